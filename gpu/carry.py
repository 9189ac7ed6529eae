"""Make `.carry/`: what a GPU session takes to the lent machine (docs/gpu.md, "The GPU check").

The lent machine reaches no package index and a device call carries 64 MiB at most (the working tree included), so:

    .carry/gpu-check/         the one call of `make gpu-check` (gpu/check.py), sized to fit beside the tree:
        whl/                  MPICH (mpi4py's MPI library, if the image's mpi4py finds none) and pytest-mpi, ~13 MB
        smollm2.h5            SmolLM2 with its GGUF blocks kept (Q4_1 layers, Q8_0 embedding) and only its first
                              layers, as many as fit (4: 44 MB): real weights, tokenizer and shapes for the
                              smollm2 step, cupy against numpy (a shallower model: the same code path)

  with --session, also for gpu/session.sh's later calls (the benchmarks that need the whole models):
    .carry/whl/      wheels its image lacks (MPICH, pytest-mpi, gguf, jsonschema and its needs), ~14 MB
    .carry/part1..3  the SmolLM2 GGUF (98 MB) in three parts, gguf.part-0..2, and its sha256 in part1
    .carry/part4     MiniLM (models/all-MiniLM-L6-v2) with its weights in float16 (44 MB instead of 88 MB)

A call names in `carry` the folder it needs (`.carry/gpu-check` for make gpu-check).

    python -m gpu.carry [--session]          (make gpu-carry)
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = ("mpich", "pytest-mpi", "gguf", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
CHECK_WHEELS = ("mpich", "pytest-mpi")
CALL_LIMIT = 64 << 20            # what one device call carries, the working tree included
MARGIN = 3 << 20                 # for files the tree gains before the call (results, notes)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
GGUF_PARTS = 3


def download_wheels(dest: Path, wheels=WHEELS) -> None:
    """The wheels for the lent machine's python3 (CPython 3.12, x86-64), without their dependencies (the image
    has the rest: KINDS.md of the device tool lists them)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *wheels],
                   check=True)


def split_gguf(gguf: Path, carry: Path) -> None:
    """gguf.part-0..N-1 into part1..partN, and gguf.sha256 (of the whole file) beside the first."""
    data = gguf.read_bytes()
    size = -(-len(data) // GGUF_PARTS)
    for k in range(GGUF_PARTS):
        folder = carry / f"part{k + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"gguf.part-{k}").write_bytes(data[k * size:(k + 1) * size])
    (carry / "part1" / "gguf.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {gguf.name}\n")


def minilm_float16(folder: Path, dest: Path) -> None:
    """The MiniLM folder with model.safetensors in float16 (both systems of bench.encoder read
    these weights)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("model.safetensors", "*.h5"))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()},
              str(dest / "model.safetensors"))


def tree_bytes() -> int:
    """Bytes of the working tree that travels: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def truncated_checkpoint(source: Path, dest: Path, layers: int) -> None:
    """dest: source with only its first `layers` layers (num_layers set, the integrity manifest made anew)."""
    import h5py

    from hpcinfer.checkpoint import integrity

    with h5py.File(source, "r") as f, h5py.File(dest, "w") as g:
        for key, value in f.attrs.items():
            g.attrs[key] = value
        g.attrs["num_layers"] = layers
        for name in f:
            if name == "integrity" or (name.startswith("layers.") and int(name.split(".")[1]) >= layers):
                continue
            f.copy(name, g)
        integrity.seal(g)


def smollm2_that_fits(gguf: Path, dest: Path, room: int) -> int:
    """Convert the GGUF with its blocks kept, then keep as many leading layers as fit in `room` bytes (at least
    1); returns that number."""
    kept = dest.with_suffix(".kept.tmp")
    subprocess.run([sys.executable, "-m", "hpcinfer", "convert", str(gguf), str(kept), "--keep-quantized"],
                   check=True, cwd=REPO)
    try:
        import h5py

        with h5py.File(kept, "r") as f:
            total = int(f.attrs["num_layers"])
        layers = total
        while True:
            truncated_checkpoint(kept, dest, layers)
            if dest.stat().st_size <= room or layers == 1:
                return layers
            layers -= 1
    finally:
        kept.unlink(missing_ok=True)


def make_gpu_check(gguf: Path, carry: Path) -> None:
    folder = carry / "gpu-check"
    shutil.rmtree(folder, ignore_errors=True)
    download_wheels(folder / "whl", CHECK_WHEELS)
    wheels = sum(f.stat().st_size for f in (folder / "whl").iterdir())
    room = CALL_LIMIT - MARGIN - tree_bytes() - wheels
    layers = smollm2_that_fits(gguf, folder / "smollm2.h5", room)
    print(f"smollm2.h5: the first {layers} layers, {(folder / 'smollm2.h5').stat().st_size / 1e6:.1f} MB "
          f"(room {room / 1e6:.1f} MB beside the tree and the wheels)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--minilm", default=str(REPO / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--out", default=str(REPO / ".carry"))
    p.add_argument("--session", action="store_true", help="also the wheels and model parts of gpu/session.sh")
    args = p.parse_args(argv)
    carry = Path(args.out)
    needed = [Path(args.gguf)] + ([Path(args.minilm) / "model.safetensors"] if args.session else [])
    for path in needed:
        if not path.exists():
            p.error(f"{path} is missing: run `make model minilm` first")
    carry.mkdir(parents=True, exist_ok=True)
    make_gpu_check(Path(args.gguf), carry)
    if args.session:
        for old in ("whl", "part1", "part2", "part3", "part4"):
            shutil.rmtree(carry / old, ignore_errors=True)
        download_wheels(carry / "whl")
        split_gguf(Path(args.gguf), carry)
        minilm_float16(Path(args.minilm), carry / "part4" / "minilm")
    for folder in sorted(carry.iterdir()):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder}: {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
