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
    ps.override(vendor="host")          # without `with`: from now on (see below)

Overrides are process-wide (like KvikIO's ``kvikio.defaults.set``), nest, and are undone
at the end of the ``with`` block (blocks may end in any order, in any thread). Like
``kvikio.defaults.set``, ``override()`` checks its arguments and applies them at the call
(a bad name or value raises there, ``with`` or not); the ``with`` block is what takes them
back. Called without ``with``, its values stay until a later ``set()`` of the same
setting, :func:`reset`, or ``restore()`` on what it returned; a ``with`` block entered
later is above it while it lasts. Precedence: defaults < environment < ``set()`` <
``override()`` calls, the latest on top.

Requests already submitted keep the settings they were submitted with; a change of
vendor, threads, queue depth, chunk size, pool size, engine or an ``fmap_*`` setting
starts a new worker pool (with an empty file-mapping cache) for the requests that follow
(the old one finishes its work and exits).

A signal handler may read and change the settings (a checkpoint from SIGTERM), even
where it interrupts phoenix in the middle of a change; a child of ``os.fork()`` may too,
whichever thread of the parent was changing them.
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
import os
import threading
import weakref
from typing import NamedTuple

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


#: the values each integer setting takes, as its error messages say them
RANGES = {
    "threads": "between 1 and 1024",
    "queue_depth": "between 1 and 4096",
    "chunk_size": "a multiple of 4096 between 4K and 1G",
    "inflight": "0 (64 MiB per worker) or between 1M and 2**63-1 bytes",
    "bounce_pool_size": "auto (0) or between 1M and this machine's memory",
    "fmap_cache": "between 0 (off) and 2**63-1 bytes",
    "fmap_window": "a multiple of 2M between 2M and 2**63-1 bytes",
    "fmap_register_flags": "vendor or an unsigned 32-bit value (0 to 0xffffffff)",
}


def _integer(name: str, value, source: str) -> int:
    """An integer setting's value as written: a whole number, a size (64K, 16M, 2G) or, for
    ``fmap_register_flags``, a number in any base (0x9). A sign is read too, so that a
    negative value gets its range in the message rather than "not a number"."""
    what = {"threads": "an integer", "queue_depth": "an integer", "fmap_register_flags": "an integer (9, 0x9)"}
    what = what.get(name, "an integer or a size (4096, 64K, 16M, 2G)")
    bad = ValueError(f"{source}: {name}={value!r} is not {what}; it must be {RANGES[name]}")
    if isinstance(value, bool):  # (an int to Python: True would be 1 thread)
        raise bad
    if isinstance(value, float):
        if not value.is_integer():  # 2.5 threads was 2
            raise bad
        return int(value)
    if not isinstance(value, str):
        try:
            return operator.index(value)  # an int, a numpy integer
        except TypeError:
            raise bad from None
    text = value.strip()
    sign = -1 if text.startswith("-") else 1
    text = text[1:] if text[:1] in ("-", "+") else text
    try:
        n = int(text, 0) if name == "fmap_register_flags" else parse_size(text)
    except SizeTooLarge:
        if sign < 0:
            raise ValueError(f"{source}: {name}={value} must be {RANGES[name]}") from None
        raise ValueError(f"{source}: {name}={value} is past 2**63-1 bytes") from None
    except ValueError:
        raise bad from None
    return sign * n


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
            raise ValueError(
                f"{source}: fmap_idle={value!r} is not a number of seconds (30, 0.5, 0: never); "
                "it must be between 0 and 1e6"
            ) from None
        if not 0 <= secs <= 1e6:
            raise ValueError(f"{source}: fmap_idle={secs} must be between 0 (never) and 1e6 seconds")
        return secs
    if name == "bounce_pool_size" and isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    n = _integer(name, value, source)
    if name == "threads" and not 1 <= n <= 1024:
        raise ValueError(f"{source}: threads={n} must be {RANGES[name]}")
    if name == "queue_depth" and not 1 <= n <= 4096:
        raise ValueError(f"{source}: queue_depth={n} must be {RANGES[name]}")
    if name in ("inflight", "bounce_pool_size", "fmap_cache", "fmap_window") and n > I64_MAX:
        raise ValueError(f"{source}: {name}={n} is past 2**63-1 bytes")
    if name == "inflight" and n != 0 and not 1 << 20 <= n:
        raise ValueError(f"{source}: inflight={n} must be {RANGES[name]}")
    if name == "chunk_size" and (n < 4096 or n % 4096 or n > 1 << 30):
        raise ValueError(f"{source}: chunk_size={n} must be {RANGES[name]}")
    if name == "bounce_pool_size" and n != 0 and n < 1 << 20:
        raise ValueError(f"{source}: bounce_pool_size={n} must be {RANGES[name]}")
    if name == "fmap_cache" and n < 0:
        raise ValueError(f"{source}: fmap_cache={n} must be {RANGES[name]}")
    if name == "fmap_window" and (n < 2 << 20 or n % (2 << 20)):
        raise ValueError(f"{source}: fmap_window={n} must be {RANGES[name]}")
    if name == "fmap_register_flags" and not 0 <= n <= 0xFFFFFFFF:
        raise ValueError(f"{source}: fmap_register_flags={n} must be {RANGES[name]}")
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


# ---- the state: published whole, so that a signal handler may read and change it ----------
#
# Python runs a signal handler in the main thread between two bytecodes of whatever it was
# doing, phoenix's own code included: a handler that checkpoints through phoenix may land in
# the middle of a change here. So the state is one immutable value, read with one load (no
# lock for readers), and replaced with one assignment by writers that compute the new value
# first. Writers hold a reentrant lock (one thread at a time; the handler, in the thread it
# interrupted, gets it again) and publish only over the state they computed from: where a
# handler published in between, they compute again on top of its change.


class _Layer(NamedTuple):
    """One override()'s values in the stack; it belongs to the Override ``owner`` refers to."""

    owner: weakref.ref
    values: dict
    entered: bool  #: in force as a ``with`` block (False: applied by the call alone)

    def in_force(self) -> bool:
        # an entered block whose object is gone without an exit (a leaked __enter__()) is over,
        # as a generator-based context manager's block ended when it was collected
        return not self.entered or self.owner() is not None


class _State(NamedTuple):
    base: dict  #: set()'s values
    layers: tuple  #: override()s, oldest first


_state = _State({}, ())
_lock = threading.RLock()
_env_cache: tuple[tuple, dict] | None = None


def _reinit_after_fork() -> None:
    # a thread of the parent may have held the lock at fork(): in the child it never lets go
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reinit_after_fork)


def _publish(change) -> _State:
    """Replace the state with ``change(state)`` (which must not mutate its argument)."""
    global _state
    with _lock:
        while True:
            old = _state
            new = change(old)
            if _state is old:  # else a signal handler changed it meanwhile: redo over its change
                _state = new
                return new


def _plain(layer: _Layer) -> bool:
    """An override applied by its call alone whose object is gone: it can never be entered or
    restored, so it is process-wide like set()."""
    return not layer.entered and layer.owner() is None


def _compact(layers: tuple) -> tuple:
    """Drop ended blocks, and what a later plain override() call shadows for good in an earlier
    one (a loop of plain calls keeps one layer per setting, not one per call)."""
    out, later = [], builtins.set()
    for layer in reversed(layers):
        if not layer.in_force():
            continue
        if _plain(layer):
            values = {k: v for k, v in layer.values.items() if k not in later}
            later |= values.keys()
            if not values:
                continue
            layer = layer._replace(values=values)
        out.append(layer)
    return tuple(reversed(out))


def _merged(state: _State) -> dict:
    values = dict(state.base)
    for layer in state.layers:
        if layer.in_force():
            values.update(layer.values)
    return values


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
    """The effective settings now: defaults < environment < set() < override()s."""
    values = dict(DEFAULTS)
    values.update(_from_env())
    values.update(_merged(_state))
    return Settings(**values)


def effective(name: str):
    """One setting's effective value, checking only that one (a bad value elsewhere in the
    environment does not stop, say, the registry from resolving ``vendor``)."""
    if name not in DEFAULTS:
        raise TypeError(f"unknown setting {name!r}; known: {', '.join(DEFAULTS)}")
    values = _merged(_state)
    if name in values:
        return values[name]
    text = os.environ.get(ENV[name])
    if text is not None and text.strip() != "":
        return _check(name, text, f"environment {ENV[name]}")
    return DEFAULTS[name]


def source_of(name: str) -> str:
    """Where a setting's effective value comes from: override, set(), environment or default."""
    state = _state
    if any(name in layer.values for layer in state.layers if layer.in_force()):
        return "override"
    if name in state.base:
        return "set()"
    text = os.environ.get(ENV[name])
    return "environment" if text is not None and text.strip() != "" else "default"


def _validate(kwargs: dict, source: str) -> dict:
    unknown = builtins.set(kwargs) - builtins.set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}")
    return {k: _check(k, v, source) for k, v in kwargs.items()}


def _without(layers: tuple, names) -> tuple:
    """The layers with ``names`` gone from those not in force as a ``with`` block."""
    out = []
    for layer in layers:
        if not layer.entered:
            layer = layer._replace(values={k: v for k, v in layer.values.items() if k not in names})
        out.append(layer)
    return _compact(tuple(out))


def set(**kwargs) -> None:  # noqa: A001 (KvikIO's name)
    """Set values process-wide: above the environment, below ``with override(...)`` blocks in
    progress; it replaces what an earlier override() call without ``with`` gave them."""
    values = _validate(kwargs, "phoenix.settings.set")
    _publish(lambda st: _State({**st.base, **values}, _without(st.layers, values)))


def reset() -> None:
    """Forget set() values and those of override() calls made without ``with``
    (``with`` blocks in progress keep theirs until they end)."""
    _publish(lambda st: _State({}, _compact(tuple(layer for layer in st.layers if layer.entered))))


class Override:
    """What :func:`override` returns: its values are in force from the call on; as a context
    manager, until the ``with`` block ends (its ``as`` target: the settings then)."""

    def __init__(self, values: dict):
        self._values = values
        self._ref = weakref.ref(self)
        layer = _Layer(self._ref, values, False)
        _publish(lambda st: _State(st.base, _compact(st.layers) + (layer,)))

    def _mine(self, layer: _Layer) -> bool:
        return layer.owner is self._ref

    def __enter__(self) -> Settings:
        def change(st: _State) -> _State:
            if any(self._mine(layer) and layer.entered for layer in st.layers):
                raise RuntimeError("this override is in force in a with block already: make another override()")
            # on top, whole: a set() since the call may have taken some of its values
            others = tuple(layer for layer in st.layers if not self._mine(layer))
            return _State(st.base, _compact(others) + (_Layer(self._ref, self._values, True),))

        _publish(change)
        return get()

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Take these values back (what the end of a ``with`` block does): for an override()
        called without ``with``. Restoring twice, or one a set() replaced, does nothing."""
        _publish(lambda st: _State(st.base, tuple(layer for layer in st.layers if not self._mine(layer))))

    def __repr__(self) -> str:
        return f"phoenix.settings.override({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def override(**kwargs) -> Override:
    """``with override(threads=8, chunk_size="16M"): ...`` -- values for the block, then back.

    Checks its arguments and applies them at the call (a bad name or value raises here);
    called without ``with``, they stay (see the module's notes)."""
    return Override(_validate(kwargs, "phoenix.settings.override"))


def describe() -> list[dict]:
    """The table above as data (for ``phx info``): name, env var, effective value, source."""
    eff = get()
    return [
        {"name": name, "env": var, "value": getattr(eff, name), "source": source_of(name)} for name, var in ENV.items()
    ]
