"""The I/O stack's errors on the vendor under test (capability ``io_errors``): closed files,
wrong open modes, ENOSPC, bad arguments: PhxIOError naming file, offset and length; failed
stream ops report late and leave the stream working; nothing left behind.

Conformance side (a pytest module of ``phx-port test``); the helpers are :mod:`.test_io`'s.
"""

from __future__ import annotations

import errno
import gc
import os

import numpy as np
import pytest

import phoenix.io as pio
from phoenix.errors import PhxIOError

from .plugin import (
    CHUNK,
    D2H,
    POISON,
    assert_bytes,
    random_bytes,
    read_device,
)
from .test_io import device_with, file_bytes, io_errors, make_file, poisoned_device


def assert_names(e: PhxIOError, path, offset: int, length: int, err: int, what: str):
    assert isinstance(e, PhxIOError), f"{what}: {type(e).__name__}: {e}"
    assert e.errno == err, f"{what}: errno {e.errno} ({e}), expected {errno.errorcode[err]}"
    assert (e.path, e.offset, e.length) == (str(path), offset, length), f"{what}: {e!r}"
    assert str(path) in str(e) and str(offset) in str(e) and str(length) in str(e), f"{what}: message {e}"


@io_errors
def test_wrong_open_mode(rt, mem, rng, engine, mode, tmp_path):
    """Writing a read-only file and reading a write-only one: EBADF naming file, offset
    and length; the file and the destination unchanged."""
    n = 2 * CHUNK + 3
    path = tmp_path / "modes.bin"
    background = random_bytes(rng, 3 * n)
    make_file(path, background)
    src = device_with(rt, mem, random_bytes(rng, n))
    dst = poisoned_device(rt, mem, n)
    with pio.open(path, "r") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write((src, n), n, 4097)
        assert_names(ei.value, path, 4097, n, errno.EBADF, f"{engine}/{mode}: write to a read-only file")
        res = pio.batch([(f, (src, n), n, 4097, 0, "write")])[0]
        assert_names(res, path, 4097, n, errno.EBADF, f"{engine}/{mode}: batch write to a read-only file")
    with pio.open(path, "a") as f:
        with pytest.raises(PhxIOError) as ei:
            f.pread((dst, n), n, 123).result()
        assert_names(ei.value, path, 123, n, errno.EBADF, f"{engine}/{mode}: read from a write-only file")
    assert_bytes(file_bytes(path), background, "the file")
    assert_bytes(read_device(rt, dst, n), np.full(n, POISON, np.uint8), "the destination of the failed read")


@io_errors
def test_closed_file(rt, mem, engine, tmp_path):
    path = tmp_path / "closed.bin"
    make_file(path, np.zeros(8192, np.uint8))
    d = poisoned_device(rt, mem, 4096)
    s = mem.stream()
    f = pio.open(path, "r+")
    f.close()
    f.close()  # twice is fine
    for op, call in (
        ("read", lambda: f.read((d, 4096))),
        ("write", lambda: f.write((d, 4096))),
        ("pread", lambda: f.pread((d, 4096)).result()),
        ("read_async", lambda: f.read_async((d, 4096), stream=s)),
        ("batch", lambda: pio.batch([(f, (d, 4096))])[0]),
    ):
        try:
            res = call()
        except (ValueError, OSError) as exc:
            res = exc
        assert isinstance(res, (ValueError, OSError)), f"{op} on a closed file returned {res!r}"
        if isinstance(res, OSError):
            assert res.errno == errno.EBADF, f"{op} on a closed file: {res}"
        assert str(path) in str(res), f"{op} on a closed file: the error does not name the file: {res}"
    rt.stream_synchronize(s)
    assert_bytes(read_device(rt, d, 4096), np.full(4096, POISON, np.uint8), "device memory")


@io_errors
def test_stream_errors_are_late_and_the_stream_goes_on(rt, mem, rng, engine, mode, tmp_path):
    """A write_async to a read-only file completes with -EBADF (result() raises it naming
    the file); the copy queued after it still runs."""
    n = CHUNK + 17
    path = tmp_path / "late.bin"
    background = random_bytes(rng, 2 * n)
    make_file(path, background)
    s = mem.stream()
    data = random_bytes(rng, n)
    src = device_with(rt, mem, data)
    y, yv = mem.pinned(n)
    yv[:] = POISON
    with pio.open(path, "r") as f:
        op = f.write_async((src, n), n, 10, 0, s)
        rt.memcpy_async(y, src, n, D2H, s)
        rt.stream_synchronize(s)
        assert op.bytes_done == -errno.EBADF, f"{engine}/{mode}: bytes_done {op.bytes_done}, expected -EBADF"
        with pytest.raises(PhxIOError) as ei:
            op.result()
        assert_names(ei.value, path, 10, n, errno.EBADF, f"{engine}/{mode}: write_async to a read-only file")
    assert_bytes(yv, data, "the copy queued after the failed write_async")
    assert_bytes(file_bytes(path), background, "the file")


@io_errors
def test_enospc(rt, mem, engine, mode):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    n = CHUNK + 10
    src = poisoned_device(rt, mem, n)
    with pio.open("/dev/full", "r+") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write((src, n), n, 0)
    assert_names(ei.value, "/dev/full", 0, n, errno.ENOSPC, f"{engine}/{mode}: write to /dev/full")


@io_errors
def test_bad_arguments(rt, mem, engine, tmp_path):
    path = tmp_path / "args.bin"
    make_file(path, np.zeros(4096, np.uint8))
    d = poisoned_device(rt, mem, 4096)
    with pio.open(path, "r+") as f:
        for call in (
            lambda: f.read((d, 4096), 10, -1),
            lambda: f.write((d, 4096), 10, 0, -1),
            lambda: f.read((d, 4096), -5, 0),
        ):
            with pytest.raises(PhxIOError) as ei:
                call()
            assert ei.value.errno == errno.EINVAL and ei.value.path == str(path), str(ei.value)
    missing = tmp_path / "missing" / "x.bin"
    with pytest.raises(PhxIOError) as ei:
        pio.open(missing, "r")
    assert ei.value.errno == errno.ENOENT and str(missing) in str(ei.value)
    assert_bytes(read_device(rt, d, 4096), np.full(4096, POISON, np.uint8), "device memory")


@io_errors
def test_nothing_left_behind(rt, mem, rng, engine, mode, tmp_path):
    """After successful and failed requests and stream ops, with the files closed: no
    request, stream op or bounce buffer is still held."""
    gc.collect()
    before = pio.stats()
    n = 4 * CHUNK
    path = tmp_path / "leaks.bin"
    make_file(path, random_bytes(rng, n))
    d = poisoned_device(rt, mem, n)
    s = mem.stream()
    with pio.open(path, "r") as f:
        futs = [f.pread((d, n), CHUNK, i * CHUNK, i * CHUNK) for i in range(4)]
        ops = [f.read_async((d, n), n, 0, 0, s), f.write_async((d, n), n, 0, 0, s)]
        with pytest.raises(PhxIOError):
            f.write((d, n))
        assert [fu.result() for fu in futs] == [CHUNK] * 4
        rt.stream_synchronize(s)
        assert [op.bytes_done for op in ops] == [n, -errno.EBADF]
    del futs, ops
    gc.collect()
    after = pio.stats()
    for key in ("files", "requests", "stream_ops", "bounce_in_use"):
        assert after[key] <= before[key], f"{engine}/{mode}: {key} was {before[key]}, now {after[key]}"
