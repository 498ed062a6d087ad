"""The boundary into C: every integer and path the Python API hands to the C core, checked once.

Core side, control plane. ctypes converts silently (``2**64`` becomes 0 in a 64-bit
field, a path is cut at its first NUL), so each value is checked here before it can
cross: integers must be integers (``int``, NumPy integers, anything with ``__index__``; not ``bool``, not
floats or strings) and inside the range the core takes; paths go through
``os.fsencode`` and must not hold a NUL. A wrong type is a ``TypeError``, a value out of
range an :class:`ArgumentError` (a ``ValueError`` and a :class:`~phoenix.errors.PhxIOError`
with EINVAL); both name the parameter, and the I/O errors the file, offset and length.
"""

from __future__ import annotations

import errno as _errno
import math
import operator
import os

from .errors import PhxIOError

#: the largest file offset (and extent end) the core takes: off_t is signed 64-bit
I64_MAX = (1 << 63) - 1
#: the largest address
U64_MAX = (1 << 64) - 1


class ArgumentError(PhxIOError, ValueError):
    """An argument out of the range the I/O core takes (EINVAL): names the parameter."""


#: a request's priority (``priority=``): enum phx_priority of the core
PRIORITY = {"normal": 0, "background": 1}


def priority(value, path, what: str) -> int:
    """The core's priority of ``priority=value`` ("normal" or "background"); ArgumentError
    naming the parameter for anything else."""
    if isinstance(value, str) and value in PRIORITY:
        return PRIORITY[value]
    raise ArgumentError(_errno.EINVAL, path, what=what, reason=f"priority={value!r} is not 'normal' or 'background'")


def integer(value, name: str, what: str) -> int:
    """``value`` as an int; TypeError naming ``name`` for anything that is not an integer."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be an integer, not a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an integer, got {type(value).__name__} {value!r}") from None


def extent(size, file_offset, buf_offset, path, what: str) -> tuple[int | None, int, int]:
    """(size or None, file_offset, buf_offset) of one I/O, checked: each in [0, 2**63) and
    the extent's end in the file at most 2**63 - 1."""
    foff = integer(file_offset, "file_offset", what)
    boff = integer(buf_offset, "buf_offset", what)
    n = None if size is None else integer(size, "size", what)
    shown = 0 if n is None else n
    for value, name in ((foff, "file_offset"), (boff, "buf_offset"), (n, "size")):
        if value is not None and not 0 <= value <= I64_MAX:
            raise ArgumentError(
                _errno.EINVAL, path, foff, shown, what, reason=f"{name}={value} is out of range (0 to 2**63-1)"
            )
    if n is not None and foff + n > I64_MAX:
        raise ArgumentError(
            _errno.EINVAL, path, foff, n, what, reason="the extent ends past 2**63-1, the largest file offset"
        )
    return n, foff, boff


def extent_arrays(file_offsets, sizes, buf_offsets, path, what: str):
    """(file offsets, sizes, buffer offsets) of a gather or scatter as int64 arrays of one
    length, checked as :func:`extent` checks one (``sizes`` may be one number for all;
    ``buf_offsets`` None: packed in order)."""
    import numpy as np

    def arr(x, name):
        a = np.asarray(x)
        if a.size == 0:
            a = a.astype(np.int64)  # [] is float64 to NumPy
        if a.dtype.kind not in "iu" or a.ndim > 1:
            raise TypeError(
                f"{what}: {name} must be integers from 0 to 2**63-1 (a sequence or a 1-D integer array), "
                f"got {a.dtype} {a.shape}"
            )
        if a.dtype.kind == "u" and a.size and int(a.max()) > I64_MAX:
            raise ArgumentError(_errno.EINVAL, path, what=what, reason=f"{name} holds a value past 2**63-1")
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
            raise ArgumentError(
                _errno.EINVAL, path, int(fo[k]), int(sz[k]), f"{what}: extent {k}", reason=f"negative {name}"
            )
    # each extent's end in the file and in the buffer: bo + sz is computed in int64 by the
    # callers (no int64 overflow here: both are >= 0)
    for starts in (fo, bo):
        past = np.flatnonzero(starts > I64_MAX - sz)
        if past.size:
            k = int(past[0])
            reason = (
                "the extent ends past 2**63-1, the largest file offset"
                if starts is fo
                else f"buffer offset {int(bo[k])} + size {int(sz[k])} passes 2**63-1: no buffer holds it"
            )
            raise ArgumentError(_errno.EINVAL, path, int(fo[k]), int(sz[k]), f"{what}: extent {k}", reason=reason)
    return fo, sz, bo


def raw_buffer(ptr, nbytes) -> tuple[int, int]:
    """A ``(ptr, nbytes)`` pair, checked: a non-NULL address, a size in [0, 2**63), and an
    extent that does not wrap past the top of the address space."""
    p = integer(ptr, "ptr", "raw buffer (ptr, nbytes)")
    n = integer(nbytes, "nbytes", "raw buffer (ptr, nbytes)")
    if not 0 < p <= U64_MAX:
        raise ValueError(f"raw buffer (ptr={p:#x}, nbytes={n}): the address must be non-NULL and fit 64 bits")
    if not 0 <= n <= I64_MAX or p + n > U64_MAX + 1:
        raise ValueError(
            f"raw buffer (ptr={p:#x}, nbytes={n}): the size must be 0 to 2**63-1 and the extent "
            "must not run past the top of the address space"
        )
    return p, n


def path_bytes(path) -> bytes:
    """A path for the C core: ``os.fsencode``'d; ValueError for an embedded NUL (the C core
    would stop there and open another file: Python's own ``open`` refuses it too)."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError(f"path {os.fsdecode(raw)!r}: embedded null byte")
    if not raw:
        raise ValueError("path: empty")
    return raw


def bounded(value, name: str, what: str, low: int, high: int) -> int:
    """An integer in [low, high]; ValueError naming ``name`` otherwise."""
    v = integer(value, name, what)
    if not low <= v <= high:
        raise ValueError(f"{what}: {name}={v} must be between {low} and {high}")
    return v


def timeout_ns(timeout, what: str) -> int:
    """A wait's ``timeout`` in seconds as the C core's nanoseconds: None, inf or one past
    2**63-1 ns (292 years) waits without end (-1); a negative one does not wait (0); NaN,
    bools and non-numbers are refused (an int64 would take 1e30 s as 0 ns: no wait)."""
    if timeout is None:
        return -1
    if isinstance(timeout, bool) or not hasattr(timeout, "__float__"):
        raise TypeError(f"{what}: timeout must be a number of seconds or None (wait without end), got {timeout!r}")
    try:
        t = float(timeout)
    except OverflowError:  # an int past a float's range: longer than any wait
        return -1
    if math.isnan(t):
        raise ValueError(f"{what}: timeout=nan: give a number of seconds, or None to wait without end")
    if t <= 0:
        return 0
    if t * 1e9 >= I64_MAX:
        return -1
    return int(t * 1e9)
