"""The kv-trace replay: sessions as threads, each round's loads, prefill and demotions, timed.

Benchmark side. One :class:`Replayer` per run; :meth:`Replayer.run_point` replays one
(configuration, concurrency) point and returns its record. Data moves outside the cache's
lock in the thread of the round that needs it; TTFT is taken before the untimed checks.
Every non-DRAM point starts cold: phoenix's registered page-cache windows are released
(``fmap_clear``) and the files dropped from the page cache; ``PHX_FMAP_MODE=off`` turns
the window cache off.

A point runs until ``--duration`` has passed and it holds ``--min-samples`` TTFTs, or until
``--max-duration`` (its record then says ``samples_short``); sessions check that between
rounds and are woken from their think time when it holds, so none overstays by more than
the round it is in. Its p99 comes with a percentile-bootstrap 95 % interval
(``ttft_p99_ci_s``, :func:`report.bootstrap_ci`).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import phoenix.settings
from phoenix.vendor import CopyKind

from ..args import check_device
from ..files import drop_cache
from .behind import ENGINES as behind_engines
from .behind import WriteBehind
from .compute import Geometry, block_key, make_backend
from .report import CONFIGS, bootstrap_ci, pct
from .tiers import Counts, KVCache, Slab, host_view
from .trace import Session, Trace, scale_trace

#: a point whose sessions are still in their rounds this long after it stopped (or was
#: interrupted) has every thread's stack written to stderr, with phoenix's counters
DRAIN_WARN_S = 60.0


def _dump_stuck(config: str, conc: int, alive, waited: float) -> None:
    """Say on stderr which sessions of a point have not left their round, where every
    thread is (faulthandler) and phoenix's counters: a point that does not end is found."""
    import faulthandler
    import sys

    names = ", ".join(t.name for t in alive)
    print(
        f"kv-trace: {config} at concurrency {conc}: {len(alive)} sessions still in a round {waited:.0f} s after "
        f"the point stopped ({names}); every thread's stack follows",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    pio = sys.modules.get("phoenix.io")
    if pio is not None:
        try:
            print(f"phoenix counters: {pio.stats()}", file=sys.stderr, flush=True)
        except Exception as exc:  # a diagnostic must not raise
            print(f"phoenix counters: unavailable ({exc})", file=sys.stderr, flush=True)


__all__ = ["CONFIGS", "Replayer", "TooLarge"]


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process so far, every thread's."""
    t = os.times()
    return t.user + t.system


def _done(config: str, fu) -> int:
    """The byte count of an engine's future: KvikIO's ``get()``, phoenix's ``result()``."""
    return fu.get() if config == "kvikio" else fu.result()


class TooLarge(Exception):
    """A round whose context no longer fits the HBM tier: its session ends there."""


@dataclass
class SessionState:
    index: int  # number in the trace
    session: Session
    next_round: int
    kid: int = -1  # session id in block keys: a session replayed from round 0 gets one of its own
    born: list = field(default_factory=list)  # per block: the round whose content it holds
    initial: bool = False

    def __post_init__(self):
        if self.kid < 0:
            self.kid = self.index

    def advance_born(self, r: int, B: int) -> None:
        """Block versions after round ``r``'s prefix (a prefix ending inside or before a block
        gives the block new content from round r on)."""
        rd = self.session.rounds[r]
        first_changed = rd.prefix_tokens // B
        total_blocks = (rd.input_tokens + rd.output_tokens) // B
        del self.born[first_changed:]
        self.born.extend([r] * (total_blocks - len(self.born)))

    def key(self, b: int) -> tuple:
        return (self.kid, b, self.born[b])


class Replayer:
    def __init__(self, args, trace: Trace, rt=None, log=print):
        import phoenix.io as pio
        from phoenix import registry

        self.args, self.log = args, log
        self.geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.q_heads, args.hidden, args.ffn, args.dtype)
        self.trace = scale_trace(trace, args.token_scale)
        B = args.block_tokens
        self.bb = B * self.geo.bytes_per_token
        if self.bb % 4096:
            raise ValueError(
                f"a block is {self.bb} bytes ({B} tokens x {self.geo.bytes_per_token}): choose --block-tokens "
                "so that it is a multiple of 4096 (O_DIRECT alignment)"
            )
        self.cmax = max(args.concurrency)
        if len(self.trace.sessions) < self.cmax:
            raise ValueError(f"the trace has {len(self.trace.sessions)} sessions, fewer than --concurrency {self.cmax}")
        first_need = max(
            (self.trace.sessions[i].rounds[0].input_tokens + self.trace.sessions[i].rounds[0].output_tokens) // B + 1
            for i in range(self.cmax)
        )
        if first_need > args.hbm // self.bb:
            raise ValueError(
                f"a first round needs {first_need} blocks of {self.bb >> 10} KiB in HBM but --hbm holds "
                f"{args.hbm // self.bb}: raise --hbm, or lower --token-scale"
            )
        slab_paths = Slab.parse(args.slab)  # refused before any memory is allocated
        if not getattr(args, "fast_device", None):  # (on fast devices the slab is made afresh)
            Slab.refuse_foreign(slab_paths)
        if rt is None:
            if phoenix.settings.effective("vendor") in ("nvidia", "auto") and args.compute in ("auto", "torch"):
                try:  # torch first: the nvidia port then shares torch's libcudart
                    import torch  # noqa: F401
                except Exception:
                    pass
            rt = registry.get_runtime()
        self.rt = rt
        check_device(rt, args.device)  # an ordinal the vendor lacks: said as --device, before any allocation
        self.pio = pio
        max_ctx = max(r.input_tokens for s in self.trace.sessions for r in s.rounds) + 1
        self.backend = make_backend(rt, self.geo, max_ctx, args.prefill_chunk, args.device, args.compute)
        # initial sessions (one per slot of the largest concurrency) start part-way through
        rng = random.Random(args.seed + 1)
        self.start_round = []
        for s in self.trace.sessions:
            hi = int(len(s.rounds) * args.warm_start)
            self.start_round.append(rng.randrange(hi) if hi > 0 else 0)
        # history: the blocks of the initial sessions' prefixes at their start rounds
        self.history: dict = {}
        for i in range(self.cmax):
            st = self._state(i, initial=True)
            for b in range(len(st.born)):
                self.history[st.key(b)] = len(self.history)
        self.cache = KVCache(rt, self.backend, args, self.geo, len(self.history))
        self.slab = Slab(slab_paths, self.bb, len(self.history), self.cache.ssd.nslots)
        self.slab_write_s = 0.0
        self.staging: dict = {}
        self.poison_hook = None  # tests: called with (config, replayer) before a point's replay
        self.phase_s: dict[str, float] = {}  # a point's wall time besides its rounds (run_point)
        self.abort = False

    def _state(self, i: int, initial: bool) -> SessionState:
        """Session ``i`` before its first replayed round: the blocks of that round's prefix exist."""
        st = SessionState(
            i,
            self.trace.sessions[i],
            self.start_round[i] if initial else 0,
            kid=i if initial else i + len(self.trace.sessions),
            initial=initial,
        )
        for r in range(st.next_round):
            st.advance_born(r, self.args.block_tokens)
        if st.next_round < len(st.session.rounds):
            del st.born[st.session.rounds[st.next_round].prefix_tokens // self.args.block_tokens :]
        return st

    # -- setup -----------------------------------------------------------------------------

    def prepare(self) -> None:
        if any(c != "dram" for c in self.args.configs):
            keys = {k: block_key(*k) for k in self.history}
            self.slab_write_s = self.slab.create(self.history, keys)
            where = self.slab.hist_path
            if self.slab.lanes > 1:
                where = f"{self.slab.lanes} files, block by block ({', '.join(self.slab.hist_paths)})"
            self.log(
                f"slab: {len(self.history)} history blocks ({len(self.history) * self.bb / 2**30:.2f} GiB) written to "
                f"{where} in {self.slab_write_s:.1f} s; dynamic region {self.cache.ssd.nslots} blocks"
            )
        for i in range(self.cmax):
            self.staging[i] = self.rt.host_alloc_pinned(self.bb)

    def close(self) -> None:
        self.slab.close()
        for p in self.staging.values():
            self.rt.host_free_pinned(p)
        self.staging = {}
        self.cache.close()
        if not self.args.keep_slab:
            self.slab.remove()
        else:
            self.slab.release()

    # -- one point: (config, concurrency) -----------------------------------------------------

    def run_point(self, config: str, conc: int) -> dict:
        t0 = time.perf_counter()
        self.cache.reset(config, self.history)
        if config != "dram":
            drop_cache(*self.slab.all_paths())
            if hasattr(self.pio, "fmap_clear"):
                self.pio.fmap_clear()  # every point starts without phoenix's page-cache mappings
        with self._engine(config):
            self.slab.open(config)
            self.phase_s = {"setup": time.perf_counter() - t0}
            try:
                if self.poison_hook:
                    self.poison_hook(config, self)
                elapsed, stopped_by = self._replay(config, conc)
            finally:
                t1 = time.perf_counter()
                self.slab.close()
                self.phase_s["close"] = time.perf_counter() - t1
        if self.errors:
            raise RuntimeError(f"{config} at concurrency {conc}: " + self.errors[0])
        t2 = time.perf_counter()
        rec = self._record(config, conc, elapsed, stopped_by)
        self.phase_s["record"] = time.perf_counter() - t2
        # where a point's wall time went besides its rounds (the log line says it)
        rec["phase_s"] = {k: round(v, 3) for k, v in self.phase_s.items()}
        # the process's CPU seconds in the rounds (its engine's threads, KvikIO's pool, the
        # sessions and the compute's launches; not the kernel's block-device threads)
        moved = (
            rec["counts"]["bytes_loaded_dram"] + rec["counts"]["bytes_loaded_ssd"] + rec["counts"]["bytes_written_ssd"]
        )
        rec["cpu_s"] = self.cpu_s
        rec["cpu_s_per_gb"] = self.cpu_s / (moved / 1e9) if moved else None
        return rec

    def _engine(self, config: str):
        """The engine's settings around a point: KvikIO's for ``kvikio``, nothing otherwise."""
        if config != "kvikio":
            return contextlib.nullcontext()
        from . import kvikio_io

        return kvikio_io.settings(self.args.kvikio_threads, self.args.kvikio_task, self._kvikio_direct())

    def _kvikio_direct(self) -> bool:
        return getattr(self.args, "kvikio_direct", "on") == "on"

    def _replay(self, config: str, conc: int) -> tuple[float, str]:
        """The sessions of one point, as threads, until the point's stop condition holds.
        Returns the seconds it took and what stopped it."""
        args = self.args
        self.point_counts = Counts()
        self.ttfts: list[float] = []
        self.errors: list[str] = []
        self.failures: list[str] = []
        self.abort = False
        self.truncated = 0
        lock = threading.Lock()
        next_session = [self.cmax]  # sessions below cmax are the initial ones (history on the slab)

        # warm-up (untimed): the initial sessions' earlier rounds went through HBM and DRAM
        tw = time.perf_counter()
        states = [self._state(i, initial=True) for i in range(conc)]
        self._warm(states)
        self.phase_s["warm"] = time.perf_counter() - tw
        min_samples = getattr(args, "min_samples", 0)
        duration = args.duration
        cap = max(duration, getattr(args, "max_duration", duration))
        stop = threading.Event()  # set when the point has what it needs: sessions leave their think time
        t_start = time.perf_counter()

        def stop_reason() -> str | None:
            el = time.perf_counter() - t_start
            if el >= duration and len(self.ttfts) >= min_samples:
                return "duration"
            return "max_duration" if el >= cap else None

        def worker(slot: int, st: SessionState):
            rng = random.Random(args.seed * 1000 + slot)
            stream = self.backend.new_stream()
            copy_stream = self.rt.stream_create(args.device)
            try:
                first = True
                while st is not None:
                    rounds = st.session.rounds
                    while st.next_round < len(rounds):
                        think = rounds[st.next_round].think_s * args.time_scale
                        if first:  # initial sessions arrive spread over one think time
                            think = think * rng.random() if st.initial else 0.0
                        first = False
                        if stop.is_set() or self.abort or (think > 0 and stop.wait(think)):
                            return
                        try:
                            ttft, counts = self.round(config, slot, st, stream, copy_stream)
                        except TooLarge:
                            with lock:
                                self.truncated += 1
                            break
                        with lock:
                            self.ttfts.append(ttft)
                            self.point_counts.add(counts)
                        st.next_round += 1
                    with lock:  # the slot takes the next session of the trace, from its first round
                        i = next_session[0]
                        next_session[0] += 1
                    st = self._state(i, initial=False) if i < len(self.trace.sessions) else None
                    first = True
            except Exception as exc:
                import traceback

                with lock:
                    self.errors.append(f"slot {slot}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                with self.cache.cond:
                    self.abort = True
                    self.cache.cond.notify_all()
            finally:
                self.backend.sync(stream)
                self.rt.stream_destroy(copy_stream)

        threads = [threading.Thread(target=worker, args=(i, states[i]), name=f"kv-session-{i}") for i in range(conc)]
        depth = getattr(args, "write_behind", 0)
        behind = WriteBehind(self, config, depth) if depth and config in behind_engines else None
        cpu0 = _cpu_s()  # the rounds' CPU (and the writer's), not the warm-up's
        try:
            if behind is not None:
                behind.start()
            return self._sessions(threads, stop, stop_reason, config, conc, t_start)
        finally:
            if behind is not None:  # after the sessions (or on any error): its writes are the point's too
                self.point_counts.add(behind.stop())
            self.cpu_s = _cpu_s() - cpu0

    def _sessions(self, threads, stop, stop_reason, config: str, conc: int, t_start: float) -> tuple[float, str]:
        """Start the sessions' threads, watch the point's stop condition, wait for them all."""
        for t in threads:
            t.start()
        stopped_by = None
        stopped_at = 0.0
        dumped = False
        try:
            while True:  # the main thread watches the stop condition; the sessions run
                alive = [t for t in threads if t.is_alive()]
                if not alive:
                    break
                if stopped_by is None:
                    stopped_by = stop_reason() or ("error" if self.abort else None)
                    if stopped_by:
                        stop.set()
                        stopped_at = time.perf_counter()
                elif not dumped and time.perf_counter() - stopped_at > DRAIN_WARN_S:
                    dumped = True  # sessions still in a round long after the stop: say where they are
                    _dump_stuck(config, conc, alive, time.perf_counter() - stopped_at)
                alive[0].join(0.01)
        finally:
            stop.set()  # an interrupt: the sessions leave after their round
            deadline = time.perf_counter() + DRAIN_WARN_S
            for t in threads:  # DRAIN_WARN_S for all of them, then they are said to be stuck
                t.join(None if dumped else max(0.0, deadline - time.perf_counter()))
            alive = [t for t in threads if t.is_alive()]
            if alive and not dumped:
                _dump_stuck(config, conc, alive, DRAIN_WARN_S)
            for t in alive:
                t.join()
        return time.perf_counter() - t_start, stopped_by or "trace_end"

    def _warm(self, states) -> None:
        """The initial sessions' earlier rounds, interleaved round by round, leave their most
        recent blocks in HBM and the next ones in DRAM (older ones: on the SSD tier's slab for
        staged and phoenix, dropped for dram). Untimed."""
        c, be = self.cache, self.backend
        produced = []  # (round, session, key) of every block version still valid at the start
        for st in states:
            for b in range(len(st.born)):
                produced.append((st.born[b], st.index, st.key(b)))
        produced.sort()
        tail = [k for _, _, k in produced[-(c.hbm.nslots + c.dram.nslots) :]]
        n_dram = max(0, len(tail) - c.hbm.nslots)
        stream = be.new_stream()
        scratch, _ = c.hbm.take()  # a free HBM slot to make DRAM contents on the device
        for k in tail[:n_dram]:
            be.fill(stream, c.hbm_ptr(scratch), self.bb, block_key(*k))
            be.sync(stream)
            slot, _ = c.dram.take()
            self.rt.memcpy(c.dram_ptr(slot), c.hbm_ptr(scratch), self.bb, CopyKind.DEVICE_TO_HOST)
            c.dram.put(k, slot)
        c.hbm.free.append(scratch)
        for k in tail[n_dram:]:
            slot, _ = c.hbm.take()
            be.fill(stream, c.hbm_ptr(slot), self.bb, block_key(*k))
            c.hbm.put(k, slot)
        be.sync(stream)
        # low blocks most recent within a session (as rounds leave them)
        for k in sorted(c.hbm.lru, key=lambda k: (-k[1],)):
            c.hbm.lru.move_to_end(k)

    # -- one round ----------------------------------------------------------------------------

    def _classify(self, keys, need):
        c = self.cache
        where = [
            "hbm" if k in c.hbm.lru else "dram" if k in c.dram.lru else "ssd" if k in c.ssd.lru else None
            for k in keys[:need]
        ]
        m = where.index(None) if None in where else need
        return where, m

    def round(self, config: str, slot: int, st: SessionState, stream, copy_stream) -> tuple[float, Counts]:
        args, c, be, bb = self.args, self.cache, self.backend, self.bb
        B = args.block_tokens
        r = st.next_round
        rd = st.session.rounds[r]
        n = Counts(rounds=1)
        t0 = time.perf_counter()
        st.advance_born(r, B)
        need = rd.prefix_tokens // B
        produce_end = (rd.input_tokens + rd.output_tokens) // B
        keys = [st.key(b) for b in range(max(need, produce_end))]
        if len(keys) > c.hbm.nslots:
            raise TooLarge(f"session {st.index} round {r}: {len(keys)} blocks, more than the HBM tier's {c.hbm.nslots}")
        with c.cond:
            # where is each prefix block; wait (holding nothing) until HBM can take what must come in
            while True:
                if self.abort:
                    raise RuntimeError("aborted: another session failed")
                if any(k in c.transit for k in keys[:need]):
                    c.cond.wait(1.0)
                    continue
                where, m = self._classify(keys, need)
                loads = [(b, where[b]) for b in range(m) if where[b] != "hbm"]
                produce = list(range(m, produce_end))
                resident = {k for k in keys if k in c.hbm.lru}
                want = [b for b, _ in loads] + [b for b in produce if keys[b] not in resident]
                if len(c.hbm.free) + c.hbm.evictable(exclude=resident) >= len(want):
                    break
                n.hbm_waits += 1
                c.cond.wait(1.0)
            t_room = time.perf_counter()
            for k in resident:
                c.hbm.pins[k] += 1
            src = {}  # pinned first: the demotions below must not evict what this round loads
            for b, w in loads:
                tier = c.dram if w == "dram" else c.ssd
                tier.pins[keys[b]] += 1
                src[b] = tier.lru[keys[b]]
                n.ssd_loads_behind += w == "ssd" and c.ssd.tags.get(keys[b]) == "behind"
            dst: dict[int, int] = {}
            tasks = []
            for b in want:
                s, victim = c.hbm.take(exclude=resident)
                dst[b] = s
                if victim is not None:
                    tasks += self._demote(victim, s, n)
        done = False
        try:
            # data moves outside the lock: demotions first (they free the slots), then loads
            self._run_tasks(config, tasks, slot)
            done = True
        finally:
            self._settle(tasks, done)
        t_demoted = time.perf_counter()
        if args.verify and loads:
            for b, _ in loads:
                be.poison(stream, c.hbm_ptr(dst[b]), bb)
            be.sync(stream)
        start = m * B  # prefill from the first missing block on: recomputed prefix and new tokens
        tokens = rd.input_tokens - start
        dram_loads = [b for b, w in loads if w == "dram"]
        ssd_loads = [b for b, w in loads if w == "ssd"]
        for b in dram_loads:
            self.rt.memcpy_async(c.hbm_ptr(dst[b]), c.dram_ptr(src[b]), bb, CopyKind.HOST_TO_DEVICE, copy_stream)
        futs = []
        if config == "phoenix":
            for b in ssd_loads:
                path, off = self.slab.where(src[b])
                futs.append((path, off, self.slab.files[path].pread((c.hbm_ptr(dst[b]), bb), bb, off)))
        elif config == "kvikio":  # KvikIO's pread into a CuPy view of the HBM block, in its thread pool
            from .kvikio_io import device_array

            for b in ssd_loads:
                path, off = self.slab.where(src[b])
                view = device_array(c.hbm_ptr(dst[b]), bb, args.device, self)
                futs.append((path, off, self.slab.files[path].pread(view, bb, off)))
        # the linear layers of the uncached tokens run while the prefix loads (queued on the GPU;
        # on the CPU stand-in they run here, beside phoenix's and the copy stream's transfers)
        be.linear(stream, tokens)
        if config == "staged":
            for b in ssd_loads:  # the naive loop: pread into pinned memory, then a synchronous copy
                path, off = self.slab.where(src[b])
                fd, _direct = self.slab.fds[path]
                got = os.preadv(fd, [host_view(self.staging[slot], bb)], off)
                if got != bb:
                    raise OSError(5, f"{path}: short read, {got} of {bb} bytes at {off}")
                self.rt.memcpy(c.hbm_ptr(dst[b]), self.staging[slot], bb, CopyKind.HOST_TO_DEVICE)
        for path, off, fu in futs:
            got = _done(config, fu)
            if got != bb:
                raise OSError(5, f"{path}: short read, {got} of {bb} bytes at {off}")
        if dram_loads:
            self.rt.stream_synchronize(copy_stream)
        t_loaded = time.perf_counter()
        # attention over the whole context, once the prefix is in HBM
        be.attention(stream, start, tokens)
        # the KV this round produces (recomputed prefix blocks, new ones; decode's as if produced)
        for b in produce:
            if keys[b] not in resident:
                be.fill(stream, c.hbm_ptr(dst[b]), bb, block_key(*keys[b]))
        be.sync(stream)
        t_end = time.perf_counter()
        ttft = t_end - t0
        # where the TTFT went: room in HBM, demotions, loads (the linear layers overlap them; with
        # --verify the destinations' poisoning too), the rest
        n.wait_s, n.demote_s = t_room - t0, t_demoted - t_room
        n.load_s, n.compute_s = t_loaded - t_demoted, t_end - t_loaded
        # accounting and verification (untimed)
        n.blocks_needed = need
        n.hbm_hits = sum(1 for w in where[:m] if w == "hbm")
        n.dram_loads, n.ssd_loads = len(dram_loads), len(ssd_loads)
        n.recomputes = need - m
        n.bytes_loaded_dram, n.bytes_loaded_ssd = len(dram_loads) * bb, len(ssd_loads) * bb
        n.blocks_produced = len(produce)
        n.prefill_tokens = tokens
        n.recompute_tokens = max(0, rd.prefix_tokens - start)
        n.linear_tflop = self.geo.linear_flops(tokens) / 1e12
        ch = args.prefill_chunk
        n.attention_tflop = (
            sum(
                self.geo.attention_flops(min(ch, tokens - p), start + p + min(ch, tokens - p))
                for p in range(0, tokens, ch)
            )
            / 1e12
        )
        if n.hbm_hits + n.dram_loads + n.ssd_loads + n.recomputes != n.blocks_needed:
            raise AssertionError(f"accounting does not add up: {n}")
        try:
            if args.verify:
                for b, w in loads:
                    ok = be.verify(stream, c.hbm_ptr(dst[b]), bb, block_key(*keys[b]))
                    n.bytes_verified += bb
                    if not ok:
                        n.verify_failures += 1
                        self.failures.append(
                            f"{config}: session {st.index} round {r} block {b} loaded from {w} "
                            "does not hold its pattern"
                        )
        finally:
            with c.cond:
                for b in range(len(keys) - 1, -1, -1):  # low blocks most recent: the prefix stays longest
                    k = keys[b]
                    if b in dst:
                        c.hbm.put(k, dst[b])
                    elif k in c.hbm.lru:
                        c.hbm.lru.move_to_end(k)
                for k in resident:
                    c.hbm.pins[k] -= 1
                for b, w in loads:
                    tier = c.dram if w == "dram" else c.ssd
                    tier.pins[keys[b]] -= 1
                    if keys[b] in tier.lru:
                        tier.lru.move_to_end(keys[b])
                c.cond.notify_all()
        return ttft, n

    # -- demotion ------------------------------------------------------------------------------

    def _demote(self, victim, hbm_slot: int, n: Counts) -> list:
        """Under the lock: where an HBM victim goes (and what that evicts). Returns tasks."""
        c = self.cache
        tasks = []
        if victim in c.dram.lru or victim in c.ssd.lru:
            return tasks  # lower tiers are inclusive: a copy is there already
        c.transit.add(victim)
        dslot, dvictim = c.dram.take()
        if dslot is not None:
            if dvictim is not None:
                tasks += self._to_ssd(dvictim, ("dram", dslot), n)
            tasks.append(("h2dram", victim, hbm_slot, dslot))
            n.demoted_to_dram += 1
            return tasks
        # DRAM has no slot to give (all pinned by loads in flight): straight to SSD, or dropped
        tasks += self._to_ssd(victim, ("hbm", hbm_slot), n)
        return tasks

    def _to_ssd(self, key, src, n: Counts) -> list:
        c = self.cache
        if key in c.ssd.lru:
            c.transit.discard(key)
            return [("nop", key)]
        if c.config == "dram":
            n.dropped += 1
            return [("nop", key)]
        sslot, _svictim = c.ssd.take()
        if sslot is None:
            n.dropped += 1
            return [("nop", key)]
        c.transit.add(key)
        n.written_to_ssd += 1
        n.bytes_written_ssd += self.bb
        return [("to_ssd", key, src, sslot)]

    def _run_tasks(self, config: str, tasks: list, slot: int) -> None:
        """A round's demotions. phoenix and KvikIO write the blocks leaving DRAM (or HBM)
        for the SSD tier all at once, as their engines' futures allow, then copy the HBM
        victims into DRAM; the staged loop does one after the other. The reorder is safe:
        a write and a copy share a slot only where ``_demote`` paired them (the write of the
        DRAM victim reads the slot its copy then fills), and every write is waited for,
        on error too, before any copy starts; the slots this round took are distinct and
        out of the free lists and LRUs until ``_finish_task``, so no other round and no
        write-behind reads or refills them; a write from HBM reads a slot no copy fills
        and the loads into it come after."""
        if config not in ("phoenix", "kvikio"):
            for task in tasks:
                self._run_task(config, task, slot)
            return
        _written, error = self._write_blocks(config, [t for t in tasks if t[0] == "to_ssd"])
        if error is not None:
            raise error
        for task in tasks:
            if task[0] == "h2dram":
                self._run_task(config, task, slot)

    def _write_blocks(self, config: str, tasks: list, priority: str = "normal") -> tuple[int, Exception | None]:
        """``to_ssd`` tasks' writes through phoenix or KvikIO, started together, every one
        waited for (on error too: no buffer is reused under a write): how many landed whole,
        and the first error (a start refused, a failed or short write), if any."""
        started, error, written = [], None, 0
        for task in tasks:
            try:
                started.append(self._write_start(config, task, priority))
            except Exception as exc:  # the writes already started are waited for below
                error = exc
                break
        for path, off, fu in started:
            try:
                got = _done(config, fu)
                if got != self.bb:
                    raise OSError(5, f"{path}: short write {got} of {self.bb} at {off}")
                written += 1
            except Exception as exc:
                error = error or exc
        return written, error

    def _write_start(self, config: str, task, priority: str = "normal"):
        """One block's write to the SSD tier through phoenix (at ``priority``) or KvikIO
        (which has none): (path, offset, future)."""
        c, bb = self.cache, self.bb
        _, _key, (tier, sslot_src), sslot = task
        path, off = self.slab.where(sslot)
        if config == "phoenix":
            ptr = c.dram_ptr(sslot_src) if tier == "dram" else c.hbm_ptr(sslot_src)
            return path, off, self.slab.files[path].pwrite((ptr, bb), bb, off, priority=priority)
        # KvikIO's pwrite from the pinned DRAM slot (or the HBM block)
        from .kvikio_io import device_array, host_array

        if tier == "dram":
            buf = host_array(c.dram_ptr(sslot_src), bb)
        else:
            buf = device_array(c.hbm_ptr(sslot_src), bb, self.args.device, self)
        return path, off, self.slab.files[path].pwrite(buf, bb, off)

    def _run_task(self, config: str, task, slot: int) -> None:
        c, bb = self.cache, self.bb
        if task[0] == "h2dram":
            _, _key, hslot, dslot = task
            self.rt.memcpy(c.dram_ptr(dslot), c.hbm_ptr(hslot), bb, CopyKind.DEVICE_TO_HOST)
        elif task[0] == "to_ssd":  # the staged loop's: one plain write after the other
            _, _key, (tier, sslot_src), sslot = task
            path, off = self.slab.where(sslot)
            if tier == "dram":
                ptr = c.dram_ptr(sslot_src)
            else:
                ptr = self.staging[slot]
                self.rt.memcpy(ptr, c.hbm_ptr(sslot_src), bb, CopyKind.DEVICE_TO_HOST)
            fd, _direct = self.slab.fds[path]
            got = os.pwritev(fd, [host_view(ptr, bb)], off)
            if got != bb:
                raise OSError(5, f"{path}: short write {got} of {bb} at {off}")

    def _settle(self, tasks: list, done: bool) -> None:
        """A round's demotions, in the index: each block in the slot it was copied or written
        to; or, when one of them failed (the point then fails), none recorded, their slots
        free again and the point aborted in the same step, so nothing (no round, no
        write-behind) takes a slot whose content is unknown for a block's copy."""
        c = self.cache
        with c.cond:
            for task in tasks:
                if done:
                    self._finish_task(task)
                else:
                    if task[0] == "h2dram":
                        c.dram.free.append(task[3])
                    elif task[0] == "to_ssd":
                        c.ssd.free.append(task[3])
                    c.transit.discard(task[1])
            if not done:
                self.abort = True
            c.cond.notify_all()

    def _finish_task(self, task) -> None:
        c = self.cache
        if task[0] == "h2dram":
            c.dram.put(task[1], task[3])
        elif task[0] == "to_ssd":
            c.ssd.put(task[1], task[3])
        c.transit.discard(task[1])

    # -- records ---------------------------------------------------------------------------------

    def _record(self, config: str, conc: int, elapsed: float, stopped_by: str = "duration") -> dict:
        t = sorted(self.ttfts)
        n = self.point_counts
        min_samples = getattr(self.args, "min_samples", 0)
        rec = {
            "config": config,
            "concurrency": conc,
            "vendor": self.rt.name,
            "test_double": bool(self.rt.is_test_double),
            "rounds": len(t),
            "seconds": elapsed,
            "qps": len(t) / elapsed if elapsed > 0 else 0.0,
            "ttft_mean_s": sum(t) / len(t) if t else None,
            "ttft_p50_s": pct(t, 0.50),
            "ttft_p99_s": pct(t, 0.99),
            "ttft_max_s": t[-1] if t else None,
            "threshold_s": self.args.threshold,
            "under_threshold": bool(t) and pct(t, 0.99) < self.args.threshold,
            "sessions_ended_hbm_full": self.truncated,
            "counts": asdict(n),
            "verified": n.verify_failures == 0,
            "failures": self.failures[:10],
            # the p99's sampling uncertainty and how the point ended (--min-samples, --max-duration)
            "samples": len(t),
            "ttft_p99_ci_s": bootstrap_ci(t, 0.99, seed=self.args.seed),
            "min_samples": min_samples,
            "max_duration_s": max(self.args.duration, getattr(self.args, "max_duration", self.args.duration)),
            "stopped_by": stopped_by,
            "samples_short": len(t) < min_samples,
        }
        if config == "kvikio":
            from . import kvikio_io

            rec["kvikio"] = kvikio_io.info(self.args.kvikio_threads, self.args.kvikio_task, self._kvikio_direct())
        elif config == "phoenix":
            from phoenix import _info

            rec["phoenix"] = {k: phoenix.settings.effective(k) for k in ("threads", "inflight", "fmap_mode")}
            rec["phoenix"]["sizes"] = _info.sizes()
        return rec
