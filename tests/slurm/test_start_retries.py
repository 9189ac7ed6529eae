"""slurm_jobs.submit_started against a recording stand-in for the cluster: a two-node job that failed with one of
the known MPI start-up signatures in its log (docs/slurm.md, "Known issue") is submitted again, at most
START_ATTEMPTS times, also when it completed all the same; any other failure, and a clean success, are returned at
once. Runs without Slurm."""

from __future__ import annotations

import pytest

from slurm_jobs import MPI_START_FAILURES, START_ATTEMPTS, submit_started

PMI_CUT = ("slurmstepd-n1: error: mpi/pmi2: full request is: CFC7955[2]40D4F6\n"
           "slurmstepd-n1: error: mpi/pmi2: invalid client request\n")
INIT_TIMEOUT = "Timeout (0:01:00)!\nThread 0x00007f (most recent call first):\n  File \"x.py\", line 70 in load_mpi\n"


class Cluster:
    """sbatch writes the next scripted log and ends the job in the next scripted state."""

    def __init__(self, out, outcomes):
        self.out, self.outcomes, self.envs, self.states = out, list(outcomes), [], {}

    def sbatch(self, args, env, cwd):
        self.envs.append(env)
        job = str(100 + len(self.envs))
        state, text = self.outcomes.pop(0)
        (self.out / f"slurm-{job}.out").write_text(text)
        self.states[job] = state
        return job

    def wait_done(self, job, timeout):
        return {"JobState": self.states[job], "ExitCode": "0:0" if self.states[job] == "COMPLETED" else "1:0"}


@pytest.mark.parametrize("signature", [PMI_CUT, INIT_TIMEOUT, "address.c:1138 Assertion `*addr_version == "
                                                                "UCP_OBJECT_VERSION_V2' failed: addr version 9\n"])
def test_a_start_up_failure_is_submitted_again(tmp_path, signature):
    cluster = Cluster(tmp_path, [("FAILED", signature), ("COMPLETED", "hpcinfer: done\n")])
    job, log, info = submit_started(cluster, "pipeline-2node.slurm", tmp_path, {"A": "1"}, timeout=5)
    assert (job, info["JobState"], len(cluster.envs)) == ("102", "COMPLETED", 2)
    assert log.read_text() == "hpcinfer: done\n"
    assert all(e["HPCINFER_MPI_INIT_TIMEOUT"] == "60" and e["A"] == "1" for e in cluster.envs)


def test_a_completed_start_with_the_fault_in_its_log_is_submitted_again(tmp_path):
    """The cut fell in the card's padding: the job completed, but its log holds slurmstepd's errors."""
    cluster = Cluster(tmp_path, [("COMPLETED", PMI_CUT + "hpcinfer: done\n"), ("COMPLETED", "hpcinfer: done\n")])
    job, log, info = submit_started(cluster, "embed-dp.slurm", tmp_path, {}, timeout=5)
    assert (job, log.read_text(), len(cluster.envs)) == ("102", "hpcinfer: done\n", 2)


def test_other_failures_and_endless_start_failures_are_returned(tmp_path):
    cluster = Cluster(tmp_path, [("FAILED", "hpcinfer: internal error on rank 0:\nTraceback ...\n")])
    assert submit_started(cluster, "x.slurm", tmp_path, {}, timeout=5)[2]["JobState"] == "FAILED"
    assert len(cluster.envs) == 1
    cluster = Cluster(tmp_path, [("FAILED", PMI_CUT)] * START_ATTEMPTS)
    assert submit_started(cluster, "x.slurm", tmp_path, {}, timeout=5)[2]["JobState"] == "FAILED"
    assert len(cluster.envs) == START_ATTEMPTS == 3


def test_the_signatures_do_not_match_an_ordinary_log():
    assert not MPI_START_FAILURES.search("hpcinfer: 6 ranks on 2 node(s)\n[rank 0] progress: 3/3 prompts\n"
                                         "hpcinfer: error on rank 2: [runtime] comm_timeout = 600 s\n")
