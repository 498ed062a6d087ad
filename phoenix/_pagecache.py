"""The page-cache mapping cache ("fmap"): warm reads into device memory, without a bounce buffer.

Core side, control plane. File ranges in the page cache (or tmpfs) are mmap'd in
windows and host-registered with the vendor, in the background after a first, staged
read; the next read of the range is one vendor copy from the mapping. The cache lives
in the C core (``phoenix/csrc/io_fmap.c``), one per engine; these calls wait for its
registrations, drop it and report it. The cache is bounded (``fmap_cache``, a small
default), releases windows not read for ``fmap_idle`` seconds and every window under
memory pressure (a PSI trigger, else MemAvailable), so that pinned pages do not keep a
file in memory that ``drop_caches`` or the kernel's reclaim would evict. Its settings are the ``fmap_*`` ones of
:mod:`phoenix.settings` (the registration flags come from the vendor:
:func:`phoenix._engine.fmap_register_flags`).
"""

from __future__ import annotations

import ctypes

from ._abi import _P, FMAP_MODE_NAME, _FmapInfo, _lib
from ._engine import _each_live_engine, _using_engine
from ._files import PhxFile
from .checks import timeout_ns


def fmap_wait(timeout: float | None = None) -> bool:
    """Wait until the background registrations queued by warm-read misses are done (the
    next read of those ranges hits). For benchmarks and KV tiers: "the registration
    happens between agent rounds". False if ``timeout`` seconds passed first."""
    ns = timeout_ns(timeout, "fmap_wait")
    return all(rc == 0 for rc in _each_live_engine(lambda e: _lib.phx_fmap_wait(e.handle, ns)))


def fmap_clear() -> int:
    """Unregister and unmap every cached file mapping now (those a request is copying
    from go when it completes); returns how many were dropped."""
    return sum(max(0, rc) for rc in _each_live_engine(lambda e: _lib.phx_fmap_clear(e.handle)))


def fmap_info() -> dict:
    """The current pool's file-mapping cache: mode, budget, window, registered windows and
    bytes, ``pinned`` (every byte registered now: cached windows and dropped ones a request
    still copies from; never above ``budget``), queued registrations, windows the vendor
    refused, hits, misses, evictions, ``idle`` (the timeout, s), ``idle_releases``,
    ``pressure_releases`` and how memory pressure is watched (``pressure``)."""
    fi = _FmapInfo()
    with _using_engine() as e:
        _lib.phx_fmap_query(e.handle, ctypes.byref(fi))
    out = {name: getattr(fi, name) for name, _ in _FmapInfo._fields_ if name not in ("why", "mode", "pressure")}
    out["mode"] = FMAP_MODE_NAME.get(fi.mode, str(fi.mode))
    out["why"] = fi.why.decode(errors="replace")
    out["idle"] = fi.idle_ns / 1e9  # seconds (PHX_FMAP_IDLE; 0: never)
    out["pressure"] = fi.pressure.decode(errors="replace")
    return out


def _fmap_simulate_pressure() -> None:
    """Test hook: every live pool's registrar acts as on a memory-pressure signal (releases
    every window; those in use when their requests finish) and registers nothing for 5 s."""
    _each_live_engine(lambda e: _lib.phx_fmap_simulate_pressure(e.handle))


def _fmap_lookup(f: PhxFile, offset: int, length: int):
    """Test hook: the mapped address of [offset, +length) of ``f`` if cached, else None."""
    addr = _P()
    with f._gate as h, _using_engine() as e:
        rc = _lib.phx_fmap_lookup(e.handle, h, offset, length, ctypes.byref(addr))
    return addr.value if rc == 0 else None
