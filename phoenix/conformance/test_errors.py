"""Errors: bad input gets a VendorError (or VendorNotImplemented), never a crash or a stray write.

A crash here ends the test process; ``phx-port test`` then records the test that
was running as failed ("crashed") and carries on with the rest in a new process.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from phoenix.errors import VendorError

from .plugin import D2D, D2H, H2D, H2H, POISON, addr, assert_bytes, read_device, write_device

pytestmark = pytest.mark.capability("errors")

ABSURD = 1 << 62


@pytest.fixture(scope="module")
def nowhere():
    """An address that is no one's allocation: a reserved PROT_NONE mapping (touching it faults)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 1 << 20
    ptr = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if ptr in (None, ctypes.c_void_p(-1).value):
        pytest.skip(f"cannot reserve an address range: errno {ctypes.get_errno()}")
    yield ptr
    libc.munmap(ptr, size)


def freed_device_pointer(rt, size: int = 65536) -> int:
    ptr = rt.device_alloc(size)
    rt.device_free(ptr)
    return ptr


# -- allocation --------------------------------------------------------------------------


def test_alloc_zero_size(rt):
    with pytest.raises(VendorError):
        rt.device_alloc(0)


def test_alloc_absurd_size(rt, devices):
    for size in (ABSURD, devices[0].total_memory * 64):
        with pytest.raises(VendorError):
            rt.device_alloc(size)
    # and the runtime is still fine afterwards
    rt.device_free(rt.device_alloc(4096))


def test_alloc_negative_size(rt):
    with pytest.raises((VendorError, ValueError, OverflowError)):
        rt.device_alloc(-1)


def test_alloc_bad_device(rt, devices):
    for bad in (len(devices), -1):
        with pytest.raises(VendorError):
            rt.device_alloc(4096, bad)


def test_pinned_absurd_size(rt):
    with pytest.raises(VendorError):
        rt.host_alloc_pinned(ABSURD)


def test_double_free(rt):
    ptr = rt.device_alloc(4096)
    rt.device_free(ptr)
    with pytest.raises(VendorError):
        rt.device_free(ptr)


def test_free_interior_pointer(rt, mem):
    ptr = mem.dev(8192)
    with pytest.raises(VendorError):
        rt.device_free(ptr + 256)


def test_free_never_allocated(rt, nowhere):
    buf = np.zeros(4096, dtype=np.uint8)
    for ptr in (addr(buf), nowhere):
        with pytest.raises(VendorError):
            rt.device_free(ptr)


def test_free_pinned_memory_as_device(rt, mem):
    ptr, _ = mem.pinned(4096)
    with pytest.raises(VendorError):
        rt.device_free(ptr)


# -- copies with bad pointers -------------------------------------------------------------


def test_copy_to_freed_device_memory(rt):
    dead = freed_device_pointer(rt)
    host = np.ones(4096, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.memcpy(dead, addr(host), host.nbytes, H2D)


def test_copy_from_freed_device_memory(rt):
    dead = freed_device_pointer(rt)
    host = np.full(4096, POISON, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.memcpy(addr(host), dead, host.nbytes, D2H)
    assert_bytes(host, np.full(4096, POISON, np.uint8), "host buffer after a refused copy")


def test_copy_device_to_device_freed(rt, mem):
    live = mem.dev(4096)  # first: a runtime may hand a freed address out again at once
    dead = freed_device_pointer(rt)
    with pytest.raises(VendorError):
        rt.memcpy(live, dead, 4096, D2D)
    with pytest.raises(VendorError):
        rt.memcpy(dead, live, 4096, D2D)


def test_copy_to_unallocated_address(rt, nowhere):
    host = np.ones(4096, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.memcpy(nowhere, addr(host), host.nbytes, H2D)
    with pytest.raises(VendorError):
        rt.memcpy(addr(host), nowhere, host.nbytes, D2H)


def test_copy_null_pointer(rt, mem):
    dev = mem.dev(4096)
    host = np.ones(4096, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.memcpy(0, addr(host), 4096, H2D)
    with pytest.raises(VendorError):
        rt.memcpy(addr(host), 0, 4096, D2H)
    with pytest.raises(VendorError):
        rt.memcpy(dev, 0, 4096, D2D)


def test_async_copy_argument_errors_raised_at_once(rt, mem):
    """An async copy with a freed pointer is refused at the call, not at synchronize."""
    s = mem.stream()
    dead = freed_device_pointer(rt)
    host = mem.keep(np.ones(4096, dtype=np.uint8))
    with pytest.raises(VendorError):
        rt.memcpy_async(dead, addr(host), 4096, H2D, s)
    with pytest.raises(VendorError):
        rt.memcpy_async(addr(host), dead, 4096, D2H, s)
    rt.stream_synchronize(s)  # and the stream is still usable


def test_absurd_copy_size(rt, mem):
    dev = mem.dev(4096)
    host = np.full(4096, POISON, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.memcpy(dev, addr(host), ABSURD, H2D)
    with pytest.raises(VendorError):
        rt.memcpy(addr(host), dev, ABSURD, D2H)
    assert_bytes(host, np.full(4096, POISON, np.uint8), "host buffer after a refused copy")


# -- copies in the wrong direction ---------------------------------------------------------


def test_wrong_direction(rt, mem):
    """Each kind names the memory on each side; a pointer of the other kind is refused."""
    dev = mem.dev(4096)
    dev2 = mem.dev(4096)
    host = np.ones(4096, dtype=np.uint8)
    host2 = np.zeros(4096, dtype=np.uint8)
    write_device(rt, dev, np.full(4096, 0x42, np.uint8))
    cases = [
        ("H2D with a host destination", addr(host2), addr(host), H2D),
        ("H2D with a device source", dev2, dev, H2D),
        ("D2H with a device destination", dev2, dev, D2H),
        ("D2H with a host source", addr(host2), addr(host), D2H),
        ("D2D with a host destination", addr(host2), dev, D2D),
        ("D2D with a host source", dev, addr(host), D2D),
        ("H2H with a device destination", dev2, addr(host), H2H),
        ("H2H with a device source", addr(host2), dev, H2H),
    ]
    accepted = []
    for what, dst, src, kind in cases:
        try:
            rt.memcpy(dst, src, 4096, kind)
            accepted.append(what)
        except VendorError:
            pass
    assert not accepted, f"copies in the wrong direction were accepted: {'; '.join(accepted)}"
    assert_bytes(host2, np.zeros(4096, np.uint8), "host buffer after refused copies")
    assert_bytes(read_device(rt, dev, 4096), np.full(4096, 0x42, np.uint8), "device buffer after refused copies")


def test_wrong_direction_async(rt, mem):
    s = mem.stream()
    dev = mem.dev(4096)
    host = mem.keep(np.ones(4096, dtype=np.uint8))
    with pytest.raises(VendorError):
        rt.memcpy_async(addr(host), addr(host), 4096, H2D, s)
    with pytest.raises(VendorError):
        rt.memcpy_async(dev, dev, 4096, D2H, s)
    rt.stream_synchronize(s)


def test_invalid_copy_kind(rt, mem):
    dev = mem.dev(4096)
    host = np.ones(4096, dtype=np.uint8)
    with pytest.raises((VendorError, ValueError)):
        rt.memcpy(dev, addr(host), 4096, 7)


# -- streams -----------------------------------------------------------------------------------


def test_destroyed_stream(rt, mem, chelper):
    s = rt.stream_create()
    rt.stream_destroy(s)
    dev = mem.dev(4096)
    host = mem.keep(np.ones(4096, dtype=np.uint8))
    task = chelper.task()
    with pytest.raises(VendorError):
        rt.stream_synchronize(s)
    with pytest.raises(VendorError):
        rt.memcpy_async(dev, addr(host), 4096, H2D, s)
    with pytest.raises(VendorError):
        rt.launch_host_func(s, chelper.fn, task.address)
    with pytest.raises(VendorError):
        rt.stream_destroy(s)
    assert task.calls == 0, "a callback launched on a destroyed stream ran"


def test_never_created_stream(rt):
    if not getattr(rt, "stream_handles_validated", True):
        pytest.skip(
            f"{rt.name}'s stream handles are pointers: a made-up one cannot be validated (as in CUDA); "
            "streams destroyed through the port are refused (test_destroyed_stream)"
        )
    bogus = 0x5EED_0000_1234
    with pytest.raises(VendorError):
        rt.stream_synchronize(bogus)
    with pytest.raises(VendorError):
        rt.stream_destroy(bogus)


def test_stream_bad_device(rt, devices):
    with pytest.raises(VendorError):
        rt.stream_create(len(devices))


def test_launch_null_function(rt, mem):
    s = mem.stream()
    with pytest.raises(VendorError):
        rt.launch_host_func(s, 0, 0)
    rt.stream_synchronize(s)


def test_runtime_usable_after_errors(rt, mem, rng):
    """After every refusal above, ordinary work still succeeds."""
    n = 1 << 20
    dev = mem.dev(n)
    data = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
    write_device(rt, dev, data)
    assert_bytes(read_device(rt, dev, n), data, "a round trip after the error tests")
