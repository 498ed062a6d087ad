"""Phoenix: vendor-agnostic direct-storage I/O between files and accelerator memory.

Core side, control plane: the package's front door. Quick start (KvikIO-like)::

    import phoenix
    with phoenix.open("/data/kv.bin", "r") as f:
        n = f.read(tensor)                 # blocking; f.pread(...) returns a future

The vendor is chosen at run time by the ``vendor`` setting: ``PHX_VENDOR``, or
``phoenix.settings.override(vendor=...)`` in code (``auto`` by default: the usable
accelerator of highest priority, else the ``host`` reference vendor). ``phx info`` tells
what is selected and why. Settings: :mod:`phoenix.settings`.
Diagnostics go to the ``phoenix`` logger (:mod:`logging`); where the application
configures no logging, its warnings and errors still reach stderr.
"""

from __future__ import annotations

from ._version import __version__


def _refuse_a_clash() -> None:
    # Another distribution (arize-phoenix) installing an import package `phoenix` into the
    # same place breaks this one in ways that do not say why (its phoenix/vendor/ hides our
    # vendor.py): say it first. The check lives outside the package (_phx_entry, installed
    # beside it) so that the console scripts run it before importing a `phoenix` at all.
    try:
        from _phx_entry import clash_message
    except ImportError:  # a source tree whose top level is not on the path: nothing to compare
        return
    message = clash_message()
    if message:
        raise ImportError(message, name=__name__)


_refuse_a_clash()

from . import settings  # noqa: E402
from .errors import PhxError, PhxIOError, VendorError  # noqa: E402
from .registry import get_runtime, use_vendor  # noqa: E402

__all__ = [
    "__version__",
    "PhxError",
    "PhxIOError",
    "VendorError",
    "get_runtime",
    "use_vendor",
    "open",
    "batch",
    "register",
    "deregister",
    "settings",
]

_IO_NAMES = {"open", "batch", "register", "deregister"}


def _submodule_names() -> set[str]:
    """The package's public submodules (``phoenix.io``, ``phoenix.kmod`` ...) in its
    directories. (An editable install maps ``phoenix.vendors`` and ``phoenix.templates``
    in from elsewhere: reachable as attributes all the same, by :func:`_submodule`.)"""
    import pkgutil

    return {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def _submodule(name: str):
    # A public submodule, imported on first use: `import phoenix; phoenix.io.stats()` works
    # as documented, without loading the C core (phoenix.io) until then. A directory of data
    # (csrc/, lib/: no __init__.py) is no module.
    import importlib
    import importlib.util

    if name.startswith("_") or not name.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(f"{__name__}.{name}")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "namespace"):
        return None
    return importlib.import_module(f"{__name__}.{name}")


def __getattr__(name):
    # The I/O stack loads the C core; import it only when used, so that `phx info`
    # and vendor discovery work (and report) even where the core cannot load.
    import importlib

    if name in _IO_NAMES:
        return getattr(importlib.import_module("phoenix.io"), name)
    module = _submodule(name)
    if module is not None:
        return module
    raise AttributeError(f"module 'phoenix' has no attribute {name!r}")


def __dir__():
    # the lazy names (open, batch, io, kmod, ...) are public too: list them before their first use
    return sorted(set(globals()) | set(__all__) | _submodule_names())
