"""libphxfile: the frozen ``phxFile*`` C ABI that LMCache's ``phx`` GDS backend loads.

Adapter, control plane. ``libphxfile.so`` (``phoenix/csrc/phxfile/``) is built with the
package into ``phoenix/lib/libphxfile.so`` and exports exactly the ten symbols of the
ABI. LMCache finds it with ``ctypes.util.find_library("phxfile")`` and falls back to
``ctypes.CDLL("libphxfile.so")``: either works once the library's directory is on the
loader path (``LD_LIBRARY_PATH``), or registered with ``ldconfig``. Ask where::

    $ .venv/bin/python -I -m phoenix.phxfile  # what to set, whether it is found now (exit 0: found)
    >>> phoenix.phxfile.library_path()     # the built library
    >>> print(phoenix.phxfile.env_hint())

The library runs inside the Python process that loads it: at its first call it imports
this module (through the CPython C API, under ``PyGILState_Ensure``) and asks for the
vendor's core context (:func:`_c_open`), and for where a registered buffer lives
(:func:`_c_classify`). The I/O itself runs in the C core without the GIL. The vendor is
the one ``PHX_VENDOR`` selects (:func:`phoenix.registry.get_runtime`); ``PHX_MODE`` and
the pool settings (:mod:`phoenix.settings`) are read when the driver opens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import logging
import os
import sys
import threading

_log = logging.getLogger(__name__)  # "phoenix.phxfile": unconfigured, errors still reach stderr

__all__ = ["SYMBOLS", "library_path", "library_dir", "load", "found_by_loader", "env_hint"]

#: the frozen ABI: exactly what libphxfile.so exports
SYMBOLS = (
    "phxFileDriverOpen",
    "phxFileDriverClose",
    "phxFileBufRegister",
    "phxFileBufDeregister",
    "phxFileHandleRegister",
    "phxFileHandleDeregister",
    "phxFileStreamRegister",
    "phxFileStreamDeregister",
    "phxFileReadAsync",
    "phxFileWriteAsync",
)

LIBNAME = "libphxfile.so"


def library_dir() -> str:
    """The directory the package build puts ``libphxfile.so`` in (``phoenix/lib``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def library_path() -> str:
    """Path of the built ``libphxfile.so``; FileNotFoundError with a hint if it was not built."""
    path = os.path.join(library_dir(), LIBNAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is not built: install the package (`pip install .`, or `pip install -e .` for development); "
            "setup.py builds libphxfile.so with the C core"
        )
    return path


def found_by_loader() -> str | None:
    """What LMCache's lookup finds now: ``ctypes.util.find_library("phxfile")``, else
    ``libphxfile.so`` if the dynamic loader resolves that name (LMCache's fallback)."""
    found = ctypes.util.find_library("phxfile")
    if found:
        return found
    try:
        ctypes.CDLL(LIBNAME)
    except OSError:
        return None
    return LIBNAME


def _where() -> str:
    """Which installation this is: the interpreter, and where it imported phoenix from (a
    checkout's source tree in the working directory shadows an installed phoenix for
    ``python -m``)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    text = f"phoenix imported by {sys.executable} from {pkg}"
    try:
        here = os.path.commonpath([os.getcwd(), pkg]) == os.getcwd()
    except ValueError:
        here = False
    if here:
        text += " (the current directory's source tree: `python -m` puts it first on the path; `python -I` does not)"
    return text


def _vendors() -> str:
    """PHX_VENDOR's values here: the vendors discovery finds (never a list written down)."""
    try:
        from phoenix import registry

        names = list(registry.discover())
    except Exception:
        names = []
    return "|".join(["auto", *names, "<port>"])


def env_hint() -> str:
    """What to set so that LMCache (``ctypes.util.find_library("phxfile")``) finds the library,
    and which installation was looked in."""
    try:
        path = library_path()
    except FileNotFoundError as exc:
        return (
            f"libphxfile: {exc}\n  looked in {_where()}\n  if phoenix is installed in another environment "
            "(a venv), run its interpreter, isolated from the working directory: <venv>/bin/python -I -m phoenix.phxfile"
        )
    d = os.path.dirname(path)
    found = found_by_loader()
    on_path = d in [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    lines = [f"libphxfile: {path}", f"  ({_where()})"]
    if found and on_path:
        lines.append(f"  found by the loader as {found!r} (LD_LIBRARY_PATH has {d})")
    elif found:
        lines.append(f"  found by the loader as {found!r}: check it is this one (ldconfig -p | grep phxfile)")
    else:
        lines.append(
            "  not found by ctypes.util.find_library('phxfile') nor the dynamic loader; set, before "
            "starting the process that loads it (LMCache, vLLM):"
        )
    if not on_path:
        lines.append(f"  export LD_LIBRARY_PATH={d}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}")
        lines.append(f"  (or system-wide, as root: echo {d} > /etc/ld.so.conf.d/phoenix.conf && ldconfig)")
    lines.append(
        f"  the vendor is PHX_VENDOR's ({_vendors()}); PHX_MODE and the PHX_* pool settings apply when the driver opens"
    )
    return "\n".join(lines)


def load(path: str | None = None) -> ctypes.CDLL:
    """Load the library with LMCache's ctypes signatures (for tests and benches)."""
    lib = ctypes.CDLL(path or library_path())
    P, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
    sigs = {
        "phxFileDriverOpen": [],
        "phxFileDriverClose": [],
        "phxFileBufRegister": [P, ctypes.c_size_t],
        "phxFileBufDeregister": [P],
        "phxFileHandleRegister": [ctypes.POINTER(P), ctypes.c_int],
        "phxFileHandleDeregister": [P],
        "phxFileStreamRegister": [P],
        "phxFileStreamDeregister": [P],
        "phxFileReadAsync": [P, P, ctypes.POINTER(ctypes.c_size_t), i64p, i64p, i64p, P],
        "phxFileWriteAsync": [P, P, ctypes.POINTER(ctypes.c_size_t), i64p, i64p, i64p, P],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


# ---- called by libphxfile.so (under the GIL; each returns 0 or -errno) --------------------


class _CoreTable(ctypes.Structure):
    """``struct phxfile_core`` of phoenix/csrc/phxfile/phxfile.c."""

    _fields_ = [
        ("abi", ctypes.c_uint32),
        ("mode", ctypes.c_int32),
        ("ctx", ctypes.c_uint64),
        ("file_from_fd", ctypes.c_uint64),
        ("file_close", ctypes.c_uint64),
        ("stream_io", ctypes.c_uint64),
        ("reg_add", ctypes.c_uint64),
        ("reg_remove", ctypes.c_uint64),
        ("reg_lookup", ctypes.c_uint64),
        ("ctx_destroy", ctypes.c_uint64),
    ]


class _Class(ctypes.Structure):
    """``struct phxfile_class``: where a buffer lives."""

    _fields_ = [
        ("mem", ctypes.c_int32),
        ("device", ctypes.c_int32),
    ]


CORE_ABI = 1
_lock = threading.RLock()
_runtime = None  # the vendor runtime the open driver uses (kept alive while it is open)


def _after_fork_in_child() -> None:
    # libphxfile's child handler closes the driver in the child (its first call opens one of
    # its own); a lock another thread of the parent held at the fork would stay held
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _errno_of(exc: BaseException) -> int:
    from .errors import VendorNotImplemented

    if isinstance(exc, OSError) and exc.errno:
        return -exc.errno
    if isinstance(exc, VendorNotImplemented):
        return -_errno.ENOSYS
    return -_errno.ENODEV


def _c_open(table_addr: int, table_size: int, _unused: int = 0) -> int:
    """Fill the core table: a context with the selected vendor's data path, the core's entry points."""
    global _runtime

    if table_size != ctypes.sizeof(_CoreTable):
        return -_errno.EPROTO
    t = _CoreTable.from_address(table_addr)
    if t.abi != CORE_ABI:
        return -_errno.EPROTO
    try:
        import importlib

        pio = importlib.import_module("phoenix.io")
        ps = importlib.import_module("phoenix.settings")
        rt = pio._runtime()  # the vendor setting's runtime
        if rt is None:
            from .registry import get_runtime

            rt = get_runtime()  # raises, saying why no vendor serves
        dp = rt.data_path()
        missing = dp.missing()
        if missing:
            raise OSError(_errno.ENODEV, f"vendor {rt.name!r}: the data path lacks {', '.join(missing)}")
        s = ps.get()
        lib = pio._lib
        cfg = pio.make_config(s, rt)  # the vendor's registration flags; CPU copies for a test double
        # the context, owned by a C gate until it is handed to the library (the last step
        # below): an exception before that (a signal handler's) leaves no context behind
        from ._core import calls

        gate = calls().ctx_open(ctypes.addressof(cfg), ctypes.addressof(dp), "libphxfile's context")
        if isinstance(gate, int):
            return gate
        # pin the bounce pool now, at DriverOpen, not at the first stream-ordered call:
        # CUDA may serialize page-locking behind the caller's busy streams
        pinned = lib.phx_ctx_prepare(gate.value)
        if pinned < 0:
            return int(pinned)
    except Exception as exc:  # logged with its traceback: LMCache only sees the errno
        _log.exception("libphxfile: cannot open the driver: %s", exc)
        return _errno_of(exc)

    def addr(fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    with _lock:
        _runtime = rt
    t.mode = pio.MODE[s.mode]
    t.file_from_fd = addr(lib.phx_file_from_fd)
    t.file_close = addr(lib.phx_file_close)
    t.stream_io = addr(lib.phx_stream_io)
    t.reg_add = addr(lib.phx_reg_add)
    t.reg_remove = addr(lib.phx_reg_remove)
    t.reg_lookup = addr(lib.phx_reg_lookup)
    t.ctx_destroy = addr(lib.phx_ctx_destroy)
    gate.detach_into(table_addr + _CoreTable.ctx.offset)  # the library's from here (DriverClose)
    return 0


def _c_classify(addr: int, size: int, out_addr: int) -> int:
    """Where [addr, addr+size) lives (MEM_*, device); -EFAULT past its device allocation.

    Asked at every call (the library caches nothing: an allocation may be freed and made
    again at the same address, another size or kind, between two calls)."""
    from . import buffers

    out = _Class.from_address(out_addr)
    rt = _runtime
    if rt is None:  # the driver closed meanwhile: no vendor to ask (None would say "host")
        return -_errno.ESHUTDOWN
    try:
        out.mem, out.device, _ = buffers.classify(rt, addr, size)
    except buffers.OutOfBounds:
        return -_errno.EFAULT
    except TypeError:
        return -_errno.EINVAL
    except Exception as exc:
        return _errno_of(exc)
    return 0


def _c_close(*_unused) -> int:
    global _runtime
    with _lock:
        _runtime = None
    return 0


def main() -> int:
    """``python -m phoenix.phxfile``: what to set; exit status 0 where LMCache's lookup finds a
    libphxfile now, 1 where it does not or this installation has none built (a script can
    check before starting LMCache)."""
    print(env_hint())
    try:
        library_path()
    except FileNotFoundError:
        return 1
    return 0 if found_by_loader() else 1


if __name__ == "__main__":
    raise SystemExit(main())
