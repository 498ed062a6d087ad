"""The I/O stack on the host vendor: round trips in each engine and mode, unaligned
extents, sparse files past 4 GiB, EOF, errors, batches, O_DIRECT fallback.

Every test uses random bytes, poisons its destination, and checks every byte: the
extent read, and that nothing around it was touched.
"""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest
from _devmem import POISON, check_extent  # tests/_devmem.py

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._testing import inject_fault
from phoenix.errors import PhxIOError

ENGINES = ["io_uring", "threads"]
MODES = ["direct", "staged"]


@pytest.fixture(params=ENGINES)
def engine(request):
    with ps.override(engine=request.param):
        yield request.param


@pytest.fixture(params=MODES)
def mode(request):
    with ps.override(mode=request.param):
        yield request.param


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


# ---- round trips -------------------------------------------------------------------------

# (file offset, buffer offset, size): aligned, unaligned head/tail, relative misalignment,
# sub-block, several chunks (chunk_size is 64K in these tests)
EXTENTS = [
    (0, 0, 4096),
    (0, 0, 1),
    (4095, 0, 2),
    (12345, 3, 200_000),
    (4096, 4096, 300 * 1024),
    (512, 0, 1 << 20),
    (1, 4095, (1 << 20) + 7),
    (65536 * 3 - 1, 1, 65536 * 2 + 2),
]


@pytest.mark.parametrize("foff,boff,size", EXTENTS)
def test_roundtrip_device(rt, engine, mode, dev, tmp_path, foff, boff, size):
    path = tmp_path / "f.bin"
    data = rand(size, seed=size)
    src = dev(boff + size + 100)
    src.poison()
    full = src.get()
    full[boff : boff + size] = data
    src.fill(full)
    with ps.override(chunk_size="64K"):
        with pio.open(path, "w") as f:
            assert f.write(src.buf(), size, foff, boff) == size
        assert os.path.getsize(path) == foff + size
        dst = dev(boff + size + 100)
        dst.poison()
        with pio.open(path, "r") as f:
            assert f.read(dst.buf(), size, foff, boff) == size
    check_extent(dst.get(), data, boff, size)
    with open(path, "rb") as fh:
        fh.seek(foff)
        assert fh.read() == data.tobytes()


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview"])
@pytest.mark.parametrize("foff,boff,size", EXTENTS[2:6])
def test_roundtrip_host(rt, engine, tmp_path, kind, foff, boff, size):
    path = tmp_path / "h.bin"
    data = rand(size, seed=foff)
    n = boff + size + 64
    src = np.full(n, POISON, np.uint8)
    src[boff : boff + size] = data
    dst_np = np.full(n, POISON, np.uint8)
    if kind == "numpy":
        s_buf, d_buf = src, dst_np
    elif kind == "bytearray":
        s_buf, d_buf = bytearray(src.tobytes()), bytearray(dst_np.tobytes())
    else:
        s_buf, d_buf = memoryview(bytearray(src.tobytes())), memoryview(bytearray(dst_np.tobytes()))
    with ps.override(chunk_size="64K"):
        with pio.open(path, "w+") as f:
            assert f.pwrite(s_buf, size, foff, boff).result() == size
            fut = f.pread(d_buf, size, foff, boff)
            assert fut.result() == size and fut.done()
    got = np.frombuffer(d_buf, np.uint8) if kind != "numpy" else dst_np
    check_extent(got, data, boff, size)


def test_bytes_are_written_but_not_read_into(rt, tmp_path):
    path = tmp_path / "b.bin"
    with pio.open(path, "w+") as f:
        assert f.write(b"hello phoenix") == 13
        with pytest.raises(TypeError, match="read"):
            f.read(b"x" * 13)
    assert path.read_bytes() == b"hello phoenix"


def test_host_buffer_of_page_aligned_memory_goes_direct(rt, engine, tmp_path):
    """Pinned host memory (page aligned) takes the zero-copy path: O_DIRECT in place."""
    n = 1 << 20
    ptr = rt.host_alloc_pinned(n)
    try:
        host = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(ptr))
        host[:] = rand(n, 7)
        before = pio.stats()
        with pio.open(tmp_path / "p.bin", "w+") as f:
            assert f.write((ptr, n)) == n
            host[:] = POISON
            assert f.read((ptr, n)) == n
        after = pio.stats()
        np.testing.assert_array_equal(host, rand(n, 7))
        assert after["chunks_user"] > before["chunks_user"]
        assert after["chunks_staged"] == before["chunks_staged"]
        assert after["chunks_staged_cpu"] == before["chunks_staged_cpu"]
    finally:
        rt.host_free_pinned(ptr)


def test_modes_take_their_paths(rt, dev, tmp_path):
    n = 1 << 20
    d = dev(n)
    d.fill(rand(n, 3))
    with pio.open(tmp_path / "m.bin", "w+") as f:
        for mode, counter in (("direct", "chunks_user"), ("staged", "chunks_staged")):
            with ps.override(mode=mode):
                before = pio.stats()
                assert f.write(d.buf()) == n
                assert f.read(d.buf()) == n
                after = pio.stats()
            assert after[counter] > before[counter], mode
    np.testing.assert_array_equal(d.get(), rand(n, 3))


def test_sparse_file_beyond_4g(rt, engine, mode, dev, tmp_path):
    path = tmp_path / "sparse.bin"
    off = (5 << 30) + 123
    size = 300_000
    data = rand(size, 11)
    src = dev(size)
    src.fill(data)
    with pio.open(path, "w+") as f:
        assert f.write(src.buf(), size, off) == size
        assert f.size() == off + size
        dst = dev(size + 8192)
        dst.poison()
        assert f.read(dst.buf(), size, off, 8192) == size
        check_extent(dst.get(), data, 8192, size)
        hole = dev(8192)
        hole.poison()
        assert f.read(hole.buf(), 8192, 4 << 30) == 8192
        assert (hole.get() == 0).all()
    assert os.stat(path).st_blocks * 512 < 64 << 20  # still sparse


def test_eof_short_read(rt, engine, mode, dev, tmp_path):
    path = tmp_path / "eof.bin"
    data = rand(10_000, 5)
    path.write_bytes(data.tobytes())
    with ps.override(chunk_size="4K"):
        with pio.open(path, "r") as f:
            d = dev(30_000)
            d.poison()
            assert f.read(d.buf(), 20_000, 5_000, 100) == 5_000
            got = d.get()
            np.testing.assert_array_equal(got[100:5_100], data[5_000:])
            assert (got[:100] == POISON).all()
            assert (got[20_100:] == POISON).all()
            if mode == "staged":  # the device copy moves only what the file supplied
                assert (got[5_100:20_100] == POISON).all()
            assert f.read(d.buf(), 100, 10_000) == 0
            assert f.read(d.buf(), 100, 1 << 40) == 0
            assert f.pread(d.buf(), 0, 0).result() == 0


# ---- errors ------------------------------------------------------------------------------


def test_write_to_read_only_file_is_ebadf(rt, engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"x" * 8192)
    with pio.open(path, "r") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write(bytearray(4096), 4096, 4096)
    e = ei.value
    assert e.errno == errno.EBADF and e.path == str(path) and e.offset == 4096 and e.length == 4096
    assert str(path) in str(e) and "4096" in str(e)


def test_enospc_names_file_offset_length(rt):
    with pio.open("/dev/full", "r+") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write(bytearray(10_000), 10_000, 0)
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.path == "/dev/full" and ei.value.length == 10_000
    # what the file holds now, and what to do
    assert "part of the range may have been written" in str(ei.value) and "free space" in str(ei.value)


def test_eio_in_one_chunk_fails_the_request(rt, engine, mode, dev, tmp_path):
    path = tmp_path / "eio.bin"
    path.write_bytes(rand(1 << 20, 2).tobytes())
    with ps.override(chunk_size="64K"):
        with pio.open(path, "r") as f:
            inject_fault(f, 300_000, 10, errno.EIO)
            d = dev(1 << 20)
            with pytest.raises(PhxIOError) as ei:
                f.read(d.buf())
            assert ei.value.errno == errno.EIO
            assert ei.value.offset == 0 and ei.value.length == 1 << 20
            assert "262144" in str(ei.value)  # the failing chunk [256K, 320K)
            assert "the destination's bytes for it are undefined" in str(ei.value)
            inject_fault(f, 0, 0, 0)
            assert f.read(d.buf()) == 1 << 20


def test_batch_failed_request_fails_alone(rt, engine, mode, dev, tmp_path):
    path = tmp_path / "batch.bin"
    n, k = 64 * 1024, 16
    data = rand(n * k, 9)
    path.write_bytes(data.tobytes())
    d = dev(n * k)
    d.poison()
    with pio.open(path, "r") as f:
        inject_fault(f, 5 * n + 100, 1, errno.EIO)
        reqs = [(f, d.buf(), n, i * n, i * n, "read") for i in range(k)]
        reqs.append((f, d.buf(), n, 0, n * k - 10, "read"))  # runs past the buffer: EFAULT
        results = pio.batch(reqs)
    assert isinstance(results[5], PhxIOError) and results[5].errno == errno.EIO
    assert isinstance(results[k], PhxIOError) and results[k].errno == errno.EFAULT
    got = d.get()
    for i in range(k):
        if i == 5:
            continue
        assert results[i] == n
        np.testing.assert_array_equal(got[i * n : (i + 1) * n], data[i * n : (i + 1) * n])


def test_batch_forms_and_futures(rt, tmp_path):
    path = tmp_path / "forms.bin"
    data = rand(3 * 4096, 4)
    with pio.open(path, "w+") as f:
        assert pio.batch([pio.IORequest(f, data, op="write")]) == [3 * 4096]
        out = np.full(3 * 4096, POISON, np.uint8)
        futs = pio.batch(
            [
                (f, out, 4096, 0, 0),
                {"file": f, "buf": out, "size": 4096, "file_offset": 4096, "buf_offset": 4096},
                pio.IORequest(f, out, 4096, 8192, 8192, "read"),
            ],
            wait=False,
        )
        assert [fut.result() for fut in futs] == [4096] * 3
    np.testing.assert_array_equal(out, data)
    assert pio.batch([]) == []


def test_bad_arguments(rt, tmp_path):
    with pio.open(tmp_path / "bad.bin", "w+") as f:
        buf = bytearray(100)
        with pytest.raises(PhxIOError) as ei:
            f.read(buf, 10, -1)
        assert ei.value.errno == errno.EINVAL
        with pytest.raises(PhxIOError) as ei:
            f.read(buf, 60, 0, 50)
        assert ei.value.errno == errno.EFAULT
        with pytest.raises(TypeError, match="size"):
            f.read(12345)
        with pytest.raises(ValueError, match="op"):
            pio.batch([(f, buf, 10, 0, 0, "append")], wait=False)[0].result()
    with pytest.raises(ValueError, match="closed"):
        f.read(buf)
    with pytest.raises(ValueError, match="mode"):
        pio.open(tmp_path / "x", "rw")
    with pytest.raises(PhxIOError) as ei:
        pio.open(tmp_path / "missing" / "x", "r")
    assert ei.value.errno == errno.ENOENT


def test_direct_mode_refuses_device_memory_it_cannot_address(rt, dev, tmp_path, monkeypatch):
    d = dev(4096)
    monkeypatch.setattr(rt, "direct_capable", lambda ptr, n: (False, "no P2P mapping (test)"))
    with ps.override(mode="direct"), pio.open(tmp_path / "d.bin", "w+") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write(d.buf())
        assert ei.value.errno == errno.EOPNOTSUPP and "no P2P mapping" in str(ei.value)
    with ps.override(mode="auto"), pio.open(tmp_path / "d.bin", "w+") as f:
        before = pio.stats()["chunks_staged"]
        assert f.write(d.buf()) == 4096  # auto: staged
        assert pio.stats()["chunks_staged"] > before


# ---- O_DIRECT and its fallback -------------------------------------------------------------


def test_direct_refused_at_first_io_falls_back(rt, engine, mode, dev, tmp_path):
    path = tmp_path / "einval.bin"
    n = 200_000
    data = rand(n, 12)
    src = dev(n)
    src.fill(data)
    with pio.open(path, "w+") as f:
        if not f.info()["direct"]:
            pytest.skip("no O_DIRECT on this file system")
        inject_fault(f, 0, 1 << 40, errno.EINVAL)  # "O_DIRECT refused at the first I/O"
        before = pio.stats()["direct_fallbacks"]
        assert f.write(src.buf()) == n
        info = f.info()
        assert not info["direct"] and "EINVAL" in info["why"]
        assert pio.stats()["direct_fallbacks"] == before + 1
        dst = dev(n)
        dst.poison()
        assert f.read(dst.buf()) == n
    np.testing.assert_array_equal(dst.get(), data)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_buffered_files(rt, engine, where, tmp_path):
    base = tmp_path if where == "tmp" else "/dev/shm"
    path = os.path.join(base, f"phx-buffered-{os.getpid()}.bin")
    try:
        data = rand(333_333, 13)
        with pio.open(path, "w+", direct=False) as f:
            info = f.info()
            assert not info["direct"] and "direct=False" in info["why"]
            assert f.write(data) == data.nbytes
            out = np.full(data.nbytes, POISON, np.uint8)
            assert f.read(out) == data.nbytes
        np.testing.assert_array_equal(out, data)
        with pio.open(path, "r") as f:  # auto: O_DIRECT where the file system takes it
            out[:] = POISON
            assert f.read(out) == data.nbytes
            np.testing.assert_array_equal(out, data)
    finally:
        os.unlink(path)


def test_sync_writes_and_fsync(rt, tmp_path):
    path = tmp_path / "sync.bin"
    data = rand(100_000, 14)
    with pio.open(path, "w", sync=True) as f:
        assert f.write(data) == data.nbytes
        f.fsync()
    assert path.read_bytes() == data.tobytes()


def test_open_modes(rt, tmp_path):
    path = tmp_path / "modes.bin"
    with pio.open(path, "x") as f:
        f.write(b"abc")
    with pytest.raises(PhxIOError) as ei:
        pio.open(path, "x")
    assert ei.value.errno == errno.EEXIST
    with pio.open(path, "a") as f:  # no truncation, positional writes
        f.write(b"Z", 1, 1)
    assert path.read_bytes() == b"aZc"
    with pio.open(path, "r+b") as f:
        out = bytearray(3)
        assert f.read(out) == 3 and out == b"aZc"
    with pio.open(path, "w") as f:
        pass
    assert path.read_bytes() == b""


# ---- the page cache ------------------------------------------------------------------------


@pytest.mark.parametrize("fixed", [True, False])
def test_staged_io_on_registered_buffers(rt, dev, tmp_path, fixed):
    """io_uring: staged reads and writes use the bounce pool as registered buffers
    (READ_FIXED / WRITE_FIXED) unless fixed_buffers=off; the bytes are the same either way,
    unaligned extents, several chunks and a short read at the end of the file included."""
    n, foff, boff, size = 3 << 20, 12345, 7, (2 << 20) + 333
    data = rand(n, 21)
    d = dev(n)
    with ps.override(engine="io_uring", mode="staged", chunk_size="256K", fixed_buffers=fixed):
        with pio.open(tmp_path / "fixed.bin", "w+", direct=True) as f:
            if not f.info()["direct"]:
                pytest.skip("no O_DIRECT here: staged I/O goes through the page cache")
            before = pio.stats()["io_fixed"]
            d.fill(data)
            assert f.write(d.buf(), file_offset=0) == n
            d.poison()
            assert f.read((d.ptr + boff, size), file_offset=foff) == size
            check_extent(d.get(), data[foff:], boff, size)
            d.poison()
            assert f.read(d.buf(), file_offset=n - 5000) == 5000  # past the end: short
            check_extent(d.get(), data[n - 5000 :], 0, 5000)
            used = pio.stats()["io_fixed"] - before
    if not fixed:
        assert used == 0
    elif used == 0:
        release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
        if release < (5, 19):
            pytest.skip(f"kernel {os.uname().release}: no sparse registered-buffer tables (5.19+)")
        pytest.fail("io_uring on a 5.19+ kernel, yet no staged I/O used a registered buffer")


@pytest.mark.parametrize("completion", ["auto", "callback", "steps"])
def test_staged_copies_complete_by_polled_events(rt, dev, tmp_path, completion):
    """io_uring: a worker learns that its staged copies are done by polling an event it
    records after them (the host vendor has event_query), or by host callbacks with
    copy_completion=callback (with steps: polled, writes looked at in doubled steps, not at their
    predicted ends); reads and writes of many chunks round-trip each way."""
    n = (4 << 20) + 4096 * 3 + 11
    data = rand(n, 22)
    d = dev(n)
    with ps.override(engine="io_uring", mode="staged", chunk_size="128K", copy_completion=completion):
        with pio.open(tmp_path / "poll.bin", "w+") as f:
            before = pio.stats()
            d.fill(data)
            assert f.write(d.buf()) == n
            f.fsync()
            d.poison()
            assert f.read(d.buf()) == n
            np.testing.assert_array_equal(d.get(), data)
            after = pio.stats()
    events = after["copy_events"] - before["copy_events"]
    chunks = after["chunks_staged"] - before["chunks_staged"]
    assert chunks >= 2 * (n // (128 << 10))
    if completion == "callback":
        assert events == 0
    else:  # every write chunk's copy and every batch of read copies, but for a full table
        assert events >= n // (128 << 10), f"{events} events for {chunks} staged chunks"


def test_cached_data_is_read_from_the_page_cache(rt, engine, mode, dev, tmp_path):
    """direct=None: O_DIRECT reads first ask the page cache (RWF_NOWAIT) and O_DIRECT only
    what is not cached; half a file dropped from the cache reads right too."""
    path = tmp_path / "warm.bin"
    n = 4 << 20
    data = rand(n, 15)
    path.write_bytes(data.tobytes())  # through the page cache: warm
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, n // 2, n // 4, os.POSIX_FADV_DONTNEED)  # a cold stretch
    finally:
        os.close(fd)
    d = dev(n)
    with ps.override(chunk_size="1M"):
        with pio.open(path, "r") as f:
            if not f.info()["direct"]:
                pytest.skip("no O_DIRECT here: everything is buffered anyway")
            before = pio.stats()
            d.poison()
            assert f.read(d.buf()) == n
            after = pio.stats()
            np.testing.assert_array_equal(d.get(), data)
            assert after["cache_hit_bytes"] - before["cache_hit_bytes"] >= n // 2
        with pio.open(path, "r", direct=True) as f:  # always O_DIRECT: no probe
            before = pio.stats()
            d.poison()
            assert f.read(d.buf()) == n
            assert pio.stats()["cache_hit_bytes"] == before["cache_hit_bytes"]
            np.testing.assert_array_equal(d.get(), data)


@pytest.mark.parametrize("odirect", [False, True])
def test_file_from_a_descriptor(rt, tmp_path, odirect):
    """What the libphxfile adapter does: adopt a caller's descriptor (dup'ed, the
    caller's stays open), with or without O_DIRECT on it."""
    path = tmp_path / "fd.bin"
    data = rand(3 * 4096 + 5, 16)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if odirect else 0), 0o644)
    try:
        f = pio.PhxFile(None, "r+", fd=fd)
        assert f.write(data) == data.nbytes
        out = np.full(data.nbytes, POISON, np.uint8)
        assert f.read(out) == data.nbytes
        f.close()
        np.testing.assert_array_equal(out, data)
        assert os.fstat(fd).st_size == data.nbytes  # still open
        assert bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT) == odirect  # its flags untouched
    finally:
        os.close(fd)
