"""Property-based tests (hypothesis) of what users type: the config parser and the prompt reader.

Whatever the bytes, `load_config` returns a valid Config or raises one ConfigError naming the file or the --set item,
and `load_prompts` returns prompts or raises one InputError naming the file (and line); never another exception.
A valid Config holds exactly what the document and the --set items said, key by key, and the default of every key
they left out.
Runs are bounded and derandomized, so CI sees the same examples every time.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from hpcinfer.arch import ModelArch
from hpcinfer.config import JOB_SECTIONS, SECTIONS, Config, load_config
from hpcinfer.errors import ConfigError, InputError
from hpcinfer.generate.prompts import load_prompts
from hpcinfer.generate.tokenizer import TextTokenizer

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VOCAB, POSITIONS = 50, 32
BASE = '[model]\ncheckpoint = "m.h5"\n\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n'


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """write(data: bytes | str) -> path of a file holding it (one file, rewritten per example)."""
    path = tmp_path_factory.mktemp("fuzz") / "input"

    def write(data) -> str:
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
        return str(path)

    return write


def config_or_error(path: str, overrides=()) -> Config | None:
    try:
        return load_config(path, list(overrides))
    except ConfigError as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message, message            # one line
        assert path in message or "--set" in message, message
        return None


def assert_holds(config: Config, path: str, document: dict) -> None:
    """`config` holds exactly what the parsed `document` says: each key given, as given (an integer given to a
    float key as that float), and each key left out at its default; a job section not given is None."""
    assert config.path == path
    for name, cls in SECTIONS.items():
        section = getattr(config, name)
        if name in JOB_SECTIONS and name not in document:
            assert section is None, name
            continue
        given = document.get(name, {})
        for f in dataclasses.fields(cls):
            want = given.get(f.name, f.default)
            if f.name in given and f.type.startswith("float"):
                want = float(want)
            got = getattr(section, f.name)
            assert got == want and type(got) is type(want), f"{name}.{f.name} = {got!r}, the document said {want!r}"


# ---------------------------------------------------------------------------------------------- config

@FUZZ
@given(st.binary(max_size=400))
@example(b'[model]\ncheckpoint = "\xe9"\n')                                  # not UTF-8
@example(b"v = " + b"[" * 3000 + b"]" * 3000)                                # nested past the recursion limit
@example(b"[model]\ncheckpoint = 1" + b"0" * 5000)                          # an integer over 4300 digits
def test_config_from_any_bytes(files, data):
    config_or_error(files(data))


def _toml_value():
    scalars = st.one_of(st.booleans(), st.integers(), st.integers(min_value=-2**63, max_value=2**63 - 1),
                        st.floats(), st.text(max_size=12), st.sampled_from(["float32", "numpy", "row", "512MB",
                                                                            "1e400GB", "inf", "-1GiB", "tiny"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=4)


def _toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_literal, value)) + "]"
    if isinstance(value, str):
        return json.dumps(value)                           # a TOML basic string is a JSON string
    return str(value)


KNOWN_KEYS = [(name, f) for name, cls in SECTIONS.items() for f in cls.__dataclass_fields__]


def _plausible(section: str, key: str):
    """Values the key may well take: one of its choices, or a small value of its type (the checks of a key's range
    and across keys may still refuse it). Without these, hardly any drawn document is valid, and what a valid
    config holds would go unchecked."""
    f = SECTIONS[section].__dataclass_fields__[key]
    if f.metadata["choices"]:
        return st.sampled_from(f.metadata["choices"])
    return {"bool": st.booleans(), "int": st.integers(0, 8),
            "int | str": st.one_of(st.integers(0, 2**40), st.sampled_from(["512MB", "2GiB", "1.5KB", "0"]))}.get(
        f.type, st.one_of(st.integers(0, 2), st.floats(0, 1)) if f.type.startswith("float")
        else st.sampled_from(["m.h5", "out/o.jsonl", "tiny-dense"]))


@st.composite
def toml_documents(draw) -> str:
    """The base job with some keys set: mostly known section/key pairs, to plausible or arbitrary values, and some
    unknown ones (about a fifth of the documents drawn are valid)."""
    lines = {}
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 9)):
            section, key = draw(st.sampled_from(KNOWN_KEYS))
            value = draw(_plausible(section, key) if draw(st.integers(0, 4)) else _toml_value())
        else:
            section = draw(st.sampled_from(list(SECTIONS) + ["extra"]))
            key, value = draw(st.text("abcdefgh_", min_size=1, max_size=8)), draw(_toml_value())
        lines.setdefault(section, {})[key] = _toml_literal(value)
    base = {"model": {"checkpoint": '"m.h5"'}, "generate": {"prompts": '"p.jsonl"', "output": '"o.jsonl"'}}
    for section, values in base.items():
        for key, value in values.items():
            lines.setdefault(section, {}).setdefault(key, value)
    return "".join(f"[{section}]\n" + "".join(f"{json.dumps(k)} = {v}\n" for k, v in keys.items()) + "\n"
                   for section, keys in lines.items())


@FUZZ
@given(toml_documents())
@example('[model]\n"checkpoint" = "m.h5"\n"dtype" = "bfloat16"\n"quantize_group" = 32\n\n'
         '[generate]\n"prompts" = "p.jsonl"\n"output" = "o.jsonl"\n"temperature" = 1\n"top_p" = 0.5\n\n'
         '[offload]\n"device_memory" = "512MB"\n"host_memory" = 4096\n\n[runtime]\n"comm_timeout" = 30\n')
def test_config_from_toml_documents(files, text):
    path = files(text)
    config = config_or_error(path)
    if config is not None:                                 # a valid config holds what the document said
        assert_holds(config, path, tomllib.loads(text))


@FUZZ
@given(st.lists(st.one_of(st.text(max_size=30),
                          st.builds(lambda k, v: f"{k[0]}.{k[1]}={v}", st.sampled_from(KNOWN_KEYS),
                                    st.one_of(st.text(max_size=12), _toml_value().map(_toml_literal))),
                          st.sampled_from(KNOWN_KEYS).flatmap(lambda k: _plausible(*k).map(
                              lambda v: f"{k[0]}.{k[1]}={_toml_literal(v)}"))),
                max_size=4))
@example(["generate.max_new_tokens=" + "[" * 3000])
@example(["generate.temperature=1" + "0" * 400])
@example(["offload.device_memory=1e400GB"])
def test_config_overrides(files, overrides):
    path = files(BASE)
    config = config_or_error(path, overrides)
    if config is not None:                                 # ... and the --set items, the last one of a key winning
        document = tomllib.loads(BASE)
        for item in overrides:
            key, _, text = item.partition("=")
            section, _, name = key.strip().partition(".")
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                value = text                               # a bare string, as --set takes a path
            document.setdefault(section, {})[name] = value
        assert_holds(config, path, document)


def test_non_finite_numbers_are_refused(files):
    for item, fragment in (("generate.temperature=nan", "finite"), ("generate.top_p=inf", "finite"),
                           ("offload.host_memory=\"1e400GB\"", "number of bytes")):
        with pytest.raises(ConfigError) as info:
            load_config(files(BASE), [item])
        assert fragment in str(info.value) and item.split("=")[0] in str(info.value)


# ---------------------------------------------------------------------------------------------- prompts

@pytest.fixture(scope="module")
def arch():
    return ModelArch(family="test", vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, max_positions=POSITIONS)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "héllo": 3, "日本": 4},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return TextTokenizer(tok.to_str())


def prompts_or_error(path: str, arch, tokenizer):
    try:
        return load_prompts(path, arch, tokenizer)
    except InputError as exc:
        assert str(exc).strip() and "\n" not in str(exc) and path in str(exc), str(exc)
        return None


@FUZZ
@given(st.binary(max_size=300))
@example(b'{"id": "a", "tokens": [1]}\n{"id": "b", "tokens": [2]')        # no trailing newline
@example(b'{"id": "caf\xe9", "tokens": [1]}\n')                             # not UTF-8
@example(b'\xef\xbb\xbf{"id": "bom", "tokens": [1]}\n')                      # a byte order mark
@example(b'{"id": 1' + b"0" * 5000 + b', "tokens": [1]}\n')                 # a huge id
@example(b'{"id": "s", "text": "a \\ud800 b"}\n')                           # a lone surrogate
def test_prompts_from_any_bytes(files, arch, tokenizer, data):
    prompts_or_error(files(data), arch, tokenizer)


def _prompt_object():
    ids = st.one_of(st.text(max_size=8), st.integers(), st.integers(min_value=10**30), st.none(), st.floats())
    tokens = st.lists(st.one_of(st.integers(-5, VOCAB + 5), st.integers(), st.booleans(), st.floats()),
                      max_size=POSITIONS + 2)
    text = st.text(max_size=20) | st.sampled_from(["hello world", "héllo 日本", "", "\u2028", "a\ud800b"])
    body = st.one_of(st.fixed_dictionaries({"id": ids, "tokens": tokens}),
                     st.fixed_dictionaries({"id": ids, "text": text}, optional={"chat": st.booleans()}),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
    return st.one_of(body, st.lists(st.integers(), max_size=2), st.text(max_size=5), st.integers())


@FUZZ
@given(st.lists(st.one_of(_prompt_object().map(lambda o: json.dumps(o, ensure_ascii=False)),
                          st.sampled_from(["", "  ", "\t"])), max_size=8),
       st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_prompt_files_line_by_line(files, arch, tokenizer, lines, newline, trailing):
    path = files(newline.join(lines) + (newline if trailing else ""))
    prompts = prompts_or_error(path, arch, tokenizer)
    if prompts is None:
        return
    filled = [i + 1 for i, line in enumerate(lines) if line.strip()]
    assert [p.line for p in prompts] == filled                  # every prompt line, in order, numbered right
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.tokens and all(0 <= t < VOCAB for t in p.tokens) and len(p.tokens) < POSITIONS


@FUZZ
@given(st.lists(st.one_of(st.text(min_size=1, max_size=6), st.integers()), min_size=2, max_size=6, unique_by=str),
       st.data())
def test_duplicate_ids_name_both_lines(files, arch, ids, data):
    first = data.draw(st.integers(0, len(ids) - 1))
    again = data.draw(st.integers(first + 1, len(ids)))
    ids = ids[:again] + [ids[first]] + ids[again:]
    lines = [json.dumps({"id": i, "tokens": [1]}) for i in ids]
    with pytest.raises(InputError) as info:
        load_prompts(files("\n".join(lines)), arch, None)
    message = str(info.value)
    assert f":{again + 1}: " in message and f"lines {first + 1} and {again + 1}" in message


def test_unicode_line_separators_inside_a_string(files, arch, tokenizer):
    text = json.dumps({"id": "u", "text": "hello\u2028world\x85日本"}, ensure_ascii=False)
    prompts = load_prompts(files(text + "\n"), arch, tokenizer)
    assert [p.line for p in prompts] == [1] and prompts[0].tokens[0] == 1


def test_nul_in_a_path(files, arch):
    with pytest.raises(ConfigError, match="generate.output = .* without NUL"):
        load_config(files(BASE), ['generate.output="a\\u0000b"'])
    with pytest.raises(InputError, match="cannot be read"):
        load_prompts("in\0put.jsonl", arch, None)


def test_verify_needs_a_checkpoint(files):
    assert load_config(files(BASE), ["model.verify=true"]).model.verify is True
    with pytest.raises(ConfigError, match="verify = true checks a checkpoint file; preset 'tiny-dense'"):
        load_config(files('[model]\npreset = "tiny-dense"\nverify = true\n[generate]\nprompts = "p"\noutput = "o"\n'))
