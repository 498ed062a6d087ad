"""Settings of the I/O stack: read from the environment, overridable in a ``with`` block.

Core side, control plane. Every setting lives in this one table:

=======================  ============================  =========  =====================================================
setting                  environment                   default    meaning
=======================  ============================  =========  =====================================================
``vendor``               ``PHX_VENDOR``                auto       the vendor runtime the I/O stack uses: a name
                                                                  (``host``, ``nvidia``, ``metax``, a port's) or
                                                                  ``auto`` (the usable vendor of highest
                                                                  ``auto_priority``, else ``host``). The one way to
                                                                  select a vendor; :mod:`phoenix.registry` resolves
                                                                  it (an unknown name is an error listing the
                                                                  installed ones).
``threads``              ``PHX_THREADS``               min(16,    I/O worker threads. io_uring engine: one ring per
                                                       max(4,     worker; threads engine: one pread/pwrite in flight
                                                       cores))    per worker. More workers copy cached (warm) data in
                                                                  parallel.
``chunk_size``           ``PHX_CHUNK_SIZE``            8M         bytes per chunk: a request is cut at multiples of it
                                                                  (in file offsets) and its chunks run in parallel. A
                                                                  multiple of 4096, at most 1G; sizes take K/M/G.
``queue_depth``          ``PHX_QUEUE_DEPTH``           32         chunks in flight per worker (io_uring engine), and
                                                                  at most 64 MiB of them: up to threads x queue_depth
                                                                  small I/Os in the kernel at once.
``inflight``             ``PHX_INFLIGHT``              64M        bytes of file I/O from the device (not the page
                                                                  cache) in flight at once, split evenly among the
                                                                  workers (each at least 1M): a request's chunks are
                                                                  cut no larger than a worker's share. Fast devices
                                                                  and caches slow down under many bytes in flight (a
                                                                  DMA's working set past the last-level cache); 0:
                                                                  64M per worker, chunks as ``chunk_size``.
``bounce_pool_size``     ``PHX_BOUNCE_POOL_SIZE``      auto       most pinned host memory for bounce buffers (staged
                                                                  path). ``auto``: four chunks (at most a worker's
                                                                  ``inflight`` share) per worker (one in the
                                                                  kernel, the others in or waiting for a device
                                                                  copy), at least 256M, at most 4G. Allocated on first use in segments, pinned
                                                                  through the vendor, kept until
                                                                  :func:`phoenix.io.shutdown`. A staged chunk is at
                                                                  most half of it, so two always fit.
``mode``                 ``PHX_MODE``                  auto       ``auto``: per request, I/O lands straight in memory
                                                                  the CPU can address (host memory; device memory the
                                                                  vendor says is direct-capable), else it is staged.
                                                                  ``staged``: device memory always goes through bounce
                                                                  buffers and vendor copies. ``direct``: device memory
                                                                  must be direct-capable (an error says why not).
                                                                  Host memory is always read and written in place.
``engine``               ``PHX_IO_ENGINE``             auto       ``io_uring`` (rings through raw system calls),
                                                                  ``threads`` (pread/pwrite workers), or ``auto``:
                                                                  io_uring where the kernel allows it, else threads
                                                                  (the reason: ``phoenix.io.capabilities()``).
``fmap_cache``           ``PHX_FMAP_CACHE``            min(4G,    most bytes of file mappings kept host-registered
                                                       RAM/16)    for warm reads into device memory (a file range in
                                                                  the page cache or tmpfs, mmap'd and registered once,
                                                                  then one DMA per read). LRU under this budget; a
                                                                  window larger than it is never registered. Its
                                                                  pages are pinned: neither ``drop_caches`` nor the
                                                                  kernel's reclaim can evict them, for every process
                                                                  on the machine, so the default is small (a few
                                                                  windows, at most a sixteenth of memory); raise it
                                                                  for a KV tier that rereads more. 0: off.
``fmap_idle``            ``PHX_FMAP_IDLE``             30         seconds: a window not read for this long is
                                                                  released (unregistered, unmapped: its pages are
                                                                  ordinary page cache again). 0: never. Every window
                                                                  is also released under memory pressure (a PSI
                                                                  trigger on ``/proc/pressure/memory``, else
                                                                  MemAvailable under 5% of MemTotal), and none is
                                                                  registered for 5 s after.
``fmap_mode``            ``PHX_FMAP_MODE``             auto       ``auto``: a miss is read staged and its windows are
                                                                  registered on a background thread once no I/O of
                                                                  the context is in flight (at most 2 s later), so
                                                                  that page-locking never slows a read or holds the
                                                                  runtime's lock under a busy stream; the next read
                                                                  hits (:func:`phoenix.io.fmap_wait` waits for it).
                                                                  ``sync``: a miss registers in the submitting thread
                                                                  and is served from the mapping (tests, benchmarks).
                                                                  ``off``: never.
``fmap_window``          ``PHX_FMAP_WINDOW``           1G         bytes per mapping window (aligned in file offsets,
                                                                  a multiple of 2M): the unit of registration.
``fmap_register_flags``  ``PHX_FMAP_REGISTER_FLAGS``   vendor     host_register flags for the mappings. ``vendor``:
                                                                  the vendor's own registration flags with its
                                                                  read-only flag (CUDA: portable 1 | read-only 8);
                                                                  a number is passed as is. A refusal is retried
                                                                  without read-only, then the window is never retried.
``fixed_buffers``        ``PHX_FIXED_BUFFERS``         on         ``on``: each io_uring worker registers the bounce
                                                                  pool with its ring (once per segment), so a staged
                                                                  read or write does not pin its pages per I/O (the
                                                                  larger part of an O_DIRECT submission's CPU). A
                                                                  segment the kernel refuses (``RLIMIT_MEMLOCK``
                                                                  without ``CAP_IPC_LOCK``) is read and written
                                                                  plainly. ``off``: never (a comparison).
``copy_completion``      ``PHX_COPY_COMPLETION``       auto       how an io_uring worker learns that its staged
                                                                  copies to or from device memory are done.
                                                                  ``auto``: it records an event after them and
                                                                  polls it between I/Os, where the vendor has
                                                                  ``event_query``; else, and with ``callback``, a
                                                                  host callback on the copy stream (each costs the
                                                                  runtime's callback thread tens of microseconds).
                                                                  A staged write's copy is looked at at its
                                                                  predicted end; ``steps``: after 20, 40, ... us
                                                                  (a comparison).
=======================  ============================  =========  =====================================================

Per file, ``phoenix.io.open(..., direct=None|True|False)`` chooses O_DIRECT (None: where the
file system takes it; unaligned heads and tails always go through the buffered descriptor),
and ``sync=True`` opens with O_DSYNC (each write durable when it completes).

Use::

    import phoenix.settings as ps
    ps.get().chunk_size                 # the effective value now
    with ps.override(threads=8, chunk_size="16M"):
        ...                             # I/O submitted here uses 8 workers, 16 MiB chunks
    ps.set(mode="staged")               # process-wide, until changed again
    with ps.override(vendor="host"):    # the vendor, like any other setting
        ...

Overrides are process-wide (like KvikIO's ``kvikio.defaults.set``), nest, and are undone
at the end of the ``with`` block. Requests already submitted keep the settings they were
submitted with; a change of vendor, threads, queue depth, chunk size, pool size, engine
or an ``fmap_*`` setting starts a new worker pool (with an empty file-mapping cache) for
the requests that follow (the old one finishes its work and exits).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

from .checks import I64_MAX
from .vendor import SizeTooLarge, parse_size

MODES = ("auto", "staged", "direct")
ENGINES = ("auto", "io_uring", "threads")
FMAP_MODES = ("auto", "off", "sync")
COPY_COMPLETIONS = ("auto", "callback", "steps")

#: setting name -> environment variable
ENV = {
    "vendor": "PHX_VENDOR",
    "threads": "PHX_THREADS",
    "chunk_size": "PHX_CHUNK_SIZE",
    "queue_depth": "PHX_QUEUE_DEPTH",
    "inflight": "PHX_INFLIGHT",
    "bounce_pool_size": "PHX_BOUNCE_POOL_SIZE",
    "mode": "PHX_MODE",
    "engine": "PHX_IO_ENGINE",
    "fmap_cache": "PHX_FMAP_CACHE",
    "fmap_idle": "PHX_FMAP_IDLE",
    "fmap_mode": "PHX_FMAP_MODE",
    "fmap_window": "PHX_FMAP_WINDOW",
    "fmap_register_flags": "PHX_FMAP_REGISTER_FLAGS",
    "fixed_buffers": "PHX_FIXED_BUFFERS",
    "copy_completion": "PHX_COPY_COMPLETION",
}


def _default_threads() -> int:
    return min(16, max(4, os.cpu_count() or 4))


def _default_fmap_cache() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    # small on purpose: pinned page-cache pages cannot be evicted (drop_caches, reclaim)
    return min(4 << 30, ram // 16) if ram > 0 else 1 << 30


DEFAULTS = {
    "vendor": "auto",
    "threads": _default_threads(),
    "chunk_size": 8 << 20,
    "queue_depth": 32,
    "inflight": 64 << 20,
    "bounce_pool_size": 0,  # auto: sized by the context from threads and chunk size
    "mode": "auto",
    "engine": "auto",
    "fmap_cache": _default_fmap_cache(),
    "fmap_idle": 30.0,
    "fmap_mode": "auto",
    "fmap_window": 1 << 30,
    "fmap_register_flags": "vendor",  # resolved per runtime by phoenix._engine.fmap_register_flags
    "fixed_buffers": True,
    "copy_completion": "auto",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One consistent set of values (what a request is submitted with)."""

    vendor: str
    threads: int
    chunk_size: int
    queue_depth: int
    inflight: int
    bounce_pool_size: int
    mode: str
    engine: str
    fmap_cache: int
    fmap_idle: float  #: seconds
    fmap_mode: str
    fmap_window: int
    fmap_register_flags: int | str  #: a number, or "vendor"
    fixed_buffers: bool
    copy_completion: str

    def pool_key(self) -> tuple:
        """The values a worker pool is built with (mode is per request; the vendor's runtime
        is a key of its own, see :mod:`phoenix._engine`). The file-mapping cache belongs to
        the pool: changing its settings starts a new one (empty)."""
        return (
            self.threads,
            self.chunk_size,
            self.queue_depth,
            self.inflight,
            self.bounce_pool_size,
            self.engine,
            self.fmap_cache,
            self.fmap_idle,
            self.fmap_mode,
            self.fmap_window,
            self.fmap_register_flags,
            self.fixed_buffers,
            self.copy_completion,
        )


def _check(name: str, value, source: str):
    """Validate and normalize one value; ValueError naming the setting and where it came from."""
    if name == "vendor":
        # any name: whether it is installed is the registry's to say (UnknownVendorError)
        text = value.strip() if isinstance(value, str) else ""
        if not text:
            raise ValueError(f"{source}: vendor={value!r} is not a vendor name (auto, host, nvidia, ...)")
        return text
    if name == "fixed_buffers":
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in ("on", "off", "1", "0", "true", "false", "yes", "no"):
            return value if isinstance(value, bool) else text in ("on", "1", "true", "yes")
        raise ValueError(f"{source}: fixed_buffers={value!r} is not on or off")
    if name == "fmap_register_flags" and isinstance(value, str) and value.strip().lower() == "vendor":
        return "vendor"
    if name in ("mode", "engine", "fmap_mode", "copy_completion"):
        text = str(value).strip().lower()
        choices = {"mode": MODES, "engine": ENGINES, "fmap_mode": FMAP_MODES, "copy_completion": COPY_COMPLETIONS}[name]
        if text not in choices:
            raise ValueError(f"{source}: {name}={value!r} is not one of {', '.join(choices)}")
        return text
    if name == "fmap_idle":
        try:
            secs = float(value.strip().lower().removesuffix("s")) if isinstance(value, str) else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: fmap_idle={value!r} is not a number of seconds (30, 0.5, 0: never)") from None
        if not 0 <= secs <= 1e6:
            raise ValueError(f"{source}: fmap_idle={secs} must be between 0 (never) and 1e6 seconds")
        return secs
    if name == "bounce_pool_size" and isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    try:
        if name == "fmap_register_flags" and isinstance(value, str):
            n = int(value.strip(), 0)  # 9, 0x9
        else:
            n = parse_size(value) if isinstance(value, str) else int(value)
    except SizeTooLarge:
        raise ValueError(f"{source}: {name}={value} is past 2**63-1 bytes") from None
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name}={value!r} is not an integer or a size (4096, 64K, 16M, 2G)") from None
    if name == "threads" and not 1 <= n <= 1024:
        raise ValueError(f"{source}: threads={n} must be between 1 and 1024")
    if name == "queue_depth" and not 1 <= n <= 4096:
        raise ValueError(f"{source}: queue_depth={n} must be between 1 and 4096")
    if name == "inflight" and n != 0 and n < 1 << 20:
        raise ValueError(f"{source}: inflight={n} must be 0 (64 MiB per worker) or at least 1M")
    if name == "chunk_size" and (n < 4096 or n % 4096 or n > 1 << 30):
        raise ValueError(f"{source}: chunk_size={n} must be a multiple of 4096 between 4K and 1G")
    if name == "bounce_pool_size" and n != 0 and n < 1 << 20:
        raise ValueError(f"{source}: bounce_pool_size={n} must be auto (0) or at least 1M")
    if name == "fmap_cache" and n < 0:
        raise ValueError(f"{source}: fmap_cache={n} must be 0 (off) or a size")
    if name == "fmap_window" and (n < 2 << 20 or n % (2 << 20)):
        raise ValueError(f"{source}: fmap_window={n} must be a multiple of 2M")
    if name == "fmap_register_flags" and not 0 <= n <= 0xFFFFFFFF:
        raise ValueError(f"{source}: fmap_register_flags={n} must be an unsigned 32-bit value")
    if name in ("inflight", "bounce_pool_size", "fmap_cache", "fmap_window") and n > I64_MAX:
        raise ValueError(f"{source}: {name}={n} is past 2**63-1 bytes")
    if name == "bounce_pool_size" and n > _physical_memory():
        raise ValueError(
            f"{source}: bounce_pool_size={n} is more than this machine's memory ({_physical_memory()} bytes): "
            "the pool is pinned host memory; give at most that (auto: sized from threads and chunk size)"
        )
    return n


def _physical_memory() -> int:
    """Bytes of RAM (sysconf), or 2**63-1 where it cannot be read."""
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return I64_MAX
    return n if n > 0 else I64_MAX  # (-1: indeterminate)


_lock = threading.Lock()
_overrides: list[dict] = []  # stack: set() writes the bottom, override() pushes
_base: dict = {}  # set() values
_env_cache: tuple[tuple, dict] | None = None


def _from_env() -> dict:
    global _env_cache
    raw = tuple(os.environ.get(var) for var in ENV.values())
    cached = _env_cache
    if cached is not None and cached[0] == raw:
        return cached[1]
    values = {}
    for (name, var), text in zip(ENV.items(), raw, strict=True):
        if text is not None and text.strip() != "":
            values[name] = _check(name, text, f"environment {var}")
    _env_cache = (raw, values)
    return values


def get() -> Settings:
    """The effective settings now: defaults < environment < set() < override() blocks."""
    values = dict(DEFAULTS)
    values.update(_from_env())
    with _lock:
        values.update(_base)
        for layer in _overrides:
            values.update(layer)
    return Settings(**values)


def effective(name: str):
    """One setting's effective value, checking only that one (a bad value elsewhere in the
    environment does not stop, say, the registry from resolving ``vendor``)."""
    if name not in DEFAULTS:
        raise TypeError(f"unknown setting {name!r}; known: {', '.join(DEFAULTS)}")
    with _lock:
        for layer in reversed(_overrides):
            if name in layer:
                return layer[name]
        if name in _base:
            return _base[name]
    text = os.environ.get(ENV[name])
    if text is not None and text.strip() != "":
        return _check(name, text, f"environment {ENV[name]}")
    return DEFAULTS[name]


def source_of(name: str) -> str:
    """Where a setting's effective value comes from: override, set(), environment or default."""
    with _lock:
        if any(name in layer for layer in _overrides):
            return "override"
        if name in _base:
            return "set()"
    text = os.environ.get(ENV[name])
    return "environment" if text is not None and text.strip() != "" else "default"


def _validate(kwargs: dict, source: str) -> dict:
    unknown = builtins.set(kwargs) - builtins.set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}")
    return {k: _check(k, v, source) for k, v in kwargs.items()}


def set(**kwargs) -> None:  # noqa: A001 (KvikIO's name)
    """Set values process-wide (above the environment, below active overrides)."""
    values = _validate(kwargs, "phoenix.settings.set")
    with _lock:
        _base.update(values)


def reset() -> None:
    """Forget set() values (overrides in progress stay until their block ends)."""
    with _lock:
        _base.clear()


@contextlib.contextmanager
def override(**kwargs) -> Iterator[Settings]:
    """``with override(threads=8, chunk_size="16M"): ...`` -- values for the block, then back."""
    layer = _validate(kwargs, "phoenix.settings.override")
    with _lock:
        _overrides.append(layer)
    try:
        yield get()
    finally:
        with _lock:
            # remove this block's layer (blocks may end out of order across threads)
            for i in range(len(_overrides) - 1, -1, -1):
                if _overrides[i] is layer:
                    del _overrides[i]
                    break


def describe() -> list[dict]:
    """The table above as data (for ``phx info``): name, env var, effective value, source."""
    eff = get()
    return [
        {"name": name, "env": var, "value": getattr(eff, name), "source": source_of(name)} for name, var in ENV.items()
    ]
