"""``phx bench kv-trace``: how a point ends (--min-samples, --max-duration), the p99's bootstrap
interval, --stop-over, the kvikio configuration (through tests/kvikio_double.py, a TEST
DOUBLE of KvikIO and CuPy), the multi-tier plot and --fast-device. On the host vendor (a test
double too); nothing here depends on how fast the machine is."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import kvikio_double
import numpy as np
import pytest

from phoenix.bench import fastdev, kvtrace
from phoenix.bench.kvtrace.cli import resolve_configs

PHX = [sys.executable, "-P", "-m", "phoenix.cli.phx"]


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    kvtrace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-trace", "--dry-run", "--slab", str(tmp_path / "kv.slab"), *extra])
    kvtrace.apply_dry_run(args)
    return args


def _quiet(*_a):
    pass


# ---- the p99's interval --------------------------------------------------------------------------


def test_bootstrap_interval_brackets_the_p99():
    from phoenix.bench.kvtrace.report import pct

    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 37, 200, 1000):
        x = rng.lognormal(0.0, 1.0, n).tolist()
        p99 = pct(sorted(x), 0.99)
        lo, hi = kvtrace.bootstrap_ci(x)
        assert lo <= p99 <= hi, (n, lo, p99, hi)
        assert min(x) <= lo and hi <= max(x)
    x = rng.lognormal(0.0, 1.0, 400).tolist()
    assert kvtrace.bootstrap_ci(x, seed=3) == kvtrace.bootstrap_ci(x, seed=3)  # seeded
    assert kvtrace.bootstrap_ci([0.5]) == [0.5, 0.5]
    assert kvtrace.bootstrap_ci([]) is None
    lo, hi = kvtrace.bootstrap_ci(x)
    assert lo < hi  # 400 spread samples: a real interval


def test_limits_use_the_interval_and_skip_what_was_not_run():
    def rec(cfg, conc, p99, lo, hi, skipped=None):
        r = {"config": cfg, "concurrency": conc, "threshold_s": 5.0}
        if skipped:
            return {**r, "skipped": skipped}
        return {**r, "ttft_p99_s": p99, "ttft_p99_ci_s": [lo, hi], "under_threshold": p99 < 5.0}

    recs = [
        rec("staged", 4, 2.0, 1.5, 3.0),
        rec("staged", 8, 4.0, 3.0, 6.0),  # p99 under, interval not wholly under
        rec("staged", 16, 20.0, 16.0, 25.0),
        rec("staged", 32, None, None, None, skipped="p99 already 20 s at concurrency 16"),
        rec("phoenix", 4, 1.0, 0.8, 1.2),
        rec("phoenix", 8, 2.0, 1.5, 2.5),
    ]
    lim = kvtrace.concurrency_limits(recs)
    assert lim["staged"] == {"p99": 8, "certain": 4, "top": False}
    assert lim["phoenix"] == {"p99": 8, "certain": 8, "top": True}  # the grid's top: may go further
    assert kvtrace.best_concurrency(recs) == {"staged": 8, "phoenix": 8}


# ---- how a point ends ------------------------------------------------------------------------------


def test_min_samples_holds_a_point_until_it_has_them(rt, tmp_path):
    args = _args(tmp_path, "--configs", "dram", "--concurrency", "2", "--duration", "0.01", "--min-samples", "60")
    (rec,) = kvtrace.run(args, log=_quiet)
    assert rec["samples"] == rec["rounds"] >= 60
    assert rec["stopped_by"] == "duration" and rec["samples_short"] is False and rec["min_samples"] == 60
    lo, hi = rec["ttft_p99_ci_s"]
    assert lo <= rec["ttft_p99_s"] <= hi
    # the keys records had before stay, with their meaning
    for key in ("rounds", "qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "under_threshold", "counts", "verified"):
        assert key in rec
    assert not any("fewer than --min-samples" in w for w in rec["warnings"])


def test_max_duration_caps_a_point_and_says_so(rt, tmp_path):
    args = _args(tmp_path, "--configs", "dram", "--concurrency", "1", "--duration", "0.2", "--min-samples", "100000")
    args.max_duration = 0.5
    (rec,) = kvtrace.run(args, log=_quiet)
    assert rec["samples_short"] is True and rec["stopped_by"] == "max_duration"
    assert 0 < rec["samples"] < 100000
    assert rec["seconds"] < 30  # the sessions left their think time at the cap, not at the sample count
    assert any("fewer than --min-samples 100000" in w and "--max-duration" in w for w in rec["warnings"])
    assert "fewer than --min-samples" in kvtrace.table([rec])


def test_a_point_whose_round_does_not_end_says_where_every_thread_is(rt, tmp_path, monkeypatch, capfd):
    """A session still in its round long after the point stopped: the stacks of every thread
    and phoenix's counters go to stderr (once), and the point still ends when it returns."""
    from phoenix.bench.kvtrace import replay

    monkeypatch.setattr(replay, "DRAIN_WARN_S", 0.3)
    real_round = replay.Replayer.round
    slow = {"left": 1}

    def round_(self, *a, **kw):
        if slow["left"]:
            slow["left"] = 0
            time.sleep(1.5)  # the first round outlives the point's 0.05 s by far more than DRAIN_WARN_S
        return real_round(self, *a, **kw)

    monkeypatch.setattr(replay.Replayer, "round", round_)
    args = _args(tmp_path, "--configs", "phoenix", "--concurrency", "1", "--duration", "0.05", "--min-samples", "0")
    (rec,) = kvtrace.run(args, log=_quiet)
    err = capfd.readouterr().err
    assert "sessions still in a round" in err and "kv-session-0" in err
    assert "Thread" in err and "round_" in err  # faulthandler's stacks, the slow round's frame among them
    assert "phoenix counters:" in err
    assert err.count("sessions still in a round") == 1
    assert rec["rounds"] >= 1 and rec["verified"]


# ---- --stop-over -------------------------------------------------------------------------------------


def test_stop_over_leaves_higher_concurrencies_unrun(rt, tmp_path):
    # a threshold no round meets: the first concurrency's p99 interval is over it, whatever the machine
    args = _args(
        tmp_path,
        "--configs",
        "dram,staged",
        "--concurrency",
        "2,1,4",
        "--threshold",
        "1e-9",
        "--stop-over",
        "1",
        "--duration",
        "0.3",
    )
    records = kvtrace.run(args, log=_quiet)
    got = [(r["config"], r["concurrency"], bool(r.get("skipped"))) for r in records]
    # concurrency-major; 1 is below the first stop (2) and runs (and stops lower), 4 is above both
    assert got == [
        ("dram", 2, False),
        ("staged", 2, False),
        ("dram", 1, False),
        ("staged", 1, False),
        ("dram", 4, True),
        ("staged", 4, True),
    ]
    skipped = records[-1]
    assert skipped["skipped"].startswith("p99 already ") and "at concurrency 1 " in skipped["skipped"]
    assert skipped["ttft_p99_s"] is None and skipped["verified"]
    json.dumps(records)  # --json writes them
    table = kvtrace.table(records)
    assert table.count("not run: p99 already") == 2
    assert kvtrace.best_concurrency(records) == {"dram": 0, "staged": 0}


# ---- the kvikio configuration, through the test double ---------------------------------------------


@pytest.mark.parametrize("direct", ["on", "off"])
def test_kvikio_configuration_round_trips_through_the_double(rt, tmp_path, monkeypatch, direct):
    double = kvikio_double.install(monkeypatch)
    args = _args(
        tmp_path, "--configs", "kvikio", "--concurrency", "4", "--kvikio-threads", "3", "--kvikio-task", "64K",
        "--kvikio-direct", direct,
    )  # fmt: skip
    args.duration = 2.0
    args.hbm, args.dram = args.hbm // 4, args.dram // 4  # small tiers: the SSD tier is loaded and written
    (rec,) = kvtrace.run(args, log=_quiet)
    c = rec["counts"]
    assert c["ssd_loads"] > 0 and c["written_to_ssd"] > 0
    assert rec["verified"] and c["bytes_verified"] == c["bytes_loaded_dram"] + c["bytes_loaded_ssd"]
    assert rec["kvikio"] == {
        "version": double.__version__,
        "compat_mode": "ON",
        "num_threads": 3,
        "task_size": 64 << 10,
        "direct_io": "opportunistic O_DIRECT reads and writes" if direct == "on" else "off: through the page cache",
        "test_double": True,
    }
    on = direct == "on"
    want = {"compat_mode": double.CompatMode.ON, "num_threads": 3, "task_size": 64 << 10}
    want.update(auto_direct_io_read=on, auto_direct_io_write=on)
    assert want in kvikio_double.SET_CALLS
    reads = [x for x in kvikio_double.CALLS if x[0] == "pread"]
    writes = [x for x in kvikio_double.CALLS if x[0] == "pwrite"]
    assert len(reads) == c["ssd_loads"] and all(dev for *_, dev in reads)  # into device memory (CuPy views)
    assert len(writes) == c["written_to_ssd"]  # evicted blocks, from DRAM (host) or HBM (device)


def test_a_kvikio_read_that_does_not_land_is_caught(rt, tmp_path, monkeypatch):
    kvikio_double.install(monkeypatch)

    def lost(self, op, device, ptr, n, off):  # says it read, copies nothing
        return n

    monkeypatch.setattr(kvikio_double.CuFile, "_piece", lost)
    args = _args(tmp_path, "--configs", "kvikio", "--concurrency", "4")
    args.duration = 2.0
    args.hbm, args.dram = args.hbm // 4, args.dram // 4
    (rec,) = kvtrace.run(args, log=_quiet)
    assert rec["counts"]["ssd_loads"] > 0 and not rec["verified"]
    assert any("loaded from ssd does not hold its pattern" in f for f in rec["failures"])


def test_default_configs_take_kvikio_where_it_can_run(tmp_path, monkeypatch):
    args = argparse.Namespace(configs=None)
    try:
        import kvikio  # noqa: F401

        real = True
    except ImportError:
        real = False
    if not real:
        configs, note = resolve_configs(args, "host")
        assert configs == ["dram", "staged", "phoenix"] and "kvikio left out" in note and "importable" in note
        with pytest.raises(ImportError, match="--configs kvikio: kvikio is not importable"):
            resolve_configs(argparse.Namespace(configs=["kvikio"]), "host")
    kvikio_double.install(monkeypatch)
    assert resolve_configs(args, "host") == (["dram", "staged", "kvikio", "phoenix"], "")
    monkeypatch.setattr(sys.modules["kvikio"], "IS_TEST_DOUBLE", False)  # the real one: CUDA memory only
    configs, note = resolve_configs(args, "host")
    assert "kvikio" not in configs and "nvidia vendor" in note
    with pytest.raises(ValueError, match="needs the nvidia vendor"):
        resolve_configs(argparse.Namespace(configs=["staged", "kvikio"]), "host")


# ---- the multi-tier plot -----------------------------------------------------------------------------


def _tier_records(label, scale):
    recs = []
    for cfg in ("dram", "staged", "kvikio", "phoenix"):
        for conc in (2, 4, 8, 16):
            p99 = scale * conc / (1 + ("dram", "staged", "kvikio", "phoenix").index(cfg))
            r = {"config": cfg, "concurrency": conc, "threshold_s": 5.0, "label": label, "vendor": "host"}
            if p99 > 20:
                recs.append({**r, "skipped": "p99 already large"})
                continue
            r.update(
                ttft_p99_s=p99,
                ttft_p99_ci_s=[p99 * 0.8, p99 * 1.3],
                qps=conc / (1 + p99),
                under_threshold=p99 < 5.0,
                meta={"bytes_per_token": 131072, "time_scale": 0.1, "token_scale": 0.25},
            )
            recs.append(r)
    return recs


def test_plot_subcommand_draws_one_column_per_tier(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    files = []
    for name, scale in (("virtio disk", 1.0), ("loop device over RAM", 0.3), ("tmpfs", 0.2)):
        path = tmp_path / f"{name.split()[0]}.json"
        path.write_text(json.dumps(_tier_records(name, scale)))
        files.append(str(path))
    out = tmp_path / "tiers.png"
    # in-process through the subcommand's parser (phx's main would leave its prog behind for later tests)
    parser = argparse.ArgumentParser()
    kvtrace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-trace", "plot", *files, "--out", str(out)])
    assert args.func is kvtrace.main_plot and args.func(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = capsys.readouterr().out
    assert f"plot written to {out}" in said and "virtio.json: most concurrent sessions" in said


def test_plot_subcommand_refuses_what_is_not_a_run(tmp_path):
    env = dict(os.environ, PHX_VENDOR="host")
    missing = tmp_path / "none.json"
    p = subprocess.run(
        PHX + ["bench", "kv-trace", "plot", str(missing), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("phx bench kv-trace plot: ") and str(missing) in lines[0] and "no such file" in lines[0]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"impl": "phoenix"}))
    p = subprocess.run(
        PHX + ["bench", "kv-trace", "plot", str(other), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 2 and "not the records of a 'phx bench kv-trace' run" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("concurrency", "4", "concurrency is '4', not a whole number"),
        ("concurrency", True, "concurrency is True"),
        ("under_threshold", None, "under_threshold is None, not true or false"),
        ("ttft_p99_ci_s", [0.1], "ttft_p99_ci_s is [0.1], not [low, high]"),
        ("ttft_p99_s", "fast", "ttft_p99_s is 'fast'"),
        ("qps", None, "qps is None, not a number"),
        ("threshold_s", "5", "threshold_s is '5'"),
        ("label", 7, "label is 7, not text"),
        ("config", ["dram"], "config is ['dram'], not a name"),
    ],
)
def test_plot_refuses_records_of_the_wrong_shape(tmp_path, key, value, words):
    """A JSON list of objects with a kv-trace record's keys but not its types is refused naming the
    file, the record and the key (the plot and the limits would fail on it half-way, a traceback)."""
    recs = _tier_records("disk", 1.0)
    i = next(n for n, r in enumerate(recs) if not r.get("skipped") and n > 0)
    recs[i][key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(recs))
    with pytest.raises(ValueError) as exc:
        kvtrace.cli.read_records(str(path))
    msg = str(exc.value)
    assert msg.startswith(f"{path}: record {i}: ") and words in msg, msg
    assert "not the records of a 'phx bench kv-trace' run" in msg


def test_plot_subcommand_refuses_a_record_of_the_wrong_type_in_one_line(tmp_path):
    recs = _tier_records("disk", 1.0)
    recs[1]["concurrency"] = "4"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(recs))
    p = subprocess.run(
        PHX + ["bench", "kv-trace", "plot", str(path), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PHX_VENDOR="host"),
        cwd=tmp_path,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"phx bench kv-trace plot: {path}: record 1: concurrency is '4'"), lines[0]
    assert not (tmp_path / "x.png").exists()


def test_plot_subcommand_without_matplotlib_says_what_to_install(tmp_path):
    fake = tmp_path / "nompl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib (test)')\n")
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_tier_records("disk", 1.0)))
    env = dict(os.environ, PHX_VENDOR="host", PYTHONPATH=str(fake.parent))
    p = subprocess.run(
        PHX + ["bench", "kv-trace", "plot", str(path), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "pip install matplotlib" in lines[0], p.stderr
    assert not (tmp_path / "x.png").exists()


# ---- --fast-device, for real (root, loop devices, mkfs.ext4) -------------------------------------


def _fast_device_or_skip():
    if os.geteuid() != 0:
        pytest.skip("--fast-device needs root")
    for tool in ("losetup", "mkfs.ext4", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"--fast-device needs {tool} on PATH")
    if not (os.path.exists("/dev/loop-control") or os.path.exists("/dev/loop0")):
        pytest.skip("no loop devices here (/dev/loop-control)")
    if subprocess.run(["losetup", "--find"], capture_output=True).returncode != 0:
        pytest.skip("no free loop device")


FAST_CMD = ["bench", "kv-trace", "--dry-run", "--configs", "dram,phoenix", "--concurrency", "2", "--duration", "0.5"]


def fast_kvtrace(tmp_path, *extra) -> list[dict]:
    """The dry-run replay (dram and phoenix, 2 sessions) with ``extra`` fast-device options,
    on the host vendor, as a command; its records (it must succeed)."""
    out = tmp_path / "kv.json"
    p = subprocess.run(
        PHX + FAST_CMD + [*extra, "--slab", str(tmp_path / "kv.slab"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PHX_VENDOR="host"),
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_fast_device_holds_the_slab_and_goes_away(tmp_path):
    _fast_device_or_skip()
    records = fast_kvtrace(tmp_path, "--fast-device", "auto")
    assert {r["config"] for r in records} == {"dram", "phoenix"}
    for r in records:
        assert r["storage"] == fastdev.LABEL and r["label"] == fastdev.LABEL and r["verified"]
        assert r["fast_device"]["fs"] == "ext4"
    slab = records[0]["meta"]["slab"]
    assert slab.endswith("/kv.slab") and os.path.basename(os.path.dirname(slab)).startswith("phx-fastdev-mnt-")
    assert not os.path.exists(os.path.dirname(slab))  # unmounted and removed
    # too small for the slab: one line that names it
    p = subprocess.run(
        PHX + FAST_CMD + ["--fast-device", "4M", "--slab", str(tmp_path / "kv.slab")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PHX_VENDOR="host"),
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "cannot hold the SSD tier's slab" in lines[0], p.stderr
