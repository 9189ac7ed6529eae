"""Host <-> device copies for the offload tiers: the seam between what moves (offload/tiers.py, generate/schedules/zigzag.py)
and how a backend moves it. `ops.copy_engine()` gives one per user; its methods:

    host_buffer(shape, dtype) -> host array      a buffer the device copies at full speed (pinned memory on CUDA)
    host_copy(array) -> host array               an array's copy in such a buffer (the host tier's store)
    upload(host_arrays, pinned) -> Upload        host -> new device arrays, started now (on a prefetch thread too);
                                                 Upload.arrays() on the compute thread gives them, ready for the
                                                 work issued after it
    upload_into(device_array, host_array, pinned) -> Upload   host -> an existing device array, after
                                                 the work issued so far (which may still read it)
    download(device_array, out) -> Download      device -> a host buffer, after the work issued so far;
                                                 Download.wait() blocks the host until `out` holds it;
                                                 Download.fence(): the compute issued from now on comes after
                                                 it (it may overwrite device_array then)
    freeing()                                    a context around dropping uploaded arrays (their memory may be
                                                 reused by a later upload only after the work issued before it)
    close()                                      wait for copies in flight

NumPy (this module, `HostCopies`): the "device" is host memory, so a copy is a copy made at once and every wait
is nothing. CuPy (backend/cupy_transfer.py, `StreamCopies`): pinned buffers, a copy stream and CUDA events.
"""

from __future__ import annotations

import contextlib

import numpy as np


class Ready:
    """A copy that is already done: arrays() / wait() give its result."""

    def __init__(self, result):
        self.result = result

    def arrays(self):
        return self.result

    wait = arrays

    def fence(self) -> None:
        pass


class HostCopies:
    """The copy engine of the NumPy backend: every copy is made at once, on the calling thread."""

    def host_buffer(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def host_copy(self, array) -> np.ndarray:
        return np.array(array)

    def upload(self, host_arrays: list, pinned: bool = True) -> Ready:
        return Ready([np.array(a) for a in host_arrays])           # a new "device" array each, as a real upload

    def upload_into(self, device_array, host_array, pinned: bool = True) -> Ready:
        device_array[...] = host_array
        return Ready([device_array])

    def download(self, device_array, out: np.ndarray) -> Ready:
        out[...] = device_array
        return Ready(out)

    def freeing(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
