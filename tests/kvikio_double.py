"""A TEST DOUBLE of KvikIO and CuPy: just enough of their API for ``phx bench kv-trace``'s
``kvikio`` configuration and ``phx bench``'s KvikIO peer to run on a machine without a GPU, on the host vendor.

It is not KvikIO and measures nothing about KvikIO. What it keeps of the real thing:

* ``kvikio.CuFile(path, flags).pread(buf, size, file_offset)`` / ``.pwrite(...)`` return a
  future whose ``get()`` is the byte count; the I/O is split into ``task_size`` pieces run in
  a pool of ``num_threads`` threads (``kvikio.defaults.set({...})`` as a context manager,
  ``kvikio.CompatMode``);
* a CuPy array (device memory: here the host vendor's) is filled through a host bounce
  buffer and the vendor's ``memcpy`` (host->device), as compat mode does; a host buffer
  (NumPy) is read and written with POSIX ``pread``/``pwrite`` directly;
* ``cupy.cuda.UnownedMemory``, ``cupy.cuda.MemoryPointer`` and ``cupy.ndarray(shape, dtype,
  memptr=...)`` wrap a raw device pointer without owning it; ``arr[a:b]`` is a view.

The module says so: ``kvikio.IS_TEST_DOUBLE`` is True, which is what lets the replay run it
with a vendor other than nvidia (and labels its records). :func:`install` puts both modules
in ``sys.modules`` for one test (``monkeypatch``), so nothing else sees them.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor

from phoenix.vendor import CopyKind

# ---- cupy ------------------------------------------------------------------------------------------


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int):
        self.mem, self.ptr = mem, mem.ptr + offset


class ndarray:  # noqa: N801 (CuPy's name)
    """A 1-D uint8 view of device memory (all the replay makes)."""

    def __init__(self, shape, dtype=None, memptr: MemoryPointer | None = None):
        (n,) = shape
        if memptr is None or n > memptr.mem.size:
            raise ValueError("the test double's ndarray views existing device memory only")
        self.shape, self.dtype, self.data, self.nbytes = (n,), dtype, memptr, n

    def __getitem__(self, sl: slice) -> ndarray:
        """A 1-D slice (step 1): a view of the same memory, as CuPy's."""
        start, stop, step = sl.indices(self.nbytes)
        if step != 1:
            raise ValueError("the test double's ndarray slices with step 1 only")
        mem = UnownedMemory(self.data.ptr + start, max(0, stop - start), self)
        return ndarray((mem.size,), self.dtype, MemoryPointer(mem, 0))


# ---- kvikio ------------------------------------------------------------------------------------------


class CompatMode(enum.Enum):
    OFF = 0
    ON = 1
    AUTO = 2


SETTINGS = {"compat_mode": CompatMode.AUTO, "num_threads": 1, "task_size": 4 << 20}
#: every settings dict set, in order (tests check what the replay asked for)
SET_CALLS: list[dict] = []
#: (op, flags, nbytes, device) of every call, in order
CALLS: list[tuple] = []
_pool_lock = threading.Lock()
_pool: list = [None, 0]  # executor, its threads


def _executor() -> ThreadPoolExecutor:
    with _pool_lock:
        if _pool[0] is None or _pool[1] != SETTINGS["num_threads"]:
            if _pool[0] is not None:
                _pool[0].shutdown(wait=False)
            _pool[0] = ThreadPoolExecutor(SETTINGS["num_threads"], thread_name_prefix="kvikio-double")
            _pool[1] = SETTINGS["num_threads"]
        return _pool[0]


@contextlib.contextmanager
def defaults_set(config: dict):
    SET_CALLS.append(dict(config))
    old = dict(SETTINGS)
    SETTINGS.update(config)
    try:
        yield
    finally:
        SETTINGS.clear()
        SETTINGS.update(old)


def defaults_get(key: str):
    return SETTINGS[key]


class IOFuture:
    def __init__(self, parts):
        self._parts = parts

    def get(self) -> int:
        return sum(p.result() for p in self._parts)

    def done(self) -> bool:
        return all(p.done() for p in self._parts)


class CuFile:
    def __init__(self, path: str, flags: str = "r"):
        mode = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC}[flags]
        self.path, self.flags = path, flags
        self.fd = os.open(path, mode, 0o644)
        self.compat = SETTINGS["compat_mode"]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pread(self, buf, size: int | None = None, file_offset: int = 0) -> IOFuture:
        return self._io("pread", buf, size, file_offset)

    def pwrite(self, buf, size: int | None = None, file_offset: int = 0) -> IOFuture:
        return self._io("pwrite", buf, size, file_offset)

    def _io(self, op, buf, size, file_offset) -> IOFuture:
        if self.compat is not CompatMode.ON:
            raise RuntimeError("the test double does compat mode only: open the file inside defaults.set")
        device = isinstance(buf, ndarray)
        n = buf.nbytes if size is None else size
        CALLS.append((op, self.flags, n, device))
        base = buf.data.ptr if device else _host_ptr(buf)
        task = SETTINGS["task_size"]
        pool = _executor()
        parts = [
            pool.submit(self._piece, op, device, base + o, min(task, n - o), file_offset + o) for o in range(0, n, task)
        ]
        return IOFuture(parts)

    def _piece(self, op, device, ptr, n, off) -> int:
        rt = _runtime()
        view = memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if not device else None
        if op == "pread":
            if not device:
                return os.preadv(self.fd, [view], off)
            bounce = bytearray(n)
            got = os.preadv(self.fd, [bounce], off)
            src = (ctypes.c_char * n).from_buffer(bounce)
            rt.memcpy(ptr, ctypes.addressof(src), got, CopyKind.HOST_TO_DEVICE)
            return got
        if not device:
            return os.pwritev(self.fd, [view], off)
        bounce = bytearray(n)
        dst = (ctypes.c_char * n).from_buffer(bounce)
        rt.memcpy(ctypes.addressof(dst), ptr, n, CopyKind.DEVICE_TO_HOST)
        return os.pwritev(self.fd, [bounce], off)


def _host_ptr(buf) -> int:
    iface = getattr(buf, "__array_interface__", None)
    if iface is None:
        raise TypeError("the test double takes a CuPy (device) or NumPy (host) array")
    return iface["data"][0]


def _runtime():
    from phoenix.registry import get_runtime

    return get_runtime()


# ---- installing ------------------------------------------------------------------------------------


def install(monkeypatch) -> types.ModuleType:
    """``kvikio``, ``kvikio.defaults``, ``cupy`` and ``cupy.cuda`` as this test double, in
    ``sys.modules`` until the test ends. Returns the kvikio module."""
    me = sys.modules[__name__]
    SET_CALLS.clear()
    CALLS.clear()
    kvikio = types.ModuleType("kvikio", "KvikIO TEST DOUBLE (tests/kvikio_double.py)")
    defaults = types.ModuleType("kvikio.defaults", "KvikIO TEST DOUBLE: settings")
    defaults.set, defaults.get = defaults_set, defaults_get
    kvikio.defaults, kvikio.CuFile, kvikio.CompatMode, kvikio.IOFuture = defaults, CuFile, CompatMode, IOFuture
    kvikio.IS_TEST_DOUBLE, kvikio.__version__, kvikio.double = True, "0.0+test-double", me
    cupy = types.ModuleType("cupy", "CuPy TEST DOUBLE (tests/kvikio_double.py)")
    cuda = types.ModuleType("cupy.cuda", "CuPy TEST DOUBLE: memory")
    cuda.UnownedMemory, cuda.MemoryPointer = UnownedMemory, MemoryPointer
    cupy.cuda, cupy.ndarray, cupy.uint8, cupy.IS_TEST_DOUBLE = cuda, ndarray, "uint8", True
    for name, mod in (("kvikio", kvikio), ("kvikio.defaults", defaults), ("cupy", cupy), ("cupy.cuda", cuda)):
        monkeypatch.setitem(sys.modules, name, mod)
    return kvikio
