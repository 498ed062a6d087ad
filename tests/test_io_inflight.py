"""The in-flight budget (``inflight``, issue 21) and small background chunks.

Requests from the device (not the page cache) are cut into chunks of at most one worker's
share of ``inflight``; background requests into chunks of at most 2 MiB (a load waits for
one of them, not for a whole chunk_size). Host vendor, both engines; chunk counts come from
the core's counters, and every byte moved is checked, with the bytes around each extent
checked untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._info import sizes
from phoenix.bench.files import drop_cache

MiB = 1 << 20
SIZE = 32 * MiB


@pytest.fixture(params=["io_uring", "threads"])
def engine(request):
    yield request.param
    pio.shutdown()


def _file(tmp_path, n, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    p = tmp_path / f"f{seed}.bin"
    p.write_bytes(data.tobytes())
    assert drop_cache(str(p)).startswith("fadvise")  # cold: the reads below come from the device
    return p, data


CHUNKS = ("chunks_user", "chunks_staged", "chunks_staged_cpu")


def _delta(fn):
    """fn()'s result and the chunks it was cut into (every path's counter)."""
    before = sum(pio.stats()[c] for c in CHUNKS)
    out = fn()
    return out, sum(pio.stats()[c] for c in CHUNKS) - before


@pytest.mark.parametrize(
    "inflight,threads,chunks",
    [
        (4 * MiB, 2, SIZE // (2 * MiB)),
        (0, 2, SIZE // (8 * MiB)),
        (64 * MiB, 2, SIZE // (8 * MiB)),
        (MiB, 4, SIZE // MiB),
    ],
)
def test_cold_reads_are_cut_at_a_workers_share(tmp_path, engine, inflight, threads, chunks):
    """A cold read of host memory and a staged one into device memory: chunks of
    min(chunk_size, inflight / threads), at least 1 MiB; every byte checked."""
    path, data = _file(tmp_path, SIZE, 1)
    with ps.override(engine=engine, threads=threads, chunk_size=8 * MiB, inflight=inflight, mode="staged"):
        assert sizes()["worker_bytes"] == (max(MiB, inflight // threads) if inflight else 64 * MiB)
        host = np.full(SIZE + 8192, 0xA5, np.uint8)
        with pio.open(path, "r") as f:
            n, got = _delta(lambda: f.read(host[4096 : 4096 + SIZE], SIZE, 0))
        assert (n, got) == (SIZE, chunks)
        np.testing.assert_array_equal(host[4096:-4096], data)
        assert (host[:4096] == 0xA5).all() and (host[-4096:] == 0xA5).all()


@pytest.mark.parametrize("inflight,chunks", [(4 * MiB, SIZE // (2 * MiB)), (0, SIZE // (8 * MiB))])
def test_cold_staged_reads_and_writes_are_cut_at_a_workers_share(rt, dev, tmp_path, engine, inflight, chunks):
    path, data = _file(tmp_path, SIZE, 2)
    with ps.override(engine=engine, threads=2, chunk_size=8 * MiB, inflight=inflight, mode="staged"):
        buf = dev(SIZE)
        buf.fill(np.full(SIZE, 0x3C, np.uint8))
        with pio.open(path, "r") as f:
            n, got = _delta(lambda: f.read(buf.buf(), SIZE, 0))
        assert (n, got) == (SIZE, chunks)
        np.testing.assert_array_equal(buf.get(), data)
        out = tmp_path / "out.bin"
        with pio.open(out, "w+") as f:
            n, got = _delta(lambda: f.write(buf.buf(), SIZE, 0))
        assert (n, got) == (SIZE, chunks)
        np.testing.assert_array_equal(np.fromfile(out, np.uint8), data)


def _spans(off, n, c):
    """Chunks of c bytes (cut at multiples of c in file offsets) that [off, off + n) spans."""
    return (off + n - 1) // c - off // c + 1


@pytest.mark.parametrize("priority,chunk", [("background", 2 * MiB), ("normal", 8 * MiB)])
def test_background_writes_take_small_chunks(rt, dev, tmp_path, engine, priority, chunk):
    """A background write is cut into 2 MiB chunks whatever chunk_size says; a normal one
    at chunk_size. The file holds every byte, nothing past the extent is written."""
    chunks = _spans(4096, SIZE, chunk)
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    with ps.override(engine=engine, threads=2, chunk_size=8 * MiB, inflight=0, mode="staged"):
        buf = dev(SIZE)
        buf.fill(data)
        out = tmp_path / "bg.bin"
        out.write_bytes(b"\x77" * (SIZE + 2 * 4096))
        with pio.open(out, "r+") as f:
            n, got = _delta(lambda: f.pwrite(buf.buf(), SIZE, 4096, priority=priority).result())
        assert (n, got) == (SIZE, chunks)
    on_disk = np.fromfile(out, np.uint8)
    np.testing.assert_array_equal(on_disk[4096 : 4096 + SIZE], data)
    assert (on_disk[:4096] == 0x77).all() and (on_disk[4096 + SIZE :] == 0x77).all()


def test_cached_reads_keep_their_chunks(rt, dev, tmp_path, engine):
    """A read from the page cache is not cut by the budget (its chunks are 4 MiB copies).
    The mapping cache is on (it is what sees that the file is cached) but too small to
    register a window, so the read is the staged path's."""
    data = np.random.default_rng(4).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "warm.bin"
    path.write_bytes(data.tobytes())
    with ps.override(engine=engine, threads=2, chunk_size=8 * MiB, inflight=2 * MiB, mode="staged", fmap_cache=4096):
        buf = dev(SIZE)
        with pio.open(path, "r") as f:
            f.read(buf.buf(), SIZE, 0)  # the file is in the page cache now
            n, got = _delta(lambda: f.read(buf.buf(), SIZE, 0))
        assert (n, got) == (SIZE, SIZE // (4 * MiB))
        np.testing.assert_array_equal(buf.get(), data)


@pytest.mark.parametrize("bad", ["512K", "4095", "-1M", "lots"])
def test_inflight_setting_is_checked(bad, monkeypatch):
    monkeypatch.setenv("PHX_INFLIGHT", bad)
    with pytest.raises(ValueError, match="inflight"):
        ps.get()


def test_sizes_say_why_chunks_are_smaller():
    with ps.override(threads=8, chunk_size=8 * MiB, inflight=16 * MiB):
        s = sizes()
        assert s["worker_bytes"] == 2 * MiB
        assert "PHX_INFLIGHT" in s["why"]
    pio.shutdown()
