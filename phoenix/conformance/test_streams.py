"""Streams, the stream host callback (LaunchHostFunc), and stream ordering.

The callbacks are C (``phx_ct_run`` in :data:`phoenix.conformance.plugin.CHELPER_SOURCE`,
compiled at test time): a stream callback runs on a runtime thread and must never be
Python. Each takes a task that can wait on a gate, sleep, then fill or snapshot a
host buffer, and records the order in which it ran. Host buffers that stream work
reads or writes are pinned: a runtime may stage pageable memory at enqueue time.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from .plugin import D2D, D2H, H2D, POISON, READBACK_POISON, MiB, assert_bytes, random_bytes, read_device

streams = pytest.mark.capability("streams")
callback = pytest.mark.capability("host_callback")
ordering = pytest.mark.capability("stream_ordering")

GATE_TIMEOUT_S = 1.0


# -- streams ------------------------------------------------------------------------------


@streams
def test_create_destroy_every_device(rt, devices):
    for d in devices:
        handles = [rt.stream_create(d.ordinal) for _ in range(4)]
        try:
            assert all(isinstance(h, int) and h != 0 for h in handles), (
                f"stream handles {handles} (0 is the default stream)"
            )
            assert len(set(handles)) == len(handles), f"stream_create returned a handle twice: {handles}"
        finally:
            for h in handles:
                rt.stream_destroy(h)


@streams
def test_synchronize_idle_stream(rt, mem):
    s = mem.stream()
    rt.stream_synchronize(s)
    rt.stream_synchronize(s)


@streams
def test_synchronize_default_stream(rt):
    rt.stream_synchronize(0)


@streams
def test_stream_reused_for_many_rounds(rt, mem, rng):
    s = mem.stream()
    n = 256 * 1024
    hptr, hview = mem.pinned(n)
    optr, oview = mem.pinned(n)
    dev = mem.dev(n)
    for i in range(50):
        data = random_bytes(rng, n)
        hview[:] = data
        oview[:] = POISON
        rt.memcpy_async(dev, hptr, n, H2D, s)
        rt.memcpy_async(optr, dev, n, D2H, s)
        rt.stream_synchronize(s)
        assert_bytes(oview, data, f"round {i} on a reused stream")


@streams
def test_many_streams(rt, mem, rng):
    """64 streams with work queued on all of them before any is synchronized."""
    n = 64 * 1024
    work = []
    for _ in range(64):
        s = mem.stream()
        hptr, hview = mem.pinned(n)
        optr, oview = mem.pinned(n)
        dev = mem.dev(n)
        hview[:] = random_bytes(rng, n)
        oview[:] = POISON
        rt.memcpy_async(dev, hptr, n, H2D, s)
        rt.memcpy_async(optr, dev, n, D2H, s)
        work.append((s, hview, oview))
    for i, (s, hview, oview) in enumerate(work):
        rt.stream_synchronize(s)
        assert_bytes(oview, hview, f"stream {i} of 64")


@streams
def test_streams_from_several_threads(rt, devices):
    """Four threads, each with its own stream and buffers, copying at once."""
    errors: list[str] = []
    n, rounds = 512 * 1024, 20

    def worker(k: int):
        try:
            dev_ord = devices[k % len(devices)].ordinal
            rt.set_device(dev_ord)
            s = rt.stream_create(dev_ord)
            hptr, optr = rt.host_alloc_pinned(n), rt.host_alloc_pinned(n)
            dev = rt.device_alloc(n, dev_ord)
            try:
                hview = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(hptr))
                oview = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(optr))
                g = np.random.default_rng(k)
                for r in range(rounds):
                    hview[:] = random_bytes(g, n)
                    oview[:] = POISON
                    rt.memcpy_async(dev, hptr, n, H2D, s)
                    rt.memcpy_async(optr, dev, n, D2H, s)
                    rt.stream_synchronize(s)
                    if not np.array_equal(oview, hview):
                        errors.append(f"thread {k} round {r}: data differs")
                        return
            finally:
                rt.stream_destroy(s)
                rt.device_free(dev)
                rt.host_free_pinned(hptr)
                rt.host_free_pinned(optr)
        except Exception as exc:  # reported below, with the thread that saw it
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 60 s"
    assert not errors, "; ".join(errors)


# -- the host callback -------------------------------------------------------------------


@callback
def test_callback_runs_once_with_its_argument(rt, mem, chelper):
    s = mem.stream()
    task = chelper.task()
    chelper.launch(rt, s, task)
    rt.stream_synchronize(s)
    assert task.calls == 1, f"the callback ran {task.calls} times by stream_synchronize"
    assert task.arg_seen == task.address, (
        f"the callback got argument {task.arg_seen:#x}, launched with {task.address:#x}"
    )


@callback
def test_callbacks_run_in_launch_order(rt, mem, chelper):
    s = mem.stream()
    tasks = [chelper.task() for _ in range(1000)]
    for t in tasks:
        chelper.launch(rt, s, t)
    rt.stream_synchronize(s)
    calls = [t.calls for t in tasks]
    assert calls == [1] * len(tasks), f"callbacks ran {sorted(set(calls))} times (each must run once)"
    seqs = [t.seq for t in tasks]
    assert seqs == sorted(seqs), "callbacks on one stream ran out of launch order"


@callback
def test_callback_every_device(rt, mem, chelper, devices):
    for d in devices:
        s = mem.stream(d.ordinal)
        task = chelper.task()
        chelper.launch(rt, s, task)
        rt.stream_synchronize(s)
        assert task.calls == 1, f"device {d.ordinal}: the callback ran {task.calls} times"


@callback
def test_callback_default_stream(rt, chelper):
    task = chelper.task()
    chelper.launch(rt, 0, task)
    rt.stream_synchronize(0)
    assert task.calls == 1, f"a callback on the default stream ran {task.calls} times"


@callback
def test_callback_writes_host_memory(rt, mem, chelper):
    n = 1 * MiB
    ptr, view = mem.pinned(n)
    view[:] = 0
    s = mem.stream()
    chelper.launch(rt, s, chelper.task(fill=0x77, dst=ptr, n=n))
    rt.stream_synchronize(s)
    assert_bytes(view, np.full(n, 0x77, np.uint8), "host memory written by a callback")


# -- stream ordering -----------------------------------------------------------------------


@ordering
def test_copies_run_in_stream_order(rt, mem, rng):
    """Copies that overwrite one region, with reads between, see each write in turn."""
    n = 4 * MiB
    s = mem.stream()
    dev, dev2 = mem.dev(n), mem.dev(n)
    ins = [mem.pinned(n) for _ in range(3)]
    outs = [mem.pinned(n) for _ in range(3)]
    datas = [random_bytes(rng, n) for _ in range(3)]
    for (_, v), d in zip(ins, datas, strict=True):
        v[:] = d
    for _, v in outs:
        v[:] = READBACK_POISON
    (a, _), (b, _), (c, _) = ins
    (o1, v1), (o2, v2), (o3, v3) = outs
    rt.memcpy_async(dev, a, n, H2D, s)
    rt.memcpy_async(o1, dev, n, D2H, s)
    rt.memcpy_async(dev, b, n, H2D, s)
    rt.memcpy_async(o2, dev, n, D2H, s)
    rt.memcpy_async(dev2, dev, n, D2D, s)
    rt.memcpy_async(dev, c, n, H2D, s)
    rt.memcpy_async(o3, dev2, n, D2H, s)
    rt.stream_synchronize(s)
    assert_bytes(v1, datas[0], "read after the first write")
    assert_bytes(v2, datas[1], "read after the second write")
    assert_bytes(v3, datas[1], "device copy taken before the third write")
    assert_bytes(read_device(rt, dev, n), datas[2], "region after the third write")


@ordering
def test_callback_sees_earlier_work_finished(rt, mem, rng, chelper):
    """[gate] [H2D] [D2H] [snapshot]: the snapshot must see the whole D2H result.

    The gate callback holds the stream until every op is queued, so the copies cannot
    have finished by the time a callback that runs early (at launch) would run.
    """
    n = 8 * MiB
    s = mem.stream()
    src, src_view = mem.pinned(n)
    out, out_view = mem.pinned(n)
    snap = mem.keep(np.full(n, READBACK_POISON, dtype=np.uint8))
    dev = mem.dev(n)
    data = random_bytes(rng, n)
    src_view[:] = data
    out_view[:] = POISON
    gate = mem.keep(ctypes.c_int(0))
    gate_task = chelper.task(gate=gate, gate_timeout_s=GATE_TIMEOUT_S)
    chelper.launch(rt, s, gate_task)
    rt.memcpy_async(dev, src, n, H2D, s)
    rt.memcpy_async(out, dev, n, D2H, s)
    snap_task = chelper.task(src=out, dst=snap.ctypes.data, n=n)
    chelper.launch(rt, s, snap_task)
    gate.value = 1
    rt.stream_synchronize(s)
    assert not gate_task.gate_timed_out, (
        "the gate callback waited for a flag set only after all launches: it ran at launch time, not in stream order"
    )
    assert snap_task.calls == 1
    assert_bytes(snap, data, "what a callback queued after a D2H copy saw of its destination")


@ordering
def test_callback_holds_back_later_work(rt, mem, chelper):
    """[sleep, then fill host buffer] [H2D from it] [D2H]: the copies see the fill."""
    n = 4 * MiB
    s = mem.stream()
    src, src_view = mem.pinned(n)
    out, out_view = mem.pinned(n)
    dev = mem.dev(n)
    src_view[:] = 0x11
    out_view[:] = POISON
    chelper.launch(rt, s, chelper.task(sleep_s=0.05, fill=0xE7, dst=src, n=n))
    rt.memcpy_async(dev, src, n, H2D, s)
    rt.memcpy_async(out, dev, n, D2H, s)
    rt.stream_synchronize(s)
    assert_bytes(
        out_view,
        np.full(n, 0xE7, np.uint8),
        "a copy queued after a callback that writes its source (0x11 = ran before the callback returned)",
    )


@ordering
def test_copies_and_callbacks_interleaved(rt, mem, chelper):
    """Rounds of [fill input] [H2D] [D2H to a shared output] [snapshot the output].

    One input and one output buffer serve every round, so each snapshot holds its
    round's marker only if every op ran after the one before it and before the next.
    """
    n, rounds = 2 * MiB, 12
    s = mem.stream()
    src, _ = mem.pinned(n)
    out, out_view = mem.pinned(n)
    dev = mem.dev(n)
    out_view[:] = POISON
    snaps = [mem.keep(np.full(n, READBACK_POISON, dtype=np.uint8)) for _ in range(rounds)]
    markers = [0x20 + 7 * i for i in range(rounds)]
    fills, shots = [], []
    for i in range(rounds):
        fills.append(chelper.task(sleep_s=0.002, fill=markers[i], dst=src, n=n))
        chelper.launch(rt, s, fills[-1])
        rt.memcpy_async(dev, src, n, H2D, s)
        rt.memcpy_async(out, dev, n, D2H, s)
        shots.append(chelper.task(src=out, dst=snaps[i].ctypes.data, n=n))
        chelper.launch(rt, s, shots[-1])
    rt.stream_synchronize(s)
    order = [t.seq for pair in zip(fills, shots, strict=True) for t in pair]
    assert order == sorted(order), f"callbacks ran out of order: {order}"
    for i in range(rounds):
        got = np.unique(snaps[i])
        assert got.tolist() == [markers[i]], (
            f"round {i}: the snapshot holds bytes {[hex(int(x)) for x in got[:6]]}, expected only 0x{markers[i]:02x}"
        )


@ordering
def test_streams_do_not_wait_for_each_other(rt, mem, rng, chelper):
    """Stream A is held by a gate; copies on stream B complete meanwhile."""
    n = 1 * MiB
    a, b = mem.stream(), mem.stream()
    gate = mem.keep(ctypes.c_int(0))
    gate_task = chelper.task(gate=gate, gate_timeout_s=GATE_TIMEOUT_S)
    after = chelper.task()
    chelper.launch(rt, a, gate_task)
    chelper.launch(rt, a, after)
    src, src_view = mem.pinned(n)
    out, out_view = mem.pinned(n)
    dev = mem.dev(n)
    data = random_bytes(rng, n)
    src_view[:] = data
    out_view[:] = POISON
    try:
        rt.memcpy_async(dev, src, n, H2D, b)
        rt.memcpy_async(out, dev, n, D2H, b)
        rt.stream_synchronize(b)
        b_done_while_gated = not gate_task.calls and not gate_task.gate_timed_out
    finally:
        gate.value = 1
    rt.stream_synchronize(a)
    assert not gate_task.gate_timed_out, (
        "stream A's gate callback timed out: it ran at launch time, or stream B's work waited for it"
    )
    assert b_done_while_gated, "stream B finished only after stream A's gate opened"
    assert after.calls == 1
    assert_bytes(out_view, data, "copies on stream B while stream A was blocked")


@ordering
def test_ordering_on_every_device(rt, mem, chelper, devices):
    """On each device's stream: [sleep, fill] [H2D] [D2H] [snapshot], all in order."""
    n = 1 * MiB
    for d in devices:
        s = mem.stream(d.ordinal)
        src, src_view = mem.pinned(n)
        out, out_view = mem.pinned(n)
        snap = mem.keep(np.full(n, READBACK_POISON, dtype=np.uint8))
        dev = mem.dev(n, d.ordinal)
        src_view[:] = 0x11
        out_view[:] = POISON
        chelper.launch(rt, s, chelper.task(sleep_s=0.01, fill=0x3D, dst=src, n=n))
        rt.memcpy_async(dev, src, n, H2D, s)
        rt.memcpy_async(out, dev, n, D2H, s)
        chelper.launch(rt, s, chelper.task(src=out, dst=snap.ctypes.data, n=n))
        rt.stream_synchronize(s)
        assert_bytes(out_view, np.full(n, 0x3D, np.uint8), f"device {d.ordinal}: copy after a filling callback")
        assert_bytes(snap, np.full(n, 0x3D, np.uint8), f"device {d.ordinal}: callback after the copies")
