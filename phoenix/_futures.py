"""Futures of the I/O calls: :class:`IOFuture` (pread/pwrite, batch) and :class:`StreamIO`
(stream-ordered reads and writes).

Core side, control plane: a future wraps the C core's request (``phx_req``) or stream
op (``phx_sop``) handle. Waiting happens in C without the GIL; the future keeps the
buffer and the engine alive until the I/O is over, and a future dropped early waits
for it, so no I/O ever lands in freed memory.
"""

from __future__ import annotations

import ctypes
import threading

from ._abi import _lib
from .checks import timeout_ns
from .errors import file_error


class IOFuture:
    """The result of :meth:`PhxFile.pread` / :meth:`PhxFile.pwrite` (KvikIO's IOFuture).

    ``result()`` (alias ``get()``) waits and returns the byte count (short at end of
    file) or raises :class:`PhxIOError`. The buffer is kept alive until the I/O is over;
    a future dropped before it completes waits for it. Any thread may wait on it.
    """

    __slots__ = (
        "_req",
        "_engine",
        "_buf",
        "_file",
        "_what",
        "_offset",
        "_size",
        "_value",
        "_error",
        "_done",
        "_lock",
        "__weakref__",
    )

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
                where = (
                    ""
                    if (off.value, length.value) == (self._offset, self._size)
                    else f"; failed chunk at offset {off.value}, length {length.value}"
                )
                self._error = file_error(-res, self._file, self._offset, self._size, f"{self._what}{where}")
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
        ns = timeout_ns(timeout, self._what)
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

    __slots__ = (
        "_sop",
        "_engine",
        "_buf",
        "_file",
        "_what",
        "_offset",
        "_size",
        "_value",
        "_done",
        "_lock",
        "__weakref__",
    )

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
        ns = timeout_ns(timeout, self._what)
        if _lib.phx_sop_wait(self._sop, ns) != 0:
            return False
        self._collect()
        return True

    def result(self, timeout: float | None = None) -> int:
        """Wait for the op; its byte count, or PhxIOError for a negative errno."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self._what}: the stream has not reached it after {timeout} s")
        if self._value < 0:
            raise file_error(-self._value, self._file, self._offset, self._size, self._what)
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
        if op.wait() if wait else op.done():
            with _stream_lock:
                _stream_ops.discard(op)
