"""Request priority (issue 21, "loads before offloads"): a normal load submitted behind a
queue of background writes runs ahead of them; without the priority it waits behind them.

Host vendor, both engines, one worker and a small bounce pool (the queue is what a read
would wait behind); every byte written and read is checked.
"""

from __future__ import annotations

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.checks import ArgumentError

MiB = 1 << 20
NWRITES = 192  # 1 MiB background writes queued ahead of the load (192 MiB)
LOAD = 2 * MiB


@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    with ps.override(
        engine=request.param, threads=1, chunk_size=MiB, bounce_pool_size=4 * MiB, queue_depth=4, mode="staged"
    ):
        yield request.param
    pio.shutdown()


def _pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _load_behind_writes(tmp_path, dev, priority):
    """Queue NWRITES writes of `priority` from device memory, then one normal load into
    device memory; how many writes were complete when the load returned."""
    wdata = _pattern(NWRITES * MiB, 1)
    rdata = _pattern(LOAD, 2)
    src = dev(wdata.size)
    src.fill(wdata)
    (tmp_path / "load.bin").write_bytes(rdata.tobytes())
    dst = dev(LOAD)
    with pio.open(tmp_path / "out.bin", "w+") as out, pio.open(tmp_path / "load.bin", "r") as f:
        reqs = [
            pio.IORequest(out, src.buf(), MiB, i * MiB, i * MiB, "write", priority=priority) for i in range(NWRITES)
        ]
        futs = pio.batch(reqs, wait=False)
        assert f.read(dst.buf(), LOAD, 0) == LOAD  # a normal load
        done_at_load = sum(fu.done() for fu in futs)
        assert [fu.result() for fu in futs] == [MiB] * NWRITES
    np.testing.assert_array_equal(dst.get(), rdata)
    got = np.fromfile(tmp_path / "out.bin", np.uint8)
    np.testing.assert_array_equal(got, wdata)
    return done_at_load


def test_load_runs_ahead_of_background_writes(rt, dev, tmp_path, engine):
    bg = _load_behind_writes(tmp_path, dev, "background")
    normal = _load_behind_writes(tmp_path, dev, "normal")
    # background: the load waits only for the chunks in flight (and a background chunk
    # after every few of its own); normal: FIFO, behind (nearly) the whole queue
    assert bg < NWRITES // 4, (bg, normal)
    assert normal > NWRITES * 3 // 4, (bg, normal)


def test_background_is_not_starved(rt, dev, tmp_path, engine):
    """Background writes go on while normal loads keep coming."""
    wdata = _pattern(16 * MiB, 3)
    rdata = _pattern(LOAD, 4)
    src = dev(wdata.size)
    src.fill(wdata)
    (tmp_path / "load.bin").write_bytes(rdata.tobytes())
    dst = dev(LOAD)
    with pio.open(tmp_path / "out.bin", "w+") as out, pio.open(tmp_path / "load.bin", "r") as f:
        futs = [out.pwrite(src.buf(), MiB, i * MiB, i * MiB, priority="background") for i in range(16)]
        loads = [f.pread(dst.buf(), LOAD, 0) for _ in range(64)]  # 128 normal chunks queued after
        assert [fu.result() for fu in loads] == [LOAD] * 64
        assert [fu.result() for fu in futs] == [MiB] * 16
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out.bin", np.uint8), wdata)
    np.testing.assert_array_equal(dst.get(), rdata)


@pytest.mark.parametrize("bad", ["low", "", None, 1, "Background"])
def test_priority_checked(rt, tmp_path, bad):
    buf = np.zeros(4096, np.uint8)
    with pio.open(tmp_path / "x.bin", "w+") as f:
        for call in (
            lambda: f.pwrite(buf, priority=bad),
            lambda: f.write(buf, priority=bad),
            lambda: f.pread(buf, priority=bad),
            lambda: f.write_many(buf, [0], [4096], priority=bad),
        ):
            with pytest.raises(ArgumentError, match="priority"):
                call()
        res = pio.batch([pio.IORequest(f, buf, 4096, 0, 0, "write", priority=bad), (f, buf, 4096, 0, 0, "write")])
        assert isinstance(res[0], ArgumentError) and "priority" in str(res[0])
        assert res[1] == 4096
        assert f.write(buf, priority="background") == 4096
        assert f.write_many(buf, [0, 4096], [2048, 2048], priority="background").tolist() == [2048, 2048]


def test_write_async_background(rt, dev, tmp_path):
    s = rt.stream_create(0)
    data = _pattern(3 * MiB, 5)
    src = dev(data.size)
    src.fill(data)
    with pio.open(tmp_path / "a.bin", "w+") as f:
        with pytest.raises(ArgumentError, match="priority"):
            f.write_async(src.buf(), stream=s, priority="urgent")
        op = f.write_async(src.buf(), stream=s, priority="background")
        rt.stream_synchronize(s)
        assert op.result() == data.size
    rt.stream_destroy(s)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "a.bin", np.uint8), data)


@pytest.fixture(params=["io_uring", "threads"])
def wide(request):
    """Four workers, a pool that holds many chunks: without the hold, background chunks
    would take three quarters of it while a load runs."""
    with ps.override(engine=request.param, threads=4, chunk_size=MiB, bounce_pool_size=64 * MiB, mode="staged"):
        yield request.param
    pio.shutdown()


def test_background_held_while_loads_run(rt, dev, tmp_path, wide):
    """While normal chunks are in their I/O, background ones are held back (counted in
    bg_held), and every byte of both still lands."""
    nw = 256  # more than the workers can take at once (io_uring: 4 x queue_depth 32): some wait queued
    wdata = _pattern(nw * MiB, 6)
    rdata = _pattern(8 * MiB, 7)
    src = dev(wdata.size)
    src.fill(wdata)
    (tmp_path / "load.bin").write_bytes(rdata.tobytes())
    dst = dev(rdata.size)
    before = pio.stats()["bg_held"]
    with pio.open(tmp_path / "out.bin", "w+") as out, pio.open(tmp_path / "load.bin", "r") as f:
        futs = [out.pwrite(src.buf(), MiB, i * MiB, i * MiB, priority="background") for i in range(nw)]
        for _ in range(16):  # back-to-back loads, as an engine loading a request's blocks
            assert f.read(dst.buf(), rdata.size, 0) == rdata.size
        assert [fu.result(timeout=60) for fu in futs] == [MiB] * nw
    assert pio.stats()["bg_held"] > before
    np.testing.assert_array_equal(dst.get(), rdata)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out.bin", np.uint8), wdata)


def test_background_alone_and_after_a_load_completes(rt, dev, tmp_path, wide):
    """The hold ends by itself: background writes submitted alone, and right after a load
    (within the hold's grace, with every worker asleep), complete without another call
    waking the workers."""
    wdata = _pattern(8 * MiB, 8)
    src = dev(wdata.size)
    src.fill(wdata)
    dst = dev(MiB)
    (tmp_path / "load.bin").write_bytes(_pattern(MiB, 9).tobytes())
    with pio.open(tmp_path / "out.bin", "w+") as out, pio.open(tmp_path / "load.bin", "r") as f:
        for rnd in range(3):
            if rnd:
                assert f.read(dst.buf(), MiB, 0) == MiB  # a load just finished: the grace is running
            futs = [out.pwrite(src.buf(), MiB, i * MiB, i * MiB, priority="background") for i in range(8)]
            assert [fu.result(timeout=30) for fu in futs] == [MiB] * 8
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out.bin", np.uint8), wdata)
