"""Engines: the vendor's runtime bound to the C core, one context per settings and runtime.

Core side, control plane. An engine is one C context (``phx_ctx``): a worker pool, a
bounce pool and the vendor's data-path table, built from the settings a request is
submitted with (:func:`make_config`) and the runtime the ``vendor`` setting selects
(:func:`phoenix.registry.resolve`). Requests, futures and stream ops hold their engine;
a change of settings or runtime starts a new one and the old one goes when the last of
them does. Here too: :func:`prepare`, :func:`shutdown`, and what a forked child does.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref

from . import registry as _registry
from . import settings as _settings
from ._abi import (
    CFG_CALLBACKS,
    CFG_CPU_COPIES,
    CFG_NO_FIXED_BUFFERS,
    CFG_POLL_STEPS,
    ENGINE,
    ENGINE_NAME,
    FMAP_MODE,
    _Config,
    _lib,
)
from ._core import calls as _bound_calls
from ._futures import _prune_stream_ops
from .errors import PhxIOError

_calls = _bound_calls()  # phoenix._phxcalls, bound to the C core

# ---- the vendor runtime and the settings it is applied with ------------------------------


def use_runtime(runtime) -> None:
    """Use this :class:`~phoenix.vendor.VendorRuntime` (None: back to the ``vendor`` setting).

    A thin wrapper over the ``vendor`` setting (:func:`phoenix.registry.use_runtime`),
    kept for tests and for programs that build or wrap their runtime themselves; otherwise
    select the vendor with ``PHX_VENDOR`` or ``phoenix.settings.override(vendor=...)``.
    """
    _registry.use_runtime(runtime)


def _runtime(s: _settings.Settings | None = None):
    """The runtime of the ``vendor`` setting (``s``'s, else the current one); None when
    ``auto`` finds no vendor that can serve: host memory still works. A vendor named
    explicitly that cannot serve raises, saying why (:func:`phoenix.registry.runtime_for_io`)."""
    vendor = s.vendor if s is not None else _settings.effective("vendor")
    return _registry.runtime_for_io(vendor)


def fmap_register_flags(s: _settings.Settings, runtime) -> int:
    """The host_register flags of page-cache mappings: the setting's number, or for
    ``vendor`` (the default) the vendor's registration flags with its read-only flag."""
    flags = s.fmap_register_flags
    if flags != "vendor":
        return flags
    if runtime is None:
        return 0
    return runtime.host_register_flags | runtime.host_register_read_only_flag


def make_config(s: _settings.Settings, runtime=None) -> _Config:
    """``struct phx_io_config`` for a set of settings and the runtime they are applied
    with (every context is built from one)."""
    flags = CFG_CPU_COPIES if runtime is not None and getattr(runtime, "is_test_double", False) else 0
    flags |= 0 if s.fixed_buffers else CFG_NO_FIXED_BUFFERS
    flags |= CFG_CALLBACKS if s.copy_completion == "callback" else 0
    flags |= CFG_POLL_STEPS if s.copy_completion == "steps" else 0
    return _Config(
        s.threads,
        s.queue_depth,
        s.chunk_size,
        s.bounce_pool_size,
        ENGINE[s.engine],
        FMAP_MODE[s.fmap_mode],
        s.fmap_cache,
        s.fmap_window,
        fmap_register_flags(s, runtime),
        flags,
        int(s.fmap_idle * 1e9),
        s.inflight,
    )


# ---- engines (C contexts) ---------------------------------------------------------------------


class _Engine:
    """One C context: a worker pool, a bounce pool and the vendor's data-path table.

    Built for one set of pool settings and one runtime; replaced when either changes.
    Requests, futures and stream ops hold a reference; the context is destroyed (after
    its I/O drains) when the last reference goes, or by :func:`shutdown`. The context is
    owned by a C gate (``phoenix._phxcalls.Gate``) made in the same C call that creates
    it: a call into the context holds the gate (:func:`_using_engine`), closing waits for
    those calls, and an interrupted construction leaves nothing behind.
    """

    def __init__(self, s: _settings.Settings, runtime):
        self.key = s.pool_key() + (id(runtime),)
        self.runtime = runtime
        self.settings = s
        dp = None
        if runtime is not None:
            try:
                dp = runtime.data_path()
            except NotImplementedError:  # a port without a data path still reads into host memory
                dp = None
            # (any other exception, a signal handler's included, propagates: no engine is made)
        if dp is not None and dp.missing():
            dp = None  # staged and stream-ordered I/O will say ENODEV
        self._dp = dp
        cfg = make_config(s, runtime)
        gate = _calls.ctx_open(
            ctypes.addressof(cfg), ctypes.addressof(dp) if dp is not None else 0, "the I/O engine was shut down"
        )
        if isinstance(gate, int):
            why = ctypes.create_string_buffer(256)
            _lib.phx_engine_probe(ENGINE[s.engine], why, len(why))
            raise PhxIOError(-gate, None, 0, 0, f"cannot start the I/O engine {s.engine!r} ({why.value.decode()})")
        self._gate = gate
        self.handle = gate.value
        why = ctypes.create_string_buffer(256)
        self.engine = ENGINE_NAME.get(_lib.phx_ctx_engine(self.handle, why, len(why)), "?")
        self.engine_why = why.value.decode()
        _all_engines.add(self)

    @property
    def has_data_path(self) -> bool:
        return self._dp is not None

    @property
    def usable(self) -> bool:
        return not self._gate.closed and not self._gate.inherited

    @property
    def users(self) -> int:
        """Threads inside a call into the context now."""
        return self._gate.users

    def close(self) -> None:
        """Destroy now: waits (in C) for the threads calling into it, then for the
        context's requests and stream ops."""
        self._gate.close()


_engine_lock = threading.RLock()  # reentrant: a signal handler may do I/O while it is held
_engine: _Engine | None = None
_exiting = False  # set by the interpreter's exit: no engine is made after it
#: every engine not destroyed yet: the current one, and retired ones that a future, a
#: stream op (or a traceback holding either) still references
_all_engines: weakref.WeakSet = weakref.WeakSet()


def _current_engine(s: _settings.Settings | None = None) -> _Engine:
    global _engine
    s = s or _settings.get()
    rt = _runtime(s)
    key = s.pool_key() + (id(rt),)
    e = _engine
    if e is not None and e.key == key and e.usable:
        return e
    with _engine_lock:
        e = _engine
        if e is None or e.key != key or not e.usable:
            if _exiting:
                raise RuntimeError("phoenix: the interpreter is exiting; no I/O is started any more")
            # the old engine stays alive while its requests hold it, then goes
            e = _Engine(s, rt)
            _engine = e
    return e


def _pick_engine(s: _settings.Settings | None):
    e = _current_engine(s)
    return e._gate, e  # (made per call: an engine must not reference itself)


def _using_engine(s: _settings.Settings | None = None):
    """``with _using_engine(s) as engine:`` the current engine, held for the block
    (shutdown() in another thread waits); entered and left in C."""
    return _calls.Hold(_pick_engine, s)


def prepare() -> dict:
    """Start the worker pool for the current settings and pin its whole bounce pool now.

    Otherwise both happen on the first I/O that needs them. Pinning goes through the
    vendor (cudaHostRegister on CUDA), which the runtime may serialize behind busy
    streams: an application that holds streams with callbacks of its own (or that must
    not stall at its first read) calls this at start-up, before stream-ordered I/O.
    Returns ``{"engine", "bounce_bytes"}``.
    """
    with _using_engine() as e:
        n = _lib.phx_ctx_prepare(e.handle)
    if n < 0:
        raise PhxIOError(-n, None, 0, 0, "prepare: pinning the bounce pool")
    return {"engine": e.engine, "bounce_bytes": int(n)}


def shutdown() -> None:
    """Stop every worker pool and free the bounce pools now (waits for in-flight I/O).

    The next I/O starts a new pool. Registrations and open files stay. Futures and
    stream ops of the stopped pools stay valid (they do not use the pool once done).
    """
    global _engine
    _prune_stream_ops(wait=True)
    with _engine_lock:
        _engine = None
        engines = list(_all_engines)
    for e in engines:
        e.close()


def _shutdown_at_exit() -> None:
    # Threads still doing I/O (daemon threads) get "exiting" for their next call instead of
    # a new engine, and each context is destroyed once the calls inside it have left, here,
    # before the interpreter tears modules down.
    global _exiting
    _exiting = True
    shutdown()


atexit.register(_shutdown_at_exit)


def _after_fork_in_child() -> None:
    # The workers are threads of the parent: the child starts a pool of its own on its
    # first I/O. The parent's contexts are left alone (their gates know they are the
    # parent's: destroying one would wait for threads that do not exist here).
    global _engine, _engine_lock
    _engine_lock = threading.RLock()
    _all_engines.clear()
    _engine = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _each_live_engine(fn) -> list:
    """fn(engine) for every engine not closing, each held meanwhile."""
    with _engine_lock:
        engines = list(_all_engines)
    out = []
    for e in engines:
        with _calls.Hold(_pick_if_usable, e) as held:
            if held is not None:
                out.append(fn(held))
    return out


def _pick_if_usable(e: _Engine):
    return (e._gate, e) if e.usable else None
