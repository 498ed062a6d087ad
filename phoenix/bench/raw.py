"""The references every bench figure is divided by: ``libphxbench.so`` (``bench_raw.c``) through ctypes.

Benchmark side, control plane. The references are C so that they carry no Python
overhead, and a library of their own so that the production core (``_phxcore.so``)
carries no benchmark symbol; setup.py builds it as ``phoenix/bench/libphxbench.so``.

* :func:`raw_transfer`: O_DIRECT (or buffered) pread/pwrite of a file into host memory,
  one request in flight per thread: the reference at the configuration given (one of the
  device's; a sweep over threads x chunk finds its fastest).
* :func:`naive_transfer`: pread a chunk into pinned host memory, then a synchronous copy
  to the device through the vendor's data-path table: the naive staging loop.
* :func:`raw_shared_transfer`: random O_DIRECT reads landing round robin in one
  caller-given region (diagnostics: what the destinations' spread costs the disk path).

Each returns the bytes moved and raises OSError (the library's message) on failure.
"""

from __future__ import annotations

import ctypes
import functools
import os

LIBRARY = "libphxbench.so"
_ERRLEN = 256


def library_path() -> str:
    """Path of ``libphxbench.so``; ImportError with a hint if it was not built."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY)
    if not os.path.exists(path):
        raise ImportError(
            f"the bench's reference library {path} is not built: install the package with "
            "`pip install .` (or `python setup.py build_ext --inplace` in a source tree)"
        )
    return path


@functools.cache
def lib() -> ctypes.CDLL:
    """The reference library with its prototypes (loaded once per process)."""
    L = ctypes.CDLL(library_path())
    i64, u64, sz, cint, cstr, vp = (
        ctypes.c_int64,
        ctypes.c_uint64,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_void_p,
    )
    protos = {
        "phxbench_raw": [cstr, cint, cint, u64, sz, cint, u64, cint, cstr, sz],
        "phxbench_raw_shared": [cstr, u64, sz, cint, u64, vp, sz, cstr, sz],
        "phxbench_naive": [vp, cint, vp, cstr, cint, u64, sz, cint, u64, cint, cstr, sz],
    }
    for name, argtypes in protos.items():
        fn = getattr(L, name)
        fn.argtypes, fn.restype = argtypes, i64
    return L


def _check(r: int, what: str, err) -> int:
    if r < 0:
        raise OSError(-r, f"{what}: {err.value.decode()}")
    return r


def raw_transfer(
    path: str, write: bool, random: bool, size: int, chunk: int, threads: int, nops: int = 0, odirect: bool = True
) -> int:
    """pread/pwrite of ``path`` into host memory from ``threads`` C threads, one ``chunk``
    each in flight, sequential or ``nops`` random ones; bytes moved."""
    err = ctypes.create_string_buffer(_ERRLEN)
    r = lib().phxbench_raw(
        os.fsencode(path), int(write), int(random), size, chunk, threads, nops, int(odirect), err, _ERRLEN
    )
    return _check(r, f"raw {'write' if write else 'read'} of {path}", err)


def naive_transfer(
    dp,
    device: int,
    dev: int,
    path: str,
    random: bool,
    size: int,
    chunk: int,
    threads: int,
    nops: int = 0,
    odirect: bool = True,
) -> int:
    """The naive staging loop into device memory ``dev`` of ``size`` bytes; ``dp`` is the
    vendor's data-path table (``runtime.data_path()``)."""
    err = ctypes.create_string_buffer(_ERRLEN)
    r = lib().phxbench_naive(
        ctypes.addressof(dp),
        device,
        dev,
        os.fsencode(path),
        int(random),
        size,
        chunk,
        threads,
        nops,
        int(odirect),
        err,
        _ERRLEN,
    )
    return _check(r, f"naive read of {path}", err)


def raw_shared_transfer(path: str, size: int, chunk: int, threads: int, nops: int, shared: int, shared_len: int) -> int:
    """``nops`` random O_DIRECT reads as :func:`raw_transfer`, read ``i`` landing at
    ``(i % (shared_len // chunk)) * chunk`` of the caller's 4 KiB-aligned region ``shared``."""
    err = ctypes.create_string_buffer(_ERRLEN)
    r = lib().phxbench_raw_shared(os.fsencode(path), size, chunk, threads, nops, shared, shared_len, err, _ERRLEN)
    return _check(r, f"raw shared-region read of {path}", err)
