"""An open GGUF file: llama.cpp's `gguf` reader (memory-mapped) and the path, so that every error names the file.
The converter (gguf.py) and the tokenizer reader (gguf_tokenizer.py) both read through it."""

from __future__ import annotations

import os

from ..errors import CheckpointError


class GgufFile:
    """The open reader plus the path, so that every error can name the file."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise CheckpointError(f"GGUF file '{path}' does not exist")
        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file '{path}' is not a file")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise CheckpointError(f"GGUF file '{path}' cannot be read ({exc.strerror})") from None
        if magic != b"GGUF":
            raise CheckpointError(f"'{path}' is not a GGUF file (it starts with {magic!r}; a GGUF file starts "
                                  f"with b'GGUF')")
        try:
            import gguf
        except ImportError:
            raise CheckpointError("converting a GGUF file needs the `gguf` package: pip install gguf") from None
        self.gguf = gguf
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, struct/numpy errors on a damaged file
            raise CheckpointError(f"GGUF file '{path}' is damaged or of an unsupported version ({exc})") from None

    def get(self, key: str, default=None):
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"GGUF file '{self.path}' lacks the metadata key '{key}'")
        return value
