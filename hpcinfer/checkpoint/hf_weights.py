"""Reading a Hugging Face model folder's files: its JSON files and its weights (model.safetensors, sharded
safetensors with an index, or pytorch_model*.bin), one tensor at a time as float32 NumPy arrays."""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from ..errors import CheckpointError


def read_json(path: str, missing_ok: bool = False) -> dict:
    if missing_ok and not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read '{path}': {exc}") from None


class WeightSource:
    """Tensors by Hugging Face name, as float32 NumPy arrays, read one at a time from the folder's weight files."""

    def __init__(self, folder: str):
        self.folder = folder
        self.location: dict[str, str] = {}      # tensor name -> weight file
        self.kind = ""                          # "safetensors" | "bin"
        self._open: dict[str, object] = {}      # safetensors file -> safe_open handle
        self._headers: dict[str, tuple[dict, int]] = {}
        self._bin: tuple[str, dict] | None = None
        self._find_files()

    def _find_files(self) -> None:
        for kind, single, index in (("safetensors", "model.safetensors", "model.safetensors.index.json"),
                                    ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json")):
            index_path = os.path.join(self.folder, index)
            if os.path.isfile(index_path):
                weight_map = read_json(index_path).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{index_path} has no 'weight_map'")
                self.kind = kind
                self.location = {n: os.path.join(self.folder, f) for n, f in weight_map.items()}
                for path in sorted(set(self.location.values())):
                    if not os.path.isfile(path):
                        raise CheckpointError(f"{index_path} names the shard '{os.path.basename(path)}', "
                                              f"which is not in {self.folder}")
                return
            files = [single] if os.path.isfile(os.path.join(self.folder, single)) else \
                sorted(f for f in os.listdir(self.folder)            # shards without an index
                       if f.endswith(".safetensors" if kind == "safetensors" else ".bin")
                       and (kind == "safetensors" or f.startswith("pytorch_model")))
            if files:
                self.kind = kind
                for f in files:
                    path = os.path.join(self.folder, f)
                    names = self._safetensors_header(path)[0] if kind == "safetensors" else \
                        self._load_bin(path).keys()
                    self.location.update({n: path for n in names})
                return
        raise CheckpointError(f"'{self.folder}' has no weights: expected model.safetensors, sharded safetensors "
                              f"with model.safetensors.index.json, or pytorch_model.bin")

    def getter(self, prefixes: tuple[str, ...]) -> Callable[[str], np.ndarray]:
        """get(name) tries the name under each prefix (HF checkpoints are saved with or without the base model's
        prefix, e.g. 'transformer.h.0...' or 'h.0...')."""
        return lambda name: self.get(tuple(prefix + name for prefix in prefixes))

    def get(self, candidates: tuple[str, ...]) -> np.ndarray:
        for name in candidates:
            if name in self.location:
                return self._read(name)
        raise CheckpointError(f"the weights in '{self.folder}' have no tensor '{candidates[0]}'"
                              + (f" (also tried {', '.join(repr(n) for n in candidates[1:])})"
                                 if len(candidates) > 1 else ""))

    def _read(self, name: str) -> np.ndarray:
        path = self.location[name]
        if self.kind == "bin":
            tensor = self._load_bin(path)[name].detach()
            return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        header, data_start = self._safetensors_header(path)
        info = header[name]
        if info["dtype"] == "BF16":
            # NumPy has no bfloat16 (safe_open(framework="np") refuses it): read the raw 16 bits and widen them;
            # bfloat16 is the top half of a float32, so this is exact and needs no torch.
            begin, end = info["data_offsets"]
            bits = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=data_start + begin)
            if bits.size != int(np.prod(info["shape"])):
                raise CheckpointError(f"'{path}' is truncated or corrupt: tensor '{name}' is incomplete")
            return (bits.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
        if info["dtype"] not in ("F64", "F32", "F16"):
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {info['dtype']}; only F32, F16, BF16 and F64 "
                                  f"weights can be converted (quantized checkpoints are not supported)")
        try:
            if path not in self._open:
                from safetensors import safe_open

                self._open[path] = safe_open(path, framework="np")
            return np.asarray(self._open[path].get_tensor(name), dtype=np.float32)
        except Exception as exc:   # noqa: BLE001 - safetensors raises its own SafetensorError for a bad file
            raise CheckpointError(f"cannot read tensor '{name}' from '{path}': {exc}") from None

    def _safetensors_header(self, path: str) -> tuple[dict, int]:
        """The JSON header of a .safetensors file (name -> dtype, shape, data_offsets) and where its data starts."""
        if path not in self._headers:
            try:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"'{path}' is not a readable safetensors file ({exc})") from None
            header.pop("__metadata__", None)
            self._headers[path] = (header, 8 + size)
        return self._headers[path]

    def _load_bin(self, path: str) -> dict:
        """One pytorch_model*.bin shard at a time, memory-mapped."""
        if self._bin is None or self._bin[0] != path:
            self._bin = None
            try:
                import torch
            except ImportError:
                raise CheckpointError(f"'{path}' is a PyTorch pickle: reading it needs torch, which is not "
                                      f"installed (pip install torch), or convert the folder to safetensors "
                                      f"first") from None
            try:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:   # files from torch < 1.6 (not zip archives) cannot be memory-mapped
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:   # noqa: BLE001 - torch raises many kinds for a bad file
                raise CheckpointError(f"cannot read '{path}' with torch.load: {exc}") from None
            self._bin = (path, state)
        return self._bin[1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._open.clear()      # safe_open handles close when released
        self._bin = None
        return False
