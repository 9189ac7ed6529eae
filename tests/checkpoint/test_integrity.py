"""Checkpoint integrity: the CRC-32s and manifest `convert` writes, and each kind of damage caught, tensor named.

One tiny llama (tests/helpers/hf_models.py) is converted once per module (float32, bfloat16 and int8-quantized); each
case copies it and damages the copy with h5py or raw byte edits. In-process checks cover each kind of damage; the
command line (`inspect --verify`, `run` with `[model] verify = true` on 2 ranks) is checked on a few of them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import save_tiny_model  # noqa: E402
from hpcinfer.checkpoint import integrity  # noqa: E402
from hpcinfer.checkpoint.format import open_checkpoint  # noqa: E402
from hpcinfer.checkpoint.hf import convert_hf  # noqa: E402
from hpcinfer.errors import CheckpointError  # noqa: E402

TENSOR = "layers.1.mlp.up.weight"
ERROR = "hpcinfer: error"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"float32" | "bfloat16" | "int8": converted checkpoint path}."""
    root = tmp_path_factory.mktemp("integrity")
    folder = save_tiny_model("llama", root / "hf")
    out = {}
    for name, dtype, quant in (("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"),
                               ("int8", "float32", "int8")):
        out[name] = root / f"{name}.h5"
        convert_hf(folder, str(out[name]), dtype, quant)
    return out


def damaged(src: Path, tmp: Path, edit=None, raw=None) -> Path:
    """A copy of `src` changed through h5py (`edit(file)`) and/or on its bytes (`raw(path)`)."""
    path = tmp / "damaged.h5"
    shutil.copyfile(src, path)
    if edit is not None:
        with h5py.File(path, "r+") as f:
            edit(f)
    if raw is not None:
        raw(path)
    return path


def verify_error(path: Path) -> str:
    """The CheckpointError message of opening and verifying `path` (the test fails if there is none)."""
    with pytest.raises(CheckpointError) as info:
        with open_checkpoint(str(path)) as ckpt:
            ckpt.verify()
    return str(info.value)


def flip_byte(name: str, at: int = 100):
    def raw(path):
        with h5py.File(path, "r") as f:
            offset = f[name].id.get_offset() + at
        with open(path, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ 0x10]))

    return raw


def truncate_inside(name: str):
    def raw(path):
        with h5py.File(path, "r") as f:
            ds = f[name]
            cut = ds.id.get_offset() + ds.id.get_storage_size() // 2
        os.truncate(path, cut)

    return raw


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_converted_checkpoints_verify(ckpts, kind):
    with open_checkpoint(str(ckpts[kind])) as ckpt:
        done = ckpt.verify()
        names = [name for name, _ in integrity.datasets(ckpt.file)]
        assert done["datasets"] == len(names) and done["bytes"] > 0
        assert all(integrity.DATA_ATTR in ckpt.file[n].attrs for n in names)
    if kind == "int8":                                 # each of q / scale stored with its own checksum
        assert f"{TENSOR}.q" in names and f"{TENSOR}.scale" in names


def test_flipped_byte_names_the_tensor(ckpts, tmp_path):
    message = verify_error(damaged(ckpts["float32"], tmp_path, raw=flip_byte(TENSOR)))
    assert f"tensor '{TENSOR}' fails its checksum" in message and "damaged.h5" in message


def test_flipped_byte_in_quantized_scale(ckpts, tmp_path):
    message = verify_error(damaged(ckpts["int8"], tmp_path, raw=flip_byte(f"{TENSOR}.scale", at=4)))
    assert f"tensor '{TENSOR}.scale' fails its checksum" in message


def test_every_flipped_tensor_is_caught(ckpts, tmp_path):
    """A flip in any one tensor is caught, and only that tensor is named."""
    with h5py.File(ckpts["bfloat16"], "r") as f:
        names = [n for n, ds in integrity.datasets(f) if ds.id.get_offset() is not None]
    for name in names[::3]:
        message = verify_error(damaged(ckpts["bfloat16"], tmp_path, raw=flip_byte(name, at=1)))
        assert f"tensor '{name}' fails" in message and message.count("fails its checksum") == 1


def test_truncated_file_names_the_cut_tensor(ckpts, tmp_path):
    path = damaged(ckpts["float32"], tmp_path, raw=truncate_inside("layers.2.mlp.up.weight"))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(path))                     # refused on open, verify or not
    message = str(info.value)
    assert "is truncated" in message and "tensors 'layers.2.mlp.up.weight' and" in message and str(path) in message


def test_missing_tensor_named(ckpts, tmp_path):
    path = damaged(ckpts["float32"], tmp_path, edit=lambda f: f.__delitem__(TENSOR))
    assert f"missing tensor '{TENSOR}'" in verify_error(path)


def test_removed_quantized_part_named(ckpts, tmp_path):
    path = damaged(ckpts["int8"], tmp_path, edit=lambda f: f.__delitem__(f"{TENSOR}.scale"))
    assert f"tensor '{TENSOR}.scale' is missing" in verify_error(path)


def test_wrong_shape_named(ckpts, tmp_path):
    def edit(f):
        del f[TENSOR]
        f.create_dataset(TENSOR, data=np.zeros((3, 3), np.float32))

    assert f"tensor '{TENSOR}' has shape (3, 3)" in verify_error(damaged(ckpts["float32"], tmp_path, edit))


@pytest.mark.parametrize("edit, fragment", [
    (lambda f: f.attrs.modify("rope_theta", 1e4), "attribute 'rope_theta' of the root is 10000.0 (500000.0"),
    (lambda f: f.attrs.modify("norm_eps", 1e-3), "attribute 'norm_eps' of the root"),
    (lambda f: f[f"{TENSOR}.q"].attrs.modify("group_size", 7), f"attribute 'group_size' of tensor '{TENSOR}.q'"),
    (lambda f: f.create_dataset("extra", data=np.zeros(2)), "tensor 'extra' was added"),
])
def test_changed_attribute_named(ckpts, tmp_path, edit, fragment):
    message = verify_error(damaged(ckpts["int8"], tmp_path, edit))
    assert "changed after conversion" in message and fragment in message


def test_damaged_manifest(ckpts, tmp_path):
    def edit(f):
        data = f[integrity.MANIFEST][()]
        data[10] ^= 1
        f[integrity.MANIFEST][...] = data

    assert "manifest fails its checksum" in verify_error(damaged(ckpts["float32"], tmp_path, edit))


def test_old_file_says_no_checksums(ckpts, tmp_path):
    def edit(f):                                      # what a checkpoint written before checksums looks like
        del f["integrity"]
        del f.attrs[integrity.MANIFEST_ATTR]
        for _, ds in integrity.datasets(f):
            del ds.attrs[integrity.DATA_ATTR]

    path = damaged(ckpts["float32"], tmp_path, edit)
    with open_checkpoint(str(path)) as ckpt:            # still loads
        assert ckpt.read("embed.tokens").shape[0] == ckpt.arch.vocab_size
    assert integrity.NO_CHECKSUMS in verify_error(path)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_share_checks_each_dataset_once(world):
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(40)}
    shares = [integrity.share(sizes, world, rank) for rank in range(world)]
    assert sorted(n for s in shares for n in s) == sorted(sizes)
    loads = [sum(sizes[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())          # greedy balance


def test_crc_streams_in_blocks(tmp_path, monkeypatch):
    data = np.random.default_rng(0).random((37, 5)).astype(np.float32)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["x"] = data
        whole = integrity.dataset_crc(f["x"])
        monkeypatch.setattr(integrity, "BLOCK_BYTES", 3 * 5 * 4)                # 3 rows per block
        assert integrity.dataset_crc(f["x"]) == whole
    import zlib

    assert whole == zlib.crc32(data.tobytes())


# ------------------------------------------------------------------------------------------ command line

def test_inspect_verify_ok_and_corrupt(ckpts, tmp_path, run_cli):
    done = run_cli(["inspect", "--verify", ckpts["float32"]], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "checksums: crc32" in done.stdout and "verify: OK" in done.stdout
    path = damaged(ckpts["float32"], tmp_path, raw=flip_byte(TENSOR))
    done = run_cli(["inspect", "--verify", path], timeout=60)
    assert done.returncode == 2 and f"tensor '{TENSOR}' fails its checksum" in done.stderr
    done = run_cli(["inspect", path], timeout=60)                 # without --verify the structure still passes
    assert done.returncode == 0


def _config(tmp: Path, ckpt: Path, verify: bool) -> Path:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [i + 1, 5, 7]}) + "\n" for i in range(3)))
    path = tmp / "job.toml"
    path.write_text(f'[model]\ncheckpoint = "{ckpt}"\nverify = {str(verify).lower()}\n\n'
                    f'[generate]\nprompts = "{prompts}"\noutput = "{tmp / "out.jsonl"}"\nmax_new_tokens = 2\n')
    return path


@pytest.mark.parametrize("damage", ["flip", "attribute"])
def test_run_with_verify_stops_every_rank(ckpts, tmp_path, run_cli, damage):
    """Two ranks (tp=2): the damage is found before any weight is loaded; one message, exit 2, no output."""
    edit = (lambda f: f.attrs.modify("rope_theta", 1e4)) if damage == "attribute" else None
    path = damaged(ckpts["float32"], tmp_path, edit=edit, raw=flip_byte(TENSOR) if damage == "flip" else None)
    done = run_cli(["run", _config(tmp_path, path, True), "--set", "parallel.tp=2"], n=2, timeout=90)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(ERROR) == 1 and str(path) in done.stderr
    assert (TENSOR if damage == "flip" else "rope_theta") in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_run_with_verify_on_a_good_checkpoint(ckpts, tmp_path, run_cli):
    done = run_cli(["run", _config(tmp_path, ckpts["bfloat16"], True)], n=2, timeout=90)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_seal_covers_any_dataset_and_attribute(tmp_path):
    """Beyond tensors: string datasets, groups, NaN attributes (equal to themselves), then a change to each."""
    path = tmp_path / "any.h5"
    with h5py.File(path, "w") as f:
        f.attrs["nan"] = float("nan")
        f.create_dataset("words", data=["alpha", "βeta"], dtype=h5py.string_dtype())
        f.create_group("g").create_dataset("x", data=np.arange(6, dtype=np.int64).reshape(2, 3))
        integrity.seal(f)
    with h5py.File(path, "r+") as f:
        assert integrity.verify(str(path), f) == {"datasets": 2, "bytes": 64}
        f["words"][1] = "gamma"
        assert "tensor 'words' fails its checksum" in integrity.verify_datasets(str(path), f, ["words"])[0]
        f["g"].attrs["new"] = 1
        with pytest.raises(CheckpointError, match="attribute 'new' of group 'g' is 1 \\(absent when converted\\)"):
            integrity.verify_metadata(str(path), f)
