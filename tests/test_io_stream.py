"""Stream-ordered I/O (read_async / write_async) in every engine and mode.

Ordering is observed with C host callbacks (``phx_testing_hostfn``, phoenix._testing) and the vendor's
copies queued on the same stream: no Python runs on the stream, so what the callbacks
record is what the stream did.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._core import core_path
from phoenix._testing import TEST_HOSTFN, TestHostFn, inject_fault
from phoenix.errors import PhxIOError
from phoenix.vendor import CopyKind

POISON = 0x3C


@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    with ps.override(engine=request.param):
        yield request.param


@pytest.fixture(params=["direct", "staged"])
def mode(request):
    with ps.override(mode=request.param):
        yield request.param


@pytest.fixture
def stream(rt):
    s = rt.stream_create(0)
    yield s
    rt.stream_synchronize(s)
    rt.stream_destroy(s)


@pytest.fixture
def devmem(rt):
    ptrs = []

    def alloc(n, fill=POISON):
        p = rt.device_alloc(n)
        ptrs.append(p)
        h = np.full(n, fill, np.uint8)
        rt.memcpy(p, h.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
        return p

    yield alloc
    for p in ptrs:
        rt.device_free(p)


def dev_get(rt, ptr, n):
    out = np.empty(n, np.uint8)
    rt.memcpy(out.ctypes.data, ptr, n, CopyKind.DEVICE_TO_HOST)
    return out


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class HostFns:
    """C test callbacks queued on a stream; their tickets say in which order they ran."""

    def __init__(self, rt):
        self.rt = rt
        self.counter = ctypes.c_int64(0)
        self.args = []

    def _queue(self, stream, **kw):
        a = TestHostFn(counter=ctypes.pointer(self.counter), seq=-1, result=-999, **kw)
        self.args.append(a)
        self.rt.launch_host_func(stream, TEST_HOSTFN, ctypes.addressof(a))
        return a

    def snapshot_mem(self, stream, dst, src, n):
        return self._queue(stream, kind=0, dst=dst, src=src, size=n)

    def snapshot_file(self, stream, fd, dst, n, offset=0):
        return self._queue(stream, kind=1, fd=fd, dst=dst, size=n, offset=offset)

    def gate(self, stream, flag: ctypes.c_int64):
        return self._queue(stream, kind=2, src=ctypes.addressof(flag))

    def sleep(self, stream, microseconds: int):
        return self._queue(stream, kind=3, size=microseconds)


def test_order_with_copies_and_callbacks(rt, engine, mode, stream, devmem, tmp_path):
    """[copy P1 -> A] [write A -> file] [callback: snapshot of the file] [copy P2 -> A]
    [read file -> B] [copy B -> host Y] [callback: snapshot of B]: the write sees P1 (not
    P2), the callback after it sees the file written, the read sees what the write wrote,
    and the work after the read sees its bytes."""
    n = 3 * (256 << 10) + 1234  # several chunks of 256K, an unaligned tail
    p1, p2 = rand(n, 1), rand(n, 2)
    a, b = devmem(n), devmem(n)
    path = tmp_path / "order.bin"
    path.write_bytes(b"")
    fns = HostFns(rt)
    file_snap = np.full(n, POISON, np.uint8)
    y = np.full(n, POISON, np.uint8)
    b_snap = np.full(n, POISON, np.uint8)
    with ps.override(chunk_size="256K"), pio.open(path, "r+") as f, open(path, "rb") as fh:
        rt.memcpy_async(a, p1.ctypes.data, n, CopyKind.HOST_TO_DEVICE, stream)
        w = f.write_async((a, n), n, 0, 0, stream)
        s1 = fns.snapshot_file(stream, fh.fileno(), file_snap.ctypes.data, n)
        rt.memcpy_async(a, p2.ctypes.data, n, CopyKind.HOST_TO_DEVICE, stream)
        r = f.read_async((b, n), n, 0, 0, stream)
        rt.memcpy_async(y.ctypes.data, b, n, CopyKind.DEVICE_TO_HOST, stream)
        s2 = fns.snapshot_mem(stream, b_snap.ctypes.data, b, n)
        rt.stream_synchronize(stream)
        assert w.bytes_done == n and r.bytes_done == n
    assert s1.result == n and (s1.seq, s2.seq) == (0, 1)
    np.testing.assert_array_equal(file_snap, p1)
    np.testing.assert_array_equal(np.frombuffer(path.read_bytes(), np.uint8), p1)
    np.testing.assert_array_equal(y, p1)
    np.testing.assert_array_equal(b_snap, p1)
    np.testing.assert_array_equal(dev_get(rt, a, n), p2)


def test_results_are_bound_late(rt, engine, mode, stream, devmem, tmp_path):
    n = 100_000
    data = rand(n, 3)
    path = tmp_path / "late.bin"
    path.write_bytes(data.tobytes())
    d = devmem(n + 10)
    gate = ctypes.c_int64(0)
    fns = HostFns(rt)
    with pio.open(path, "r") as f:
        fns.gate(stream, gate)  # the stream waits here
        op = f.read_async((d, n + 10), n, 0, 10, stream)
        time.sleep(0.05)
        assert op.bytes_done is None and not op.done()
        gate.value = 1
        rt.stream_synchronize(stream)
        assert op.done() and op.bytes_done == n and op.result() == n
    got = dev_get(rt, d, n + 10)
    np.testing.assert_array_equal(got[10:], data)
    assert (got[:10] == POISON).all()


def test_host_callbacks_never_enter_python(rt, engine, mode, stream, devmem, tmp_path):
    """Wait for a stream op with a call that holds the GIL all along (ctypes.PyDLL does
    not release it): if any callback of the op needed Python it could not run, and the
    wait would time out instead of returning 0."""
    n = 5 * (128 << 10) + 77
    data = rand(n, 4)
    path = tmp_path / "gil.bin"
    path.write_bytes(data.tobytes())
    d = devmem(n)
    holding = ctypes.PyDLL(core_path())
    holding.phx_sop_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    holding.phx_sop_wait.restype = ctypes.c_int
    with ps.override(chunk_size="128K"), pio.open(path, "r+") as f:
        fns = HostFns(rt)  # (must outlive the stream's use of it)
        fns.sleep(stream, 100_000)  # the stream starts the ops while this thread holds the GIL
        w = f.write_async((d, n), n, n, 0, stream)
        r = f.read_async((d, n), n, 0, 0, stream)
        t0 = time.perf_counter()
        assert holding.phx_sop_wait(r._sop, int(20e9)) == 0, "the stream op needed the GIL"
        assert holding.phx_sop_wait(w._sop, int(20e9)) == 0
        assert time.perf_counter() - t0 >= 0.02  # it did wait for the stream
        rt.stream_synchronize(stream)
        del fns
        assert w.bytes_done == n and r.bytes_done == n
    np.testing.assert_array_equal(dev_get(rt, d, n), data)


def test_staged_read_never_copies_bytes_past_eof(rt, engine, stream, devmem, tmp_path):
    path = tmp_path / "eof.bin"
    data = rand(10_000, 5)
    path.write_bytes(data.tobytes())
    d = devmem(50_000)
    with ps.override(mode="staged", chunk_size="4K"), pio.open(path, "r") as f:
        op = f.read_async((d, 50_000), 40_000, 2_000, 1_000, stream)
        op0 = f.read_async((d, 50_000), 100, 20_000, 0, stream)
        rt.stream_synchronize(stream)
        assert op.bytes_done == 8_000 and op0.bytes_done == 0
    got = dev_get(rt, d, 50_000)
    np.testing.assert_array_equal(got[1_000:9_000], data[2_000:])
    assert (got[:1_000] == POISON).all() and (got[9_000:] == POISON).all()


def test_pending_writes_extend_the_readable_size(rt, engine, mode, stream, devmem, tmp_path):
    """A read queued after a write that grows the file reads what the write will write:
    the size known at submission includes this process's pending writes."""
    path = tmp_path / "grow.bin"
    path.write_bytes(b"")
    n = 300_000
    a, b = devmem(n), devmem(n)
    data = rand(n, 6)
    rt.memcpy(a, data.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    with ps.override(chunk_size="64K"), pio.open(path, "r+") as f:
        w = f.write_async((a, n), n, 0, 0, stream)
        r = f.read_async((b, n), n, 0, 0, stream)
        rt.stream_synchronize(stream)
        assert (w.bytes_done, r.bytes_done) == (n, n)
    np.testing.assert_array_equal(dev_get(rt, b, n), data)


def test_many_chunks_reuse_few_slots(rt, engine, stream, devmem, tmp_path):
    """40 chunks through 4 bounce slots per op, writes then reads, several ops queued."""
    path = tmp_path / "slots.bin"
    n = 40 * (64 << 10) + 99
    data = rand(n, 7)
    a, b = devmem(n), devmem(n)
    rt.memcpy(a, data.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    with ps.override(mode="staged", chunk_size="64K"), pio.open(path, "w+") as f:
        ops = [f.write_async((a, n), n // 2, 0, 0, stream), f.write_async((a, n), n - n // 2, n // 2, n // 2, stream)]
        ops.append(f.read_async((b, n), n, 0, 0, stream))
        rt.stream_synchronize(stream)
        assert [op.bytes_done for op in ops] == [n // 2, n - n // 2, n]
    np.testing.assert_array_equal(dev_get(rt, b, n), data)
    assert pio.stats()["bounce_in_use"] == 0


def test_host_memory_on_a_stream(rt, engine, stream, tmp_path):
    path = tmp_path / "host.bin"
    data = rand(70_000, 8)
    out = np.full(70_000, POISON, np.uint8)
    with pio.open(path, "w+") as f:
        w = f.write_async(data, stream=stream)
        r = f.read_async(out, stream=stream)
        rt.stream_synchronize(stream)
        assert (w.result(), r.result()) == (70_000, 70_000)
    np.testing.assert_array_equal(out, data)


def test_errors_are_late_negative_errno(rt, engine, mode, stream, devmem, tmp_path):
    path = tmp_path / "err.bin"
    path.write_bytes(b"\0" * 8192)
    d = devmem(8192)
    with pio.open(path, "r") as f:
        op = f.write_async((d, 8192), 8192, 0, 0, stream)  # read-only file
        rt.stream_synchronize(stream)
        assert op.bytes_done == -errno.EBADF
        with pytest.raises(PhxIOError) as ei:
            op.result()
        assert ei.value.errno == errno.EBADF and ei.value.path == str(path)
        inject_fault(f, 4096, 1, errno.EIO)
        op = f.read_async((d, 8192), 8192, 0, 0, stream)
        rt.stream_synchronize(stream)
        assert op.bytes_done == -errno.EIO
        with pytest.raises(PhxIOError):  # submission errors: at once
            f.read_async((d, 8192), 8193, 0, 0, stream)


def test_close_waits_for_queued_stream_ops(rt, engine, mode, stream, devmem, tmp_path):
    path = tmp_path / "close.bin"
    data = rand(50_000, 9)
    path.write_bytes(data.tobytes())
    d = devmem(50_000)
    gate, fns = ctypes.c_int64(0), HostFns(rt)
    f = pio.open(path, "r")
    fns.gate(stream, gate)
    op = f.read_async((d, 50_000), stream=stream)
    closer = threading.Thread(target=f.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a stream op of the file was queued"
    gate.value = 1
    closer.join(10)
    assert not closer.is_alive() and f.closed
    assert op.result() == 50_000
    rt.stream_synchronize(stream)
    del fns
    np.testing.assert_array_equal(dev_get(rt, d, 50_000), data)


def test_dropped_stream_op_keeps_its_buffer(rt, stream, tmp_path):
    path = tmp_path / "drop.bin"
    data = rand(30_000, 10)
    path.write_bytes(data.tobytes())
    gate, fns = ctypes.c_int64(0), HostFns(rt)
    fns.gate(stream, gate)
    out = np.full(30_000, POISON, np.uint8)
    with pio.open(path, "r") as f:
        f.read_async(bytearray(30_000), stream=stream)  # dropped at once: kept alive inside
        f.read_async(out, stream=stream)
        gate.value = 1
    rt.stream_synchronize(stream)
    del fns
    np.testing.assert_array_equal(out, data)


def test_a_timeout_past_int64_nanoseconds_waits_without_end(rt, stream, tmp_path):
    """result(timeout=1e30) of an op its stream has not reached yet waits for it (an int64
    once took 1e30 s as 0 ns: a TimeoutError at once); NaN and non-numbers are refused,
    naming timeout; a short timeout still times out."""
    path = tmp_path / "wait.bin"
    data = rand(4096, 9)
    data.tofile(path)
    out = np.full(4096, POISON, np.uint8)
    flag = ctypes.c_int64(0)
    fns = HostFns(rt)
    fns.gate(stream, flag)  # the stream waits here until flag is set
    with pio.open(path, "r") as f:
        op = f.read_async(out, stream=stream)
        with pytest.raises(TimeoutError):
            op.result(timeout=0.05)
        with pytest.raises(ValueError, match="timeout=nan"):
            op.result(timeout=float("nan"))
        with pytest.raises(TypeError, match="timeout must be a number"):
            op.result(timeout="1")
        threading.Timer(0.3, lambda: setattr(flag, "value", 1)).start()
        for big in (1e30, 2**64 / 1e9, float("inf")):
            assert op.result(timeout=big) == 4096
        np.testing.assert_array_equal(out, data)
        fut = f.pread(np.empty(4096, np.uint8))
        assert fut.result(timeout=1e30) == 4096
    assert pio.fmap_wait(timeout=1e30)


def test_an_op_of_more_chunks_than_a_count_holds_is_refused(rt, stream, tmp_path):
    """phx_stream_io with a staged op of 2**32 +- k chunks (a 64-bit count once cut to an int:
    0 chunks and a count of 0 with no error, or a negative count and a heap overflow) is
    refused with EINVAL before anything moves, as phx_submit refuses it; run in a
    subprocess (a heap overflow must not take the tests)."""
    script = tmp_path / "huge_op.py"
    script.write_text(
        """import ctypes, sys
import numpy as np
import phoenix.io as pio
import phoenix.settings as ps
from phoenix._abi import _Desc, _P, _Sizes, _lib, MODE, OP_WRITE
from phoenix.registry import get_runtime
rt = get_runtime("host")
pio.use_runtime(rt)
with ps.override(mode="staged"):
    f = pio.open(sys.argv[1], "w")
    with pio._using_engine() as e:
        sz = _Sizes()
        _lib.phx_ctx_sizes(e.handle, ctypes.byref(sz))
        info = f.info()
        A = info["dio_offset_align"] if info["direct"] else 4096
        C = -(-sz.staged_chunk // A) * A
        dev = rt.device_alloc(4 * C)
        s = rt.stream_create()
        for k in (0, 1, -1, -2):
            desc = _Desc(f._h, dev, (2**32 + k) * C, 0, OP_WRITE, 1, 0, MODE["staged"])
            done, sop = ctypes.c_int64(-999), _P()
            rc = _lib.phx_stream_io(e.handle, ctypes.byref(desc), s, ctypes.byref(done), ctypes.byref(sop))
            print("RC", k, rc, done.value)
        rt.stream_synchronize(s)
        rt.stream_destroy(s)
        rt.device_free(dev)
    f.close()
print("DONE")
"""
    )
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.bin")],
        env={**os.environ, "PHX_VENDOR": "host"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "DONE" in p.stdout, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    rcs = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("RC")]
    assert len(rcs) == 4 and all(int(r[2]) == -errno.EINVAL for r in rcs), p.stdout
    assert (tmp_path / "out.bin").stat().st_size == 0


@pytest.mark.parametrize("handle", ["same", "another"])
@pytest.mark.parametrize("how", ["read", "read_many", "batch"])
def test_a_blocking_read_reads_what_a_write_queued_before_it_on_its_stream_wrote(
    rt, mode, stream, devmem, tmp_path, how, handle
):
    """write_async queued behind work that holds its stream, then at once a blocking read
    (read, read_many, batch; through the same handle or another one of the file) of the
    range it writes, which it also grows the file over: the read waits for the write the
    caller queued before it and returns its bytes and its count (it read the bytes from
    before the write, and a short count, while the stream had not reached the write)."""
    n = 3 * (64 << 10) + 321
    old, new = rand(n // 2 + 1000, 20), rand(n, 21)
    path = tmp_path / "raw.bin"
    path.write_bytes(old.tobytes())
    a = devmem(n)
    rt.memcpy(a, new.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    dst = np.full(n + 64, POISON, np.uint8)
    h = n // 2
    fns = HostFns(rt)
    with ps.override(chunk_size="64K"), pio.open(path, "r+") as f, pio.open(path, "r") as other:
        g = f if handle == "same" else other
        fns.sleep(stream, 200_000)  # the stream reaches the write later than the read is issued
        w = f.write_async((a, n), n, 0, 0, stream)
        if how == "read":
            counts = [g.read(dst, n, 0, 32)]
        elif how == "read_many":
            counts = list(g.read_many(dst, [0, h], [h, n - h], [32, 32 + h]))
        else:
            counts = pio.batch([(g, dst, h, 0, 32, "read"), (g, dst, n - h, h, 32 + h, "read")])
        write_was_done = w.done()
        assert w.result() == n
        rt.stream_synchronize(stream)
    del fns
    assert counts == ([n] if how == "read" else [h, n - h]), counts
    np.testing.assert_array_equal(dst[32 : 32 + n], new)
    assert (dst[:32] == POISON).all() and (dst[32 + n :] == POISON).all()
    assert write_was_done


def test_a_blocking_write_lands_after_a_write_queued_before_it_on_its_stream(rt, mode, stream, devmem, tmp_path):
    """write_async of a range queued behind work that holds its stream, then at once a
    blocking write of part of it: the file holds the blocking write's bytes there (the
    queued write, run later by its stream, overwrote them)."""
    n = 3 * (64 << 10) + 321
    first, second = rand(n, 22), rand(n // 3, 23)
    path = tmp_path / "waw.bin"
    path.write_bytes(b"")
    a = devmem(n)
    rt.memcpy(a, first.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    fns = HostFns(rt)
    with ps.override(chunk_size="64K"), pio.open(path, "r+") as f:
        fns.sleep(stream, 200_000)
        w = f.write_async((a, n), n, 0, 0, stream)
        assert f.write(second, n // 3, 1000) == n // 3
        assert w.result() == n
        rt.stream_synchronize(stream)
    del fns
    want = first.copy()
    want[1000 : 1000 + n // 3] = second
    np.testing.assert_array_equal(np.frombuffer(path.read_bytes(), np.uint8), want)


def test_a_read_sees_what_a_write_through_another_handle_queued_before_it(rt, engine, mode, stream, devmem, tmp_path):
    """A write_async through one handle that grows the file, then a read_async through
    another handle of more than the file will hold, both on one stream held behind other
    work (the read is planned before the write ran): the read returns what the file holds
    when the stream runs it, its count is the bytes it moved, and the destination past the
    count keeps its bytes (a staged read was sized at submission, from the file's size
    then: it stopped at the old end)."""
    m, off, n, want = 50_000, 30_000, 200_000, 300_000
    old, new = rand(m, 24), rand(n, 25)
    path = tmp_path / "grow2.bin"
    path.write_bytes(old.tobytes())
    a = devmem(n)
    rt.memcpy(a, new.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    b = devmem(want + 64)
    fns = HostFns(rt)
    with ps.override(chunk_size="64K"), pio.open(path, "r+") as g, pio.open(path, "r") as f:
        fns.sleep(stream, 100_000)
        w = g.write_async((a, n), n, off, 0, stream)
        r = f.read_async((b, want + 64), want, 0, 32, stream)
        rt.stream_synchronize(stream)
        assert (w.result(), r.result()) == (n, off + n)
    del fns
    got = dev_get(rt, b, want + 64)
    np.testing.assert_array_equal(got[32 : 32 + off], old[:off])
    np.testing.assert_array_equal(got[32 + off : 32 + off + n], new)
    assert (got[:32] == POISON).all() and (got[32 + off + n :] == POISON).all(), "bytes past the count changed"


def test_a_failed_read_past_the_files_end_at_submission_copies_nothing_stale(rt, engine, stream, devmem, tmp_path):
    """The same growth, with a chunk of the read failing (EIO): the op's count is the error,
    the chunks before the failed one hold the file's bytes, and the destination of the
    failed chunk and of those after it keeps its bytes (no stale bounce bytes)."""
    m, n, want, C = 10_000, 230_000, 300_000, 64 << 10
    data = rand(n, 26)
    path = tmp_path / "grow3.bin"
    path.write_bytes(data[:m].tobytes())
    a = devmem(n)
    rt.memcpy(a, data.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
    b = devmem(want)
    fns = HostFns(rt)
    with ps.override(mode="staged", chunk_size="64K"), pio.open(path, "r+") as g, pio.open(path, "r") as f:
        inject_fault(f, 2 * C + 100, 1, errno.EIO)
        fns.sleep(stream, 50_000)
        w = g.write_async((a, n), n, 0, 0, stream)
        r = f.read_async((b, want), want, 0, 0, stream)
        rt.stream_synchronize(stream)
        assert (w.result(), r.bytes_done) == (n, -errno.EIO)
    del fns
    got = dev_get(rt, b, want)
    np.testing.assert_array_equal(got[: 2 * C], data[: 2 * C])
    assert (got[2 * C :] == POISON).all(), "a failed chunk or one after it changed the destination"
