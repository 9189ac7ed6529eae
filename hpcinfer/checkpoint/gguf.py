"""Convert a llama.cpp GGUF file (Llama architecture) into an hpcinfer checkpoint.

    arch = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.h5", dtype="float32")

The `gguf` reader memory-maps the file; tensors are dequantized to float32 one at a time, put into our canonical
layout and written, so memory stays at about one tensor. Three things differ from a Hugging Face checkpoint:

- Shapes: GGUF lists dimensions fastest-first (`ne`), numpy slowest-first. `ReaderTensor.shape` is the `ne` order
  (token_embd shows [D, V]); `ReaderTensor.data` and `dequantize` give the numpy order ([V, D]), which for a matrix
  is nn.Linear's [out, in].
- Rotary layout: llama.cpp's converter permutes the rows of Q and K within each head (HF rotates half-and-half,
  llama.cpp rotates adjacent pairs); `_unpermute_rows` undoes it.
- Tokenizer: a GGUF has no tokenizer.json, only metadata under `tokenizer.ggml.*`. We rebuild the same `tokenizers`
  object that transformers builds from it (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so that token
  ids match `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import CheckpointError
from ..model.arch import ModelArch, tensor_shapes
from .writer import CheckpointWriter

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TOKENIZERS = ("gpt2",)  # tokenizer.ggml.model: byte-level BPE

# GGUF tensor names (llama.cpp's) -> canonical names (model.arch.tensor_shapes).
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed.tokens",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}
# Row-parallel matrices are stored [in, out]: the transpose of nn.Linear's (and GGUF's numpy-order) [out, in].
_TRANSPOSED = ("attn.o.weight", "mlp.down.weight")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(src: str, out: str, dtype: str = "float32") -> ModelArch:
    """Convert the GGUF file `src` into the checkpoint `out` (written atomically); return its architecture."""
    gguf_file = _GgufFile(src)
    arch = _read_arch(gguf_file)
    sources = _map_tensors(gguf_file, arch)
    tokenizer = _read_tokenizer(gguf_file)
    with CheckpointWriter(out, arch, dtype) as writer:
        for name, tensor in sources.items():
            writer.add(name, _to_canonical(name, _dequantize(gguf_file, tensor), arch))
        if tokenizer is not None:
            writer.set_tokenizer(**tokenizer)
    return arch


class _GgufFile:
    """The open reader plus the path, so that every error can name the file."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise CheckpointError(f"GGUF file '{path}' does not exist")
        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file '{path}' is not a file")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise CheckpointError(f"GGUF file '{path}' cannot be read ({exc.strerror})") from None
        if magic != b"GGUF":
            raise CheckpointError(f"'{path}' is not a GGUF file (it starts with {magic!r}; a GGUF file starts "
                                  f"with b'GGUF')")
        try:
            import gguf
        except ImportError:
            raise CheckpointError("converting a GGUF file needs the `gguf` package: pip install gguf") from None
        self.gguf = gguf
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, struct/numpy errors on a damaged file
            raise CheckpointError(f"GGUF file '{path}' is damaged or of an unsupported version ({exc})") from None

    def get(self, key: str, default=None):
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"GGUF file '{self.path}' lacks the metadata key '{key}'")
        return value


def _float32_value(x) -> float:
    """GGUF floats are float32: give back the shortest decimal that rounds to it (1e-05, not 9.999999747e-06)."""
    return float(str(np.float32(x)))


def _read_arch(f: _GgufFile) -> ModelArch:
    name = f.require("general.architecture")
    if name not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"GGUF file '{f.path}' holds a {name!r} model; the GGUF converter supports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)} (other families convert from Hugging Face "
                              f"folders)")
    p = name + "."
    if f.get(p + "expert_count", 0):
        raise CheckpointError(f"GGUF file '{f.path}' is a mixture-of-experts {name} model "
                              f"({f.get(p + 'expert_count')} experts); the GGUF converter supports dense models only")
    scaling = f.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise CheckpointError(f"GGUF file '{f.path}' uses rope scaling {scaling!r}, which hpcinfer does not support")
    hidden = int(f.require(p + "embedding_length"))
    heads = int(f.require(p + "attention.head_count"))
    kv_heads = int(f.get(p + "attention.head_count_kv", heads))
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    value_dim = int(f.get(p + "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise CheckpointError(f"GGUF file '{f.path}' has key length {head_dim} but value length {value_dim}; "
                              f"hpcinfer needs them equal")
    embed = _find_tensor(f, "token_embd.weight")
    vocab = int(embed.shape[-1])  # ne order: [D, V]
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos_ids = []  # llama.cpp also ends generation on the end-of-turn and end-of-message tokens
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = f.get(key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    try:
        return ModelArch(
            family=name,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(f.require(p + "block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(f.require(p + "feed_forward_length")),
            max_positions=int(f.require(p + "context_length")),
            norm="rmsnorm",
            norm_eps=_float32_value(f.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            position="rotary",
            rotary_dim=int(f.get(p + "rope.dimension_count", head_dim)),
            rope_theta=_float32_value(f.get(p + "rope.freq_base", 10000.0)),
            activation="silu",
            gated_mlp=True,
            tied_embeddings=_find_tensor(f, "output.weight", required=False) is None,
            bos_token_id=-1 if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except ValueError as exc:
        raise CheckpointError(f"GGUF file '{f.path}' describes an invalid {name} model: {exc}") from None


def _find_tensor(f: _GgufFile, name: str, required: bool = True):
    for tensor in f.reader.tensors:
        if tensor.name == name:
            return tensor
    if required:
        raise CheckpointError(f"GGUF file '{f.path}' has no tensor '{name}'")
    return None


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)  # blk.{i}.{rest}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _map_tensors(f: _GgufFile, arch: ModelArch) -> dict:
    """Canonical name -> GGUF tensor, checking names, shapes and quantization types before anything is written."""
    expected = tensor_shapes(arch)
    sources, probed = {}, set()
    for tensor in f.reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise CheckpointError(f"GGUF file '{f.path}' scales its rotary frequencies (tensor 'rope_freqs.weight', "
                                  f"Llama 3.1 style); hpcinfer does not support rope scaling")
        name = _canonical_name(tensor.name)
        if name is None or name not in expected:
            raise CheckpointError(f"GGUF file '{f.path}' has tensor '{tensor.name}', which a {arch.family} model "
                                  f"with this configuration does not have")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ne order -> numpy order
        if name.endswith(_TRANSPOSED):
            shape = shape[::-1]
        if shape != expected[name]:
            raise CheckpointError(f"GGUF file '{f.path}': tensor '{tensor.name}' has shape {list(shape)} (as stored "
                                  f"here), expected {list(expected[name])}")
        if tensor.tensor_type not in probed:  # dequantize a sliver of one tensor per type: fail before writing
            _dequantize(f, tensor, probe=True)
            probed.add(tensor.tensor_type)
        sources[name] = tensor
    missing = [n for n in expected if n not in sources]
    if missing:
        raise CheckpointError(f"GGUF file '{f.path}' lacks the tensor for '{missing[0]}' "
                              f"({len(missing)} of {len(expected)} missing)")
    return sources


def _dequantize(f: _GgufFile, tensor, probe: bool = False) -> np.ndarray:
    """float32 array in numpy order (slowest dimension first)."""
    data = tensor.data[:1] if probe and tensor.data.ndim > 1 else tensor.data
    try:
        values = f.gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"GGUF file '{f.path}': tensor '{tensor.name}' is stored as "
                              f"{tensor.tensor_type.name}, which the gguf package cannot dequantize; "
                              f"re-quantize the model to a common type (F32, F16, BF16, Q8_0, Q4_K ...)") from None
    if probe:
        return values
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, 2) back to (2, half) order."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _to_canonical(name: str, w: np.ndarray, arch: ModelArch) -> np.ndarray:
    if name.endswith("attn.q.weight"):
        return _unpermute_rows(w, arch.num_heads)
    if name.endswith("attn.k.weight"):
        return _unpermute_rows(w, arch.num_kv_heads)
    if name.endswith(_TRANSPOSED):
        return w.T
    return w


# ----------------------------------------------------------------------------------------------- tokenizer

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


def _read_tokenizer(f: _GgufFile) -> dict | None:
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
