"""Errors a user can cause and fix: each carries one clear message naming the file, key or value.

Anything raised that is not an HpcinferError is a bug and is reported with its traceback.
"""


class HpcinferError(Exception):
    """Base of every user-facing error; the process exits with `exit_code`."""

    exit_code = 2


class ConfigError(HpcinferError):
    """The config file or a --set override is malformed, unknown or out of range."""


class CheckpointError(HpcinferError):
    """A checkpoint (or conversion source) is missing, unreadable or not what it claims to be."""


class InputError(HpcinferError):
    """A prompt file or a prompt in it is invalid for this model."""
