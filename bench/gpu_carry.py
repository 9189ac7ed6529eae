"""Make `.carry/`: what a GPU session takes to the lent machine (docs/gpu.md, "What a GPU session must run first").

The lent machine reaches no package index and a device call carries 64 MiB at most (the working tree included), so:

    .carry/whl/      wheels its image lacks (MPICH, pytest-mpi, gguf, jsonschema and its needs), ~14 MB
    .carry/part1..3  the SmolLM2 GGUF (98 MB) in three parts, gguf.part-0..2, and its sha256 in part1
    .carry/part4     MiniLM (models/all-MiniLM-L6-v2) with its weights in float16 (44 MB instead of 88 MB)

A call names in `carry` the folders it needs; bench/gpu_session.sh's `stash` step moves the parts to /tmp/carry,
where they stay while the machine is warm, and `models` joins, checks and converts them.

    python -m bench.gpu_carry          (make gpu-carry)
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
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
GGUF_PARTS = 3


def download_wheels(dest: Path) -> None:
    """The wheels for the lent machine's python3 (CPython 3.12, x86-64), without their dependencies (the image
    has the rest: KINDS.md of the device tool lists them)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *WHEELS],
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
    """The MiniLM folder with model.safetensors in float16 (both systems of bench.encoder read these weights)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("model.safetensors", "*.h5"))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()},
              str(dest / "model.safetensors"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--minilm", default=str(REPO / "models" / "all-MiniLM-L6-v2"))
    p.add_argument("--out", default=str(REPO / ".carry"))
    args = p.parse_args(argv)
    carry = Path(args.out)
    for path in (Path(args.gguf), Path(args.minilm) / "model.safetensors"):
        if not path.exists():
            p.error(f"{path} is missing: run `make model minilm` first")
    shutil.rmtree(carry, ignore_errors=True)
    download_wheels(carry / "whl")
    split_gguf(Path(args.gguf), carry)
    minilm_float16(Path(args.minilm), carry / "part4" / "minilm")
    for folder in sorted(carry.iterdir()):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder}: {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
