"""Prompt files: JSON Lines, one object per prompt, `{"id", "tokens": [ints]}` or `{"id", "text", "chat"?}`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InputError

PROMPT_KEYS = ("id", "tokens", "text", "chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    tokens: list
    line: int


def load_prompts(path: str, arch, tokenizer) -> list[Prompt]:
    """Read and check every prompt; raises InputError naming the file, the line and what is wrong."""
    prompts, seen = [], {}
    for number, line in _lines(path):
        if not line.strip():
            continue
        prompt = _parse_line(f"{path}:{number}", line, arch, tokenizer, number)
        if prompt.id in seen:
            raise InputError(f"{path}:{number}: id {prompt.id!r} appears more than once (lines {seen[prompt.id]} "
                             f"and {number}); ids must be unique")
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"prompt file '{path}' holds no prompts")
    return prompts


def _lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of each line. Lines end at "\n" only (JSON Lines), "\r\n" too; other Unicode line
    breaks (U+2028 ...) may stand inside a JSON string. A UTF-8 byte order mark at the start is skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InputError(f"prompt file '{path}' does not exist") from None
    except (OSError, ValueError) as exc:              # ValueError: a NUL character in the path
        raise InputError(f"prompt file {path!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            lines.append((number, raw.removesuffix(b"\r").decode("utf-8")))
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}:{number}: cannot be read as UTF-8 (byte {raw[exc.start]:#04x} at column "
                             f"{exc.start + 1}); save the prompt file as UTF-8") from None
    return lines


def _parse_line(where: str, line: str, arch, tokenizer, number: int) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:                      # e.g. an integer of more than 4300 digits (sys.int_info)
        raise InputError(f"{where}: not valid JSON for hpcinfer ({str(exc).split(':')[0]})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with \"id\" and \"tokens\" or \"text\"")
    unknown = [k for k in obj if k not in PROMPT_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(PROMPT_KEYS)}")
    pid = obj.get("id")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise InputError(f"{where}: \"id\" must be a string or an integer")
    if ("tokens" in obj) == ("text" in obj):
        raise InputError(f"{where}: give exactly one of \"tokens\" and \"text\"")
    tokens = _tokens(where, obj, arch, tokenizer)
    if not tokens:
        raise InputError(f"{where}: the prompt is empty")
    if len(tokens) >= arch.max_positions:
        raise InputError(f"{where}: the prompt has {len(tokens)} tokens; this model handles at most "
                         f"{arch.max_positions} positions, so prompts must have fewer than {arch.max_positions}")
    return Prompt(str(pid), tokens, number)


def _tokens(where: str, obj: dict, arch, tokenizer) -> list:
    if "tokens" in obj:
        tokens = obj["tokens"]
        if "chat" in obj:
            raise InputError(f"{where}: \"chat\" applies to \"text\" prompts only")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InputError(f"{where}: \"tokens\" must be a list of integers")
        return _in_vocabulary(where, tokens, arch)
    text, chat = obj["text"], obj.get("chat", False)
    if not isinstance(text, str):
        raise InputError(f"{where}: \"text\" must be a string")
    if not isinstance(chat, bool):
        raise InputError(f"{where}: \"chat\" must be true or false")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:              # JSON allows lone surrogates ("\\ud800"); tokenizers do not
        raise InputError(f"{where}: \"text\" holds a lone surrogate ({text[exc.start]!r} at character "
                         f"{exc.start + 1}), which is not Unicode text") from None
    if tokenizer is None:
        raise InputError(f"{where}: a \"text\" prompt needs a tokenizer, and the checkpoint has none; "
                         f"give \"tokens\" instead or convert a model that ships a tokenizer")
    if chat:
        if not tokenizer.chat_template:
            raise InputError(f"{where}: \"chat\": true needs a chat template, and the checkpoint has none")
        return _in_vocabulary(where, tokenizer.encode_chat(text), arch)
    return _in_vocabulary(where, tokenizer.encode(text), arch)


def _in_vocabulary(where: str, tokens: list, arch) -> list:
    bad = [t for t in tokens if not 0 <= t < arch.vocab_size]
    if bad:
        raise InputError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {arch.vocab_size})")
    return tokens
