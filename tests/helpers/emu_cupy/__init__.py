"""A CPU stand-in for cupy, so that the CuPy backend (hpcinfer/backend/cupy_ops.py) and its cuda_src/ kernels run,
and are tested, on a machine with no GPU.

What it is: a fake `cupy` module (and `cupy.cuda`, `cupyx`) over NumPy. Device arrays are `ndarray` objects that
wrap a NumPy array (their "device memory"); NumPy arrays are host arrays. As cupy's, device arrays are not
`np.ndarray` instances (a subclass would let `isinstance(x, np.ndarray)` host checks and `np.asarray(x)` pass here
and fail on a GPU); a test may peek at the memory as `x._a` without a transfer. Kernels are really run:
`RawModule(code=..., options=...)` compiles the *given source* with its -D options for the CPU emulator
(tests/helpers/kernel_emulator.py: g++ + tests/helpers/cuda_emu.h, one fiber per CUDA thread, cached under
build/kernel-emu/), and `ElementwiseKernel` turns its CUDA snippet into a kernel (a grid-stride loop over i; raw
params are pointers, other arrays are indexed by i, scalars by value) compiled the same way: the real snippets run.

Use it (pytest; tests/helpers/ is on sys.path through tests/conftest.py):
    # the fixture `emu_cupy` (tests/conftest.py, function scope) yields the fake module:
    def test_x(emu_cupy): ops = CupyOps(device=0)       # or make_ops("cupy", 0); nests in installed()
    import emu_cupy as emu                              # any scope: `with emu.installed() as cp:` (module fixtures),
    emu.install(monkeypatch, devices=1, sm_count=2)     # or with a MonkeyPatch; both return the fake module
    # a whole GPU-only test module on the fake, as a plugin (CLI subprocesses do not see the fake: deselect them):
    #   PYTHONPATH=tests/helpers .venv/bin/python -m pytest -p emu_cupy tests/backend/test_cupy_ops.py \
    #       -k "not smollm2 and not cli"

What it checks, as a GPU would refuse it:
- host/device separation: `np.asarray(device_array)` raises (as cupy), mixing host NumPy arrays into device math
  raises TypeError, device arrays are not `np.ndarray`; `cp.empty` memory starts as 0xFF bytes (NaN, -1) so an
  op that leaves part of its output unwritten shows it;
- kernel launches: argument count, pointer dtypes against the kernel's C types (T_STORAGE / T_ACT from the -D
  options), scalar sizes (cupy passes a numpy scalar's bytes as they are, a Python int as int64, a float as
  float64: `int` params need np.int32, `long long` np.int64, `float` np.float32), host arrays given as pointers,
  the emulator's deadlock check (a __syncthreads or shuffle not reached by every thread), and bounds: a kernel
  gets each array's whole allocation between 4 KiB margins of 0xFF bytes, so a read just past it reads NaN / -1
  and a write past it is reported;
- ElementwiseKernel: its snippet compiles as C++ and array dtypes equal the declared ones ("Type is mismatched");
- CUDA graphs: while a stream captures, every device computation runs AND is recorded (a closure writing the same
  output memory); views are not recorded. Host <-> device transfers and syncs inside capture (`cp.asarray(host)`,
  `.get()`, `.set()`, `synchronize()`, `int()`/`bool()`/`float()` of a device array, host index arrays, boolean
  mask indexing, nonzero/unique, ...)
  raise `cuda.runtime.CUDARuntimeError` (cudaErrorStreamCaptureUnsupported) and invalidate the capture (its
  end_capture raises too); device work on another stream during a capture raises cudaErrorStreamCaptureImplicit.
  cuBLAS calls on the capturing stream (`cupy.matmul`, `dot`, `vdot`, `inner`, `tensordot`, `einsum`, the `@`
  operator, `ndarray.dot`) raise NotImplementedError("calling cuBLAS API during stream capture is currently
  unsupported"), as CuPy 14's cublas.setStream does (cupy/cupy#6290), before anything is recorded: the capture
  stays valid. (`cupy.random`, which CuPy refuses likewise for cuRAND, is not emulated at all.)
  `end_capture()` returns a Graph whose `launch()` replays the closures in order with the same memory and the same
  scalars, as a CUDA graph does: a value baked in from the host at capture time gives wrong results at replay.
- streams, events and pinned memory (an async copy engine's ordering bugs): the current stream is per host thread
  (`with s:` / `s.use()` on one thread leave the others' alone), as cupy's; the capture state is global. Device
  work runs at once, on the host; async copies do not: `dst.set(host, stream=s)` and
  `src.get(stream=s, out=host, blocking=False)` (s not the null stream; a get with stream=None uses the current
  stream) with a pinned host array (`cupyx.empty_pinned` / `zeros_pinned` and views of them; `empty_pinned` memory
  starts as 0xFF bytes) are queued on s; a download's host `out` is poisoned (0xFF) at once (an upload's device
  destination is not: a download queued before it on s must still read the old contents). Queued copies run,
  in order, when s is flushed: `s.synchronize()`; `ev.synchronize()` or `other.wait_event(ev)` for an event
  recorded on s (up to the event); `Device().synchronize()` / `runtime.deviceSynchronize()` (every stream); a
  blocking `get` on s; device work on s itself (stream order; kernels with `stream=` count as work on it); and
  device work (or a synchronous transfer or sync) on the legacy null stream flushes every *blocking* stream
  (`Stream()`, non_blocking=False), never a non_blocking one. `ev.done` is a query (True once the queue has run
  past the event; runs nothing); an event recorded with nothing queued is done at once; one recorded on the null
  stream marks every blocking stream's queue. A host -> device copy takes a snapshot of its host bytes when issued
  and raises `StreamOrderError` (an AssertionError) when it runs if they changed (a pinned buffer reused before
  the copy's event completed). Until it runs, its destination bytes are "pending": any op, kernel launch,
  ElementwiseKernel, Graph.launch, synchronous get/set/item/int() that touches them (views of the same allocation
  included; only the overlapping bytes count) raises `StreamOrderError` naming the stream, except ops that only
  make a view. A device -> host copy reads the device memory when it runs, so device work issued meanwhile on
  another stream without a wait shows in `out` (the race a late copy has on a GPU). Copies with pageable host
  memory run at once (CUDA stages them synchronously) and count in `_state.pageable_async_copies`; queued copies
  that ran count in `_state.async_copies` and `_state.async_copy_bytes`. Every host <-> device copy whose host
  memory is not pinned, synchronous ones included (`cupy.asarray(host)`, `.get()`, `.set()`, `int()` of a device
  array, host index arrays), is logged in `_state.pageable_copies` (pageable.py: direction, bytes, call, dtype
  kind; `pageable.watch()` gives those of a block), as CUDA stages each of them synchronously. Copies without a stream (or on the null
  stream) are synchronous, as before. Async copies inside a capture raise, as other transfers.
- NCCL is absent (`cupy.cuda.nccl.available` is False), as on a machine without the library.

What it cannot check: speed (an emulated launch costs ~0.01-0.1 s: keep models tiny); the memory model (blocks
run one after another, threads switch only at barriers: a missing __syncthreads or a race can pass; an access far
outside an allocation is not caught); real NVRTC (a source g++ accepts may still fail NVRTC:
tests/kernels/test_kernels_compile.py checks that); cuBLAS numerics (matmul is NumPy's); concurrency between streams for
device work (it runs at once, in host order: a missing wait between two compute streams, or a kernel reading
memory that a device -> device copy on another stream writes, passes; only host <-> device copies are deferred);
write-after-read races on an async copy's
destination (a pending H2D copy overwriting memory that earlier work on another stream still reads looks like it
ran after that work); memory reuse across streams (memory pools and allocators are no-ops: no out-of-memory, no
stream-ordered reuse of freed blocks, so a missing `reuse_after` wait passes); Graph.launch checks only the
memory its recorded work touched; a capture runs the work eagerly too (CUDA only records it), so results computed
inside a capture are already there before the first launch; device work on a non-capturing stream during a
capture (legal in CUDA from another thread) is refused, as before.

Where it is (tests/helpers/emu_cupy/, one module per part of the fake):
    state.py      errors (CUDARuntimeError, StreamOrderError, CompileException), the poison constants, and the one
                  mutable state (`_state`: device, per-thread stream stack, capture, copy queues, pending device
                  memory, pinned buffers, copy counters; `_fake`: the module of the latest build())
    arrays.py     device arrays: `ndarray` (get/set, async copies queued on a stream) and `_op` (run a NumPy
                  function on device memory, recorded in a capture)
    functions.py  the module's functions (asarray, empty, ...; any NumPy function through __getattr__), cupyx's
                  pinned arrays
    kernels.py    RawModule, RawKernel, ElementwiseKernel on the CPU emulator, the guarded launch
    devices.py    Device, Stream (its copy queue and flushes), Graph, Event, memory pools, cupy.cuda.runtime
    pageable.py   the log of host <-> device copies with pageable host memory (PageableCopy, watch())
    __init__.py   the assembly: build() the fake modules, install() / installed() them, the pytest plugin hooks
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

import kernel_emulator as emulate

from . import pitched, state
from .arrays import ndarray
from .devices import (Device, Event, Graph, MemoryPool, PinnedMemoryPool, Stream, _default_pool, _pinned_pool,
                      _runtime_module, get_current_stream, using_allocator)
from .functions import (_module_getattr, _scatter_add, array, asarray, ascontiguousarray, asnumpy, empty, empty_like,
                        empty_like_pinned, empty_pinned, get_array_module, is_available, zeros_like_pinned,
                        zeros_pinned)
from .kernels import ElementwiseKernel, RawKernel, RawModule
from .state import GUARD_BYTES, POISON_BYTE, CompileException, CUDARuntimeError, StreamOrderError

__all__ = ["CUDARuntimeError", "CompileException", "Device", "ElementwiseKernel", "Event", "GUARD_BYTES", "Graph",
           "MemoryPool", "POISON_BYTE", "PinnedMemoryPool", "RawKernel", "RawModule", "Stream", "StreamOrderError",
           "array", "asarray", "ascontiguousarray", "asnumpy", "build", "empty", "empty_like", "empty_pinned",
           "get_array_module", "get_current_stream", "install", "installed", "is_available", "ndarray",
           "using_allocator", "zeros_pinned"]

__version__ = "14.0.0+emulated"


def __getattr__(name):
    """`emu_cupy._state` and `emu_cupy._fake`: the live values, owned by state.py (build() and install() swap them)."""
    if name in ("_state", "_fake"):
        return getattr(state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build(devices: int = 1, sm_count: int = 2) -> dict[str, types.ModuleType]:
    """A fresh fake cupy: {module name: module} for sys.modules (state reset: no capture, device 0)."""
    state._state = state._State(devices, sm_count)
    Stream.null._ops = Stream.null._invalid = None
    Stream.null._queue, Stream.null._enqueued, Stream.null._flushed = [], 0, 0

    cp = types.ModuleType("cupy")
    cp.__doc__ = "CuPy stand-in over NumPy and the CPU kernel emulator (tests/helpers/emu_cupy/)"
    cp.__version__ = __version__
    cp.__path__ = []                       # a package: `import cupy.cuda` finds the fake submodules in sys.modules
    for name, value in dict(ndarray=ndarray, asarray=asarray, array=array, ascontiguousarray=ascontiguousarray,
                            asnumpy=asnumpy, empty=empty, empty_like=empty_like, get_array_module=get_array_module,
                            is_available=is_available, RawModule=RawModule, RawKernel=RawKernel,
                            ElementwiseKernel=ElementwiseKernel).items():
        setattr(cp, name, value)
    cp.asanyarray = asarray
    cp.get_default_memory_pool = lambda: _default_pool
    cp.get_default_pinned_memory_pool = lambda: _pinned_pool
    cp.__getattr__ = _module_getattr
    cp._emulated = True

    cuda = types.ModuleType("cupy.cuda")
    cuda.__path__ = []
    runtime = _runtime_module()
    runtime.memcpy2DAsync = _memcpy2d_async
    compiler = types.ModuleType("cupy.cuda.compiler")
    compiler.CompileException = CompileException
    nvrtc = types.ModuleType("cupy.cuda.nvrtc")
    nvrtc.getVersion = lambda: (12, 8)
    nccl = types.ModuleType("cupy.cuda.nccl")   # as cupy without the NCCL library: imports, not available
    nccl.available = False
    graph = types.ModuleType("cupy.cuda.graph")
    graph.Graph = Graph
    for name, value in dict(runtime=runtime, compiler=compiler, nvrtc=nvrtc, nccl=nccl, graph=graph,
                            Device=Device, Stream=Stream, Event=Event, Graph=Graph, MemoryPool=MemoryPool,
                            PinnedMemoryPool=PinnedMemoryPool, using_allocator=using_allocator,
                            get_current_stream=get_current_stream, is_available=is_available,
                            set_allocator=lambda allocator=None: None,
                            set_pinned_memory_allocator=lambda allocator=None: None).items():
        setattr(cuda, name, value)
    cp.cuda = cuda
    cp.RawModule, cp.RawKernel = RawModule, RawKernel

    cupyx = types.ModuleType("cupyx")
    cupyx.scatter_add = _scatter_add
    for name, value in dict(empty_pinned=empty_pinned, zeros_pinned=zeros_pinned, empty_like_pinned=empty_like_pinned,
                            zeros_like_pinned=zeros_like_pinned).items():
        setattr(cupyx, name, value)
    state._fake = cp
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.compiler": compiler,
            "cupy.cuda.nvrtc": nvrtc, "cupy.cuda.nccl": nccl, "cupy.cuda.graph": graph, "cupyx": cupyx}


def _memcpy2d_async(*args):
    state._state.host_sync("runtime.memcpy2DAsync (host <-> device copy)")
    pitched.memcpy2DAsync(*args)


def install(monkeypatch, devices: int = 1, sm_count: int = 2) -> types.ModuleType:
    """Put a fresh fake cupy in sys.modules (hiding any real cupy module and submodule) and point
    hpcinfer.backend.cupy_ops at it, for the life of `monkeypatch`; the kernel loader's caches are cleared.
    Returns the fake cupy module."""
    from hpcinfer.backend import cupy_ops
    from hpcinfer.kernels import loader

    reason = emulate.unavailable()
    if reason:
        pytest.skip(f"the CuPy emulator runs kernels on the CPU emulator, which is unavailable: {reason}")
    monkeypatch.setattr(state, "_state", state._state)   # no change now: restored as they are when monkeypatch
    monkeypatch.setattr(state, "_fake", state._fake)     # undoes (a nested install gives the outer one back)
    modules = build(devices, sm_count)
    for name in [n for n in sys.modules if n.split(".")[0] in ("cupy", "cupyx", "cupy_backends")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cp = modules["cupy"]
    monkeypatch.setattr(cupy_ops, "_driver_loads", lambda: True)   # the emulated machine has its driver (for a
    monkeypatch.setattr(cupy_ops, "_import_cupy", lambda: cp)      # gpu_available imported before the install)
    monkeypatch.setattr(cupy_ops, "gpu_available", lambda: True)
    loader.clear_cache()
    monkeypatch.setattr(loader, "_modules", {})       # kernels loaded on the fake stay with it
    monkeypatch.setattr(loader, "_kernels", {})
    return cp


@contextlib.contextmanager
def installed(devices: int = 1, sm_count: int = 2):
    """install() for any scope (module and session fixtures, plain code): yields the fake cupy module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield install(monkeypatch, devices, sm_count)


def pytest_configure(config):
    """As a plugin (`PYTHONPATH=tests/helpers python -m pytest -p emu_cupy tests/<layer>/test_x.py`): the whole
    session runs on the fake cupy, installed before collection, so GPU-only test modules (whose skip checks call
    gpu_available at import) run here. Not a plugin otherwise: importing this module registers only the fixture."""
    monkeypatch = pytest.MonkeyPatch()
    config._emu_cupy_monkeypatch = monkeypatch
    reason = emulate.unavailable()
    if reason:
        raise pytest.UsageError(f"-p emu_cupy: the kernel emulator is unavailable: {reason}")
    install(monkeypatch)


def pytest_unconfigure(config):
    monkeypatch = getattr(config, "_emu_cupy_monkeypatch", None)
    if monkeypatch is not None:
        monkeypatch.undo()

