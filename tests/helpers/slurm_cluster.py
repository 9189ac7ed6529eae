"""A throw-away Slurm cluster on this machine for the tests (tests/slurm/): munged, slurmctld and one or two slurmd,
every file of theirs in one temp dir, stopped by process id after.

    reason = unavailable_reason()          # None, or why the tests must skip (not root, no packages)
    cluster = SlurmCluster(nodes=1).start()
    job = cluster.sbatch(["jobs/demo.slurm"], env=..., cwd=REPO)
    info = cluster.wait_done(job, timeout=120)   # scontrol's fields: JobState, ExitCode, Restarts, ...
    cluster.stop()                         # every daemon, job step and rank of this cluster, by pid

The packages are Debian's (slurmctld, slurmd, slurm-client, munge: `make slurm-packages`); docs/slurm.md gives the
same set-up as a recipe. Nothing is written outside the temp dir: the munge key, socket and logs, slurm.conf, the
state and spool dirs, the pid and log files live there, and the daemons listen on free ports of 127.0.0.1, so a
cluster of the machine's own (and other test runs) are left alone. The commands find the cluster through
SLURM_CONF in `cluster.env()`.

Clean-up does not depend on the test passing: the daemons run in the foreground as children of this process with a
parent-death signal (SIGTERM when the test process dies, even by SIGKILL), `stop()` runs from the fixture's
finalizer and from atexit, and after the daemons it ends every process whose environment names this cluster's
slurm.conf (job steps, srun, the ranks: slurmstepd outlives slurmd by design).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun")
MUNGE_USER = "munge"

# Settings that make a requeued job start again within seconds (Slurm 22.05, docs/slurm.md "Shorter waits"):
#   AuthInfo cred_expire=5     a requeued job waits cred_expire + 1 s before it may start (default 120; minimum 5)
#   sched_interval=1           the main scheduling loop, which starts such a job once its begin time has passed,
#                              runs every second (default 60)
#   bf_interval=1              the backfill loop likewise (default 30)
# (slurm_conf() also sets KillWait=10: SIGTERM to SIGKILL after scancel or a requeue, default 30; and MinJobAge=600:
# a finished job stays visible to `scontrol show job` for 10 minutes, there being no accounting to ask.)
FAST_REQUEUE = {"cred_expire": 5, "sched_interval": 1, "bf_interval": 1}

# The variables of a surrounding Slurm job or command, dropped from this cluster's commands and jobs.
OUTER_SLURM_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")

# Job ids start at a random one per cluster: MPICH names a job's shared state by its PMI job id (SLURM_JOB_ID and
# step), so two clusters that both number from 1 (pytest-xdist workers running tests/slurm/ files at once) crossed
# their ranks' messages ("Message from rank 1 and tag 7 truncated" in MPI_Init, 2026-12-02).
JOB_ID_RANGE = (1_000, 60_000_000)              # Slurm's MaxJobId is 67,043,328

# Job states of a job that has ended (and is no longer COMPLETING: its processes are gone).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}

_PR_SET_PDEATHSIG = 1


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here (not root, a package missing), or None."""
    if os.geteuid() != 0:
        return "the Slurm tests start slurmctld, slurmd and munged as root; this run is not root"
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (f"Slurm or munge is not installed ({', '.join(missing)} not on PATH): "
                f"`make slurm-packages` installs Debian's {' '.join(PACKAGES)} (root, apt)")
    try:
        pwd.getpwnam(MUNGE_USER)
    except KeyError:
        return f"no '{MUNGE_USER}' user (the munge package makes it): `make slurm-packages`"
    return None


def _which(name: str) -> str | None:
    """A program on PATH, or in /usr/sbin or /sbin (where Debian puts the daemons; a user's PATH may lack them)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def slurm_version() -> str:
    """The installed Slurm's version, e.g. '22.05.8' (`slurmd -V`: the only command that needs no slurm.conf)."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-V"], capture_output=True, text=True, check=True).stdout
    return out.split()[-1]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (the kernel's choice)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM to this child when the process that started it dies (after any setuid)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class SlurmError(RuntimeError):
    """The cluster did not come up, or a Slurm command failed; the message holds the daemons' log tails."""


class SlurmUnsupported(SlurmError):
    """This Slurm build cannot run the cluster asked for (two slurmd on one host)."""


class SlurmCluster:
    """One controller and `nodes` slurmd on this host (two need a Slurm built with --enable-multiple-slurmd).

    `cpus` and `memory_mb` are what each node declares: with SlurmdParameters=config_overrides Slurm believes them
    even where the machine has fewer cores (tasks are then oversubscribed, which is fine for tiny models). `gpu`
    declares one GPU per node (gres.conf with /dev/null as its device): a job asking for one is scheduled, and
    runs on the CPU."""

    def __init__(self, nodes: int = 1, cpus: int = 2, memory_mb: int = 8000, gpu: bool = False,
                 requeue: dict | None = None):
        self.nodes, self.cpus, self.memory_mb, self.gpu = nodes, cpus, memory_mb, gpu
        self.requeue = dict(FAST_REQUEUE, **(requeue or {}))
        self.host = socket.gethostname().split(".")[0]
        self.root = Path(tempfile.mkdtemp(prefix="hpcinfer-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.socket = self.munge_dir / "munge.socket"
        self.node_names = [self.host] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
        self.first_job_id = JOB_ID_RANGE[0] + secrets.randbelow(JOB_ID_RANGE[1] - JOB_ID_RANGE[0])
        self._daemons: dict[str, subprocess.Popen] = {}
        self._stopped = False
        self.started_s = None

    # ---------------------------------------------------------------------------------------------- set-up
    def start(self, timeout: float = 60) -> "SlurmCluster":
        t0 = time.monotonic()
        atexit.register(self.stop)
        try:
            self._write_files()
            self._start_munged(timeout)
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(lambda: self._run(["scontrol", "ping"], check=False).stdout.count("UP") > 0,
                       timeout, "slurmctld to answer `scontrol ping`")
            if self.nodes > 1 and "MULTIPLE_SLURMD = Yes" not in " ".join(self.scontrol("show", "config").split()):
                raise SlurmUnsupported(f"Slurm {slurm_version()} here was built without --enable-multiple-slurmd "
                                       "(`scontrol show config` has no MULTIPLE_SLURMD = Yes): one slurmd per host")
            for name in self.node_names:
                args = ["slurmd", "-D", "-f", str(self.conf)] + (["-N", name] if self.nodes > 1 else [])
                self._spawn(f"slurmd-{name}", args)
            self._wait(self._all_idle, timeout, f"node(s) {','.join(self.node_names)} to be idle")
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _write_files(self) -> None:
        self.root.chmod(0o755)                      # munged (as munge) must reach its dir below
        for sub in ("state", "log", "run", *(f"spool/{n}" for n in self.node_names)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = pwd.getpwnam(MUNGE_USER)
        self.munge_dir.mkdir(exist_ok=True)
        self.munge_dir.chmod(0o755)                 # munged: "execute permissions for all required" on its socket dir
        key = self.munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self.conf.write_text(self.slurm_conf())
        (self.root / "plugstack.conf").write_text("")      # not /etc/slurm/plugstack.conf: no SPANK plugin
        if self.gpu:                                # declared only: /dev/null as its device (Count= alone registers 0)
            (self.root / "gres.conf").write_text(f"NodeName={','.join(self.node_names)} Name=gpu File=/dev/null\n")

    def slurm_conf(self) -> str:
        """The slurm.conf of this cluster (docs/slurm.md shows the same settings as a recipe)."""
        ctld_port, *node_ports = free_ports(1 + self.nodes)
        r, q = self.root, self.requeue
        lines = [
            "# Written by tests/helpers/slurm_cluster.py: a one-host test cluster (docs/slurm.md).",
            "ClusterName=hpcinfer-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire={q['cred_expire']}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none",
            "MpiDefault=pmi2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            f"SchedulerParameters=sched_interval={q['sched_interval']},bf_interval={q['bf_interval']}",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=600",
            f"FirstJobId={self.first_job_id}",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "Waittime=0",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={r / 'plugstack.conf'}",
        ]
        if self.gpu:
            lines.append("GresTypes=gpu")
        gres = " Gres=gpu:1" if self.gpu else ""
        for name, port in zip(self.node_names, node_ports):
            lines.append(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory={self.memory_mb}{gres} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE "
                     "OverSubscribe=FORCE:8 State=UP")
        return "\n".join(lines) + "\n"

    def _start_munged(self, timeout: float) -> None:
        d = self.munge_dir
        self._spawn("munged", ["munged", "--foreground", f"--socket={self.socket}", f"--key-file={d / 'munge.key'}",
                               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                               f"--seed-file={d / 'munged.seed'}"], user=MUNGE_USER)
        self._wait(self.socket.exists, timeout, "munged's socket")

    def _spawn(self, name: str, args: list[str], user: str | None = None) -> None:
        args = [_which(args[0]) or args[0], *args[1:]]
        log = open(self.root / "log" / f"{name}.console", "w")
        kwargs = {"user": user, "group": user} if user else {}
        self._daemons[name] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env(), preexec_fn=_die_with_parent, cwd=self.root, **kwargs)
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self._daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no sign after {timeout:.0f} s"
                raise SlurmError(f"waiting for {what}: {why}\n{self.log_tails()}")
            time.sleep(0.2)

    def _all_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.node_names)

    # ------------------------------------------------------------------------------------------- commands
    def env(self, extra: dict | None = None, base: dict | None = None) -> dict:
        """An environment for Slurm commands (and the jobs they submit) that finds this cluster."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(OUTER_SLURM_PREFIXES)}         # were the tests run inside a Slurm job
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def _run(self, args: list[str], check: bool = True, env: dict | None = None, cwd=None, timeout: float = 30):
        done = subprocess.run(args, capture_output=True, text=True, env=env or self.env(), cwd=cwd, timeout=timeout)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> str:
        """Submit; returns the job id. `env` is the job's whole environment (sbatch exports it all by default)."""
        done = self._run(["sbatch", "--parsable", *map(str, args)], env=self.env(base=env), cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def scancel(self, *args: str) -> str:
        return self._run(["scancel", *args]).stdout

    def job(self, job_id: str) -> dict:
        """`scontrol show job -o` as a dict of its KEY=VALUE fields (JobState, ExitCode, Restarts, NodeList...)."""
        text = self.scontrol("show", "job", "-o", job_id)
        return dict(m.groups() for m in re.finditer(r"(\w[\w:/]*)=(\S*)", text))

    def wait_for(self, job_id: str, states: set[str], timeout: float) -> dict:
        """Poll until the job's state is one of `states`; returns its fields (SlurmError on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} not {'/'.join(sorted(states))} after {timeout:.0f} s: {info}\n"
                                 f"{self.log_tails()}")
            time.sleep(0.2)

    def wait_done(self, job_id: str, timeout: float) -> dict:
        return self.wait_for(job_id, FINISHED, timeout)

    def job_processes(self, job_id: str) -> list[int]:
        """Pids of the processes of this job still alive here (by SLURM_JOB_ID and this cluster's SLURM_CONF in
        their environment): the batch shell, srun, the ranks."""
        return _pids_with_env({f"SLURM_JOB_ID={job_id}", f"SLURM_CONF={self.conf}"})

    # -------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Cancel the jobs, stop slurmd, slurmctld and munged by pid, then end any process of this cluster left
        (job steps, ranks); idempotent. The temp dir stays when KEEP_SLURM is set (its logs)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._cancel_jobs(timeout=15)
        except (OSError, subprocess.SubprocessError):      # a hung or missing command: the kills below still run
            pass
        for name in sorted(self._daemons, key=lambda n: (n == "munged", n == "slurmctld")):  # slurmd first
            _terminate(self._daemons[name])
        for pid in _pids_with_env({f"SLURM_CONF={self.conf}"}):
            _kill(pid, signal.SIGKILL)
        if not os.environ.get("KEEP_SLURM"):
            shutil.rmtree(self.root, ignore_errors=True)

    def _cancel_jobs(self, timeout: float) -> None:
        """scancel every job (SIGTERM to the batch shells and steps) and wait until none is left, not even
        COMPLETING: their processes then end by themselves, not by SIGKILL."""
        if "slurmctld" not in self._daemons or self._daemons["slurmctld"].poll() is not None:
            return
        self._run(["scancel", "--full", "--partition=test"], check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._run(["squeue", "-h"], check=False, timeout=10).stdout.strip():
            time.sleep(0.3)

    def log_tails(self, lines: int = 25) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")) + [self.munge_dir / "munged.log"]:
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


def _terminate(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _pids_with_env(entries: set[str]) -> list[int]:
    """Pids of the processes whose environment holds every one of `entries` ("NAME=value")."""
    wanted = {e.encode() for e in entries}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:                             # gone, or not ours to read
            continue
        if wanted <= env:
            found.append(int(proc.name))
    return found
