"""The tokenizer of a GGUF file: the byte-level BPE `tokenizers.Tokenizer` that transformers builds from the
`tokenizer.ggml.*` metadata (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so token ids match."""

from __future__ import annotations

from ..errors import CheckpointError
from .gguf_file import GgufFile

SUPPORTED_TOKENIZERS = ("gpt2",)  # tokenizer.ggml.model: byte-level BPE

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns by tokenizer.ggml.pre, copied from transformers (gguf_tokenizer_mapping.py
# GGUF_PRE_TOKENIZER_SPLITS). A name not listed keeps GPT-2's ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def read_tokenizer(f: GgufFile) -> dict | None:
    """Keyword arguments for CheckpointWriter.set_tokenizer, or None when the file has no tokenizer."""
    model = f.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model not in SUPPORTED_TOKENIZERS:
        raise CheckpointError(f"GGUF file '{f.path}' has a {model!r} tokenizer (tokenizer.ggml.model); the GGUF "
                              f"converter builds {', '.join(SUPPORTED_TOKENIZERS)} (byte-level BPE) tokenizers only")
    tokens = list(f.require("tokenizer.ggml.tokens"))
    merges = list(f.require("tokenizer.ggml.merges"))
    token_types = list(f.get("tokenizer.ggml.token_type") or ())
    named = {}  # bos/eos/unk/pad -> token string
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        token_id = f.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not 0 <= int(token_id) < len(tokens):
                raise CheckpointError(f"GGUF file '{f.path}': tokenizer.ggml.{key} = {token_id} is outside the "
                                      f"vocabulary of {len(tokens)} tokens")
            named[role] = tokens[int(token_id)]
    tokenizer = build_byte_level_tokenizer(
        tokens, merges, token_types, named, pre=f.get("tokenizer.ggml.pre"),
        add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(f.get("tokenizer.ggml.add_eos_token", False)))
    return {"tokenizer_json": tokenizer.to_str(), "chat_template": f.get("tokenizer.chat_template"),
            "bos_token": named.get("bos"), "eos_token": named.get("eos")}


def build_byte_level_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], named: dict,
                               pre: str | None = None, add_bos: bool = False, add_eos: bool = False):
    """The `tokenizers.Tokenizer` transformers builds for a GGUF "gpt2" vocabulary (GPT2Tokenizer + GGUF extras):
    BPE over the byte alphabet, ByteLevel pre-tokenizer and decoder, control tokens (type 3) special and
    user-defined tokens (type 4) plain added tokens, and a post-processor that adds BOS/EOS only when the file
    asks for it (tokenizer.ggml.add_bos_token / add_eos_token)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet is respelled byte by byte (as transformers does).
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()

    # A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocabulary.
    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet]
    special = control + [t for t in named.values() if t not in control]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos, eos = named.get("bos"), named.get("eos")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))
