"""read_many / write_many (vectorized gather and scatter) on the host vendor, both engines,
both modes: random extents of random bytes, poisoned destinations, every byte checked,
refusals that move nothing, one failed extent failing alone."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from _devmem import POISON  # tests/_devmem.py

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._testing import inject_fault
from phoenix.errors import PhxIOError

FILE_SIZE = 3 << 20


@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    with ps.override(engine=request.param, chunk_size="64K"):
        yield request.param


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, FILE_SIZE, dtype=np.uint8)
    path = tmp_path / "many.bin"
    path.write_bytes(data.tobytes())
    return path, data


def extents(n, seed, max_size=150_000):
    """n random (file offset, size) pairs inside the file, unaligned, sizes 1..max_size."""
    rng = np.random.default_rng(seed)
    sz = rng.integers(1, max_size, n)
    fo = rng.integers(0, FILE_SIZE - sz)
    return fo.astype(np.int64), sz.astype(np.int64)


@pytest.mark.parametrize("mode", ["auto", "staged", "direct"])
def test_gather_into_device_memory_every_byte(rt, engine, mode, dev, data_file):
    path, data = data_file
    fo, sz = extents(300, seed=1)
    gap = 13  # poisoned bytes between the extents: they must stay poisoned
    bo = np.zeros_like(sz)
    bo[1:] = np.cumsum(sz[:-1] + gap)
    d = dev(int(bo[-1] + sz[-1] + 100))
    with ps.override(mode=mode), pio.open(path, "r") as f:
        got = f.read_many(d.buf(), fo, sz, bo)
    np.testing.assert_array_equal(got, sz)
    out = d.get()
    want = np.full(d.n, POISON, np.uint8)
    for o, s, b in zip(fo, sz, bo, strict=True):
        want[b : b + s] = data[o : o + s]
    np.testing.assert_array_equal(out, want)


def test_gather_packed_by_default_into_host_memory(rt, engine, data_file):
    path, data = data_file
    fo, sz = extents(200, seed=2, max_size=9000)
    buf = np.full(int(sz.sum()) + 64, POISON, np.uint8)
    with pio.open(path, "r") as f:
        got = f.read_many(buf, list(fo), list(sz))  # sequences, no buffer offsets: packed in order
    np.testing.assert_array_equal(got, sz)
    want = np.concatenate([data[o : o + s] for o, s in zip(fo, sz, strict=True)])
    np.testing.assert_array_equal(buf[: want.size], want)
    assert (buf[want.size :] == POISON).all()


def test_scatter_from_device_memory_then_read_back(rt, engine, dev, tmp_path):
    path = tmp_path / "scatter.bin"
    ref = np.random.default_rng(3).integers(0, 256, FILE_SIZE, dtype=np.uint8)
    path.write_bytes(ref.tobytes())
    # disjoint extents: a random permutation of slots of random lengths
    rng = np.random.default_rng(4)
    cuts = np.sort(rng.choice(np.arange(1, FILE_SIZE), 400, replace=False))
    starts, ends = np.r_[0, cuts], np.r_[cuts, FILE_SIZE]
    pick = rng.permutation(len(starts))[:150]
    fo, sz = starts[pick], ends[pick] - starts[pick]
    src = np.random.default_rng(5).integers(0, 256, int(sz.sum()), dtype=np.uint8)
    d = dev(src.size)
    d.fill(src)
    with pio.open(path, "r+") as f:
        got = f.write_many(d.buf(), fo, sz)
    np.testing.assert_array_equal(got, sz)
    pos = 0
    for o, s in zip(fo, sz, strict=True):
        ref[o : o + s] = src[pos : pos + s]
        pos += s
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), ref)


def test_eof_gives_short_counts_not_errors(rt, engine, dev, data_file):
    path, data = data_file
    fo = np.array([FILE_SIZE - 1000, FILE_SIZE + 5, 0])
    sz = np.array([4000, 100, 10])
    d = dev(5000)
    with pio.open(path, "r") as f:
        got = f.read_many(d.buf(), fo, sz)
    np.testing.assert_array_equal(got, [1000, 0, 10])
    out = d.get()
    np.testing.assert_array_equal(out[:1000], data[-1000:])
    assert (out[1000:4000] == POISON).all()
    np.testing.assert_array_equal(out[4100:4110], data[:10])


def test_extent_past_the_buffer_is_refused_before_anything_moves(rt, engine, dev, data_file, tmp_path):
    path, _ = data_file
    d = dev(1 << 16)
    fo = np.array([0, 8192, 4096])
    sz = np.array([4096, 4096, 4096])
    bo = np.array([0, 4096, (1 << 16) - 4095])  # the last one runs one byte past the buffer
    with pio.open(path, "r") as f, pytest.raises(PhxIOError) as ei:
        f.read_many(d.buf(), fo, sz, bo)
    assert ei.value.errno == errno.EFAULT and ei.value.filename == str(path)
    assert (d.get() == POISON).all(), "a refused gather wrote into the buffer"
    # the same for a scatter: the file is unchanged
    before = path.read_bytes()
    d.fill(np.random.default_rng(9).integers(0, 256, d.n, dtype=np.uint8))
    with pio.open(path, "r+") as f, pytest.raises(PhxIOError):
        f.write_many(d.buf(), fo, sz, bo)
    assert path.read_bytes() == before


def test_extent_across_registrations_fails_alone(rt, engine, dev, data_file):
    """A buffer registered as consecutive regions (as LMCache registers a tensor), region 2
    short of its end by 4 KiB: an extent that crosses from one region into the next is
    served, one that crosses the 4 KiB gap from region 2 into region 3 is refused (EFAULT)
    and its bytes stay poisoned; the other extents land."""
    path, data = data_file
    region = 1 << 16
    d = dev(4 * region)
    pieces = [(d.ptr + k * region, region - (4096 if k == 2 else 0)) for k in range(4)]
    for p in pieces:
        pio.register(p)
    try:
        fo = np.array([0, 100_000, 200_000, 300_000])
        sz = np.array([5000, 5000, 5000, 5000])
        bo = np.array([0, region - 100, 3 * region - 4196, 3 * region + 1007])  # 1: regions 0|1, 2: over the gap
        with pio.open(path, "r") as f:
            with pytest.raises(PhxIOError) as ei:
                f.read_many(d.buf(), fo, sz, bo)
            assert ei.value.errno == errno.EFAULT and "extent 2 of 4" in str(ei.value)
            d.poison()
            got = f.read_many(d.buf(), fo, sz, bo, check=False)
        np.testing.assert_array_equal(got, [5000, 5000, -errno.EFAULT, 5000])
        out = d.get()
        assert (out[bo[2] : bo[2] + sz[2]] == POISON).all(), "the refused extent moved bytes"
        for i in (0, 1, 3):
            np.testing.assert_array_equal(out[bo[i] : bo[i] + sz[i]], data[fo[i] : fo[i] + sz[i]])
    finally:
        for p in pieces:
            pio.deregister(p)


def test_failed_extent_fails_alone(rt, engine, dev, data_file):
    path, data = data_file
    fo, sz = extents(50, seed=6, max_size=4000)
    fo[17] = 2_000_000
    d = dev(int(sz.sum()))
    with pio.open(path, "r") as f:
        inject_fault(f, 2_000_000, 1, errno.EIO)
        got = f.read_many(d.buf(), fo, sz, check=False)
        inject_fault(f, 0, 0, 0)
    bad = {i for i, o in enumerate(fo) if o <= 2_000_000 < o + sz[i]}
    assert 17 in bad
    for i in range(50):
        assert got[i] == (-errno.EIO if i in bad else sz[i])
    out, pos = d.get(), np.r_[0, np.cumsum(sz)]
    for i in range(50):
        if i not in bad:
            np.testing.assert_array_equal(out[pos[i] : pos[i + 1]], data[fo[i] : fo[i] + sz[i]])


@pytest.mark.parametrize(
    "args,exc",
    [
        (([0, 1], [1, 2, 3]), ValueError),  # lengths differ
        (([0.5], [4]), TypeError),  # not integers
        (([-1], [4]), PhxIOError),  # negative file offset
        (([0], [-4]), PhxIOError),  # negative size
        (([0, 1], [4, 4], [0, -3]), PhxIOError),  # negative buffer offset
    ],
)
def test_bad_arguments_are_refused(rt, data_file, args, exc):
    path, _ = data_file
    buf = np.full(64, POISON, np.uint8)
    with pio.open(path, "r") as f, pytest.raises(exc):
        f.read_many(buf, *args)
    assert (buf == POISON).all()


def test_empty_and_all_zero_sizes(rt, data_file):
    path, _ = data_file
    buf = np.full(16, POISON, np.uint8)
    with pio.open(path, "r") as f:
        assert f.read_many(buf, [], []).size == 0
        np.testing.assert_array_equal(f.read_many(buf, [0, 5], 0), [0, 0])
    assert (buf == POISON).all()


def test_no_request_leaks(rt, engine, dev, data_file):
    path, _ = data_file
    fo, sz = extents(3000, seed=8, max_size=3000)
    d = dev(int(sz.sum()))
    with pio.open(path, "r") as f:
        f.read_many(d.buf(), fo, sz)
    s = pio.stats()
    assert s["requests"] == 0 and s["bounce_in_use"] == 0, s
