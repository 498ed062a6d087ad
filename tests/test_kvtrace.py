"""``phx bench kv-trace``: the trace (statistics, determinism, file round trip) and a small
replay on the host vendor (a test double) whose accounting must hold: every loaded byte
verified, hit + load + recompute counts adding up, corrupt slabs and lost loads caught."""

import argparse
import json
import os

import pytest

from phoenix.bench import kvtrace


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    kvtrace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-trace", "--dry-run", "--slab", str(tmp_path / "kv.slab"), *extra])
    kvtrace.apply_dry_run(args)
    args.duration = 2.0  # long enough that the tiers evict and load even on a busy CI machine
    return args


# ---- trace ----------------------------------------------------------------------------------------


def test_generator_is_seeded_and_deterministic():
    a, b, c = kvtrace.generate(16, seed=3), kvtrace.generate(16, seed=3), kvtrace.generate(16, seed=4)
    assert a.sessions == b.sessions
    assert a.sessions != c.sessions


def test_generator_statistics_match_the_published_ones():
    st = kvtrace.trace_stats(kvtrace.generate(200, seed=0))
    assert 60_000 <= st["context_at_round_30_median"] <= 110_000  # ~80K at round 30
    assert st["sessions_beyond_180k"] >= 1  # some beyond 180K
    assert 200 <= st["added_tokens_p10"] and st["added_tokens_p90"] <= 8_000  # hundreds to a few thousand a round
    assert 1.0 <= st["think_s_median"] <= 6.0  # a few seconds between rounds
    assert 100 <= st["input_output_ratio"] <= 170  # ~131:1
    assert 0.92 <= st["prefix_hit_rate"] <= 0.965  # ~94 %


def test_every_round_is_consistent():
    for s in kvtrace.generate(32, seed=1).sessions:
        carried = 0
        for rd in s.rounds:
            assert 0 <= rd.prefix_tokens <= carried and rd.prefix_tokens <= rd.input_tokens
            assert rd.new_tokens > 0 and rd.output_tokens > 0
            carried = rd.input_tokens + rd.output_tokens


def test_reader_round_trips_the_writer(tmp_path):
    trace = kvtrace.generate(8, seed=2)
    path = tmp_path / "t.jsonl"
    kvtrace.write_trace(trace, str(path))
    back = kvtrace.read_trace(str(path))
    assert back.sessions == trace.sessions
    assert back.params["seed"] == 2
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == kvtrace.FORMAT and header["version"] == kvtrace.VERSION


def test_reader_takes_a_json_document_and_defaults_the_prefix(tmp_path):
    path = tmp_path / "t.json"
    rounds = [
        {"session": "a", "round": 0, "input_tokens": 1000, "output_tokens": 10},
        {"session": "a", "round": 1, "input_tokens": 1500, "output_tokens": 5, "think_s": 2.5},
    ]
    path.write_text(json.dumps({"format": kvtrace.FORMAT, "rounds": rounds}))
    t = kvtrace.read_trace(str(path))
    assert [(r.prefix_tokens, r.new_tokens) for r in t.sessions[0].rounds] == [(0, 1000), (1010, 490)]


def test_reader_rejects_a_prefix_longer_than_the_context(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"session": 1, "round": 0, "input_tokens": 100, "prefix_tokens": 0, "output_tokens": 1}\n'
        '{"session": 1, "round": 1, "input_tokens": 300, "prefix_tokens": 200, "output_tokens": 1}\n'
    )
    with pytest.raises(ValueError, match="prefix_tokens=200"):
        kvtrace.read_trace(str(path))


# ---- replay on the host vendor -------------------------------------------------------------------


def _check_accounting(rec):
    c = rec["counts"]
    assert c["hbm_hits"] + c["dram_loads"] + c["ssd_loads"] + c["recomputes"] == c["blocks_needed"]
    assert c["bytes_verified"] == c["bytes_loaded_dram"] + c["bytes_loaded_ssd"]
    assert c["bytes_loaded_dram"] == c["dram_loads"] * rec["meta"]["block_bytes"]
    assert c["bytes_loaded_ssd"] == c["ssd_loads"] * rec["meta"]["block_bytes"]
    assert c["verify_failures"] == 0 and rec["verified"]
    assert rec["rounds"] == c["rounds"] > 0
    # the TTFT's phases add up to the TTFTs
    phases = [c[k] for k in ("wait_s", "demote_s", "load_s", "compute_s")]
    assert min(phases) >= 0 and sum(phases) == pytest.approx(rec["ttft_mean_s"] * rec["rounds"], rel=1e-6)
    moved = c["bytes_loaded_dram"] + c["bytes_loaded_ssd"] + c["bytes_written_ssd"]
    assert rec["cpu_s"] > 0 and (rec["cpu_s_per_gb"] is None) == (moved == 0)


def test_small_replay_accounting(rt, tmp_path):
    args = _args(tmp_path)
    # tiers a quarter of the dry run's: the first rounds already overflow them, so the
    # assertions below hold however few rounds a loaded machine completes in the window
    args.hbm, args.dram = args.hbm // 4, args.dram // 4
    records = kvtrace.run(args, log=lambda *a: None)
    configs = records[0]["meta"]["configs"]  # by default all four; kvikio only where it can run (not here)
    assert configs == ["dram", "staged", "phoenix"] and "kvikio left out" in records[0]["meta"]["configs_note"]
    assert all(k.startswith("PHX_") for k in records[0]["meta"]["env"])  # the settings beside argv
    assert [(r["config"], r["concurrency"]) for r in records] == [(c, n) for n in (1, 4) for c in configs]
    for rec in records:
        _check_accounting(rec)
        assert rec["vendor"] == "host" and rec["test_double"] is True
        assert rec["meta"]["compute"] == "numpy-cpu"
        assert rec["ttft_p50_s"] <= rec["ttft_p99_s"] and rec["qps"] > 0
    busy = {r["config"]: r["counts"] for r in records if r["concurrency"] == 4}
    # capacities are small enough that the tiers matter: DRAM-only recomputes, the others load from SSD
    assert busy["dram"]["recomputes"] > 0 and busy["dram"]["ssd_loads"] == 0
    for cfg in ("staged", "phoenix"):
        assert busy[cfg]["ssd_loads"] > 0 and busy[cfg]["bytes_verified"] > 0
    assert not os.path.exists(args.slab) and not os.path.exists(args.slab + ".history")
    table = kvtrace.table(records)
    assert "most concurrent sessions" in table


def test_a_corrupt_slab_byte_is_caught(rt, tmp_path):
    args = _args(tmp_path, "--configs", "phoenix", "--concurrency", "4")
    args.hbm, args.dram = args.hbm // 4, args.dram // 4  # the first rounds load from the slab, however slow
    rp = kvtrace.Replayer(args, kvtrace.generate(args.sessions, args.seed), log=lambda *a: None)
    try:
        rp.prepare()
        assert rp.history, "the initial sessions need history on the slab"

        def corrupt(config, replayer):  # one byte of every history block
            with open(replayer.slab.hist_path, "r+b") as fh:
                for slot in range(len(replayer.history)):
                    fh.seek(slot * replayer.bb + 123)
                    b = fh.read(1)
                    fh.seek(slot * replayer.bb + 123)
                    fh.write(bytes([b[0] ^ 0xFF]))

        rp.poison_hook = corrupt
        rec = rp.run_point("phoenix", 4)
    finally:
        rp.close()
    assert rec["counts"]["ssd_loads"] > 0
    assert rec["counts"]["verify_failures"] > 0 and not rec["verified"]
    assert "does not hold its pattern" in rec["failures"][0]


class _LosesCopies:
    """The host runtime, except that stream-ordered host->device copies never land."""

    def __init__(self, rt):
        self._rt = rt

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def memcpy_async(self, dst, src, size, kind, stream):
        return None


def test_a_load_that_does_not_land_is_caught(rt, tmp_path):
    args = _args(tmp_path, "--configs", "dram", "--concurrency", "4")
    rp = kvtrace.Replayer(args, kvtrace.generate(args.sessions, args.seed), rt=_LosesCopies(rt), log=lambda *a: None)
    try:
        rp.prepare()
        rec = rp.run_point("dram", 4)
    finally:
        rp.close()
    assert rec["counts"]["dram_loads"] > 0
    assert rec["counts"]["verify_failures"] == rec["counts"]["dram_loads"]  # poisoned destinations stay poisoned


def test_cli_gen_and_bench_still_parse(tmp_path):
    from phoenix.cli.phx import main

    out = tmp_path / "trace.jsonl"
    assert main(["bench", "kv-trace", "gen", "--sessions", "4", "--seed", "7", "--out", str(out)]) == 0
    assert kvtrace.read_trace(str(out)).sessions == kvtrace.generate(4, 7).sessions


def test_bench_without_a_subcommand_is_the_throughput_bench():
    from phoenix.bench import cli, loader, throughput

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="cmd"))
    a = parser.parse_args(["bench", "--size", "1M", "--threads", "1,2"])
    assert a.threads == [1, 2] and a.bench_cmd is None and a.func is throughput.main
    k = parser.parse_args(["bench", "kv-trace", "--concurrency", "1,2"])
    assert k.func is kvtrace.main and k.concurrency == [1, 2]
    m = parser.parse_args(["bench", "loader", "model.safetensors", "--device", "cpu", "--chunk", "64M"])
    assert m.func is loader.main and m.file == "model.safetensors" and m.chunk == 64 << 20


def test_a_point_that_loaded_nothing_from_a_tier_is_flagged():
    """A staged or phoenix point with no SSD load measures no SSD path: the record, the table and
    its legend say so."""
    from phoenix.bench.kvtrace.cli import tier_warnings

    def rec(config, conc, dram, ssd):
        counts = {
            "hbm_hits": 5,
            "dram_loads": dram,
            "ssd_loads": ssd,
            "recomputes": 0,
            "bytes_loaded_dram": 0,
            "bytes_loaded_ssd": 0,
        }
        r = {
            "config": config,
            "concurrency": conc,
            "rounds": 3,
            "qps": 1.0,
            "ttft_mean_s": 0.1,
            "ttft_p50_s": 0.1,
            "ttft_p99_s": 0.2,
            "counts": counts,
            "verified": True,
            "under_threshold": True,
            "threshold_s": 5.0,
        }
        r["warnings"] = tier_warnings(r)
        return r

    recs = [rec("phoenix", 1, 4, 0), rec("staged", 4, 3, 2), rec("dram", 1, 0, 0), rec("dram", 4, 2, 0)]
    assert "SSD tier" in recs[0]["warnings"][0] and "--concurrency" in recs[0]["warnings"][0]
    assert recs[1]["warnings"] == [] and recs[3]["warnings"] == []  # dram has no SSD tier
    assert "DRAM tier" in recs[2]["warnings"][0]
    out = kvtrace.table(recs)
    assert out.count("WARNING:") == 2 and "phoenix at concurrency 1 loaded nothing from the SSD tier" in out
    for column in ("config", "conc", "rounds", "QPS", "TTFT", "hbm", "dram", "ssd", "recomp", "GB ld", "verified"):
        assert f"\n  {column} " in out.split("columns:", 1)[1], column


class _Future:
    def __init__(self, log, name, got=None, exc=None):
        self.log, self.name, self.got, self.exc = log, name, got, exc

    def result(self):
        self.log.append(("waited", self.name))
        if self.exc:
            raise self.exc
        return self.got


class _Tasks:
    """What ``Replayer._run_tasks`` uses of its replayer (the real ``_write_blocks``),
    recording the order of events."""

    bb = 4096
    _write_blocks = kvtrace.Replayer._write_blocks

    def __init__(self, fail_start=None, fail_wait=None, short=None):
        self.log, self.fail_start, self.fail_wait, self.short = [], fail_start, fail_wait, short

    def _write_start(self, config, task, priority="normal"):
        name = task[1]
        if name == self.fail_start:
            raise OSError(28, f"{name}: no space")
        self.log.append(("started", name))
        exc = OSError(5, f"{name}: EIO") if name == self.fail_wait else None
        return f"/slab/{name}", 0, _Future(self.log, name, self.bb // 2 if name == self.short else self.bb, exc)

    def _run_task(self, config, task, slot):
        self.log.append(("ran", task[0], task[1]))


_DEMOTIONS = [
    ("to_ssd", "w1", ("dram", 3), 10),
    ("h2dram", "c1", 7, 3),
    ("to_ssd", "w2", ("dram", 4), 11),
    ("h2dram", "c2", 8, 4),
    ("to_ssd", "w3", ("hbm", 9), 12),
]


def test_demotion_writes_start_together_and_finish_before_the_copies():
    from phoenix.bench.kvtrace.replay import Replayer

    fake = _Tasks()
    Replayer._run_tasks(fake, "phoenix", list(_DEMOTIONS), 0)
    assert fake.log == [
        ("started", "w1"), ("started", "w2"), ("started", "w3"),
        ("waited", "w1"), ("waited", "w2"), ("waited", "w3"),
        ("ran", "h2dram", "c1"), ("ran", "h2dram", "c2"),
    ]  # fmt: skip
    fake = _Tasks()  # the naive loop: one task after the other, in order
    Replayer._run_tasks(fake, "staged", list(_DEMOTIONS), 0)
    assert fake.log == [("ran", t[0], t[1]) for t in _DEMOTIONS]


@pytest.mark.parametrize(
    "kind, want",
    [("fail_start", "w2: no space"), ("fail_wait", "w1: EIO"), ("short", "short write 2048 of 4096")],
)
def test_a_failed_demotion_write_is_raised_after_every_started_one_is_waited(kind, want):
    from phoenix.bench.kvtrace.replay import Replayer

    fake = _Tasks(**{kind: "w2" if kind == "fail_start" else "w1"})
    with pytest.raises(OSError, match=want):
        Replayer._run_tasks(fake, "phoenix", list(_DEMOTIONS), 0)
    started = [n for e, n in fake.log if e == "started"]
    assert started and all(("waited", n) in fake.log for n in started)  # none left in flight
    assert not any(e == "ran" for e, *_ in fake.log)  # no copy into a slot whose write failed


def test_drop_cache_takes_every_file_and_names_what_it_could_not_drop(tmp_path):
    from phoenix.bench.files import drop_cache

    files = [tmp_path / f"f{i}" for i in range(3)]
    data = [os.urandom(1 << 16) for _ in files]
    for f, d in zip(files, data, strict=True):
        f.write_bytes(d)
    assert drop_cache(*map(str, files)).startswith("fadvise")
    gone = [str(tmp_path / "gone1"), str(tmp_path / "gone2")]
    how = drop_cache(str(files[0]), gone[0], str(files[1]), gone[1])
    assert how.startswith("not dropped (") and gone[0] in how and " and 1 more; others fadvise" in how
    assert [f.read_bytes() for f in files] == data  # dropped from the cache, not changed
