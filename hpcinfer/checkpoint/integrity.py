"""Checkpoint integrity: a CRC-32 per dataset and a manifest of the file's metadata, written when a conversion
finishes (`seal`), checked by `[model] verify = true` and `hpcinfer inspect --verify` (docs/checkpoint-format.md).

- every dataset carries the attribute `crc32`: zlib's CRC-32 of its stored bytes in C order, streamed block by block
  (host memory: one block of at most BLOCK_BYTES);
- the dataset `integrity/manifest` holds JSON describing every object: root and group attributes, and each
  dataset's shape, dtype and attributes (minus `crc32`); the root attribute `manifest_crc32` is its CRC-32.
  A changed hyperparameter, a reshaped, added or removed tensor is named by diffing it against the file.

CRC-32 (not a cryptographic hash) because the threat is accidental damage (a truncated copy, a flipped bit, a
hand-edited attribute), not an attacker: it catches every error burst up to 32 bits and misses random damage with
probability 2^-32, and zlib computes it at several GB/s (blake2b: about 1 GB/s), so verifying costs about what
reading the file costs.
"""

from __future__ import annotations

import io
import json
import re
import zlib

import h5py
import numpy as np

from ..errors import CheckpointError

DATA_ATTR = "crc32"
MANIFEST = "integrity/manifest"
MANIFEST_ATTR = "manifest_crc32"
BLOCK_BYTES = 32 * 2**20
NO_CHECKSUMS = "no checksums stored"


def dataset_crc(ds: h5py.Dataset) -> int:
    """CRC-32 of a dataset's stored bytes (C order), read in blocks of leading rows."""
    if ds.dtype.kind == "O":                       # variable-length strings: their UTF-8 bytes, NUL-separated
        items = np.asarray(ds[()], dtype=object).ravel()
        return zlib.crc32(b"\0".join(v if isinstance(v, bytes) else str(v).encode("utf-8") for v in items))
    if ds.ndim == 0 or ds.size == 0:
        return zlib.crc32(np.ascontiguousarray(ds[()]).tobytes())
    row_bytes = max(1, ds.dtype.itemsize * (ds.size // ds.shape[0]))
    step = max(1, BLOCK_BYTES // row_bytes)
    crc = 0
    for start in range(0, ds.shape[0], step):
        block = np.ascontiguousarray(ds[start:start + step])
        crc = zlib.crc32(memoryview(block).cast("B"), crc)
    return crc


def _plain(value):
    """An attribute value as JSON (bytes -> str, arrays -> lists, NumPy scalars -> Python)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype.kind == "S" else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _attrs(obj) -> dict:
    return {k: _plain(v) for k, v in sorted(obj.attrs.items()) if k not in (DATA_ATTR, MANIFEST_ATTR)}


def describe_objects(file: h5py.File) -> dict:
    """{path: {"attrs"} for groups, {"shape", "dtype", "attrs"} for datasets}, the manifest itself left out."""
    objects = {"/": {"attrs": _attrs(file)}}

    def visit(name, obj):
        if name == MANIFEST or name == MANIFEST.split("/")[0]:
            return
        entry = {"attrs": _attrs(obj)}
        if isinstance(obj, h5py.Dataset):
            entry.update(shape=list(obj.shape), dtype=obj.dtype.str)
        objects[name] = entry

    file.visititems(visit)
    return objects


def _manifest_bytes(file) -> bytes:
    return json.dumps({"algorithm": "crc32", "objects": describe_objects(file)}, sort_keys=True).encode("utf-8")


def seal(file: h5py.File) -> None:
    """Write every dataset's CRC-32 and the manifest (call once, after the last write)."""
    for name, ds in datasets(file):
        ds.attrs[DATA_ATTR] = np.uint32(dataset_crc(ds))
    manifest = _manifest_bytes(file)
    file.create_dataset(MANIFEST, data=np.frombuffer(manifest, dtype=np.uint8))
    file.attrs[MANIFEST_ATTR] = np.uint32(zlib.crc32(manifest))


def datasets(file: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    """Every dataset of the file except the manifest, in a fixed (sorted) order."""
    found = []
    file.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, h5py.Dataset) and
                    name != MANIFEST else None)
    return sorted(found, key=lambda item: item[0])


def has_checksums(file: h5py.File) -> bool:
    return MANIFEST in file and MANIFEST_ATTR in file.attrs


def verify_metadata(path: str, file: h5py.File) -> None:
    """The manifest is intact and the file's attributes, tensors, shapes and dtypes are still what it records."""
    if not has_checksums(file):
        raise CheckpointError(f"checkpoint '{path}': {NO_CHECKSUMS} (it was converted before hpcinfer wrote "
                              f"checksums, or its integrity record was removed); convert it again to verify it, "
                              f"or set [model] verify = false")
    raw = bytes(file[MANIFEST][()])
    if zlib.crc32(raw) != int(file.attrs[MANIFEST_ATTR]):
        raise CheckpointError(f"checkpoint '{path}': its integrity manifest fails its checksum (the file is "
                              f"damaged); convert or copy it again")
    recorded = json.loads(raw)["objects"]
    problem = _first_difference(recorded, describe_objects(file))
    if problem:
        raise CheckpointError(f"checkpoint '{path}' changed after conversion: {problem}; convert or copy it again")


def _first_difference(recorded: dict, current: dict) -> str | None:
    for name in sorted(set(recorded) | set(current)):
        entry = recorded.get(name) or current[name]
        what = "the root" if name == "/" else ("tensor" if "shape" in entry else "group") + f" '{name}'"
        if name not in current:
            return f"{what} is missing (it was written at conversion)"
        if name not in recorded:
            return f"{what} was added"
        old, new = recorded[name], current[name]
        for key in ("shape", "dtype"):
            if old.get(key) != new.get(key):
                return f"{what} has {key} {new.get(key)} ({old.get(key)} when converted)"
        for key in sorted(set(old["attrs"]) | set(new["attrs"])):
            if _show(old["attrs"], key) != _show(new["attrs"], key):          # as JSON, so NaN equals NaN
                return (f"attribute '{key}' of {what} is {_show(new['attrs'], key)[:80]} "
                        f"({_show(old['attrs'], key)[:80]} when converted)")
    return None


def _show(attrs: dict, key: str) -> str:
    return json.dumps(attrs[key], sort_keys=True) if key in attrs else "absent"


def verify_datasets(path: str, file: h5py.File, names: list[str]) -> list[str]:
    """Check the CRC-32 of the named datasets; returns one problem line per failing dataset."""
    problems = []
    for name in names:
        try:
            ds = file[name]
            stored = ds.attrs.get(DATA_ATTR)
            if stored is None:
                problems.append(f"tensor '{name}' has no stored checksum")
                continue
            actual = dataset_crc(ds)
        except (OSError, KeyError, RuntimeError) as exc:
            problems.append(f"tensor '{name}' cannot be read ({exc})")
            continue
        if actual != int(stored):
            problems.append(f"tensor '{name}' fails its checksum (crc32 stored {int(stored):#010x}, "
                            f"read {actual:#010x}): its data changed since conversion")
    return problems


def share(sizes: dict[str, int], world: int, rank: int) -> list[str]:
    """The dataset names `rank` verifies: largest first to the least-loaded rank, so every dataset is checked once
    across the job and each rank reads about 1/world of the bytes. Same answer on every rank."""
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += sizes[name]
        if owner == rank:
            mine.append(name)
    return mine


def verify(path: str, file: h5py.File, rank: int = 0, world: int = 1) -> dict:
    """Check the metadata (every rank) and this rank's share of the datasets' data. Raises CheckpointError naming
    the file and the failing tensors; returns {"datasets", "bytes"} checked here."""
    verify_metadata(path, file)
    sizes = {name: int(ds.size * ds.dtype.itemsize) for name, ds in datasets(file)}
    names = share(sizes, world, rank)
    problems = verify_datasets(path, file, names)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint '{path}' is corrupt: " + "; ".join(problems[:3]) + more +
                              "; convert or copy it again")
    return {"datasets": len(names), "bytes": sum(sizes[n] for n in names)}


def truncation_report(path: str, error: OSError) -> str | None:
    """For a file HDF5 refuses as truncated: which datasets lie (partly) past its end, found by opening it through
    a view padded with zeros to its recorded length. None when the error is not a truncation."""
    found = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", str(error))
    if found is None:
        return None
    size, expected = int(found.group(1)), int(found.group(2))
    try:
        with _ZeroPadded(path, expected) as view, h5py.File(view, "r") as file:
            lost = [name for _, name in sorted(_past_end(file, size))]     # the first one cut comes first
    except (OSError, RuntimeError):
        lost = []                                         # the root metadata is gone too: no names to give
    where = ""
    if lost:
        where = (f": tensor '{lost[0]}' lies past the end" if len(lost) == 1 else
                 f": tensors '{lost[0]}' and {len(lost) - 1} more lie past the end")
    return (f"checkpoint '{path}' is truncated ({size:,} of {expected:,} bytes){where}; the copy or conversion "
            f"did not finish: copy or convert it again")


def _past_end(group, size: int, prefix: str = "") -> list[tuple[float, str]]:
    """(offset, name) of the datasets under `group` whose data or header lies past byte `size` (listing links
    reads no object headers; a dataset whose header is lost sorts last)."""
    lost = []
    for key in group.keys():
        name = prefix + key
        try:
            obj = group[key]
            if isinstance(obj, h5py.Group):
                lost += _past_end(obj, size, name + "/")
                continue
            offset = obj.id.get_offset()
            if offset is not None and offset + obj.id.get_storage_size() > size:
                lost.append((offset, name))
        except (OSError, KeyError, RuntimeError):
            lost.append((float("inf"), name))             # its header itself was cut off
    return lost


class _ZeroPadded(io.RawIOBase):
    """A read-only file object that reads `path` and then zeros up to `size` bytes."""

    def __init__(self, path: str, size: int):
        self.file, self.size, self.pos = open(path, "rb"), size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = (offset, self.pos + offset, self.size + offset)[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buffer):
        view = memoryview(buffer)
        n = max(0, min(len(view), self.size - self.pos))
        self.file.seek(self.pos)
        got = self.file.readinto(view[:n]) or 0
        view[got:n] = bytes(n - got)
        self.pos += n
        return n

    def close(self):
        self.file.close()
        super().close()
