"""The Python API of the I/O stack: files <-> host or device memory.

Control plane. Familiar to KvikIO users::

    import phoenix.io as pio
    with pio.open("/data/kv.bin", "r") as f:
        fut = f.pread(tensor)              # IOFuture; fut.result() -> bytes read
        n = f.read(tensor, size, file_offset=4096, buf_offset=0)
        op = f.read_async(tensor, size, 0, 0, stream)   # ordered on the stream
        ...                                # after the stream completes: op.bytes_done
    results = pio.batch([(f, buf, size, file_offset, buf_offset, "read"), ...])

Python only checks arguments, finds the buffer's extent (:mod:`phoenix.buffers`), asks
the vendor where it lives and submits; chunking, the file I/O, device copies,
completions and stream callbacks run in the C core (``phoenix/csrc/io_*.c``) on its own
threads, without the GIL. Settings (threads, chunk size, queue depth, bounce pool,
mode, engine): :mod:`phoenix.settings`.

Paths, chosen per request (``PHX_MODE``, see ``phoenix/csrc/phx_io.h``):

* host memory (pinned, registered or plain): read and written in place, O_DIRECT for
  the aligned body, buffered for unaligned heads and tails; a buffer whose address is
  not aligned like its file offset goes through a bounce slot (a CPU copy);
* device memory the CPU can address (vendor ``direct_capable``: the host vendor's arena,
  P2P-mapped memory later): the same, straight into the device address (``direct``);
* other device memory: O_DIRECT into pinned bounce slots, then the vendor's
  memcpy_async on a per-worker stream, pipelined (``staged``).
* staged reads into device memory of file ranges in the page cache (or tmpfs): once
  the range's window is mmap'd and host-registered (in the background after a first,
  staged read; :func:`fmap_wait`), one vendor copy straight from the mapping per read:
  no bounce buffer, no pread, about a tenth of the CPU. That first read is staged in
  4 MiB chunks, at most 4 bounce slots per worker at a time (a memory copy, then a DMA:
  small chunks overlap the two, few slots keep the DMAs close behind the copies).
  Mappings are cached across opens, LRU under ``PHX_FMAP_CACHE``, dropped on writes through phoenix and when the file's size or
  times change; :func:`fmap_clear` releases them (``fmap_*`` settings, :func:`fmap_info`).

Ordering with the caller's stream (the rule every call keeps):

* an I/O call that touches device memory runs after all work queued so far on the
  caller's stream: a read lands after the work that writes (or reads) its destination,
  a write takes the bytes that work produced;
* a blocking call (``read``, ``write``, ``read_many``, ``write_many``, ``batch``) returns
  with its bytes in place, visible to any work queued after it; a future's bytes are in
  place once ``.result()`` returns; a stream-ordered call (``read_async``/``write_async``)
  is ordered on the stream itself;
* the caller's stream is the call's ``stream=`` (a vendor handle, a torch or CuPy stream,
  anything with ``cuda_stream``, ``ptr`` or ``__cuda_stream__``), else the current stream
  of the buffer's framework (``torch.cuda.current_stream(device)`` for a torch tensor,
  CuPy's current stream for a CuPy array, the stream a ``__cuda_array_interface__``
  names; DLPack producers order their work before the stream given, the default one when
  none is), else the vendor's default stream (0). Host memory is ordered only when the
  call names a stream.

It costs an event, not a synchronize: the call records an event on the caller's stream;
phoenix's copy streams wait for it on the device (the file I/O into bounce buffers runs
meanwhile), and memory the CPU or the disk writes directly waits for it on the host. A
vendor without events makes phoenix synchronize the caller's stream before it submits
(``phx info``, "caller_stream", says which). :mod:`phoenix.streams` finds the stream.

Errors: :class:`~phoenix.errors.PhxIOError` (an OSError) naming the file, the offset
and the length; a short read at end of file is a count, not an error.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno as _errno
import importlib
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass

from . import buffers as _buffers
from . import checks as _checks
from . import streams as _streams
from ._core import core
from .errors import PhxIOError, RegistrationError, extent_error

# (not `from . import settings`: phoenix/__init__.py's lazy __getattr__ for "settings"
# recurses when the submodule is not imported yet)
_settings = importlib.import_module(__package__ + ".settings")

__all__ = [
    "PhxFile", "IOFuture", "StreamIO", "IORequest", "open", "batch", "register", "deregister",
    "capabilities", "stats", "shutdown", "prepare", "use_runtime", "fmap_wait", "fmap_clear", "fmap_info",
]

# ---- the C core's ABI (phoenix/csrc/phx_io.h) ------------------------------------------

OP_READ, OP_WRITE = 0, 1
MODE = {"auto": 0, "staged": 1, "direct": 2}
ENGINE = {"auto": 0, "io_uring": 1, "threads": 2}
ENGINE_NAME = {1: "io_uring", 2: "threads"}
FMAP_MODE = {"auto": 0, "off": 1, "sync": 2}
FMAP_MODE_NAME = {v: k for k, v in FMAP_MODE.items()}
F_READ, F_WRITE, F_CREATE, F_TRUNC, F_EXCL, F_SYNC = 1, 2, 4, 8, 16, 32
DIRECT_OFF, DIRECT_ON, DIRECT_AUTO = 0, 1, -1
MEM_NAME = {0: "host", 1: "device", 2: "device (direct-capable)"}


class _Config(ctypes.Structure):
    _fields_ = [
        ("threads", ctypes.c_uint32),
        ("queue_depth", ctypes.c_uint32),
        ("chunk_size", ctypes.c_uint64),
        ("bounce_pool_size", ctypes.c_uint64),
        ("engine", ctypes.c_int32),
        ("fmap_mode", ctypes.c_int32),
        ("fmap_budget", ctypes.c_uint64),
        ("fmap_window", ctypes.c_uint64),
        ("fmap_register_flags", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


CFG_CPU_COPIES = 1  # PHX_CFG_CPU_COPIES: the vendor's copies are CPU copies (test doubles)


def make_config(s: _settings.Settings, runtime=None) -> _Config:
    """``struct phx_io_config`` for a set of settings (every context is built from one)."""
    flags = CFG_CPU_COPIES if runtime is not None and getattr(runtime, "is_test_double", False) else 0
    return _Config(s.threads, s.queue_depth, s.chunk_size, s.bounce_pool_size, ENGINE[s.engine],
                   FMAP_MODE[s.fmap_mode], s.fmap_cache, s.fmap_window, s.fmap_register_flags, flags)


class _FmapInfo(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_int32),
        ("register_flags", ctypes.c_uint32),
        ("budget", ctypes.c_uint64),
        ("window", ctypes.c_uint64),
        ("windows", ctypes.c_int64),
        ("bytes", ctypes.c_int64),
        ("pending", ctypes.c_int64),
        ("unregistrable", ctypes.c_int64),
        ("in_use", ctypes.c_int64),
        ("hits", ctypes.c_int64),
        ("misses", ctypes.c_int64),
        ("registrations", ctypes.c_int64),
        ("evictions", ctypes.c_int64),
        ("invalidations", ctypes.c_int64),
        ("why", ctypes.c_char * 160),
    ]


class _Desc(ctypes.Structure):
    _fields_ = [
        ("file", ctypes.c_void_p),
        ("addr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("file_offset", ctypes.c_int64),
        ("op", ctypes.c_int32),
        ("mem", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("after", ctypes.c_void_p),  # phx_fence *: the caller's stream point to wait for
    ]


class _FileInfo(ctypes.Structure):
    _fields_ = [
        ("direct", ctypes.c_int32),
        ("dio_offset_align", ctypes.c_uint32),
        ("dio_mem_align", ctypes.c_uint32),
        ("fd_direct", ctypes.c_int32),
        ("fd_buffered", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
        ("known_size", ctypes.c_int64),
        ("why", ctypes.c_char * 160),
    ]


class _RegInfo(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("mem", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("refs", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
    ]


_STAT_FIELDS = (
    "contexts", "threads", "files", "requests", "stream_ops", "registrations", "worker_streams",
    "bounce_bytes", "bounce_in_use", "bytes_read", "bytes_written",
    "chunks_user", "chunks_staged", "chunks_staged_cpu",
    "io_direct", "io_buffered", "reissues", "direct_fallbacks", "uring_enters",
    "cache_hit_bytes", "cache_misses",
    "fmap_windows", "fmap_bytes", "fmap_hits", "fmap_misses", "pool_waits", "copy_flushes",
)


class _Sizes(ctypes.Structure):
    _fields_ = [("bounce_pool", ctypes.c_uint64), ("chunk", ctypes.c_uint64), ("staged_chunk", ctypes.c_uint64),
                ("max_slot", ctypes.c_uint64)]


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _STAT_FIELDS]



_P = ctypes.c_void_p


def _bind():
    lib = core()
    protos = {
        "phx_engine_probe": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
        "phx_ctx_create": (ctypes.c_int, [ctypes.POINTER(_Config), _P, ctypes.POINTER(_P)]),
        "phx_ctx_engine": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t]),
        "phx_ctx_destroy": (None, [_P]),
        "phx_ctx_prepare": (ctypes.c_int64, [_P]),
        "phx_file_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)]),
        "phx_file_from_fd": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)]),
        "phx_file_close": (ctypes.c_int, [_P]),
        "phx_file_fsync": (ctypes.c_int, [_P]),
        "phx_file_size": (ctypes.c_int64, [_P]),
        "phx_file_query": (ctypes.c_int, [_P, ctypes.POINTER(_FileInfo)]),
        "phx_cache_probe_works": (ctypes.c_int, [_P]),
        "phx_submit": (ctypes.c_int, [_P, ctypes.POINTER(_Desc), ctypes.c_uint32, ctypes.POINTER(_P)]),
        "phx_req_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_req_done": (ctypes.c_int, [_P]),
        "phx_req_result": (ctypes.c_int64, [_P]),
        "phx_req_error_extent": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint64)]),
        "phx_req_release": (None, [_P]),
        "phx_req_wait_all": (ctypes.c_int, [ctypes.POINTER(_P), ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64),
                                            ctypes.c_int64]),
        "phx_req_release_all": (None, [ctypes.POINTER(_P), ctypes.c_uint32]),
        "phx_stream_io": (ctypes.c_int, [_P, ctypes.POINTER(_Desc), _P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(_P)]),
        "phx_sop_done": (ctypes.c_int, [_P]),
        "phx_sop_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_sop_result": (ctypes.c_int64, [_P]),
        "phx_sop_release": (None, [_P]),
        "phx_reg_add": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]),
        "phx_reg_remove": (ctypes.c_int, [ctypes.c_uint64]),
        "phx_reg_lookup": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(_RegInfo)]),
        "phx_reg_clear": (ctypes.c_int, []),
        "phx_mem_probe": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64]),
        "phx_fmap_query": (ctypes.c_int, [_P, ctypes.POINTER(_FmapInfo)]),
        "phx_fmap_lookup": (ctypes.c_int, [_P, _P, ctypes.c_int64, ctypes.c_uint64, ctypes.POINTER(_P)]),
        "phx_fmap_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_fmap_clear": (ctypes.c_int, [_P]),
        "phx_io_get_stats": (None, [ctypes.POINTER(_Stats)]),
        "phx_fence_record": (ctypes.c_int, [_P, ctypes.c_int, _P, ctypes.POINTER(_P)]),
        "phx_fence_release": (None, [_P]),
        "phx_ctx_ordering": (ctypes.c_int, [_P]),
        "phx_ctx_sizes": (ctypes.c_int, [_P, ctypes.POINTER(_Sizes)]),
    }
    for name, (res, args) in protos.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


_lib = _bind()


def _strerror(rc: int) -> str:
    return os.strerror(-rc) if rc < 0 else "ok"


# ---- the vendor runtime ---------------------------------------------------------------------

_rt_lock = threading.Lock()
_rt_explicit = None
_rt_none = object()


def use_runtime(runtime) -> None:
    """Use this :class:`~phoenix.vendor.VendorRuntime` (None: back to ``phoenix.registry``).

    For tests and for programs that build their runtime themselves; otherwise the I/O
    stack uses ``phoenix.registry.get_runtime()`` (``PHX_VENDOR``).
    """
    global _rt_explicit
    with _rt_lock:
        _rt_explicit = runtime


def _runtime():
    rt = _rt_explicit
    if rt is not None:
        return rt
    try:
        from .registry import get_runtime
    except ImportError:
        return None
    try:
        return get_runtime()
    except Exception:  # no usable vendor: host memory still works
        return None


# ---- engines (C contexts) ---------------------------------------------------------------------


class _Engine:
    """One C context: a worker pool, a bounce pool and the vendor's data-path table.

    Built for one set of pool settings and one runtime; replaced when either changes.
    Requests, futures and stream ops hold a reference; the context is destroyed (after
    its I/O drains) when the last reference goes, or by :func:`shutdown`. A thread that
    calls into the context holds it (:func:`_using_engine`): closing waits for it, so
    the C context is never destroyed under a submission.
    """

    def __init__(self, s: _settings.Settings, runtime):
        self.key = s.pool_key() + (id(runtime),)
        self.runtime = runtime
        self.settings = s
        try:
            dp = runtime.data_path() if runtime is not None else None
        except Exception:  # a port without a data path still reads into host memory
            dp = None
        if dp is not None and dp.missing():
            dp = None  # staged and stream-ordered I/O will say ENODEV
        self._dp = dp
        cfg = make_config(s, runtime)
        handle = _P()
        rc = _lib.phx_ctx_create(ctypes.byref(cfg), ctypes.byref(dp) if dp is not None else None, ctypes.byref(handle))
        if rc < 0:
            why = ctypes.create_string_buffer(256)
            _lib.phx_engine_probe(ENGINE[s.engine], why, len(why))
            raise PhxIOError(-rc, None, 0, 0, f"cannot start the I/O engine {s.engine!r} ({why.value.decode()})")
        self.handle = handle.value
        why = ctypes.create_string_buffer(256)
        self.engine = ENGINE_NAME.get(_lib.phx_ctx_engine(self.handle, why, len(why)), "?")
        self.engine_why = why.value.decode()
        self._cv = threading.Condition()
        self._users = 0
        self._closing = False
        self._finalizer = weakref.finalize(self, _lib.phx_ctx_destroy, self.handle)
        _all_engines.add(self)

    @property
    def has_data_path(self) -> bool:
        return self._dp is not None

    @property
    def usable(self) -> bool:
        return not self._closing and self._finalizer.alive

    def enter(self) -> bool:
        """Hold the context for a call into it; False once it is closing."""
        with self._cv:
            if not self.usable:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._cv:
            self._users -= 1
            if not self._users:
                self._cv.notify_all()

    def close(self) -> None:
        """Destroy now: waits for the threads calling into it, then (in C) for the
        context's requests and stream ops."""
        with self._cv:
            self._closing = True
            while self._users:
                self._cv.wait()
        self._finalizer()


_engine_lock = threading.Lock()
_engine: _Engine | None = None
#: every engine not destroyed yet: the current one, and retired ones that a future, a
#: stream op (or a traceback holding either) still references
_all_engines: weakref.WeakSet = weakref.WeakSet()


def _current_engine(s: _settings.Settings | None = None) -> _Engine:
    global _engine
    s = s or _settings.get()
    rt = _runtime()
    key = s.pool_key() + (id(rt),)
    e = _engine
    if e is not None and e.key == key and e.usable:
        return e
    with _engine_lock:
        e = _engine
        if e is None or e.key != key or not e.usable:
            # the old engine stays alive while its requests hold it, then goes
            _engine = e = _Engine(s, rt)
    return e


@contextlib.contextmanager
def _using_engine(s: _settings.Settings | None = None):
    """The current engine, held for the block (shutdown() in another thread waits)."""
    while True:
        e = _current_engine(s)
        if e.enter():
            break
    try:
        yield e
    finally:
        e.leave()


def prepare() -> dict:
    """Start the worker pool for the current settings and pin its whole bounce pool now.

    Otherwise both happen on the first I/O that needs them. Pinning goes through the
    vendor (cudaHostRegister on CUDA), which the runtime may serialize behind busy
    streams: an application that holds streams with callbacks of its own (or that must
    not stall at its first read) calls this at start-up, before stream-ordered I/O.
    Returns ``{"engine", "bounce_bytes"}``.
    """
    with _using_engine() as e:
        n = _lib.phx_ctx_prepare(e.handle)
    if n < 0:
        raise PhxIOError(-n, None, 0, 0, "prepare: pinning the bounce pool")
    return {"engine": e.engine, "bounce_bytes": int(n)}


def shutdown() -> None:
    """Stop every worker pool and free the bounce pools now (waits for in-flight I/O).

    The next I/O starts a new pool. Registrations and open files stay. Futures and
    stream ops of the stopped pools stay valid (they do not use the pool once done).
    """
    global _engine
    _prune_stream_ops(wait=True)
    with _engine_lock:
        _engine = None
        engines = list(_all_engines)
    for e in engines:
        e.close()


atexit.register(shutdown)


def _after_fork_in_child() -> None:
    # The workers are threads of the parent: the child starts a pool of its own on its
    # first I/O. The parent's context is left alone (destroying it would wait for
    # threads that do not exist here).
    global _engine
    for e in list(_all_engines):  # detach first: dropping _engine may free the last reference
        e._finalizer.detach()
    _all_engines.clear()
    _engine = None


os.register_at_fork(after_in_child=_after_fork_in_child)

# ---- futures --------------------------------------------------------------------------------


class IOFuture:
    """The result of :meth:`PhxFile.pread` / :meth:`PhxFile.pwrite` (KvikIO's IOFuture).

    ``result()`` (alias ``get()``) waits and returns the byte count (short at end of
    file) or raises :class:`PhxIOError`. The buffer is kept alive until the I/O is over;
    a future dropped before it completes waits for it. Any thread may wait on it.
    """

    __slots__ = ("_req", "_engine", "_buf", "_file", "_what", "_offset", "_size", "_value", "_error", "_done",
                 "_lock", "__weakref__")

    def __init__(self, req, engine, buf, file, what, offset, size, error=None):
        self._req = req  # the C handle: released only by __del__, so that waits never race it
        self._engine = engine
        self._buf = buf
        self._file = file
        self._what = what
        self._offset = offset
        self._size = size
        self._value = None
        self._error = error
        self._done = req is None
        self._lock = threading.Lock()
        if self._done and buf is not None:
            buf.release()
            self._buf = None

    @classmethod
    def failed(cls, error: BaseException, what: str = "") -> IOFuture:
        return cls(None, None, None, None, what, 0, 0, error)

    def done(self) -> bool:
        if self._done:
            return True
        if _lib.phx_req_done(self._req):
            self._collect()
            return True
        return False

    def _collect(self) -> None:
        with self._lock:
            if self._done:
                return
            req = self._req
            res = _lib.phx_req_result(req)
            if res < 0:
                off, length = ctypes.c_int64(self._offset), ctypes.c_uint64(self._size)
                _lib.phx_req_error_extent(req, ctypes.byref(off), ctypes.byref(length))
                path = self._file.path if self._file is not None else None
                where = "" if (off.value, length.value) == (self._offset, self._size) else \
                    f"; failed chunk at offset {off.value}, length {length.value}"
                self._error = PhxIOError(-res, path, self._offset, self._size, f"{self._what}{where}")
            else:
                self._value = res
            if self._buf is not None:
                self._buf.release()
                self._buf = None
            self._engine = None
            self._done = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for completion; False if ``timeout`` (seconds) passed first."""
        if self._done:
            return True
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        if _lib.phx_req_wait(self._req, ns) != 0:
            return False
        self._collect()
        return True

    def result(self, timeout: float | None = None) -> int:
        if not self.wait(timeout):
            raise TimeoutError(f"{self._what}: not complete after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    get = result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TimeoutError(f"{self._what}: not complete after {timeout} s")
        return self._error

    def __del__(self):
        req = getattr(self, "_req", None)
        if req is None:
            return
        try:
            _lib.phx_req_wait(req, -1)  # the buffer must outlive the I/O
            _lib.phx_req_release(req)
        except Exception:  # interpreter shutting down
            pass

    def __repr__(self):
        state = "pending" if not self.done() else f"error {self._error!r}" if self._error else f"done {self._value}"
        return f"<IOFuture {self._what} {state}>"


class StreamIO:
    """A stream-ordered read or write (:meth:`PhxFile.read_async` / ``write_async``).

    Its result is bound late: once the stream has reached the end of the operation,
    :attr:`bytes_done` is the byte count or a negative errno (cuFile's ``bytes_read``).
    """

    __slots__ = ("_sop", "_engine", "_buf", "_file", "_what", "_offset", "_size", "_value", "_done", "_lock",
                 "__weakref__")

    def __init__(self, sop, engine, buf, file, what, offset, size):
        self._sop = sop  # the C handle: released only by __del__
        self._engine = engine
        self._buf = buf
        self._file = file
        self._what = what
        self._offset = offset
        self._size = size
        self._value = None
        self._done = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the stream has run the operation to its end."""
        if self._done:
            return True
        if _lib.phx_sop_done(self._sop):
            self._collect()
            return True
        return False

    def _collect(self) -> None:
        with self._lock:
            if self._done:
                return
            self._value = _lib.phx_sop_result(self._sop)
            if self._buf is not None:
                self._buf.release()
                self._buf = None
            self._engine = None
            self._done = True

    @property
    def bytes_done(self) -> int | None:
        """Bytes moved, or -errno; None until the stream has reached the end of the op."""
        return self._value if self.done() else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (without touching the stream) until the op has run; False on timeout."""
        if self._done:
            return True
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        if _lib.phx_sop_wait(self._sop, ns) != 0:
            return False
        self._collect()
        return True

    def result(self, timeout: float | None = None) -> int:
        """Wait for the op; its byte count, or PhxIOError for a negative errno."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self._what}: the stream has not reached it after {timeout} s")
        if self._value < 0:
            path = self._file.path if self._file is not None else None
            raise PhxIOError(-self._value, path, self._offset, self._size, self._what)
        return self._value

    def __del__(self):
        sop = getattr(self, "_sop", None)
        if sop is None:
            return
        try:
            if not self._done:
                _lib.phx_sop_wait(sop, -1)  # the buffer must outlive the op
            _lib.phx_sop_release(sop)
        except Exception:
            pass

    def __repr__(self):
        return f"<StreamIO {self._what} bytes_done={self.bytes_done}>"


# stream ops the caller dropped before the stream ran them: their buffers stay alive here
_stream_lock = threading.Lock()
_stream_ops: set[StreamIO] = set()


def _prune_stream_ops(wait: bool = False) -> None:
    with _stream_lock:
        ops = list(_stream_ops)
    for op in ops:
        if (op.wait() if wait else op.done()):
            with _stream_lock:
                _stream_ops.discard(op)


class _Fences:
    """The caller's stream points one call's requests wait for (``phx_fence_record``):
    one per (device, stream) among its extents. Released after the requests naming them
    are submitted (each request holds its own reference in the core)."""

    __slots__ = ("engine", "fences")

    def __init__(self, engine):
        self.engine = engine
        self.fences: dict[tuple[int, int], int] = {}

    def after(self, r: _Resolved, explicit: int | None, path, file_offset: int, what: str) -> int | None:
        """The fence ``r``'s request waits for (an address; None: nothing to wait for)."""
        stream = _streams.caller_stream(r.buf, r.mem, explicit)
        if stream is None or r.size == 0:
            return None
        device = -1 if r.mem == _buffers.MEM_HOST else r.device  # host memory: the thread's current device
        key = (device, stream)
        if key in self.fences:
            return self.fences[key] or None
        if not self.engine.has_data_path:
            raise PhxIOError(_errno.ENODEV, path, file_offset, r.size,
                             f"{what}: stream={stream:#x} given, but no vendor runtime with a data path is selected "
                             "to order with it (PHX_VENDOR)")
        out = _P()
        rc = _lib.phx_fence_record(self.engine.handle, device, stream, ctypes.byref(out))
        if rc < 0:
            raise PhxIOError(-rc, path, file_offset, r.size,
                             f"{what}: cannot order with the caller's stream {stream:#x} on device {device}: the vendor "
                             "refused to record an event on it (a destroyed stream, or another device's?)")
        self.fences[key] = out.value or 0
        return out.value or None

    def release(self) -> None:
        fences, self.fences = self.fences, {}
        for f in fences.values():
            if f:
                _lib.phx_fence_release(f)


# ---- buffer resolution --------------------------------------------------------------------


class _Resolved:
    __slots__ = ("buf", "addr", "size", "foff", "mem", "device", "why")

    def release(self):
        if self.buf is not None:
            self.buf.release()
            self.buf = None


_RAW = _buffers.Buffer  # (for isinstance checks below)


def _resolve(runtime, obj, size, buf_offset, writable, path, file_offset, what, cache=None, stream=None) -> _Resolved:
    """The extent of an I/O in ``obj``: checked, classified. Raises PhxIOError / TypeError.
    ``stream``: the call's own stream handle, if it named one (a DLPack producer orders
    its work before it)."""
    size, file_offset, buf_offset = _checks.extent(size, file_offset, buf_offset, path, what)
    r = _Resolved()
    r.foff = file_offset
    if type(obj) is tuple and len(obj) == 2 and type(obj[0]) is int and type(obj[1]) is int and \
            0 < obj[0] and 0 <= obj[1] <= _checks.I64_MAX and obj[0] + obj[1] <= _checks.U64_MAX + 1:
        base, nbytes, kind, kdev, source = obj[0], obj[1], None, None, "raw"  # the common batch case: no Buffer
        r.buf = None
    else:
        buf = _buffers.adapt(obj, writable=writable, stream=stream)
        base, nbytes, kind, kdev, source = buf.addr, buf.nbytes, buf.kind, buf.device, buf.source
        r.buf = buf
    try:
        if size is None:
            size = max(0, nbytes - buf_offset)
        if buf_offset + size > nbytes:
            raise extent_error(path, file_offset, size,
                               f"{what}: buffer extent [{buf_offset}, +{size}) runs past the buffer's {nbytes} bytes")
        r.addr, r.size = base + buf_offset, size
        if size == 0:
            r.mem, r.device, r.why = _buffers.MEM_HOST, 0, "empty"
            return r
        info = _RegInfo()
        rc = _lib.phx_reg_lookup(r.addr, size, ctypes.byref(info))
        if rc == -_errno.EFAULT:
            raise extent_error(path, file_offset, size,
                               f"{what}: buffer extent [{r.addr:#x}, +{size}) runs past the end of its registration "
                               f"[{info.base:#x}, +{info.size})")
        if rc == 0:
            r.mem, r.device, r.why = info.mem, info.device, "registered"
            return r
        hit = cache.get(r.addr, size) if cache is not None else None
        if hit is not None:
            r.mem, r.device, r.why = hit
        else:
            try:
                r.mem, r.device, r.why = _buffers.classify(runtime, r.addr, size, kind, kdev)
            except _buffers.OutOfBounds as exc:
                raise extent_error(path, file_offset, size, f"{what}: {exc}") from None
            if cache is not None:
                cache.put(runtime, r.addr, r)
        if r.mem == _buffers.MEM_HOST and source == "raw" and _lib.phx_mem_probe(r.addr, size) == -_errno.EFAULT:
            raise extent_error(path, file_offset, size,
                               f"{what}: [{r.addr:#x}, +{size}) is not accessible memory (freed?)")
        return r
    except BaseException:
        r.release()
        raise


class _ClassCache:
    """Per-batch memo of vendor pointer queries, by device allocation (many requests of a
    batch land in one allocation; a batch is too short-lived for it to be freed)."""

    def __init__(self):
        self._ranges: list[tuple[int, int, tuple]] = []
        self._last = None

    def get(self, addr: int, size: int):
        last = self._last
        if last is not None and last[0] <= addr and addr + size <= last[1]:
            return last[2]
        for entry in self._ranges:
            if entry[0] <= addr and addr + size <= entry[1]:
                self._last = entry
                return entry[2]
        return None

    def put(self, runtime, addr: int, r: _Resolved) -> None:
        if runtime is None or r.mem == _buffers.MEM_HOST or len(self._ranges) >= 64:
            return
        info = runtime.pointer_info(addr)
        if info.size and r.mem == _buffers.MEM_DEVICE_MAPPED:
            ok, _ = runtime.direct_capable(info.base, info.size)
            if not ok:
                return
        if info.size:
            self._ranges.append((info.base, info.base + info.size, (r.mem, r.device, r.why)))


def _check_mode(r: _Resolved, mode: str, path, file_offset, what):
    if mode == "direct" and r.mem == _buffers.MEM_DEVICE:
        raise PhxIOError(_errno.EOPNOTSUPP, path, file_offset, r.size,
                         f"{what}: PHX_MODE=direct, but this device memory is not direct-capable ({r.why})")


# ---- files --------------------------------------------------------------------------------

_MODES = {
    "r": F_READ,
    "r+": F_READ | F_WRITE,
    "w": F_WRITE | F_CREATE | F_TRUNC,
    "w+": F_READ | F_WRITE | F_CREATE | F_TRUNC,
    "a": F_WRITE | F_CREATE,  # positional writes: no O_APPEND (it would ignore offsets)
    "a+": F_READ | F_WRITE | F_CREATE,
    "x": F_WRITE | F_CREATE | F_EXCL,
    "x+": F_READ | F_WRITE | F_CREATE | F_EXCL,
}


def _open_flags(mode: str) -> int:
    key = mode.replace("b", "")
    if key not in _MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(_MODES)} (a 'b' is accepted and ignored)")
    return _MODES[key]


class PhxFile:
    """A file open for I/O between it and host or device memory (KvikIO's ``CuFile``).

    ``direct``: None (default) uses O_DIRECT where the file system takes it, but reads
    ranges that are mostly in the page cache already through it (``cachestat``, Linux
    6.5+; backing off while it misses); True always uses O_DIRECT (PhxIOError EINVAL
    where refused); False never uses it. ``sync=True``
    opens with O_DSYNC: a write is durable when its future completes.
    Thread-safe: any number of threads may submit I/O on one file.
    """

    def __init__(self, path, mode: str = "r", *, direct: bool | None = None, sync: bool = False, perm: int = 0o644,
                 fd: int | None = None):
        self._h = None
        self._closed = True
        if fd is not None:
            fd = _checks.bounded(fd, "fd", "open", 0, 2**31 - 1)
        self.path = os.fspath(path) if fd is None or path is not None else f"<fd {fd}>"
        self.mode = mode
        flags = _open_flags(mode) | (F_SYNC if sync else 0)
        perm = _checks.bounded(perm, "perm", "open", 0, 0o7777)
        dflag = DIRECT_AUTO if direct is None else DIRECT_ON if direct else DIRECT_OFF
        handle = _P()
        if fd is not None:
            rc = _lib.phx_file_from_fd(fd, dflag, ctypes.byref(handle))
        else:
            rc = _lib.phx_file_open(_checks.path_bytes(self.path), flags, perm, dflag, ctypes.byref(handle))
        if rc < 0:
            what = "open (O_DIRECT required by direct=True)" if direct and rc == -_errno.EINVAL else "open"
            if rc == -_errno.ESPIPE:
                what = "open: phoenix moves data at file offsets; a pipe/FIFO/socket (or a terminal) has none"
            raise PhxIOError(-rc, self.path, 0, 0, what)
        self._h = handle.value
        self._cv = threading.Condition()
        self._users = 0  # threads inside a submission
        self._closed = False

    # -- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _enter(self) -> int:
        with self._cv:
            if self._closed:
                raise ValueError(f"I/O on closed file {self.path}")
            self._users += 1
            return self._h

    def _leave(self) -> None:
        with self._cv:
            self._users -= 1
            if self._users == 0:
                self._cv.notify_all()

    def close(self) -> None:
        """Close after the file's in-flight I/O (futures and stream ops) completes."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            while self._users:
                self._cv.wait()
            h, self._h = self._h, None
        rc = _lib.phx_file_close(h)  # waits for the file's requests and queued stream ops
        if rc < 0:
            raise PhxIOError(-rc, self.path, 0, 0, "close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_h", None) and not self._closed:
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self):
        return f"<PhxFile {self.path!r} mode={self.mode!r}{' closed' if self._closed else ''}>"

    # -- information ---------------------------------------------------------------------------

    def size(self) -> int:
        h = self._enter()
        try:
            n = _lib.phx_file_size(h)
        finally:
            self._leave()
        if n < 0:
            raise PhxIOError(-n, self.path, 0, 0, "fstat")
        return n

    def info(self) -> dict:
        """O_DIRECT in use (and why), its alignments, the descriptors."""
        h = self._enter()
        try:
            fi = _FileInfo()
            _lib.phx_file_query(h, ctypes.byref(fi))
        finally:
            self._leave()
        return {
            "direct": bool(fi.direct),
            "why": fi.why.decode(errors="replace"),
            "dio_offset_align": fi.dio_offset_align,
            "dio_mem_align": fi.dio_mem_align,
            "fd_direct": fi.fd_direct,
            "fd_buffered": fi.fd_buffered,
        }

    def fileno(self) -> int:
        """The buffered descriptor (for os.fstat and the like; do not close it)."""
        return self.info()["fd_buffered"]

    def fsync(self) -> None:
        h = self._enter()
        try:
            rc = _lib.phx_file_fsync(h)
        finally:
            self._leave()
        if rc < 0:
            raise PhxIOError(-rc, self.path, 0, 0, "fsync")

    # -- I/O -----------------------------------------------------------------------------------

    def _submit(self, op, buf, size, file_offset, buf_offset, stream) -> IOFuture:
        what = "pread" if op == OP_READ else "pwrite"
        return _submit_many([(self, buf, size, file_offset, buf_offset, op)], what, stream=stream)[0]

    def pread(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
              stream=None) -> IOFuture:
        """Read ``size`` bytes (default: to the end of ``buf``) at ``file_offset`` into
        ``buf`` at ``buf_offset``; returns an :class:`IOFuture` of the byte count.
        Ordered after the caller's stream (``stream``: see "Ordering with the caller's
        stream" above); the bytes are in place once the future is done."""
        return self._submit(OP_READ, buf, size, file_offset, buf_offset, stream)

    def pwrite(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *,
               stream=None) -> IOFuture:
        """Write ``size`` bytes of ``buf`` from ``buf_offset`` to the file at ``file_offset``
        (after the work queued so far on the caller's stream has produced them)."""
        return self._submit(OP_WRITE, buf, size, file_offset, buf_offset, stream)

    def read(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *, stream=None) -> int:
        """Blocking :meth:`pread`: the byte count (short at end of file)."""
        return self.pread(buf, size, file_offset, buf_offset, stream=stream).result()

    def write(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0, *, stream=None) -> int:
        """Blocking :meth:`pwrite`: the byte count."""
        return self.pwrite(buf, size, file_offset, buf_offset, stream=stream).result()

    def read_many(self, buf, file_offsets, sizes, buf_offsets=None, *, check: bool = True, stream=None):
        """Gather: read many extents of this file into one buffer in one call.

        ``file_offsets``, ``sizes`` and ``buf_offsets`` are sequences or NumPy arrays of
        the same length (``sizes`` may be one number for all); ``buf_offsets`` defaults to
        the extents packed in order. The buffer is resolved once, the requests are built
        by NumPy and handed to the C core in slices (one call each), so a gather of tens of
        thousands of small blocks (KV-cache pages, random reads) costs no Python per block.
        Every extent is checked against the buffer before anything is submitted, and
        against its registration by the core (EFAULT for that extent alone).

        Returns an int64 array of byte counts (short at end of file). With ``check``
        (default), a failed extent raises :class:`PhxIOError` naming the first failed one
        and how many failed, after all have finished; without it, its entry is -errno.
        Ordered after the caller's stream, as :meth:`read`.
        """
        return self._many(OP_READ, buf, file_offsets, sizes, buf_offsets, check, stream)

    def write_many(self, buf, file_offsets, sizes, buf_offsets=None, *, check: bool = True, stream=None):
        """Scatter: write many extents of one buffer to this file (see :meth:`read_many`)."""
        return self._many(OP_WRITE, buf, file_offsets, sizes, buf_offsets, check, stream)

    def _many(self, op, buf, file_offsets, sizes, buf_offsets, check, stream):
        s = _settings.get()
        with _using_engine(s) as engine:
            return self._many_on(engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream)

    def _many_on(self, engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream):
        import numpy as np

        what = "read_many" if op == OP_READ else "write_many"
        fo, sz, bo = _many_arrays(file_offsets, sizes, buf_offsets, self.path, what)
        n = fo.size
        out = np.zeros(n, np.int64)
        live = np.flatnonzero(sz)
        if not live.size:
            return out
        explicit = None if stream is None else _streams.handle(stream)
        ends = bo + sz
        lo_i, hi_i = int(live[np.argmin(bo[live])]), int(live[np.argmax(ends[live])])
        # the buffer resolved at its lowest and its highest extent: the highest end inside
        # the buffer puts every extent inside it; one allocation, one kind of memory
        rs = []
        fences = _Fences(engine)
        try:
            for i in (lo_i, hi_i):
                rs.append(_resolve(engine.runtime, buf, int(sz[i]), int(bo[i]), op == OP_READ, self.path,
                                   int(fo[i]), f"{what} (extent {i} of {n})", stream=explicit))
            r, e = rs
            if (r.mem, r.device) != (e.mem, e.device):
                raise ValueError(f"{what}: the buffer's extents lie in different memory "
                                 f"({MEM_NAME.get(r.mem)} {r.device} and {MEM_NAME.get(e.mem)} {e.device})")
            _check_mode(e, s.mode, self.path, int(fo[hi_i]), what)
            base, span = r.addr - int(bo[lo_i]), int(ends[hi_i] - bo[lo_i])
            if r.mem == _buffers.MEM_HOST and r.buf is None and \
                    _lib.phx_mem_probe(r.addr, span) == -_errno.EFAULT:
                raise extent_error(self.path, int(fo[lo_i]), span,
                                   f"{what}: [{r.addr:#x}, +{span}) is not accessible memory (freed?)")
            if r.mem != _buffers.MEM_HOST and engine.runtime is not None:
                # every extent in the device allocation the lowest one is in: the two ends
                # may each lie in an allocation, and the gap between them in the next one
                info = engine.runtime.pointer_info(r.addr)
                if info.size and r.addr + span > info.base + info.size:
                    raise extent_error(self.path, int(fo[hi_i]), int(sz[hi_i]),
                                       f"{what}: extents [{r.addr:#x}, +{span}) run past the device allocation "
                                       f"[{info.base:#x}, +{info.size}) of extent {lo_i} (extent {hi_i} ends "
                                       "outside it): nothing was moved")
            descs = np.zeros(n, _DESC_DTYPE)
            descs["addr"] = np.uint64(base) + bo.astype(np.uint64)
            descs["size"] = sz
            descs["file_offset"] = fo
            descs["op"], descs["mem"], descs["device"], descs["mode"] = op, r.mem, r.device, MODE[s.mode]
            descs["after"] = fences.after(e, explicit, self.path, int(fo[lo_i]), what) or 0
            handles = np.zeros(n, np.uint64)
            h = self._enter()
            try:
                descs["file"] = h
                for a in range(0, n, _MANY_SLICE):  # the first slices run while the next are built
                    b = min(n, a + _MANY_SLICE)
                    rc = _lib.phx_submit(engine.handle, descs[a:].ctypes.data_as(ctypes.POINTER(_Desc)), b - a,
                                         handles[a:].ctypes.data_as(ctypes.POINTER(_P)))
                    if rc < 0:  # out of memory: the earlier slices are in flight, wait for them
                        out[a:] = rc
                        n = a
                        break
                hp = handles.ctypes.data_as(ctypes.POINTER(_P))
                _lib.phx_req_wait_all(hp, n, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), -1)  # no GIL
                bad = np.flatnonzero(out < 0)
                err = None
                if bad.size and check:
                    k = int(bad[0])
                    eo, el = ctypes.c_int64(int(fo[k])), ctypes.c_uint64(int(sz[k]))
                    if handles[k]:
                        _lib.phx_req_error_extent(_P(int(handles[k])), ctypes.byref(eo), ctypes.byref(el))
                    err = PhxIOError(int(-out[k]), self.path, eo.value, el.value,
                                     f"{what}: extent {k} of {fo.size} failed ({bad.size} failed in all)")
                _lib.phx_req_release_all(hp, n)
            finally:
                self._leave()
        finally:
            fences.release()
            for x in rs:
                x.release()
        if err is not None:
            raise err
        return out

    def _stream(self, op, buf, size, file_offset, buf_offset, stream) -> StreamIO:
        s = _settings.get()
        with _using_engine(s) as engine:
            return self._stream_on(engine, s, op, buf, size, file_offset, buf_offset, stream)

    def _stream_on(self, engine, s, op, buf, size, file_offset, buf_offset, stream) -> StreamIO:
        what = "read_async" if op == OP_READ else "write_async"
        explicit = None if stream is None else _streams.handle(stream)
        r = _resolve(engine.runtime, buf, size, buf_offset, op == OP_READ, self.path, file_offset, what,
                     stream=explicit)
        keep = r.buf if r.buf is not None else _NOTHING
        try:
            file_offset = r.foff
            _check_mode(r, s.mode, self.path, file_offset, what)
            if not engine.has_data_path:
                raise PhxIOError(_errno.ENODEV, self.path, file_offset, r.size,
                                 f"{what}: the vendor runtime has no data path (launch_host_func) for stream-ordered I/O")
            h = self._enter()
            try:
                d = _Desc(h, r.addr, r.size, file_offset, op, r.mem, r.device, MODE[s.mode])
                sop = _P()
                on = _streams.caller_stream(r.buf, r.mem, explicit) or 0
                rc = _lib.phx_stream_io(engine.handle, ctypes.byref(d), on, None, ctypes.byref(sop))
            finally:
                self._leave()
            if rc < 0:
                raise PhxIOError(-rc, self.path, file_offset, r.size, what)
        except BaseException:
            r.release()
            raise
        op_obj = StreamIO(sop.value, engine, keep, self, what, r.foff, r.size)
        _prune_stream_ops()
        with _stream_lock:
            _stream_ops.add(op_obj)
        return op_obj

    def read_async(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0,
                   stream=None) -> StreamIO:
        """Read ordered on ``stream`` (None: the caller's stream, found as for :meth:`read`):
        work queued on it before this call has finished when the read starts, work queued
        after sees the bytes. Returns a :class:`StreamIO` whose ``bytes_done`` is bound when
        the stream gets there."""
        return self._stream(OP_READ, buf, size, file_offset, buf_offset, stream)

    def write_async(self, buf, size: int | None = None, file_offset: int = 0, buf_offset: int = 0,
                    stream=None) -> StreamIO:
        """Write ordered on ``stream`` (see :meth:`read_async`)."""
        return self._stream(OP_WRITE, buf, size, file_offset, buf_offset, stream)


_MANY_SLICE = 1024  # read_many / write_many: requests per phx_submit


def _desc_dtype():
    import numpy as np

    dt = np.dtype({"names": [f for f, _ in _Desc._fields_],
                   "formats": ["<u8", "<u8", "<u8", "<i8", "<i4", "<i4", "<i4", "<i4", "<u8"],
                   "offsets": [getattr(_Desc, f).offset for f, _ in _Desc._fields_], "itemsize": ctypes.sizeof(_Desc)})
    return dt


_DESC_DTYPE = _desc_dtype()


def _many_arrays(file_offsets, sizes, buf_offsets, path, what):
    """(file offsets, sizes, buffer offsets) as int64 arrays of one length, checked."""
    import numpy as np

    def arr(x, name):
        a = np.asarray(x)
        if a.size == 0:
            a = a.astype(np.int64)  # [] is float64 to NumPy
        if a.dtype.kind not in "iu" or a.ndim > 1:
            raise TypeError(f"{what}: {name} must be integers from 0 to 2**63-1 (a sequence or a 1-D integer array), "
                            f"got {a.dtype} {a.shape}")
        if a.dtype.kind == "u" and a.size and int(a.max()) > _checks.I64_MAX:
            raise _checks.ArgumentError(_errno.EINVAL, path, 0, 0, f"{what}: {name} holds a value past 2**63-1")
        return a.astype(np.int64, copy=False)

    fo = arr(file_offsets, "file_offsets").ravel()
    n = fo.size
    sz = arr(sizes, "sizes")
    if sz.ndim == 0:
        sz = np.full(n, int(sz), np.int64)
    if sz.size != n:
        raise ValueError(f"{what}: {n} file offsets but {sz.size} sizes")
    if buf_offsets is None:
        bo = np.zeros(n, np.int64)
        np.cumsum(sz[:-1], out=bo[1:])
    else:
        bo = arr(buf_offsets, "buf_offsets").ravel()
        if bo.size != n:
            raise ValueError(f"{what}: {n} file offsets but {bo.size} buffer offsets")
    for a, name in ((fo, "file offset"), (sz, "size"), (bo, "buffer offset")):
        neg = np.flatnonzero(a < 0)
        if neg.size:
            k = int(neg[0])
            raise _checks.ArgumentError(_errno.EINVAL, path, int(fo[k]), int(sz[k]),
                                        f"{what}: extent {k}: negative {name}")
    past = np.flatnonzero(fo > _checks.I64_MAX - sz)  # (no int64 overflow: both are >= 0)
    if past.size:
        k = int(past[0])
        raise _checks.ArgumentError(_errno.EINVAL, path, int(fo[k]), int(sz[k]),
                                    f"{what}: extent {k} ends past 2**63-1, the largest file offset")
    return fo, sz, bo


def open(path, mode: str = "r", *, direct: bool | None = None, sync: bool = False, perm: int = 0o644) -> PhxFile:  # noqa: A001
    """Open ``path`` for I/O (modes r, r+, w, w+, a, a+, x, x+); see :class:`PhxFile`."""
    return PhxFile(path, mode, direct=direct, sync=sync, perm=perm)


# ---- submission (one C call for any number of requests) ------------------------------------

_OPS = {"read": OP_READ, "r": OP_READ, OP_READ: OP_READ, "write": OP_WRITE, "w": OP_WRITE, OP_WRITE: OP_WRITE}


@dataclass
class IORequest:
    """One request of :func:`batch`."""

    file: PhxFile
    buf: object
    size: int | None = None
    file_offset: int = 0
    buf_offset: int = 0
    op: str = "read"


class _Nothing:
    """Stands for "no buffer to keep alive" (raw pairs) where None would mean "done"."""

    @staticmethod
    def release():
        pass


_NOTHING = _Nothing()
_FLUSH = 256  # requests per phx_submit: the first ones start while Python prepares the rest


def _submit_many(reqs, what_default: str | None = None, want_futures: bool = True, stream=None):
    """Submit requests; IOFutures, or (handles, buffers, meta, early) for a waiting batch.

    Requests are resolved in Python and handed to the core in groups of _FLUSH (one C
    call each), so the I/O of the first groups runs while the rest are prepared. A
    request refused in Python fails alone (for one request: raised).
    """
    s = _settings.get()
    with _using_engine(s) as engine:
        return _submit_on(engine, s, reqs, what_default, want_futures, stream)


def _submit_on(engine, s, reqs, what_default, want_futures, stream):
    explicit = None if stream is None else _streams.handle(stream)
    rt = engine.runtime
    mode = MODE[s.mode]
    fences = _Fences(engine)
    single = len(reqs) == 1
    cache = None if single else _ClassCache()
    n_all = len(reqs)
    handles = (_P * n_all)()
    bufs: list = [None] * n_all
    meta: list = [None] * n_all  # (file, file_offset, size, what)
    early: dict[int, BaseException] = {}
    files: dict[int, PhxFile] = {}
    pend: list[int] = []
    descs = (_Desc * min(_FLUSH, n_all))()

    def flush():
        k = len(pend)
        if not k:
            return
        out = (_P * k)()
        rc = _lib.phx_submit(engine.handle, descs, k, out)
        for j, i in enumerate(pend):
            if rc < 0 or not out[j]:
                f, off, size, what = meta[i]
                bufs[i].release()
                bufs[i] = None
                early[i] = PhxIOError(_errno.ENOMEM if rc >= 0 else -rc, f.path, off, size, what)
            else:
                handles[i] = out[j]
        pend.clear()

    try:
        for i, req in enumerate(reqs):
            if isinstance(req, BaseException):  # malformed (_normalize): fails alone
                early[i] = req
                continue
            f, buf, size, file_offset, buf_offset, op = req
            opcode = _OPS.get(op) if isinstance(op, (str, int)) and not isinstance(op, bool) else None
            what = what_default or ("read" if opcode == OP_READ else "write")
            try:
                if opcode is None:
                    raise ValueError(f"request {i}: op {op!r} is not 'read' or 'write'")
                fh = files.get(id(f))
                if fh is None:
                    if not isinstance(f, PhxFile):
                        raise TypeError(f"request {i}: {type(f).__name__} is not a phoenix file (phoenix.io.open)")
                    f._enter()  # ValueError when closed
                    files[id(f)] = f
                r = _resolve(rt, buf, size, buf_offset, opcode == OP_READ, f.path, file_offset, what, cache,
                             stream=explicit)
                file_offset = r.foff
                if mode == 2 and r.mem == _buffers.MEM_DEVICE:
                    r.release()
                    _check_mode(r, s.mode, f.path, file_offset, what)
                try:
                    after = fences.after(r, explicit, f.path, file_offset, what)
                except BaseException:
                    r.release()
                    raise
            except Exception as exc:  # a malformed request fails alone (one request: raised)
                if single:
                    raise
                early[i] = exc
                continue
            d = descs[len(pend)]
            d.file, d.addr, d.size, d.file_offset = f._h, r.addr, r.size, file_offset
            d.op, d.mem, d.device, d.mode = opcode, r.mem, r.device, mode
            d.after = after
            bufs[i] = r.buf if r.buf is not None else _NOTHING
            meta[i] = (f, file_offset, r.size, what)
            pend.append(i)
            if len(pend) == _FLUSH:
                flush()
        flush()
    except BaseException:
        for i in pend:
            bufs[i].release()
        raise
    finally:
        fences.release()
        for f in files.values():
            f._leave()
    if not want_futures:
        return handles, bufs, meta, early
    futures = []
    for i in range(n_all):
        if i in early:
            futures.append(IOFuture.failed(early[i], meta[i][3] if meta[i] else ""))
        else:
            f, off, size, what = meta[i]
            futures.append(IOFuture(handles[i], engine, bufs[i], f, what, off, size))
    return futures


def _normalize(req, i: int):
    """A request as (file, buf, size, file_offset, buf_offset, op), or the TypeError that
    says why it is not one (returned, not raised: a malformed request fails alone)."""
    if isinstance(req, IORequest):
        return (req.file, req.buf, req.size, req.file_offset, req.buf_offset, req.op)
    if isinstance(req, dict):
        unknown = set(req) - {"file", "buf", "size", "file_offset", "buf_offset", "op"}
        if unknown or "file" not in req or "buf" not in req:
            return TypeError(f"request {i}: a dict needs 'file' and 'buf' (and may have size, file_offset, "
                             f"buf_offset, op){'; unknown keys ' + ', '.join(sorted(map(str, unknown))) if unknown else ''}")
        return (req["file"], req["buf"], req.get("size"), req.get("file_offset", 0), req.get("buf_offset", 0),
                req.get("op", "read"))
    try:
        t = tuple(req)
    except TypeError:
        return TypeError(f"request {i}: (file, buf, size, file_offset, buf_offset, op) expected, "
                         f"got {type(req).__name__}")
    if not 2 <= len(t) <= 6:
        return TypeError(f"request {i}: (file, buf, size, file_offset, buf_offset, op) expected, got {len(t)} items")
    defaults = (None, None, None, 0, 0, "read")
    return t + defaults[len(t):]


def batch(requests, *, wait: bool = True, stream=None):
    """Submit many requests at once.

    Each request is an :class:`IORequest`, a dict with those keys, or a tuple
    ``(file, buf, size=None, file_offset=0, buf_offset=0, op="read")``. A failed request
    fails alone. With ``wait`` (default) returns one result per request: the byte count,
    or the :class:`PhxIOError` (not raised); with ``wait=False`` the :class:`IOFuture` list.
    Each request is ordered after its caller's stream (``stream``, else its buffer's).
    """
    reqs = [_normalize(r, i) for i, r in enumerate(requests)]
    if not reqs:
        return []
    if not wait:
        if len(reqs) == 1:
            try:
                return _submit_many(reqs, stream=stream)
            except Exception as exc:
                return [IOFuture.failed(exc)]
        return _submit_many(reqs, stream=stream)
    if len(reqs) == 1:
        try:
            futs = _submit_many(reqs, stream=stream)
        except Exception as exc:
            return [exc]
        err = futs[0].exception()
        return [err if err is not None else futs[0].result()]
    handles, bufs, meta, early = _submit_many(reqs, want_futures=False, stream=stream)
    n = len(reqs)
    results = (ctypes.c_int64 * n)()
    _lib.phx_req_wait_all(handles, n, results, -1)  # one C call for all, no GIL
    out: list = []
    for i in range(n):
        if i in early:
            out.append(early[i])
            continue
        res = results[i]
        if res >= 0:
            out.append(res)
        else:
            f, off, size, what = meta[i]
            eo, el = ctypes.c_int64(off), ctypes.c_uint64(size)
            _lib.phx_req_error_extent(handles[i], ctypes.byref(eo), ctypes.byref(el))
            where = "" if (eo.value, el.value) == (off, size) else f"; failed chunk at offset {eo.value}, length {el.value}"
            out.append(PhxIOError(-res, f.path, off, size, f"{what}{where}"))
        bufs[i].release()
    _lib.phx_req_release_all(handles, n)
    return out


# ---- registrations ----------------------------------------------------------------------------

_reg_lock = threading.Lock()
_registered: dict[int, list] = {}  # base -> adapted buffers kept alive (one per reference)


def register(buf) -> int:
    """Register a buffer for I/O; returns its base address.

    Registering records where the memory lives (so I/O on it skips the vendor's pointer
    query) and keeps the object alive until :func:`deregister`. An exact duplicate is
    reference counted; any other overlap with a registration raises RegistrationError.
    An I/O extent that starts inside a registration must end inside it (EFAULT).
    """
    rt = _runtime()
    b = _buffers.adapt(buf, writable=False)
    if b.nbytes <= 0:
        b.release()
        raise RegistrationError("cannot register an empty buffer")
    try:
        mem, device, _ = _buffers.classify(rt, b.addr, b.nbytes, b.kind, b.device)
    except (TypeError, _buffers.OutOfBounds) as exc:
        b.release()
        raise RegistrationError(str(exc)) from None
    with _reg_lock:
        rc = _lib.phx_reg_add(b.addr, b.nbytes, mem, device)
        if rc < 0:
            b.release()
            info = _RegInfo()
            other = ""
            for probe in (b.addr, b.addr + b.nbytes - 1):
                if _lib.phx_reg_lookup(probe, 1, ctypes.byref(info)) != 1:
                    other = f" (overlaps [{info.base:#x}, +{info.size}))"
                    break
            raise RegistrationError(f"cannot register [{b.addr:#x}, +{b.nbytes}): {_strerror(rc)}{other}")
        _registered.setdefault(b.addr, []).append(b)
    return b.addr


def deregister(buf) -> None:
    """Drop one reference of the registration starting at ``buf``'s base address."""
    b = _buffers.adapt(buf, writable=False)
    try:
        with _reg_lock:
            rc = _lib.phx_reg_remove(b.addr)
            if rc < 0:
                raise RegistrationError(f"[{b.addr:#x}, +{b.nbytes}) is not registered")
            kept = _registered.get(b.addr)
            if kept:
                kept.pop().release()
                if not kept:
                    del _registered[b.addr]
    finally:
        b.release()


# ---- information ------------------------------------------------------------------------------


def stats() -> dict:
    """Counters of the C core: live objects (contexts, threads, files, requests,
    stream_ops, registrations, worker_streams, bounce_bytes, bounce_in_use) and
    cumulative ones (bytes_read/written, chunks per path, direct/buffered I/Os,
    reissues, O_DIRECT fallbacks, io_uring_enter calls), and the file-mapping cache's
    (fmap_windows and fmap_bytes live: registered now; fmap_hits and fmap_misses: staged
    reads into device memory served from a registered mapping, or not); pool_waits
    (chunks that waited for a bounce slot, or for one of their worker's page-cache slots)
    and copy_flushes (completion callbacks launched for staged reads' device copies)."""
    _prune_stream_ops()
    st = _Stats()
    _lib.phx_io_get_stats(ctypes.byref(st))
    return {name: getattr(st, name) for name in _STAT_FIELDS}


def sizes() -> dict:
    """The sizes the current worker pool runs with, as it resolved the settings: the bounce
    pool (``auto`` sized), the chunk, the chunk of staged and bounced transfers (at most
    the chunk, and small enough that two fit the pool: a small pool takes smaller staged
    chunks, it is never refused) and the largest bounce slot, with a sentence saying so."""
    sz = _Sizes()
    with _using_engine() as e:
        _lib.phx_ctx_sizes(e.handle, ctypes.byref(sz))
    out = {name: getattr(sz, name) for name, _ in _Sizes._fields_}
    mib = 1 << 20
    why = f"bounce pool {sz.bounce_pool / mib:g} MiB, chunk {sz.chunk / mib:g} MiB"
    if sz.staged_chunk < sz.chunk:
        why += (f"; staged chunks {sz.staged_chunk / mib:g} MiB (two must fit the pool: raise "
                "PHX_BOUNCE_POOL_SIZE for staged chunks of the full chunk size)")
    out["why"] = why
    return out


# ---- the file-mapping registration cache (warm reads; phoenix/csrc/phx_io.h) ------------------


def _each_live_engine(fn) -> list:
    """fn(engine) for every engine not closing, each held meanwhile."""
    with _engine_lock:
        engines = list(_all_engines)
    out = []
    for e in engines:
        if e.enter():
            try:
                out.append(fn(e))
            finally:
                e.leave()
    return out


def fmap_wait(timeout: float | None = None) -> bool:
    """Wait until the background registrations queued by warm-read misses are done (the
    next read of those ranges hits). For benchmarks and KV tiers: "the registration
    happens between agent rounds". False if ``timeout`` seconds passed first."""
    ns = -1 if timeout is None else max(0, int(timeout * 1e9))
    return all(rc == 0 for rc in _each_live_engine(lambda e: _lib.phx_fmap_wait(e.handle, ns)))


def fmap_clear() -> int:
    """Unregister and unmap every cached file mapping now (those a request is copying
    from go when it completes); returns how many were dropped."""
    return sum(max(0, rc) for rc in _each_live_engine(lambda e: _lib.phx_fmap_clear(e.handle)))


def fmap_info() -> dict:
    """The current pool's file-mapping cache: mode, budget, window, registered windows and
    bytes, queued registrations, windows the vendor refused, hits, misses, evictions."""
    fi = _FmapInfo()
    with _using_engine() as e:
        _lib.phx_fmap_query(e.handle, ctypes.byref(fi))
    out = {name: getattr(fi, name) for name, _ in _FmapInfo._fields_ if name not in ("why", "mode")}
    out["mode"] = FMAP_MODE_NAME.get(fi.mode, str(fi.mode))
    out["why"] = fi.why.decode(errors="replace")
    return out


def _fmap_lookup(f: PhxFile, offset: int, length: int):
    """Test hook: the mapped address of [offset, +length) of ``f`` if cached, else None."""
    addr = _P()
    h = f._enter()
    try:
        with _using_engine() as e:
            rc = _lib.phx_fmap_lookup(e.handle, h, offset, length, ctypes.byref(addr))
    finally:
        f._leave()
    return addr.value if rc == 0 else None


def _probe_engine(name: str) -> tuple[bool, str]:
    why = ctypes.create_string_buffer(256)
    rc = _lib.phx_engine_probe(ENGINE[name], why, len(why))
    return rc >= 0, why.value.decode()


def capabilities(path=None) -> dict:
    """What the I/O stack can do here, and why (for ``phx info``).

    ``path``: a file or directory whose file system to check for O_DIRECT (default: the
    temporary directory). Returns engines (io_uring, threads, which ``auto`` picks),
    O_DIRECT on that file system, the vendor's data path, and the paths (host, direct,
    staged, zero-copy file mappings) with a reason each.
    """
    s = _settings.get()
    out: dict = {"settings": {k: getattr(s, k) for k in _settings.DEFAULTS}}
    if s.bounce_pool_size == 0:
        out["settings"]["bounce_pool_size"] = "auto"
    try:
        out["sizes"] = sizes()
    except Exception as exc:  # no engine can start: capabilities() still reports the rest
        out["sizes"] = {"why": f"cannot start a worker pool: {exc}"}
    ok_uring, why_uring = _probe_engine("io_uring")
    _, why_auto = _probe_engine("auto")
    out["engines"] = {
        "io_uring": {"available": ok_uring, "why": why_uring},
        "threads": {"available": True, "why": "pread/pwrite worker threads: always available"},
        "auto": "io_uring" if ok_uring else "threads",
        "auto_why": why_auto,
        "selected": s.engine if s.engine != "auto" else ("io_uring" if ok_uring else "threads"),
    }
    where = os.fspath(path) if path is not None else tempfile.gettempdir()
    directory = where if os.path.isdir(where) else os.path.dirname(os.path.abspath(where))
    try:
        fd, probe = tempfile.mkstemp(prefix=".phx-probe-", dir=directory)
        os.close(fd)
        try:
            with PhxFile(probe, "r+") as f:
                fi = f.info()
                cache_rc = _lib.phx_cache_probe_works(f._h)
        finally:
            os.unlink(probe)
        out["o_direct"] = {"path": directory, "available": fi["direct"], "why": fi["why"],
                           "offset_align": fi["dio_offset_align"], "mem_align": fi["dio_mem_align"]}
        out["page_cache_probe"] = {
            "available": cache_rc == 0,
            "why": "cachestat(2) works: direct=None reads ranges already in the page cache buffered"
            if cache_rc == 0 else f"cachestat(2) unavailable ({_strerror(cache_rc)}; Linux 6.5+): O_DIRECT reads "
                                  "go to the disk even for cached data",
        }
    except OSError as exc:
        out["o_direct"] = {"path": directory, "available": False, "why": f"cannot probe: {exc}"}
    rt = _runtime()
    modes = {"host": {"available": True, "why": "host memory (plain, pinned or registered) is read and written in "
                                                  "place: O_DIRECT for the aligned body, buffered for unaligned ends"}}
    if rt is None:
        out["vendor"] = None
        modes["direct"] = {"available": False, "why": "no vendor runtime selected"}
        modes["staged"] = {"available": False, "why": "no vendor runtime selected"}
        out["stream_ordered"] = {"available": False, "why": "no vendor runtime selected"}
        out["caller_stream"] = {"by": "none", "why": "no vendor runtime selected: host memory only, nothing to order"}
    else:
        dp = None
        try:
            dp = rt.data_path()
            missing = dp.missing()
        except Exception as exc:
            missing = [f"data_path() failed: {exc}"]
        out["vendor"] = {"name": rt.name, "test_double": bool(getattr(rt, "is_test_double", False)),
                         "data_path": "complete" if not missing else f"missing: {', '.join(missing)}"}
        modes["staged"] = {"available": not missing,
                           "why": "pinned bounce buffers + the vendor's memcpy_async on per-worker streams"
                           if not missing else f"the vendor's data path lacks {', '.join(missing)}"}
        out["stream_ordered"] = {"available": not missing,
                                 "why": "host callbacks (launch_host_func) run the file I/O in stream order, in every "
                                        "mode" if not missing else "needs the vendor's launch_host_func"}
        if missing:
            out["caller_stream"] = {"by": "none", "why": "no data path: device memory cannot be used"}
        else:
            by_events = not dp.missing_events()
            out["caller_stream"] = {"by": "events" if by_events else "synchronize", "why": dp.ordering()}
        try:
            ptr = rt.device_alloc(1 << 16, 0)
            try:
                ok, why = rt.direct_capable(ptr, 1 << 16)
            finally:
                rt.device_free(ptr)
            modes["direct"] = {"available": bool(ok), "why": why}
        except Exception as exc:
            modes["direct"] = {"available": False, "why": f"cannot probe device memory: {exc}"}
    fm = None
    try:
        fm = fmap_info()
    except Exception as exc:  # no engine can start: say why
        modes["zero_copy_file_mappings"] = {"available": False, "why": f"cannot query: {exc}"}
    if fm is not None:
        on = fm["mode"] != "off"
        modes["zero_copy_file_mappings"] = {
            "available": on,
            "why": (f"warm reads into device memory: page-cache ranges mmap'd and host-registered in "
                    f"{fm['window'] >> 20} MiB windows (flags {fm['register_flags']:#x}), cached up to "
                    f"{fm['budget'] >> 20} MiB, one DMA per read; mode {fm['mode']}") if on else fm["why"],
            "state": fm,
        }
    out["modes"] = modes
    return out
