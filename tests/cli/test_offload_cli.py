"""`hpcinfer run` with [offload], end to end in subprocesses: weights in host memory or on disk, row and zig-zag
schedules, on 1 and 2 ranks (tp = 2, dp = 2), must write exactly what the run without offload writes; the
metrics' "offload" section reports what moved; bad [offload] inputs fail once, clearly, before any weight is read.

One tiny 4-layer Llama (tests/helpers/hf_models.py's llama_mha with 4 layers: 4 KV heads, so tp = 2 works; EOS stops
some sequences early) is converted once per module; 8 prompts run in batches of 4 (two blocks; dp = 2 gives each
replica one). MoE streaming runs on the "tiny-moe" preset with tp = 2, ep = 2 on 2 ranks (offload refuses MoE
with dp > 1).

Partitioned fetch (each of the dp = 2 replicas keeps and reads half of every layer, an all-gather assembles it)
runs here end to end; tests/mpi/test_offload_partitioned.py checks its rounds and reads under MPI.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import h5py  # noqa: E402

from cli_helpers import CliJob, assert_fails_once_and_clearly, metrics_of, write_token_prompts
from hf_models import save_tiny_model
from hpcinfer.api import generate, load_model  # noqa: E402
from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from hpcinfer.config import load_config  # noqa: E402
from hpcinfer.offload.budget import plan_bytes, predicted_vs_measured  # noqa: E402
from hpcinfer.parallel.stages import partition_layers  # noqa: E402

VOCAB, LAYERS = 256, 4
PROMPT_LENGTHS = (3, 9, 1, 14, 6, 11, 4, 7)
BATCH = 4
MAX_NEW = 6
ERROR = "hpcinfer: error"
BAD_TIMEOUT = 60
HOST = ["offload.weights_gpu=0", "offload.weights_cpu=100"]


class Job(CliJob):
    """The module's 4-layer checkpoint (with more EOS ids), prompts and config; `plan` gives budget.plan_bytes."""

    def __init__(self, root: Path, run_cli, cwd: Path):
        ckpt = root / "tiny4.h5"
        self.arch = convert_hf(save_tiny_model("llama_mha", root / "hf", num_layers=LAYERS), str(ckpt))
        assert self.arch.num_layers == LAYERS and self.arch.num_kv_heads == 4
        tokens = write_token_prompts(root / "prompts.jsonl", PROMPT_LENGTHS, VOCAB)
        # More EOS ids, from a greedy run in this process: prompt 1 stops at its 1st token, 2 at its 3rd, 5 at
        # its 4th; the other sequences run to MAX_NEW (as tests/cli/test_pipeline_cli.py's eos_job).
        greedy = generate(load_model(str(ckpt)), tokens, MAX_NEW)
        eos = set(self.arch.eos_token_ids) | {greedy[1][0], greedy[2][2], greedy[5][3]}
        with h5py.File(ckpt, "r+") as f:
            f.attrs["eos_token_ids"] = np.asarray(sorted(eos), dtype=np.int64)
        super().__init__(root, run_cli, cwd, ckpt, root / "prompts.jsonl", MAX_NEW, BATCH, "ignore_eos = false\n")

    def plan(self, *extra, tp=1) -> dict:
        """budget.plan_bytes of this job with these overrides (one rank's share)."""
        config = load_config(str(self.config), [*extra, f"parallel.tp={tp}"])
        return plan_bytes(self.arch, config, partition_layers(self.arch, 1)[0], list(PROMPT_LENGTHS))


@pytest.fixture(scope="module")
def job(tmp_path_factory, run_cli, repo_root):
    return Job(tmp_path_factory.mktemp("offload_cli"), run_cli, repo_root)


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """One rank, no [offload]: the output every offloaded run must write byte for byte."""
    out = tmp_path_factory.mktemp("reference")
    _, got = job.run_reference(out)
    lengths = [len(r["output_tokens"]) for r in got]
    assert min(lengths) < MAX_NEW == max(lengths), lengths          # EOS stops some sequences early
    metrics = metrics_of(out)
    assert metrics["offload"]["weights_peak_device_bytes_per_rank"] == 0                  # offload is off
    return out


def device_budget(job, *extra, tp=1) -> int:
    """A device budget this plan just fits (its device bytes + 1 KB): the run must stay under it."""
    return int(job.plan(*extra, tp=tp)["device"]) + 1000


# id: (ranks, overrides, expects host bytes, expects disk bytes)
LAYOUTS = {
    "n1-host-row": (1, [*HOST], True, False),
    "n1-host-row-no-prefetch": (1, [*HOST, "offload.prefetch_layers=0"], True, False),
    "n1-disk-row-prefetch2": (1, ["offload.weights_gpu=0", "offload.weights_cpu=0", "offload.prefetch_layers=2"],
                              False, True),
    "n1-mixed-zigzag-cache-host": (1, ["offload.weights_gpu=25", "offload.weights_cpu=25",
                                       'offload.schedule="zigzag"', "offload.num_gpu_batches=2",
                                       "offload.cache_gpu=0", "offload.cache_cpu=100"], True, True),
    "n1-host-zigzag-gpu-batches": (1, [*HOST, 'offload.schedule="zigzag"', "offload.gpu_batch_size=1",
                                       "offload.num_gpu_batches=4"], True, False),
    "n2-tp2-host-row": (2, [*HOST, "parallel.tp=2"], True, False),
    "n2-tp2-mixed-zigzag": (2, ["parallel.tp=2", "offload.weights_gpu=0", "offload.weights_cpu=50",
                                'offload.schedule="zigzag"', "offload.num_gpu_batches=2"], True, True),
    "n2-dp2-disk-zigzag": (2, ["offload.weights_gpu=0", "offload.weights_cpu=0", 'offload.schedule="zigzag"',
                               "offload.num_gpu_batches=2"], False, True),
    "n2-dp2-host-row": (2, [*HOST, "offload.num_gpu_batches=2"], True, False),
}


@pytest.mark.parametrize("n, overrides, from_host, from_disk", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_offloaded_runs_write_what_the_plain_run_writes(job, reference, tmp_path, n, overrides, from_host,
                                                        from_disk):
    tp = 2 if "parallel.tp=2" in overrides else 1
    disk = tmp_path / "disk"
    extra = [*overrides, f"offload.disk_dir={disk}"]
    budget = device_budget(job, *extra, tp=tp)
    done = job.run(tmp_path / "out", *extra, f"offload.device_memory={budget}", n=n)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
    metrics = metrics_of(tmp_path / "out")
    assert metrics["mesh"]["tp"] == tp and metrics["mesh"]["dp"] == n // tp
    off = metrics["offload"]
    assert 0 < off["weights_peak_device_bytes_per_rank"] <= budget
    assert (off["weights_bytes_from_host"] > 0) == from_host
    assert (off["weights_bytes_from_disk"] > 0) == from_disk
    assert metrics["config"]["offload"]["device_memory"] == budget
    if from_disk:                                               # one folder of files per rank
        assert sorted(p.name for p in disk.iterdir()) == [f"rank{r:05d}" for r in range(n)]
        assert all(any(p.suffix == ".npy" for p in (disk / f"rank{r:05d}").iterdir()) for r in range(n))
    else:
        assert not disk.exists()
    if "offload.cache_cpu=100" in overrides:
        assert metrics["kv_cache"]["offloaded_bytes_to_host"] > 0
        assert metrics["kv_cache"]["fetched_bytes_to_device"] > 0


def test_tensor_parallel_ranks_stream_half_a_layer_each(job, reference, tmp_path):
    """tp = 2: each rank holds and streams its shard, so its peak is about half the single rank's."""
    peaks = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        done = job.run(out, *HOST, "offload.prefetch_layers=0", f"parallel.tp={tp}", n=tp)
        assert done.returncode == 0, done.stderr
        assert (out / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
        peaks[tp] = metrics_of(out)["offload"]["weights_peak_device_bytes_per_rank"]
    assert 0.45 * peaks[1] <= peaks[2] <= 0.6 * peaks[1], peaks   # norms are replicated, the rest is split


def test_partitioned_fetch_on_two_replicas_reads_each_layer_once_per_node(job, reference, tmp_path):
    """dp = 2 on one node, weights on disk: with partitioned_fetch each replica keeps and reads half of every
    layer and an all-gather assembles it; the output is the plain run's, and the disk bytes read fall from
    (rank 0's fetches + rank 1's) whole layers to (the longer rank's fetches + 1) layers."""
    moved = {}
    for partitioned in ("false", "true"):
        out, disk = tmp_path / f"out-{partitioned}", tmp_path / f"disk-{partitioned}"
        done = job.run(out, "offload.weights_gpu=0", "offload.weights_cpu=0", f"offload.disk_dir={disk}",
                       f"offload.partitioned_fetch={partitioned}", n=2)
        assert done.returncode == 0, done.stderr
        assert (out / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
        moved[partitioned] = metrics_of(out)["offload"]["weights_bytes_from_disk"]
        files = sorted(p.name for p in (disk / "rank00001").iterdir())
        assert len(files) == (LAYERS if partitioned == "true" else len(files)) and files
        if partitioned == "true":
            assert all("-part-0001" in name for name in files), files        # one part file per layer
    assert moved["true"] < 0.75 * moved["false"], moved


def test_quantized_weights_stream_under_a_budget_only_they_fit(job, tmp_path):
    """[model] quantize = "int8" with the weights in host memory: the tiers move the quantized tensors, the budget
    check counts their quantized bytes (a device budget between the int8 plan and the float plan passes), and
    the output is the quantized run's without offload. The float model under that budget is refused."""
    from hpcinfer.checkpoint.format import open_checkpoint
    from hpcinfer.quant.storage import configure, quant_of

    int8 = ['model.quantize="int8"']
    plain = job.run(tmp_path / "plain", *int8)
    assert plain.returncode == 0, plain.stderr
    config = load_config(str(job.config), [*int8, *HOST])
    with open_checkpoint(str(job.ckpt)) as ckpt:
        configure(ckpt, "int8")
        plan = plan_bytes(job.arch, config, partition_layers(job.arch, 1)[0], list(PROMPT_LENGTHS),
                          quant_of(ckpt))
    float_plan = job.plan(*HOST)
    window, float_window = plan["parts"]["streaming window"], float_plan["parts"]["streaming window"]
    assert window < 0.3 * float_window and plan["device"] + 1000 < float_plan["device"], (plan, float_plan)
    budget = int(plan["device"]) + 1000
    done = job.run(tmp_path / "off", *int8, *HOST, f"offload.device_memory={budget}")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "off" / "output.jsonl").read_text() == (tmp_path / "plain" / "output.jsonl").read_text()
    off = metrics_of(tmp_path / "off")["offload"]
    assert 0 < off["weights_peak_device_bytes_per_rank"] <= plan["parts"]["streaming window"]
    assert off["weights_bytes_from_host"] > 0
    refused = job.run(tmp_path / "float", *HOST, f"offload.device_memory={budget}", timeout=BAD_TIMEOUT)
    assert refused.returncode == 2 and "cannot hold this plan" in refused.stderr, refused.stderr


def test_zigzag_moves_fewer_weight_bytes_than_row_by_row(job, reference, tmp_path):
    """Four GPU batches of one sequence: row by row streams every layer per GPU batch, zig-zag once per block."""
    moved = {}
    for schedule in ("row", "zigzag"):
        out = tmp_path / schedule
        done = job.run(out, *HOST, f'offload.schedule="{schedule}"', "offload.num_gpu_batches=4", n=1)
        assert done.returncode == 0, done.stderr
        assert (out / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
        assert "set [offload] profile" in done.stdout                # no profile: how to get the prediction
        moved[schedule] = metrics_of(out)["offload"]["weights_bytes_from_host"]
    # EOS ends sequences at different steps, so row is below 4x; it is still far above zig-zag.
    assert 2 * moved["zigzag"] <= moved["row"] <= 4 * moved["zigzag"], moved


def test_the_host_budget_can_be_below_the_model_when_the_rest_is_on_disk(job, reference, tmp_path):
    """Weights mostly on disk (1 of 4 layers in host memory) under a host_memory budget below the model's weight
    bytes: the run passes the budget check, reads the disk tier from its per-layer files and writes the plain
    run's output; a host budget just below what the plan keeps in host memory is refused."""
    disk = tmp_path / "disk"
    placement = ["offload.weights_gpu=0", "offload.weights_cpu=25", f"offload.disk_dir={disk}"]
    with h5py.File(job.ckpt, "r") as f:
        model_bytes = sum(d.nbytes for d in datasets_of(f))
    on_host = int(job.plan(*placement)["host"])
    budget = model_bytes // 2
    assert 0 < on_host < budget < model_bytes, (on_host, model_bytes)
    done = job.run(tmp_path / "out", *placement, f"offload.host_memory={budget}")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
    metrics = metrics_of(tmp_path / "out")
    assert metrics["config"]["offload"]["host_memory"] == budget
    assert metrics["offload"]["weights_bytes_from_disk"] > 0 and metrics["offload"]["weights_bytes_from_host"] > 0
    files = list((disk / "rank00000").glob("*.npy"))
    assert files and sum(f.stat().st_size for f in files) > on_host           # 3 layers on disk, 1 in host memory
    refused = job.run(tmp_path / "small", *placement, f"offload.host_memory={on_host - 1}", timeout=BAD_TIMEOUT)
    assert_fails_once_and_clearly(refused, tmp_path / "small", [f"host_memory = {on_host - 1:,} bytes"])


def datasets_of(group) -> list:
    """Every dataset under an h5py group."""
    found = []
    group.visititems(lambda _, obj: found.append(obj) if isinstance(obj, h5py.Dataset) else None)
    return found


def test_a_profile_reports_the_cost_models_prediction_beside_the_measured_time(job, reference, tmp_path):
    """[offload] profile: the metrics' offload section holds the cost model's predicted time for this run's policy
    (budget.predicted_vs_measured over its 2 blocks of 4 prompts), the measured generate time and their ratio."""
    done = job.run(tmp_path / "out", *HOST, 'offload.profile="t4-16gb"')
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "output.jsonl").read_text() == (reference / "output.jsonl").read_text()
    metrics = metrics_of(tmp_path / "out")
    off = metrics["offload"]
    assert off["profile"] == "t4-16gb" and off["predicted_s"] > 0 and off["measured_s"] > 0, off
    assert off["measured_s"] == metrics["generate_s"]
    assert off["measured_over_predicted"] == off["measured_s"] / off["predicted_s"]
    config = load_config(str(job.config), [*HOST, 'offload.profile="t4-16gb"'])
    blocks = len(PROMPT_LENGTHS) // BATCH
    again = predicted_vs_measured(job.arch, config, list(PROMPT_LENGTHS), blocks, off["measured_s"])
    assert off["predicted_s"] == pytest.approx(again["predicted_s"], rel=1e-12)
    assert "cost model predicted" in done.stdout and "t4-16gb" in done.stdout
    assert "set [offload] profile" not in done.stdout


# ------------------------------------------------------------------------------------------------------- MoE

def moe_config(root: Path, repo_root: Path, tp: int = 2) -> Path:
    """inputs/preset-tiny-moe.toml with 8 tokens, batch 8, EOS ignored, on 2 ranks: tp = 2 and ep = 2 (dp = 1:
    offload does not step MoE data-parallel replicas together, so it refuses dp > 1 with an MoE model)."""
    path = root / f"moe-tp{tp}.toml"
    path.write_text(f'[model]\npreset = "tiny-moe"\n\n[parallel]\ntp = {tp}\nep = 2\n\n'
                    f'[generate]\nprompts = "{repo_root / "inputs" / "tokens.jsonl"}"\noutput = "unused.jsonl"\n'
                    "max_new_tokens = 8\nbatch_size = 8\nignore_eos = true\n")
    return path


# With the preset's capacity factor (1.0) the tokens an expert keeps depend on which sequences share a step, so
# GPU batches of part of the batch route differently: the zig-zag case lifts the capacity limit on both runs.
MOE_CASES = {"host-row": [*HOST],
             "mixed-zigzag-2-gpu-batches": ["offload.weights_gpu=0", "offload.weights_cpu=50",
                                            'offload.schedule="zigzag"', "offload.num_gpu_batches=2",
                                            "moe.capacity_factor=100.0"]}


@pytest.mark.parametrize("overrides", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_moe_experts_stream_on_two_ranks(job, tmp_path, repo_root, overrides):
    config = moe_config(tmp_path, repo_root)
    same = [o for o in overrides if o.startswith("moe.")]
    # offload runs the static schedule by design; with a binding expert capacity the plain run must batch the same
    plain = job.run(tmp_path / "plain", *same, 'schedule.batching="static"', n=2, config=config)
    assert plain.returncode == 0, plain.stderr
    done = job.run(tmp_path / "off", *overrides, f"offload.disk_dir={tmp_path / 'disk'}", n=2, config=config)
    assert done.returncode == 0, done.stderr
    assert "mesh pp=1 dp=1 tp=2" in done.stdout
    assert (tmp_path / "off" / "output.jsonl").read_text() == (tmp_path / "plain" / "output.jsonl").read_text()
    off = metrics_of(tmp_path / "off")["offload"]
    assert off["weights_peak_device_bytes_per_rank"] > 0 and off["weights_bytes_from_host"] > 0


def test_moe_with_data_parallel_replicas_is_refused_under_offload(job, tmp_path, repo_root):
    """dp = 2 with an MoE model: the replicas exchange tokens in every MoE layer, which the offload schedules do
    not step together (it deadlocked before it was refused)."""
    config = moe_config(tmp_path, repo_root, tp=1)
    done = job.run(tmp_path / "off", "generate.batch_size=3", *HOST, "offload.num_gpu_batches=2", n=2,
                   config=config, timeout=BAD_TIMEOUT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count(ERROR) == 1 and "needs dp = 1" in done.stderr, done.stderr
    assert not (tmp_path / "off" / "output.jsonl").exists()


# ------------------------------------------------------------------------------------------------ bad inputs

def case_weights_above_100(job, tmp):
    return ["offload.weights_gpu=60", "offload.weights_cpu=50"], 1, [
        "offload.weights_gpu + offload.weights_cpu = 110", "above 100"]


def case_cache_above_100(job, tmp):
    return ["offload.cache_gpu=80", "offload.cache_cpu=30"], 1, ["offload.cache_gpu + offload.cache_cpu"]


def case_weights_on_disk_without_disk_dir(job, tmp):
    return ["offload.weights_gpu=0", "offload.weights_cpu=50"], 1, ["puts weights on disk", "offload.disk_dir"]


def case_device_budget_too_small(job, tmp):
    return [*HOST, 'offload.device_memory="10KB"'], 1, [
        "device_memory = 10,000 bytes", "resident layers", "streaming window", "embedding tables", "KV cache"]


def case_device_budget_too_small_on_two_ranks(job, tmp):
    return [*HOST, "parallel.tp=2", 'offload.device_memory="10KB"'], 2, ["device_memory = 10,000 bytes",
                                                                         "streaming window"]


def case_host_budget_too_small(job, tmp):
    return [*HOST, 'offload.host_memory="1KB"'], 1, ["host_memory = 1,000 bytes", "on the host"]


def case_block_not_the_batch(job, tmp):
    return [*HOST, 'offload.schedule="zigzag"', "offload.gpu_batch_size=3", "offload.num_gpu_batches=2"], 1, [
        "offload.gpu_batch_size * num_gpu_batches = 6", f"batch_size = {BATCH}"]


def case_offload_with_pp2(job, tmp):
    return [*HOST, "parallel.pp=2"], 2, ["pp = 1"]


def case_row_schedule_with_cache_on_host(job, tmp):
    return [*HOST, "offload.cache_gpu=0", "offload.cache_cpu=100"], 1, ["offload.cache_gpu < 100", "zigzag"]


def case_unknown_schedule(job, tmp):
    return ['offload.schedule="diagonal"'], 1, ["offload.schedule", "row", "zigzag"]


def case_budget_without_unit(job, tmp):
    return ['offload.device_memory="lots"'], 1, ["offload.device_memory", "2GiB"]


BAD_CASES = [case_weights_above_100, case_cache_above_100, case_weights_on_disk_without_disk_dir,
             case_device_budget_too_small, case_device_budget_too_small_on_two_ranks, case_host_budget_too_small,
             case_block_not_the_batch, case_offload_with_pp2, case_row_schedule_with_cache_on_host,
             case_unknown_schedule, case_budget_without_unit]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_bad_offload_input_fails_once_and_clearly(job, tmp_path, case):
    overrides, n, fragments = case(job, tmp_path)
    out = tmp_path / "out"
    done = job.run(out, *overrides, n=n, timeout=BAD_TIMEOUT)
    assert_fails_once_and_clearly(done, out, fragments)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
