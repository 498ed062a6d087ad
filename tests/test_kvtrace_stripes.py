"""``phx bench kv-trace`` with the SSD tier striped (``--slab A,B,...``, ``--fast-devices N``):
blocks go to the files in turn (a reference model, checked by hypothesis), every history block
is written where it is then read from, a replay over two files verifies every loaded byte, and
N loop devices are set up, labelled and torn down. On the host vendor (a test double)."""

import argparse
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_kvtrace_points import _fast_device_or_skip, fast_kvtrace

from phoenix.bench import fastdev, kvtrace
from phoenix.bench.kvtrace.tiers import Slab

PHX = [sys.executable, "-P", "-m", "phoenix.cli.phx"]


def _args(tmp_path, slab, *extra):
    parser = argparse.ArgumentParser()
    kvtrace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-trace", "--dry-run", "--slab", slab, *extra])
    kvtrace.apply_dry_run(args)
    args.duration = 2.0
    return args


@given(lanes=st.integers(1, 6), hist=st.integers(0, 40), dyn=st.integers(0, 40))
def test_slots_go_to_the_files_in_turn(lanes, hist, dyn):
    bb = 4096
    paths = [f"/x/lane{i}.slab" for i in range(lanes)]
    s = Slab(",".join(paths), bb, hist, dyn)
    assert s.lanes == lanes and s.paths == paths and s.hist_paths == [p + ".history" for p in paths]
    h_lane, d_lane = s.lane_slots()
    assert s.nbytes() == (h_lane + d_lane) * bb
    seen = set()
    for slot in range(hist + dyn):
        path, off = s.where(slot)
        # the model: history slot i on lane i mod N at (i div N) blocks; demoted ones the same from 0
        i, files, per = (slot, s.hist_paths, h_lane) if slot < hist else (slot - hist, s.paths, d_lane)
        assert (path, off) == (files[i % lanes], i // lanes * bb)
        assert off % bb == 0 and off // bb < per  # inside the lane's file as sized
        seen.add((path, off))
    assert len(seen) == hist + dyn  # no two slots share a block


def test_one_file_is_the_slab_as_before():
    s = Slab("/x/kv.slab", 8192, 3, 2)
    assert (s.path, s.hist_path, s.lanes) == ("/x/kv.slab", "/x/kv.slab.history", 1)
    assert (
        s.nbytes() == 5 * 8192 and s.where(2) == ("/x/kv.slab.history", 2 * 8192) and s.where(4) == ("/x/kv.slab", 8192)
    )


@pytest.mark.parametrize("bad", ["", "a,", "a,a", ","])
def test_a_slab_list_with_empty_or_repeated_files_is_refused(bad):
    with pytest.raises(ValueError, match="comma-separated, distinct"):
        Slab(bad, 4096, 1, 1)


def test_history_blocks_are_written_on_their_lanes(rt, tmp_path):
    bb, lanes, n = 64 << 10, 3, 11
    s = Slab([str(tmp_path / f"l{i}.slab") for i in range(lanes)], bb, n, 4)
    rng = np.random.default_rng(5)
    history = {("k", i): i for i in range(n)}
    keys = {k: int(rng.integers(1, 2**62)) for k in history}
    s.create(history, keys)
    base = np.arange(bb // 8, dtype=np.uint64)
    for k, slot in history.items():
        path, off = s.where(slot)
        with open(path, "rb") as fh:
            fh.seek(off)
            got = np.frombuffer(fh.read(bb), np.uint64)
        assert np.array_equal(got, base ^ np.uint64(keys[k])), (slot, path, off)
    for i, p in enumerate(s.hist_paths):  # each lane holds its share and nothing past it
        assert os.path.getsize(p) == len(range(i, n, lanes)) * bb
    for p in s.paths:
        assert os.path.getsize(p) == s.lane_slots()[1] * bb
    s.remove()
    assert not any(os.path.exists(p) for p in s.all_paths())


def test_a_replay_striped_over_two_files_verifies_every_load(rt, tmp_path):
    slab = f"{tmp_path / 'a.slab'},{tmp_path / 'b.slab'}"
    args = _args(tmp_path, slab, "--configs", "staged,phoenix", "--concurrency", "4")
    args.hbm, args.dram = args.hbm // 4, args.dram // 4  # the first rounds load from the slab
    records = kvtrace.run(args, log=lambda *a: None)
    assert [r["config"] for r in records] == ["staged", "phoenix"]
    for rec in records:
        c = rec["counts"]
        assert c["ssd_loads"] > 0 and c["bytes_loaded_ssd"] == c["ssd_loads"] * rec["meta"]["block_bytes"]
        assert c["bytes_verified"] == c["bytes_loaded_dram"] + c["bytes_loaded_ssd"]
        assert c["verify_failures"] == 0 and rec["verified"]
        assert rec["meta"]["slab"] == slab
    for p in slab.split(","):
        assert not os.path.exists(p) and not os.path.exists(p + ".history")


def test_fast_devices_stripe_the_slab_and_go_away(tmp_path):
    _fast_device_or_skip()
    records = fast_kvtrace(tmp_path, "--fast-device", "auto", "--fast-devices", "2")
    label = fastdev.label(2)
    assert "2 loop devices over RAM, striped" in label
    for r in records:
        assert r["storage"] == label and r["label"] == label and r["verified"]
        assert r["fast_device"]["devices"] == 2 and len(set(r["fast_device"]["loops"])) == 2
    slabs = records[0]["meta"]["slab"].split(",")
    dirs = {os.path.dirname(s) for s in slabs}
    assert len(slabs) == 2 and len(dirs) == 2 and all(s.endswith("/kv.slab") for s in slabs)
    assert all(os.path.basename(d).startswith("phx-fastdev-mnt-") and not os.path.exists(d) for d in dirs)
    for ln in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines():
        assert not any(loop + ":" in ln for loop in records[0]["fast_device"]["loops"]), ln


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--fast-devices", "2"], "give --fast-device"),
        (["--fast-devices", "2", "--fast-device", "auto", "--slab", "/tmp/a,/tmp/b"], "one file name"),
        (["--fast-device", "auto", "--slab", "/tmp/a,/tmp/b"], "one file name"),
        (["--fast-devices", "0"], "--fast-devices"),
    ],
)
def test_fast_devices_refusals_are_one_line(extra, words):
    p = subprocess.run(
        PHX + ["bench", "kv-trace", "--dry-run", *extra],
        capture_output=True,
        text=True,
        env=dict(os.environ, PHX_VENDOR="host"),
        timeout=120,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_check_space_adds_up_the_lanes_on_one_file_system(tmp_path, monkeypatch):
    bb = 256 << 20
    s = Slab([str(tmp_path / "a.slab"), str(tmp_path / "b.slab")], bb, 4, 2)  # 3 blocks a lane: 1.5 GiB in all
    real = os.statvfs

    def statvfs(free):
        def f(path):
            st = real(path)
            return os.statvfs_result((*st[:4], free // st.f_frsize, *st[5:]))

        return f

    monkeypatch.setattr(os, "statvfs", statvfs(2 << 30))
    s.check_space()
    monkeypatch.setattr(os, "statvfs", statvfs(1 << 30))  # room for one lane, not two
    with pytest.raises(OSError, match=r"striped over 2 files: the SSD tier needs 1\.50 GiB in .* has 1\.00 GiB free"):
        s.check_space()


class _CountsAllocs:
    """The host runtime, counting its allocations."""

    def __init__(self, rt):
        self._rt, self.allocs = rt, 0

    def __getattr__(self, name):
        attr = getattr(self._rt, name)
        if "alloc" in name and callable(attr):

            def counted(*a, **k):
                self.allocs += 1
                return attr(*a, **k)

            return counted
        return attr


def test_a_bad_slab_list_is_refused_before_memory_is_taken(rt, tmp_path):
    a = str(tmp_path / "a.slab")
    args = _args(tmp_path, f"{a},{a}", "--configs", "phoenix", "--concurrency", "2")
    counting = _CountsAllocs(rt)
    with pytest.raises(ValueError, match="comma-separated, distinct"):
        kvtrace.Replayer(args, kvtrace.generate(args.sessions, args.seed), rt=counting, log=lambda *a: None)
    assert counting.allocs == 0
    good = _args(tmp_path, a, "--configs", "phoenix", "--concurrency", "2")
    rp = kvtrace.Replayer(good, kvtrace.generate(good.sessions, good.seed), rt=counting, log=lambda *a: None)
    rp.close()
    assert counting.allocs > 0  # the counter sees the allocations a replayer makes


def test_panel_titles_wrap_the_long_striped_label():
    from phoenix.bench.kvtrace.report import column_title

    t = column_title("x", [{"label": fastdev.label(4)}])
    lines = t.splitlines()
    assert len(lines) >= 2 and all(len(ln) <= 48 for ln in lines) and " ".join(t.split()) == fastdev.label(4)
    assert column_title("tier", []) == "tier" and column_title("x", [{"storage": "s"}]) == "s"
