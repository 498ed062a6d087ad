"""Phoenix's exceptions: one hierarchy, every error says what failed and where.

Core side, control plane. Vendor runtimes raise :class:`VendorError` (through the
generated shims); the I/O stack raises :class:`PhxIOError`, an ``OSError`` (of the standard subclass
for its errno: ``FileNotFoundError``, ``PermissionError`` ...) that names the file, and the
offset and the length of the extent that failed where there is one.
"""

from __future__ import annotations

import errno as _errno
import os


class PhxError(Exception):
    """Base class of every error raised by phoenix."""


class VendorError(PhxError):
    """A vendor runtime call failed.

    Carries the vendor name, the runtime call, the numeric error code and the
    runtime's own error name and message (``cudaErrorInvalidValue: invalid
    argument``), so that a user can search the vendor's documentation for it.
    """

    def __init__(self, vendor: str, call: str, code: int, name: str = "", message: str = ""):
        self.vendor = vendor
        self.call = call
        self.code = int(code)
        self.name = name or f"error {code}"
        self.message = message
        detail = f"{self.name}: {message}" if message else self.name
        super().__init__(f"{vendor}: {call} failed with {detail} (code {self.code})")


class VendorNotImplemented(PhxError, NotImplementedError):
    """A vendor did not implement an operation of the contract.

    Raised by the default methods of :class:`phoenix.vendor.VendorRuntime`; the
    message names the operation and the file where the port must fill it in.
    """


class VendorUnavailable(PhxError):
    """A vendor exists but cannot serve on this machine (its probe said why)."""


class UnknownVendorError(PhxError, LookupError):
    """The ``vendor`` setting (``PHX_VENDOR``), or a name given in code, names no installed vendor."""

    def __init__(self, name: str, installed: list[str]):
        self.requested = name
        self.installed = list(installed)
        super().__init__(
            f"unknown vendor {name!r}; installed vendors: {', '.join(self.installed) or '(none)'}"
            " (set PHX_VENDOR, the vendor setting, to one of them, or to 'auto')"
        )


class ShimLoadError(PhxError, OSError):
    """A runtime library could not be loaded, or lacks symbols the port needs."""

    def __init__(self, library: str, missing: list[str] | None = None, reason: str = ""):
        self.library = library
        self.missing = list(missing or [])
        if self.missing:
            msg = f"{library}: missing symbols: {', '.join(self.missing)}"
        else:
            msg = f"{library}: {reason or 'cannot be loaded'}"
        super().__init__(msg)


class RegistrationError(PhxError, ValueError):
    """A buffer registration is refused (overlap with another, unknown base, ...)."""


class PhxIOError(PhxError, OSError):
    """An I/O request failed: an ``OSError`` of the standard subclass for its errno.

    ``PhxIOError(errno.ENOENT, path, what="open")`` is a ``FileNotFoundError`` as well
    (``EACCES``/``EPERM``: ``PermissionError``, ``EISDIR``: ``IsADirectoryError``, ... as
    ``OSError(errno, ...)`` picks), so ``except FileNotFoundError`` and ``except
    PhxIOError`` both catch it. It carries only what means something for the failure:

    * ``filename`` / ``path``: the file (None when no file is involved);
    * ``offset`` / ``length``: the extent of the request, or None (opening a file);
    * ``what``: the call (``"pwrite"``, ``"read_many: extent 3 of 10 failed"``, ...);
    * ``reason``: why, and what to do about it (default: ``os.strerror(errno)``).

    The message names each once: ``/x/y.bin: No such file or directory`` for an open,
    ``/x/y.bin, offset 4096, length 8192: pwrite: No space left on device`` for an extent.
    A legacy ``offset, length`` of ``0, 0`` means "no extent".
    """

    _classes: dict[tuple[type, type], type] = {}

    def __new__(
        cls,
        err: int,
        path: str | None = None,
        offset: int | None = None,
        length: int | None = None,
        what: str = "",
        *,
        reason: str | None = None,
    ):
        err = int(err)
        if offset is not None and length is not None and not offset and not length:
            offset = length = None  # (0, 0): no extent (the callers of old)
        offset = None if offset is None else int(offset)
        length = None if length is None else int(length)
        reason = reason or os.strerror(err)
        message = _message(path, offset, length, what, reason)
        klass = _errno_class(cls, err)
        if path is None:
            self = OSError.__new__(klass, err, message)
        else:
            self = OSError.__new__(klass, err, message, path)
        self.path = path
        self.offset = offset
        self.length = length
        self.what = what
        self.reason = reason
        return self

    def __init__(self, *args, **kwargs):  # everything is set by __new__ (OSError parses its arguments there)
        pass

    def __str__(self) -> str:
        return self.strerror  # the whole message: the path once, no "[Errno N]" and no repr'd file name after it

    def __reduce__(self):
        base = next(c for c in type(self).__mro__ if not c.__dict__.get("_phx_dynamic"))
        return (
            _rebuild,
            (base, self.errno, self.path, self.offset, self.length, self.what, self.reason),
            dict(self.__dict__),
        )


def _message(path, offset, length, what: str, reason: str) -> str:
    where = (os.fsdecode(path) if isinstance(path, bytes) else path) or ""
    if offset is not None or length is not None:
        ext = f"offset {offset}, length {length}"
        where = f"{where}, {ext}" if where else ext
    parts = [p for p in (where, what, reason) if p]
    return ": ".join(parts)


def _errno_class(cls: type, err: int) -> type:
    """``cls`` combined with the ``OSError`` subclass that ``OSError(err, ...)`` would be
    (``FileNotFoundError`` for ENOENT ...): made once per (class, errno class)."""
    builtin = type(OSError(err, ""))
    if builtin is OSError or issubclass(cls, builtin):
        return cls
    key = (cls, builtin)
    klass = PhxIOError._classes.get(key)
    if klass is None:
        name = f"Phx{builtin.__name__}" if cls is PhxIOError else f"{cls.__name__}_{builtin.__name__}"
        klass = type(cls)(
            name,
            (cls, builtin),
            {
                "__module__": cls.__module__,
                "__qualname__": name,
                "__doc__": f"{cls.__name__} that is a {builtin.__name__}.",
                "_phx_dynamic": True,
            },
        )
        klass = PhxIOError._classes.setdefault(key, klass)
    return klass


def _rebuild(cls, err, path, offset, length, what, reason):
    return cls(err, path, offset, length, what, reason=reason)


def _opened_for(mode: str) -> tuple[bool, bool]:
    """(readable, writable) of a :func:`phoenix.io.open` mode."""
    key = mode.replace("b", "")
    return ("r" in key or "+" in key), (key != "r")


def _writes(what: str) -> bool:
    """Whether the call named ``what`` ("pwrite", "write_many: extent 3 ...", "write") writes."""
    return "write" in what.split(":", 1)[0]


def file_error(err: int, file, offset, length, what: str) -> PhxIOError:
    """The :class:`PhxIOError` of a request on ``file`` (a PhxFile, or None) that failed with ``err``.

    EBADF on a write to a file opened read-only (or a read from one opened write-only)
    says so and how to open it instead, from the file's mode."""
    path = getattr(file, "path", None)
    reason = None
    write = _writes(what)
    if err == _errno.EBADF and file is not None:
        mode = getattr(file, "mode", None)
        fd = getattr(file, "_fd", None)
        if fd is not None:
            reason = (
                f"descriptor {fd} is not open for {'writing' if write else 'reading'} (Bad file descriptor); "
                f"open it with O_RDWR or {'O_WRONLY' if write else 'O_RDONLY'}"
            )
        elif isinstance(mode, str):
            readable, writable = _opened_for(mode)
            if write and not writable:
                reason = (
                    f"the file is opened read-only ({mode!r}); open it with 'r+', 'w' or 'a' to write "
                    "('w' empties it first)"
                )
            elif not write and not readable:
                reason = f"the file is opened write-only ({mode!r}); open it with 'r' or 'r+' to read"
    elif err == _errno.EIO or (err in _PARTIAL and write):
        reason = _partial_reason(err, write)
    elif err == _errno.ECHILD:
        reason = (
            "the I/O was started by the parent process before fork(): its threads are not in this "
            "process, which cannot wait for it or see its bytes; start the I/O again here"
        )
    return PhxIOError(err, path, offset, length, what, reason=reason)


#: errors after which part of a request's range may have moved, and what to do about each
_PARTIAL = {
    _errno.ENOSPC: "free space on the file system",
    _errno.EDQUOT: "free space or raise the quota",
    _errno.EFBIG: "keep the range under the file system's largest file size and RLIMIT_FSIZE",
    _errno.EIO: "look for the error of the storage device (dmesg) or of the accelerator's runtime",
}


def _partial_reason(err: int, write: bool) -> str:
    """ENOSPC, EDQUOT, EFBIG (writes), EIO: a request moves in chunks, in parallel, so chunks
    other than the failed one may have completed: say so, and how to recover."""
    if write:
        part = "part of the range may have been written (chunks run in parallel): its bytes in the file are undefined"
        then = "then write the whole range again"
    else:
        part = "part of the range may have been read: the destination's bytes for it are undefined"
        then = "then read it again"
    return f"{os.strerror(err)}; {part}; {_PARTIAL[err]}, {then}"


def extent_error(path: str | None, offset: int, length: int, what: str, reason: str | None = None) -> PhxIOError:
    """An EFAULT refusal of an extent that runs outside its buffer; ``reason`` says where
    it runs out (the default is EFAULT's "Bad address")."""
    return PhxIOError(_errno.EFAULT, path, offset, length, what, reason=reason)
