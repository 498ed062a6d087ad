"""Stress and lifetimes: concurrent mixed I/O against a reference copy; no leaks.

8 threads x 200 reads and writes with random extents (unaligned offsets and sizes,
host and device buffers, staged and direct, stream-ordered and not) on one shared
file; each thread owns a region of the file and keeps a reference copy of it, and every
read is compared byte for byte. Afterwards every counter of live objects is back to
zero: threads, contexts, files, requests, stream ops, registrations, bounce memory.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.vendor import CopyKind

THREADS, OPS, REGION = 8, 200, (1 << 20) + 1000  # regions share pages at their borders
LIVE = (
    "contexts",
    "threads",
    "files",
    "requests",
    "stream_ops",
    "registrations",
    "worker_streams",
    "bounce_bytes",
    "bounce_in_use",
)


def worker(rt, f, tid: int, errors: list, stream: int):
    rng = np.random.default_rng(1000 + tid)
    base = tid * REGION
    ref = np.zeros(REGION, np.uint8)
    dev = rt.device_alloc(REGION + 8192)
    host = np.zeros(REGION + 8192, np.uint8)
    try:
        for i in range(OPS):
            size = int(rng.integers(1, 200_000))
            off = int(rng.integers(0, REGION - size))
            boff = int(rng.integers(0, 8192))
            on_device = rng.random() < 0.6
            mode = "staged" if rng.random() < 0.5 else "direct"
            kind = rng.random()  # < 0.15: stream-ordered, else sync
            write = rng.random() < 0.5
            with ps.override(mode=mode):
                if write:
                    data = rng.integers(0, 256, size, dtype=np.uint8)
                    if on_device:
                        rt.memcpy(dev + boff, data.ctypes.data, size, CopyKind.HOST_TO_DEVICE)
                        buf = (dev, REGION + 8192)
                    else:
                        host[boff : boff + size] = data
                        buf = host
                    if kind < 0.15 and on_device:
                        n = f.write_async(buf, size, base + off, boff, stream).result()
                    else:
                        n = f.write(buf, size, base + off, boff)
                    assert n == size
                    ref[off : off + size] = data
                else:
                    if on_device:
                        fill = np.full(size, 0xEE, np.uint8)
                        rt.memcpy(dev + boff, fill.ctypes.data, size, CopyKind.HOST_TO_DEVICE)
                        buf = (dev, REGION + 8192)
                    else:
                        host[boff : boff + size] = 0xEE
                        buf = host
                    if kind < 0.15 and on_device:
                        n = f.read_async(buf, size, base + off, boff, stream).result()
                    else:
                        n = f.pread(buf, size, base + off, boff).result()
                    assert n == size
                    if on_device:
                        got = np.empty(size, np.uint8)
                        rt.memcpy(got.ctypes.data, dev + boff, size, CopyKind.DEVICE_TO_HOST)
                    else:
                        got = host[boff : boff + size]
                    if not np.array_equal(got, ref[off : off + size]):
                        bad = int(np.argmax(got != ref[off : off + size]))
                        raise AssertionError(
                            f"thread {tid} op {i}: {mode} {'dev' if on_device else 'host'} read "
                            f"[{off}, +{size}) differs at +{bad}"
                        )
    except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
        errors.append(exc)
    finally:
        rt.device_free(dev)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_stress_mixed_threads(rt, engine, tmp_path):
    path = tmp_path / "stress.bin"
    errors: list = []
    streams = [rt.stream_create(0) for _ in range(THREADS)]
    with ps.override(engine=engine, threads=4, chunk_size="64K", bounce_pool_size="4M"):
        with pio.open(path, "w+") as f:
            f.write(np.zeros(THREADS * REGION, np.uint8))
            ts = [threading.Thread(target=worker, args=(rt, f, t, errors, streams[t])) for t in range(THREADS)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
    for s in streams:
        rt.stream_destroy(s)
    if errors:
        raise errors[0]


def test_nothing_leaks(rt, tmp_path):
    """Files, registrations, requests, stream ops, workers and bounce buffers all go."""
    pio.shutdown()
    base = {k: pio.stats()[k] for k in LIVE}
    assert base == dict.fromkeys(LIVE, 0), base
    dev = rt.device_alloc(1 << 20)
    s = rt.stream_create(0)
    try:
        with ps.override(mode="staged", threads=3):
            pio.register((dev, 1 << 20))
            with pio.open(tmp_path / "leak.bin", "w+") as f:
                f.write((dev, 1 << 20))
                futs = [f.pread((dev, 1 << 20), 4096, i * 4096, i * 4096) for i in range(64)]
                op = f.read_async((dev, 1 << 20), stream=s)
                st = pio.stats()
                assert st["threads"] == 3 and st["files"] == 1 and st["registrations"] == 1
                assert st["bounce_bytes"] > 0
                assert [fut.result() for fut in futs] == [4096] * 64
            assert op.done() and op.bytes_done == 1 << 20  # close waited for it
            st = pio.stats()
            assert st["files"] == 0 and st["requests"] == 0 and st["stream_ops"] == 0 and st["bounce_in_use"] == 0
            pio.deregister((dev, 1 << 20))
    finally:
        rt.stream_destroy(s)
        rt.device_free(dev)
    pio.shutdown()
    assert {k: pio.stats()[k] for k in LIVE} == dict.fromkeys(LIVE, 0)
    assert threading.active_count() >= 1  # (phoenix makes no Python threads)


def test_settings_change_retires_the_old_pool(rt, tmp_path):
    pio.shutdown()
    data = np.arange(100_000, dtype=np.uint8)
    with pio.open(tmp_path / "pools.bin", "w+") as f:
        for threads in (2, 3, 5):
            with ps.override(threads=threads):
                assert f.write(data) == data.nbytes
                assert pio.stats()["threads"] == threads  # the old pool is gone
    pio.shutdown()
    assert pio.stats()["threads"] == 0 and pio.stats()["contexts"] == 0


def test_forked_child_starts_its_own_pool(rt, tmp_path):
    import multiprocessing as mp

    path = tmp_path / "fork.bin"
    data = np.arange(300_000, dtype=np.uint8)
    with pio.open(path, "w+") as f:
        assert f.write(data) == data.nbytes  # the parent's pool is running now

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(str(path), q))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert q.get(timeout=5) == data.nbytes


def _child_read(path, q):
    out = np.zeros(300_000, np.uint8)
    with pio.open(path, "r") as f:
        n = f.read(out)
    q.put(n if (out == np.arange(300_000, dtype=np.uint8)).all() else -1)
