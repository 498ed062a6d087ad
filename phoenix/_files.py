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
import os
import threading

from . import buffers as _buffers
from . import checks as _checks
from . import settings as _settings
from . import streams as _streams
from ._abi import (
    _DESC_DTYPE,
    _P,
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
from ._engine import _using_engine
from ._extents import _NOTHING, _check_mode, _ClassCache, _Fences, _resolve
from ._futures import IOFuture, StreamIO, _prune_stream_ops, _stream_lock, _stream_ops
from .errors import PhxIOError, _opened_for, extent_error, file_error

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
        self._h = None
        self._fd = None
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
            raise _open_error(-rc, self.path, mode, direct, fd)
        self._fd = fd
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
            raise PhxIOError(-rc, self.path, what="close")

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
            raise PhxIOError(-n, self.path, what="fstat")
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
        of this file (any handle) issued before it on the range (or past it: it grows the
        file) is waited for on the host, queued on its stream or not: the read returns what
        it wrote."""
        return self.pread(buf, size, file_offset, buf_offset, stream=stream, priority=priority).result()

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
        return self.pwrite(buf, size, file_offset, buf_offset, stream=stream, priority=priority).result()

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
            return self._many_on(engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream, priority)

    def _many_on(self, engine, s, op, buf, file_offsets, sizes, buf_offsets, check, stream, priority="normal"):
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
        fences = _Fences(engine)
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
            handles = np.zeros(n, np.uint64)
            h = self._enter()
            try:
                descs["file"] = h
                for a in range(0, n, _MANY_SLICE):  # the first slices run while the next are built
                    b = min(n, a + _MANY_SLICE)
                    rc = _lib.phx_submit(
                        engine.handle,
                        descs[a:].ctypes.data_as(ctypes.POINTER(_Desc)),
                        b - a,
                        handles[a:].ctypes.data_as(ctypes.POINTER(_P)),
                    )
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
                    err = file_error(
                        int(-out[k]),
                        self,
                        eo.value,
                        el.value,
                        f"{what}: extent {k} of {fo.size} failed ({bad.size} failed in all)",
                    )
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

    def _stream(self, op, buf, size, file_offset, buf_offset, stream, priority="normal") -> StreamIO:
        s = _settings.get()
        with _using_engine(s) as engine:
            return self._stream_on(engine, s, op, buf, size, file_offset, buf_offset, stream, priority)

    def _stream_on(self, engine, s, op, buf, size, file_offset, buf_offset, stream, priority="normal") -> StreamIO:
        what = "read_async" if op == OP_READ else "write_async"
        prio = _checks.priority(priority, self.path, what)
        explicit = None if stream is None else _streams.handle(stream)
        r = _resolve(
            engine.runtime, buf, size, buf_offset, op == OP_READ, self.path, file_offset, what, stream=explicit
        )
        keep = r.buf if r.buf is not None else _NOTHING
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
            h = self._enter()
            try:
                d = _Desc(h, r.addr, r.size, file_offset, op, r.mem, r.device, MODE[s.mode])
                d.priority = prio
                d.flags = r.owned
                sop = _P()
                on = _streams.caller_stream(r.buf, r.mem, explicit) or 0
                rc = _lib.phx_stream_io(engine.handle, ctypes.byref(d), on, None, ctypes.byref(sop))
            finally:
                self._leave()
            if rc < 0:
                raise file_error(-rc, self, file_offset, r.size, what)
        except BaseException:
            r.release()
            raise
        op_obj = StreamIO(sop.value, engine, keep, self, what, r.foff, r.size)
        _prune_stream_ops()
        with _stream_lock:
            _stream_ops.add(op_obj)
        return op_obj

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
        return self._stream(OP_READ, buf, size, file_offset, buf_offset, stream, priority)

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
        return self._stream(OP_WRITE, buf, size, file_offset, buf_offset, stream, priority)


_MANY_SLICE = 1024  # read_many / write_many: requests per phx_submit


def open(path, mode: str = "r", *, direct: bool | None = None, sync: bool = False, perm: int = 0o644) -> PhxFile:  # noqa: A001
    """Open ``path`` for I/O (modes r, r+, w, w+, a, a+, x, x+); see :class:`PhxFile`."""
    return PhxFile(path, mode, direct=direct, sync=sync, perm=perm)


# ---- submission (one C call for any number of requests) ------------------------------------

_OPS = {"read": OP_READ, "r": OP_READ, OP_READ: OP_READ, "write": OP_WRITE, "w": OP_WRITE, OP_WRITE: OP_WRITE}
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
                early[i] = file_error(_errno.ENOMEM if rc >= 0 else -rc, f, off, size, what)
            else:
                handles[i] = out[j]
        pend.clear()

    try:
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
                fh = files.get(id(f))
                if fh is None:
                    if not isinstance(f, PhxFile):
                        raise TypeError(f"request {i}: {type(f).__name__} is not a phoenix file (phoenix.io.open)")
                    f._enter()  # ValueError when closed
                    files[id(f)] = f
                r = _resolve(
                    rt, buf, size, buf_offset, opcode == OP_READ, f.path, file_offset, what, cache, stream=explicit
                )
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
            d.priority = prio
            d.flags = r.owned
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
