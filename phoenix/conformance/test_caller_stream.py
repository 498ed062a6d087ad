"""Ordering with the caller's stream: blocking calls and futures never race queued work.

Capability ``io_caller_stream`` (the rule is in :mod:`phoenix.io`): an I/O call that
touches device memory runs after all work queued so far on the caller's stream, and its
bytes are in place for work queued after it completes. The caller's stream is the
call's ``stream=``, else the buffer's framework's current stream, else the default one.

Each test holds the stream with a host callback that sleeps, queues work on the
destination (or the source) behind it, then makes a blocking or future call *without
synchronizing*: without the ordering the I/O runs first and the queued copy lands after
it (reads) or the file gets the bytes from before it (writes). Every byte is checked,
and the bytes around the extent. Raw handles on the default stream and on a side
stream, for ``read``/``pread``/``read_many``/``batch`` and their write twins, every
engine and mode; torch tensors and CuPy arrays (their current streams) where installed
and backed by the vendor under test.
"""

from __future__ import annotations

import numpy as np
import pytest

import phoenix.io as pio
from phoenix.vendor import MemoryType

from .plugin import D2H, H2D, POISON, KiB, assert_bytes, fill_device, random_bytes, read_device, write_device
from .test_io import make_file

caller_stream = pytest.mark.capability("io_caller_stream")

#: how long the stream is held: far longer than the I/O of N bytes takes
HOLD_S = 0.1
#: a few chunks (the suite's chunk size is 64 KiB) plus an odd tail
N = 3 * 64 * KiB + 777
#: the extent lies inside a larger allocation: bytes around it must stay untouched
PAD = 4 * KiB + 13

STREAMS = ("default", "side")


def _half(n: int) -> int:
    return n // 2 + 5


def _read(api: str, f, buf, n: int, stream) -> int:
    """Read the file's first n bytes into buf with one of the blocking or future calls
    (``stream``: None names no stream, as natural code does)."""
    h = _half(n)
    kw = {} if stream is None else {"stream": stream}
    if api == "read":
        return f.read(buf, n, 0, **kw)
    if api == "pread":
        return f.pread(buf, n, 0, **kw).result()
    if api == "read_many":
        return int(f.read_many(buf, [h, 0], [n - h, h], [h, 0], **kw).sum())
    if api == "batch":
        res = pio.batch([(f, buf, h, 0, 0, "read"), (f, buf, n - h, h, h, "read")], **kw)
        assert all(isinstance(x, int) for x in res), res
        return sum(res)
    raise AssertionError(api)


def _write(api: str, f, buf, n: int, stream) -> int:
    h = _half(n)
    kw = {} if stream is None else {"stream": stream}
    if api == "read":
        return f.write(buf, n, 0, **kw)
    if api == "pread":
        return f.pwrite(buf, n, 0, **kw).result()
    if api == "read_many":
        return int(f.write_many(buf, [h, 0], [n - h, h], [h, 0], **kw).sum())
    if api == "batch":
        res = pio.batch([(f, buf, h, 0, 0, "write"), (f, buf, n - h, h, h, "write")], **kw)
        assert all(isinstance(x, int) for x in res), res
        return sum(res)
    raise AssertionError(api)


APIS = ("read", "pread", "read_many", "batch")


@caller_stream
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", STREAMS)
def test_read_waits_for_queued_writes(rt, mem, rng, io, engine, mode, tmp_path, chelper, api, which):
    """[hold] [copy POISON -> the destination] on the caller's stream, then a blocking read
    of the file into it: the read lands after the copy (the destination holds the file),
    and a copy queued after the read sees its bytes."""
    data = random_bytes(rng, N)
    path = tmp_path / "caller-read.bin"
    make_file(path, data)
    alloc = mem.dev(N + 2 * PAD)
    fill_device(rt, alloc, N + 2 * PAD, 0x11)  # around the extent: must stay 0x11
    dst = alloc + PAD
    poison, poisonv = mem.pinned(N)
    poisonv[:] = POISON
    out, outv = mem.pinned(N)
    outv[:] = 0x22
    s = mem.stream() if which == "side" else 0
    pio.prepare()  # pin the bounce pool before the stream is held (pinning may wait for busy streams)
    hold = chelper.task(sleep_s=HOLD_S)
    with pio.open(path, "r") as f:
        chelper.launch(rt, s, hold)
        rt.memcpy_async(dst, poison, N, H2D, s)
        got = _read(api, f, (dst, N), N, s if which == "side" else None)
        rt.memcpy_async(out, dst, N, D2H, s)  # work queued after the read sees its bytes
        rt.stream_synchronize(s)
    assert got == N
    assert hold.calls == 1
    whole = read_device(rt, alloc, N + 2 * PAD)
    assert_bytes(
        whole[PAD : PAD + N],
        data,
        f"{engine}/{mode}/{which} stream: {api} into memory a queued copy wrote first (the read raced it "
        "if the destination holds the copy's 0xA5)",
    )
    assert_bytes(
        np.concatenate([whole[:PAD], whole[PAD + N :]]),
        np.full(2 * PAD, 0x11, np.uint8),
        f"{engine}/{mode}: bytes around the extent",
    )
    assert_bytes(outv.copy(), data, f"{engine}/{mode}/{which} stream: a copy queued after {api}")


@caller_stream
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", STREAMS)
def test_write_waits_for_queued_producer(rt, mem, rng, io, engine, mode, tmp_path, chelper, api, which):
    """[hold] [copy the payload -> the source] on the caller's stream, then a blocking write
    of the source: the file gets the payload, not the source's bytes from before."""
    data = random_bytes(rng, N)
    path = tmp_path / "caller-write.bin"
    background = random_bytes(rng, N + 100)
    make_file(path, background)
    src = mem.dev(N)
    fill_device(rt, src, N, POISON)
    payload, payloadv = mem.pinned(N)
    payloadv[:] = data
    s = mem.stream() if which == "side" else 0
    pio.prepare()
    hold = chelper.task(sleep_s=HOLD_S)
    with pio.open(path, "r+") as f:
        chelper.launch(rt, s, hold)
        rt.memcpy_async(src, payload, N, H2D, s)
        got = _write(api, f, (src, N), N, s if which == "side" else None)
        rt.stream_synchronize(s)
    assert got == N
    on_file = np.fromfile(path, dtype=np.uint8)
    assert_bytes(
        on_file[:N],
        data,
        f"{engine}/{mode}/{which} stream: {api} of memory a queued copy fills "
        "(the write raced it if the file holds 0xA5)",
    )
    assert_bytes(on_file[N:], background[N:], f"{engine}/{mode}: the file beyond the extent")


@caller_stream
def test_host_memory_with_a_named_stream(rt, mem, rng, io, engine, tmp_path, chelper):
    """Host memory is ordered when the call names a stream: pinned memory filled by a copy
    queued on it is written with the copy's bytes."""
    data = random_bytes(rng, N)
    path = tmp_path / "caller-host.bin"
    src = mem.dev(N)
    write_device(rt, src, data)
    pinned, pinnedv = mem.pinned(N)
    pinnedv[:] = POISON
    s = mem.stream()
    pio.prepare()
    hold = chelper.task(sleep_s=HOLD_S)
    with pio.open(path, "w+") as f:
        chelper.launch(rt, s, hold)
        rt.memcpy_async(pinned, src, N, D2H, s)
        assert f.write((pinned, N), stream=s) == N
        rt.stream_synchronize(s)
    assert_bytes(np.fromfile(path, dtype=np.uint8), data, f"{engine}: write of pinned memory after a queued copy")


# -- frameworks: their current streams ------------------------------------------------------


def _torch(rt):
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA (or ROCm) device here")
    probe = torch.empty(1, device="cuda")
    if rt.pointer_info(probe.data_ptr()).type is not MemoryType.DEVICE:
        pytest.skip(f"torch's device memory is not memory of vendor {rt.name!r}")
    return torch


def _sleep(torch):
    """Hold torch's current stream for about HOLD_S (a spinning kernel)."""
    torch.cuda._sleep(int(HOLD_S * 2.0e9))


@caller_stream
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", STREAMS)
def test_torch_current_stream(rt, rng, io, engine, tmp_path, api, which):
    """``torch.zeros`` (or a fill on a side stream inside ``torch.cuda.stream``) then a
    read, ``y.copy_(x)`` then a write: no synchronize in between."""
    torch = _torch(rt)
    data = random_bytes(rng, N)
    path = tmp_path / "torch.bin"
    make_file(path, data)
    expect = torch.from_numpy(data.copy())
    side = torch.cuda.Stream() if which == "side" else torch.cuda.current_stream()
    pio.prepare()
    with pio.open(path, "r+") as f, torch.cuda.stream(side):
        _sleep(torch)
        t = torch.zeros(N, dtype=torch.uint8, device="cuda")
        assert _read(api, f, t, N, None) == N
        y = (t.to(torch.int16) + 0).to(torch.uint8)  # work queued after the read
        side.synchronize()
        assert torch.equal(t.cpu(), expect), f"{engine}/{which}: {api} into torch.zeros: zeros landed after the read"
        assert torch.equal(y.cpu(), expect)
        x = torch.from_numpy(random_bytes(rng, N)).cuda()
        dst = torch.full((N,), POISON, dtype=torch.uint8, device="cuda")
        side.synchronize()
        _sleep(torch)
        dst.copy_(x)
        assert _write(api, f, dst, N, None) == N
        side.synchronize()
    on_file = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    assert torch.equal(on_file[:N], x.cpu()), f"{engine}/{which}: {api} after y.copy_(x) wrote stale bytes"


@caller_stream
@pytest.mark.parametrize("api", APIS)
def test_cupy_current_stream(rt, rng, io, engine, tmp_path, chelper, api):
    """CuPy: a fill queued on CuPy's current (non-blocking) stream, then a read; a copy
    into the source, then a write."""
    try:
        import cupy
    except ImportError:
        pytest.skip("CuPy is not installed")
    try:
        arr = cupy.zeros(N, dtype=cupy.uint8)
    except Exception as exc:  # no device, no driver
        pytest.skip(f"CuPy cannot allocate here: {exc}")
    if rt.pointer_info(int(arr.data.ptr)).type is not MemoryType.DEVICE:
        pytest.skip(f"CuPy's device memory is not memory of vendor {rt.name!r}")
    data = random_bytes(rng, N)
    path = tmp_path / "cupy.bin"
    make_file(path, data)
    pio.prepare()
    with pio.open(path, "r+") as f, cupy.cuda.Stream(non_blocking=True) as cs:
        hold = chelper.task(sleep_s=HOLD_S)
        chelper.launch(rt, cs.ptr, hold)
        arr.fill(POISON)
        assert _read(api, f, arr, N, None) == N
        cs.synchronize()
        assert_bytes(cupy.asnumpy(arr), data, f"{engine}: {api} into a CuPy array after a fill on its stream")
        x = cupy.asarray(random_bytes(rng, N))
        cs.synchronize()
        hold2 = chelper.task(sleep_s=HOLD_S)
        chelper.launch(rt, cs.ptr, hold2)
        arr[...] = x
        assert _write(api, f, arr, N, None) == N
        cs.synchronize()
    assert_bytes(
        np.fromfile(path, dtype=np.uint8)[:N],
        cupy.asnumpy(x),
        f"{engine}: {api} of a CuPy array after a copy on its stream",
    )
