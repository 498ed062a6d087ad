"""Device buffers of the vendor under test for the I/O tests: poisoned at creation, filled
and read back through the vendor's own copies, and the extent check every test uses."""

from __future__ import annotations

import numpy as np

from phoenix.vendor import CopyKind

POISON = 0xA5


class Dev:
    """``n`` bytes of device memory, poisoned (``POISON``) when made."""

    def __init__(self, rt, n: int):
        self.rt, self.n = rt, n
        self.ptr = rt.device_alloc(max(n, 1))
        self.poison()

    def buf(self):
        return (self.ptr, self.n)

    def fill(self, data: np.ndarray):
        data = np.ascontiguousarray(data)
        self.rt.memcpy(self.ptr, data.ctypes.data, data.nbytes, CopyKind.HOST_TO_DEVICE)

    def poison(self):
        if self.n:
            self.fill(np.full(self.n, POISON, np.uint8))

    def get(self) -> np.ndarray:
        out = np.empty(self.n, np.uint8)
        if self.n:
            self.rt.memcpy(out.ctypes.data, self.ptr, self.n, CopyKind.DEVICE_TO_HOST)
        return out

    def free(self):
        self.rt.device_free(self.ptr)


def check_extent(got: np.ndarray, want: np.ndarray, start: int, count: int):
    """got[start:start+count] == want, and everything else still the poison."""
    np.testing.assert_array_equal(got[start : start + count], want[:count])
    assert (got[:start] == POISON).all(), "bytes before the extent were touched"
    assert (got[start + count :] == POISON).all(), "bytes after the extent were touched"
