"""Vendor discovery and run-time selection: the registry resolves the ``vendor`` setting.

Core side, control plane. There is one way to select a vendor: the ``vendor`` setting of
:mod:`phoenix.settings`, read from ``PHX_VENDOR`` and overridable like every other
setting (``settings.override(vendor="host")``, ``settings.set(vendor=...)``). The
registry turns its value into a runtime (:func:`get_runtime`); :func:`use_vendor` and
:func:`use_runtime` are thin wrappers over the setting, kept for tests and scripts.

Vendors are found, never listed:

* in-tree: every directory ``vendors/<name>/`` with a ``runtime.py`` (installed as
  ``phoenix.vendors.<name>``);
* out-of-tree: the ``phoenix.vendors`` entry-point group (``name = "pkg.module"``
  or ``"pkg.module:Runtime"``);
* extra directories in ``PHX_VENDOR_PATH`` (``dir1:dir2``), each holding
  ``<name>/runtime.py``: for a port under development and for tests.

So adding a vendor edits nothing outside its own directory. ``auto`` (the default)
probes the vendors in the order of their ``auto_priority`` (a class attribute of the
port: higher first; 0 is never chosen by ``auto``) and falls back to the ``host``
reference vendor; the selection records why it chose and why it skipped each other
vendor. A vendor whose module fails to import is reported with its error and does not
stop the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field

from . import settings as _settings
from .errors import PhxError, UnknownVendorError, VendorUnavailable
from .vendor import Probe, VendorRuntime

#: the reference vendor `auto` falls back to (always installed: it makes the rest testable)
FALLBACK = "host"


@dataclass
class VendorEntry:
    """One discovered vendor: where it comes from, and its class or its import error."""

    name: str
    source: str  #: "in-tree", "entry point <dist>", or "PHX_VENDOR_PATH <dir>"
    location: str  #: module name or file path
    _loader: object = field(repr=False, default=None)
    _cls: type | None = field(repr=False, default=None)
    _error: str | None = field(repr=False, default=None)
    _loaded: bool = field(repr=False, default=False)

    def load(self) -> type[VendorRuntime] | None:
        """Import the vendor's runtime module once; None (and :attr:`error`) on failure.

        A vendor module that raises, or calls sys.exit(), at import is a broken vendor; an
        exit or interrupt that is not the vendor's (a signal handler that calls sys.exit()
        while the import runs) propagates, and the next load imports again."""
        if not self._loaded:
            cls, error = None, None
            try:
                obj = self._loader()
                cls = getattr(obj, "Runtime", obj)
                if not (isinstance(cls, type) and issubclass(cls, VendorRuntime)):
                    raise TypeError(f"{self.location} has no Runtime class derived from phoenix.vendor.VendorRuntime")
            except Exception as exc:  # a broken vendor must not stop the others
                cls, error = None, import_failure(exc)
            except SystemExit as exc:
                if not vendors_own_exit(exc):
                    raise
                cls, error = None, import_failure(exc)  # nor end the process
            # published together, after the import: a signal handler that loads this entry
            # while it imports finds it not loaded yet
            self._cls, self._error, self._loaded = cls, error, True
        return self._cls

    @property
    def error(self) -> str | None:
        self.load()
        return self._error

    def probe(self) -> Probe:
        cls = self.load()
        if cls is None:
            return Probe(False, self._error or "import failed")
        try:
            return cls.probe()
        except Exception as exc:  # a probe must not raise; report it if it does
            return Probe(False, f"probe raised {type(exc).__name__}: {exc}")

    @property
    def is_test_double(self) -> bool:
        cls = self.load()
        return bool(cls and cls.is_test_double)


def import_failure(exc: BaseException) -> str:
    """``import failed: <error> (<file>:<line>)`` for a vendor module that raised (or called
    sys.exit()) while importing; the place is in the vendor's own code, not the importer's."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SystemExit):
        what = f"it called sys.exit({exc.code!r}) at import"
    where = failure_place(exc)
    return f"import failed: {what}" + (f" ({where[0]}:{where[1]})" if where else "")


def vendors_own_exit(exc: SystemExit) -> bool:
    """Whether a SystemExit raised while a vendor's module imported is the vendor's doing (its
    code, or a library it called, called sys.exit()), not a Python signal handler's that ran
    meanwhile (Python runs handlers in the main thread between any two bytecodes: the
    handler's frames are then the innermost of the traceback)."""
    handlers = {code for code in map(_code_of, _signal_handlers()) if code is not None}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return False
        tb = tb.tb_next
    return True


def _signal_handlers() -> list:
    import signal

    found = []
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler):
            found.append(handler)
    return found


def _code_of(handler):
    """The code a Python signal handler runs first: a function's, a bound method's, a
    functools.partial's, a callable object's ``__call__``."""
    for _ in range(8):
        code = getattr(handler, "__code__", None)
        if code is not None:
            return code
        inner = getattr(handler, "__func__", None) or getattr(handler, "func", None)
        if inner is None:  # an object with a __call__ of its own (a builtin's has no code)
            inner = next((vars(k)["__call__"] for k in type(handler).__mro__ if "__call__" in vars(k)), None)
        if inner is None:
            return None
        handler = inner
    return None


def failure_place(exc: BaseException) -> tuple[str, int] | None:
    """Where a vendor's import failed: the deepest frame in the directory of the first module
    the import ran (the vendor's; a library it called, phoenix's importer and importlib's
    frames are not the vendor's code); a syntax error's own file and line."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 0
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    top = next((f for f in frames if f.name == "<module>"), None)
    if top is None:  # not raised by a module's code (the Runtime check above): no place of its
        return None
    home = os.path.dirname(top.filename)
    mine = [f for f in frames if os.path.dirname(f.filename) == home]
    return mine[-1].filename, mine[-1].lineno


def _module_loader(modname: str):
    return lambda: importlib.import_module(modname)


def _file_loader(name: str, path: str):
    def load():
        modname = f"phoenix_vendor_path_{name}.runtime"
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(modname, None)  # as importlib does: the next load runs it again
            raise
        return mod

    return load


def _entry_point_loader(ep):
    return lambda: ep.load()


def discover() -> dict[str, VendorEntry]:
    """All installed vendors by name (nothing imported yet: loading is lazy)."""
    found: dict[str, VendorEntry] = {}
    try:
        roots = list(importlib.import_module("phoenix.vendors").__path__)
    except ImportError:
        roots = []
    for root in roots:
        for name in sorted(os.listdir(root)):
            if name not in found and os.path.exists(os.path.join(root, name, "runtime.py")):
                mod = f"phoenix.vendors.{name}.runtime"
                found[name] = VendorEntry(name, "in-tree", mod, _module_loader(mod))
    for ep in importlib.metadata.entry_points(group="phoenix.vendors"):
        if ep.name not in found:
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            found[ep.name] = VendorEntry(ep.name, f"entry point ({dist})", ep.value, _entry_point_loader(ep))
    for d in filter(None, os.environ.get("PHX_VENDOR_PATH", "").split(os.pathsep)):
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name, "runtime.py")
            if os.path.exists(path) and name not in found:
                found[name] = VendorEntry(name, f"PHX_VENDOR_PATH ({d})", path, _file_loader(name, path))
    return dict(sorted(found.items()))


@dataclass
class Selection:
    """The outcome of selecting a vendor: which, why, and why not the others."""

    name: str
    runtime_cls: type[VendorRuntime]
    requested: str
    reason: str
    skipped: dict[str, str] = field(default_factory=dict)


def auto_priority(entry: VendorEntry) -> int:
    """Where ``auto`` probes a vendor: its class's ``auto_priority`` (higher first; 0:
    only chosen by name); -1 for a vendor that does not import (recorded, never probed)."""
    cls = entry.load()
    if cls is None:
        return -1
    return int(cls.auto_priority)


def auto_order(vendors: dict[str, VendorEntry]) -> list[str]:
    """The vendors ``auto`` considers, in probe order (priority, then name); not the fallback."""
    names = [n for n in vendors if n != FALLBACK]
    return sorted(names, key=lambda n: (-auto_priority(vendors[n]), n))


def _setting_source() -> str:
    where = _settings.source_of("vendor")
    return "PHX_VENDOR" if where in ("environment", "default") else f"the vendor setting ({where})"


def select(name: str | None = None, vendors: dict[str, VendorEntry] | None = None) -> Selection:
    """Choose a vendor by name, or by probing (``auto``); ``name`` defaults to the
    ``vendor`` setting (``PHX_VENDOR``).

    Raises UnknownVendorError for a name that is not installed, VendorUnavailable if
    the named vendor fails to import or its probe says it cannot serve.
    """
    requested = (name or "").strip() or _settings.effective("vendor")
    return _select(requested, "caller" if name else _setting_source(), vendors)


def _select(requested: str, by: str, vendors: dict[str, VendorEntry] | None) -> Selection:
    vendors = discover() if vendors is None else vendors
    if requested != "auto":
        entry = vendors.get(requested)
        if entry is None:
            raise UnknownVendorError(requested, list(vendors))
        cls = entry.load()
        if cls is None:
            raise VendorUnavailable(f"vendor {requested!r} ({entry.location}): {entry.error}")
        probe = entry.probe()
        if not probe.usable:
            raise VendorUnavailable(f"vendor {requested!r} cannot serve here: {probe.reason}")
        return Selection(requested, cls, requested, f"requested by {by}")

    skipped: dict[str, str] = {}
    for candidate in auto_order(vendors):
        entry = vendors[candidate]
        if entry.load() is None:
            skipped[candidate] = entry.error or "import failed"
            continue
        if entry.is_test_double:
            skipped[candidate] = "test double: only chosen by name"
            continue
        if auto_priority(entry) <= 0:
            skipped[candidate] = "auto_priority 0: only chosen by name"
            continue
        probe = entry.probe()
        if probe.usable:
            return Selection(candidate, entry.load(), "auto", f"auto: first usable vendor ({probe.reason})", skipped)
        skipped[candidate] = probe.reason
    fallback = vendors.get(FALLBACK)
    if fallback is None or fallback.load() is None:
        raise VendorUnavailable(f"no usable vendor, and the fallback {FALLBACK!r} is missing; skipped: {skipped}")
    probe = fallback.probe()
    if not probe.usable:  # said now, not by the runtime's constructor after the caller started its work
        others = f"skipped {', '.join(skipped)}: 'phx-port list' says why" if skipped else "none is installed"
        raise VendorUnavailable(
            f"PHX_VENDOR=auto: no vendor can serve here: no accelerator vendor is usable ({others}), and "
            f"the fallback {FALLBACK!r} cannot: {probe.reason}"
        )
    return Selection(
        FALLBACK,
        fallback.load(),
        "auto",
        "auto: no accelerator vendor usable, fell back to the host reference vendor (test double)",
        skipped,
    )


# The registry's state is replaced whole, never changed in place, and the lock is reentrant:
# a signal handler that does phoenix I/O runs in the main thread between two bytecodes of
# whatever it interrupted, resolve() included, and must neither deadlock on the lock nor see
# a half-made change (see phoenix.settings).
_lock = threading.RLock()
_current: tuple[str, VendorRuntime, Selection] | None = None  # (requested, runtime, selection)
#: use_runtime()'s (runtime, the settings override it holds): served for its name, never closed here
_adopted: tuple[VendorRuntime, _settings.Override] | None = None


def _reinit_after_fork() -> None:
    # a thread of the parent may have held the lock at fork(): in the child it never lets go
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reinit_after_fork)


def get_runtime(name: str | None = None) -> VendorRuntime:
    """The process-wide runtime of the selected vendor (created on first use).

    The vendor is the ``vendor`` setting's (``PHX_VENDOR``, ``settings.override(vendor=...)``);
    ``name`` asks for one vendor without changing the setting (tests, tools). The choice
    may change between calls; a different one closes the previous runtime and creates the
    new one.
    """
    name = (name or "").strip()
    return resolve(name or _settings.effective("vendor"), "caller" if name else None)


def _served(vendor: str) -> VendorRuntime | None:
    adopted, current = _adopted, _current
    if adopted is not None and adopted[0].name == vendor:
        return adopted[0]
    if current is not None and current[0] == vendor:
        return current[1]
    return None


def resolve(vendor: str, by: str | None = None) -> VendorRuntime:
    """The runtime for a value of the ``vendor`` setting (what the I/O stack calls with
    the settings it submits with); ``by`` says who asked, for the selection's reason."""
    global _current
    rt = _served(vendor)
    if rt is not None:
        return rt
    with _lock:
        rt = _served(vendor)
        if rt is not None:
            return rt
        sel = _select(vendor, by or _setting_source(), None)
        made = sel.runtime_cls()
        rt = _served(vendor)
        if rt is not None:  # a signal handler resolved it while this call made its own
            made.close()
            return rt
        old, _current = _current, (vendor, made, sel)
        if old is not None:
            old[1].close()
        return made


def runtime_for_io(vendor: str) -> VendorRuntime | None:
    """The runtime the I/O stack submits with, for a value of the ``vendor`` setting.

    ``auto``: None where no vendor can serve (host memory needs none). A vendor named
    explicitly (``PHX_VENDOR=nvidia``, ``settings.override(vendor=...)``) that cannot
    serve raises, naming it and why: a typo or a missing driver is never ignored in favour
    of host memory."""
    if vendor == "auto":
        try:
            return resolve(vendor)
        except PhxError:  # no usable vendor (the registry says why): host memory still works
            return None
        # (anything else, a signal handler's exception among them, propagates: an engine
        # built on "no runtime" because of it would be cached, answering "no data path")
    try:
        return resolve(vendor)
    except VendorUnavailable as exc:
        where = _settings.source_of("vendor")
        named = f"PHX_VENDOR={vendor}" if where in ("environment", "default") else f"vendor={vendor!r} ({where})"
        instead = "auto" if vendor == FALLBACK else f"auto (or {FALLBACK})"
        raise VendorUnavailable(
            f"{named}: {exc}; set the vendor to {instead} to use what is usable here ('phx info' lists the vendors)"
        ) from exc


def current_selection() -> Selection | None:
    """The Selection behind :func:`get_runtime`'s runtime, if one was made."""
    current = _current
    return current[2] if current else None


def use_vendor(name: str) -> VendorRuntime:
    """Select a vendor in code and return its runtime: ``settings.set(vendor=name)``, then
    :func:`get_runtime`. A thin wrapper over the setting, kept for tests and scripts; it
    writes no environment variable (a child process sees ``PHX_VENDOR`` as it was)."""
    _settings.set(vendor=name)
    return get_runtime()


def use_runtime(runtime: VendorRuntime | None) -> None:
    """Make a runtime the caller built (or wrapped) the one the ``vendor`` setting selects;
    None undoes it.

    A thin wrapper over the setting, kept for tests and for programs that build their
    runtime themselves: it holds ``settings.override(vendor=runtime.name)`` until the next
    call, and :func:`resolve` serves this instance for that name. The registry never
    closes it: the caller owns it.
    """
    global _adopted
    with _lock:
        layer = None
        if runtime is not None:
            layer = _settings.override(vendor=runtime.name)
            layer.__enter__()  # a block until the next call: set() does not take it back
        old, _adopted = _adopted, (runtime, layer) if runtime is not None else None
        if old is not None:
            old[1].__exit__(None, None, None)


def reset() -> None:
    """Close and forget the current runtime (tests, and switching vendors)."""
    global _current
    with _lock:
        old, _current = _current, None
        if old is not None:
            old[1].close()
