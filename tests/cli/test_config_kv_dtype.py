"""[model] kv_dtype: a float KV cache's storage on the GPU. `auto` follows the model's dtype when it is float16 or
bfloat16 and the job keeps every KV row on the device, else float32; an explicit half type is refused where the
cache goes to host memory or the backend is NumPy (one clear error naming the file and key)."""

from __future__ import annotations

import pytest

from hpcinfer.config import gpu_kv_dtype, load_config
from hpcinfer.errors import ConfigError

BASE = '[model]\ncheckpoint = "m.h5"\n{model}\n[generate]\nprompts = "p.jsonl"\noutput = "o.jsonl"\n{rest}'


def config(tmp_path, model: str = "", rest: str = ""):
    path = tmp_path / "job.toml"
    path.write_text(BASE.format(model=model, rest=rest))
    return load_config(str(path))


@pytest.mark.parametrize("model, rest, want", [
    ("", "", "float32"),                                                          # float32 weights
    ('dtype = "float16"', "", "float16"),                                         # the model's dtype
    ('dtype = "bfloat16"', "", "bfloat16"),
    ('dtype = "float16"', "[schedule]\nkv_offload_threshold = \"1GiB\"\n", "float32"),   # rows go to the host
    ('dtype = "float16"', '[offload]\nschedule = "zigzag"\ncache_gpu = 50\ncache_cpu = 50\n', "float32"),
    ('dtype = "float16"\nkv_dtype = "float32"', "", "float32"),                   # float32 stays a choice
    ('kv_dtype = "bfloat16"', "", "bfloat16"),                                     # explicit, any weights
])
def test_the_gpu_kv_dtype(tmp_path, model, rest, want):
    assert gpu_kv_dtype(config(tmp_path, model, rest)) == want


@pytest.mark.parametrize("model, rest, fragments", [
    ('kv_dtype = "float16"', '[runtime]\nbackend = "numpy"\n', ["model.kv_dtype", "NumPy backend", "float32"]),
    ('kv_dtype = "bfloat16"', "[schedule]\nkv_offload_threshold = \"1GiB\"\n",
     ["model.kv_dtype", "host memory", "float32"]),
    ('kv_dtype = "float8"', "", ["kv_dtype", "float16"]),
])
def test_refused_choices_say_why(tmp_path, model, rest, fragments):
    with pytest.raises(ConfigError) as err:
        config(tmp_path, model, rest)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert "job.toml" in str(err.value)
