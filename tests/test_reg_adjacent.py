"""A buffer registered as adjacent regions serves an extent that spans them (host vendor).

LMCache registers its staging buffer as consecutive 16 MiB regions (``phoenix.io.register``
on consecutive slices, or libphxfile's ``phxFileBufRegister`` per region) and moves the
whole buffer at once. Registrations that follow one another with no gap, of one kind of
memory on one device, are one run: an extent in the run is registered memory (read,
write, read_many, write_many, batch, read_async; device and host memory; every byte
checked, bytes past the extent untouched). An extent that runs past the run into memory
no registration holds is classified as unregistered memory is (the vendor bounds it by
its allocation). Refused with EFAULT, nothing moved, one clear line: an extent that runs
over unregistered bytes into another registration (a gap), or into an adjacent
registration of another kind of memory (host next to device) or device. libphxfile
keeps its rule that a registration is a buffer's only known end, over a run now.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

import numpy as np
import pytest
from _devmem import POISON, check_extent  # tests/_devmem.py

import phoenix.buffers as pb
import phoenix.io as pio
import phoenix.settings as ps
from phoenix._extents import _resolve
from phoenix.errors import PhxIOError
from phoenix.registry import get_runtime

REGION = 1 << 20
N = 5
PAD = 4096 + 64  # poisoned bytes before and after the registered span, in the same allocation
FOFF = 3 * 4096 + 17  # an unaligned file offset
SPAN = N * REGION


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def clean_registrations():
    yield
    assert pio.stats()["registrations"] == 0, "a test leaked registrations"


@pytest.fixture(params=["direct", "staged"])
def mode(request):
    with ps.override(mode=request.param, chunk_size="256K"):
        yield request.param


@pytest.fixture
def data_file(tmp_path):
    data = rand(FOFF + SPAN + 8192, 11)
    path = tmp_path / "adj.bin"
    path.write_bytes(data.tobytes())
    return path, data


@contextlib.contextmanager
def registered(pieces):
    """pio.register each piece (objects or (ptr, n) pairs); deregistered on the way out."""
    done = []
    try:
        for p in pieces:
            pio.register(p)
            done.append(p)
        yield
    finally:
        for p in reversed(done):
            pio.deregister(p)


class Target:
    """The span [PAD, PAD + SPAN) of poisoned memory registered as regions: device memory
    of the vendor (as (ptr, n) pairs) or a NumPy array (as consecutive slices)."""

    def __init__(self, dev, kind, regions=range(N)):
        self.kind, self.n = kind, PAD + SPAN + PAD
        if kind == "device":
            self.d = dev(self.n)
            self.buf = self.d.buf()
            self.pieces = [(self.d.ptr + PAD + k * REGION, REGION) for k in regions]
        else:
            self.a = np.full(self.n, POISON, np.uint8)
            self.buf = self.a
            self.pieces = [self.a[PAD + k * REGION : PAD + (k + 1) * REGION] for k in regions]

    def get(self):
        return self.d.get() if self.kind == "device" else self.a.copy()

    def fill(self, data):
        if self.kind == "device":
            self.d.fill(data)
        else:
            self.a[:] = data

    def poison(self):
        self.fill(np.full(self.n, POISON, np.uint8))


def _classified(buf, size, boff):
    r = _resolve(get_runtime("host"), buf, size, boff, True, "x", 0, "read")
    try:
        return r.mem, r.why
    finally:
        r.release()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_adjacent_registrations_serve_one_extent(rt, dev, mode, data_file, kind, clean_registrations):
    path, data = data_file
    t = Target(dev, kind)
    want_mem = pb.MEM_DEVICE_MAPPED if kind == "device" else pb.MEM_HOST
    stream = rt.stream_create(0)
    try:
        with registered(t.pieces), pio.open(path, "r+") as f:
            # the whole span, and one from inside region 1 to inside region 3: registered memory
            assert _classified(t.buf, SPAN, PAD) == (want_mem, "registered")
            assert _classified(t.buf, 2 * REGION + 99, PAD + REGION + 5) == (want_mem, "registered")
            file_span = data[FOFF : FOFF + SPAN]
            assert f.read(t.buf, SPAN, FOFF, PAD) == SPAN
            check_extent(t.get(), file_span, PAD, SPAN)
            t.poison()
            (count,) = pio.batch([(f, t.buf, SPAN, FOFF, PAD, "read")])
            assert count == SPAN
            check_extent(t.get(), file_span, PAD, SPAN)
            t.poison()
            assert f.read_async(t.buf, SPAN, FOFF, PAD, stream).result() == SPAN
            rt.stream_synchronize(stream)
            check_extent(t.get(), file_span, PAD, SPAN)
            # a gather whose extents cross every region boundary, packed in order
            sz = np.array([REGION // 2, REGION, REGION + 777, 2 * REGION - 777, REGION // 2])
            assert sz.sum() == SPAN
            bo = PAD + np.r_[0, np.cumsum(sz)[:-1]]
            fo = FOFF + np.r_[np.cumsum(sz[::-1])[::-1][1:], 0]  # the file packed in the other order
            t.poison()
            np.testing.assert_array_equal(f.read_many(t.buf, fo, sz, bo), sz)
            got = t.get()
            for i in range(len(sz)):
                np.testing.assert_array_equal(got[bo[i] : bo[i] + sz[i]], data[fo[i] : fo[i] + sz[i]])
            assert (got[:PAD] == POISON).all() and (got[PAD + SPAN :] == POISON).all()
            # writes: the whole span, then a scatter of it, land where they should
            new = rand(t.n, 12)
            t.fill(new)
            assert f.write(t.buf, SPAN, FOFF, PAD) == SPAN
            want = data.copy()
            want[FOFF : FOFF + SPAN] = new[PAD : PAD + SPAN]
            np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
            new2 = rand(t.n, 13)
            t.fill(new2)
            np.testing.assert_array_equal(f.write_many(t.buf, fo, sz, bo), sz)
            for i in range(len(sz)):
                want[fo[i] : fo[i] + sz[i]] = new2[bo[i] : bo[i] + sz[i]]
            np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    finally:
        rt.stream_synchronize(stream)
        rt.stream_destroy(stream)


def test_a_tensor_registered_as_16_mib_regions_reads_whole(rt, dev, tmp_path, clean_registrations):
    """LMCache's layout: 4 x 16 MiB regions of one device buffer, one read of all of it
    (it was refused: "its registration holds 16777216 bytes; the request needs 67108864")."""
    region, n = 16 << 20, 4
    data = rand(region * n, 14)
    path = tmp_path / "lm.bin"
    path.write_bytes(data.tobytes())
    d = dev(region * n)
    with registered([(d.ptr + k * region, region) for k in range(n)]), pio.open(path, "r") as f:
        assert f.read(d.buf()) == region * n
    np.testing.assert_array_equal(d.get(), data)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_gap_between_registrations_is_refused(rt, dev, data_file, kind, clean_registrations):
    """Regions 0, 1, 3 and 4 registered, region 2 not: an extent from the run 0-1 over the
    gap into region 3 is refused (EFAULT naming the registration and the gap), by every
    entry point, nothing moves; an extent inside a run is served, and so is one that runs
    from region 1 into the gap and ends there (unregistered memory of the buffer given)."""
    path, data = data_file
    t = Target(dev, kind, regions=[0, 1, 3, 4])
    before = data.tobytes()
    stream = rt.stream_create(0)
    try:
        with registered(t.pieces), pio.open(path, "r+") as f:
            across = (2 * REGION, PAD + REGION + 100)  # (size, buffer offset): region 1 to region 3
            for call in (
                lambda: f.read(t.buf, across[0], FOFF, across[1]),
                lambda: f.write(t.buf, across[0], FOFF, across[1]),
                lambda: f.read(t.buf, SPAN, FOFF, PAD),
                lambda: f.read_async(t.buf, across[0], FOFF, across[1], stream),
            ):
                with pytest.raises(PhxIOError) as ei:
                    call()
                msg = str(ei.value)
                assert ei.value.errno == errno.EFAULT and "\n" not in msg, msg
                assert "registration" in msg and "unregistered bytes" in msg and "register the gap" in msg, msg
            (r,) = pio.batch([(f, t.buf, across[0], FOFF, across[1], "read")])
            assert isinstance(r, PhxIOError) and r.errno == errno.EFAULT
            # a gather: the extent over the gap fails alone, the others land
            fo = np.array([FOFF, FOFF + 10_000, FOFF + 20_000])
            sz = np.array([5000, 2 * REGION, 5000])
            bo = np.array([PAD + 3, PAD + REGION + 100, PAD + 4 * REGION])
            got_counts = f.read_many(t.buf, fo, sz, bo, check=False)
            np.testing.assert_array_equal(got_counts, [5000, -errno.EFAULT, 5000])
            rt.stream_synchronize(stream)
            got = t.get()
            for i in (0, 2):
                np.testing.assert_array_equal(got[bo[i] : bo[i] + sz[i]], data[fo[i] : fo[i] + sz[i]])
            got[bo[0] : bo[0] + sz[0]] = POISON
            got[bo[2] : bo[2] + sz[2]] = POISON
            assert (got == POISON).all(), "a refused extent moved bytes"
            assert path.read_bytes() == before, "a refused write changed the file"
            # inside the run 3-4, and from region 1 into the gap, ending in it: served
            t.poison()
            assert f.read(t.buf, 2 * REGION, FOFF, PAD + 3 * REGION) == 2 * REGION
            check_extent(t.get(), data[FOFF:], PAD + 3 * REGION, 2 * REGION)
            t.poison()
            assert f.read(t.buf, REGION, FOFF, PAD + REGION + REGION // 2) == REGION
            check_extent(t.get(), data[FOFF:], PAD + REGION + REGION // 2, REGION)
    finally:
        rt.stream_synchronize(stream)
        rt.stream_destroy(stream)


def test_registration_runs_past_into_unregistered_memory(rt, dev, data_file, clean_registrations):
    """Regions 0 and 1 registered, the rest of the buffer not: the whole span is read and
    written as unregistered memory (classified by the vendor), every byte checked; a raw
    pair's extent past its device allocation is still refused and moves nothing."""
    path, data = data_file
    for kind in ("device", "host"):
        t = Target(dev, kind, regions=[0, 1])
        with registered(t.pieces), pio.open(path, "r+") as f:
            mem, why = _classified(t.buf, SPAN, PAD)
            assert why != "registered" and mem == (pb.MEM_DEVICE_MAPPED if kind == "device" else pb.MEM_HOST)
            assert f.read(t.buf, SPAN, FOFF, PAD) == SPAN
            check_extent(t.get(), data[FOFF:], PAD, SPAN)
            assert f.write(t.buf, SPAN, FOFF + 1, PAD) == SPAN
        got = np.fromfile(path, np.uint8)
        np.testing.assert_array_equal(got[FOFF + 1 : FOFF + 1 + SPAN], data[FOFF : FOFF + SPAN])
        data = got
    t = Target(dev, "device", regions=[0, 1])
    with registered(t.pieces), pio.open(path, "r") as f, pytest.raises(PhxIOError) as ei:
        f.read((t.d.ptr, t.n + 4096), SPAN + PAD + 4096, 0, PAD)
    assert ei.value.errno == errno.EFAULT and "device allocation" in str(ei.value), ei.value
    assert (t.get() == POISON).all()


def test_adjacent_registrations_of_other_memory_are_refused_together(rt, dev, data_file, clean_registrations):
    """A device registration followed at once by one of host memory (a pinned allocation
    next to device memory in one address space), or of another device: one extent over
    both is refused (EFAULT naming both kinds and where to split), nothing moves; each
    part alone is served as its own kind of memory."""
    lib = pio._lib
    path, data = data_file
    d = dev(PAD + 2 * REGION + PAD)
    a, b = d.ptr + PAD, d.ptr + PAD + REGION
    for mem, device, named in ((pb.MEM_HOST, 0, "host memory on device 0"), (pb.MEM_DEVICE_MAPPED, 1, "device 1")):
        d.poison()
        pio.register((a, REGION))
        assert lib.phx_reg_add(b, REGION, mem, device) == 0
        try:
            with pio.open(path, "r+") as f:
                for call in (
                    lambda: f.read(d.buf(), 2 * REGION, FOFF, PAD),
                    lambda: f.write(d.buf(), REGION + 1, FOFF, PAD),
                    lambda: f.read(d.buf(), 2, FOFF, PAD + REGION - 1),
                ):
                    with pytest.raises(PhxIOError) as ei:
                        call()
                    msg = str(ei.value)
                    assert ei.value.errno == errno.EFAULT and named in msg and "split it there" in msg, msg
                    assert f"buffer offset {PAD + REGION}" in msg, msg
                assert (d.get() == POISON).all(), "a refused extent moved bytes"
                assert _classified(d.buf(), REGION, PAD) == (pb.MEM_DEVICE_MAPPED, "registered")
                assert _classified(d.buf(), REGION, PAD + REGION) == (mem, "registered")
                if mem == pb.MEM_HOST:  # (the host vendor's device memory is host memory: both parts can land)
                    assert f.read(d.buf(), REGION, FOFF, PAD) == REGION
                    assert f.read(d.buf(), REGION, FOFF + REGION, PAD + REGION) == REGION
                    check_extent(d.get(), data[FOFF:], PAD, 2 * REGION)
        finally:
            assert lib.phx_reg_remove(b) == 0
            pio.deregister((a, REGION))


# ---- libphxfile -----------------------------------------------------------------------------


@pytest.fixture
def phxlib():
    from phoenix import phxfile

    lib = phxfile.load()
    yield lib
    assert lib.phxFileDriverClose() == 0


def _submit(lib, fn, fh, base, nbytes, foff, boff, stream):
    size, fo, bo, done = ctypes.c_size_t(nbytes), ctypes.c_int64(foff), ctypes.c_int64(boff), ctypes.c_int64(-12345)
    rc = fn(fh, ctypes.c_void_p(base), ctypes.byref(size), ctypes.byref(fo), ctypes.byref(bo), ctypes.byref(done),
            ctypes.c_void_p(stream))  # fmt: skip
    return rc, done


def test_libphxfile_spans_adjacent_regions_and_refuses_past_them(rt, dev, phxlib, tmp_path):
    """phxFileBufRegister per region: one ReadAsync / WriteAsync from region 0's base over
    all of them is served, and from a buf_base inside region 1 into region 2; an extent past
    the last region, or over a gap (region 1 deregistered), is -EFAULT and moves nothing."""
    lib = phxlib
    n = 3
    data = rand(n * REGION + 8192, 15)
    path = tmp_path / "slab.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    d = dev(n * REGION + 4096)
    fh = ctypes.c_void_p()
    stream = rt.stream_create(0)
    regions = [d.ptr + k * REGION for k in range(n)]
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), fd) == 0
        for r in regions:
            assert lib.phxFileBufRegister(ctypes.c_void_p(r), ctypes.c_size_t(REGION)) == 0
        rc, done = _submit(lib, lib.phxFileReadAsync, fh, d.ptr, n * REGION, 0, 0, stream)
        rt.stream_synchronize(stream)
        assert rc == 0 and done.value == n * REGION
        check_extent(d.get(), data, 0, n * REGION)
        d.poison()
        rc, done = _submit(lib, lib.phxFileReadAsync, fh, regions[1] + 5, REGION, 100, 7, stream)
        rt.stream_synchronize(stream)
        assert rc == 0 and done.value == REGION
        check_extent(d.get(), data[100:], REGION + 12, REGION)
        d.fill(rand(d.n, 16))
        src = d.get()
        rc, done = _submit(lib, lib.phxFileWriteAsync, fh, d.ptr, n * REGION, 8192, 0, stream)
        rt.stream_synchronize(stream)
        assert rc == 0 and done.value == n * REGION
        want = data.copy()
        want[8192 : 8192 + n * REGION] = src[: n * REGION]
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
        # past the last region (into allocated, unregistered memory): refused, nothing moves
        d.poison()
        for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
            for base, nbytes, boff in ((d.ptr, n * REGION + 1, 0), (regions[2], 4096, REGION - 100)):
                rc, done = _submit(lib, fn, fh, base, nbytes, 0, boff, stream)
                assert rc == -errno.EFAULT and done.value == rc, (fn.__name__, hex(base), nbytes, boff)
        # a gap: region 1 deregistered
        assert lib.phxFileBufDeregister(ctypes.c_void_p(regions[1])) == 0
        for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
            rc, done = _submit(lib, fn, fh, d.ptr, n * REGION, 0, 0, stream)
            assert rc == -errno.EFAULT and done.value == rc, fn.__name__
            rc, done = _submit(lib, fn, fh, d.ptr, 8192, 0, REGION - 4096, stream)  # region 0 into the gap
            assert rc == -errno.EFAULT and done.value == rc, fn.__name__
        rt.stream_synchronize(stream)
        assert (d.get() == POISON).all(), "a refused extent moved bytes"
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    finally:
        rt.stream_synchronize(stream)
        rt.stream_destroy(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        for r in regions:
            lib.phxFileBufDeregister(ctypes.c_void_p(r))
        os.close(fd)
