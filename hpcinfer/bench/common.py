"""What the suite runner (suites/) and the benchmark scripts (the repository's bench/) share: the machine's
description, how busy the rest of the machine was while we measured (the quiet-machine checks), prompts of real
text, token agreement.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUSY_WARN_CPUS = 0.2       # other processes' CPU use above which a measurement counts as disturbed
QUIET_WINDOW_S = 1.0


def logger(name: str):
    """log(msg) to stderr with the script's name and the time."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


def median(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else float("nan")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---- machine and software ------------------------------------------------------------------------------------

def _proc_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            k, _, value = line.partition(":")
            if k.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def gpu_info() -> list[dict]:
    """Name, driver and memory of every NVIDIA GPU (nvidia-smi), or [] where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return gpus


def machine_info() -> dict:
    flags = (_proc_field("/proc/cpuinfo", "flags") or "").split()
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or "unknown",
        "cpus_online": os.cpu_count(),
        "cpus_usable": usable_cores(),
        "cpu_flags": [f for f in wanted if f in flags],
        "mem_total_GiB": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "gpus": gpu_info(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def loadavg() -> list | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- is anything else running? -------------------------------------------------------------------------------

class CpuMeter:
    """How much CPU other processes used while we measured: (machine busy time - our own CPU time) / wall time,
    in CPUs (0 = the machine was ours alone), from /proc/stat and os.times(); also the hypervisor's steal time."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        own = os.times()
        return (time.perf_counter(), (user + nice + system + irq + softirq) / tick, steal / tick,
                own.user + own.system)

    def lap(self) -> dict | None:
        """Figures since the previous lap (or since creation)."""
        now = self._sample()
        if now is None or self.start is None:
            return None
        (t0, busy0, steal0, own0), (t1, busy1, steal1, own1) = self.start, now
        self.start = now
        wall = max(t1 - t0, 1e-9)
        return {"wall_s": round(wall, 2), "own_cpus": round((own1 - own0) / wall, 2),
                "other_cpus": round(max(0.0, (busy1 - busy0) - (own1 - own0)) / wall, 2),
                "steal_cpus": round((steal1 - steal0) / wall, 2)}


class ChildCpuMeter(CpuMeter):
    """CpuMeter that counts the waited-for child jobs (mpiexec and its ranks) as our own CPU time, so other_cpus
    is what every other process on the machine used meanwhile."""

    @staticmethod
    def _sample():
        base = CpuMeter._sample()
        if base is None:
            return None
        t = os.times()
        return base[:3] + (base[3] + t.children_user + t.children_system,)


def wait_quiet(max_s: float) -> dict:
    """Before a measurement: wait (1 s windows, at most max_s) until other processes use <= BUSY_WARN_CPUS."""
    meter, t0, other = CpuMeter(), time.perf_counter(), None
    while max_s > 0:
        time.sleep(QUIET_WINDOW_S)
        lap = meter.lap()
        other = lap["other_cpus"] if lap else 0.0
        if other <= BUSY_WARN_CPUS or time.perf_counter() - t0 + QUIET_WINDOW_S > max_s:
            break
    return {"other_cpus": other, "waited_s": round(time.perf_counter() - t0, 1)}


def busy_warning(values, what: str) -> list[str]:
    """[a warning] when other processes used more than BUSY_WARN_CPUS during any of `values` (CPUs), else []."""
    busy = [v for v in values if v is not None]
    if busy and max(busy) > BUSY_WARN_CPUS:
        return [f"other processes used up to {max(busy):.2f} CPUs during {what}; the times of those "
                f"measurements are inflated: rerun on a quiet machine"]
    return []


# ---- inputs and checks -----------------------------------------------------------------------------------------

def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens: consecutive slices of the token stream of the Python
    standard library's pydoc_data/topics.py (real English prose, present on every Python)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    need = count * length
    chars = need * 8
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:
        raise SystemExit(f"bench: pydoc_data/topics.py gives only {len(ids)} tokens, {need} needed")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def agreement(a: list, b: list) -> dict:
    """Greedy tokens that agree: per sequence, the length of the common prefix (fp32 rounding may flip a near-tie
    late in a generation; an early mismatch means the two systems do not compute the same model)."""
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefixes.append(n)
    return {"common_prefix": prefixes, "min": min(prefixes) if prefixes else 0, "length": len(a[0]) if a else 0}
