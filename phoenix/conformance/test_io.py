"""The I/O stack on the vendor under test: files <-> device memory through :mod:`phoenix.io`.

Capabilities (each engine, and each mode where the mode matters):

* ``io_roundtrip``: write device memory to a file and read it back (blocking calls,
  futures, batches, host memory, every device); each mode takes its own path;
* ``io_unaligned``: file offsets, buffer offsets and sizes off every alignment, into
  files with other data around the extent (heads and tails must not clobber it);
* ``io_large_offsets``: sparse files, extents at and beyond 4 GiB, holes read as zeros;
* ``io_eof``: short reads at end of file return the count; bytes beyond it untouched;
* ``io_concurrency``: several threads issuing reads and writes at once, against a reference;
* ``io_stream_ordering``: ``read_async`` / ``write_async`` keep stream order with the
  vendor's copies and with host callbacks;
* ``io_extents``: an extent that runs past its registration (or its allocation) is
  refused with EFAULT and nothing is written, in memory or in the file;
* ``io_errors`` (test_io_errors.py): closed files, wrong open modes, ENOSPC, bad arguments: PhxIOError naming
  file, offset and length; failed stream ops report late and leave the stream working.

Engines: ``io_uring`` and ``threads``, each skipped with the reason where it is not
available; a run with ``PHX_IO_ENGINE`` set (``phx-port test --engine``) tests only that
engine and skips the other with that reason. Modes: ``auto``, ``staged``, ``direct``
(skipped, with the vendor's reason, where device memory is not direct-capable).

Only the runtime contract and :mod:`phoenix.io` are used: device memory is filled and
read back with the vendor's synchronous copies, destinations are poisoned, and every
byte is checked (the extent, and everything around it). Files live in pytest's
temporary directory (under ``/tmp`` unless ``TMPDIR`` says otherwise).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._testing import TEST_HOSTFN, TestHostFn
from phoenix.errors import PhxIOError

from .plugin import (
    CHUNK,
    D2H,
    H2D,
    POISON,
    READBACK_POISON,
    KiB,
    MiB,
    addr,
    assert_bytes,
    fill_device,
    random_bytes,
    read_device,
    write_device,
)

roundtrip = pytest.mark.capability("io_roundtrip")
unaligned = pytest.mark.capability("io_unaligned")
large_offsets = pytest.mark.capability("io_large_offsets")
eof = pytest.mark.capability("io_eof")
concurrency = pytest.mark.capability("io_concurrency")
stream_ordering = pytest.mark.capability("io_stream_ordering")
extents = pytest.mark.capability("io_extents")
io_errors = pytest.mark.capability("io_errors")

GiB = 1 << 30


def staged_path(io, mode: str) -> bool:
    """Whether device memory goes through bounce buffers and the vendor's copies."""
    return mode == "staged" or (mode == "auto" and not io["modes"]["direct"]["available"])


# -- helpers --------------------------------------------------------------------------------


def device_with(rt, mem, data: np.ndarray, device: int = 0) -> int:
    """A device allocation holding ``data``."""
    ptr = mem.dev(data.size, device)
    write_device(rt, ptr, data)
    return ptr


def poisoned_device(rt, mem, n: int, device: int = 0) -> int:
    ptr = mem.dev(n, device)
    fill_device(rt, ptr, n, POISON)
    return ptr


def with_extent(n: int, start: int, data: np.ndarray, fill: int = POISON) -> np.ndarray:
    """``n`` bytes of ``fill`` with ``data`` at ``start``: what a poisoned buffer must hold."""
    out = np.full(n, fill, dtype=np.uint8)
    out[start : start + data.size] = data
    return out


def file_bytes(path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


def pread_file(path, offset: int, n: int) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(os.pread(fd, n, offset), dtype=np.uint8)
    finally:
        os.close(fd)


def make_file(path, data: np.ndarray) -> None:
    with open(path, "wb") as fh:
        fh.write(data.tobytes())


_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class RawLaunch:
    """Queue C host callbacks through the data-path table's ``launch_host_func``.

    That is the entry the I/O core orders its file I/O with, so the order these tests
    observe is the core's. (The runtime's ``launch_host_func`` method is the
    ``stream_ordering`` capability's business.)
    """

    def __init__(self, rt):
        self.table = rt.data_path()
        if not self.table.launch_host_func:
            pytest.fail("the vendor's data-path table has no launch_host_func", pytrace=False)
        self._fn = _LAUNCH(self.table.launch_host_func)

    def __call__(self, stream: int, fn: int, arg: int) -> None:
        rc = self._fn(ctypes.c_void_p(stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))
        assert rc == self.table.success, f"data-path launch_host_func returned {rc}"


# -- io_roundtrip -----------------------------------------------------------------------------


@roundtrip
def test_roundtrip(rt, mem, rng, io, engine, mode, tmp_path):
    """Device -> file -> device: blocking calls, then futures in flight, then a batch."""
    n = 16 * CHUNK + 4096  # several chunks
    data = random_bytes(rng, n)
    src = device_with(rt, mem, data)
    path = tmp_path / "roundtrip.bin"
    with pio.open(path, "w+") as f:
        assert f.write((src, n)) == n
        assert f.size() == n
        assert_bytes(file_bytes(path), data, f"{engine}/{mode}: the file after write")
        dst = poisoned_device(rt, mem, n)
        assert f.read((dst, n)) == n
        assert_bytes(read_device(rt, dst, n), data, f"{engine}/{mode}: device memory after read")

        # eight futures at once: piece i of the file into slot 7-i of the buffer
        piece = n // 8
        fill_device(rt, dst, n, POISON)
        futs = [f.pread((dst, n), piece, i * piece, (7 - i) * piece) for i in range(8)]
        assert [fu.result() for fu in futs] == [piece] * 8
        want = np.concatenate([data[i * piece : (i + 1) * piece] for i in reversed(range(8))])
        assert_bytes(read_device(rt, dst, n), want, f"{engine}/{mode}: eight preads into swapped slots")
        futs = [f.pwrite((dst, n), piece, n + i * piece, i * piece) for i in range(8)]
        assert [fu.result() for fu in futs] == [piece] * 8
        assert_bytes(file_bytes(path), np.concatenate([data, want]), f"{engine}/{mode}: the file after 8 pwrites")

        # a batch of reads into a fresh buffer, pieces in file order
        out = poisoned_device(rt, mem, n)
        results = pio.batch([(f, (out, n), piece, n + i * piece, i * piece, "read") for i in range(8)])
        assert results == [piece] * 8, results
        assert_bytes(read_device(rt, out, n), want, f"{engine}/{mode}: batch of 8 reads")


@roundtrip
def test_modes_take_their_paths(rt, mem, rng, io, engine, mode, tmp_path):
    """staged: bounce buffers and the vendor's copies; direct: straight from device memory;
    io_uring: the kernel rings are entered, threads: never (counted over a write)."""
    n = 4 * CHUNK
    data = random_bytes(rng, n)
    src = device_with(rt, mem, data)
    dst = poisoned_device(rt, mem, n)
    with pio.open(tmp_path / "paths.bin", "w+") as f:
        before = _settled_stats()
        assert f.write((src, n)) == n  # (a write: a read of warm data may be served from a cache)
        after = pio.stats()
        assert f.read((dst, n)) == n
    assert_bytes(read_device(rt, dst, n), data, f"{engine}/{mode}: read back")
    delta = {k: after[k] - before[k] for k in ("chunks_user", "chunks_staged", "chunks_staged_cpu", "uring_enters")}
    if staged_path(io, mode):
        assert delta["chunks_staged"] > 0 and delta["chunks_user"] == 0, f"{mode}: not staged: {delta}"
    else:
        assert delta["chunks_user"] > 0 and delta["chunks_staged"] == 0, f"{mode}: not direct: {delta}"
    if engine == "io_uring":
        assert delta["uring_enters"] > 0, f"the io_uring engine never entered a ring: {delta}"
    else:
        assert delta["uring_enters"] == 0, f"the threads engine entered an io_uring ring: {delta}"


def _settled_stats(quiet_s: float = 0.05, limit_s: float = 5.0) -> dict:
    """The counters once io_uring_enter calls stop moving: they are process-wide, and the
    workers of another context (an earlier test's) count the enter they go to sleep in
    after their caller has its result."""
    last = pio.stats()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = pio.stats()
        if now["uring_enters"] == last["uring_enters"]:
            return now
        last = now
    return last


@roundtrip
def test_roundtrip_host_memory(rt, mem, rng, engine, tmp_path):
    """Pinned and plain (pageable) host memory, in place."""
    n = 5 * CHUNK + 777
    data = random_bytes(rng, n)
    pptr, pview = mem.pinned(n)
    pview[:] = data
    plain = np.full(n, POISON, dtype=np.uint8)
    with pio.open(tmp_path / "host.bin", "w+") as f:
        assert f.write((pptr, n)) == n
        assert f.read(plain) == n
        assert_bytes(plain, data, f"{engine}: file -> pageable host memory")
        pview[:] = POISON
        assert f.read((pptr, n)) == n
        assert_bytes(pview, data, f"{engine}: file -> pinned host memory")


@roundtrip
def test_roundtrip_every_device(rt, mem, rng, engine, devices, tmp_path):
    """Each device's memory to the file and back (a write on one device, the read on the next)."""
    n = 3 * CHUNK + 5
    path = tmp_path / "devices.bin"
    with pio.open(path, "w+") as f:
        for i, d in enumerate(devices):
            data = random_bytes(rng, n)
            src = device_with(rt, mem, data, d.ordinal)
            assert f.write((src, n), n, i * n) == n
            other = devices[(i + 1) % len(devices)].ordinal
            dst = poisoned_device(rt, mem, n, other)
            assert f.read((dst, n), n, i * n) == n
            assert_bytes(read_device(rt, dst, n), data, f"{engine}: device {d.ordinal} -> file -> device {other}")


# -- io_unaligned -----------------------------------------------------------------------------

#: (file offset, buffer offset, size): single bytes, sub-sector, odd offsets, relative
#: misalignment, chunk boundaries crossed, equal misalignment
UNALIGNED = [
    (0, 0, 1),
    (1, 0, 1),
    (4095, 7, 2),
    (511, 513, 4097),
    (12345, 3, 200_000),
    (1, 4095, 3 * CHUNK + 7),
    (3 * CHUNK - 1, 1, 2 * CHUNK + 2),
    (4096 + 17, 4096 + 17, CHUNK),
    (8192, 1, 2 * CHUNK),
]


@unaligned
def test_unaligned_extents(rt, mem, rng, engine, mode, tmp_path):
    """Each extent written into a file of other data (which must survive around it) and
    read back into a poisoned buffer at the same buffer offset."""
    for i, (foff, boff, size) in enumerate(UNALIGNED):
        what = f"{engine}/{mode}: file offset {foff}, buffer offset {boff}, size {size}"
        path = tmp_path / f"unaligned{i}.bin"
        background = random_bytes(rng, foff + size + 5000)
        make_file(path, background)
        data = random_bytes(rng, size)
        nbuf = boff + size + 300
        src = device_with(rt, mem, with_extent(nbuf, boff, data))
        dst = poisoned_device(rt, mem, nbuf)
        with pio.open(path, "r+") as f:
            assert f.write((src, nbuf), size, foff, boff) == size, what
            expect = background.copy()
            expect[foff : foff + size] = data
            assert_bytes(file_bytes(path), expect, f"{what}: the file after write")
            assert f.read((dst, nbuf), size, foff, boff) == size, what
        assert_bytes(read_device(rt, dst, nbuf), with_extent(nbuf, boff, data), f"{what}: the buffer after read")


# -- io_large_offsets -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    """A directory whose file system keeps holes (skips where it does not)."""
    d = tmp_path_factory.mktemp("phx-sparse")
    probe = d / "probe"
    try:
        with open(probe, "wb") as fh:
            fh.truncate(6 * GiB)
            fh.seek(6 * GiB - 1)
            fh.write(b"x")
        blocks = os.stat(probe).st_blocks
    except OSError as exc:
        pytest.skip(f"cannot make a 6 GiB sparse file in {d}: {exc}")
    finally:
        probe.unlink(missing_ok=True)
    if blocks * 512 > 64 * MiB:
        pytest.skip(f"the file system of {d} does not keep holes (a 6 GiB sparse file took {blocks * 512} bytes)")
    return d


#: (file offset, size): straddling 4 GiB, beyond it unaligned, beyond 2^33 aligned
LARGE = [(4 * GiB - 1000, 300_000), (5 * GiB + 123, 200_001), (9 * GiB, 3 * CHUNK)]


@large_offsets
def test_offsets_beyond_4gib(rt, mem, rng, engine, mode, sparse_dir, request):
    path = sparse_dir / f"sparse-{request.node.callspec.id}.bin"
    stream = mem.stream()
    try:
        with pio.open(path, "w+") as f:
            for foff, size in LARGE:
                what = f"{engine}/{mode}: offset {foff:#x}, size {size}"
                data = random_bytes(rng, size)
                src = device_with(rt, mem, data)
                assert f.write((src, size), size, foff) == size, what
                assert_bytes(pread_file(path, foff, size), data, f"{what}: the file after write")
                dst = poisoned_device(rt, mem, size + 8192)
                assert f.pread((dst, size + 8192), size, foff, 8192).result() == size, what
                assert_bytes(
                    read_device(rt, dst, size + 8192), with_extent(size + 8192, 8192, data), f"{what}: pread back"
                )
                fill_device(rt, dst, size + 8192, POISON)
                op = f.read_async((dst, size + 8192), size, foff, 8192, stream)
                rt.stream_synchronize(stream)
                assert op.bytes_done == size, f"{what}: read_async bytes_done {op.bytes_done}"
                assert_bytes(
                    read_device(rt, dst, size + 8192), with_extent(size + 8192, 8192, data), f"{what}: read_async back"
                )
            assert f.size() == LARGE[-1][0] + LARGE[-1][1]
            hole = poisoned_device(rt, mem, 3 * 8192)
            assert f.read((hole, 3 * 8192), 8192, 7 * GiB + 4096, 8192) == 8192
            assert_bytes(
                read_device(rt, hole, 3 * 8192),
                with_extent(3 * 8192, 8192, np.zeros(8192, dtype=np.uint8)),
                f"{engine}/{mode}: a hole at 7 GiB",
            )
        assert os.stat(path).st_blocks * 512 < 64 * MiB, "the file is no longer sparse"
    finally:
        path.unlink(missing_ok=True)


# -- io_eof -------------------------------------------------------------------------------------


@eof
def test_short_reads_at_eof(rt, mem, rng, io, engine, mode, tmp_path):
    path = tmp_path / "eof.bin"
    data = random_bytes(rng, 10_000)
    make_file(path, data)
    n = 30_000
    stream = mem.stream()
    with ps.override(chunk_size="4K"), pio.open(path, "r") as f:
        for how in ("read", "pread", "batch", "read_async"):
            what = f"{engine}/{mode}: {how} of 20000 bytes at 5000 of a 10000-byte file"
            d = poisoned_device(rt, mem, n)
            if how == "read":
                got = f.read((d, n), 20_000, 5_000, 100)
            elif how == "pread":
                got = f.pread((d, n), 20_000, 5_000, 100).result()
            elif how == "batch":
                got = pio.batch([(f, (d, n), 20_000, 5_000, 100, "read")])[0]
            else:
                op = f.read_async((d, n), 20_000, 5_000, 100, stream)
                rt.stream_synchronize(stream)
                got = op.bytes_done
            assert got == 5_000, f"{what}: returned {got!r}, expected the 5000 bytes to end of file"
            out = read_device(rt, d, n)
            assert_bytes(out[100:5_100], data[5_000:], f"{what}: the bytes read")
            assert_bytes(out[:100], np.full(100, POISON, np.uint8), f"{what}: before the extent")
            assert_bytes(out[20_100:], np.full(n - 20_100, POISON, np.uint8), f"{what}: after the extent")
            if staged_path(io, mode):  # only what the file supplied is copied to the device
                assert_bytes(out[5_100:20_100], np.full(15_000, POISON, np.uint8), f"{what}: past end of file")
        d = poisoned_device(rt, mem, 100)
        assert f.read((d, 100), 100, 10_000) == 0, "a read at end of file"
        assert f.read((d, 100), 100, 1 << 40) == 0, "a read far past end of file"
        assert f.pread((d, 100), 0, 0).result() == 0, "a zero-byte read"
        op = f.read_async((d, 100), 100, 20_000, 0, stream)
        rt.stream_synchronize(stream)
        assert op.bytes_done == 0, f"read_async past end of file: bytes_done {op.bytes_done}"
        assert_bytes(read_device(rt, d, 100), np.full(100, POISON, np.uint8), "empty reads wrote something")


# -- io_concurrency ----------------------------------------------------------------------------


@concurrency
def test_threads_issue_mixed_requests(rt, engine, mode, tmp_path):
    """8 threads, each with its own region of one file and its own device buffers, issue
    random reads and writes (some several at once, as futures), checked against a
    reference image of the file; then the whole file is checked."""
    nthreads, ops, region = 8, 24, 256 * KiB
    path = tmp_path / "concurrent.bin"
    g = np.random.default_rng(0xC0C0)
    ref = random_bytes(g, nthreads * region)
    make_file(path, ref)
    errors: list[str] = []

    def worker(k: int, f):
        src = dst = 0
        try:
            rt.set_device(0)
            r = np.random.default_rng(1000 + k)
            mine = random_bytes(r, region)
            src, dst = rt.device_alloc(region, 0), rt.device_alloc(region, 0)
            write_device(rt, src, mine)
            base = k * region
            for i in range(ops):
                batch = []
                for _ in range(int(r.integers(1, 5))):  # 1..4 requests in flight
                    size = int(r.integers(1, 100 * KiB))
                    # disjoint file and buffer slices within this batch: quarters of the region
                    q = len(batch)
                    lo = q * (region // 4)
                    size = min(size, region // 4)
                    fo = lo + int(r.integers(0, region // 4 - size + 1))
                    bo = lo + int(r.integers(0, region // 4 - size + 1))
                    batch.append((fo, bo, size))
                if r.random() < 0.5:
                    futs = [f.pwrite((src, region), size, base + fo, bo) for fo, bo, size in batch]
                    for fu, (fo, bo, size) in zip(futs, batch, strict=True):
                        assert fu.result() == size
                        ref[base + fo : base + fo + size] = mine[bo : bo + size]
                else:
                    fill_device(rt, dst, region, POISON)
                    futs = [f.pread((dst, region), size, base + fo, bo) for fo, bo, size in batch]
                    got = [fu.result() for fu in futs]
                    assert got == [s for _, _, s in batch], f"byte counts {got}"
                    out = read_device(rt, dst, region)
                    want = np.full(region, POISON, dtype=np.uint8)
                    for fo, bo, size in batch:
                        want[bo : bo + size] = ref[base + fo : base + fo + size]
                    if not np.array_equal(out, want):
                        bad = int(np.flatnonzero(out != want)[0])
                        errors.append(
                            f"thread {k} op {i}: reads {batch} (file offset, buffer offset, size; "
                            f"file region at {base}): buffer byte {bad} is 0x{int(out[bad]):02x}, "
                            f"expected 0x{int(want[bad]):02x}"
                        )
                        return
        except Exception as exc:  # reported below, with the thread that saw it
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")
        finally:
            for p in (src, dst):
                if p:
                    rt.device_free(p)

    with pio.open(path, "r+") as f:
        threads = [threading.Thread(target=worker, args=(k, f)) for k in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread is still running after 60 s"
        assert not errors, f"{engine}/{mode}: " + "; ".join(errors[:4])
        assert_bytes(file_bytes(path), ref, f"{engine}/{mode}: the file after the threads' writes")


@concurrency
def test_threads_share_one_buffer(rt, mem, rng, engine, mode, tmp_path):
    """4 threads read disjoint pieces of one file into one device buffer at once."""
    piece, nthreads = 3 * CHUNK + 11, 4
    n = piece * nthreads * 4
    data = random_bytes(rng, n)
    path = tmp_path / "shared.bin"
    make_file(path, data)
    dst = poisoned_device(rt, mem, n)
    errors: list[str] = []

    def worker(k: int, f):
        try:
            for j in range(4):
                i = j * nthreads + k
                got = f.pread((dst, n), piece, i * piece, i * piece).result()
                if got != piece:
                    errors.append(f"thread {k}: piece {i} read {got} bytes")
        except Exception as exc:
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

    with pio.open(path, "r") as f:
        threads = [threading.Thread(target=worker, args=(k, f)) for k in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 60 s"
    assert not errors, "; ".join(errors)
    assert_bytes(read_device(rt, dst, n), data, f"{engine}/{mode}: pieces read by {nthreads} threads")


# -- io_stream_ordering -------------------------------------------------------------------------


@stream_ordering
def test_io_keeps_order_with_copies(rt, mem, rng, engine, mode, tmp_path):
    """[copy P1 -> A] [write A -> file] [copy P2 -> A] [read file -> B] [copy B -> Y]
    [write A -> file]: the write sees P1 and not P2; the read sees the first write and
    not the second; the copy after the read sees its bytes."""
    n = 3 * CHUNK + 1234
    s = mem.stream()
    p1, p1v = mem.pinned(n)
    p2, p2v = mem.pinned(n)
    y, yv = mem.pinned(n)
    p1v[:] = random_bytes(rng, n)
    p2v[:] = random_bytes(rng, n)
    yv[:] = POISON
    a, b = poisoned_device(rt, mem, n), poisoned_device(rt, mem, n)
    path = tmp_path / "order.bin"
    first = tmp_path / "order-first.bin"
    with pio.open(path, "w+") as f, pio.open(first, "w+") as f1:
        rt.memcpy_async(a, p1, n, H2D, s)
        w1 = f.write_async((a, n), n, 0, 0, s)
        w1b = f1.write_async((a, n), n, 0, 0, s)  # a second file: the same bytes
        rt.memcpy_async(a, p2, n, H2D, s)
        r = f.read_async((b, n), n, 0, 0, s)
        rt.memcpy_async(y, b, n, D2H, s)
        w2 = f.write_async((a, n), n, 0, 0, s)
        rt.stream_synchronize(s)
        assert (w1.bytes_done, w1b.bytes_done, r.bytes_done, w2.bytes_done) == (n, n, n, n)
    assert_bytes(file_bytes(first), p1v.copy(), f"{engine}/{mode}: write_async after a copy (the copy's bytes)")
    assert_bytes(yv, p1v.copy(), f"{engine}/{mode}: copy after read_async (the read's bytes, from the first write)")
    assert_bytes(read_device(rt, b, n), p1v.copy(), f"{engine}/{mode}: read_async between two writes")
    assert_bytes(file_bytes(path), p2v.copy(), f"{engine}/{mode}: the last write_async")


@stream_ordering
def test_io_keeps_order_with_callbacks(rt, mem, rng, engine, mode, tmp_path, chelper):
    """[gate] [callback fills H] [copy H -> A] [write A -> file] [callback snapshots the
    file] [read file -> B] [copy B -> Y]: while the gate holds the stream nothing after it
    has run (results unbound, the file untouched); then each step sees the one before."""
    n = 2 * CHUNK + 999
    foff = 3000
    launch = RawLaunch(rt)
    s = mem.stream()
    src, srcv = mem.pinned(n)
    h, hv = mem.pinned(n)
    y, yv = mem.pinned(n)
    data = random_bytes(rng, n)
    srcv[:] = data
    hv[:] = POISON
    yv[:] = POISON
    a, b = poisoned_device(rt, mem, n), poisoned_device(rt, mem, n)
    path = tmp_path / "callbacks.bin"
    background = random_bytes(rng, foff + n + 100)
    make_file(path, background)
    snap = mem.keep(np.full(n, READBACK_POISON, dtype=np.uint8))
    counter = mem.keep(ctypes.c_int64(0))
    gate = mem.keep(ctypes.c_int(0))
    hold = chelper.task(gate=gate, gate_timeout_s=5.0)
    fill = chelper.task(src=src, dst=h, n=n)
    fd = os.open(path, os.O_RDONLY)
    try:
        shot = mem.keep(
            TestHostFn(
                kind=1, fd=fd, dst=addr(snap), size=n, offset=foff, counter=ctypes.pointer(counter), seq=-1, result=-999
            )
        )
        # the pool for these settings is started and its bounce buffers pinned before the
        # stream is held: pinning (cudaHostRegister) may wait for busy streams, and this
        # test's gate keeps the stream busy until the caller goes on (see io.prepare)
        pio.prepare()
        with pio.open(path, "r+") as f:
            try:
                launch(s, chelper.fn, hold.address)
                launch(s, chelper.fn, fill.address)
                rt.memcpy_async(a, h, n, H2D, s)
                w = f.write_async((a, n), n, foff, 0, s)
                launch(s, TEST_HOSTFN, ctypes.addressof(shot))
                r = f.read_async((b, n), n, foff, 0, s)
                rt.memcpy_async(y, b, n, D2H, s)
                time.sleep(0.05)
                held = (w.bytes_done, r.bytes_done, fill.calls, shot.seq)
                untouched = np.array_equal(file_bytes(path), background)
            finally:
                gate.value = 1
                rt.stream_synchronize(s)
            assert not hold.gate_timed_out, "the gate callback timed out (did it run at launch, holding the caller?)"
            assert held == (None, None, 0, -1), (
                f"work queued behind a closed gate ran: (write, read, fill callback, file snapshot) = {held}"
            )
            assert untouched, "the file changed while the stream was held before the write_async"
            assert (w.bytes_done, r.bytes_done) == (n, n), (w.bytes_done, r.bytes_done)
        assert shot.result == n, f"the file snapshot callback read {shot.result}"
    finally:
        os.close(fd)
    assert_bytes(hv, data, "the fill callback")
    assert_bytes(
        snap,
        data,
        f"{engine}/{mode}: a callback after write_async sees the file written "
        "(with the bytes of a callback before the copy before it)",
    )
    assert_bytes(yv, data, f"{engine}/{mode}: a copy after read_async")
    assert_bytes(
        file_bytes(path),
        np.concatenate([background[:foff], data, background[foff + n :]]),
        f"{engine}/{mode}: the file",
    )


# -- io_extents ----------------------------------------------------------------------------------


@extents
def test_extent_past_registration_is_served_and_past_allocation_refused(rt, mem, rng, engine, mode, tmp_path):
    """A registered device range inside a larger allocation (guard bytes around it): an
    extent that starts inside the registration and runs on into the rest of the allocation
    is valid memory, served (the part past the registration as unregistered memory) by
    read, write, batch, read_async and write_async, every byte in place and nothing beside
    it touched; one that runs past the allocation is refused with EFAULT and nothing changes,
    in device memory (every byte, guards included) or in the file."""
    guard, n = 4096, 16 * KiB + 5
    total = guard + n + guard
    base = poisoned_device(rt, mem, total)
    reg = base + guard
    path = tmp_path / "extent.bin"
    background = random_bytes(rng, 2 * n + 2 * guard)
    make_file(path, background)
    regs_before = pio.stats()["registrations"]
    s = mem.stream()
    assert pio.register((reg, n)) == reg
    try:
        assert pio.stats()["registrations"] == regs_before + 1
        view = (reg, n + guard)  # the registration and the rest of its allocation
        past = [(0, n + 1), (n - 1, 2), (n // 2, n - n // 2 + 1), (n - 100, 4096), (0, n + guard)]
        with pio.open(path, "r+") as f:
            for boff, size in past:
                what = f"{engine}/{mode}: extent [{boff}, +{size}) of a {n}-byte registration"
                make_file(path, background)  # (the writes below change it)
                for op in ("read", "read_async", "batch"):
                    fill_device(rt, base, total, POISON)
                    if op == "read":
                        got = f.read(view, size, 100, boff)
                    elif op == "read_async":
                        got = f.read_async(view, size, 100, boff, s).result()
                    else:
                        # (two requests: a batch of one is submitted alone; the other into the front guard)
                        got = pio.batch([(f, view, size, 100, boff, "read"), (f, (base, guard), 1, 0, 0, "read")])[0]
                    rt.stream_synchronize(s)
                    assert got == size, f"{what}: {op} moved {got}"
                    want = with_extent(total, guard + boff, background[100 : 100 + size])
                    if op == "batch":
                        want[0] = background[0]
                    assert_bytes(read_device(rt, base, total), want, f"{what}: device memory after {op}")
                for op in ("write", "write_async"):
                    make_file(path, background)
                    data = random_bytes(rng, size)
                    write_device(rt, reg + boff, data)
                    if op == "write":
                        got = f.write(view, size, 100, boff)
                    else:
                        got = f.write_async(view, size, 100, boff, s).result()
                    assert got == size, f"{what}: {op} moved {got}"
                    want = background.copy()
                    want[100 : 100 + size] = data
                    assert_bytes(file_bytes(path), want, f"{what}: the file after {op}")
            make_file(path, background)
            fill_device(rt, base, total, POISON)
            # past the allocation: refused, whatever the buffer claims
            over = (reg, n + guard + 2 * guard)
            poison = np.full(total, POISON, dtype=np.uint8)
            for boff, size in [(0, n + guard + 1), (n + guard - 1, 2), (n, guard + 4096)]:
                what = f"{engine}/{mode}: extent [{boff}, +{size}) past the allocation's end ({n + guard} bytes on)"
                for op in ("read", "write", "read_async", "write_async"):
                    with pytest.raises(PhxIOError) as ei:
                        if op in ("read", "write"):
                            getattr(f, op)(over, size, 100, boff)
                        else:
                            getattr(f, op)(over, size, 100, boff, s)
                    e = ei.value
                    assert e.errno == errno.EFAULT, f"{what}: {op} raised errno {e.errno} ({e}), not EFAULT"
                    assert (e.path, e.offset, e.length) == (str(path), 100, size), f"{what}: {op}: {e}"
                res = pio.batch([(f, over, size, 0, boff, "read"), (f, over, size, 0, boff, "write")])
                assert all(isinstance(x, PhxIOError) and x.errno == errno.EFAULT for x in res), f"{what}: batch {res}"
                rt.stream_synchronize(s)
                assert_bytes(read_device(rt, base, total), poison, f"{what}: device memory after the refusals")
                assert_bytes(file_bytes(path), background, f"{what}: the file after the refusals")
            assert f.read((reg, n), n, 0) == n
        got = read_device(rt, base, total)
        assert_bytes(
            got, with_extent(total, guard, background[:n]), f"{engine}/{mode}: a full read of the registration"
        )
    finally:
        pio.deregister((reg, n))
    assert pio.stats()["registrations"] == regs_before


@extents
def test_extent_past_allocation_is_refused(rt, mem, rng, engine, tmp_path):
    """An unregistered buffer that claims more than its device allocation: the part past
    the allocation is refused with EFAULT; nothing is written."""
    n = 64 * KiB  # (the contract: the byte after a 64 KiB allocation is not inside it)
    ptr = poisoned_device(rt, mem, n)
    path = tmp_path / "alloc.bin"
    background = random_bytes(rng, 4 * n)
    make_file(path, background)
    with pio.open(path, "r+") as f:
        for op in ("read", "write"):
            with pytest.raises(PhxIOError) as ei:
                getattr(f, op)((ptr, 2 * n), n + 1, 0, 0)
            assert ei.value.errno == errno.EFAULT, f"{op}: {ei.value}"
            with pytest.raises(PhxIOError) as ei:
                getattr(f, op)((ptr, n), n + 1, 0, 0)  # past the buffer given
            assert ei.value.errno == errno.EFAULT, f"{op}: {ei.value}"
    assert_bytes(read_device(rt, ptr, n), np.full(n, POISON, np.uint8), "device memory after the refusals")
    assert_bytes(file_bytes(path), background, "the file after the refusals")


# -- io_errors -----------------------------------------------------------------------------------
