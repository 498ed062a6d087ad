"""Test hooks: what tests and the conformance suite reach into, kept out of the production API.

Test side, control plane. Nothing in phoenix imports this package; tests, the
conformance suite (shipped, so an out-of-tree port can run it) and benchmarks do.

* :data:`TEST_HOSTFN` and :class:`TestHostFn`: a C stream host callback and its
  arguments (``phx_testing_hostfn``, ``hostrt/phx_testing.h``) that gate, hold or
  snapshot a stream with no Python on it. It lives in the host test-double library
  (``hostrt/libphxhostrt.so``), calls no accelerator runtime, and so works with any
  vendor's ``launch_host_func``, CUDA's on hardware included.
* :func:`inject_fault`: make a file's chunks fail with an errno (the C core's
  ``phx_file_inject_fault``), to test error paths without a failing disk.

``hostrt/`` holds the host reference runtime's C sources (a test double of a
CUDA-shaped runtime): setup.py builds them as ``libphxhostrt.so`` (bound by
``vendors/host/runtime.py``), and :mod:`phoenix.emulator` builds ``hostrt.c`` with
other symbol prefixes. They ship in the package, so both work from an installed wheel.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

from .._core import core

if TYPE_CHECKING:
    from ..io import PhxFile

#: the host reference runtime's sources, and the library the package build puts beside them
HOSTRT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostrt")
HOST_LIBRARY = os.path.join(HOSTRT_DIR, "libphxhostrt.so")

__all__ = ["HOSTRT_DIR", "HOST_LIBRARY", "TEST_HOSTFN", "TestHostFn", "inject_fault"]


class TestHostFn(ctypes.Structure):
    """``struct phx_testing_hostfn``: the arguments of :data:`TEST_HOSTFN`.

    ``kind`` 0 copies ``size`` bytes ``src`` -> ``dst``; 1 preads ``size`` bytes of
    ``fd`` at ``offset`` into ``dst``; 2 holds the stream until the int64 at ``src``
    is non-zero; 3 holds it for ``size`` microseconds. Then it takes a ticket from
    ``*counter`` into ``seq`` and stores bytes or -errno into ``result``. Keep the
    struct alive until the stream has run it.
    """

    __test__ = False  # a ctypes struct, not a pytest test class

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("fd", ctypes.c_int32),
        ("dst", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("counter", ctypes.POINTER(ctypes.c_int64)),
        ("seq", ctypes.c_int64),
        ("result", ctypes.c_int64),
    ]


@functools.cache
def _host_library() -> ctypes.CDLL:
    # loaded locally: nothing else should resolve a symbol against the test double
    try:
        return ctypes.CDLL(HOST_LIBRARY, mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise ImportError(
            f"phoenix's host test-double library is not built ({exc}): `pip install -e .` builds it"
        ) from None


#: address of the C test callback ``phx_testing_hostfn`` (queue it with any vendor's launch_host_func)
TEST_HOSTFN: int = ctypes.cast(_host_library().phx_testing_hostfn, ctypes.c_void_p).value


@functools.cache
def _inject_fn():
    fn = core().phx_file_inject_fault
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int]
    return fn


def inject_fault(f: PhxFile, offset: int, length: int, err: int) -> None:
    """Chunks of ``f`` overlapping ``[offset, offset+length)`` fail with errno ``err`` (0 clears)."""
    with f._gate as h:  # the file's C handle, held open for the call
        rc = _inject_fn()(h, offset, length, err)
    if rc < 0:
        raise OSError(-rc, f"phx_file_inject_fault: {os.strerror(-rc)}")
