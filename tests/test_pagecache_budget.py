"""Registered page-cache windows are bounded, visible, and given back (issue 22), on the host vendor.

Windows (mmap'd, host-registered file ranges of the page cache) pin their pages: nothing
can evict them. The cache never pins more than ``fmap_cache``; a window not read for
``fmap_idle`` seconds is released; a memory-pressure signal releases every window (those
a read is copying from when that read is done) while reads go on, staged, with the right
bytes; ``phx info`` and ``stats()`` show what is pinned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _devmem import Dev, check_extent  # tests/_devmem.py

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._pagecache import _fmap_simulate_pressure

W = 2 << 20


@pytest.fixture(autouse=True)
def _fresh(rt):
    pio.shutdown()
    yield
    pio.shutdown()


def make_file(path, size, seed=1):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    data.tofile(path)
    return data


def fmap(**kw):
    kw.setdefault("fmap_window", W)
    kw.setdefault("mode", "staged")
    kw.setdefault("fmap_mode", "sync")
    return ps.override(**kw)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_default_budget_is_small():
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert ps.DEFAULTS["fmap_cache"] == min(4 << 30, ram // 16)
    assert ps.DEFAULTS["fmap_idle"] == 30.0
    with ps.override(fmap_idle="1.5"):
        assert ps.get().fmap_idle == 1.5
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match="fmap_idle"):
            ps.override(fmap_idle=bad).__enter__()


def test_windows_above_the_budget_are_never_pinned(rt, dev, tmp_path):
    path = tmp_path / "big.bin"
    size = 7 * W + 123
    data = make_file(path, size, 3)
    budget = 3 * W
    d = dev(2 * W)
    with fmap(fmap_cache=budget, fmap_idle=0), pio.open(path) as f:
        for _round in range(3):  # warm: more than the budget is read, again and again
            for off in range(0, size, W):
                n = min(2 * W, size - off)
                d.poison()
                assert f.read(d.buf(), n, off) == n
                check_extent(d.get(), data[off:], 0, n)
                st, info = pio.stats(), pio.fmap_info()
                assert st["fmap_bytes"] <= budget and info["pinned"] <= budget and info["bytes"] <= budget
        info = pio.fmap_info()
        assert info["registrations"] > 3 and info["evictions"] > 0
        assert 0 < info["pinned"] <= budget and pio.stats()["fmap_bytes"] == info["pinned"]
    pio.shutdown()
    assert pio.stats()["fmap_bytes"] == 0 and pio.stats()["fmap_windows"] == 0


def test_idle_window_is_released(rt, dev, tmp_path):
    path = tmp_path / "idle.bin"
    size = 2 * W
    data = make_file(path, size, 4)
    d = dev(size)
    with fmap(fmap_idle=0.5), pio.open(path) as f:
        assert f.read(d.buf(), size, 0) == size
        check_extent(d.get(), data, 0, size)
        assert pio.fmap_info()["windows"] == 2 and pio.stats()["fmap_bytes"] == 2 * W
        assert wait_for(lambda: pio.fmap_info()["windows"] == 0, 10)
        info = pio.fmap_info()
        assert info["pinned"] == 0 and info["idle_releases"] == 2 and pio.stats()["fmap_bytes"] == 0
        # read again: registered again, right bytes
        d.poison()
        assert f.read(d.buf(), size, 0) == size
        check_extent(d.get(), data, 0, size)
        assert pio.fmap_info()["windows"] == 2
    pio.shutdown()
    # fmap_idle=0: never released for being idle
    with fmap(fmap_idle=0), pio.open(path) as f:
        assert f.read(d.buf(), size, 0) == size
        time.sleep(1.0)
        assert pio.fmap_info()["windows"] == 2 and pio.fmap_info()["idle_releases"] == 0


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_pressure_releases_every_window_while_reads_go_on(rt, dev, tmp_path, mode):
    path = tmp_path / "pressure.bin"
    size = 4 * W + 777
    data = make_file(path, size, 5)
    errors: list = []
    stop = threading.Event()
    reads = [0]

    def reader(tid):
        rng = np.random.default_rng(200 + tid)
        d = Dev(rt, size + 4096)
        try:
            while not stop.is_set():
                n = int(rng.integers(1, size))
                off = int(rng.integers(0, size - n + 1))
                boff = int(rng.integers(0, 4096))
                d.poison()
                assert f.read(d.buf(), n, off, boff) == n
                check_extent(d.get(), data[off:], boff, n)
                reads[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            stop.set()
        finally:
            d.free()

    with fmap(fmap_mode=mode, fmap_idle=0), pio.open(path) as f:
        ts = [threading.Thread(target=reader, args=(t,)) for t in range(6)]
        for t in ts:
            t.start()
        try:
            # windows registered and read from
            assert wait_for(lambda: pio.fmap_info()["windows"] >= 3 and pio.fmap_info()["hits"] > 20, 20)
            _fmap_simulate_pressure()
            # every window goes (those in use when their reads are done); none is registered
            # again for 5 s, while the readers keep reading (staged)
            assert wait_for(lambda: pio.fmap_info()["pressure_releases"] == 1, 3)
            assert wait_for(lambda: pio.fmap_info()["pinned"] == 0 and pio.stats()["fmap_bytes"] == 0, 3)
            info = pio.fmap_info()
            assert info["windows"] == 0 and info["pending"] == 0
            n0 = reads[0]
            assert wait_for(lambda: reads[0] > n0 + 20, 10)  # reads go on
            assert pio.fmap_info()["windows"] == 0
        finally:
            stop.set()
            for t in ts:
                t.join()
        assert not errors, errors[0]
        assert pio.fmap_wait(timeout=30)
        assert pio.fmap_info()["in_use"] == 0


def test_info_and_stats_report_the_pinned_bytes(rt, dev, tmp_path):
    path = tmp_path / "info.bin"
    data = make_file(path, 3 * W, 6)
    d = dev(3 * W)
    with fmap(fmap_cache="64M", fmap_idle=7), pio.open(path) as f:
        assert f.read(d.buf(), 3 * W, 0) == 3 * W
        check_extent(d.get(), data, 0, 3 * W)
        assert pio.stats()["fmap_bytes"] == 3 * W and pio.stats()["fmap_windows"] == 3
        caps = pio.capabilities()
        fm = caps["modes"]["zero_copy_file_mappings"]
        assert fm["state"]["pinned"] == 3 * W and fm["state"]["windows"] == 3
        assert "64.0 MiB" in fm["why"] and "7 s" in fm["why"] and "PHX_FMAP_MODE=off" in fm["why"]
        assert caps["settings"]["fmap_idle"] == 7
    env = dict(os.environ, PHX_VENDOR="host", PHX_FMAP_CACHE="96M", PHX_FMAP_IDLE="12")
    out = subprocess.run(
        [sys.executable, "-m", "phoenix.cli.phx", "info"],
        env=env,
        cwd=os.path.dirname(os.path.abspath(__file__)),  # not the source tree: the installed package
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "fmap_cache: 96.0 MiB" in out.stdout and "fmap_idle: 12 s" in out.stdout
    assert "page-cache windows pinned: 0 B in 0 windows (budget 96.0 MiB, released after 12 s unread" in out.stdout
