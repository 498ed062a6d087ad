"""The C core's ABI as Python sees it: ``phoenix/csrc/phx_io.h`` mirrored in ctypes, bound once.

Core side, control plane: the structures, constants and prototypes every other I/O
module uses to call the core; the data path itself (chunks, completions, stream
callbacks) runs in C behind these functions, without the GIL. A field or a prototype
changed in ``phx_io.h`` is changed here, and nowhere else in Python.
"""

from __future__ import annotations

import ctypes
import os

from ._core import core

OP_READ, OP_WRITE = 0, 1
MODE = {"auto": 0, "staged": 1, "direct": 2}
ENGINE = {"auto": 0, "io_uring": 1, "threads": 2}
ENGINE_NAME = {1: "io_uring", 2: "threads"}
FMAP_MODE = {"auto": 0, "off": 1, "sync": 2}
FMAP_MODE_NAME = {v: k for k, v in FMAP_MODE.items()}
F_READ, F_WRITE, F_CREATE, F_TRUNC, F_EXCL, F_SYNC = 1, 2, 4, 8, 16, 32
DIRECT_OFF, DIRECT_ON, DIRECT_AUTO = 0, 1, -1
MEM_NAME = {0: "host", 1: "device", 2: "device (direct-capable)"}


class _Config(ctypes.Structure):
    _fields_ = [
        ("threads", ctypes.c_uint32),
        ("queue_depth", ctypes.c_uint32),
        ("chunk_size", ctypes.c_uint64),
        ("bounce_pool_size", ctypes.c_uint64),
        ("engine", ctypes.c_int32),
        ("fmap_mode", ctypes.c_int32),
        ("fmap_budget", ctypes.c_uint64),
        ("fmap_window", ctypes.c_uint64),
        ("fmap_register_flags", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("fmap_idle_ns", ctypes.c_uint64),
        ("inflight", ctypes.c_uint64),
    ]


CFG_CPU_COPIES = 1  # PHX_CFG_CPU_COPIES: the vendor's copies are CPU copies (test doubles)
CFG_NO_FIXED_BUFFERS = 2  # PHX_CFG_NO_FIXED_BUFFERS: the rings do not register the bounce pool
CFG_CALLBACKS = 4  # PHX_CFG_CALLBACKS: copies' completions by host callbacks, never by polling events
CFG_POLL_STEPS = 8  # PHX_CFG_POLL_STEPS: polled, in doubled steps, not at writes' predicted ends


class _FmapInfo(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_int32),
        ("register_flags", ctypes.c_uint32),
        ("budget", ctypes.c_uint64),
        ("window", ctypes.c_uint64),
        ("windows", ctypes.c_int64),
        ("bytes", ctypes.c_int64),
        ("pending", ctypes.c_int64),
        ("unregistrable", ctypes.c_int64),
        ("in_use", ctypes.c_int64),
        ("hits", ctypes.c_int64),
        ("misses", ctypes.c_int64),
        ("registrations", ctypes.c_int64),
        ("evictions", ctypes.c_int64),
        ("invalidations", ctypes.c_int64),
        ("why", ctypes.c_char * 160),
        ("idle_ns", ctypes.c_uint64),
        ("pinned", ctypes.c_int64),
        ("idle_releases", ctypes.c_int64),
        ("pressure_releases", ctypes.c_int64),
        ("pressure", ctypes.c_char * 96),
    ]


class _Desc(ctypes.Structure):
    _fields_ = [
        ("file", ctypes.c_void_p),
        ("addr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("file_offset", ctypes.c_int64),
        ("op", ctypes.c_int32),
        ("mem", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("after", ctypes.c_void_p),  # phx_fence *: the caller's stream point to wait for
        ("priority", ctypes.c_int32),  # enum phx_priority: 0 normal, 1 background
        ("flags", ctypes.c_int32),  # PHX_IO_OWNED_MEMORY: host memory of an object held (memcpy)
    ]


PHX_IO_OWNED_MEMORY = 1


class _FileInfo(ctypes.Structure):
    _fields_ = [
        ("direct", ctypes.c_int32),
        ("dio_offset_align", ctypes.c_uint32),
        ("dio_mem_align", ctypes.c_uint32),
        ("fd_direct", ctypes.c_int32),
        ("fd_buffered", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
        ("known_size", ctypes.c_int64),
        ("why", ctypes.c_char * 160),
    ]


class _RegInfo(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("mem", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("refs", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
    ]


def _stat_fields() -> tuple[str, ...]:
    """The counters of ``struct phx_io_stats`` in order, as the core names them (the list
    is written once, in phx_io.h's PHX_IO_STATS)."""
    fn = core().phx_io_stats_fields
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    return tuple(name for name in fn().decode().split(",") if name)


_STAT_FIELDS = _stat_fields()


class _Sizes(ctypes.Structure):
    _fields_ = [
        ("bounce_pool", ctypes.c_uint64),
        ("chunk", ctypes.c_uint64),
        ("staged_chunk", ctypes.c_uint64),
        ("max_slot", ctypes.c_uint64),
        ("worker_bytes", ctypes.c_uint64),
    ]


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in _STAT_FIELDS]


_P = ctypes.c_void_p


def _bind():
    lib = core()
    protos = {
        "phx_engine_probe": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
        "phx_ctx_create": (ctypes.c_int, [ctypes.POINTER(_Config), _P, ctypes.POINTER(_P)]),
        "phx_ctx_engine": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t]),
        "phx_ctx_destroy": (None, [_P]),
        "phx_ctx_prepare": (ctypes.c_int64, [_P]),
        "phx_file_open": (
            ctypes.c_int,
            [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)],
        ),
        "phx_file_from_fd": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P)]),
        "phx_file_close": (ctypes.c_int, [_P]),
        "phx_file_fsync": (ctypes.c_int, [_P]),
        "phx_file_size": (ctypes.c_int64, [_P]),
        "phx_file_query": (ctypes.c_int, [_P, ctypes.POINTER(_FileInfo)]),
        "phx_cache_probe_works": (ctypes.c_int, [_P]),
        "phx_submit": (ctypes.c_int, [_P, ctypes.POINTER(_Desc), ctypes.c_uint32, ctypes.POINTER(_P)]),
        "phx_req_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_req_done": (ctypes.c_int, [_P]),
        "phx_req_result": (ctypes.c_int64, [_P]),
        "phx_req_error_extent": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint64)]),
        "phx_req_release": (None, [_P]),
        "phx_req_wait_all": (
            ctypes.c_int,
            [ctypes.POINTER(_P), ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64],
        ),
        "phx_req_release_all": (None, [ctypes.POINTER(_P), ctypes.c_uint32]),
        "phx_stream_io": (
            ctypes.c_int,
            [_P, ctypes.POINTER(_Desc), _P, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(_P)],
        ),
        "phx_sop_done": (ctypes.c_int, [_P]),
        "phx_sop_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_sop_result": (ctypes.c_int64, [_P]),
        "phx_sop_release": (None, [_P]),
        "phx_reg_add": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]),
        "phx_reg_remove": (ctypes.c_int, [ctypes.c_uint64]),
        "phx_reg_lookup": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(_RegInfo)]),
        "phx_reg_clear": (ctypes.c_int, []),
        "phx_mem_probe": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64]),
        "phx_fmap_query": (ctypes.c_int, [_P, ctypes.POINTER(_FmapInfo)]),
        "phx_fmap_lookup": (ctypes.c_int, [_P, _P, ctypes.c_int64, ctypes.c_uint64, ctypes.POINTER(_P)]),
        "phx_fmap_wait": (ctypes.c_int, [_P, ctypes.c_int64]),
        "phx_fmap_clear": (ctypes.c_int, [_P]),
        "phx_fmap_simulate_pressure": (ctypes.c_int, [_P]),  # test hook (phx_testing.h)
        "phx_io_get_stats": (None, [ctypes.POINTER(_Stats)]),
        "phx_fence_record": (ctypes.c_int, [_P, ctypes.c_int, _P, ctypes.POINTER(_P)]),
        "phx_fence_release": (None, [_P]),
        "phx_ctx_ordering": (ctypes.c_int, [_P]),
        "phx_ctx_sizes": (ctypes.c_int, [_P, ctypes.POINTER(_Sizes)]),
    }
    for name, (res, args) in protos.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


_lib = _bind()


def _strerror(rc: int) -> str:
    return os.strerror(-rc) if rc < 0 else "ok"


def _desc_dtype():
    """``struct phx_io_desc`` as a NumPy record: read_many / write_many build descriptors in bulk."""
    import numpy as np

    dt = np.dtype(
        {
            "names": [f for f, _ in _Desc._fields_],
            "formats": ["<u8", "<u8", "<u8", "<i8", "<i4", "<i4", "<i4", "<i4", "<u8", "<i4", "<i4"],
            "offsets": [getattr(_Desc, f).offset for f, _ in _Desc._fields_],
            "itemsize": ctypes.sizeof(_Desc),
        }
    )
    return dt


_DESC_DTYPE = _desc_dtype()
