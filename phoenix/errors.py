"""Phoenix's exceptions: one hierarchy, every error says what failed and where.

Core side, control plane. Vendor runtimes raise :class:`VendorError` (through the
generated shims); the I/O stack raises :class:`PhxIOError`, an ``OSError`` that
names the file, the offset and the length of the extent that failed.
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
    """An I/O request failed; names the file, the file offset and the length."""

    def __init__(self, err: int, path: str | None, offset: int, length: int, what: str = ""):
        self.path = path
        self.offset = int(offset)
        self.length = int(length)
        where = f"{path or '<fd>'} at offset {offset}, length {length}"
        msg = f"{what}: {os.strerror(err)}" if what else os.strerror(err)
        OSError.__init__(self, err, f"{msg} ({where})")
        self.filename = path


def extent_error(path: str | None, offset: int, length: int, what: str) -> PhxIOError:
    """An EFAULT-style refusal of an extent that runs outside its buffer."""
    return PhxIOError(_errno.EFAULT, path, offset, length, what)
