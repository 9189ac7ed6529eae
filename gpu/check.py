"""`make gpu-check`: a lent GPU window's checks as ONE remote command that ends in under 9 minutes (issue 19;
docs/gpu.md, "The GPU check").

    python3 -m gpu.check --out "$OUT"          (= make gpu-check GPU_CHECK_OUT="$OUT")

Steps, in priority order; each runs as a child process under its own timeout, cut further so that the whole run
ends by the budget (`--budget`, 510 s), and writes its result file into --out as soon as it ends, so that a later
failure or the device tool's kill loses nothing:

  mpi       make MPI loadable: the image's mpi4py as it is if it finds an MPI library, else the carried mpich
            wheel unpacked whole (its data folder holds lib/ and bin/; `pip install --target` drops lib/) with
            LD_LIBRARY_PATH and PATH set for every later step; other carried wheels into a site folder
  env       env.json: GPU, driver, CUDA runtime, cupy, NVRTC, cuBLAS, NCCL, mpi4py and its MPI library, python,
            numpy, torch, transformers, compute-sanitizer, the commit
  ops       ops.xml (junit): every Ops method, CuPy against NumPy, kernels on and off, float32/16/bfloat16
            (tests/backend/test_cupy_ops.py and the other GPU-marked op tests, tests/comm/test_nccl_group.py), over
            pytest-xdist workers: they compile the kernel variants in parallel into CuPy's disk cache, which the
            later steps read
  e2e       e2e.xml (junit): tests/cli/test_gpu_e2e.py (tokens cupy = numpy eager and graphed, NCCL captured, 2 ranks)
  decode    decode.json: bench.gpu on gpt2-1.5b float16, batch 1 and 16: copy bandwidth, decode,
            CUDA graphs on and off, transformers eager (its markdown is rebuilt from it: python -m gpu.check --report)
  memcheck  memcheck.xml (junit) and its ERROR SUMMARY in summary.json: compute-sanitizer memcheck over the
            kernels' op cases, with CuPy's pool off (HPCINFER_SANITIZE=1: every array its own allocation)
  smollm2   smollm2.xml (junit): the real SmolLM2 against NumPy, when a converted checkpoint was carried
  gemm      issue 29's kernel sweeps, each a child under its own budget (SWEEP_BUDGET_S, cut to the time left):
  attention the small-batch GEMMs (GEMV, tensor-core tc_gemm, torch's cuBLAS) on gpt2-1.5b's and a Llama-3.1-8B
            layer's shapes at T = 1..64 (bench/gpu_gemm.py), decode attention alone, dense and paged, float16 and
            float32 KV, context 128/1024/4096 (bench/gpu_attention.py), each against the copy bandwidth of the same
            run; their results go into summary.json under the step, as the scenarios' do
  flexgen   issue 32's paper scenarios (gpu/scenarios.py), each a child under its own budget (scenarios.BUDGET_S,
  zero      under 3 minutes each, cut to the time left): FlexGen on OPT-30B's shapes under a 16 GB budget,
  moe       ZeRO-Inference streaming at batch 1..64, DeepSpeed-MoE decode (Mixtral-8x7B's shapes,
            ds-moe-1.3b-128); their results go into summary.json under the step (no file of their own: the
            device tool brings back 8), their tables into report.md and log.txt

`python -m gpu.check --report DIR` writes DIR/report.md (each step's outcome, the junit counts, the decode
headline) from the files that came back; the run prints the same table last. Besides those, summary.json (each step: rc, seconds, timed out, its file, a note; rewritten after every step) and
log.txt (every step's output) come back: 8 files at most, as the device tool returns. A step that fails is
recorded and the next one runs. Without a GPU (`--fake`, the default when cupy sees none) the same steps run on the
CPU stand-in of cupy (tests/helpers/emu_cupy/) with small shapes, skipping what needs a device (NCCL, compute-sanitizer,
mpiexec ranks): the rehearsal that `make test` runs, so that a window spends no time on typos.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry" / "gpu-check"          # made by `make gpu-carry` (gpu/carry.py)
MPI_DIR = Path(tempfile.gettempdir()) / "hpcinfer-mpich"
SITE_DIR = Path(tempfile.gettempdir()) / "hpcinfer-site"
STEPS = ("mpi", "env", "ops", "e2e", "decode", "memcheck", "smollm2", "gemm", "attention", "flexgen", "zero", "moe")
SWEEPS = ("gemm", "attention")                # issue 29's kernel sweeps (bench/gpu_gemm.py, bench/gpu_attention.py)
SCENARIOS = ("flexgen", "zero", "moe")        # issue 32's paper scenarios (gpu/scenarios.py): results in summary.json
# What comes back (the device tool returns 8 files at most): each step's result file, the summary and the log.
FILES = {"env": "env.json", "ops": "ops.xml", "e2e": "e2e.xml", "decode": "decode.json", "memcheck": "memcheck.xml",
         "smollm2": "smollm2.xml"}
ALWAYS = ("summary.json", "log.txt")
MIN_STEP_S = 20                               # a step that would get less than this is skipped, not started


@dataclasses.dataclass
class Check:
    """The state of one gpu-check run: where results go, the environment every child gets, the deadline."""

    out: Path
    fake: bool
    deadline: float
    carry: Path
    commit: str
    env: dict = dataclasses.field(default_factory=lambda: dict(os.environ))
    summary: dict = dataclasses.field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.out / "log.txt"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, step: str, **fields) -> None:
        self.summary.setdefault("steps", {})[step] = fields
        self.write_summary()

    def write_summary(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")

    def run(self, step: str, cmd: list, timeout: float, env: dict | None = None) -> tuple[int, float, bool]:
        """cmd as a child in its own process group under min(timeout, time left): (rc, seconds, timed out); its
        output is appended to log.txt."""
        limit = max(1.0, min(timeout, self.left()))
        with open(self.log, "a") as log:
            log.write(f"\n===== {step} ({time.strftime('%H:%M:%S')}, limit {limit:.0f} s): {' '.join(cmd)}\n")
            log.flush()
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc, timed_out = proc.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc, timed_out = proc.wait(), True
            seconds = time.monotonic() - t0
            log.write(f"===== {step}: rc {rc}{' (timed out)' if timed_out else ''} in {seconds:.1f} s\n")
        return rc, seconds, timed_out

    def python(self, *args) -> list:
        """python running `args` (a module and its arguments), on the CPU stand-in of cupy when faking."""
        if self.fake:
            return [sys.executable, "-m", "emu_cupy", *args]          # tests/helpers/emu_cupy/__main__.py
        return [sys.executable, *args]

    def pytest(self, junit: str, *args) -> list:
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={self.out / junit}"]
        return cmd + (["-p", "emu_cupy"] if self.fake else []) + list(args)


# ---- the steps -------------------------------------------------------------------------------------------------

# Open MPI in a container without ssh, as root (the lent machine, 2026-11-27: Debian Open MPI 4.1.6 under the
# image's mpi4py): a singleton MPI_Init forks an orted that looks for an rsh agent and aborts ("plm_rsh_agent: ssh :
# rsh ... could not be found"), and mpiexec refuses root. The isolated launcher starts local processes only.
OPEN_MPI_LOCAL = {"OMPI_MCA_plm": "isolated", "OMPI_MCA_rmaps_base_oversubscribe": "yes",
                  "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                  "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
WORLD_PROBE = ("from mpi4py import MPI; w = MPI.COMM_WORLD; n = w.allreduce(1); assert n == w.Get_size(), n; "
               "print(MPI.Get_library_version().splitlines()[0], 'ranks', n)")


def mpi_works(check: Check, label: str, extra_env: dict) -> bool:
    """A singleton world and a 2-rank mpiexec world both initialize and all-reduce under check.env + extra_env."""
    env = {**check.env, **extra_env}
    singleton = [sys.executable, "-c", WORLD_PROBE]
    if check.run(f"mpi: {label}, one process", singleton, 30, env=extra_env)[0] != 0:
        return False
    mpiexec = shutil.which("mpiexec", path=env.get("PATH"))
    if mpiexec is None:
        return False
    return check.run(f"mpi: {label}, mpiexec -n 2", [mpiexec, "-n", "2", *singleton], 30, env=extra_env)[0] == 0


def step_mpi(check: Check) -> dict:
    """MPI for every later step, the first that runs a singleton and a 2-rank world: the image's own as it is, the
    image's own with Open MPI's container settings (OPEN_MPI_LOCAL), or the carried mpich wheel."""
    wheels = sorted(glob.glob(str(check.carry / "whl" / "*.whl")))
    others = [w for w in wheels if not Path(w).name.startswith("mpich-")]
    if others:
        rc, _, _ = check.run("mpi: carried wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                                     "--no-deps", "--no-compile", "--upgrade", "--target",
                                                     str(SITE_DIR), *others], 120)
        if rc != 0:
            return {"rc": rc, "note": "installing the carried wheels failed (log.txt)"}
        check.env["PYTHONPATH"] = os.pathsep.join(filter(None, [check.env.get("PYTHONPATH"), str(SITE_DIR)]))
    if mpi_works(check, "the image's MPI", {}):
        return {"rc": 0, "note": "the image's mpi4py and mpiexec run as they are"}
    if mpi_works(check, "the image's MPI, Open MPI local settings", OPEN_MPI_LOCAL):
        check.env.update(OPEN_MPI_LOCAL)
        return {"rc": 0, "note": "the image's MPI with " + " ".join(f"{k}={v}" for k, v in OPEN_MPI_LOCAL.items())}
    mpich = [w for w in wheels if Path(w).name.startswith("mpich-")]
    if not mpich:
        return {"rc": 1, "note": "the image's MPI does not run and no mpich wheel was carried (make gpu-carry)"}
    unpack_mpich(mpich[0], MPI_DIR)
    check.env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(MPI_DIR / "lib"),
                                                                 check.env.get("LD_LIBRARY_PATH")]))
    check.env["PATH"] = os.pathsep.join([str(MPI_DIR / "bin"), check.env.get("PATH", "")])
    ok = mpi_works(check, "the carried mpich", {})
    return {"rc": 0 if ok else 1, "note": f"carried {Path(mpich[0]).name}, unpacked to {MPI_DIR}"}


def unpack_mpich(wheel: str, dest: Path) -> None:
    """The mpich wheel's data folder (<name>.data/data/: bin/, lib/, include/) into dest, executables kept
    executable: what pip install --target leaves out."""
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = Path(info.filename).parts
            if len(parts) > 2 and parts[0].endswith(".data") and parts[1] == "data" and not info.is_dir():
                target = dest.joinpath(*parts[2:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(info))
                target.chmod((info.external_attr >> 16) & 0o777 or 0o644)


ENV_PROBE = r"""
import json, platform, shutil, subprocess, sys
def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {type(exc).__name__}: {exc}"
info = {"python": sys.version.split()[0], "platform": platform.platform()}
import numpy; info["numpy"] = numpy.__version__
import cupy
info["cupy"] = cupy.__version__
info["emulated"] = bool(getattr(cupy, "_emulated", False))
rt = cupy.cuda.runtime
info["gpu"] = attempt(lambda: rt.getDeviceProperties(0)["name"].decode())
info["gpu_memory_GiB"] = attempt(lambda: round(rt.getDeviceProperties(0)["totalGlobalMem"] / 2**30, 1))
info["compute_capability"] = attempt(lambda: "%d.%d" % (rt.getDeviceProperties(0)["major"],
                                                        rt.getDeviceProperties(0)["minor"]))
info["driver_cuda"] = attempt(rt.driverGetVersion)
info["runtime_cuda"] = attempt(rt.runtimeGetVersion)
info["nvrtc"] = attempt(lambda: cupy.cuda.nvrtc.getVersion())
info["cublas"] = attempt(lambda: cupy.cuda.cublas.getVersion(cupy.cuda.device.get_cublas_handle()))
def nccl():
    from cupy.cuda import nccl   # a submodule: cupy.cuda does not import it
    return nccl.get_version() if nccl.available else "not available"
info["nccl"] = attempt(nccl)
info["nvidia_smi"] = attempt(lambda: subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                                     "--format=csv,noheader"], capture_output=True, text=True,
                                                    timeout=20).stdout.strip())
info["compute_sanitizer"] = shutil.which("compute-sanitizer")
info["mpiexec"] = shutil.which("mpiexec")
def mpi():
    import mpi4py
    from mpi4py import MPI
    return {"mpi4py": mpi4py.__version__, "library": MPI.Get_library_version().splitlines()[0]}
info["mpi"] = attempt(mpi)
for name in ("torch", "transformers", "h5py", "scipy"):
    info[name] = attempt(lambda: __import__(name).__version__)
info["torch_cuda"] = attempt(lambda: __import__("torch").cuda.is_available())
print(json.dumps(info, indent=1, default=str))
"""


def step_env(check: Check) -> dict:
    out = check.out / FILES["env"]
    probe = Path(tempfile.mkdtemp()) / "probe.py"
    probe.write_text(f"import sys\nsys.stdout = open({str(out)!r}, 'w')\n" + ENV_PROBE)
    rc, _, _ = check.run("env", check.python(str(probe)), 90)
    if rc == 0:
        info = json.loads(out.read_text())
        info.update(commit=check.commit, date=time.strftime("%Y-%m-%d"), fake=check.fake)
        out.write_text(json.dumps(info, indent=1, default=str) + "\n")
    return {"rc": rc, "file": out.name}


def _workers(check: Check) -> list:
    """pytest-xdist workers (the image has it; here it may be missing: then one process)."""
    probe = subprocess.run([sys.executable, "-c", "import xdist"], env=check.env, capture_output=True)
    return ["-n", str(min(8, os.cpu_count() or 1))] if probe.returncode == 0 and not check.fake else []


def step_ops(check: Check) -> dict:
    cmd = check.pytest(FILES["ops"], *_workers(check), "tests/backend/test_cupy_ops.py",
                       "tests/kernels/test_quant_kernels.py::test_cupy_linear_q_matches_numpy",
                       "tests/comm/test_nccl_group.py", "-k", "not smollm2 and not cli_run")
    rc, _, _ = check.run("ops", cmd, 200)
    return {"rc": rc, "file": FILES["ops"]}


def step_e2e(check: Check) -> dict:
    rc, _, _ = check.run("e2e", check.pytest(FILES["e2e"], "tests/cli/test_gpu_e2e.py"), 150)
    return {"rc": rc, "file": FILES["e2e"]}


def step_decode(check: Check) -> dict:
    work = Path(tempfile.mkdtemp())
    args = ["--only", "copy,decode,graphs,hf", "--out", str(work), "--name", "decode", "--commit", check.commit]
    args += (["--quick", "--repeats", "1", "--decode-batch", "1,2"] if check.fake else
             ["--preset", "gpt2-1.5b", "--decode-batch", "1,16", "--repeats", "3"])
    rc, _, _ = check.run("decode", check.python("-m", "bench.gpu", *args), 240)
    found = sorted(work.glob("decode-*.json"))
    if found:
        shutil.copy(found[-1], check.out / FILES["decode"])
    return {"rc": rc, "file": FILES["decode"] if found else None}


def step_memcheck(check: Check) -> dict:
    sanitizer = shutil.which("compute-sanitizer", path=check.env.get("PATH"))
    if check.fake or sanitizer is None:
        return {"rc": 0, "skipped": "compute-sanitizer needs a GPU" if check.fake else "compute-sanitizer not found"}
    cmd = [sanitizer, "--tool", "memcheck", "--report-api-errors", "no", "--print-limit", "20",
           *check.pytest(FILES["memcheck"], "tests/backend/test_cupy_ops.py", "-k", "test_op_matches_numpy and kernels")]
    start = check.log.stat().st_size
    rc, _, _ = check.run("memcheck", cmd, 180, env={"HPCINFER_SANITIZE": "1"})
    with open(check.log) as log:
        log.seek(start)
        summaries = [line.strip() for line in log if "ERROR SUMMARY" in line]
    return {"rc": rc, "file": FILES["memcheck"], "error_summary": summaries[-1] if summaries else None}


def step_smollm2(check: Check) -> dict:
    model = check.carry / "smollm2.h5"
    if not model.exists():
        return {"rc": 0, "skipped": f"no {model.relative_to(REPO)} carried (make gpu-carry)"}
    cmd = check.pytest(FILES["smollm2"], "tests/backend/test_cupy_ops.py", "-k", "smollm2 or cli_run")
    rc, _, _ = check.run("smollm2", cmd, 300, env={"HPCINFER_SMOLLM2": str(model)})
    return {"rc": rc, "file": FILES["smollm2"]}


SWEEP_BUDGET_S = {"gemm": 90, "attention": 60}
SWEEP_ARGS = {   # (module, its output file, the arguments on a GPU, the arguments of the stand-in's rehearsal)
    "gemm": ("bench.gpu_gemm", "gpu-gemm.json", [],
             ["--shapes", "tiny-dense", "--tokens", "1,3", "--copy-mb", "1", "--spill-mb", "1"]),
    "attention": ("bench.gpu_attention", "gpu-attention.json", [], ["--quick", "--copy-mb", "1"]),
}


def step_sweep(check: Check, name: str) -> dict:
    """An issue-29 kernel sweep under its own budget; its JSON goes into summary.json under the step."""
    module, file, real, fake = SWEEP_ARGS[name]
    work = Path(tempfile.mkdtemp(prefix=f"sweep-{name}-"))
    budget = min(SWEEP_BUDGET_S[name], max(1.0, check.left() - 5))
    args = ["-m", module, "--out", str(work), *(fake if check.fake else real)]
    args += ["--budget", f"{budget - 10:.0f}"] if name == "gemm" else []
    return results_step(check, name, args, budget, work / file)


def results_step(check: Check, name: str, args: list, timeout: float, path: Path) -> dict:
    """Run `python args` as the step's child; what its results file `path` holds when it ends (a timeout
    included: the children rewrite it after every case) goes into summary.json under the step ("results")."""
    rc, _, timed_out = check.run(name, check.python(*args), timeout)
    results = json.loads(path.read_text()) if path.exists() else None
    return {"rc": rc, "results": results, "note": "timed out: the cases that ended are kept" if timed_out else ""}


def step_gemm(check: Check) -> dict:
    return step_sweep(check, "gemm")


def step_attention(check: Check) -> dict:
    return step_sweep(check, "attention")


def step_scenario(check: Check, name: str) -> dict:
    """A paper scenario (gpu/scenarios.py) under its own budget (BUDGET_S, cut to the time left): its child
    rewrites its results file after every case, and what is there when the step ends (a timeout included) goes
    into summary.json under the step ("results"), so the device tool's 8 files are not one more."""
    from gpu.scenarios import BUDGET_S

    work = Path(tempfile.mkdtemp(prefix=f"scenario-{name}-"))
    budget = min(BUDGET_S[name], max(1.0, check.left() - 5))
    args = ["-m", "gpu.scenarios", name, "--out", str(work / f"{name}.json"), "--budget", f"{budget:.0f}"]
    args += ["--kernels", "off"] if check.fake else []          # the rehearsal: tiny shapes, no emulated kernels
    return results_step(check, name, args, budget + 20, work / f"{name}.json")


def step_flexgen(check: Check) -> dict:
    return step_scenario(check, "flexgen")


def step_zero(check: Check) -> dict:
    return step_scenario(check, "zero")


def step_moe(check: Check) -> dict:
    return step_scenario(check, "moe")


# ---- the report ------------------------------------------------------------------------------------------------

def junit_counts(path: Path) -> str:
    """'tests/failures/errors/skipped' of a junit file, or why there is none."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return "no file"
    try:
        suite = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return f"unreadable ({exc})"
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    get = lambda key: suite.get(key, "0")                                   # noqa: E731
    return f"{get('tests')} tests, {get('failures')} failed, {get('errors')} errors, {get('skipped')} skipped"


def decode_lines(path: Path) -> list[str]:
    """The decode benchmark's headline: ms/step, fraction of the copy bandwidth, graphs and transformers ratios."""
    if not path.exists():
        return []
    sections = json.loads(path.read_text()).get("sections", {})
    lines = [f"copy {sections.get('copy', {}).get('GBps', float('nan')):.1f} GB/s"]
    for key, r in (sections.get("decode") or {}).items():
        if not isinstance(r, dict) or "ms_per_token" not in r:
            lines.append(f"{key}: {r}")
            continue
        graphs = (sections.get("graphs") or {}).get(key) or {}
        hf = (sections.get("hf") or {}).get(key) or {}
        lines.append(f"{key}: {r['ms_per_token']:.3f} ms/step, {r['GBps']:.1f} GB/s = "
                     f"{r.get('fraction_of_copy') or float('nan'):.2f} of copy; graphs x{graphs.get('speedup') or 0:.2f}"
                     f" (eager steps {(graphs.get('on') or {}).get('graph_eager_steps')}); "
                     f"transformers {hf.get('ms_per_token', float('nan')):.3f} ms/step, hpcinfer x"
                     f"{hf.get('hpcinfer_speedup') or 0:.2f}")
    return lines


def scenario_tables(summary: dict) -> list[str]:
    """The paper scenarios' markdown tables (gpu/scenarios.markdown) from their results in summary.json."""
    from gpu.scenarios import markdown

    found = [(summary.get("steps") or {}).get(name, {}).get("results") for name in SCENARIOS]
    return [line for data in found if data for line in ["", markdown(data)]]


def report(out: Path) -> str:
    """A short markdown report of a gpu-check folder (summary.json, the junit files, decode.json)."""
    s = json.loads((out / "summary.json").read_text())
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    lines = [f"# gpu-check at {s.get('commit')}, {s.get('started')}", "",
             f"{env.get('gpu')} ({env.get('nvidia_smi')}), CUDA driver {env.get('driver_cuda')}, runtime "
             f"{env.get('runtime_cuda')}, cupy {env.get('cupy')}, NCCL {env.get('nccl')}, MPI {env.get('mpi')}"
             f"{' (CPU stand-in: times mean nothing)' if s.get('fake') else ''}", "",
             "| step | rc | s | result |", "|---|---|---|---|"]
    for name, r in (s.get("steps") or {}).items():
        what = r.get("skipped") or r.get("note") or ""
        if str(r.get("file", "")).endswith(".xml"):
            what = f"{junit_counts(out / r['file'])} {what}".strip()
        if r.get("results"):
            res = r["results"]
            errors = sum("error" in c for c in res.get("cases", {}).values())
            what = (f"{len(res.get('cases', {}))} cases ({errors} failed), {len(res.get('skipped', {}))} skipped "
                    f"{what}").strip()
        if r.get("error_summary"):
            what += f" {r['error_summary']}"
        lines.append(f"| {name} | {r.get('rc')} | {r.get('seconds')} | {what} |")
    lines += ["", *(f"- {line}" for line in decode_lines(out / "decode.json")), *scenario_tables(s),
              "", f"{s.get('failed_steps')} step(s) failed in {s.get('elapsed_s')} s.", ""]
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------------------------

def run_steps(check: Check, steps) -> int:
    failed = 0
    for name in steps:
        if check.left() < MIN_STEP_S:
            check.record(name, rc=None, skipped=f"out of time ({check.left():.0f} s left of the budget)")
            continue
        t0 = time.monotonic()
        try:
            result = globals()[f"step_{name}"](check)
        except Exception as exc:  # noqa: BLE001 - a broken step is recorded; the next one runs
            result = {"rc": 1, "note": f"the step itself failed: {type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - t0, 1)
        check.record(name, **result)
        failed += result.get("rc") not in (0, None)
        print(f"gpu-check: {name}: rc {result.get('rc')} in {result['seconds']} s"
              f"{' (' + result['skipped'] + ')' if 'skipped' in result else ''}", flush=True)
    return failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "out/gpu-check", help="folder for the result files")
    p.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run (the device's command "
                                                                 "limit is 600)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {STEPS}")
    p.add_argument("--fake", action="store_true", help="run on the CPU stand-in of cupy (default without a GPU)")
    p.add_argument("--carry", default=str(CARRY), help="the carried folder (wheels, smollm2.h5)")
    p.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse HEAD, else unknown)")
    p.add_argument("--report", metavar="DIR", help="only write DIR/report.md from a gpu-check folder and print it")
    args = p.parse_args(argv)
    if args.report:
        text = report(Path(args.report))
        (Path(args.report) / "report.md").write_text(text)
        print(text)
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if set(steps) - set(STEPS):
        p.error(f"unknown steps {sorted(set(steps) - set(STEPS))}; choose from {STEPS}")
    from hpcinfer.backend.cupy_ops import gpu_available
    from hpcinfer.bench.common import git_commit

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fake = args.fake or not gpu_available()
    check = Check(out, fake, time.monotonic() + args.budget, Path(args.carry), args.commit or git_commit() or "unknown")
    check.env["PYTHONUNBUFFERED"] = "1"
    check.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                           str(REPO / "tests" / "helpers") if fake else None,
                                                           check.env.get("PYTHONPATH")]))
    check.log.write_text(f"gpu-check at {check.commit}, {'on the CPU stand-in of cupy' if fake else 'on a GPU'}\n")
    check.summary.update(commit=check.commit, fake=fake, budget_s=args.budget, started=time.strftime("%FT%T%z"))
    failed = run_steps(check, steps)
    check.summary.update(elapsed_s=round(args.budget - check.left(), 1), failed_steps=failed)
    check.write_summary()
    print(report(out))                                      # the device tool's output tail shows this table
    print(f"gpu-check: {failed} step(s) failed; results in {out} (summary.json, log.txt)")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
