"""The embeddings file (HDF5), written by rank 0 batch by batch into `OUTPUT.partial` and renamed to OUTPUT when
every row is in: an interrupted job never leaves a corrupt OUTPUT, and a re-run with the same fingerprint
(generate/resume.py: config, checkpoint, inputs) resumes the partial file, skipping the rows marked done.

Datasets (docs/embed.md): `embeddings` float32 [N, D] (pooling mean/cls/pooler) or [N, Lmax, D] zero-padded
(pooling none); `ids` [N] UTF-8 strings; `lengths` [N] int64 tokens embedded; `truncated` [N] uint8;
`done` [N] uint8 (every row 1 in a finished file). Root attributes: format, format_version, pooling, normalize,
family, hidden_size, max_length.
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from ..errors import ConfigError
from ..generate.resume import Sidecar

FORMAT_NAME = "hpcinfer-embeddings"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"


class EmbeddingWriter:
    """Rank 0's writer. `start()` returns the done mask [N] (all False for a fresh file)."""

    def __init__(self, path: str, inputs: list, arch, pooling: str, normalize: bool, max_length: int,
                 fingerprint: dict | None = None, restart: bool = False):
        self.path, self.partial = path, path + PARTIAL_SUFFIX
        self.inputs, self.arch, self.pooling = inputs, arch, pooling
        self.normalize, self.max_length = normalize, max_length
        self.fingerprint, self.restart = fingerprint, restart
        self.sidecar = Sidecar(path)
        self.file = None
        self.complete = False
        self.done = None                      # [N] bool once started

    def start(self) -> np.ndarray:
        """Open (resume) or create the partial file; a changed job is a ConfigError. Returns the done mask."""
        self.done = self._start()
        return self.done

    def _start(self) -> np.ndarray:
        if self.fingerprint is not None and self.sidecar.start(self.fingerprint, self.restart):
            state = self.sidecar.read() or {}
            if state.get("complete") and os.path.isfile(self.path):
                self.complete = True                          # nothing left to do: keep the finished file
                return np.ones(len(self.inputs), dtype=bool)
            if os.path.isfile(self.partial):
                self.file = h5py.File(self.partial, "r+")
                self._check_resumable()
                return self.file["done"][()].astype(bool)
        self._create()
        if self.fingerprint is not None:
            self.sidecar.write(self.fingerprint)
        return np.zeros(len(self.inputs), dtype=bool)

    def _create(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        f = self.file = h5py.File(self.partial, "w")
        N, D = len(self.inputs), self.arch.hidden_size
        lengths = np.array([len(x.tokens) for x in self.inputs], dtype=np.int64)
        if self.pooling == "none":
            L = int(lengths.max())
            f.create_dataset("embeddings", (N, L, D), dtype=np.float32, chunks=(1, L, D), fillvalue=0.0)
        else:
            f.create_dataset("embeddings", (N, D), dtype=np.float32, chunks=(min(N, max(1, 65536 // D)), D))
        f.create_dataset("ids", data=[x.id for x in self.inputs], dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("lengths", data=lengths)
        f.create_dataset("truncated", data=np.array([x.truncated for x in self.inputs], dtype=np.uint8))
        f.create_dataset("done", (N,), dtype=np.uint8, fillvalue=0)
        attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "pooling": self.pooling,
                 "normalize": self.normalize, "family": self.arch.family, "hidden_size": D,
                 "max_length": self.max_length}
        f.attrs.update(attrs)
        f.flush()

    def _check_resumable(self) -> None:
        f = self.file
        if f.attrs.get("format") != FORMAT_NAME or f["done"].shape != (len(self.inputs),):
            raise ConfigError(f"'{self.partial}' is not a partial embeddings file of this job; delete it or re-run "
                              f"with --restart")

    def write_rows(self, indices, rows: list) -> None:
        """rows[i] ([D], or [n, D] with pooling none) is the embedding of input indices[i]; flushed at once."""
        order = np.argsort(indices)
        ds = self.file["embeddings"]
        if self.pooling == "none":
            for i in order:
                ds[indices[i], :rows[i].shape[0]] = rows[i]
        else:
            ds[np.asarray(indices)[order]] = np.stack([rows[i] for i in order])
        done = self.file["done"]
        done[np.sort(np.asarray(indices))] = 1
        self.file.flush()

    def finish(self) -> None:
        """Every row written: close and rename the partial file into place; mark the job complete."""
        if self.complete:
            return
        missing = int((self.file["done"][()] == 0).sum())
        self.file.close()
        self.file = None
        if missing:
            raise RuntimeError(f"{missing} embeddings were never written to '{self.partial}'")
        os.replace(self.partial, self.path)
        if self.fingerprint is not None:
            self.sidecar.write(self.fingerprint, complete=True)

    def close(self) -> None:
        """On an error: keep the partial file (a re-run resumes it)."""
        if self.file is not None:
            self.file.close()
            self.file = None


def read_embeddings(path: str) -> dict:
    """The datasets of an embeddings file as NumPy arrays (ids as str): for tests and users."""
    with h5py.File(path, "r") as f:
        out = {name: f[name][()] for name in ("embeddings", "lengths", "truncated")}
        out["ids"] = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in f["ids"][()]]
        out["attrs"] = dict(f.attrs)
    return out
