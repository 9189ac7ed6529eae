"""Embedding inputs: JSON Lines, one object per input, `{"id", "text"}` or `{"id", "tokens": [ints]}`.

Texts go through the checkpoint's tokenizer with its post-processor, so BERT inputs get [CLS] ... [SEP] (an empty
text gives just those two) and RoBERTa ones <s> ... </s>. Token lists are used as given (add the special tokens
yourself). An input longer than max_length is cut (texts keep their closing special token, as the Hugging Face
tokenizer's own truncation does) and counted, or, with truncate = false, is an error naming its line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InputError

INPUT_KEYS = ("id", "text", "tokens")


@dataclass(frozen=True)
class EmbedInput:
    id: str
    tokens: list
    line: int
    truncated: bool = False


class EncoderTokenizer:
    """The checkpoint's tokenizer.json, with the padding and truncation it may carry switched off (padding is the
    batch's business; truncation is decided by [embed] max_length and truncate)."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        if max_length is None:
            return self.tokenizer.encode(text).ids
        self.tokenizer.enable_truncation(max_length)
        try:
            return self.tokenizer.encode(text).ids
        finally:
            self.tokenizer.no_truncation()


def load_inputs(path: str, arch, tokenizer: EncoderTokenizer | None, max_length: int,
                truncate: bool) -> list[EmbedInput]:
    """Read, tokenize and check every input; raises InputError naming the file, the line and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InputError(f"[embed] inputs file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"[embed] inputs file '{path}' cannot be read: {exc}") from None
    inputs, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        item = _parse_line(f"{path}:{number}", line, number, arch, tokenizer, max_length, truncate)
        if item.id in seen:
            raise InputError(f"{path}:{number}: id {item.id!r} appears more than once")
        seen.add(item.id)
        inputs.append(item)
    if not inputs:
        raise InputError(f"[embed] inputs file '{path}' holds no inputs")
    return inputs


def _parse_line(where: str, line: str, number: int, arch, tokenizer, max_length: int, truncate: bool):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with \"id\" and \"text\" or \"tokens\"")
    unknown = [k for k in obj if k not in INPUT_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(INPUT_KEYS)}")
    iid = obj.get("id")
    if not isinstance(iid, (str, int)) or isinstance(iid, bool):
        raise InputError(f"{where}: \"id\" must be a string or an integer")
    if ("tokens" in obj) == ("text" in obj):
        raise InputError(f"{where}: give exactly one of \"text\" and \"tokens\"")
    tokens = _tokens(where, obj, arch, tokenizer)
    if not tokens:
        raise InputError(f"{where}: the input has no tokens (empty \"tokens\", or an empty text with a tokenizer "
                         f"that adds no special tokens); an input needs at least one token")
    if len(tokens) <= max_length:
        return EmbedInput(str(iid), tokens, number)
    if not truncate:
        raise InputError(f"{where}: the input has {len(tokens)} tokens, more than [embed] max_length = "
                         f"{max_length}; set truncate = true to cut it, or raise max_length (at most the model's "
                         f"{arch.max_positions} positions)")
    cut = tokenizer.encode(obj["text"], max_length) if "text" in obj else tokens[:max_length]
    if len(cut) > max_length:            # the tokenizer does not truncate below its special tokens: cut plainly
        cut = tokens[:max_length]
    return EmbedInput(str(iid), cut, number, truncated=True)


def _tokens(where: str, obj: dict, arch, tokenizer) -> list:
    if "tokens" in obj:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InputError(f"{where}: \"tokens\" must be a list of integers")
    else:
        if not isinstance(obj["text"], str):
            raise InputError(f"{where}: \"text\" must be a string")
        if tokenizer is None:
            raise InputError(f"{where}: a \"text\" input needs a tokenizer, and the checkpoint has none; give "
                             f"\"tokens\" instead or convert a model folder that ships tokenizer.json")
        tokens = tokenizer.encode(obj["text"])
    bad = [t for t in tokens if not 0 <= t < arch.vocab_size]
    if bad:
        raise InputError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {arch.vocab_size})")
    return tokens
