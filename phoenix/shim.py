"""The shim generator: typed ctypes bindings of a vendor runtime, from a prototype table.

Core side, control plane. A port describes the C calls it needs as :class:`Proto` rows
(symbol, result type, argument types, how errors are reported) and calls
:func:`load_shim`. The result has one method per row; each call checks its result
and raises :class:`~phoenix.errors.VendorError` carrying the runtime's error name
and message (from the table's ``error_name`` / ``error_string`` calls). Missing
symbols are reported all at once, at load time, with the library path.

Most accelerator runtimes are CUDA-shaped with another prefix, so
:func:`cuda_shaped_protos` produces the whole table for a prefix (``cuda``, ``mc``,
``hip``, ``musa``, ...); a port adds or overrides rows where its runtime differs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ShimLoadError, VendorError

#: error conventions
STATUS = "status"  # returns an integer status; ``success`` value means ok
NONE = "none"  # no error reporting (e.g. the error-string calls themselves)
NULL_ON_ERROR = "null"  # returns a pointer; NULL means error, errno holds why


@dataclass(frozen=True)
class Proto:
    """One row of a prototype table."""

    symbol: str
    restype: Any
    argtypes: Sequence[Any]
    errors: str = STATUS
    #: name of the Python method (defaults to the symbol without the prefix, snake-cased)
    pyname: str | None = None
    #: optional symbols are bound when present and reported (not fatal) when absent
    optional: bool = False


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def find_library(names: Iterable[str], search_dirs: Iterable[str] = ()) -> tuple[str | None, list[str]]:
    """Find a shared library: first in ``search_dirs`` (for each name), then the loader's path.

    Returns ``(path or None, places looked)`` so probes can say where they looked.
    """
    looked: list[str] = []
    names = list(names)
    for d in search_dirs:
        if not d:
            continue
        for n in names:
            cand = os.path.join(d, n if n.startswith("lib") and ".so" in n else f"lib{n}.so")
            looked.append(cand)
            if os.path.exists(cand):
                return cand, looked
    for n in names:
        base = n[3:].split(".so")[0] if n.startswith("lib") else n
        looked.append(f"ld path: lib{base}.so")
        found = ctypes.util.find_library(base)
        if found:
            return found, looked
    return None, looked


class Shim:
    """A loaded runtime library with one checked method per prototype row."""

    def __init__(self, vendor: str, library: str, handle: ctypes.CDLL, prefix: str, success: int):
        self.vendor = vendor
        self.library = library
        self.handle = handle
        self.prefix = prefix
        self.success = success
        self.missing_optional: list[str] = []
        self._error_name = None
        self._error_string = None
        self._get_last_error = None
        self._symbols: dict[str, Any] = {}

    def address(self, symbol: str) -> int:
        """Raw address of a bound C function (for the data-path table)."""
        fn = self._symbols.get(symbol)
        if fn is None:
            fn = getattr(self.handle, symbol)
        return ctypes.cast(fn, ctypes.c_void_p).value or 0

    def has(self, symbol: str) -> bool:
        return symbol in self._symbols

    def describe_error(self, code: int) -> tuple[str, str]:
        """(error name, error message) of a status code, from the runtime itself."""
        name = msg = ""
        try:
            if self._error_name is not None:
                raw = self._error_name(code)
                name = raw.decode(errors="replace") if raw else ""
            if self._error_string is not None:
                raw = self._error_string(code)
                msg = raw.decode(errors="replace") if raw else ""
        except Exception:  # the error path must never raise a second error
            pass
        return name or f"error {code}", msg

    def raise_for(self, call: str, code: int):
        name, msg = self.describe_error(code)
        # The error is raised here: leave it out of the runtime's per-thread "last error"
        # (CUDA's GetLastError returns and clears it), or the next library to ask in this
        # thread (torch, CuPy) takes it for a failure of its own.
        if self._get_last_error is not None:
            try:
                self._get_last_error()
            except Exception:
                pass
        raise VendorError(self.vendor, call, code, name, msg)


def load_shim(
    vendor: str,
    library: str,
    protos: Sequence[Proto],
    *,
    prefix: str = "",
    success: int = 0,
    error_name: str | None = None,
    error_string: str | None = None,
    mode: int = ctypes.RTLD_GLOBAL,
) -> Shim:
    """Load ``library`` and bind every row of ``protos``; return a :class:`Shim`.

    Raises :class:`~phoenix.errors.ShimLoadError` if the library cannot be loaded
    or any required symbol is missing (all missing symbols named at once).
    """
    try:
        handle = ctypes.CDLL(library, mode=mode)
    except OSError as exc:
        raise ShimLoadError(library, reason=str(exc)) from None
    shim = Shim(vendor, library, handle, prefix, success)

    missing = [p.symbol for p in protos if not p.optional and not hasattr(handle, p.symbol)]
    if missing:
        raise ShimLoadError(library, missing=missing)

    if error_name and hasattr(handle, error_name):
        fn = getattr(handle, error_name)
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_int]
        shim._error_name = fn
    if error_string and hasattr(handle, error_string):
        fn = getattr(handle, error_string)
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_int]
        shim._error_string = fn
    if prefix and hasattr(handle, f"{prefix}GetLastError"):
        fn = getattr(handle, f"{prefix}GetLastError")
        fn.restype, fn.argtypes = ctypes.c_int, []
        shim._get_last_error = fn

    for proto in protos:
        if not hasattr(handle, proto.symbol):
            shim.missing_optional.append(proto.symbol)
            continue
        cfn = getattr(handle, proto.symbol)
        cfn.restype = proto.restype
        cfn.argtypes = list(proto.argtypes)
        shim._symbols[proto.symbol] = cfn
        pyname = proto.pyname or _snake(
            proto.symbol[len(prefix) :] if prefix and proto.symbol.startswith(prefix) else proto.symbol
        )
        setattr(shim, pyname, _make_method(shim, proto, cfn))
    return shim


def _make_method(shim: Shim, proto: Proto, cfn):
    symbol = proto.symbol
    if proto.errors == STATUS:
        success = shim.success

        def call(*args):
            rc = cfn(*args)
            if rc != success:
                shim.raise_for(symbol, rc)
            return rc
    elif proto.errors == NULL_ON_ERROR:

        def call(*args):
            res = cfn(*args)
            if not res:
                err = ctypes.get_errno()
                raise VendorError(shim.vendor, symbol, err, "NULL", os.strerror(err) if err else "returned NULL")
            return res
    else:
        call = cfn
    call.__name__ = symbol
    call.__doc__ = f"{symbol}{tuple(getattr(a, '__name__', str(a)) for a in proto.argtypes)} (checked: {proto.errors})"
    return call


# -- CUDA-shaped runtimes ------------------------------------------------------

_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_i = ctypes.c_int
_u = ctypes.c_uint
_sz = ctypes.c_size_t


def cuda_shaped_protos(prefix: str) -> list[Proto]:
    """The prototype table of a CUDA-shaped runtime with symbol prefix ``prefix``.

    ``cuda`` gives libcudart's names, ``mc`` MACA's, ``hip`` HIP's. Pointer
    attributes are taken as an opaque buffer (the struct layout is the port's
    business: fields differ between runtimes and releases).
    """
    P = prefix
    return [
        Proto(f"{P}GetDeviceCount", _i, [ctypes.POINTER(_i)]),
        Proto(f"{P}SetDevice", _i, [_i]),
        Proto(f"{P}GetDevice", _i, [ctypes.POINTER(_i)]),
        Proto(f"{P}DeviceGetPCIBusId", _i, [ctypes.c_char_p, _i, _i]),
        Proto(f"{P}DeviceGetAttribute", _i, [ctypes.POINTER(_i), _i, _i], optional=True),
        Proto(f"{P}MemGetInfo", _i, [ctypes.POINTER(_sz), ctypes.POINTER(_sz)]),
        Proto(f"{P}Malloc", _i, [_pp, _sz]),
        Proto(f"{P}Free", _i, [_p]),
        Proto(f"{P}HostRegister", _i, [_p, _sz, _u]),
        Proto(f"{P}HostUnregister", _i, [_p]),
        Proto(f"{P}MallocHost", _i, [_pp, _sz]),
        Proto(f"{P}FreeHost", _i, [_p]),
        Proto(f"{P}Memcpy", _i, [_p, _p, _sz, _i]),
        Proto(f"{P}MemcpyAsync", _i, [_p, _p, _sz, _i, _p]),
        Proto(f"{P}StreamCreateWithFlags", _i, [_pp, _u]),
        Proto(f"{P}StreamSynchronize", _i, [_p]),
        Proto(f"{P}StreamDestroy", _i, [_p]),
        Proto(f"{P}LaunchHostFunc", _i, [_p, _p, _p]),
        # events (optional: the I/O core orders with the caller's stream by them, else
        # it synchronizes the stream; see phoenix.vendor.DataPathTable)
        Proto(f"{P}EventCreateWithFlags", _i, [_pp, _u], optional=True),
        Proto(f"{P}EventRecord", _i, [_p, _p], optional=True),
        Proto(f"{P}StreamWaitEvent", _i, [_p, _p, _u], optional=True),
        Proto(f"{P}EventSynchronize", _i, [_p], optional=True),
        Proto(f"{P}EventDestroy", _i, [_p], optional=True),
        Proto(f"{P}PointerGetAttributes", _i, [_p, _p]),
        Proto(f"{P}DeviceSynchronize", _i, []),
        # read for the name only (offset 0 in every runtime), into a buffer larger than any struct
        Proto(f"{P}GetDeviceProperties", _i, [_p, _i], optional=True),
        Proto(f"{P}RuntimeGetVersion", _i, [ctypes.POINTER(_i)], optional=True),
        Proto(f"{P}DriverGetVersion", _i, [ctypes.POINTER(_i)], optional=True),
        # NOT_READY is an answer, not an error: the caller reads the status itself
        Proto(f"{P}StreamQuery", _i, [_p], errors=NONE, optional=True),
        Proto(f"{P}GetLastError", _i, [], errors=NONE, optional=True),
        Proto(f"{P}GetErrorString", ctypes.c_char_p, [_i], errors=NONE),
        Proto(f"{P}GetErrorName", ctypes.c_char_p, [_i], errors=NONE, optional=True),
    ]
