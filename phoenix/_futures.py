"""Futures of the I/O calls: :class:`IOFuture` (pread/pwrite, batch) and :class:`StreamIO`
(stream-ordered reads and writes).

Core side, control plane: a future wraps the C core's request (``phx_req``, held by its
call's ``phoenix._phxcalls.Requests``) or stream op (``phx_sop``, in the C base
``StreamOp``). Waiting happens in C without the GIL; the C objects keep the buffer and
the engine alive until the I/O is over, and a future dropped early waits for it (in C,
where no exception can interrupt it), so no I/O ever lands in freed memory.
"""

from __future__ import annotations

import os

from ._core import calls as _bound_calls
from .checks import timeout_ns
from .errors import file_error

_calls = _bound_calls()  # phoenix._phxcalls, bound to the C core


class IOFuture:
    """The result of :meth:`PhxFile.pread` / :meth:`PhxFile.pwrite` (KvikIO's IOFuture).

    ``result()`` (alias ``get()``) waits and returns the byte count (short at end of
    file) or raises :class:`PhxIOError`. The buffer is kept alive until the I/O is over;
    a future dropped before it completes waits for it. Any thread may wait on it.
    """

    __slots__ = (
        "_group",
        "_i",
        "_engine",
        "_file",
        "_what",
        "_offset",
        "_size",
        "_value",
        "_error",
        "_done",
        "__weakref__",
    )

    def __init__(self, group, i, engine, file, what, offset, size, error=None):
        # the request is the group's (phoenix._phxcalls.Requests, C): it keeps the buffer until
        # the request is done, and waits for and releases the request when the last future
        # of its call goes; nothing here waits in Python, so no exception can skip it
        self._group = group
        self._i = i
        self._engine = engine
        self._file = file
        self._what = what
        self._offset = offset
        self._size = size
        self._value = None
        self._error = error
        self._done = group is None

    @classmethod
    def failed(cls, error: BaseException, what: str = "") -> IOFuture:
        return cls(None, 0, None, None, what, 0, 0, error)

    def done(self) -> bool:
        if self._done:
            return True
        if self._group.done(self._i):
            self._collect()
            return True
        return False

    def _collect(self) -> None:
        # no lock (a signal handler, or a thread of a forked child's parent, may be inside):
        # two threads collecting at once compute the same result, and collect(i) is idempotent
        if self._done:
            return
        g, i = self._group, self._i
        res = g.result(i)
        if res < 0:
            where = ""
            ext = g.error_extent(i)
            if ext is not None and ext != (self._offset, self._size):
                where = f"; failed chunk at offset {ext[0]}, length {ext[1]}"
            self._error = file_error(-res, self._file, self._offset, self._size, f"{self._what}{where}")
        else:
            self._value = res
        g.collect(i)
        self._engine = None
        self._done = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for completion; False if ``timeout`` (seconds) passed first."""
        if self._done:
            return True
        ns = timeout_ns(timeout, self._what)
        if self._group.wait(self._i, ns) != 0:
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

    def __repr__(self):
        state = "pending" if not self.done() else f"error {self._error!r}" if self._error else f"done {self._value}"
        return f"<IOFuture {self._what} {state}>"


class StreamIO(_calls.StreamOp):
    """A stream-ordered read or write (:meth:`PhxFile.read_async` / ``write_async``).

    Its result is bound late: once the stream has reached the end of the operation,
    :attr:`bytes_done` is the byte count or a negative errno (cuFile's ``bytes_read``).
    Made in C by the call that queues the op (``phoenix._phxcalls.StreamMethod``), which
    keeps it, and its buffer, alive until the stream has run it, dropped or not.
    """

    __slots__ = ()

    def done(self) -> bool:
        """True once the stream has run the operation to its end."""
        if self._poll():
            _stream_ops.discard(self)
            return True
        return False

    @property
    def bytes_done(self) -> int | None:
        """Bytes moved, or -errno; None until the stream has reached the end of the op."""
        return self._value if self.done() else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (without touching the stream) until the op has run; False on timeout."""
        if self._done:
            return True
        if not self._wait(timeout_ns(timeout, self._what)):
            return False
        _stream_ops.discard(self)
        return True

    def result(self, timeout: float | None = None) -> int:
        """Wait for the op; its byte count, or PhxIOError for a negative errno."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self._what}: the stream has not reached it after {timeout} s")
        if self._value < 0:
            raise file_error(-self._value, self._file, self._offset, self._size, self._what)
        return self._value

    def __repr__(self):
        return f"<StreamIO {self._what} bytes_done={self.bytes_done}>"


# stream ops not run yet, dropped by the caller or not: each (and its buffer) stays alive
# here until its stream has run it (the C call that queues an op adds it)
_stream_ops: set[StreamIO] = set()


def _prune_stream_ops(wait: bool = False) -> None:
    for op in list(_stream_ops):
        if op.wait() if wait else op.done():
            _stream_ops.discard(op)


def _after_fork_in_child() -> None:
    # the parent's ops: their streams' threads are not here (they answer -ECHILD)
    _stream_ops.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
