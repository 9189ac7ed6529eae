"""The fake cupy's errors and its one mutable state (tests/emu_cupy/): current device, stream stack, the capture in
progress, and the fake module of the latest build(). Other modules of the package read `state._state` and
`state._fake` at call time (never a copy), so build() and install() can swap them here."""

from __future__ import annotations

POISON_BYTE = 0xFF          # cp.empty memory: NaN in every float dtype (and bfloat16 bits), -1 in signed ints
GUARD_BYTES = 4096          # poisoned margins around each allocation a kernel gets (see kernels._guarded_launch)


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class CompileException(Exception):
    """As cupy.cuda.compiler.CompileException."""

    def __init__(self, msg, source=None, name=None, options=(), backend="nvrtc"):
        super().__init__(msg)
        self.source, self.name, self.options, self.backend = source, name, options, backend


class _State:
    def __init__(self, devices: int = 1, sm_count: int = 2):
        self.devices, self.sm_count, self.device = devices, sm_count, 0
        self.stack: list = []           # streams entered with `with stream:`
        self.base = None                # stream made current with .use() (None: the null stream)
        self.capturing = None           # the stream whose capture is in progress

    def current(self):
        from .devices import Stream

        return self.stack[-1] if self.stack else (self.base or Stream.null)

    def device_op(self, what: str):
        """Called before device work: returns the op list to record into (or None), or raises when a capture is
        in progress on another stream (CUDA's global capture mode forbids that)."""
        capturing = self.capturing
        if capturing is None:
            return None
        if self.current() is not capturing:
            self._fail(capturing, "cudaErrorStreamCaptureImplicit", f"{what} on another stream")
        return capturing._ops

    def host_sync(self, what: str):
        """A host <-> device transfer or a host sync: not allowed while a stream captures."""
        if self.capturing is not None:
            self._fail(self.capturing, "cudaErrorStreamCaptureUnsupported", what)

    @staticmethod
    def _fail(stream, code: str, what: str):
        reason = (f"{code}: operation not permitted when stream is capturing ({what} during CUDA graph capture: "
                  "no host <-> device copy or sync may happen inside a captured region)")
        stream._invalid = stream._invalid or reason
        raise CUDARuntimeError(reason)


_state = _State()
_fake = None                # the cupy module of the latest build()
