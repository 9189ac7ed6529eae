"""Rank 0's side of a generation job's results: resume what a previous run committed, commit each finished batch
round, and write the final file in input order (the fingerprint, sidecar and log are generate/resume.py's).

While the job runs, `[generate] output` is an append-only log in commit order; at the end it is rewritten in input
order, so an uninterrupted run leaves the same file as one that was stopped and resumed.
"""

from __future__ import annotations

import json

from .output import result_record
from .resume import JsonlLog, Sidecar, config_values, file_digest, file_identity, fingerprint

# keys that change where results go or how the job runs, never which results it produces
NOT_IN_FINGERPRINT = frozenset({
    "generate.output", "generate.metrics", "generate.echo", "runtime.threads", "runtime.comm_timeout",
    "runtime.log_level", "runtime.progress", "runtime.cuda_graphs", "offload.disk_dir", "offload.profile"})


def generation_fingerprint(config) -> dict:
    """What determines a generation job's results: the config's values (but NOT_IN_FINGERPRINT), the checkpoint's
    identity (path, size, modification time; none for a preset) and the prompt file's content hash."""
    ckpt = config.model.checkpoint
    return fingerprint({"config": config_values(config, NOT_IN_FINGERPRINT),
                        "checkpoint": file_identity(ckpt) if ckpt is not None else None,
                        "prompts": file_digest(config.generate.prompts)})


class ResultWriter:
    """Commits results to `output`. `done` maps prompt index -> record for every prompt already committed."""

    def __init__(self, output: str, prompts: list, tokenizer, fp: dict, restart: bool = False):
        self.prompts, self.tokenizer, self.fp = prompts, tokenizer, fp
        self.log, self.sidecar = JsonlLog(output), Sidecar(output)
        self.resumed = self.sidecar.start(fp, restart)           # ConfigError when the job changed
        self.done = self._recover() if self.resumed else {}
        self.started = self.resumed                              # a fresh run owns the file from its first commit

    def _recover(self) -> dict:
        by_id = {json.dumps(p.id): i for i, p in enumerate(self.prompts)}
        done = {}
        for record in self.log.recover():
            index = by_id.get(json.dumps(record.get("id")))
            if index is not None:                                # (the fingerprint makes a stranger impossible)
                done[index] = record
        return done

    def commit(self, results: list) -> None:
        """results: [(prompt index, generated ids, finish_reason)] of one batch round, appended in index order."""
        if not self.started:                                     # drop what an older or different run left
            self.log.reset()
            self.sidecar.write(self.fp)
            self.started = True
        fresh = [(i, t, r) for i, t, r in sorted(results, key=lambda r: r[0]) if i not in self.done]
        records = [result_record(self.prompts[i].id, tokens, reason, self.tokenizer) for i, tokens, reason in fresh]
        self.log.append(records)
        self.done.update((i, rec) for (i, _, _), rec in zip(fresh, records))

    def finish(self) -> list[dict]:
        """Every prompt's record in input order, written atomically; the sidecar marks the job complete."""
        missing = [self.prompts[i].id for i in range(len(self.prompts)) if i not in self.done]
        assert not missing, f"prompts without a result: {missing[:5]}"
        records = [self.done[i] for i in range(len(self.prompts))]
        if not self.started:
            self.sidecar.write(self.fp)
        self.log.finalize(records)
        self.sidecar.write(self.fp, complete=True)
        return records
