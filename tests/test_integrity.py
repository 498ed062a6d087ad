"""Nothing lost, nothing corrupted: the bad-input, odd-setting and shutdown defects, each
with the test that showed it (host vendor, both engines).

* small bounce pools and chunk sizes that are not powers of two: every byte moves (the
  planner cut requests at multiples of a non-power-of-two chunk with a bit mask, and
  skipped chunks while counting them done);
* integers crossing into C are checked (2**64 became 0), paths refuse NUL, element sizes
  come from the exporter (``<U4`` is 16 bytes), a malformed batch request fails alone;
* ``read_many`` extents that leave the device allocation are refused as ``read`` refuses
  them (they wrote into the next allocation);
* ``shutdown()`` under submitting threads, and stream ops beside blocking staged I/O with
  one worker and a 1 MiB pool, neither crash nor hang (subprocesses with a timeout).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.checks import ArgumentError
from phoenix.errors import PhxIOError
from phoenix.vendor import CopyKind, parse_size

ENGINES = ("io_uring", "threads")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def rt():
    from phoenix.registry import get_runtime

    runtime = get_runtime("host")
    pio.use_runtime(runtime)
    yield runtime
    pio.shutdown()
    pio.use_runtime(None)


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def run_py(code: str, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PHX_VENDOR="host", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- pools and chunks of any accepted size ---------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "pool,chunk", [("1M", "8M"), ("16M", "8M"), ("1M", "4K"), ("2M", "12K"), ("4M", "20K"), ("auto", "392K")]
)
def test_small_pools_and_odd_chunks_move_every_byte(rt, tmp_path, engine, pool, chunk):
    """Host memory at an odd address (bounced through slots) and host-vendor device memory
    staged through the pool: writes then reads of odd sizes at odd offsets, every byte,
    the bytes around each extent untouched."""
    path = tmp_path / "pool.bin"
    n = 3 * (1 << 20) + 4097
    data = rand(n + 1, 1)[1:]
    with ps.override(engine=engine, bounce_pool_size=pool, chunk_size=chunk, threads=2):
        big = np.zeros(n + 2, np.uint8)
        src = big[1:-1]  # not page aligned
        src[:] = data
        with pio.open(path, "w+") as f:
            assert f.write(src, n, 777) == n
        on_file = np.fromfile(path, np.uint8)
        assert on_file.size == 777 + n and (on_file[:777] == 0).all()
        assert np.array_equal(on_file[777:], data), f"{np.count_nonzero(on_file[777:] != data)} bytes wrong"
        dst_big = np.full(n + 2, 0xA5, np.uint8)
        with pio.open(path) as f:
            assert f.read(dst_big[1:-1], n, 777) == n
        assert np.array_equal(dst_big[1:-1], data) and dst_big[0] == dst_big[-1] == 0xA5
        dev = rt.device_alloc(n + 8192)
        try:
            with ps.override(mode="staged"), pio.open(path, "r+") as f:
                assert f.read((dev, n + 8192), n, 777, 4096) == n
                out = np.empty(n + 8192, np.uint8)
                assert f.write((dev, n + 8192), n, 0, 4096) == n
            rt.memcpy(out.ctypes.data, dev, n + 8192, CopyKind.DEVICE_TO_HOST)
            assert np.array_equal(out[4096 : 4096 + n], data)
            assert np.array_equal(np.fromfile(path, np.uint8)[:n], data)
        finally:
            rt.device_free(dev)


# ---- the boundary into C ---------------------------------------------------------------------


def test_integers_are_checked_at_the_boundary(rt, tmp_path):
    path = tmp_path / "ints.bin"
    data = rand(16384, 2)
    data.tofile(path)
    buf = np.full(16384, 0xA5, np.uint8)
    with pio.open(path, "r+") as f:
        for kw in (
            {"file_offset": 2**64},
            {"file_offset": 2**64 + 4096},
            {"size": 2**63},
            {"buf_offset": -1},
            {"file_offset": -1},
            {"file_offset": 2**63 - 10, "size": 100},
        ):
            for call in (f.read, f.write, f.pread):
                with pytest.raises(ArgumentError) as ei:
                    call(buf, **kw)
                assert ei.value.errno == errno.EINVAL and isinstance(ei.value, ValueError)
                name = next(iter(kw))
                assert name in str(ei.value) or "2**63-1" in str(ei.value), str(ei.value)
        for kw in ({"file_offset": 1.5}, {"size": "16"}, {"buf_offset": 2.0}, {"file_offset": True}):
            with pytest.raises(TypeError, match=next(iter(kw))):
                f.read(buf, **kw)
        for raw in ((buf.ctypes.data, 2**64 + 16), (buf.ctypes.data, -1), (0, 16), (2**64, 16)):
            with pytest.raises(ValueError, match="raw buffer"):
                f.read(raw)
        with pytest.raises(ArgumentError, match="2\\*\\*63-1"):
            f.read_many(buf, [2**63 - 10], [100])
        # NumPy integers are integers
        assert f.read(buf, np.uint32(100), np.int64(4096), np.int16(8)) == 100
        assert np.array_equal(buf[8:108], data[4096:4196])
    assert np.array_equal(np.fromfile(path, np.uint8), data), "a refused write changed the file"


def test_a_path_with_nul_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    with pytest.raises(ValueError, match="null byte"):
        pio.open(str(victim) + "\0.new", "w")
    assert victim.read_bytes() == b"keep me"


@pytest.mark.parametrize("dtype", ["U4", "M8[ns]", "m8[s]", "S3", "c16"])
def test_element_sizes_come_from_the_exporter(tmp_path, dtype):
    arr = np.zeros(5, dtype)
    path = tmp_path / "items.bin"
    rand(arr.nbytes + 100, 3).tofile(path)
    with pio.open(path) as f:
        assert f.read(arr) == arr.nbytes
    assert np.array_equal(arr.view(np.uint8), np.fromfile(path, np.uint8)[: arr.nbytes])


def test_a_malformed_batch_request_fails_alone(tmp_path):
    path = tmp_path / "batch.bin"
    data = rand(300 * 64, 4)
    data.tofile(path)
    out = np.zeros(300 * 64, np.uint8)
    with pio.open(path) as f:
        reqs = [(f, out, 64, i * 64, i * 64) for i in range(300)]
        reqs[290] = (f, out, 64, 290 * 64.0, 290 * 64)  # a float offset
        reqs[291] = (f, out)[:1]  # too short
        reqs[292] = {"file": f}  # no buffer
        res = pio.batch(reqs)
    assert isinstance(res[290], TypeError) and isinstance(res[291], TypeError) and isinstance(res[292], TypeError)
    good = [i for i in range(300) if i not in (290, 291, 292)]
    assert all(res[i] == 64 for i in good)
    for i in good:
        assert np.array_equal(out[i * 64 : (i + 1) * 64], data[i * 64 : (i + 1) * 64])
    assert not out[290 * 64 : 293 * 64].any()


def test_read_many_extents_stay_in_their_device_allocation(rt, tmp_path):
    path = tmp_path / "many.bin"
    rand(1 << 20, 5).tofile(path)
    a = rt.device_alloc(1 << 16)
    b = rt.device_alloc(1 << 16)
    fill = np.full(1 << 16, 0xA5, np.uint8)
    try:
        rt.memcpy(b, fill.ctypes.data, 1 << 16, CopyKind.HOST_TO_DEVICE)
        lo, hi = min(a, b), max(a, b)
        gap = hi - lo
        with pio.open(path) as f:
            for buf in ((lo, gap + 4096), _Cai(lo, gap + 4096)):
                with pytest.raises(PhxIOError) as ei:
                    f.read_many(buf, [0, 8192], [4096, 4096], [0, gap])
                assert ei.value.errno == errno.EFAULT and "allocation" in str(ei.value)
                with pytest.raises(PhxIOError) as ei:  # as read refuses the whole buffer
                    f.read(buf)
                assert ei.value.errno == errno.EFAULT
        out = np.empty(1 << 16, np.uint8)
        rt.memcpy(out.ctypes.data, hi, 1 << 16, CopyKind.DEVICE_TO_HOST)
        assert (out == 0xA5).all(), "read_many wrote into the next allocation"
    finally:
        rt.device_free(a)
        rt.device_free(b)


class _Cai:
    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1", "version": 3}


def test_non_finite_settings_say_which(monkeypatch):
    for text in ("inf", "nan", "-inf", "1e400"):
        with pytest.raises(ValueError):
            parse_size(text)
        monkeypatch.setenv("PHX_THREADS", text)
        with pytest.raises(ValueError, match="PHX_THREADS"):
            ps.get()
    monkeypatch.delenv("PHX_THREADS")


def test_sizes_say_what_the_pool_allows(rt):
    with ps.override(bounce_pool_size="1M", chunk_size="8M"):
        sz = pio.sizes()
    assert sz["bounce_pool"] == 1 << 20 and sz["chunk"] == 8 << 20
    assert 0 < sz["staged_chunk"] < sz["chunk"] and "PHX_BOUNCE_POOL_SIZE" in sz["why"]
    assert 2 * sz["staged_chunk"] <= sz["bounce_pool"]


# ---- shutdown and the small pool under concurrency -------------------------------------------

SHUTDOWN = """
    import threading, time, sys
    import numpy as np
    import phoenix.io as pio, phoenix.settings as ps
    from phoenix.registry import get_runtime
    rt = get_runtime("host"); pio.use_runtime(rt)
    path, n = sys.argv[1], 1 << 20
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8); data.tofile(path)
    stop, errs, done = threading.Event(), [], [0]
    def work(k):
        d, a, s = rt.device_alloc(n), np.zeros(n, np.uint8), rt.stream_create()
        with pio.open(path) as f:
            while not stop.is_set():
                try:
                    with ps.override(mode=("staged", "auto")[k % 2], engine=("io_uring", "threads")[k % 2]):
                        assert f.read((d, n)) == n
                        assert f.read(a) == n and (a == data).all()
                        assert int(f.read_many(a, [0], [n]).sum()) == n
                        op = f.read_async((d, n), n, 0, 0, s); rt.stream_synchronize(s)
                        assert op.bytes_done == n, op.bytes_done
                        assert pio.batch([(f, a, n, 0, 0, "read")]) == [n]
                        done[0] += 1
                except Exception as e:
                    errs.append(repr(e)); break
    ths = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [t.start() for t in ths]
    end = time.time() + 2
    while time.time() < end:
        pio.shutdown(); time.sleep(0.001)
    stop.set(); [t.join() for t in ths]
    print(done[0], errs[:3])
    assert not errs and done[0] > 0
"""


def test_shutdown_under_submitting_threads(tmp_path):
    r = run_py(SHUTDOWN, tmp_path / "shutdown.bin")
    assert r.returncode == 0, f"rc {r.returncode} (-8: SIGFPE, -11: SIGSEGV): {r.stdout} {r.stderr[-2000:]}"


SMALL_POOL = """
    import threading, sys
    import numpy as np
    import phoenix.io as pio, phoenix.settings as ps
    from phoenix.registry import get_runtime
    rt = get_runtime("host"); pio.use_runtime(rt)
    path, engine, n = sys.argv[1], sys.argv[2], 8 << 20
    np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tofile(path)
    errs = []
    def work(k):
        try:
            d, s = rt.device_alloc(n), rt.stream_create()
            with pio.open(path, "r+") as f:
                for _ in range(4):
                    if k % 2:
                        op = f.read_async((d, n), n, 0, 0, s); rt.stream_synchronize(s)
                        assert op.bytes_done == n, op.bytes_done
                    else:
                        assert f.read((d, n)) == n and f.write((d, n)) == n
        except Exception as e:
            errs.append(repr(e))
    with ps.override(threads=1, bounce_pool_size="1M", mode="staged", engine=engine):
        ths = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        [t.start() for t in ths]; [t.join() for t in ths]
    assert not errs, errs
    print("ok")
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_stream_ops_beside_blocking_staged_io_with_one_worker_and_a_1m_pool(tmp_path, engine):
    """A stream op holds the whole pool while its host callbacks wait for its own file I/O;
    blocking staged chunks wait for slots: the stream op's I/O must not queue behind them."""
    try:
        r = run_py(SMALL_POOL, tmp_path / "small.bin", engine, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("hung: stream ops and blocking staged I/O with 1 worker and a 1 MiB pool")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ---- offsets next to the largest one --------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [None, True, False])
def test_reads_and_writes_next_to_the_largest_offset(tmp_path, engine, direct):
    """Extents that end just short of 2**63: the chunk boundary after them is 2**63 itself,
    which int64_t cannot hold (a read of 1 byte became a chunk of hundreds, past the
    buffer, and O_DIRECT blocks past the largest offset were refused). A read there is past
    EOF (0, the buffer untouched); a write there is the file system's to refuse (EFBIG)."""
    path = tmp_path / "far.bin"
    path.write_bytes(rand(5000, 3).tobytes())
    with ps.override(engine=engine), pio.open(path, "r+", direct=direct) as f:
        for back in (1 + 1, 344, 4096, 4097, 8187, 1 << 20):
            off = 2**63 - back
            size = min(back - 1, 3000)
            buf = np.full(size + 8192, 0x5A, np.uint8)
            assert f.read(buf, size, off, 4096) == 0, back
            assert (buf == 0x5A).all(), f"bytes written by a read past EOF at 2**63-{back}"
            with pytest.raises(OSError) as ei:
                f.write(buf, size, off, 4096)
            assert ei.value.errno in (errno.EFBIG, errno.EINVAL), ei.value
    assert path.read_bytes() == rand(5000, 3).tobytes()


@pytest.mark.parametrize("mode", ["staged", "auto"])
def test_a_stream_read_after_an_external_truncation_moves_nothing(rt, tmp_path, mode):
    """A stream-ordered staged read is sized when it is queued: from fstat and the ends of
    this file's writes still in flight, never from writes long completed (the file was
    truncated since by someone else: the copy wrote zeros past the count)."""
    path = tmp_path / "trunc.bin"
    n = 3 * 4096 + 5
    dev = rt.device_alloc(n + 4096)
    try:
        with ps.override(mode=mode), pio.open(path, "w+") as f:
            src = rand(n, 4)
            assert f.write(src, n, 0) == n
            os.truncate(path, 0)
            poison = np.full(n + 4096, 0xC3, np.uint8)
            rt.memcpy(dev, poison.ctypes.data, n + 4096, CopyKind.HOST_TO_DEVICE)
            op = f.read_async((dev, n), n, 0, stream=0)
            rt.stream_synchronize(0)
            assert op.result() == 0
            back = np.empty(n + 4096, np.uint8)
            rt.memcpy(back.ctypes.data, dev, n + 4096, CopyKind.DEVICE_TO_HOST)
            assert (back == 0xC3).all(), f"{int((back != 0xC3).sum())} device bytes changed by a read of an empty file"
    finally:
        rt.device_free(dev)


@pytest.mark.parametrize("engine_name", ["io_uring", "threads"])
def test_a_growing_write_never_shows_a_hole_to_a_reader(tmp_path, engine_name):
    """A write of one chunk that grows the file (an unaligned head, the O_DIRECT body, an
    unaligned tail) lands in order: a reader meanwhile sees the old end or the new bytes,
    never zeros inside its count (the tail once set the new end before the body landed).
    Appends of 98,760 bytes at unaligned offsets, the file staying under one chunk."""
    path = tmp_path / "grow.bin"
    words0 = 512
    (np.arange(words0, dtype=np.uint64) << np.uint64(20)).tofile(path)
    end = [words0 * 8]
    stop = threading.Event()
    bad: list = []
    reads = [0]

    def writer():
        with ps.override(engine=engine_name, chunk_size="64M"), pio.open(path, "r+") as f:
            while end[0] < (12 << 20):
                w0 = end[0] // 8
                pat = ((np.arange(w0, w0 + 12345, dtype=np.uint64) << np.uint64(20)) | np.uint64(1)).view(np.uint8)
                assert f.write(pat, pat.size, w0 * 8) == pat.size
                end[0] += pat.size
        stop.set()

    def reader():
        fd = os.open(path, os.O_RDONLY)
        try:
            while not stop.is_set():
                fo = max(0, end[0] - 65536) // 8 * 8
                data = os.pread(fd, 1 << 20, fo)
                c = len(data) // 8
                got = np.frombuffer(data[: c * 8], np.uint64) >> np.uint64(20)
                wrong = np.flatnonzero(got != np.arange(fo // 8, fo // 8 + c, dtype=np.uint64))
                if wrong.size:
                    bad.append((fo, len(data), int(fo + 8 * wrong[0])))
                reads[0] += 1
        finally:
            os.close(fd)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert reads[0] > 50, reads
    assert not bad, f"{len(bad)} of {reads[0]} reads saw zeros inside their count: {bad[:3]}"
