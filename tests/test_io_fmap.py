"""The file-mapping registration cache (warm reads into device memory), on the host vendor.

A staged read into device memory of a file range that is in the page cache is served,
once the range's window is mmap'd and host-registered, by one vendor copy from the
mapping. Every test uses random bytes, poisons its destination and checks every byte:
the extent read and that nothing around it was touched. Windows are 2 MiB here so that
small files span several.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from _devmem import POISON, Dev, check_extent  # tests/_devmem.py

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._testing import TEST_HOSTFN, TestHostFn, inject_fault
from phoenix.vendor import CopyKind

W = 2 << 20
ENGINES = ["io_uring", "threads"]


@pytest.fixture(autouse=True)
def _fresh(rt):
    pio.shutdown()  # each test starts with an empty cache
    yield
    pio.shutdown()


def make_file(path, size, seed=1):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    data.tofile(path)
    return data


def fmap(**kw):
    kw.setdefault("fmap_window", W)
    kw.setdefault("mode", "staged")
    return ps.override(**kw)


def hits():
    return pio.stats()["fmap_hits"]


def test_warm_read_hits_after_first_read(rt, dev, tmp_path, request):
    """auto: the first read misses (served staged) and queues the registration; after
    fmap_wait the next read is one copy from the mapping."""
    for engine in ENGINES:
        pio.shutdown()
        path = tmp_path / f"warm-{engine}.bin"
        size = 5 * W + 123
        data = make_file(path, size)
        d = dev(size + 8192)
        with fmap(fmap_mode="auto", engine=engine), pio.open(path) as f:
            st0 = pio.stats()
            assert f.read(d.buf(), size, 0, 4096) == size
            check_extent(d.get(), data, 4096, size)
            st1 = pio.stats()
            assert st1["fmap_misses"] == st0["fmap_misses"] + 1 and st1["fmap_hits"] == st0["fmap_hits"]
            assert pio.fmap_wait(timeout=30)
            info = pio.fmap_info()
            assert info["windows"] == 6 and info["pending"] == 0 and info["mode"] == "auto"
            assert pio.stats()["fmap_windows"] == 6 and pio.stats()["fmap_bytes"] == 5 * W + 4096
            d.poison()
            staged_before = pio.stats()["chunks_staged"]
            assert f.read(d.buf(), size, 0, 4096) == size
            st2 = pio.stats()
            assert st2["fmap_hits"] == st1["fmap_hits"] + 1
            assert st2["chunks_staged"] == staged_before  # no bounce buffer, no file I/O
            check_extent(d.get(), data, 4096, size)
            assert pio._fmap_lookup(f, 100, 1000) is not None


def test_sync_mode_hits_at_once_and_close_keeps_windows(rt, dev, tmp_path):
    path = tmp_path / "sync.bin"
    size = 3 * W
    data = make_file(path, size, 2)
    d = dev(size)
    with fmap(fmap_mode="sync"):
        with pio.open(path) as f:
            h0 = hits()
            assert f.read(d.buf()) == size
            assert hits() == h0 + 1
            check_extent(d.get(), data, 0, size)
        # closing keeps the windows: a new open of the same file hits
        assert pio.fmap_info()["windows"] == 3
        with pio.open(path) as f:
            d.poison()
            assert f.read(d.buf()) == size
            assert hits() == h0 + 2
            assert pio.fmap_info()["registrations"] == 3
            check_extent(d.get(), data, 0, size)


def test_unaligned_extents_within_a_hit(rt, dev, tmp_path):
    path = tmp_path / "unaligned.bin"
    size = 4 * W + 777
    data = make_file(path, size, 3)
    rng = np.random.default_rng(7)
    d = dev(size + 16384)
    with fmap(fmap_mode="sync"), pio.open(path) as f:
        f.read(d.buf(), size, 0, 0)  # registers every window
        for _ in range(60):
            n = int(rng.integers(1, 3 * W))
            off = int(rng.integers(0, size - n))
            boff = int(rng.integers(0, 16384))
            d.poison()
            h0 = hits()
            assert f.read(d.buf(), n, off, boff) == n
            assert hits() == h0 + 1
            check_extent(d.get(), data[off:], boff, n)


def test_read_spanning_windows_and_past_eof(rt, dev, tmp_path):
    path = tmp_path / "span.bin"
    size = 2 * W + 5000
    data = make_file(path, size, 4)
    d = dev(3 * W)
    with fmap(fmap_mode="sync"), pio.open(path) as f:
        # across the border of windows 0 and 1
        assert f.read(d.buf(), 6000, W - 3000, 100) == 6000
        check_extent(d.get(), data[W - 3000 :], 100, 6000)
        assert pio.fmap_info()["windows"] == 2
        # across all three windows, running past the end of the file: a short count
        d.poison()
        h0 = hits()
        assert f.read(d.buf(), 3 * W - 64, 32, 64) == size - 32
        assert hits() == h0 + 1
        check_extent(d.get(), data[32:], 64, size - 32)
        # entirely past the end: 0, nothing touched
        d.poison()
        assert f.read(d.buf(), 4096, size + 10, 0) == 0
        assert (d.get() == POISON).all()


def test_write_through_phoenix_invalidates(rt, dev, tmp_path):
    path = tmp_path / "write.bin"
    size = 3 * W
    data = make_file(path, size, 5)
    d = dev(size)
    with fmap(fmap_mode="sync"), pio.open(path, "r+") as f:
        assert f.read(d.buf()) == size
        assert pio.fmap_info()["windows"] == 3
        new = np.random.default_rng(9).integers(0, 256, 5000, dtype=np.uint8)
        assert f.write(new, 5000, W + 100) == 5000  # window 1 only
        info = pio.fmap_info()
        assert info["windows"] == 2 and info["invalidations"] >= 1
        assert pio._fmap_lookup(f, W, 10) is None
        # the others are dropped at their next lookup: the write changed the file's mtime
        assert pio._fmap_lookup(f, 0, 10) is None
        data[W + 100 : W + 5100] = new
        d.poison()
        assert f.read(d.buf()) == size
        check_extent(d.get(), data, 0, size)
        # a write from device memory (staged) invalidates as well
        src = dev(W)
        src_bytes = np.random.default_rng(10).integers(0, 256, W, dtype=np.uint8)
        rt.memcpy(src.ptr, src_bytes.ctypes.data, W, CopyKind.HOST_TO_DEVICE)
        assert f.write(src.buf(), 1000, 2 * W + 10) == 1000
        data[2 * W + 10 : 2 * W + 1010] = src_bytes[:1000]
        assert pio._fmap_lookup(f, 2 * W, 10) is None
        d.poison()
        assert f.read(d.buf()) == size
        check_extent(d.get(), data, 0, size)


def test_external_modification_invalidates(rt, dev, tmp_path):
    path = tmp_path / "external.bin"
    size = 2 * W
    data = make_file(path, size, 6)
    d = dev(size + W)
    with fmap(fmap_mode="auto"), pio.open(path) as f:
        f.read(d.buf(), size)
        assert pio.fmap_wait(timeout=30)
        assert pio.fmap_info()["windows"] == 2
        st = os.stat(path)
        # another writer: new bytes and a new mtime (set explicitly: the file system's
        # clock may be coarser than the test)
        new = np.random.default_rng(11).integers(0, 256, 4096, dtype=np.uint8)
        with open(path, "r+b") as g:
            g.seek(12345)
            g.write(new.tobytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        data[12345 : 12345 + 4096] = new
        d.poison()
        m0 = pio.stats()["fmap_misses"]
        assert f.read(d.buf(), size) == size
        assert pio.stats()["fmap_misses"] == m0 + 1  # the stale windows were dropped
        check_extent(d.get(), data, 0, size)
        assert pio.fmap_info()["invalidations"] == 2
        assert pio.fmap_wait(timeout=30)
        # the file grows: a size change drops them too, and the new bytes are read
        more = np.random.default_rng(12).integers(0, 256, 1000, dtype=np.uint8)
        with open(path, "ab") as g:
            g.write(more.tobytes())
        data = np.concatenate([data, more])
        d.poison()
        h0 = hits()
        assert f.read(d.buf(), size + 1000) == size + 1000
        assert hits() == h0
        check_extent(d.get(), data, 0, size + 1000)


def test_eviction_under_a_tiny_budget(rt, dev, tmp_path):
    path = tmp_path / "evict.bin"
    size = 5 * W
    data = make_file(path, size, 7)
    d = dev(W)
    with fmap(fmap_mode="sync", fmap_cache=2 * W), pio.open(path) as f:
        for _round in range(2):
            for w in range(5):
                d.poison()
                assert f.read(d.buf(), W, w * W) == W
                check_extent(d.get(), data[w * W :], 0, W)
                st = pio.stats()
                assert st["fmap_bytes"] <= 2 * W and st["fmap_windows"] <= 2
        info = pio.fmap_info()
        assert info["evictions"] >= 8 and info["windows"] == 2
        # the most recent two stay
        assert pio._fmap_lookup(f, 4 * W, 1) is not None and pio._fmap_lookup(f, 3 * W, 1) is not None
        assert pio._fmap_lookup(f, 0, 1) is None
        # a window larger than the budget is never registered
    with fmap(fmap_mode="sync", fmap_cache=W, fmap_window=2 * W), pio.open(path) as f:
        d.poison()
        assert f.read(d.buf(), W, 0) == W
        check_extent(d.get(), data, 0, W)
        assert pio.fmap_info()["windows"] == 0


def test_fmap_off(rt, dev, tmp_path):
    path = tmp_path / "off.bin"
    size = 2 * W
    data = make_file(path, size, 8)
    d = dev(size)
    for kw in ({"fmap_mode": "off"}, {"fmap_cache": 0}):
        with fmap(**kw), pio.open(path) as f:
            h0, m0 = hits(), pio.stats()["fmap_misses"]
            for _ in range(2):
                d.poison()
                assert f.read(d.buf()) == size
                check_extent(d.get(), data, 0, size)
            assert pio.fmap_wait(timeout=5)
            assert hits() == h0 and pio.stats()["fmap_misses"] == m0
            assert pio.fmap_info()["windows"] == 0 and pio.fmap_info()["mode"] == "off"
            assert not pio.capabilities(tmp_path)["modes"]["zero_copy_file_mappings"]["available"]


def test_not_for_host_memory_direct_files_or_faults(rt, dev, tmp_path):
    path = tmp_path / "nohost.bin"
    size = W
    data = make_file(path, size, 13)
    with fmap(fmap_mode="sync"):
        with pio.open(path) as f:
            host = np.full(size, POISON, np.uint8)
            assert f.read(host) == size
            np.testing.assert_array_equal(host, data)
            assert pio.fmap_info()["windows"] == 0  # host memory is read in place
        d = dev(size)
        try:
            with pio.open(path, direct=True) as f:
                assert f.read(d.buf()) == size
                assert pio.fmap_info()["windows"] == 0
        except OSError:
            pass  # no O_DIRECT on this file system
        with pio.open(path) as f:
            inject_fault(f, 0, 100, 5)  # EIO: the fault must still be seen
            with pytest.raises(OSError):
                f.read(d.buf())
            assert pio.fmap_info()["windows"] == 0


def test_unregistrable_window_is_not_retried(rt, dev, tmp_path):
    path = tmp_path / "unreg.bin"
    size = W
    data = make_file(path, size, 14)
    d = dev(size)
    # the host vendor refuses flags above 0xF, with or without read-only
    with fmap(fmap_mode="sync", fmap_register_flags=0x18), pio.open(path) as f:
        for _ in range(3):
            d.poison()
            assert f.read(d.buf()) == size
            check_extent(d.get(), data, 0, size)
        info = pio.fmap_info()
        assert info["unregistrable"] == 1 and info["windows"] == 0 and info["registrations"] == 0
    # read-only accepted by the host vendor: 9 (portable | read-only) and 1 both work
    for flags in (9, 1, 0):
        pio.shutdown()
        with fmap(fmap_mode="sync", fmap_register_flags=flags), pio.open(path) as f:
            d.poison()
            assert f.read(d.buf()) == size
            assert pio.fmap_info()["windows"] == 1
            check_extent(d.get(), data, 0, size)


def test_no_leaks_after_fmap_clear(rt, dev, tmp_path):
    path = tmp_path / "leak.bin"
    size = 3 * W + 1
    data = make_file(path, size, 15)
    d = dev(size)
    base_threads = pio.stats()["threads"]
    with fmap(fmap_mode="auto"), pio.open(path) as f:
        f.read(d.buf())
        assert pio.fmap_wait(timeout=30)
        st = pio.stats()
        assert st["fmap_windows"] == 4 and st["fmap_bytes"] == 3 * W + 4096
        assert pio.fmap_clear() == 4
        st = pio.stats()
        assert st["fmap_windows"] == 0 and st["fmap_bytes"] == 0
        assert pio.fmap_info()["windows"] == 0 and pio.fmap_info()["in_use"] == 0
        d.poison()
        assert f.read(d.buf()) == size  # a miss again, re-queued
        check_extent(d.get(), data, 0, size)
        assert pio.fmap_wait(timeout=30)
        assert pio.stats()["fmap_windows"] == 4
    pio.shutdown()  # context destroy releases everything and stops the registrar
    st = pio.stats()
    assert st["fmap_windows"] == 0 and st["fmap_bytes"] == 0 and st["threads"] == base_threads
    assert st["contexts"] == 0


def test_concurrent_readers_of_one_window(rt, dev, tmp_path):
    path = tmp_path / "concurrent.bin"
    size = 2 * W + 333
    data = make_file(path, size, 16)
    errors: list = []
    stop = threading.Event()

    def reader(tid):
        rng = np.random.default_rng(100 + tid)
        d = Dev(rt, size + 4096)
        try:
            for _ in range(40):
                n = int(rng.integers(1, size))
                off = int(rng.integers(0, size - n + 1))
                boff = int(rng.integers(0, 4096))
                d.poison()
                assert f.read(d.buf(), n, off, boff) == n
                check_extent(d.get(), data[off:], boff, n)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            d.free()

    def clearer():
        while not stop.is_set():
            pio.fmap_clear()  # windows dropped while readers copy from them
            stop.wait(0.002)

    for mode in ("sync", "auto"):
        pio.shutdown()
        with fmap(fmap_mode=mode), pio.open(path) as f:
            ts = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
            c = threading.Thread(target=clearer)
            for t in ts:
                t.start()
            c.start()
            for t in ts:
                t.join()
            stop.set()
            c.join()
            stop.clear()
            assert not errors, errors[0]
            assert pio.fmap_wait(timeout=30)
            assert pio.fmap_info()["in_use"] == 0
            assert pio.stats()["requests"] == 0
        assert pio.stats()["fmap_hits"] > 0
    pio.shutdown()
    assert pio.stats()["fmap_windows"] == 0 and pio.stats()["fmap_bytes"] == 0


def test_settings_and_capabilities(rt, tmp_path):
    with ps.override(fmap_mode="sync", fmap_window="4M", fmap_cache="1G", fmap_register_flags="0x9"):
        s = ps.get()
        assert (s.fmap_mode, s.fmap_window, s.fmap_cache, s.fmap_register_flags) == ("sync", 4 << 20, 1 << 30, 9)
        caps = pio.capabilities(tmp_path)["modes"]["zero_copy_file_mappings"]
        assert caps["available"] and caps["state"]["window"] == 4 << 20 and caps["state"]["mode"] == "sync"
    for bad in ({"fmap_window": "3M"}, {"fmap_mode": "maybe"}, {"fmap_cache": -1}):
        with pytest.raises(ValueError):
            ps.override(**bad).__enter__()
    assert {r["name"] for r in ps.describe()} >= {"fmap_cache", "fmap_mode", "fmap_window", "fmap_register_flags"}


def test_registration_waits_until_the_context_is_idle(rt, dev, tmp_path):
    """A miss queues its windows, but the registrar page-locks them only once no request or
    stream op of the context is in flight (on CUDA, cudaHostRegister beside a first read
    slows it, and can hold a driver lock that the application's calls then wait for): while
    a gate holds a stream-ordered read, nothing is registered; after it, the window is."""
    import ctypes
    import time

    path = tmp_path / "idle.bin"
    size = W + 4096
    data = make_file(path, size, seed=7)
    d, e = dev(size), dev(size)
    s = rt.stream_create(0)
    gate = ctypes.c_int64(0)
    hold = TestHostFn(kind=2, src=ctypes.addressof(gate), seq=-1, result=-999)
    seen = []
    try:
        with fmap(fmap_mode="auto"), pio.open(path) as f:
            rt.launch_host_func(s, TEST_HOSTFN, ctypes.addressof(hold))
            try:
                r = f.read_async(e.buf(), size, 0, 0, s)  # in flight behind the gate
                assert f.read(d.buf(), size, 0, 0) == size  # a miss: its windows are queued
                check_extent(d.get(), data, 0, size)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 0.5:
                    seen.append(pio.fmap_info()["windows"])
                    time.sleep(0.02)
                pending = pio.fmap_info()["pending"]
            finally:
                gate.value = 1  # before anything can raise: close() waits for the read
                rt.stream_synchronize(s)
            assert set(seen) == {0}, f"registered while a stream op was in flight: windows {seen}"
            assert pending >= 1
            assert r.result() == size
            assert pio.fmap_wait(timeout=30)
            assert pio.fmap_info()["windows"] == 2 and pio.fmap_info()["pending"] == 0
            check_extent(e.get(), data, 0, size)
            e.poison()
            assert f.read(e.buf(), size, 0, 0) == size
            check_extent(e.get(), data, 0, size)
    finally:
        gate.value = 1
        rt.stream_synchronize(s)
        rt.stream_destroy(s)


def test_window_with_holes_between_the_samples_is_not_registered(rt, dev, tmp_path):
    """The submit path judges a large window's residency from eight 1 MiB samples; the
    registrar checks every page before it maps the window (MAP_POPULATE would read the
    missing pages from the disk). A 64 MiB window whose samples are cached but whose pages
    between them are not: queued, then dropped, never registered; the bytes read are right."""
    win, mib = 64 << 20, 1 << 20
    path = tmp_path / "holes.bin"
    data = make_file(path, win)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        step = (win - mib) // 7  # where the samples are (phoenix/csrc/io_fmap.c, resident_sampled)
        for i in range(7):  # evict most of each gap between two samples
            os.posix_fadvise(fd, i * step + mib + 65536, step - mib - 131072, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    d = dev(win)
    with fmap(fmap_mode="auto", fmap_window=win, chunk_size="1M"), pio.open(path) as f:
        st0 = pio.stats()
        assert f.read(d.buf(), win, 0, 0) == win
        assert pio.stats()["fmap_misses"] == st0["fmap_misses"] + 1
        assert pio.fmap_wait(timeout=30)
        info = pio.fmap_info()
        assert info["windows"] == 0 and info["pending"] == 0, info
    np.testing.assert_array_equal(d.get(), data)


def _cached_pages(path) -> int | None:
    """Pages of ``path`` in the page cache (cachestat(2), Linux 6.5+), None if unknown."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, os.path.getsize(path))
    cs = (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, rng, cs, 0) != 0:
            return None
    finally:
        os.close(fd)
    return cs[0]


def test_page_cache_reads_are_staged_in_small_chunks(rt, dev, tmp_path):
    """A miss whose range is in the page cache is staged in 4 MiB chunks whatever the
    chunk size (a memory copy then a DMA: smaller chunks overlap the two); a range that
    is not cached keeps the configured chunks. Every byte checked both times."""
    path = tmp_path / "cached.bin"
    size = (20 << 20) + 4097
    data = make_file(path, size)
    d = dev(size + 8192)
    with fmap(fmap_mode="auto", fmap_window=64 << 20, chunk_size="16M"), pio.open(path) as f:
        st0 = pio.stats()
        assert f.read(d.buf(), size, 0, 4096) == size
        st1 = pio.stats()
        check_extent(d.get(), data, 4096, size)
        assert st1["fmap_misses"] == st0["fmap_misses"] + 1
        assert st1["chunks_staged"] - st0["chunks_staged"] == -(-size // (4 << 20))  # 6, not 2
    # one worker: its cached chunks take at most 4 slots at a time (parked until a copy
    # returns one); every byte still arrives and every slot comes back
    for threads in (1, 2):
        pio.shutdown()
        d.poison()
        with fmap(fmap_mode="auto", fmap_window=64 << 20, chunk_size="16M", threads=threads), pio.open(path) as f:
            assert f.read(d.buf(), size, 0, 4096) == size
            check_extent(d.get(), data, 4096, size)
            assert pio.stats()["bounce_in_use"] == 0
    pio.shutdown()  # no registered windows (they pin the pages)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _cached_pages(path) != 0:
        pytest.skip("this file system keeps the file cached (or cachestat is missing): no cold read to compare")
    d.poison()
    with fmap(fmap_mode="auto", fmap_window=64 << 20, chunk_size="16M"), pio.open(path) as f:
        st0 = pio.stats()
        assert f.read(d.buf(), size, 0, 4096) == size
        st1 = pio.stats()
        check_extent(d.get(), data, 4096, size)
        assert st1["chunks_staged"] - st0["chunks_staged"] == -(-size // (16 << 20))  # 2


def test_reads_and_writes_racing_keep_the_queue_bounded_and_clear_returns(rt, dev, tmp_path):
    """Device-memory reads of a cached file that is also written (each write drops the
    window a read queued; the next read queues it again) while host reads keep the context
    busy (the registrar waits for it to be idle): the registration queue stays bounded
    (FMAP_PENDING_MAX, each entry holds a descriptor: once it grew by hundreds a second
    until the process ran out of them), fmap_clear returns while the I/O goes on, and every
    byte read into device memory is what the file held."""
    path = tmp_path / "race.bin"
    n = 8 * W
    data = make_file(path, n, 31)
    stop = threading.Event()
    errors: list = []
    fds0 = len(os.listdir("/proc/self/fd"))
    with fmap(fmap_mode="auto", fmap_window=n), pio.open(path, "r+") as f:  # one window: every read wants it

        def host_reader(k):
            b = np.empty(1 << 20, np.uint8)
            while not stop.is_set():
                f.read(b, 1 << 20, (k % 16) << 20)

        def dev_reader_writer(k):
            d = dev(1 << 20)
            same = data[k << 20 : (k << 20) + 4096]  # writes of what the file holds: reads stay checkable
            i = 0
            try:
                while not stop.is_set():
                    off = ((i + k) % 16) << 20
                    d.poison()
                    assert f.read(d.buf(), 1 << 20, off) == 1 << 20
                    check_extent(d.get(), data[off:], 0, 1 << 20)
                    assert f.write(same, 4096, k << 20) == 4096
                    i += 1
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        threads = [threading.Thread(target=host_reader, args=(k,)) for k in range(4)]
        threads += [threading.Thread(target=dev_reader_writer, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        most, most_fds = 0, 0
        try:
            for _ in range(30):
                stop.wait(0.1)
                most = max(most, pio.fmap_info()["pending"])
                most_fds = max(most_fds, len(os.listdir("/proc/self/fd")))
            cleared = threading.Event()
            threading.Thread(target=lambda: (pio.fmap_clear(), cleared.set()), daemon=True).start()
            assert cleared.wait(20), "fmap_clear did not return while the I/O went on"
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not errors, errors[0]
    assert most <= 64, f"{most} window registrations queued"
    assert most_fds <= fds0 + 64 + 32, f"{most_fds} descriptors open (from {fds0})"
