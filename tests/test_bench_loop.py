"""`phx bench --fast-device`: a loop device over a tmpfs file, labelled everywhere, torn down
always (normal exit, Ctrl-C, SIGTERM); the raw O_DIRECT sweep's best and at-concurrency
points; the refusals said in one line."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from phoenix.bench import fastdev
from phoenix.bench.report import references
from phoenix.bench.sweep import PHOENIX_GRID, SWEEP_QD, pick_phoenix, select_sweep, sweep_grid
from phoenix.bench.throughput import planned_steps, sequential_plan

LABEL = "loop device over RAM (stand-in for a fast NVMe array)"


def _can_loop() -> str | None:
    if os.geteuid() != 0:
        return "needs root (losetup, mkfs, mount)"
    if shutil.which("losetup") is None or not os.path.exists("/dev/loop-control"):
        return "no losetup or no loop devices"
    if subprocess.run(["losetup", "--find"], capture_output=True).returncode != 0:
        return "no free loop device"
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < 512 << 20:
        return "less than 512 MiB free in /dev/shm"
    return None


needs_loop = pytest.mark.skipif(_can_loop() is not None, reason=str(_can_loop()))


def _leftovers() -> list[str]:
    """Anything of a fast device still there: loop devices over our images, mounts, images, mount dirs."""
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    left = [ln for ln in out.splitlines() if "phx-fastdev" in ln]
    with open("/proc/mounts") as fh:
        left += [ln for ln in fh if "phx-fastdev" in ln]
    left += glob.glob("/dev/shm/phx-fastdev-*")
    left += glob.glob(os.path.join(tempfile.gettempdir(), "phx-fastdev-mnt-*"))
    return left


def _cmd(tmp_path, *extra):
    return [
        sys.executable,
        "-P",
        "-m",
        "phoenix.cli.phx",
        "bench",
        "--fast-device",
        "256M",
        "--size",
        "64M",
        "--chunk",
        "4M",
        "--threads",
        "4",
        "--temperature",
        "cold",
        "--reps",
        "1",
        "--sweep-threads",
        "1,4",
        "--sweep-chunks",
        "1M,4M",
        *extra,
    ]


ENV = dict(os.environ, PHX_VENDOR="host")


# -- the sweep's selection ----------------------------------------------------------------


def test_pick_phoenix_prefers_less_cpu_among_the_fastest():
    pts = [
        {"gbps": 8.0, "cpu_s_per_gb": 0.04},
        {"gbps": 7.9, "cpu_s_per_gb": 0.01},  # within 3%: less CPU wins
        {"gbps": 7.0, "cpu_s_per_gb": 0.001},  # too slow, however cheap
    ]
    assert pick_phoenix(pts) is pts[1]
    assert pick_phoenix(pts[:1]) is pts[0] and pick_phoenix([]) is None


def test_select_sweep_best_and_at_concurrency():
    pts = [
        {"threads": 1, "chunk": 1 << 20, "gbps": 3.0},
        {"threads": 4, "chunk": 1 << 20, "gbps": 6.5},
        {"threads": 4, "chunk": 16 << 20, "gbps": 4.0},
        {"threads": 16, "chunk": 1 << 20, "gbps": 6.5},  # equal to the best: the first stays
        {"threads": 16, "chunk": 16 << 20, "gbps": 5.0},
    ]
    best, at = select_sweep(pts, 16, 16 << 20)
    assert best is pts[1] and at is pts[4]
    best, at = select_sweep(pts, 8, 16 << 20)  # phoenix's point not in the grid
    assert best is pts[1] and at is None
    assert select_sweep([], 4, 1) == (None, None)


def test_sweep_grid_holds_phoenix_point_and_is_off_without_the_option():
    args = argparse.Namespace(
        ops=["read", "write", "randread"],
        temperature=["cold"],
        threads=[16],
        chunk=16 << 20,
        qd=48,
        random_bs=64 << 10,
        reps=1,
        raw_sweep=True,
        sweep_threads=[1, 4],
        sweep_chunks=[1 << 20],
    )
    grid = sweep_grid(args, "read")
    assert (16, 16 << 20) in grid and (1, 1 << 20) in grid and (4, 1 << 20) in grid and len(grid) == 3
    assert sweep_grid(args, "randread") == [(q, 64 << 10) for q in sorted(set(SWEEP_QD) | {48})]
    plan = sequential_plan(args)
    with_sweep = planned_steps(args, plan, False, "host")
    args.raw_sweep = False
    assert sweep_grid(args, "read") == [] and sweep_grid(args, "randread") == []
    # the sweep points (read 3, write 3, randread 6), and raw's best re-measured in each op's one repetition
    assert with_sweep - planned_steps(args, plan, False, "host") == 3 + 3 + 6 + 3
    args.raw_sweep, args.temperature = True, ["warm"]
    assert sweep_grid(args, "read") == []  # warm figures have the buffered reference, no sweep


# -- refusals -------------------------------------------------------------------------------


def test_check_refuses_with_what_is_needed(monkeypatch):
    monkeypatch.setattr(fastdev.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        fastdev.check(1 << 30, 64 << 20)
    monkeypatch.setattr(fastdev.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fastdev.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="needs losetup"):
        fastdev.check(1 << 30, 64 << 20)
    monkeypatch.setattr(fastdev.shutil, "which", lambda name: "/usr/sbin/" + name)
    monkeypatch.setattr(fastdev.os.path, "exists", lambda p: False)
    with pytest.raises(FileNotFoundError, match="needs loop devices"):
        fastdev.check(1 << 30, 64 << 20)
    monkeypatch.setattr(fastdev.os.path, "exists", lambda p: True)
    monkeypatch.setattr(fastdev, "_sh", lambda *a, **k: "/dev/loop7")
    with pytest.raises(ValueError, match="give --fast-device"):
        fastdev.check(64 << 20, 64 << 20)

    class Small:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(fastdev.os, "statvfs", lambda p: Small)
    with pytest.raises(OSError, match=r"free in /dev/shm"):
        fastdev.check(1 << 30, 64 << 20)


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    p = subprocess.run(_cmd(tmp_path, "--fast-device", "16M"), env=ENV, capture_output=True, text=True)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("phx bench: --fast-device"), p.stderr


# -- end to end on a real loop device --------------------------------------------------------


@needs_loop
def test_fast_device_run_is_labelled_and_leaves_nothing(tmp_path):
    before = _leftovers()
    out = tmp_path / "fd.json"
    cmd = _cmd(tmp_path, "--ops", "read,write", "--quiet", "--json", str(out), "--plot", str(tmp_path / "fd.png"))
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith(("read ", "write "))]
    assert rows and all(LABEL in ln for ln in rows), p.stdout
    # the raw sweep's 4 points, and raw at phoenix's pick where that is not one of them
    assert any("raw_best" in ln and re.search(r"(of|pick of) [45] swept|pick of [45]\b", ln) for ln in rows), rows
    recs = json.loads(out.read_text())
    assert all(r["storage"] == LABEL for r in recs)
    meta = recs[0]["meta"]["fast_device"]
    assert meta["label"] == LABEL and meta["fs"] in ("ext4", "raw") and meta["direct_io"] in (True, False)
    for op in ("read", "write"):
        best = [r for r in recs if r["impl"] == "raw_best" and r["op"] == op]
        sweep = [r for r in recs if r["impl"] == "raw_sweep" and r["op"] == op]
        # the grid's 4 points, and the raw reference's at phoenix's pick where the grid lacks it
        assert len(best) == 1 and len(sweep) in (4, 5)
        assert best[0]["sweep_gbps"] == max(r["gbps"] for r in sweep) and best[0]["config"]
        (raw,) = [r for r in recs if r["impl"] == "raw_odirect" and r["op"] == op]
        assert (raw["threads"], raw["chunk"]) in {(r["threads"], r["chunk"]) for r in sweep}
        ref = references(recs)[(op, "cold", 0)]  # never below a raw figure measured beside it
        assert ref["gbps"] == max(best[0]["gbps"], raw["gbps"])
        assert best[0]["reps"] == 1 and len(best[0]["runs_s"]) == 1  # re-measured in the repetitions
        psweep = [r for r in recs if r["impl"] == "phoenix_sweep" and r["op"] == op]
        (phx,) = [r for r in recs if r["impl"] == "phoenix" and r["op"] == op]
        assert len(psweep) == len(PHOENIX_GRID) + 1 and phx["best_of_sweep"]
        pick = pick_phoenix(psweep)
        assert (phx["workers"], phx["chunk"], phx["queue_depth"]) == (
            pick["threads"],
            pick["chunk"],
            pick["queue_depth"],
        )
        assert "4" in best[0]["at_concurrency"]  # phoenix's 4 threads x 4 MiB is in the grid
        assert any(r["impl"] == "phoenix" and r["op"] == op for r in recs)
    assert (tmp_path / "fd.png").stat().st_size > 0
    assert _leftovers() == before


@needs_loop
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_fast_device_torn_down_on_a_signal(tmp_path, sig):
    before = _leftovers()
    cmd = _cmd(tmp_path, "--ops", "read,write,randread", "--reps", "3")
    # SIGINT as a terminal gives it, even where this test runs in a shell's background job
    # (which starts its children with SIGINT ignored: Python then keeps it ignored)
    p = subprocess.Popen(
        cmd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in p.stderr:  # the device is up once this line is said
            if line.startswith("phx bench: on a"):
                break
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "interrupted" in err
    assert _leftovers() == before
