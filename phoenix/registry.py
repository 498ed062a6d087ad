"""Vendor discovery and run-time selection (``PHX_VENDOR``).

Control plane. Vendors are found, never listed:

* in-tree: every directory ``vendors/<name>/`` with a ``runtime.py`` (installed as
  ``phoenix.vendors.<name>``);
* out-of-tree: the ``phoenix.vendors`` entry-point group (``name = "pkg.module"``
  or ``"pkg.module:Runtime"``);
* extra directories in ``PHX_VENDOR_PATH`` (``dir1:dir2``), each holding
  ``<name>/runtime.py``: for a port under development and for tests.

So adding a vendor edits nothing outside its own directory. ``PHX_VENDOR=auto``
(the default) probes every real vendor and falls back to the ``host`` reference
vendor; the selection records why it chose and why it skipped each other vendor.
A vendor whose module fails to import is reported with its error and does not
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

from .errors import UnknownVendorError, VendorUnavailable
from .vendor import Probe, VendorRuntime

#: the reference vendor `auto` falls back to
FALLBACK = "host"
#: probe order of `auto` for the vendors it knows; others follow alphabetically
PREFERRED = ("nvidia", "metax")


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
        """Import the vendor's runtime module once; None (and :attr:`error`) on failure."""
        if not self._loaded:
            self._loaded = True
            try:
                obj = self._loader()
                cls = getattr(obj, "Runtime", obj)
                if not (isinstance(cls, type) and issubclass(cls, VendorRuntime)):
                    raise TypeError(f"{self.location} has no Runtime class derived from phoenix.vendor.VendorRuntime")
                self._cls = cls
            except Exception as exc:  # a broken vendor must not stop the others
                tb = traceback.extract_tb(exc.__traceback__)
                where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
                self._error = f"import failed: {type(exc).__name__}: {exc}{where}"
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


def _module_loader(modname: str):
    return lambda: importlib.import_module(modname)


def _file_loader(name: str, path: str):
    def load():
        modname = f"phoenix_vendor_path_{name}.runtime"
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
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


def select(name: str | None = None, vendors: dict[str, VendorEntry] | None = None) -> Selection:
    """Choose a vendor by name, or by probing (``auto``); ``name`` defaults to ``PHX_VENDOR``.

    Raises UnknownVendorError for a name that is not installed, VendorUnavailable if
    the named vendor fails to import or its probe says it cannot serve.
    """
    requested = (name or os.environ.get("PHX_VENDOR") or "auto").strip()
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
        return Selection(requested, cls, requested, f"requested by {'PHX_VENDOR' if not name else 'caller'}")

    order = [n for n in PREFERRED if n in vendors]
    order += [n for n in vendors if n not in order and n != FALLBACK]
    skipped: dict[str, str] = {}
    for candidate in order:
        entry = vendors[candidate]
        if entry.load() is None:
            skipped[candidate] = entry.error or "import failed"
            continue
        if entry.is_test_double:
            skipped[candidate] = "test double: only chosen by name"
            continue
        probe = entry.probe()
        if probe.usable:
            return Selection(candidate, entry.load(), "auto", f"auto: first usable vendor ({probe.reason})", skipped)
        skipped[candidate] = probe.reason
    fallback = vendors.get(FALLBACK)
    if fallback is None or fallback.load() is None:
        raise VendorUnavailable(f"no usable vendor, and the fallback {FALLBACK!r} is missing; skipped: {skipped}")
    return Selection(FALLBACK, fallback.load(), "auto", "auto: no accelerator vendor usable, fell back to the host reference vendor (test double)", skipped)


_lock = threading.Lock()
_current: tuple[str, VendorRuntime, Selection] | None = None


def get_runtime(name: str | None = None) -> VendorRuntime:
    """The process-wide runtime of the selected vendor (created on first use).

    ``name`` (or ``PHX_VENDOR``) may change between calls; a different choice
    closes the previous runtime and creates the new one.
    """
    global _current
    requested = (name or os.environ.get("PHX_VENDOR") or "auto").strip()
    with _lock:
        if _current is not None and _current[0] == requested:
            return _current[1]
        sel = select(requested)
        rt = sel.runtime_cls()
        if _current is not None:
            _current[1].close()
        _current = (requested, rt, sel)
        return rt


def current_selection() -> Selection | None:
    """The Selection behind :func:`get_runtime`'s runtime, if one was made."""
    return _current[2] if _current else None


def use_vendor(name: str) -> VendorRuntime:
    """Select a vendor in code (same as ``PHX_VENDOR=name``) and return its runtime."""
    os.environ["PHX_VENDOR"] = name
    return get_runtime(name)


def reset() -> None:
    """Close and forget the current runtime (tests, and switching vendors)."""
    global _current
    with _lock:
        if _current is not None:
            _current[1].close()
        _current = None
