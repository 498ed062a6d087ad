"""``phx bench loader`` (issue 21 item 5): its options and their refusals (one line, exit 2),
the raw sweep and the choice of its best point, phxloader's own sweep (its pick in force for
the measured loads), the peers (safetensors, fastsafetensors) called through their APIs or
skipped with the reason recorded, and a whole run on a loop device over RAM with the host
vendor (a test double, labelled as one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from test_bench_loop import LABEL, _leftovers, needs_loop

from phoenix import phxloader
from phoenix.bench import loader, loader_peers
from phoenix.cli import phx

PHX = [sys.executable, "-P", "-m", "phoenix.cli.phx", "bench", "loader"]
ENV = dict(os.environ, PHX_VENDOR="host")
ENV.pop("PHX_DEBUG", None)


def _run(*args, timeout=120):
    return subprocess.run([*PHX, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def _one_line(p, *words):
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    assert lines[0].startswith("phx bench loader: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


def _small_file(path, n=4):
    rng = np.random.default_rng(3)
    phxloader.save_file({f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(n)}, path)
    return os.fspath(path)


# -- options --------------------------------------------------------------------------------


def test_options_parse():
    parser = phx.build_parser()
    a = parser.parse_args(["bench", "loader", "--fast-device", "9G", "--make", "8G", "--device", "phx"])
    assert a.func is loader.main and a.file is None and a.fast_device == 9 << 30 and a.make == 8 << 30
    assert a.raw_sweep is None and a.sweep_threads == [4, 8, 16, 32] and a.sweep_chunks == [1 << 20, 4 << 20, 16 << 20]
    assert a.phoenix_sweep is None
    a = parser.parse_args(
        ["bench", "loader", "m.safetensors", "--no-raw-sweep", "--sweep-threads", "2,6", "--no-phoenix-sweep"]
    )
    assert a.file == "m.safetensors" and a.raw_sweep is False and a.sweep_threads == [2, 6] and a.fast_device is None
    assert a.phoenix_sweep is False


def test_refusals_are_one_line(tmp_path):
    _one_line(_run("--device", "phx"), "give a .safetensors FILE", "--fast-device")
    _one_line(
        _run("--fast-device", "1G", "--device", "phx"), "--fast-device", "starts empty", "--make", "model.safetensors"
    )
    _one_line(_run(str(tmp_path / "nope.safetensors"), "--fast-device", "1G"), "nope.safetensors", "no such file")
    _one_line(_run("--fast-device", "200M", "--make", "1G"), "--fast-device 200 MiB cannot hold", "give --fast-device")
    _one_line(_run("--fast-device", "0"), "--fast-device")
    _one_line(_run("m.safetensors", "--sweep-chunks", "1M,x"), "--sweep-chunks")


# -- the raw sweep and its best --------------------------------------------------------------


def test_sweep_points_hold_phoenix_own_point_once():
    pts = loader.sweep_points([8, 16], [1 << 20, 4 << 20], (16, 8 << 20))
    assert pts == [(8, 1 << 20), (8, 4 << 20), (16, 1 << 20), (16, 4 << 20), (16, 8 << 20)]
    assert loader.sweep_points([16], [8 << 20], (16, 8 << 20)) == [(16, 8 << 20)]


def test_pick_best_first_of_equals_and_phoenix_point():
    def p(t, c, g):
        return {"threads": t, "chunk": c << 20, "config": loader.config_text(t, c << 20), "gbps": g}

    pts = [p(8, 1, 3.0), p(8, 4, 6.5), p(16, 4, 6.5), p(16, 8, 5.0)]
    best = loader.pick_best(pts, (16, 8 << 20))
    assert (best["threads"], best["chunk"], best["sweep_gbps"], best["best_of"]) == (8, 4 << 20, 6.5, 4)
    assert best["config"] == "8 threads x 4 MiB" and best["at_phoenix"] == {"config": "16 threads x 8 MiB", "gbps": 5.0}
    assert loader.pick_best(pts, (32, 1 << 20))["at_phoenix"] is None
    assert loader.pick_best([], (1, 1)) is None


def test_bench_file_bound_and_small_width(tmp_path):
    p = tmp_path / "m.safetensors"
    loader.make_bench_file(p, 24 << 20)
    h = phxloader.read_header(p)
    assert 24 << 20 <= h.file_size <= loader.bench_file_bytes(24 << 20)
    assert loader.bench_file_bytes(8 << 30) - (8 << 30) < 400 << 20  # 8G: width 4096, one layer over at most


# -- the peers --------------------------------------------------------------------------------


def _fake_fastsafetensors(calls):
    """A stand-in module with fastsafetensors' API shape, reading with NumPy."""

    class SingleGroup:
        pass

    class Buffer:
        def __init__(self, path):
            self.sd = phxloader.load_file(path, "cpu", framework="numpy")

        def get_tensor(self, k):
            return self.sd[k]

        def close(self):
            calls.append("fb.close")

    class SafeTensorsFileLoader:
        def __init__(self, pg, device, nogds=False, set_numa=True):
            calls.append(("init", type(pg).__name__, device, nogds, set_numa))

        def add_filenames(self, files):
            self.path = files[0][0]

        def copy_files_to_device(self):
            self.fb = Buffer(self.path)
            return self.fb

        def get_keys(self):
            return list(self.fb.sd)

        def close(self):
            calls.append("loader.close")

    return types.SimpleNamespace(SafeTensorsFileLoader=SafeTensorsFileLoader, SingleGroup=SingleGroup, __version__="x")


def test_fastsafetensors_through_its_api_or_skipped_with_why(tmp_path, monkeypatch):
    f = _small_file(tmp_path / "s.safetensors")
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)
    fn, why, _ = loader_peers.fastsafetensors_impl(f, "cuda", object(), lambda: None)
    assert fn is None and why.startswith("not importable (")
    calls: list = []
    monkeypatch.setitem(sys.modules, "fastsafetensors", _fake_fastsafetensors(calls))
    assert loader_peers.fastsafetensors_impl(f, "cuda", None, lambda: None)[1].startswith("needs torch")
    assert "not phx device memory" in loader_peers.fastsafetensors_impl(f, "phx:0", object(), lambda: None)[1]
    fn, why, info = loader_peers.fastsafetensors_impl(f, "cpu", object(), lambda: None)
    assert why is None and info["version"] == "x" and "nogds=True" in info["api"]
    assert fn() == 4 * 256 * 1024 * 4
    assert calls == [("init", "SingleGroup", "cpu", True, False), "fb.close", "loader.close"]


def test_bench_interleaves_peers_ratios_against_the_best(tmp_path, monkeypatch):
    """A peer that loads (a stand-in) and one that fails in the middle: the table, the ratios
    (x raw against the re-measured best), the failure recorded as a skip."""
    f = _small_file(tmp_path / "s.safetensors", 8)
    n_loads = []

    def fake_st(path, device, torch, sync):
        def run():
            n_loads.append(1)
            return sum(a.nbytes for a in phxloader.load_file(path, "cpu", framework="numpy").values())

        return run, None, {"api": "stand-in"}

    def failing(path, device, torch, sync):
        def run():
            raise RuntimeError("no CUDA in this test")

        return run, None, {"api": "stand-in"}

    monkeypatch.setattr(loader, "safetensors_impl", fake_st)
    monkeypatch.setattr(loader, "fastsafetensors_impl", failing)
    # phxloader's sweep: the settings in force at each load, in order
    under = []
    real_load = loader.load_file

    def load_file(*a, **k):
        s = loader.settings()
        under.append((s.threads, s.inflight))
        return real_load(*a, **k)

    monkeypatch.setattr(loader, "load_file", load_file)
    grid = [(1, 1 << 20), (2, 4 << 20)]
    res = loader.bench(
        *(f, "phx", 2),
        **dict(sweep=True, sweep_threads=[1, 2], sweep_chunks=[1 << 20], phoenix_sweep=True, phoenix_grid=grid),
        fast_device={"label": "x"},
        quiet=True,
    )
    assert len(res["raw_sweep"]) == 3 and res["raw_best"]["best_of"] == 3
    assert res["env"] == {k: v for k, v in os.environ.items() if k.startswith("PHX_")}  # settings beside argv
    s = loader.settings()
    own = (s.threads, s.inflight)
    swept = [(p["threads"], p["inflight"]) for p in res["phoenix_sweep"]]
    # an untimed load at the settings' own, one per point, then the pick's: cold and warm, 2 repetitions
    assert swept == sorted({*grid, own}) and under[: len(swept) + 1] == [own, *swept]
    pick = res["phoenix_pick"]
    assert pick["best_of"] == len(swept) and (pick["at_settings"]["threads"], pick["at_settings"]["inflight"]) == own
    assert under[len(swept) + 1 :] == [(pick["threads"], pick["inflight"])] * 4
    assert (loader.settings().threads, loader.settings().inflight) == own  # the pick's override ended
    raw = res["raw_odirect_cold"]
    assert (raw["threads"], raw["chunk"]) == (res["raw_best"]["threads"], res["raw_best"]["chunk"]) and raw["best"]
    assert res["impls"] == [
        "raw_odirect_cold",
        "phxloader_cold",
        "phxloader_warm",
        "safetensors_cold",
        "safetensors_warm",
    ]
    assert len(n_loads) == 4 and len(res["safetensors_cold"]["seconds"]) == 2
    assert res["skipped"] == {"fastsafetensors": "failed: RuntimeError: no CUDA in this test"}
    assert res["phxloader_cold"]["x_raw"] == pytest.approx(res["phxloader_cold"]["gbps"] / raw["gbps"])
    st = res["ratios"]["phxloader_cold / safetensors_cold"]
    assert st == pytest.approx(res["phxloader_cold"]["gbps"] / res["safetensors_cold"]["gbps"])
    t = res["target"]
    assert t["phxloader_cold / safetensors_cold"] == st
    assert t["met"] == (t["phxloader_cold / raw_best"] >= loader.TARGET_RAW and st > 1)


# -- end to end on a real loop device ---------------------------------------------------------


@needs_loop
def test_fast_device_run_labelled_swept_and_torn_down(tmp_path):
    before = _leftovers()
    out = tmp_path / "l.json"
    p = _run(
        *("--fast-device", "256M", "--make", "64M", "--device", "phx", "--reps", "1"),
        *("--sweep-threads", "2,4", "--sweep-chunks", "1M,4M", "--json", str(out)),
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["storage"] == LABEL and res["fast_device"]["label"] == LABEL and res["fast_device"]["fs"] == "ext4"
    assert os.path.basename(res["file"]) == "model.safetensors" and res["size"] >= 64 << 20
    assert res["vendor"] == "host" and res["test_double"] is True
    assert len(res["raw_sweep"]) >= 4 and res["raw_best"]["best_of"] == len(res["raw_sweep"])
    assert res["raw_best"]["at_phoenix"] is not None  # phoenix's own threads x chunk size is always swept
    assert res["raw_odirect_cold"]["config"] == res["raw_best"]["config"]
    for name in ("raw_odirect_cold", "phxloader_cold", "phxloader_warm"):
        assert res[name]["storage"] == LABEL and res[name]["gbps"] > 0 and res[name]["x_raw"] > 0
    assert res["phoenix_pick"]["best_of"] == len(res["phoenix_sweep"]) >= len(loader.PHX_GRID)
    assert "fastsafetensors" in res["skipped"] and "safetensors" in res["skipped"]
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        assert res["skipped"]["fastsafetensors"].startswith("not importable (")
    assert res["target"]["met"] is None  # no safetensors here: not judged
    for words in (
        "x raw",
        "fastsafetensors: ",
        "issue 21 target",
        "phxloader sweep",
        f"storage: {LABEL}",
        "test double",
    ):
        assert words in p.stdout, (words, p.stdout)
    assert _leftovers() == before


@needs_loop
def test_fast_device_copies_an_existing_file(tmp_path):
    f = _small_file(tmp_path / "mine.safetensors")
    out = tmp_path / "l.json"
    p = _run(
        *(f, "--fast-device", "128M", "--device", "phx", "--reps", "1"),
        *("--no-raw-sweep", "--no-phoenix-sweep", "--json", str(out)),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert (
        os.path.basename(res["file"]) == "mine.safetensors" and res["file"] != f and res["size"] == os.path.getsize(f)
    )
    assert "raw_sweep" not in res and res["raw_odirect_cold"]["best"] is False and res["storage"] == LABEL
    assert "phoenix_sweep" not in res
