"""Byte sizes (config.parse_bytes: an integer or a number with a unit, "512MB", "2GiB"): a size with trailing junk,
an unknown unit or a negative number is refused with one ConfigError naming the file, the key, the value and what
is allowed, in the job config and in the `hpcinfer plan` / `profile` options alike; it is never read as a prefix.
"""

from __future__ import annotations

import pytest

from hpcinfer.cli import _bytes_option
from hpcinfer.config import load_config, parse_bytes
from hpcinfer.errors import ConfigError

BYTE_KEYS = ["offload.device_memory", "offload.host_memory", "schedule.kv_offload_threshold"]
JUNK = ["2GiBs", "12 XB", "5 MB!", "1.5.0GB", "GB"]          # trailing junk, unknown unit, no number
SIZE_HINT = '"512MB" or "2GiB"'                              # the allowed forms, as the message gives them


def config_with(tmp_path, key: str, value: str) -> str:
    section, name = key.split(".")
    path = tmp_path / "job.toml"
    path.write_text('[model]\ncheckpoint = "m.h5"\n\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n\n'
                    f'[{section}]\n{name} = "{value}"\n')
    return str(path)


def refusal(path: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


@pytest.mark.parametrize("value", JUNK)
def test_a_size_with_junk_is_not_parsed_as_its_prefix(value):
    with pytest.raises(ValueError):
        parse_bytes(value)


@pytest.mark.parametrize("key", BYTE_KEYS)
@pytest.mark.parametrize("value", JUNK)
def test_a_config_size_with_junk_names_the_file_key_value_and_the_forms(tmp_path, key, value):
    path = config_with(tmp_path, key, value)
    message = refusal(path)
    for fragment in (path, key, repr(value), SIZE_HINT):
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("key", BYTE_KEYS)
def test_a_negative_config_size_names_the_key_value_and_the_bound(tmp_path, key):
    message = refusal(config_with(tmp_path, key, "-5MB"))
    for fragment in (key, "'-5MB'", ">= 0"):
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("value, words", [*[(v, ["not a number of bytes", '"16GB"']) for v in JUNK],
                                          ("-5MB", [">= 0"])])
def test_a_size_option_with_junk_names_the_option_and_value(value, words):
    with pytest.raises(ConfigError) as caught:
        _bytes_option("device-memory", value)
    message = str(caught.value)
    for fragment in ("--device-memory", repr(value), *words):
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("value, size", [("1.5GiB", 3 * 2**29), ("1.5GB", 1_500_000_000), ("2.3GB", 2_300_000_000),
                                         ("0.5KiB", 512), ("1e3", 1000), ("7B", 7), (" 2 MB ", 2_000_000)])
def test_a_fraction_with_a_unit_that_makes_whole_bytes_is_exact(value, size):
    assert parse_bytes(value) == size


@pytest.mark.parametrize("value", ["1.5B", "2.5", "1.1KiB", "0.0001KB"])
def test_a_fractional_byte_count_is_refused_not_rounded_down(value):
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_bytes(value)


@pytest.mark.parametrize("key", BYTE_KEYS)
def test_a_config_fractional_byte_count_names_the_key_value_and_the_rule(tmp_path, key):
    message = refusal(config_with(tmp_path, key, "1.5B"))
    for fragment in (key, "'1.5B'", "fractional byte count", "1.5 bytes"):
        assert fragment in message, f"{fragment!r} not in {message!r}"
