"""Copies in the four typed directions, synchronous and on a stream, every byte checked.

Each copy moves ``size`` bytes from a random offset of a source buffer (filled with
random bytes throughout) to a random offset of a destination buffer poisoned before
the copy. Afterwards the WHOLE destination is compared: the extent must hold the
source bytes and every byte around it must still be poison, so a dropped last byte
and a byte written past the end are both caught. Random data never contains a
poison value, so no unwritten byte can pass by chance. Device buffers are read back
through a device-to-host copy into a buffer poisoned with another value.
"""

from __future__ import annotations

import numpy as np
import pytest

from phoenix.vendor import CopyKind

from .plugin import D2D, D2H, H2D, H2H, POISON, KiB, MiB, addr, assert_bytes, fill_device, read_device, write_device

pytestmark = pytest.mark.capability("copies")

DIRECTIONS = {"h2d": H2D, "d2h": D2H, "d2d": D2D, "h2h": H2H}
SIZES = [1, 2, 3, 255, 256, 257, 4095, 4096, 4097, 65535, 65536 + 7, 1 * MiB + 13, 16 * MiB - 1]
BIG = 64 * MiB


class Side:
    """One end of a copy: a buffer of ``total`` bytes in device, pageable, pinned or registered memory."""

    def __init__(self, rt, mem, where: str, total: int, device: int = 0):
        self.rt, self.where, self.total = rt, where, total
        if where == "device":
            self.ptr = mem.dev(total, device)
            self.view = None
        elif where == "pinned":
            self.ptr, self.view = mem.pinned(total)
        elif where == "registered":
            self.view = mem.keep(np.empty(total, dtype=np.uint8))
            self.ptr = mem.register(self.view)
        else:  # pageable
            self.view = mem.keep(np.empty(total, dtype=np.uint8))
            self.ptr = addr(self.view)

    def fill(self, data: np.ndarray):
        if self.view is None:
            write_device(self.rt, self.ptr, data)
        else:
            self.view[:] = data

    def poison(self):
        if self.view is None:
            fill_device(self.rt, self.ptr, self.total, POISON)
        else:
            self.view[:] = POISON

    def contents(self) -> np.ndarray:
        return read_device(self.rt, self.ptr, self.total) if self.view is None else self.view.copy()


def check_copy(
    rt,
    mem,
    rng,
    pool,
    kind: CopyKind,
    size: int,
    *,
    stream_mode: str,
    host: str = "pageable",
    src_device: int = 0,
    dst_device: int = 0,
    stream_device: int = 0,
):
    """Copy ``size`` bytes between random offsets in direction ``kind``; check every byte."""
    soff, doff = (int(x) for x in rng.integers(0, 4 * KiB, 2))
    tail = int(rng.integers(1, 4 * KiB))  # guard bytes after the extent, at least one
    src_where = "device" if kind in (D2H, D2D) else host
    dst_where = "device" if kind in (H2D, D2D) else host
    src = Side(rt, mem, src_where, soff + size + tail, src_device)
    dst = Side(rt, mem, dst_where, doff + size + tail, dst_device)
    start = int(rng.integers(0, pool.size - src.total + 1))
    src_data = pool[start : start + src.total]
    src.fill(src_data)
    dst.poison()

    if stream_mode == "sync":
        rt.memcpy(dst.ptr + doff, src.ptr + soff, size, kind)
    else:
        stream = 0 if stream_mode == "default" else mem.stream(stream_device)
        rt.memcpy_async(dst.ptr + doff, src.ptr + soff, size, kind, stream)
        rt.stream_synchronize(stream)

    expected = np.full(dst.total, POISON, dtype=np.uint8)
    expected[doff : doff + size] = src_data[soff : soff + size]
    what = (
        f"{kind.name} {stream_mode} copy of {size} bytes ({src_where} +{soff} -> {dst_where} +{doff}, "
        f"destination {dst.total} bytes, poison 0x{POISON:02x})"
    )
    assert_bytes(dst.contents(), expected, what)
    assert_bytes(src.contents(), src_data, f"{what}: source after the copy")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_copy_sync(rt, mem, rng, random_pool, direction, size):
    check_copy(rt, mem, rng, random_pool, DIRECTIONS[direction], size, stream_mode="sync")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_copy_on_stream(rt, mem, rng, random_pool, direction, size):
    # the data path's shape: pinned host memory, copies queued on a stream
    check_copy(rt, mem, rng, random_pool, DIRECTIONS[direction], size, stream_mode="stream", host="pinned")


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_copy_sync_64mib(rt, mem, rng, big_random_pool, direction):
    check_copy(rt, mem, rng, big_random_pool, DIRECTIONS[direction], BIG, stream_mode="sync")


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copy_on_stream_64mib(rt, mem, rng, big_random_pool, direction):
    check_copy(rt, mem, rng, big_random_pool, DIRECTIONS[direction], BIG, stream_mode="stream", host="pinned")


@pytest.mark.parametrize("host", ["pageable", "pinned", "registered"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_copy_host_memory_kinds(rt, mem, rng, random_pool, host, direction, mode):
    for size in (4097, 1 * MiB + 1):
        check_copy(rt, mem, rng, random_pool, DIRECTIONS[direction], size, stream_mode=mode, host=host)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_copy_default_stream(rt, mem, rng, random_pool, direction):
    """Stream handle 0 is the default stream (the contract's handles: 0 for the default)."""
    check_copy(rt, mem, rng, random_pool, DIRECTIONS[direction], 65536 + 3, stream_mode="default", host="pinned")


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_copy_zero_bytes_is_noop(rt, mem, direction):
    kind = DIRECTIONS[direction]
    src = Side(rt, mem, "device" if kind in (D2H, D2D) else "pinned", 4096)
    dst = Side(rt, mem, "device" if kind in (H2D, D2D) else "pinned", 4096)
    src.fill(np.arange(4096, dtype=np.uint32).astype(np.uint8))
    dst.poison()
    rt.memcpy(dst.ptr, src.ptr, 0, kind)
    s = mem.stream()
    rt.memcpy_async(dst.ptr, src.ptr, 0, kind, s)
    rt.stream_synchronize(s)
    assert_bytes(dst.contents(), np.full(4096, POISON, np.uint8), f"{kind.name} copy of 0 bytes")


def test_copy_within_one_allocation(rt, mem, rng, random_pool):
    """Device-to-device between two disjoint parts of the same allocation."""
    n = 1 * MiB
    buf = mem.dev(3 * n)
    data = random_pool[: 3 * n].copy()
    write_device(rt, buf, data)
    rt.memcpy(buf + 2 * n, buf, n, D2D)
    expected = data.copy()
    expected[2 * n :] = data[:n]
    assert_bytes(read_device(rt, buf, 3 * n), expected, "D2D copy inside one allocation")


def test_copies_on_every_device(rt, mem, rng, random_pool, devices):
    for d in devices:
        for kind in (H2D, D2H, D2D):
            for mode in ("sync", "stream"):
                check_copy(
                    rt,
                    mem,
                    rng,
                    random_pool,
                    kind,
                    65536 + 11,
                    stream_mode=mode,
                    host="pinned",
                    src_device=d.ordinal,
                    dst_device=d.ordinal,
                    stream_device=d.ordinal,
                )


@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_copy_across_devices(rt, mem, rng, random_pool, two_devices, mode):
    a, b = two_devices
    for src_dev, dst_dev in ((a, b), (b, a)):
        check_copy(
            rt,
            mem,
            rng,
            random_pool,
            D2D,
            1 * MiB + 5,
            stream_mode=mode,
            src_device=src_dev,
            dst_device=dst_dev,
            stream_device=src_dev,
        )
