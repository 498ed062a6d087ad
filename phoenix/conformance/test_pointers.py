"""Pointer queries: what an address is, which device, and the allocation that holds it."""

from __future__ import annotations

import numpy as np
import pytest

from phoenix.errors import VendorError
from phoenix.vendor import MemoryType, PointerInfo

from .plugin import MiB, addr

pytestmark = pytest.mark.capability("pointer_queries")


def info_of(rt, ptr: int) -> PointerInfo:
    info = rt.pointer_info(ptr)
    assert isinstance(info, PointerInfo), f"pointer_info({ptr:#x}) returned {info!r}, not a PointerInfo"
    return info


def check_device_extent(rt, base: int, size: int, device: int):
    """Every probe point of [base, base+size) names that allocation on that device."""
    for off in sorted({0, min(1, size - 1), size // 2, size - 1}):
        ptr = base + off
        info = info_of(rt, ptr)
        where = f"pointer_info(base + {off}) of a {size}-byte allocation on device {device}"
        assert info.type is MemoryType.DEVICE, f"{where}: type {info.type}"
        assert info.device == device, f"{where}: device {info.device}, expected {device}"
        assert info.base == base, f"{where}: base {info.base:#x}, expected {base:#x}"
        assert size <= info.size, f"{where}: size {info.size} < the {size} bytes allocated"
        assert info.base <= ptr < info.base + info.size, f"{where}: [{info.base:#x}, +{info.size}) misses it"


@pytest.mark.parametrize("size", [1, 4096, 3 * MiB + 17])
def test_device_memory(rt, mem, size):
    check_device_extent(rt, mem.dev(size), size, 0)


def test_neighbouring_allocations(rt, mem):
    """Each of many adjacent allocations reports itself, not a neighbour."""
    ptrs = [(mem.dev(4096 + 512 * i), 4096 + 512 * i) for i in range(16)]
    for ptr, size in ptrs:
        check_device_extent(rt, ptr, size, 0)


def test_one_past_the_end(rt, mem):
    size = 65536
    ptr = mem.dev(size)
    info = info_of(rt, ptr + size)
    assert info.type is not MemoryType.DEVICE or info.base != ptr, (
        f"the byte after a {size}-byte allocation is reported inside it: {info}"
    )


def test_device_memory_every_device(rt, mem, devices):
    for d in devices:
        size = 1 * MiB + 3 * d.ordinal + 1
        check_device_extent(rt, mem.dev(size, d.ordinal), size, d.ordinal)


def test_device_memory_second_device(rt, mem, two_devices):
    a, b = two_devices
    pa, pb = mem.dev(8192, a), mem.dev(8192, b)
    check_device_extent(rt, pa, 8192, a)
    check_device_extent(rt, pb, 8192, b)


def test_pinned_host_memory(rt, mem):
    size = 1 * MiB + 9
    ptr, _ = mem.pinned(size)
    for off in (0, 5, size - 1):
        info = info_of(rt, ptr + off)
        assert info.type is MemoryType.HOST_PINNED, f"pinned allocation + {off}: type {info.type}"
        assert info.base == ptr, f"pinned allocation + {off}: base {info.base:#x}, expected {ptr:#x}"
        assert size <= info.size, f"pinned allocation + {off}: size {info.size} < {size}"


def test_registered_host_memory(rt, mem):
    size = 2 * MiB + 100
    buf = np.zeros(size + 4096, dtype=np.uint8)
    start = addr(buf) + 1000
    rt.host_register(start, size)
    try:
        for off in (0, 1, size - 1):
            info = info_of(rt, start + off)
            assert info.type is MemoryType.HOST_PINNED, f"registered range + {off}: type {info.type}"
            assert info.base == start, f"registered range + {off}: base {info.base:#x}, expected {start:#x}"
            assert info.size == size, f"registered range + {off}: size {info.size}, registered {size}"
    finally:
        rt.host_unregister(start)
    info = info_of(rt, start)
    assert info.type is MemoryType.HOST, f"after host_unregister: {info}"


def test_plain_host_memory(rt):
    buf = np.zeros(65536, dtype=np.uint8)
    for ptr in (addr(buf), addr(buf) + 12345):
        info = info_of(rt, ptr)
        assert info.type is MemoryType.HOST, f"a numpy buffer is reported as {info.type}"
        assert info.base == ptr and info.size == 0, (
            f"plain host memory must give base = the pointer and size 0, got base {info.base:#x} size {info.size}"
        )


def test_freed_device_memory(rt):
    size = 65536
    ptr = rt.device_alloc(size)
    rt.device_free(ptr)
    for off in (0, size // 2):
        try:
            info = info_of(rt, ptr + off)
        except VendorError:
            continue  # refusing to describe it is fine too
        assert not (info.type is MemoryType.DEVICE and info.base == ptr), (
            f"freed device memory (+{off}) is still reported as the allocation: {info}"
        )


def test_unpinned_after_free(rt):
    ptr = rt.host_alloc_pinned(8192)
    rt.host_free_pinned(ptr)
    try:
        info = info_of(rt, ptr)
    except VendorError:
        return
    assert not (info.type is MemoryType.HOST_PINNED and info.base == ptr), (
        f"freed pinned memory is still reported as pinned: {info}"
    )
