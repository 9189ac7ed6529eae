"""`hpcinfer plan` prints a plan that runs as printed: its TOML (the `[offload]` and `[generate]` sections), read
by the project's config loader, passes the runtime's budget check (budget.check_budgets), places the layers the
comments say (tiers.place_layers), and the cost model's peak for it is the runtime's plan (budget.plan_bytes)
plus only what the budget check does not count (CostTerms.uncounted: work(b) on the device and the disk
layers' streaming window in host memory; both count CPU attention's host scratch), so the printed peak is an
upper bound of what the runtime allocates, equal to it but for those named terms.

Cases: the tiny test model and a pyramid-MoE one (layers of different sizes) with weights spilled to disk, the
KV cache split or on the host, float32 / float16 / bfloat16, int4 weights and an int8 KV cache, and the
audit's gpt-neox-20b in float16 on the a100 preset with 36 GB of device and 64 GB of host memory (which used to
plan 36.48 GB of device and 87 GB of host: the float cache counted at 2 bytes, the weights as a fraction of a
layer).
"""

from __future__ import annotations

import tomllib
import types

import pytest

from hpcinfer.checkpoint.presets import PRESETS as MODELS
from hpcinfer.cli import main
from hpcinfer.config import load_config
from hpcinfer.offload.budget import check_budgets, kv_format_of, plan_bytes
from hpcinfer.offload.cost_model import TIERS, CostModel
from hpcinfer.offload.policy import Policy
from hpcinfer.offload.profile import PRESETS, save_profile
from hpcinfer.offload.tiers import place_layers
from hpcinfer.parallel.stages import partition_layers
from hpcinfer.quant.storage import quant_of

# A slow disk, a fast link, a slow device: spilling matters and the plans differ between the cases.
TINY_MACHINE = dict(disk_memory=10**9, host_to_device=1e9, device_to_host=1e9, disk_to_host=1e8,
                    host_to_disk=1e8, device_flops=1e9, host_flops=1e9, device_bandwidth=1e10,
                    host_bandwidth=1e9)

CASES = [
    # model, dtype, device, host, profile, prompt, gen, extra plan options
    ("tiny-dense", "float32", "600KB", "450KB", "tiny", 8, 4, []),
    ("tiny-dense", "float16", "300KB", "600KB", "tiny", 8, 4, []),
    ("tiny-dense", "bfloat16", "400KB", "2MB", "tiny", 16, 8, ["--cpu-attention", "off"]),
    ("tiny-dense", "float32", "450KB", "1MB", "tiny", 8, 4, ["--quantize", "int4", "--kv-cache", "int8"]),
    ("tiny-dense", "float32", "600KB", "1MB", "tiny", 8, 4, ["--schedule", "row"]),
    ("tiny-prmoe", "float32", "1600KB", "3MB", "tiny", 8, 4, ["--prefetch-layers", "0"]),
    ("tiny-prmoe", "float16", "2MB", "3MB", "tiny", 8, 4, []),
    ("gpt-neox-20b", "float16", "36GB", "64GB", "a100-40gb-pcie4", 512, 32, []),
    ("gpt-neox-20b", "float16", "36GB", "64GB", "a100-40gb-pcie4", 512, 32, ["--cpu-attention", "off"]),
    ("gpt-13b", "float16", "16GB", "40GB", "t4-16gb", 512, 32, []),
]


def plan_toml(capsys, tmp_path, model, dtype, device, host, profile, prompt, gen, extra) -> str:
    if profile == "tiny":
        path = tmp_path / "tiny.toml"
        save_profile(PRESETS["t4-16gb"].__class__(device_memory=1, host_memory=1, name="tiny", **TINY_MACHINE),
                     str(path))
        profile = str(path)
    (tmp_path / "disk").mkdir()
    argv = ["plan", "--model", model, "--dtype", dtype, "--profile", profile, "--device-memory", device,
            "--host-memory", host, "--prompt-len", str(prompt), "--gen-len", str(gen), "--candidates", "0",
            "--disk-dir", str(tmp_path / "disk"), *extra]
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("model, dtype, device, host, profile, prompt, gen, extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'-'.join(c[7]) or 'auto'}" for c in CASES])
def test_printed_plan_passes_the_runtime_budget_check(capsys, tmp_path, model, dtype, device, host, profile,
                                                       prompt, gen, extra):
    out = plan_toml(capsys, tmp_path, model, dtype, device, host, profile, prompt, gen, extra)
    printed = tomllib.loads(out)                     # the whole output is TOML; the sections are what to paste
    off, generate = printed["offload"], printed["generate"]
    assert generate == {"batch_size": off["gpu_batch_size"] * off["num_gpu_batches"], "max_new_tokens": gen}
    quantize = extra[extra.index("--quantize") + 1] if "--quantize" in extra else "none"
    kv_cache = extra[extra.index("--kv-cache") + 1] if "--kv-cache" in extra else "none"
    model_section = f'[model]\npreset = "{model}"\ndtype = "{dtype}"\nquantize = "{quantize}"\n' \
                    f'kv_cache = "{kv_cache}"\n\n'
    path = tmp_path / "job.toml"
    path.write_text(model_section + out[out.index("[offload]"):out.index("[generate]")]
                    + "[generate]\n" + "\n".join(f"{k} = {v}" for k, v in generate.items()) + "\n"
                    + f'prompts = "{tmp_path / "p.jsonl"}"\noutput = "{tmp_path / "out.jsonl"}"\n')
    config = load_config(str(path))                  # the loader accepts it: disk_dir is there when needed
    arch = MODELS[model]
    stages = partition_layers(arch, 1)
    wanted = None if quantize == "none" else (quantize, 64)
    quantized = quant_of(types.SimpleNamespace(arch=arch, load_quant=wanted))
    prompts = [prompt] * config.generate.batch_size
    check_budgets(arch, config, stages, prompts, quantized)          # raises ConfigError if it does not fit

    # The runtime's layer placement is what the comments say, whole layers.
    tiers = place_layers(arch.num_layers, off["weights_gpu"], off["weights_cpu"])
    for tier, key in (("device", "weights_gpu"), ("host", "weights_cpu")):
        assert f"{key} = {off[key]}" in out and f"{tiers.count(tier)} of {arch.num_layers} layers" in out
    if "disk" in tiers:
        assert off["disk_dir"] == str(tmp_path / "disk")
    else:
        assert "disk_dir" not in off

    # The predicted peak is the runtime's plan plus the terms the budget check does not count.
    runtime = plan_bytes(arch, config, stages[0], prompts, quantized)
    policy = Policy(**{k: off[k] for k in ("schedule", "gpu_batch_size", "num_gpu_batches", "weights_gpu",
                                           "weights_cpu", "cache_gpu", "cache_cpu", "act_gpu", "act_cpu",
                                           "cpu_attention", "prefetch_layers")})
    model_ = CostModel(arch, prompt, gen, PRESETS.get(profile) or PRESETS["t4-16gb"], dtype, quantized,
                       kv_format_of(config, arch))
    terms = model_.terms(policy.gpu_batch_size, policy.num_gpu_batches, policy.cpu_attention, policy.schedule,
                         policy.prefetch_layers)
    predicted = model_.predict(policy).peak
    uncounted = terms.uncounted(policy.fractions())
    for tier in TIERS:
        assert predicted[tier] - uncounted[tier] == pytest.approx(runtime[tier], rel=1e-12, abs=1e-3), tier
        assert predicted[tier] >= runtime[tier] - 1e-3
    for tier, key in (("device", "device_memory"), ("host", "host_memory")):
        assert runtime[tier] <= off[key]


def test_a_printed_plan_delegates_attention_over_a_split_cache(capsys, tmp_path):
    """The first case's plan (tiny-dense float32, 600 KB device) splits the cache with CPU attention (device rows
    attend on the device, host rows on the host); the parametrized test above checks that it runs as printed."""
    off = tomllib.loads(plan_toml(capsys, tmp_path, *CASES[0]))["offload"]
    assert off["cpu_attention"] and 0 < off["cache_gpu"] < 100 and off["cache_gpu"] + off["cache_cpu"] == 100


def test_gpt_neox_20b_float16_on_a100_fits_what_the_audit_reproduced(capsys, tmp_path):
    """The audit's case: 36 GB device, 64 GB host. The plan counts the float32 cache the runtime allocates and
    whole layers; its printed peak is within the budgets (it was 36.48 GB device and 87 GB host)."""
    out = plan_toml(capsys, tmp_path, "gpt-neox-20b", "float16", "36GB", "64GB", "a100-40gb-pcie4", 512, 32, [])
    peak = next(line for line in out.splitlines() if line.startswith("# peak memory:"))
    device, host = (float(part.split()[1]) for part in peak.split(": ", 1)[1].split(", ")[:2])
    assert device <= 36.0 and host <= 64.0, peak
