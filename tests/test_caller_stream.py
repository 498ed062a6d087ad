"""Ordering with the caller's stream, beyond the conformance capability (host vendor).

* A vendor whose data path has no events is still ordered: phoenix synchronizes the
  caller's stream before it submits, and ``capabilities()`` (``phx info``) says so.
* How the caller's stream is found: explicit handles and stream objects, the producer's
  stream of a ``__cuda_array_interface__``, the default stream for raw device memory, and
  nothing for host memory.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import phoenix.io as pio
from phoenix import buffers as pb
from phoenix import streams
from phoenix._testing import TEST_HOSTFN, TestHostFn
from phoenix.vendor import CopyKind


@pytest.fixture
def host_rt():
    from phoenix.registry import get_runtime

    return get_runtime("host")


class _NoEvents:
    """The host runtime with the events group left out of its data path (a port of a
    runtime without events)."""

    def __init__(self, rt):
        self._rt = rt

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def data_path(self):
        table = self._rt.data_path()
        for name in table.EVENTS:
            setattr(table, name, None)
        return table


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_a_vendor_without_events_is_synchronized(host_rt, tmp_path, mode):
    import phoenix.settings as ps

    rt = _NoEvents(host_rt)
    pio.use_runtime(rt)
    try:
        caps = pio.capabilities()
        assert caps["caller_stream"]["by"] == "synchronize" and "no events" in caps["caller_stream"]["why"]
        n = 300_000
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        path = tmp_path / "noevents.bin"
        data.tofile(path)
        dst = host_rt.device_alloc(n)
        poison = np.full(n, 0xA5, np.uint8)
        hold = TestHostFn(kind=3, size=100_000)  # hold the stream 100 ms
        s = host_rt.stream_create()
        try:
            with ps.override(mode=mode), pio.open(path) as f:
                for stream in (s, 0):
                    host_rt.launch_host_func(stream, TEST_HOSTFN, ctypes.addressof(hold))
                    host_rt.memcpy_async(dst, poison.ctypes.data, n, CopyKind.HOST_TO_DEVICE, stream)
                    assert (f.read((dst, n), stream=s) if stream else f.read((dst, n))) == n
                    host_rt.stream_synchronize(stream)
                    out = np.empty(n, np.uint8)
                    host_rt.memcpy(out.ctypes.data, dst, n, CopyKind.DEVICE_TO_HOST)
                    assert np.array_equal(out, data), f"stream {stream}: the read raced the queued copy"
        finally:
            host_rt.stream_destroy(s)
            host_rt.device_free(dst)
    finally:
        pio.shutdown()
        pio.use_runtime(None)


def test_events_are_reported(host_rt):
    pio.use_runtime(host_rt)
    try:
        assert pio.capabilities()["caller_stream"]["by"] == "events"
    finally:
        pio.use_runtime(None)


class _Cai:
    def __init__(self, ptr, n, stream="absent"):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1", "version": 3}
        if stream != "absent":
            self.__cuda_array_interface__["stream"] = stream


def test_how_the_callers_stream_is_found():
    class TorchLike:
        cuda_stream = 0x1234

    class CupyLike:
        ptr = 0x5678

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x9ABC)

    assert streams.handle(7) == 7
    assert streams.handle(TorchLike()) == 0x1234
    assert streams.handle(CupyLike()) == 0x5678
    assert streams.handle(Protocol()) == 0x9ABC
    assert streams.handle(ctypes.c_void_p(0x42)) == 0x42 and streams.handle(ctypes.c_void_p()) == 0
    assert streams.handle(np.uint64(99)) == 99
    for bad in (True, -1, 2**64, "0", 1.5, object()):
        with pytest.raises(TypeError):
            streams.handle(bad)
    # __cuda_array_interface__: 1 is the legacy default stream (the runtime's 0), absent: none named
    assert pb.adapt(_Cai(0x10000, 16, 1), writable=True).stream == 0
    assert pb.adapt(_Cai(0x10000, 16, 0xBEEF), writable=True).stream == 0xBEEF
    assert pb.adapt(_Cai(0x10000, 16, None), writable=True).stream is None
    assert pb.adapt(_Cai(0x10000, 16), writable=True).stream is None
    dev = pb.adapt(_Cai(0x10000, 16, 0xBEEF), writable=True)
    assert streams.caller_stream(dev, pb.MEM_DEVICE, None) == 0xBEEF
    assert streams.caller_stream(dev, pb.MEM_DEVICE, 5) == 5  # the call's own stream first
    raw = pb.adapt((0x10000, 16), writable=True)
    assert streams.caller_stream(raw, pb.MEM_DEVICE, None) == 0  # the default stream
    assert streams.caller_stream(raw, pb.MEM_HOST, None) is None  # host memory: not ordered
    assert streams.caller_stream(raw, pb.MEM_HOST, 5) == 5


def test_a_bad_stream_is_refused_before_anything_moves(host_rt, tmp_path):
    pio.use_runtime(host_rt)
    try:
        path = tmp_path / "bad.bin"
        np.arange(4096, dtype=np.uint8).tofile(path)
        dst = host_rt.device_alloc(4096)
        try:
            with pio.open(path) as f:
                with pytest.raises(pio.PhxIOError, match="cannot order with the caller's stream"):
                    f.read((dst, 4096), stream=0xDEAD0000)  # never created
                with pytest.raises(TypeError, match="stream"):
                    f.read((dst, 4096), stream="default")
        finally:
            host_rt.device_free(dst)
    finally:
        pio.shutdown()
        pio.use_runtime(None)
