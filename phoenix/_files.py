"""Files: :class:`PhxFile` and :func:`open`, and the submission of their requests to the core.

Core side, control plane. A :class:`PhxFile` wraps the C core's file (``phx_file``: an
O_DIRECT and a buffered descriptor); its calls resolve their extents
(:mod:`phoenix._extents`) and hand the requests to the current engine
(:mod:`phoenix._engine`) in a few C calls, which return futures (:mod:`phoenix._futures`).
Every blocking wait runs in C without the GIL.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import functools
import os

from . import buffers as _buffers
from . import checks as _checks
from . import settings as _settings
from . import streams as _streams
from ._abi import (
    _DESC_DTYPE,
    DIRECT_AUTO,
    DIRECT_OFF,
    DIRECT_ON,
    F_CREATE,
    F_EXCL,
    F_READ,
    F_SYNC,
    F_TRUNC,
    F_WRITE,
    MEM_NAME,
    MODE,
    OP_READ,
    OP_WRITE,
    _Desc,
    _FileInfo,
    _lib,
)
from ._core import calls as _bound_calls
from ._engine import _using_engine
from ._extents import _check_mode, _ClassCache, _Fences, _resolve
from ._futures import IOFuture, StreamIO, _prune_stream_ops, _stream_ops
from .errors import PhxIOError, _opened_for, extent_error, file_error

_calls = _bound_calls()  # phoenix._phxcalls, bound to the C core

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
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string ({', '.join(_MODES)}), got {type(mode).__name__} {mode!r}")
    key = mode.replace("b", "")
    if key not in _MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(_MODES)} (a 'b' is accepted and ignored)")
    return _MODES[key]


def _open_error(err: int, path: str, mode: str, direct, fd) -> PhxIOError:
    """Why ``path`` could not be opened with ``mode``, and what to do: the path once, no extent."""
    readable, writable = _opened_for(mode)
    need = "read and write" if readable and writable else "write" if writable else "read"
    key = mode.replace("b", "")
    if fd is not None:
        return PhxIOError(err, path, what=f"cannot use descriptor {fd}")
    if err == _errno.ENOENT:
        parent = os.path.dirname(path) or "."
        if "r" not in key and not os.path.isdir(parent):
            reason = (
                f"No such file or directory: its directory {parent} does not exist; create it first "
                f"(mode {mode!r} creates the file, not its directories)"
            )
        else:
            reason = "No such file or directory" + ("; open it with 'w' or 'a' to create it" if key == "r+" else "")
    elif err in (_errno.EACCES, _errno.EPERM):
        if "r" not in key and not os.path.lexists(path):
            reason = (
                f"Permission denied: mode {mode!r} creates the file, which needs permission to write its "
                f"directory {os.path.dirname(path) or '.'}"
            )
        else:
            reason = f"Permission denied: mode {mode!r} needs permission to {need} it" + (
                "; open it with 'r' to only read it" if writable and readable and key.startswith("r") else ""
            )
    elif err == _errno.EROFS:
        reason = f"Read-only file system: mode {mode!r} writes; open it with 'r', or write the file elsewhere"
    elif err == _errno.EISDIR:
        reason = "Is a directory: phoenix reads and writes files; give the path of a file"
    elif err == _errno.ENOTDIR:
        reason = "Not a directory: a component of the path is a file, not a directory"
    elif err == _errno.EEXIST:
        reason = (
            f"File exists: mode {mode!r} only creates a new file; open it with 'w' to replace it or 'r+' to change it"
        )
    elif err == _errno.EINVAL and direct:
        reason = (
            "the file system refuses O_DIRECT (Invalid argument), which direct=True requires; "
            "pass direct=None to fall back to buffered I/O where it is refused"
        )
    elif err == _errno.ESPIPE:
        reason = (
            "Illegal seek: phoenix moves data at file offsets; a pipe, FIFO, socket or terminal has none, "
            "and some /proc files take no writes at an offset; give a regular file or a block device"
        )
    else:
        reason = None
    return PhxIOError(err, path, reason=reason)


def _stream_refused(rc: int, f, offset: int, size: int, what: str):
    raise file_error(-rc, f, offset, size, what)


class PhxFile:
    """A file open for I/O between it and host or device memory (KvikIO's ``CuFile``).

    ``direct``: None (default) uses O_DIRECT where the file system takes it, but reads
    ranges that are mostly in the page cache already through it (``cachestat``, Linux
    6.5+; backing off while it misses); True always uses O_DIRECT (PhxIOError EINVAL
    where refused); False never uses it. ``sync=True``
    opens with O_DSYNC: a write is durable when its future completes.
    ``fd``: adopt an open descriptor (the caller keeps and closes its own): phoenix opens the
    inode again through ``/proc/self/fd`` (a regular file or block device), so flags the caller
    sets on its descriptor later (O_APPEND, O_DIRECT) do not change phoenix's I/O; a dup where
    that cannot be done and no such flag is set yet.
    Thread-safe: any number of threads may submit I/O on one file.
    """

    def __init__(
        self,
        path,
        mode: str = "r",
        *,
        direct: bool | None = None,
        sync: bool = False,
        perm: int = 0o644,
        fd: int | None = None,
    ):
        self._gate = None
        self._fd = None
        if fd is not None:
            fd = _checks.bounded(fd, "fd", "open", 0, 2**31 - 1)
        self.path = os.fspath(path) if fd is None or path is not None else f"<fd {fd}>"
        self.mode = mode
        flags = _open_flags(mode) | (F_SYNC if sync else 0)
        perm = _checks.bounded(perm, "perm", "open", 0, 0o7777)
        dflag = DIRECT_AUTO if direct is None else DIRECT_ON if direct else DIRECT_OFF
        what = f"I/O on closed file {self.path}"
        if fd is not None:
            gate = _calls.file_from_fd(fd, dflag, what)
        else:
            gate = _calls.file_open(_checks.path_bytes(self.path), flags, perm, dflag, what)
        if isinstance(gate, int):
            raise _open_error(-gate, self.path, mode, direct, fd)
        # the C file, owned by a gate made in the same C call: entered and left in C by
        # every call that uses it, closed once (after them) by close() or when collected
        self._gate = gate
        self._fd = fd

    # -- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._gate is None or self._gate.closed

    @property
    def _h(self) -> int | None:
        """The C file's address (None once closed); use it inside ``with self._gate``."""
        return None if self.closed else self._gate.value

    @property
    def _users(self) -> int:
        """Threads inside a call on this file now."""
        return 0 if self._gate is None else self._gate.users

    def close(self) -> None:
        """Close after the file's in-flight I/O (futures and stream ops) completes."""
        if self._gate is None:
            return
        first, rc = self._gate.close()  # waits for the calls inside, then the file's I/O (no GIL)
        if first and rc < 0:
            raise PhxIOError(-rc, self.path, what="close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<PhxFile {self.path!r} mode={self.mode!r}{' closed' if self.closed else ''}>"

    # -- information ---------------------------------------------------------------------------

    def size(self) -> int:
        with self._gate as h:
            n = _lib.phx_file_size(h)
        if n < 0:
            raise PhxIOError(-n, self.path, what="fstat")
        return n

    def info(self) -> dict:
        """O_DIRECT in use (and why), its alignments, the descriptors."""
        fi = _FileInfo()
        with self._gate as h:
            _lib.phx_file_query(h, ctypes.byref(fi))
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
        with self._gate as h:
            rc = _lib.phx_file_fsync(h)
        if rc < 0:
            raise PhxIOError(-rc, self.path, what="fsync")

    # -- I/O -----------------------------------------------------------------------------------

    def _submit(self, op, buf, size, file_offset, buf_offset, stream, priority) -> IOFuture:
        what = "pread" if op == OP_READ else "pwrite"
        return _submit_many([(self, buf, size, file_offset, buf_offset, op, priority)], what, stream=stream)[0]

    def pread(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        *,
        stream=None,
        priority: str = "normal",
    ) -> IOFuture:
        """Read ``size`` bytes (default: to the end of ``buf``) at ``file_offset`` into
        ``buf`` at ``buf_offset``; returns an :class:`IOFuture` of the byte count.
        Ordered after the caller's stream (``stream``: see "Ordering with the caller's
        stream" in :mod:`phoenix.io`); the bytes are in place once the future is done.
        ``priority`` as for :meth:`pwrite`."""
        return self._submit(OP_READ, buf, size, file_offset, buf_offset, stream, priority)

    def pwrite(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        *,
        stream=None,
        priority: str = "normal",
    ) -> IOFuture:
        """Write ``size`` bytes of ``buf`` from ``buf_offset`` to the file at ``file_offset``
        (after the work queued so far on the caller's stream has produced them).

        ``priority``: ``"normal"`` (default) or ``"background"``. The workers run normal
        requests' chunks before background ones (one background chunk after every few
        normal ones: never starved); while normal chunks are in their I/O (or one finished
        less than 20 ms ago) at most one background chunk (2 MiB at most) is, and otherwise
        background chunks leave a quarter of the bounce pool free: a load submitted behind
        gigabytes of background writes (a KV engine's offloads) waits for that one chunk,
        not the queue.
        Anything else raises :class:`~phoenix.checks.ArgumentError`."""
        return self._submit(OP_WRITE, buf, size, file_offset, buf_offset, stream, priority)

    def read(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        *,
        stream=None,
        priority: str = "normal",
    ) -> int:
        """Blocking :meth:`pread`: the byte count (short at end of file). A :meth:`write_async`
        of this file (any handle) issued before it on the range (or one that grows the file
        into the range the read has past the file's end) is waited for on the host, queued on
        its stream or not: the read returns what it wrote."""
        return self._blocking(OP_READ, buf, size, file_offset, buf_offset, stream, priority)

    def write(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        *,
        stream=None,
        priority: str = "normal",
    ) -> int:
        """Blocking :meth:`pwrite` (``priority`` as there): the byte count."""
        return self._blocking(OP_WRITE, buf, size, file_offset, buf_offset, stream, priority)

    def _blocking(self, op, buf, size, file_offset, buf_offset, stream, priority) -> int:
        # submitted and waited for inside one C guard, not as pread(...).result(): a future
        # whose wait is interrupted stays alive in the traceback (its frames hold it), and
        # its I/O would run on after read() raised
        what = "pread" if op == OP_READ else "pwrite"
        req = [(self, buf, size, file_offset, buf_offset, op, priority)]
        res = _submit_many(req, what, wait=True, stream=stream)[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def read_many(
        self, buf, file_offsets, sizes, buf_offsets=None, *, check: bool = True, stream=None, priority: str = "normal"
    ):
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
        Ordered after the caller's stream, as :meth:`read`; ``priority`` as for
        :meth:`pwrite`.
        """
        return self._many(OP_READ, buf, file_offsets, sizes, buf_offsets, check, stream, priority)

    def write_many(
        self, buf, file_offsets, sizes, buf_offsets=None, *, check: bool = True, stream=None, priority: str = "normal"
    ):
        """Scatter: write many extents of one buffer to this file (see :meth:`read_many`);
        ``priority="background"`` for offloads nobody waits for (see :meth:`pwrite`)."""
        return self._many(OP_WRITE, buf, file_offsets, sizes, buf_offsets, check, stream, priority)

    def _many(self, op, buf, file_offsets, sizes, buf_offsets, check, stream, priority="normal"):
        s = _settings.get()
        with _using_engine(s) as engine:
            # in a C guard: however this ends, no request of it is still running after it
            return _calls.guarded(
                self._many_on, engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream, priority
            )

    def _many_on(self, g, engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream, priority="normal"):
        import numpy as np

        what = "read_many" if op == OP_READ else "write_many"
        prio = _checks.priority(priority, self.path, what)
        fo, sz, bo = _checks.extent_arrays(file_offsets, sizes, buf_offsets, self.path, what)
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
        fences = _Fences(engine, g)
        try:
            for i in (lo_i, hi_i):
                rs.append(
                    _resolve(
                        engine.runtime,
                        buf,
                        int(sz[i]),
                        int(bo[i]),
                        op == OP_READ,
                        self.path,
                        int(fo[i]),
                        f"{what} (extent {i} of {n})",
                        stream=explicit,
                    )
                )
            r, e = rs
            if (r.mem, r.device) != (e.mem, e.device):
                raise ValueError(
                    f"{what}: the buffer's extents lie in different memory "
                    f"({MEM_NAME.get(r.mem)} {r.device} and {MEM_NAME.get(e.mem)} {e.device})"
                )
            _check_mode(e, s.mode, self.path, int(fo[hi_i]), what)
            base, span = r.addr - int(bo[lo_i]), int(ends[hi_i] - bo[lo_i])
            if r.mem == _buffers.MEM_HOST and r.buf is None and _lib.phx_mem_probe(r.addr, span) == -_errno.EFAULT:
                raise extent_error(
                    self.path, int(fo[lo_i]), span, what, f"[{r.addr:#x}, +{span}) is not accessible memory (freed?)"
                )
            if r.mem != _buffers.MEM_HOST and engine.runtime is not None:
                # every extent in the device allocation the lowest one is in: the two ends
                # may each lie in an allocation, and the gap between them in the next one
                info = engine.runtime.pointer_info(r.addr)
                if info.size and r.addr + span > info.base + info.size:
                    raise extent_error(
                        self.path,
                        int(fo[hi_i]),
                        int(sz[hi_i]),
                        f"{what}: extent {hi_i} of {n}",
                        f"the device allocation [{info.base:#x}, +{info.size}) of extent {lo_i} "
                        f"holds {info.size} bytes; the extents need {span} from {r.addr - info.base} "
                        f"bytes into it (extent {hi_i} ends outside it); nothing was moved: keep "
                        "every extent of one call inside one allocation",
                    )
            descs = np.zeros(n, _DESC_DTYPE)
            descs["addr"] = np.uint64(base) + bo.astype(np.uint64)
            descs["size"] = sz
            descs["file_offset"] = fo
            descs["op"], descs["mem"], descs["device"], descs["mode"] = op, r.mem, r.device, MODE[s.mode]
            descs["after"] = fences.after(e, explicit, self.path, int(fo[lo_i]), what) or 0
            descs["priority"] = prio
            descs["flags"] = r.owned if r.owned and e.owned else 0  # (both ends: one object)
            for x in rs:  # the group lets them go once every request is done
                g.keep_all(x.buf)
                x.buf = None
        finally:
            for x in rs:
                x.release()
        descs["file"] = g.enter(self._gate)  # the file stays open until every slice is submitted
        at = descs.ctypes.data
        for a in range(0, n, _MANY_SLICE):  # the first slices run while the next are built
            b = min(n, a + _MANY_SLICE)
            rc = g.submit(engine.handle, at + a * _DESC_DTYPE.itemsize, b - a)
            if rc < 0:  # out of memory: the earlier slices are in flight, wait for them
                out[a:] = rc
                n = a
                break
        g.wait_all(out.ctypes.data, 0, n)  # no GIL
        bad = np.flatnonzero(out < 0)
        err = None
        if bad.size and check:
            k = int(bad[0])
            ext = g.error_extent(k) if k < n else None
            eo, el = ext if ext is not None else (int(fo[k]), int(sz[k]))
            err = file_error(
                int(-out[k]), self, eo, el, f"{what}: extent {k} of {fo.size} failed ({bad.size} failed in all)"
            )
        g.finish()
        if err is not None:
            raise err
        return out

    def _stream_plan(self, op, buf, size, file_offset, buf_offset, stream, priority) -> tuple:
        """What read_async / write_async queue: checked and resolved here, in Python (an
        exception here queues nothing); queued in C (``phoenix._phxcalls.StreamMethod``)."""
        what = "read_async" if op == OP_READ else "write_async"
        _prune_stream_ops()
        s = _settings.get()
        with _using_engine(s) as engine:
            prio = _checks.priority(priority, self.path, what)
            explicit = None if stream is None else _streams.handle(stream)
            r = _resolve(
                engine.runtime, buf, size, buf_offset, op == OP_READ, self.path, file_offset, what, stream=explicit
            )
            try:
                file_offset = r.foff
                _check_mode(r, s.mode, self.path, file_offset, what)
                if not engine.has_data_path:
                    raise PhxIOError(
                        _errno.ENODEV,
                        self.path,
                        file_offset,
                        r.size,
                        what,
                        reason="the vendor runtime has no data path (launch_host_func) for stream-ordered "
                        "I/O; use read/write (or pread/pwrite) instead",
                    )
                # (a file closed by now is refused by the C step, which enters its gate)
                d = _Desc(self._gate.value, r.addr, r.size, file_offset, op, r.mem, r.device, MODE[s.mode])
                d.priority = prio
                d.flags = r.owned
                on = _streams.caller_stream(r.buf, r.mem, explicit) or 0
            except BaseException:
                r.release()
                raise
        keep, r.buf = r.buf, None
        plan = (self._gate, engine._gate, engine.handle, ctypes.addressof(d), d, on, StreamIO, _stream_ops)
        return plan + (keep, what, self, file_offset, r.size, engine)

    def read_async(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        stream=None,
        *,
        priority: str = "normal",
    ) -> StreamIO:
        """Read ordered on ``stream`` (None: the caller's stream, found as for :meth:`read`):
        work queued on it before this call has finished when the read starts, work queued
        after sees the bytes. It reads the file as the stream finds it (a write queued
        before it, through any handle, that grows the file is read), and leaves the buffer
        past the bytes it read as it was. Returns a :class:`StreamIO` whose ``bytes_done``
        is bound when the stream gets there. ``priority`` as for :meth:`pwrite`. A staged op
        (device memory the CPU cannot address) holds its bounce slots from this call until
        its stream runs it: a call waits while ops queued behind busy streams hold the whole
        pool (``PHX_BOUNCE_POOL_SIZE``), so size the pool for the ops you keep queued."""
        return self._stream_plan(OP_READ, buf, size, file_offset, buf_offset, stream, priority)

    def write_async(
        self,
        buf,
        size: int | None = None,
        file_offset: int = 0,
        buf_offset: int = 0,
        stream=None,
        *,
        priority: str = "normal",
    ) -> StreamIO:
        """Write ordered on ``stream`` (see :meth:`read_async`); ``priority="background"``:
        its file I/O goes after normal requests' (see :meth:`pwrite`)."""
        return self._stream_plan(OP_WRITE, buf, size, file_offset, buf_offset, stream, priority)

    # planned in Python, queued in C: no bytecode of phoenix's runs between the op being
    # queued and the caller holding its StreamIO (an exception cannot strand a queued op)
    read_async = functools.update_wrapper(_calls.StreamMethod(read_async, _stream_refused), read_async)
    write_async = functools.update_wrapper(_calls.StreamMethod(write_async, _stream_refused), write_async)


_MANY_SLICE = 1024  # read_many / write_many: requests per phx_submit


def open(path, mode: str = "r", *, direct: bool | None = None, sync: bool = False, perm: int = 0o644) -> PhxFile:  # noqa: A001
    """Open ``path`` for I/O (modes r, r+, w, w+, a, a+, x, x+); see :class:`PhxFile`."""
    return PhxFile(path, mode, direct=direct, sync=sync, perm=perm)


# ---- submission (one C call for any number of requests) ------------------------------------

_OPS = {"read": OP_READ, "r": OP_READ, OP_READ: OP_READ, "write": OP_WRITE, "w": OP_WRITE, OP_WRITE: OP_WRITE}
_FLUSH = 256  # requests per phx_submit: the first ones start while Python prepares the rest


def _submit_many(reqs, what_default: str | None = None, wait: bool = False, stream=None):
    """Submit requests; their IOFutures, or with ``wait`` their results (counts, or the
    PhxIOError of each failed one, not raised).

    Requests are resolved in Python and handed to the core in groups of _FLUSH (one C
    call each), so the I/O of the first groups runs while the rest are prepared. A
    request refused in Python fails alone (for one request: raised). The submission runs
    in a C guard (``phoenix._phxcalls.guarded``): if it raises, every request it submitted
    is waited for before the exception leaves; the futures it returns own their requests.
    """
    s = _settings.get()
    with _using_engine(s) as engine:
        return _calls.guarded(_submit_on, engine, s, reqs, what_default, wait, stream)


def _submit_on(g, engine, s, reqs, what_default, wait, stream):
    explicit = None if stream is None else _streams.handle(stream)
    rt = engine.runtime
    mode = MODE[s.mode]
    fences = _Fences(engine, g)
    single = len(reqs) == 1
    cache = None if single else _ClassCache()
    n_all = len(reqs)
    slot = [-1] * n_all  # request -> its slot in the group
    meta: list = [None] * n_all  # (file, file_offset, size, what)
    early: dict[int, BaseException] = {}
    handles: dict[int, int] = {}  # id(file) -> its C file, entered for the submission
    pend: list[int] = []
    descs = (_Desc * min(_FLUSH, n_all))()

    def flush():
        k = len(pend)
        if not k:
            return
        first = g.count
        rc = g.submit(engine.handle, ctypes.addressof(descs), k)
        for j, i in enumerate(pend):
            if rc < 0 or not g.handle(first + j):
                f, off, size, what = meta[i]
                g.collect(first + j)
                slot[i] = -1
                early[i] = file_error(_errno.ENOMEM if rc >= 0 else -rc, f, off, size, what)
        pend.clear()

    for i, req in enumerate(reqs):
        if isinstance(req, BaseException):  # malformed (_normalize): fails alone
            early[i] = req
            continue
        f, buf, size, file_offset, buf_offset, op, priority = req
        opcode = _OPS.get(op) if isinstance(op, (str, int)) and not isinstance(op, bool) else None
        what = what_default or ("read" if opcode == OP_READ else "write")
        try:
            if opcode is None:
                raise ValueError(f"request {i}: op {op!r} is not 'read' or 'write'")
            prio = _checks.priority(priority, getattr(f, "path", None), what if single else f"request {i}: {what}")
            fh = handles.get(id(f))
            if fh is None:
                if not isinstance(f, PhxFile):
                    raise TypeError(f"request {i}: {type(f).__name__} is not a phoenix file (phoenix.io.open)")
                fh = handles[id(f)] = g.enter(f._gate)  # ValueError when closed
            r = _resolve(
                rt, buf, size, buf_offset, opcode == OP_READ, f.path, file_offset, what, cache, stream=explicit
            )
            try:
                file_offset = r.foff
                if mode == 2 and r.mem == _buffers.MEM_DEVICE:
                    _check_mode(r, s.mode, f.path, file_offset, what)
                after = fences.after(r, explicit, f.path, file_offset, what)
                owned = r.owned
                slot[i] = g.count + len(pend)
                g.keep(slot[i], r.buf)  # the group lets it go once the request is done
                r.buf = None
            finally:
                r.release()
        except Exception as exc:  # a malformed request fails alone (one request: raised)
            if single:
                raise
            early[i] = exc
            continue
        d = descs[len(pend)]
        d.file, d.addr, d.size, d.file_offset = fh, r.addr, r.size, file_offset
        d.op, d.mem, d.device, d.mode = opcode, r.mem, r.device, mode
        d.after = after
        d.priority = prio
        d.flags = owned
        meta[i] = (f, file_offset, r.size, what)
        pend.append(i)
        if len(pend) == _FLUSH:
            flush()
    flush()
    if wait:
        return _results(g, slot, meta, early)
    futures = []
    for i in range(n_all):
        if i in early:
            futures.append(IOFuture.failed(early[i], meta[i][3] if meta[i] else ""))
        else:
            f, off, size, what = meta[i]
            futures.append(IOFuture(g, slot[i], engine, f, what, off, size))
    return futures


def _results(g, slot, meta, early) -> list:
    """Wait for every request of the group (one C call, no GIL); each one's count, or its
    PhxIOError (not raised)."""
    n = g.count
    results = (ctypes.c_int64 * max(n, 1))()
    g.wait_all(ctypes.addressof(results), 0, n)
    out: list = []
    for i in range(len(slot)):
        if i in early:
            out.append(early[i])
            continue
        res = results[slot[i]]
        if res >= 0:
            out.append(res)
        else:
            f, off, size, what = meta[i]
            ext = g.error_extent(slot[i])
            where = "" if ext is None or ext == (off, size) else f"; failed chunk at offset {ext[0]}, length {ext[1]}"
            out.append(file_error(-res, f, off, size, f"{what}{where}"))
    g.finish()
    return out
