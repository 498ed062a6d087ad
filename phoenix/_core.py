"""Loader of the C core library (``phoenix._phxcalls``): the I/O stack's, and its test hooks'.

Core side, control plane. The library is an extension module only so the package
build compiles it and the import system locates it; it is used through ctypes (every
ctypes call releases the GIL while it runs in C). It holds no vendor runtime: the host
vendor binds its own library (``phoenix/_testing/hostrt/``) like any other port.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util


@functools.cache
def core_path() -> str:
    """Path of the compiled C core; raises ImportError with a hint if it was not built."""
    spec = importlib.util.find_spec("phoenix._phxcore")
    if spec is None or not spec.origin:
        raise ImportError(
            "phoenix's C core (phoenix._phxcore) is not built: install the package with "
            "`pip install .` (or `pip install -e .` for development)"
        )
    return spec.origin


@functools.cache
def core() -> ctypes.CDLL:
    """The C core as a ctypes library (loaded once per process)."""
    return ctypes.CDLL(core_path(), mode=ctypes.RTLD_GLOBAL)


@functools.cache
def calls():
    """``phoenix._phxcalls``, bound to the C core: the objects that own a call's C resources
    (gates, request groups, stream ops) across asynchronous exceptions."""
    from . import _phxcalls

    core()  # loaded (RTLD_GLOBAL) before the module binds its entry points
    _phxcalls.bind(core_path())
    return _phxcalls
