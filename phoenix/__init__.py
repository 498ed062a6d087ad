"""Phoenix: vendor-agnostic direct-storage I/O between files and accelerator memory.

Core side, control plane: the package's front door. Quick start (KvikIO-like)::

    import phoenix
    with phoenix.open("/data/kv.bin", "r") as f:
        n = f.read(tensor)                 # blocking; f.pread(...) returns a future

The vendor is chosen at run time by the ``vendor`` setting: ``PHX_VENDOR``, or
``phoenix.settings.override(vendor=...)`` in code (``auto`` by default: the usable
accelerator of highest priority, else the ``host`` reference vendor). ``phx info`` tells
what is selected and why. Settings: :mod:`phoenix.settings`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import settings  # noqa: E402
from .errors import PhxError, PhxIOError, VendorError  # noqa: E402
from .registry import get_runtime, use_vendor  # noqa: E402

__all__ = ["__version__", "PhxError", "PhxIOError", "VendorError", "get_runtime", "use_vendor",
           "open", "batch", "register", "deregister", "settings"]

_IO_NAMES = {"open", "batch", "register", "deregister"}


def __getattr__(name):
    # The I/O stack loads the C core; import it only when used, so that `phx info`
    # and vendor discovery work (and report) even where the core cannot load.
    import importlib

    if name in _IO_NAMES:
        return getattr(importlib.import_module("phoenix.io"), name)
    raise AttributeError(f"module 'phoenix' has no attribute {name!r}")
