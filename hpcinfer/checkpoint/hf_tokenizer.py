"""The tokenizer of a Hugging Face model folder: tokenizer.json (or one transformers builds from older vocabulary
files), the chat template and the bos/eos token strings."""

from __future__ import annotations

import json
import os

from .hf_weights import read_json


def tokenizer_files(folder: str, bos_id: int, eos_ids: tuple) -> tuple | None:
    """(tokenizer.json text, chat template, bos string, eos string), or None when the folder has no tokenizer."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = _tokenizer_json_via_transformers(folder)
        if text is None:
            return None
    config = read_json(os.path.join(folder, "tokenizer_config.json"), missing_ok=True)
    template = None
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    else:
        template = config.get("chat_template") or \
            read_json(os.path.join(folder, "chat_template.json"), missing_ok=True).get("chat_template")
        if isinstance(template, list):        # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
    vocab = _id_to_token(text)
    bos = _token_string(config.get("bos_token")) or vocab.get(bos_id)
    eos = _token_string(config.get("eos_token")) or (vocab.get(eos_ids[0]) if eos_ids else None)
    return text, template, bos, eos


def _tokenizer_json_via_transformers(folder: str) -> str | None:
    """Older folders (e.g. facebook/opt-125m) ship only vocab.json + merges.txt or a SentencePiece model: let
    transformers, when installed, build the fast tokenizer and serialize it. The tokenizer is optional, so any
    failure here means "no tokenizer stored", not a failed conversion."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("vocab.json", "tokenizer.model", "vocab.txt")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder).backend_tokenizer.to_str()
    except Exception:   # noqa: BLE001 - ImportError, missing files, slow-only tokenizers, ...
        return None


def _token_string(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as serialized AddedTokens {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_to_token(tokenizer_json: str) -> dict[int, str]:
    """Added (special) tokens and, for vocabularies stored as a mapping, every token: id -> string."""
    try:
        data = json.loads(tokenizer_json)
    except ValueError:
        return {}
    table: dict[int, str] = {}
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        table.update({int(i): t for t, i in vocab.items()})
    for token in data.get("added_tokens") or []:
        table[int(token["id"])] = token["content"]
    return table

