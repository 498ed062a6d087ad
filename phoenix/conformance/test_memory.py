"""Device memory (alloc/free) and host memory (registration, pinned allocations)."""

from __future__ import annotations

import numpy as np
import pytest

from phoenix.errors import VendorError
from phoenix.vendor import MemoryType

from .plugin import D2H, H2D, MiB, addr, assert_bytes, random_bytes, read_device, write_device

memory = pytest.mark.capability("memory")
registration = pytest.mark.capability("host_registration")

SIZES = [1, 7, 255, 256, 4095, 4096, 4097, 65536, 1 * MiB + 3, 16 * MiB]


# -- device memory ---------------------------------------------------------------------


@memory
@pytest.mark.parametrize("size", SIZES)
def test_alloc_free(rt, size):
    ptr = rt.device_alloc(size)
    try:
        assert isinstance(ptr, int) and ptr != 0, f"device_alloc({size}) returned {ptr!r}"
        assert ptr % 256 == 0, f"device_alloc({size}) returned {ptr:#x}, not 256-byte aligned"
    finally:
        rt.device_free(ptr)


@memory
def test_allocation_holds_data(rt, mem, rng):
    """Every byte of an allocation can be written and read back (first and last included)."""
    n = 3 * MiB + 5
    ptr = mem.dev(n)
    data = random_bytes(rng, n)
    write_device(rt, ptr, data)
    assert_bytes(read_device(rt, ptr, n), data, "read back of a whole allocation")


@memory
def test_allocations_disjoint(rt, mem, rng):
    """Live allocations never overlap: writing one leaves the others intact."""
    sizes = [int(s) for s in rng.integers(1, 200_000, 40)]
    ptrs = [mem.dev(s) for s in sizes]
    spans = sorted((p, p + s) for p, s in zip(ptrs, sizes, strict=True))
    for (a0, a1), (b0, _) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0, f"allocations [{a0:#x}, {a1:#x}) and [{b0:#x}, ...) overlap"
    datas = [random_bytes(rng, s) for s in sizes]
    for p, d in zip(ptrs, datas, strict=True):
        write_device(rt, p, d)
    for i, (p, d) in enumerate(zip(ptrs, datas, strict=True)):
        assert_bytes(read_device(rt, p, d.size), d, f"allocation {i} ({d.size} bytes) after writing all")


@memory
def test_many_allocations(rt):
    """A thousand small allocations, all distinct and aligned, then all freed."""
    ptrs = []
    try:
        for i in range(1000):
            ptrs.append(rt.device_alloc(64 + i))
        assert len(set(ptrs)) == len(ptrs), "device_alloc returned the same address twice"
        assert all(p % 256 == 0 for p in ptrs), "an allocation is not 256-byte aligned"
    finally:
        errors = []
        for p in ptrs:
            try:
                rt.device_free(p)
            except VendorError as exc:
                errors.append(str(exc))
        assert not errors, f"{len(errors)} frees failed, first: {errors[0]}"


@memory
def test_free_returns_memory(rt, devices):
    """Alloc/free cycles of a large block do not run out: a free gives the memory back."""
    size = max(64 * MiB, devices[0].total_memory // 4)  # 8 cycles: twice the device when leaked
    size = min(size, 1 << 34)
    for _ in range(8):
        ptr = rt.device_alloc(size)
        rt.device_free(ptr)


@memory
def test_alloc_every_device(rt, mem, rng, devices):
    for d in devices:
        n = 1 * MiB + d.ordinal
        ptr = mem.dev(n, d.ordinal)
        data = random_bytes(rng, n)
        write_device(rt, ptr, data)
        assert_bytes(read_device(rt, ptr, n), data, f"allocation on device {d.ordinal}")


@memory
def test_alloc_on_second_device_is_there(rt, mem, two_devices):
    _, second = two_devices
    ptr = mem.dev(4096, second)
    info = rt.pointer_info(ptr)
    assert info.type is MemoryType.DEVICE and info.device == second, (
        f"device_alloc(device={second}) gave memory the runtime places as {info}"
    )


# -- host memory: registration and pinned allocations ----------------------------------


@registration
@pytest.mark.parametrize("size,offset", [(4096, 0), (1 * MiB, 0), (3 * MiB + 5, 100), (1, 17)])
def test_register_existing_memory(rt, mem, rng, size, offset):
    """Registered host memory is usable for copies both ways, then unregistered cleanly."""
    backing = np.zeros(size + offset + 64, dtype=np.uint8)
    buf = backing[offset : offset + size]
    ptr = addr(buf)
    rt.host_register(ptr, size)
    try:
        info = rt.pointer_info(ptr)
        assert info.type is MemoryType.HOST_PINNED, f"registered memory is reported as {info}"
        dev = mem.dev(size)
        data = random_bytes(rng, size)
        buf[:] = data
        rt.memcpy(dev, ptr, size, H2D)
        buf[:] = 0
        rt.memcpy(ptr, dev, size, D2H)
        assert_bytes(buf, data, "round trip through registered memory")
    finally:
        rt.host_unregister(ptr)
    info = rt.pointer_info(ptr)
    assert info.type is MemoryType.HOST, f"after host_unregister the memory is still reported as {info}"


@registration
def test_register_many(rt):
    bufs = [np.zeros(8192 + 64 * i, dtype=np.uint8) for i in range(64)]
    for b in bufs:
        rt.host_register(addr(b), b.nbytes)
    for b in bufs:
        rt.host_unregister(addr(b))


@registration
def test_double_registration_refused(rt):
    buf = np.zeros(65536, dtype=np.uint8)
    rt.host_register(addr(buf), buf.nbytes)
    try:
        with pytest.raises(VendorError):
            rt.host_register(addr(buf), buf.nbytes)
    finally:
        rt.host_unregister(addr(buf))


@registration
def test_overlapping_registration_refused(rt):
    buf = np.zeros(4 * 65536, dtype=np.uint8)
    rt.host_register(addr(buf) + 65536, 2 * 65536)
    try:
        with pytest.raises(VendorError):  # straddles the start of the registered range
            rt.host_register(addr(buf), 2 * 65536)
        with pytest.raises(VendorError):  # inside it
            rt.host_register(addr(buf) + 65536 + 4096, 4096)
    finally:
        rt.host_unregister(addr(buf) + 65536)


@registration
def test_register_zero_size_refused(rt):
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.host_register(addr(buf), 0)


@registration
def test_unregister_unknown_refused(rt):
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(VendorError):
        rt.host_unregister(addr(buf))


@registration
def test_unregister_twice_refused(rt):
    buf = np.zeros(4096, dtype=np.uint8)
    rt.host_register(addr(buf), buf.nbytes)
    rt.host_unregister(addr(buf))
    with pytest.raises(VendorError):
        rt.host_unregister(addr(buf))


@registration
def test_reregister_after_unregister(rt):
    buf = np.zeros(65536, dtype=np.uint8)
    for _ in range(3):
        rt.host_register(addr(buf), buf.nbytes)
        rt.host_unregister(addr(buf))


@registration
@pytest.mark.parametrize("size", [1, 4096, 1 * MiB + 1, 16 * MiB])
def test_pinned_alloc_free(rt, mem, rng, size):
    ptr, view = mem.pinned(size)
    assert ptr != 0
    info = rt.pointer_info(ptr)
    assert info.type is MemoryType.HOST_PINNED, f"host_alloc_pinned memory is reported as {info}"
    # it is host memory: the CPU writes it, and it copies to and from the device
    data = random_bytes(rng, size)
    view[:] = data
    dev = mem.dev(size)
    rt.memcpy(dev, ptr, size, H2D)
    view[:] = 0
    rt.memcpy(ptr, dev, size, D2H)
    assert_bytes(view, data, "round trip through pinned memory")


@registration
def test_pinned_zero_size_refused(rt):
    with pytest.raises(VendorError):
        rt.host_alloc_pinned(0)


@registration
def test_pinned_double_free_refused(rt):
    ptr = rt.host_alloc_pinned(4096)
    rt.host_free_pinned(ptr)
    with pytest.raises(VendorError):
        rt.host_free_pinned(ptr)


@registration
def test_pinned_free_of_device_memory_refused(rt, mem):
    dev = mem.dev(4096)
    with pytest.raises(VendorError):
        rt.host_free_pinned(dev)
