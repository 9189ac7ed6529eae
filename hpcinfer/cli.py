"""Command line: `hpcinfer run | convert | inspect` (also `python -m hpcinfer ...`)."""

from __future__ import annotations

import argparse
import sys

from .errors import HpcinferError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcinfer", description="MPI-launched SPMD transformer inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a generation job (under mpiexec -n N, or alone)")
    run.add_argument("config", help="job config (TOML); see docs/config.md")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value (repeatable), e.g. --set generate.max_new_tokens=64")
    convert = sub.add_parser("convert", help="convert a Hugging Face folder or a .gguf file to an hpcinfer "
                                             "HDF5 checkpoint")
    convert.add_argument("source", help="Hugging Face model folder (config.json + safetensors/bin) or .gguf file")
    convert.add_argument("output", help="output .h5 file")
    convert.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                         help="storage dtype (default float32)")
    inspect = sub.add_parser("inspect", help="print a checkpoint's architecture and tensors, and check it")
    inspect.add_argument("checkpoint")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        from .runtime import main_run

        return main_run(args.config, args.overrides)
    try:
        if args.command == "convert":
            return _convert(args.source, args.output, args.dtype)
        return _inspect(args.checkpoint)
    except HpcinferError as exc:
        print(f"hpcinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _convert(source: str, output: str, dtype: str) -> int:
    import os
    import time

    t0 = time.perf_counter()
    if source.endswith(".gguf"):
        from .checkpoint.gguf import convert_gguf as convert
    elif os.path.isdir(source):
        from .checkpoint.hf import convert_hf as convert
    else:
        from .errors import CheckpointError

        raise CheckpointError(f"convert source '{source}' is neither a .gguf file nor a Hugging Face model "
                              f"folder (a directory with config.json)")
    arch = convert(source, output, dtype)
    print(f"hpcinfer: converted {source} -> {output} ({arch.family}, {arch.num_layers} layers, "
          f"{arch.param_count():,} parameters, {dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _inspect(path: str) -> int:
    from .checkpoint.format import describe, open_checkpoint

    with open_checkpoint(path) as ckpt:
        print(describe(ckpt))
    return 0
