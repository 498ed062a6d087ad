"""``phx bench kv-trace --write-behind``: the DRAM blocks chosen to be written ahead of their
eviction (a reference model of the choice), the writes' bookkeeping and failure, and whole
points that verify every loaded byte with it on. On the host vendor (a test double)."""

import argparse
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenix.bench import kvtrace
from phoenix.bench.kvtrace.behind import WriteBehind
from phoenix.bench.kvtrace.replay import Replayer
from phoenix.bench.kvtrace.tiers import Tier


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    kvtrace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv-trace", "--dry-run", "--slab", str(tmp_path / "kv.slab"), *extra])
    kvtrace.apply_dry_run(args)
    args.hbm, args.dram = args.hbm // 4, args.dram // 4  # small tiers: DRAM evicts, the SSD tier is written
    return args


class _Cache:
    def __init__(self, dram_slots, ssd_slots):
        self.dram, self.ssd = Tier("dram", dram_slots), Tier("ssd", ssd_slots, reserved=2)
        self.transit: set = set()
        self.cond = threading.Condition()


class _Rp:
    _write_blocks = Replayer._write_blocks  # the replayer's own: the fakes' _write_start under it

    def __init__(self, cache):
        self.cache, self.bb, self.abort, self.errors = cache, 4096, False, []


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 12),
    depth=st.integers(0, 10),
    batch=st.integers(1, 5),
    ssd_free=st.integers(0, 6),
    marks=st.lists(st.sampled_from(["plain", "pinned", "on_ssd", "transit", "writing"]), min_size=12, max_size=12),
    ssd_pins=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_pick_matches_the_reference_model(n, depth, batch, ssd_free, marks, ssd_pins):
    c = _Cache(16, 8)
    wb = WriteBehind(_Rp(c), "phoenix", depth, batch)
    hist = [("hist", 0), ("hist", 1)]  # the history's reserved slots, at the SSD tier's LRU head
    for slot, k in enumerate(hist):
        c.ssd.put(k, slot)
    keys = [("k", i) for i in range(n)]
    for i, k in enumerate(keys):
        slot, _ = c.dram.take()
        c.dram.put(k, slot)
        if marks[i] == "pinned":
            c.dram.pins[k] += 1
        elif marks[i] == "transit":
            c.transit.add(k)
        elif marks[i] == "writing":
            wb.writing.add(k)
    on_ssd = [k for i, k in enumerate(keys) if marks[i] == "on_ssd"]
    for k in on_ssd:
        slot, _ = c.ssd.take()
        if slot is None:
            break
        c.ssd.put(k, slot)
    on_ssd = [k for k in on_ssd if k in c.ssd.lru]
    while len(c.ssd.free) > ssd_free:  # the rest of the SSD tier's slots hold other blocks, some pinned (loading)
        k = ("other", len(c.ssd.lru))
        c.ssd.put(k, c.ssd.free.pop())
        if ssd_pins[len(c.ssd.lru) % 8]:
            c.ssd.pins[k] += 1
    ssd_before = dict(c.ssd.lru)
    ssd_pinned = {k for k in ssd_before if c.ssd.pins[k]}
    free_before = list(c.ssd.free)
    pins_before = dict(c.dram.pins)

    got = wb.pick()

    # the reference, step by step: in LRU order within the first `depth`, the blocks that need
    # a write (not on the SSD tier, not pinned, in transit or being written), up to `batch`,
    # while the SSD tier yields a slot: a free one (the list's end first), else the slot of its
    # least recently used block that is not history, not pinned and not also in DRAM
    free, lru, want = list(free_before), list(ssd_before.items()), []
    for i, k in enumerate(keys):
        if i >= depth or len(want) >= batch:
            break
        if k in on_ssd or marks[i] in ("pinned", "transit", "writing"):
            continue
        if free:
            free.pop()
        else:
            out = [j for j, (key, slot) in enumerate(lru) if slot >= 2 and key not in ssd_pinned and key not in keys]
            if not out:
                break
            lru.pop(out[0])
        want.append(k)
    assert [k for k, _d, _s in got] == want
    slots = [s for _k, _d, s in got]
    assert len(set(slots)) == len(slots) and all(s >= 2 for s in slots)  # no history slot, none twice
    assert all(s not in c.ssd.free and s not in c.ssd.lru.values() for s in slots)  # out of the tier until written
    assert [d for _k, d, _s in got] == [c.dram.lru[k] for k in want]
    for k in want:
        assert c.dram.pins[k] == pins_before.get(k, 0) + 1 and k in wb.writing
    assert all(k in c.ssd.lru for k in hist + on_ssd) and ssd_pinned <= set(c.ssd.lru)  # none of these evicted


def test_a_failed_write_behind_aborts_the_point_and_gives_the_slot_back(tmp_path):
    c = _Cache(4, 4)
    rp = _Rp(c)
    for i in range(3):
        slot, _ = c.dram.take()
        c.dram.put(("k", i), slot)
    seen = []

    class _Fut:
        def __init__(self, exc=None):
            self.exc = exc

        def result(self):
            if self.exc:
                raise self.exc
            return rp.bb

    def start(config, task, priority):
        seen.append((task[1], priority))
        return "/slab", 0, _Fut(OSError(5, "EIO") if task[1] == ("k", 1) else None)

    rp._write_start = start
    wb = WriteBehind(rp, "phoenix", depth=3, batch=3)
    free_before = sorted(c.ssd.free)
    wb.start()
    for _ in range(500):
        if rp.abort:
            break
        threading.Event().wait(0.01)
    counts = wb.stop()
    assert rp.abort and "write-behind (phoenix): OSError" in rp.errors[0]
    assert [p for _k, p in seen] == ["background"] * 3  # phoenix's writes behind run at background priority
    assert counts.written_behind == counts.written_to_ssd == 2 and counts.bytes_written_ssd == 2 * rp.bb
    assert not wb.writing and not +c.dram.pins  # every pin released
    assert sorted(c.ssd.free) == free_before  # the batch failed: its slots are free again, none in the LRU
    assert not c.ssd.lru


@pytest.mark.parametrize("depth", [0, 8])
def test_points_with_write_behind_verify_every_byte(rt, tmp_path, depth):
    args = _args(tmp_path, "--configs", "staged,phoenix", "--concurrency", "4", "--write-behind", str(depth))
    args.duration = 2.0
    lines: list[str] = []
    records = kvtrace.run(args, log=lambda *a: lines.append(" ".join(map(str, a))))
    by = {r["config"]: r for r in records}
    assert records[0]["meta"]["write_behind"] == depth
    for rec in records:
        c = rec["counts"]
        assert rec["verified"] and c["bytes_verified"] == c["bytes_loaded_dram"] + c["bytes_loaded_ssd"]
        assert c["ssd_loads"] > 0 and c["bytes_written_ssd"] == c["written_to_ssd"] * rec["meta"]["block_bytes"]
        assert c["written_behind"] <= c["written_to_ssd"]
        assert c["ssd_loads_behind"] <= c["ssd_loads"]
    assert by["staged"]["counts"]["written_behind"] == by["staged"]["counts"]["ssd_loads_behind"] == 0
    behind = by["phoenix"]["counts"]["written_behind"]
    assert (behind > 0) if depth else (behind == 0)
    # the copies written behind are read back from the SSD tier (and verified with every load)
    read_back = by["phoenix"]["counts"]["ssd_loads_behind"]
    assert (read_back > 0) if depth else (read_back == 0)
    said = f"{read_back} of {by['phoenix']['counts']['ssd_loads']} SSD loads from them"
    assert any(said in line for line in lines) if depth else not any("SSD loads from them" in line for line in lines)
    assert not [t for t in threading.enumerate() if t.name == "kv-write-behind"]  # the writer ended with its point


def test_write_behind_refuses_a_negative_depth(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--write-behind", "-1")
    assert "--write-behind" in capsys.readouterr().err


def test_an_error_in_the_writer_itself_fails_the_point():
    c = _Cache(4, 4)
    rp = _Rp(c)
    wb = WriteBehind(rp, "kvikio", depth=2)

    def broken():
        raise KeyError("index out of step")

    wb.pick = broken
    wb.start()
    wb._thread.join(5)
    assert not wb._thread.is_alive()
    assert rp.abort and rp.errors == ["write-behind (kvikio): KeyError: 'index out of step'"]
    assert wb.stop().written_behind == 0


def test_a_failed_demotion_records_nothing_and_aborts_at_once(rt, tmp_path):
    """A round whose demotion write fails: its blocks are not recorded in the slots it was
    writing or copying to, the slots are free again, and the point is aborted in the same step."""
    args = _args(tmp_path, "--configs", "phoenix", "--concurrency", "4", "--write-behind", "0")
    rp = kvtrace.Replayer(args, kvtrace.generate(args.sessions, args.seed), log=lambda *a: None)
    seen = []
    real = rp._settle

    def settle(tasks, done):
        if not done:
            before = {t[1]: (t[0], t[3]) for t in tasks if t[0] in ("h2dram", "to_ssd")}
            real(tasks, done)
            c = rp.cache
            for key, (kind, slot) in before.items():
                tier = c.dram if kind == "h2dram" else c.ssd
                seen.append((key not in tier.lru, slot in tier.free, key not in c.transit, rp.abort))
        else:
            real(tasks, done)

    rp._settle = settle

    def failing_write(config, task, priority="normal"):
        raise OSError(28, "No space left on device")

    rp._write_start = failing_write
    try:
        rp.prepare()
        with pytest.raises(RuntimeError, match="No space left on device"):
            rp.run_point("phoenix", 4)
    finally:
        rp.close()
    assert seen and all(all(x) for x in seen)


def test_a_tag_lives_as_long_as_its_copy():
    """Tier tags (who wrote a resident copy) go with the copy: dropped, taken as a victim or
    rewritten untagged, the block is no longer counted as written behind."""
    t = Tier("ssd", 3)
    for k in "abc":
        t.put(k, t.take()[0], tag="behind")
    assert t.tags == dict.fromkeys("abc", "behind")
    t.drop("a")
    slot, victim = t.take()  # the free slot a had
    assert victim is None and "a" not in t.tags
    t.put("a", slot)  # written again on eviction: untagged
    slot, victim = t.take()  # no free slot: b, the least recently used, is the victim
    assert victim == "b" and "b" not in t.tags
    t.put("b", slot, tag="behind")
    t.put("c", t.lru["c"])  # rewritten in place, untagged
    assert t.tags == {"b": "behind"}
