"""The job config: defaults, --set overrides, and one clear ConfigError for every way a config can be wrong.

Every error message must name the file, the key or section at fault and what is allowed, so each case below
lists the fragments its message must hold (the file's path is checked for every file-level case).
"""

from __future__ import annotations

import pytest

from hpcinfer.config import load_config
from hpcinfer.errors import ConfigError, HpcinferError

# The smallest valid config: the required sections with their required keys, as raw TOML values.
BASE = {
    "model": {"checkpoint": '"m.h5"'},
    "generate": {"prompts": '"p.jsonl"', "output": '"o.jsonl"'},
}


def render(changes: dict | None = None, base: dict | None = None) -> str:
    """TOML text of BASE with `changes` applied: {"section.key": raw TOML value, or None to delete it}."""
    sections = {name: dict(keys) for name, keys in (BASE if base is None else base).items()}
    for dotted, value in (changes or {}).items():
        section, key = dotted.split(".", 1)
        if value is None:
            sections[section].pop(key)
        else:
            sections.setdefault(section, {})[key] = value
    return "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) + "\n"
                   for name, keys in sections.items())


@pytest.fixture
def write(tmp_path):
    def write(text: str, name: str = "job.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def config_error(path: str, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    assert isinstance(info.value, HpcinferError) and info.value.exit_code == 2
    return str(info.value)


# ---------------------------------------------------------------------------------------------- valid configs

def test_defaults_fill_in(write):
    config = load_config(write(render()))
    assert config.model.checkpoint == "m.h5" and config.model.dtype == "float32"
    assert (config.parallel.tp, config.parallel.pp) == (1, 1)
    assert (config.runtime.backend, config.runtime.threads) == ("auto", 0)
    g = config.generate
    assert (g.prompts, g.output, g.metrics) == ("p.jsonl", "o.jsonl", None)
    assert (g.max_new_tokens, g.batch_size, g.top_k, g.seed) == (32, 8, 0, 0)
    assert (g.temperature, g.top_p, g.ignore_eos) == (0.0, 1.0, False)
    assert config.path.endswith("job.toml")


def test_every_key_set_in_the_file(write):
    config = load_config(write(render({
        "model.dtype": '"bfloat16"', "parallel.tp": "4", "parallel.pp": "1", "runtime.backend": '"numpy"',
        "runtime.threads": "2", "generate.max_new_tokens": "7", "generate.batch_size": "3",
        "generate.temperature": "0.7", "generate.top_k": "20", "generate.top_p": "0.9", "generate.seed": "11",
        "generate.ignore_eos": "true", "generate.metrics": '"m.json"'})))
    assert config.model.dtype == "bfloat16" and config.parallel.tp == 4 and config.runtime.threads == 2
    g = config.generate
    assert (g.max_new_tokens, g.batch_size, g.temperature, g.top_k, g.top_p, g.seed, g.ignore_eos, g.metrics) == \
        (7, 3, 0.7, 20, 0.9, 11, True, "m.json")


def test_an_integer_is_accepted_for_a_float_and_becomes_a_float(write):
    config = load_config(write(render({"generate.temperature": "1", "generate.top_p": "1"})))
    assert config.generate.temperature == 1.0 and isinstance(config.generate.temperature, float)
    assert isinstance(config.generate.top_p, float)


def test_config_is_frozen(write):
    config = load_config(write(render()))
    with pytest.raises(AttributeError):
        config.generate.max_new_tokens = 5


@pytest.mark.parametrize("item, section, key, expected", [
    ("generate.max_new_tokens=7", "generate", "max_new_tokens", 7),                  # int
    ("generate.temperature=0.25", "generate", "temperature", 0.25),                  # float
    ("generate.ignore_eos=true", "generate", "ignore_eos", True),                    # bool
    ("generate.output=out/run 1/o.jsonl", "generate", "output", "out/run 1/o.jsonl"),  # bare string (a path)
    ('model.checkpoint="models/x.h5"', "model", "checkpoint", "models/x.h5"),        # quoted string
    ("runtime.threads = 3", "runtime", "threads", 3),                                # a section not in the file
    (" parallel.tp =2", "parallel", "tp", 2),                                        # spaces around the key
])
def test_set_overrides(write, item, section, key, expected):
    config = load_config(write(render()), [item])
    value = getattr(getattr(config, section), key)
    assert value == expected and type(value) is type(expected)


def test_later_overrides_win_and_override_the_file(write):
    path = write(render({"generate.max_new_tokens": "5"}))
    config = load_config(path, ["generate.max_new_tokens=6", "generate.max_new_tokens=9"])
    assert config.generate.max_new_tokens == 9


def test_overrides_can_supply_required_keys(write):
    path = write(render({"generate.output": None}))
    assert load_config(path, ["generate.output=o2.jsonl"]).generate.output == "o2.jsonl"


# ---------------------------------------------------------------------------------------------- --set errors

@pytest.mark.parametrize("item", [
    "generate.max_new_tokens",        # no '='
    "max_new_tokens=5",               # no section
    ".max_new_tokens=5",              # empty section
    "generate.=5",                    # empty key
    "=5",
])
def test_malformed_set_is_refused(write, item):
    message = config_error(write(render()), [item])
    assert repr(item) in message and "section.key=value" in message


@pytest.mark.parametrize("item, fragments", [
    ("generate.max_new_token=5", ["unknown key 'max_new_token'", "[generate]", "max_new_tokens"]),
    ("gen.max_new_tokens=5", ["unknown section [gen]", "generate"]),
    ("generate.max_new_tokens=five", ["generate.max_new_tokens = 'five'", "an integer"]),
    ("generate.max_new_tokens=0", ["generate.max_new_tokens = 0", ">= 1"]),
    ("model.dtype=int3", ["model.dtype = 'int3'", "float32, float16, bfloat16"]),
])
def test_overrides_are_validated_like_the_file(write, item, fragments):
    path = write(render())
    message = config_error(path, [item])
    assert path in message
    for fragment in fragments:
        assert fragment in message


def test_set_into_a_value_that_is_not_a_section(write):
    path = write('model = "m.h5"\n' + render(base={"generate": BASE["generate"]}))
    message = config_error(path, ["model.checkpoint=x.h5"])
    assert "[model] is not a section" in message


# --------------------------------------------------------------------------------------------- file errors

def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    message = config_error(path)
    assert path in message and "does not exist" in message


def test_a_directory_is_not_a_config(tmp_path):
    message = config_error(str(tmp_path))
    assert str(tmp_path) in message and "cannot be read" in message


@pytest.mark.parametrize("text", [
    "[model\ncheckpoint = 'm.h5'\n",                      # unclosed table header
    "[model]\ncheckpoint = m.h5\n",                       # unquoted string
    "[model]\ncheckpoint = 'a'\ncheckpoint = 'b'\n",      # duplicate key
])
def test_malformed_toml(write, text):
    path = write(text)
    message = config_error(path)
    assert path in message and "not valid TOML" in message and "line" in message


def test_unknown_section(write):
    path = write(render() + "[generation]\nseed = 1\n")
    message = config_error(path)
    assert path in message and "unknown section [generation]" in message
    assert "model, parallel, schedule, moe, offload, runtime, generate" in message


@pytest.mark.parametrize("missing", ["model", "generate"])
def test_missing_required_section(write, missing):
    path = write(render(base={name: keys for name, keys in BASE.items() if name != missing}))
    message = config_error(path)
    assert path in message and f"missing section [{missing}]" in message


def test_a_section_given_as_a_value(write):
    path = write('parallel = 2\n' + render())
    message = config_error(path)
    assert path in message and "'parallel' must be a section [parallel]" in message


# (changes to BASE, fragments the message must hold besides the file's path)
KEY_ERRORS = {
    "unknown key (typo)": ({"generate.max_new_token": "8"},
                           ["unknown key 'max_new_token' in [generate]", "allowed keys:", "max_new_tokens"]),
    "unknown key in an optional section": ({"parallel.dp": "2"},
                                           ["unknown key 'dp' in [parallel]", "tp, pp"]),
    "missing model.checkpoint": ({"model.checkpoint": None}, ["[model] needs exactly one of 'checkpoint'", "preset"]),
    "missing generate.prompts": ({"generate.prompts": None}, ["[generate]", "required key 'prompts'"]),
    "missing generate.output": ({"generate.output": None}, ["[generate]", "required key 'output'"]),
    "string for an int": ({"parallel.tp": '"2"'}, ["parallel.tp = '2'", "must be an integer"]),
    "float for an int": ({"generate.max_new_tokens": "8.0"},
                         ["generate.max_new_tokens = 8.0", "must be an integer"]),
    "int for a bool": ({"generate.ignore_eos": "1"}, ["generate.ignore_eos = 1", "must be true or false"]),
    "bool for an int": ({"parallel.tp": "true"}, ["parallel.tp = True", "must be an integer"]),
    "bool for a float": ({"generate.temperature": "false"},
                         ["generate.temperature = False", "must be a number"]),
    "int for a string": ({"model.checkpoint": "5"}, ["model.checkpoint = 5", "must be a string"]),
    "table for an int": ({"generate.seed": "{ a = 1 }"}, ["generate.seed = {'a': 1}", "must be an integer"]),
    "tp = 0": ({"parallel.tp": "0"}, ["parallel.tp = 0", "must be >= 1"]),
    "threads = -1": ({"runtime.threads": "-1"}, ["runtime.threads = -1", "must be >= 0"]),
    "top_p = 0": ({"generate.top_p": "0"}, ["generate.top_p = 0.0", "must be in (0, 1]"]),
    "top_p = 1.5": ({"generate.top_p": "1.5"}, ["generate.top_p = 1.5", "must be in (0, 1]"]),
    "temperature = -1": ({"generate.temperature": "-1"}, ["generate.temperature = -1.0", "must be >= 0"]),
    "max_new_tokens = 0": ({"generate.max_new_tokens": "0"}, ["generate.max_new_tokens = 0", "must be >= 1"]),
    "batch_size = 0": ({"generate.batch_size": "0"}, ["generate.batch_size = 0", "must be >= 1"]),
    "top_k = -1": ({"generate.top_k": "-1"}, ["generate.top_k = -1", "must be >= 0"]),
    "dtype = int3": ({"model.dtype": '"int3"'},
                     ["model.dtype = 'int3'", "not allowed", "float32, float16, bfloat16"]),
    "backend = tpu": ({"runtime.backend": '"tpu"'}, ["runtime.backend = 'tpu'", "auto, numpy, cupy"]),
    "ranks_per_node = -1": ({"parallel.ranks_per_node": "-1"}, ["parallel.ranks_per_node = -1", "must be >= 0"]),
    "prompt micro-batches above the batch": ({"schedule.prompt_micro_batches": "99"},
                                             ["schedule.prompt_micro_batches = 99", "batch_size"]),
    "gen micro-batches below 0": ({"schedule.gen_micro_batches": "-1"},
                                  ["schedule.gen_micro_batches = -1", "must be >= 0"]),
    "offload threshold unit": ({"schedule.kv_offload_threshold": '"12 parsecs"'},
                               ["schedule.kv_offload_threshold", "512MB"]),
    "offload threshold type": ({"schedule.kv_offload_threshold": "1.5"},
                               ["schedule.kv_offload_threshold = 1.5", "number of bytes"]),
    "fractional bytes": ({"offload.device_memory": '"1.5B"'},
                         ["offload.device_memory = '1.5B'", "fractional byte count", "whole bytes"]),
    "quantize mode": ({"model.quantize": '"int3"'},
                      ["model.quantize = 'int3'", "not allowed", "none, int8, int4, asym8"]),
    "cpu_attention over a device cache": (
        {"offload.schedule": '"zigzag"', "offload.cpu_attention": "true"},
        ["offload.cpu_attention = true", "offload.cache_gpu = 100", "nothing", "cache_gpu < 100",
         "cache_gpu = 0, cache_cpu = 100", "cpu_attention = false"]),
}


@pytest.mark.parametrize("text, expected", [(0, 0), (4096, 4096), ("512MB", 512 * 10**6), ("2GiB", 2 * 2**30),
                                            ("1.5 kB", 1500), ("64", 64)])
def test_byte_sizes_parse(text, expected):
    from hpcinfer.config import parse_bytes

    assert parse_bytes(text) == expected


@pytest.mark.parametrize("changes, fragments", KEY_ERRORS.values(), ids=KEY_ERRORS.keys())
def test_key_errors_name_file_key_and_what_is_allowed(write, changes, fragments):
    path = write(render(changes))
    message = config_error(path)
    assert message.startswith(path), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("reader, what", [("hpcinfer.offload.profile:load_profile", "profile file"),
                                          ("hpcinfer.bench.suites.config:load_bench_config", "bench config"),
                                          ("hpcinfer.config:load_config", "config file")])
@pytest.mark.parametrize("content, fragment", [(b"a = 1\n\xff\n", "is not UTF-8 text"),
                                               (b"a = " + b"9" * 5000 + b"\n", "is not valid TOML for hpcinfer"),
                                               (b"a = [1,\n", "is not valid TOML")])
def test_every_toml_reader_turns_bad_files_into_one_clear_error(tmp_path, reader, what, content, fragment):
    import importlib

    module, name = reader.split(":")
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        getattr(importlib.import_module(module), name)(str(path))
    assert f"{what} '{path}'" in str(err.value) and fragment in str(err.value)
