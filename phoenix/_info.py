"""What the I/O stack can do here and what it is doing: :func:`capabilities`, :func:`stats`, :func:`sizes`.

Core side, control plane: read by ``phx info``, the conformance suite and tests. Each
answer says why (an engine unavailable, O_DIRECT refused, a vendor without a data path).
"""

from __future__ import annotations

import ctypes
import os
import tempfile

from . import settings as _settings
from ._abi import _STAT_FIELDS, ENGINE, _lib, _Sizes, _Stats, _strerror
from ._engine import _runtime, _using_engine
from ._files import PhxFile
from ._futures import _prune_stream_ops
from ._pagecache import fmap_info


def stats() -> dict:
    """Counters of the C core: live objects (contexts, threads, files, requests,
    stream_ops, registrations, worker_streams, bounce_bytes, bounce_in_use) and
    cumulative ones (bytes_read/written, chunks per path, direct/buffered I/Os,
    reissues, O_DIRECT fallbacks, io_uring_enter calls), and the file-mapping cache's
    (fmap_windows and fmap_bytes live: registered (pinned) now, in every pool, counted until
    a window is unregistered -- never above each pool's ``fmap_cache``; fmap_hits and fmap_misses: staged
    reads into device memory served from a registered mapping, or not); pool_waits
    (chunks that waited for a bounce slot, or for one of their worker's page-cache slots)
    copy_flushes (batches of staged reads' device copies given a completion: a callback
    launched, or an event), copy_events (events recorded after staged copies, which the
    io_uring workers poll instead of host callbacks: reads' batches and writes) and io_fixed
    (io_uring reads and writes of bounce slots on registered buffers)."""
    _prune_stream_ops()
    st = _Stats()
    _lib.phx_io_get_stats(ctypes.byref(st))
    return {name: getattr(st, name) for name in _STAT_FIELDS}


def sizes() -> dict:
    """The sizes the current worker pool runs with, as it resolved the settings: the bounce
    pool (``auto`` sized), the chunk, the chunk of staged and bounced transfers (at most
    the chunk, and small enough that two fit the pool: a small pool takes smaller staged
    chunks, it is never refused), the largest bounce slot and the bytes of device I/O one
    worker keeps in flight (its share of ``inflight``), with a sentence saying so."""
    sz = _Sizes()
    with _using_engine() as e:
        _lib.phx_ctx_sizes(e.handle, ctypes.byref(sz))
    out = {name: getattr(sz, name) for name, _ in _Sizes._fields_}
    mib = 1 << 20
    why = f"bounce pool {sz.bounce_pool / mib:g} MiB, chunk {sz.chunk / mib:g} MiB"
    if sz.staged_chunk < sz.chunk:
        why += (
            f"; staged chunks {sz.staged_chunk / mib:g} MiB (two must fit the pool: raise "
            "PHX_BOUNCE_POOL_SIZE for staged chunks of the full chunk size)"
        )
    if sz.worker_bytes < sz.chunk:
        why += (
            f"; chunks from the device {sz.worker_bytes / mib:g} MiB (each worker's share of "
            "PHX_INFLIGHT: raise it, or lower PHX_THREADS, for larger ones)"
        )
    out["why"] = why
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _probe_engine(name: str) -> tuple[bool, str]:
    why = ctypes.create_string_buffer(256)
    rc = _lib.phx_engine_probe(ENGINE[name], why, len(why))
    return rc >= 0, why.value.decode()


def capabilities(path=None) -> dict:
    """What the I/O stack can do here, and why (for ``phx info``).

    ``path``: a file or directory whose file system to check for O_DIRECT (default: the
    temporary directory). Returns engines (io_uring, threads, which ``auto`` picks),
    O_DIRECT on that file system, the vendor's data path, and the paths (host, direct,
    staged, zero-copy file mappings) with a reason each.
    """
    s = _settings.get()
    out: dict = {"settings": {k: getattr(s, k) for k in _settings.DEFAULTS}}
    if s.bounce_pool_size == 0:
        out["settings"]["bounce_pool_size"] = "auto"
    try:
        out["sizes"] = sizes()
    except Exception as exc:  # no engine can start: capabilities() still reports the rest
        out["sizes"] = {"why": f"cannot start a worker pool: {exc}"}
    ok_uring, why_uring = _probe_engine("io_uring")
    _, why_auto = _probe_engine("auto")
    out["engines"] = {
        "io_uring": {"available": ok_uring, "why": why_uring},
        "threads": {"available": True, "why": "pread/pwrite worker threads: always available"},
        "auto": "io_uring" if ok_uring else "threads",
        "auto_why": why_auto,
        "selected": s.engine if s.engine != "auto" else ("io_uring" if ok_uring else "threads"),
    }
    where = os.fspath(path) if path is not None else tempfile.gettempdir()
    directory = where if os.path.isdir(where) else os.path.dirname(os.path.abspath(where))
    try:
        fd, probe = tempfile.mkstemp(prefix=".phx-probe-", dir=directory)
        os.close(fd)
        try:
            with PhxFile(probe, "r+") as f:
                fi = f.info()
                cache_rc = _lib.phx_cache_probe_works(f._h)
        finally:
            os.unlink(probe)
        out["o_direct"] = {
            "path": directory,
            "available": fi["direct"],
            "why": fi["why"],
            "offset_align": fi["dio_offset_align"],
            "mem_align": fi["dio_mem_align"],
        }
        out["page_cache_probe"] = {
            "available": cache_rc == 0,
            "why": "cachestat(2) works: direct=None reads ranges already in the page cache buffered"
            if cache_rc == 0
            else f"cachestat(2) unavailable ({_strerror(cache_rc)}; Linux 6.5+): O_DIRECT reads "
            "go to the disk even for cached data",
        }
    except OSError as exc:
        out["o_direct"] = {"path": directory, "available": False, "why": f"cannot probe: {exc}"}
    rt = _runtime()
    modes = {
        "host": {
            "available": True,
            "why": "host memory (plain, pinned or registered) is read and written in "
            "place: O_DIRECT for the aligned body, buffered for unaligned ends",
        }
    }
    if rt is None:
        out["vendor"] = None
        modes["direct"] = {"available": False, "why": "no vendor runtime selected"}
        modes["staged"] = {"available": False, "why": "no vendor runtime selected"}
        out["stream_ordered"] = {"available": False, "why": "no vendor runtime selected"}
        out["caller_stream"] = {"by": "none", "why": "no vendor runtime selected: host memory only, nothing to order"}
    else:
        dp = None
        try:
            dp = rt.data_path()
            missing = dp.missing()
        except Exception as exc:
            missing = [f"data_path() failed: {exc}"]
        out["vendor"] = {
            "name": rt.name,
            "test_double": bool(getattr(rt, "is_test_double", False)),
            "data_path": "complete" if not missing else f"missing: {', '.join(missing)}",
        }
        modes["staged"] = {
            "available": not missing,
            "why": "pinned bounce buffers + the vendor's memcpy_async on per-worker streams"
            if not missing
            else f"the vendor's data path lacks {', '.join(missing)}",
        }
        out["stream_ordered"] = {
            "available": not missing,
            "why": "host callbacks (launch_host_func) run the file I/O in stream order, in every mode"
            if not missing
            else "needs the vendor's launch_host_func",
        }
        if missing:
            out["caller_stream"] = {"by": "none", "why": "no data path: device memory cannot be used"}
        else:
            by_events = not dp.missing_events()
            out["caller_stream"] = {"by": "events" if by_events else "synchronize", "why": dp.ordering()}
            polled = (
                by_events
                and bool(dp.event_query)
                and _settings.effective("copy_completion") == "auto"
                and out["engines"]["selected"] == "io_uring"
            )
            out["copy_completion"] = {
                "by": "polled events" if polled else "host callbacks",
                "why": "io_uring workers record an event after their staged copies and query it (event_query)"
                if polled
                else "the threads engine, a vendor without event_query, or copy_completion=callback: "
                "a host callback per batch of copies",
            }
        try:
            ptr = rt.device_alloc(1 << 16, 0)
            try:
                ok, why = rt.direct_capable(ptr, 1 << 16)
            finally:
                rt.device_free(ptr)
            modes["direct"] = {"available": bool(ok), "why": why}
        except Exception as exc:
            modes["direct"] = {"available": False, "why": f"cannot probe device memory: {exc}"}
    fm = None
    try:
        fm = fmap_info()
    except Exception as exc:  # no engine can start: say why
        modes["zero_copy_file_mappings"] = {"available": False, "why": f"cannot query: {exc}"}
    if fm is not None:
        on = fm["mode"] != "off"
        idle = f"{fm['idle']:g} s unread (PHX_FMAP_IDLE)" if fm["idle"] > 0 else "never when idle (PHX_FMAP_IDLE=0)"
        modes["zero_copy_file_mappings"] = {
            "available": on,
            "why": (
                f"warm reads into device memory: page-cache ranges mmap'd and host-registered (pinned) in "
                f"{_mib(fm['window'])} windows (flags {fm['register_flags']:#x}), at most {_mib(fm['budget'])} "
                f"pinned (PHX_FMAP_CACHE), one DMA per read; released after {idle} and all under memory "
                f"pressure ({fm['pressure']}); mode {fm['mode']}, PHX_FMAP_MODE=off turns it off"
            )
            if on
            else fm["why"],
            "state": {k: v for k, v in fm.items() if k not in ("idle_ns", "pressure")},
        }
    out["modes"] = modes
    return out
