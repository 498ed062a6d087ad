"""Which queued stream-ordered writes a blocking call waits for (host vendor).

A ``write_async`` queued behind work that holds its stream is waited for by a blocking
read or write of the same file issued after it only where the blocking call depends on
it: a write where they overlap; a read also where the read reaches past the file's end
and the queued write grows the file past that end (the hole then reads as counted
zeros). Anything else returns at once, with the bytes the file holds. The stream is held
by a C host callback (``phx_testing_hostfn``) waiting on a flag the test sets, so a call
that waits when it must not shows as one still running while the stream is held.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._testing import TEST_HOSTFN, TestHostFn
from phoenix.vendor import CopyKind

MiB = 1 << 20
SIZE = 16 * MiB
POISON = 0x5A
PROMPT = 20.0  # seconds a call that must not wait is given (a loaded machine): it waits for ever otherwise


@pytest.fixture(params=["direct", "staged"])
def mode(request):
    with ps.override(mode=request.param, chunk_size="256K"):
        yield request.param


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Held:
    """A stream held by a C callback until :meth:`release` (also on the way out)."""

    def __init__(self, rt):
        self.rt = rt
        self.stream = rt.stream_create(0)
        self.flag = ctypes.c_int64(0)
        self.arg = TestHostFn(kind=2, src=ctypes.addressof(self.flag), seq=-1, result=-999)
        rt.launch_host_func(self.stream, TEST_HOSTFN, ctypes.addressof(self.arg))

    def release(self):
        self.flag.value = 1

    def close(self):
        self.release()
        self.rt.stream_synchronize(self.stream)
        self.rt.stream_destroy(self.stream)


class Call:
    """A blocking call run in a thread; ``done`` says whether it returned."""

    def __init__(self, fn, *args):
        self.result = self.error = None
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except BaseException as exc:  # reported by the test
            self.error = exc
        self.finished.set()

    def wait(self, timeout):
        self.finished.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.finished.is_set()


@pytest.fixture
def setup(rt, tmp_path):
    """A 16 MiB file of random bytes, device memory with the bytes queued writes write,
    and held streams made on demand (released and destroyed after the test)."""
    old = rand(SIZE, 1)
    path = tmp_path / "deps.bin"
    path.write_bytes(old.tobytes())
    new = rand(4 * MiB, 2)
    src = rt.device_alloc(new.nbytes)
    rt.memcpy(src, new.ctypes.data, new.nbytes, CopyKind.HOST_TO_DEVICE)
    held: list[Held] = []

    def hold():
        h = Held(rt)
        held.append(h)
        return h

    hold.made = held

    yield path, old, new, src, hold
    for h in held:
        h.close()
    rt.device_free(src)


@contextlib.contextmanager
def released(hold):
    """On the way out (before the files close: a close waits for the queued writes),
    every stream ``hold`` made is let go."""
    try:
        yield
    finally:
        for h in hold.made:
            h.release()


def _dst(n, pad=64):
    return np.full(n + 2 * pad, POISON, np.uint8), pad


def test_a_read_of_another_range_does_not_wait(rt, mode, setup):
    """write_async of [8M, 9M) held on its stream; blocking reads of [2M, 3M) (read,
    read_many, batch, through the same handle and another one) and a blocking write of
    [2M, 3M) return while the stream is still held, with the file's bytes."""
    path, old, new, src, hold = setup
    h = hold()
    with pio.open(path, "r+") as f, pio.open(path, "r") as g, released(hold):
        w = f.write_async((src, 4 * MiB), MiB, 8 * MiB, 0, h.stream)
        for handle in (f, g):
            dst, pad = _dst(MiB)
            c = Call(handle.read, dst, MiB, 2 * MiB, pad)
            assert c.wait(PROMPT), "a read of [2M, 3M) waited for a queued write of [8M, 9M)"
            assert c.result == MiB
            np.testing.assert_array_equal(dst[pad : pad + MiB], old[2 * MiB : 3 * MiB])
            assert (dst[:pad] == POISON).all() and (dst[pad + MiB :] == POISON).all()
        dst, pad = _dst(MiB)
        half = MiB // 2
        c = Call(g.read_many, dst, [2 * MiB, 2 * MiB + half], [half, half], [pad, pad + half])
        assert c.wait(PROMPT), "read_many of [2M, 3M) waited for a queued write of [8M, 9M)"
        assert list(c.result) == [half, half]
        np.testing.assert_array_equal(dst[pad : pad + MiB], old[2 * MiB : 3 * MiB])
        dst, pad = _dst(MiB)
        c = Call(pio.batch, [(g, dst, MiB, 2 * MiB, pad, "read")])
        assert c.wait(PROMPT), "a batch read of [2M, 3M) waited for a queued write of [8M, 9M)"
        assert c.result == [MiB]
        np.testing.assert_array_equal(dst[pad : pad + MiB], old[2 * MiB : 3 * MiB])
        # a read that reaches past the end, where the queued write does not grow the file
        dst, pad = _dst(2 * MiB)
        c = Call(g.read, dst, 2 * MiB, SIZE - MiB, pad)
        assert c.wait(PROMPT), "a read past the end waited for a write that does not grow the file"
        assert c.result == MiB
        np.testing.assert_array_equal(dst[pad : pad + MiB], old[SIZE - MiB :])
        assert (dst[pad + MiB :] == POISON).all()
        mine = rand(MiB, 3)
        c = Call(f.write, mine, MiB, 2 * MiB)
        assert c.wait(PROMPT), "a write of [2M, 3M) waited for a queued write of [8M, 9M)"
        assert c.result == MiB
        assert not w.done(), "the held stream ran the queued write"
        h.release()
        assert w.result() == MiB
    want = old.copy()
    want[2 * MiB : 3 * MiB] = mine
    want[8 * MiB : 9 * MiB] = new[:MiB]
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)


def test_a_read_the_queued_write_changes_waits(rt, mode, setup):
    """Reads that depend on a held write_async wait for it and return what it made: one
    overlapping it (its bytes), one past the file's end that the write grows the file
    over without overlapping it (counted zeros of the hole), one across the old end into
    the write (old bytes, zeros, the write's bytes, the new count). Bytes past each
    count stay as they were."""
    path, old, new, src, hold = setup
    cases = [  # (file offset, size, the bytes the read must return)
        (8 * MiB + MiB // 2, MiB, np.concatenate([new[MiB // 2 : MiB], old[9 * MiB : 9 * MiB + MiB // 2]])),
    ]
    with pio.open(path, "r+") as f, pio.open(path, "r") as g, released(hold):
        for foff, size, want in cases:
            h = hold()
            w = f.write_async((src, 4 * MiB), MiB, 8 * MiB, 0, h.stream)
            dst, pad = _dst(size)
            c = Call(g.read, dst, size, foff, pad)
            assert not c.wait(0.5), "an overlapping read did not wait for the queued write"
            h.release()
            assert c.wait(PROMPT) and w.result() == MiB
            assert c.result == size
            np.testing.assert_array_equal(dst[pad : pad + size], want)
            assert (dst[:pad] == POISON).all() and (dst[pad + size :] == POISON).all()
        # grows the file from 16M to 21M: [16M, 20M) a hole, [20M, 21M) its bytes
        h = hold()
        w = f.write_async((src, 4 * MiB), MiB, 20 * MiB, 0, h.stream)
        hole_dst, hpad = _dst(MiB)
        hole = Call(g.read, hole_dst, MiB, 17 * MiB, hpad)
        span_dst, pad = _dst(8 * MiB)
        span = Call(g.read, span_dst, 8 * MiB, 15 * MiB, pad)
        assert not hole.wait(0.5), "a read of the hole the queued write makes did not wait for it"
        assert not span.wait(0), "a read across the end into the queued write did not wait for it"
        h.release()
        assert hole.wait(PROMPT) and span.wait(PROMPT) and w.result() == MiB
    assert hole.result == MiB and (hole_dst[hpad : hpad + MiB] == 0).all(), "the hole did not read as zeros"
    assert (hole_dst[:hpad] == POISON).all() and (hole_dst[hpad + MiB :] == POISON).all()
    assert span.result == 6 * MiB
    got = span_dst[pad : pad + 6 * MiB]
    np.testing.assert_array_equal(got[:MiB], old[15 * MiB :])
    assert (got[MiB : 5 * MiB] == 0).all(), "the hole did not read as zeros"
    np.testing.assert_array_equal(got[5 * MiB :], new[:MiB])
    assert (span_dst[pad + 6 * MiB :] == POISON).all(), "bytes past the count changed"


def test_several_queued_writes_each_judged(rt, mode, setup):
    """Two held write_async past the end: A grows the file to 18M ([16M, 18M)), B lies
    at [24M, 25M). A read of [19M, 20M) depends on B alone (B makes it a hole of zeros;
    A does not reach it): it returns once B's stream runs, while A's is still held. A
    read of [18M, 19M) with only A queued reads nothing and does not wait (A ends where
    the read starts); a read of [10M, 11M), inside the file, waits for neither."""
    path, old, new, src, hold = setup
    ha = hold()
    with pio.open(path, "r+") as f, pio.open(path, "r") as g, released(hold):
        a = f.write_async((src, 4 * MiB), 2 * MiB, 16 * MiB, 0, ha.stream)
        dst, pad = _dst(MiB)
        c = Call(g.read, dst, MiB, 18 * MiB, pad)
        assert c.wait(PROMPT), "a read of [18M, 19M) waited for a write that ends at 18M"
        assert c.result == 0 and (dst == POISON).all()
        hb = hold()
        b = f.write_async((src, 4 * MiB), MiB, 24 * MiB, 2 * MiB, hb.stream)
        dst, pad = _dst(MiB)
        c = Call(g.read, dst, MiB, 10 * MiB, pad)
        assert c.wait(PROMPT), "a read of [10M, 11M), inside the file, waited for writes past its end"
        assert c.result == MiB
        np.testing.assert_array_equal(dst[pad : pad + MiB], old[10 * MiB : 11 * MiB])
        dst, pad = _dst(MiB)
        c = Call(g.read, dst, MiB, 19 * MiB, pad)
        assert not c.wait(0.5), "a read of the hole a queued write makes did not wait for it"
        hb.release()
        assert c.wait(PROMPT), "a read of [19M, 20M) waited for a write of [16M, 18M)"
        assert b.result() == MiB and not a.done()
        assert c.result == MiB
        assert (dst[pad : pad + MiB] == 0).all()
        assert (dst[:pad] == POISON).all() and (dst[pad + MiB :] == POISON).all()
        ha.release()
        assert a.result() == 2 * MiB
    got = np.fromfile(path, np.uint8)
    assert got.size == 25 * MiB
    np.testing.assert_array_equal(got[:SIZE], old)
    np.testing.assert_array_equal(got[16 * MiB : 18 * MiB], new[: 2 * MiB])
    assert (got[18 * MiB : 24 * MiB] == 0).all()
    np.testing.assert_array_equal(got[24 * MiB :], new[2 * MiB : 3 * MiB])
