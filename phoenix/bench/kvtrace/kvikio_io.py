"""The ``kvikio`` configuration's engine: the SSD tier read and written through KvikIO.

Benchmark side. Availability and settings are control plane; the reads and writes are the
data path, in KvikIO's own thread pool. What a KvikIO user does today, with its best settings:

* compat mode ON (POSIX I/O, no GDS), ``num_threads`` ``--kvikio-threads`` (default 16),
  ``task_size`` ``--kvikio-task`` (default 4M) and, with ``--kvikio-direct on`` (the default),
  KvikIO's opportunistic Direct I/O for reads and writes (``auto_direct_io_read`` /
  ``auto_direct_io_write``: O_DIRECT where aligned, as phoenix and the staged loop read the
  slab), set with ``kvikio.defaults.set`` around each point (the files are opened inside, as
  compat mode is taken at open);
* a load from the SSD tier: ``CuFile(path, "r").pread(view, size, offset)`` (``"r+"`` for the
  file of demoted blocks, which is written too) into a CuPy view
  of the HBM block (``cupy.cuda.UnownedMemory`` + ``MemoryPointer`` + ``ndarray``: no copy,
  no allocation), the future waited before attention, as for phoenix;
* a write of a block evicted from DRAM: ``CuFile.pwrite`` from a NumPy view of the pinned
  DRAM slot (KvikIO takes host memory and writes it with POSIX ``pwrite``): a round's writes
  started together and waited for before its copies into DRAM, as phoenix's, and the
  write-behind's in its thread (``behind``); one evicted straight from HBM (DRAM full of pinned loads):
  ``pwrite`` from a CuPy view of the device block (KvikIO bounces it through its own buffer).

With ``--kvikio-direct off`` KvikIO reads and writes through the page cache (each point
starts with the slab dropped from it). Where RAM holds the whole slab (the loop device and
tmpfs tiers of a large host) the page cache is then a RAM tier the others lack, unbounded by
``--dram``: its blocks written during a point are read back from memory, not the drive.
Device memory must be CUDA's: on another vendor the configuration is refused, except for a
module marked ``IS_TEST_DOUBLE`` (tests/kvikio_double.py), which copies through the vendor.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

HINT = "install KvikIO and CuPy for this CUDA (e.g. pip install kvikio-cu12 cupy-cuda12x), or leave kvikio out of --configs"


def support(vendor: str) -> tuple[bool, str]:
    """Whether the kvikio configuration can run with ``vendor`` here, and why (one line)."""
    try:
        import kvikio
        import kvikio.defaults  # noqa: F401
    except Exception as exc:
        return False, f"kvikio is not importable ({type(exc).__name__}: {exc})"
    try:
        import cupy  # noqa: F401  (KvikIO reads into a CUDA array: a CuPy view of the HBM block)
    except Exception as exc:
        return False, f"cupy is not importable ({type(exc).__name__}: {exc}); KvikIO needs a CUDA array"
    if vendor != "nvidia" and not is_test_double():
        return False, f"KvikIO reads into CUDA device memory: it needs the nvidia vendor, not {vendor!r}"
    return True, f"kvikio {version()}{' (TEST DOUBLE)' if is_test_double() else ''}"


def is_test_double() -> bool:
    import kvikio

    return bool(getattr(kvikio, "IS_TEST_DOUBLE", False))


def version() -> str:
    import kvikio

    return str(getattr(kvikio, "__version__", "?"))


@contextlib.contextmanager
def settings(threads: int, task_size: int, direct: bool = True):
    """KvikIO's compat mode, thread pool, task size and Direct I/O for the duration of a point."""
    import kvikio
    import kvikio.defaults

    config = {
        "compat_mode": kvikio.CompatMode.ON,
        "num_threads": threads,
        "task_size": task_size,
        "auto_direct_io_read": direct,
        "auto_direct_io_write": direct,
    }
    with kvikio.defaults.set(config):
        yield


def info(threads: int, task_size: int, direct: bool = True) -> dict:
    """What a kvikio record says about the engine."""
    return {
        "version": version(),
        "compat_mode": "ON",
        "num_threads": threads,
        "task_size": task_size,
        "direct_io": "opportunistic O_DIRECT reads and writes" if direct else "off: through the page cache",
        "test_double": is_test_double(),
    }


def open_file(path: str, flags: str):
    import kvikio

    return kvikio.CuFile(path, flags)


def device_array(ptr: int, nbytes: int, device: int, owner=None):
    """A CuPy uint8 view of ``nbytes`` of device memory at ``ptr`` (memory the replay owns)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def host_array(ptr: int, nbytes: int):
    """A NumPy uint8 view of ``nbytes`` of (pinned) host memory at ``ptr``."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=np.uint8)
