"""Where an I/O's extent lives: buffer resolution, registrations, the caller's stream point.

Core side, control plane. Before a request goes to the C core, Python checks its extent
against the buffer (:mod:`phoenix.checks`, :mod:`phoenix.buffers`), finds where the
memory lives (a registration, else the vendor's pointer query, memoized per batch),
and records the point of the caller's stream the request waits for (:mod:`phoenix.streams`).
:func:`register` / :func:`deregister` fill the core's registration table those lookups read.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import threading

from . import buffers as _buffers
from . import checks as _checks
from . import streams as _streams
from ._abi import PHX_IO_OWNED_MEMORY, _lib, _RegInfo, _strerror
from ._core import calls as _bound_calls
from ._engine import _runtime
from .errors import PhxIOError, RegistrationError, extent_error

_calls = _bound_calls()  # phoenix._phxcalls, bound to the C core

# ---- buffer resolution --------------------------------------------------------------------


class OwnedPair(tuple):
    """A ``(ptr, nbytes)`` pair of host memory its maker holds for the call (phoenix's own
    loaders: an array they made): copied into with memcpy, as a Python object's memory is,
    not through the kernel's checked copy that a raw pair gets."""

    __slots__ = ()


class _Resolved:
    __slots__ = ("buf", "addr", "size", "foff", "mem", "device", "why", "held")

    @property
    def owned(self) -> int:
        """PHX_IO_OWNED_MEMORY when the memory is a Python object's (held by ``buf``) or an
        OwnedPair's: the core copies into it with memcpy; 0 for a raw (ptr, nbytes) pair (a
        checked copy)."""
        held = self.held or (self.buf is not None and self.buf.source != "raw")
        return PHX_IO_OWNED_MEMORY if held else 0

    def release(self):
        if self.buf is not None:
            self.buf.release()
            self.buf = None


def _resolve(runtime, obj, size, buf_offset, writable, path, file_offset, what, cache=None, stream=None) -> _Resolved:
    """The extent of an I/O in ``obj``: checked, classified. Raises PhxIOError / TypeError.
    ``stream``: the call's own stream handle, if it named one (a DLPack producer orders
    its work before it)."""
    size, file_offset, buf_offset = _checks.extent(size, file_offset, buf_offset, path, what)
    r = _Resolved()
    r.foff = file_offset
    r.held = type(obj) is OwnedPair
    if (
        (type(obj) is tuple or r.held)
        and len(obj) == 2
        and type(obj[0]) is int
        and type(obj[1]) is int
        and 0 < obj[0]
        and 0 <= obj[1] <= _checks.I64_MAX
        and obj[0] + obj[1] <= _checks.U64_MAX + 1
    ):
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
            raise extent_error(
                path,
                file_offset,
                size,
                what,
                f"the buffer holds {nbytes} bytes; the request needs {size} from buffer offset {buf_offset}",
            )
        r.addr, r.size = base + buf_offset, size
        if size == 0:
            r.mem, r.device, r.why = _buffers.MEM_HOST, 0, "empty"
            return r
        # registered memory: the run of adjacent registrations of one kind of memory from the
        # one holding the start (io_reg.c). An extent that runs past the run into memory no
        # registration holds (1, info written) is classified below as unregistered memory is:
        # it lies in the buffer given, and the vendor bounds a device extent by its allocation
        info = _RegInfo()
        rc = _lib.phx_reg_lookup(r.addr, size, ctypes.byref(info))
        if rc == -_errno.EFAULT:
            from ._abi import MEM_NAME

            end, nxt = info.base + info.size, _RegInfo()
            held = (
                f"its registration [{info.base:#x}, +{info.size}) holds {info.size} bytes (with those adjacent "
                f"to it of the same memory); the request needs {size} from {r.addr - info.base} bytes into it"
            )
            if _lib.phx_reg_lookup(end, 1, ctypes.byref(nxt)) == 0 and nxt.base == end:
                why = (
                    f"{held}, and runs into the registration at {end:#x} of {MEM_NAME.get(nxt.mem)} memory on "
                    f"device {nxt.device} from {MEM_NAME.get(info.mem)} memory on device {info.device}: one "
                    f"request moves one kind of memory, split it there (buffer offset {buf_offset + end - r.addr})"
                )
            else:
                why = (
                    f"{held}, and runs over unregistered bytes from {end:#x} into another registration: "
                    "register the gap too (adjacent registrations serve one extent), or split the request"
                )
            raise extent_error(path, file_offset, size, what, why)
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
                raise extent_error(path, file_offset, size, what, str(exc)) from None
            if cache is not None:
                cache.put(runtime, r.addr, r)
        if r.mem == _buffers.MEM_HOST and source == "raw" and _lib.phx_mem_probe(r.addr, size) == -_errno.EFAULT:
            raise extent_error(
                path, file_offset, size, what, f"[{r.addr:#x}, +{size}) is not accessible memory (freed?)"
            )
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
        raise PhxIOError(
            _errno.EOPNOTSUPP,
            path,
            file_offset,
            r.size,
            what,
            reason=f"PHX_MODE=direct, but this device memory is not direct-capable ({r.why}); "
            "set PHX_MODE=auto to move it through bounce buffers",
        )


# ---- the caller's stream --------------------------------------------------------------------


class _Fences:
    """The caller's stream points one call's requests wait for (``phx_fence_record``):
    one per (device, stream) among its extents, recorded into the call's group
    (``phoenix._phxcalls.Requests``), which releases them once the requests naming them
    are submitted (each request holds its own reference in the core)."""

    __slots__ = ("engine", "group", "fences")

    def __init__(self, engine, group):
        self.engine = engine
        self.group = group
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
            raise PhxIOError(
                _errno.ENODEV,
                path,
                file_offset,
                r.size,
                what,
                reason=f"stream={stream:#x} given, but no vendor runtime with a data path is selected "
                "to order with it; set PHX_VENDOR to the stream's vendor",
            )
        rc, fence = self.group.fence(self.engine.handle, device, stream)
        if rc < 0:
            raise PhxIOError(
                -rc,
                path,
                file_offset,
                r.size,
                what,
                reason=f"cannot order with the caller's stream {stream:#x} on device {device}: the "
                f"vendor refused to record an event on it ({_strerror(rc)}; a destroyed stream, or "
                "another device's?)",
            )
        self.fences[key] = fence
        return fence or None


# ---- registrations ----------------------------------------------------------------------------

_reg_lock = threading.RLock()  # reentrant: a signal handler may register while it is held
_registered: dict[int, list] = {}  # base -> adapted buffers kept alive (one per reference)


def register(buf) -> int:
    """Register a buffer for I/O; returns its base address.

    Registering records where the memory lives (so I/O on it skips the vendor's pointer
    query) and keeps the object alive until :func:`deregister`. An exact duplicate is
    reference counted; any other overlap with a registration raises RegistrationError.
    An I/O extent that starts inside a registration must end inside it, or in the
    registrations of the same memory that follow it with no gap, or in unregistered memory
    (else EFAULT: nothing moves).
    """
    rt = _runtime()
    b = _buffers.adapt(buf, writable=False)
    if b.nbytes <= 0:
        b.release()
        raise RegistrationError("cannot register an empty buffer")
    try:
        mem, device, _ = _buffers.classify(rt, b.addr, b.nbytes, b.kind, b.device)
    except TypeError as exc:
        b.release()
        raise RegistrationError(str(exc)) from None
    except _buffers.OutOfBounds as exc:
        b.release()
        raise RegistrationError(f"cannot register [{b.addr:#x}, +{b.nbytes}): {exc}") from None
    with _reg_lock:
        # the core's entry and the buffer kept for it are made in one C call: no exception
        # (a signal handler's) can leave one without the other
        rc = _calls.reg_keep(_registered.setdefault(b.addr, []), b, b.addr, b.nbytes, mem, device)
        if rc < 0:
            if not _registered[b.addr]:
                del _registered[b.addr]
            b.release()
            info = _RegInfo()
            other = ""
            for probe in (b.addr, b.addr + b.nbytes - 1):
                if _lib.phx_reg_lookup(probe, 1, ctypes.byref(info)) != 1:
                    other = f" (overlaps [{info.base:#x}, +{info.size}))"
                    break
            raise RegistrationError(f"cannot register [{b.addr:#x}, +{b.nbytes}): {_strerror(rc)}{other}")
        if mem == _buffers.MEM_HOST and _lib.phx_mem_probe(b.addr, b.nbytes) == -_errno.EFAULT:
            _calls.reg_unkeep(_registered[b.addr], b.addr)
            if not _registered[b.addr]:
                del _registered[b.addr]
            raise RegistrationError(f"cannot register [{b.addr:#x}, +{b.nbytes}): not accessible memory (freed?)")
    return b.addr


def _after_fork_in_child() -> None:
    global _reg_lock
    _reg_lock = threading.RLock()  # (a thread of the parent may have held it at the fork)


os.register_at_fork(after_in_child=_after_fork_in_child)


def deregister(buf) -> None:
    """Drop one reference of the registration starting at ``buf``'s base address."""
    b = _buffers.adapt(buf, writable=False)
    try:
        with _reg_lock:
            kept = _registered.get(b.addr)
            if not kept:  # (not one of this module's: libphxfile's are removed there)
                raise RegistrationError(f"[{b.addr:#x}, +{b.nbytes}) is not registered with phoenix.register")
            rc = _calls.reg_unkeep(kept, b.addr)  # (also when the core's entry went another way: not kept pinned)
            if not kept:
                del _registered[b.addr]
            if rc < 0:
                raise RegistrationError(f"[{b.addr:#x}, +{b.nbytes}) is not registered")
    finally:
        b.release()
