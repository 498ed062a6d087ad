"""Staged reads of cached pages into device memory, piece by piece (pread a piece, queue
its device copy, pread the next): every byte of unaligned extents, extents ending at or
past the end of the file, failed reads, in both engines, with pieces smaller than chunks
and with the piecewise path off (PHX_CACHED_PIECE=0) as the reference."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from _devmem import POISON, check_extent  # tests/_devmem.py

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.errors import PhxIOError

SIZE = (1 << 20) + 12345  # not a multiple of anything


@pytest.fixture(params=[("io_uring", "12288"), ("threads", "12288"), ("io_uring", "0")])
def pieces(request, monkeypatch):
    engine, piece = request.param
    monkeypatch.setenv("PHX_CACHED_PIECE", piece)  # read when a context is made
    pio.shutdown()  # a fresh context per case
    with ps.override(engine=engine, mode="staged", chunk_size="64K", fmap_mode="off"):
        yield engine, int(piece)
    pio.shutdown()


@pytest.fixture
def cached_file(tmp_path):
    data = np.random.default_rng(11).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "cached.bin"
    path.write_bytes(data.tobytes())  # written buffered: in the page cache
    return path, data


@pytest.mark.parametrize("foff,size", [(0, SIZE), (1, 65535), (4095, 200_001), (SIZE - 70_000, 70_000),
                                       (SIZE - 50_000, 100_000), (65536 - 10, 20)])
def test_cached_staged_reads_every_byte(rt, pieces, dev, cached_file, foff, size):
    path, data = cached_file
    d = dev(size + 64)
    with pio.open(path, "r", direct=None) as f:
        before = pio.stats()
        got = f.read(d.buf(), size, foff, 32)
        after = pio.stats()
    want = data[foff:foff + size]
    assert got == want.size
    check_extent(d.get(), want, 32, want.size)
    assert after["bounce_in_use"] == 0
    # a whole 64 KiB chunk inside the extent goes piece by piece (when pieces are on)
    whole = (foff + size) // 65536 - -(-foff // 65536) > 0
    n = after["cached_pieces"] - before["cached_pieces"]
    if pieces[1] and whole:
        assert n >= 65536 // pieces[1], "no chunk went piece by piece"
    elif not pieces[1]:
        assert n == 0


def test_cached_staged_read_failure_keeps_nothing_in_flight(rt, pieces, dev, cached_file):
    path, _ = cached_file
    d = dev(SIZE)
    d.poison()
    with pio.open(path, "r", direct=None) as f:
        f._inject_fault(300_000, 1, errno.EIO)
        with pytest.raises(PhxIOError) as ei:
            f.read(d.buf(), SIZE, 0, 0)
        f._inject_fault(0, 0, 0)
        assert ei.value.errno == errno.EIO
    s = pio.stats()
    assert s["bounce_in_use"] == 0 and s["requests"] == 0, s


def test_poisoned_neighbours_of_many_small_cached_reads(rt, pieces, dev, cached_file):
    path, data = cached_file
    rng = np.random.default_rng(12)
    sz = rng.integers(1, 40_000, 64)
    fo = rng.integers(0, SIZE - sz)
    bo = np.r_[0, np.cumsum(sz[:-1] + 7)]
    d = dev(int(bo[-1] + sz[-1] + 7))
    with pio.open(path, "r", direct=None) as f:
        np.testing.assert_array_equal(f.read_many(d.buf(), fo, sz, bo), sz)
    out = d.get()
    want = np.full(d.n, POISON, np.uint8)
    for o, s, b in zip(fo, sz, bo, strict=True):
        want[b:b + s] = data[o:o + s]
    np.testing.assert_array_equal(out, want)
