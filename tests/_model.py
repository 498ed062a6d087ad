"""Reference model and guarded buffers for the property tests (tests/test_properties.py).

``SparseFile`` is what a file should hold: its size and its bytes (pages of 64 KiB kept
only where something was written, zeros elsewhere), grown with zeros by writes past the
end and cut by truncation. ``Guarded`` is a buffer of one kind of memory (NumPy host
memory, the host vendor's device memory, pinned host memory) with poisoned guard bytes
on both sides: every check compares the whole allocation, guards included.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from phoenix.vendor import CopyKind

PAGE = 1 << 16


class SparseFile:
    """The bytes a file must hold: ``size`` and 64 KiB pages (absent pages are zeros)."""

    def __init__(self):
        self.size = 0
        self.pages: dict[int, np.ndarray] = {}

    def read(self, off: int, n: int) -> np.ndarray:
        """What a read of n bytes at off returns: min(n, size - off) bytes (none past EOF)."""
        count = max(0, min(n, self.size - off))
        out = np.zeros(count, np.uint8)
        pos = 0
        while pos < count:
            idx, rel = divmod(off + pos, PAGE)
            take = min(PAGE - rel, count - pos)
            page = self.pages.get(idx)
            if page is not None:
                out[pos : pos + take] = page[rel : rel + take]
            pos += take
        return out

    def write(self, off: int, data) -> None:
        data = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
        n = data.size
        pos = 0
        while pos < n:
            idx, rel = divmod(off + pos, PAGE)
            take = min(PAGE - rel, n - pos)
            page = self.pages.get(idx)
            if page is None:
                page = self.pages[idx] = np.zeros(PAGE, np.uint8)
            page[rel : rel + take] = data[pos : pos + take]
            pos += take
        if n:
            self.size = max(self.size, off + n)

    def truncate(self, n: int) -> None:
        if n < self.size:
            for idx in [i for i in self.pages if i * PAGE >= n]:
                del self.pages[idx]
            idx, rel = divmod(n, PAGE)
            if rel and idx in self.pages:
                self.pages[idx][rel:] = 0
        self.size = n

    def copy(self) -> SparseFile:
        m = SparseFile()
        m.size = self.size
        m.pages = {k: v.copy() for k, v in self.pages.items()}
        return m


def _data_segments(fd: int, size: int):
    """[start, end) ranges that the file system says hold data (SEEK_DATA/SEEK_HOLE);
    the whole file where it cannot say."""
    try:
        out, pos = [], 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end))
            pos = end
        return out
    except (AttributeError, OSError):
        return [(0, size)]


def file_mismatch(path, model: SparseFile) -> str | None:
    """None if the file at path holds exactly model's bytes, else what differs. Reads every
    range the file system reports as data and every page the model holds (holes read as
    zeros on both sides), so a sparse file of gigabytes costs what was written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != model.size:
            return f"file size {size}, model {model.size}"
        ranges = _data_segments(fd, size)
        ranges += [(i * PAGE, min((i + 1) * PAGE, size)) for i in sorted(model.pages) if i * PAGE < size]
        for start, end in ranges:
            pos = start
            while pos < end:
                n = min(end - pos, 16 << 20)
                got = np.frombuffer(os.pread(fd, n, pos), np.uint8)
                want = model.read(pos, n)
                if got.size != want.size or not np.array_equal(got, want):
                    bad = np.flatnonzero(got[: want.size] != want[: got.size]) if got.size and want.size else [0]
                    first = pos + int(bad[0]) if len(bad) else pos + min(got.size, want.size)
                    return (
                        f"file bytes differ from the model in [{pos}, +{n}): first at {first} "
                        f"({len(bad)} bytes differ; read {got.size}, want {want.size})"
                    )
                pos += n
        return None
    finally:
        os.close(fd)


# ---- buffers -----------------------------------------------------------------------------

KINDS = ("numpy", "numpy_odd", "numpy_page", "memoryview", "device", "device_odd", "pinned", "pinned_odd")


class Guarded:
    """n bytes of one kind of memory, between poisoned guards.

    kind: numpy (a slice of a NumPy array, wherever NumPy put it), numpy_odd (at an odd
    address), numpy_page (page aligned), memoryview (of a bytearray), device / device_odd
    (the vendor's device memory; a (ptr, nbytes) pair at a page-aligned or odd address),
    pinned / pinned_odd (rt.host_alloc_pinned, likewise); ``register``: registered with
    phoenix.io.register for its life. ``obj`` is what the I/O call takes; ``whole()``
    reads the allocation back, guards included.
    """

    def __init__(self, rt, kind: str, n: int, poison: int, lead: int, trail: int = 64, register: bool = False):
        self.rt, self.kind, self.n, self.poison = rt, kind, n, poison
        self.registered = False
        if kind.endswith("_odd"):
            lead = lead | 1
        elif kind in ("numpy", "memoryview"):
            pass
        else:
            lead = (lead + 4095) // 4096 * 4096 or 4096  # page-aligned address (device and pinned bases are)
        self.total = lead + n + trail
        self._ptr = None
        self._arr = None
        if kind.startswith("numpy"):
            raw = np.full(self.total + 4096, poison, np.uint8)
            shift = 0
            if kind == "numpy_page":
                shift = (-(raw.ctypes.data + lead)) % 4096
            elif kind == "numpy_odd":
                shift = 0 if (raw.ctypes.data + lead) % 2 else 1
            self._arr = raw[shift : shift + self.total]
            self.lead = lead
            self.obj = self._arr[lead : lead + n]
        elif kind == "memoryview":
            self._ba = bytearray([poison]) * self.total
            self._arr = np.frombuffer(self._ba, np.uint8)
            self.lead = lead
            self.obj = memoryview(self._ba)[lead : lead + n]
        elif kind.startswith("device"):
            self._ptr = rt.device_alloc(self.total)
            self.lead = lead
            self._put(0, np.full(self.total, poison, np.uint8))
            self.obj = (self._ptr + lead, n)
        elif kind.startswith("pinned"):
            self._ptr = rt.host_alloc_pinned(self.total)
            self.lead = lead
            self._arr = np.ctypeslib.as_array((ctypes.c_uint8 * self.total).from_address(self._ptr))
            self._arr[:] = poison
            self.obj = (self._ptr + lead, n)
        else:
            raise ValueError(kind)
        if register and n:
            import phoenix.io as pio

            pio.register(self.obj)  # (I/O then finds it without asking the vendor)
            self.registered = True

    @property
    def addr(self) -> int:
        return (self._ptr if self._ptr is not None else self._arr.ctypes.data) + self.lead

    @property
    def is_device(self) -> bool:
        return self.kind.startswith("device")

    def _put(self, at: int, data: np.ndarray) -> None:
        if self.is_device:
            data = np.ascontiguousarray(data)
            if data.size:
                self.rt.memcpy(self._ptr + at, data.ctypes.data, data.size, CopyKind.HOST_TO_DEVICE)
        else:
            self._arr[at : at + data.size] = data

    def fill(self, data: np.ndarray, at: int = 0) -> None:
        """Put data at buffer offset ``at`` (inside the buffer)."""
        assert at + data.size <= self.n
        self._put(self.lead + at, data)

    def whole(self) -> np.ndarray:
        """The allocation as it is now: lead guard, buffer, trail guard."""
        if self.is_device:
            out = np.empty(self.total, np.uint8)
            self.rt.memcpy(out.ctypes.data, self._ptr, self.total, CopyKind.DEVICE_TO_HOST)
            return out
        return self._arr.copy()

    def expect(self, extents) -> np.ndarray:
        """The allocation as it must be: poison, with (buffer offset, bytes) extents written."""
        want = np.full(self.total, self.poison, np.uint8)
        for bo, data in extents:
            want[self.lead + bo : self.lead + bo + data.size] = data
        return want

    def mismatch(self, extents, spans=(), tail_zero_ok=()) -> str | None:
        """None if the allocation is poison but for the (buffer offset, bytes) extents, else
        what differs and where: a guard, a request's span (buffer offset, size, count: among
        the bytes returned or past them), or elsewhere. tail_zero_ok: (start, end) ranges where zeros
        are accepted instead of poison (only for hunting past a known failure)."""
        got, want = self.whole(), self.expect(extents)
        if np.array_equal(got, want):
            return None
        bad = np.flatnonzero(got != want)
        for a, b in tail_zero_ok:
            lo, hi = self.lead + a, self.lead + b
            sel = (bad >= lo) & (bad < hi)
            sel &= got[bad] == 0
            bad = bad[~sel]
        if not bad.size:
            return None

        def where(i):
            b = int(i) - self.lead
            if b < 0:
                return f"lead guard (byte {b})"
            if b >= self.n:
                return f"trail guard (byte {b - self.n} after the buffer)"
            for bo, size, count in spans:
                if bo <= b < bo + count:
                    return f"buffer offset {b}, among the {count} bytes returned by the request [{bo}, +{size})"
                if bo + count <= b < bo + size:
                    return f"buffer offset {b}, inside the request [{bo}, +{size}) past the {count} bytes it returned"
            return f"buffer offset {b}, outside every request's extent"

        return (
            f"{bad.size} bytes of the {self.kind} buffer (n={self.n}, address {self.addr:#x}) differ: "
            f"first at {where(bad[0])} (got {got[bad[0]]:#x}, want {want[bad[0]]:#x}), last at {where(bad[-1])}"
        )

    def free(self) -> None:
        if self.registered:
            import phoenix.io as pio

            pio.deregister(self.obj)
            self.registered = False
        if self._ptr is not None:
            if self.is_device:
                self.rt.device_free(self._ptr)
            else:
                self._arr = None
                self.rt.host_free_pinned(self._ptr)
            self._ptr = None
        self.obj = None
