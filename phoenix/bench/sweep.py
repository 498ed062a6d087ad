"""``phx bench --raw-sweep``: the raw O_DIRECT reference and phoenix, each at its best configuration.

Benchmark side, control plane. A sweep runs each cold op once per point of a grid
(threads x chunk size; random reads: reads in flight), raw O_DIRECT and phoenix
interleaved point by point (drift of the device hits both alike), one run per point with
the file dropped from the page cache first. Each side's best point is then re-measured in
the interleaved repetitions of :func:`phoenix.bench.throughput.run` (a best picked from
single runs is biased upwards: the winner of noisy runs; its re-measured median is not),
and every ratio of the op divides by raw's re-measured best (``raw_best``).
"""

from __future__ import annotations

from .files import drop_cache

SWEEP_THREADS = (1, 4, 8, 16, 32)
SWEEP_CHUNKS = (1 << 20, 4 << 20, 16 << 20)
SWEEP_QD = (8, 16, 32, 64, 128)


#: bytes one random-read run moves at most (large blocks: fewer reads, the same time)
RANDOM_BYTES = 4 << 30


def random_nops(args) -> int:
    """Random reads per run: --random-ops, at most 4 passes over the file and RANDOM_BYTES,
    at least 16 per read in flight."""
    bs = args.random_bs
    return max(args.qd * 16, min(args.random_ops, args.size // bs * 4, RANDOM_BYTES // bs))


def sweep_grid(args, op: str) -> list[tuple[int, int]]:
    """The (threads, chunk) points of the raw O_DIRECT sweep of ``op`` (cold only):
    ``--sweep-threads`` x ``--sweep-chunks`` plus phoenix's own (each --threads at
    --chunk); random reads: in-flight counts ``SWEEP_QD`` plus --qd at --random-bs. Empty
    without ``--raw-sweep``. A grid point with more threads than --size has chunks is left
    out (its extra threads would idle: the figure of fewer threads, mislabelled)."""
    if not getattr(args, "raw_sweep", False) or "cold" not in args.temperature or op not in args.ops:
        return []
    if op == "randread":
        return [(q, args.random_bs) for q in sorted(set(SWEEP_QD) | {args.qd})]
    threads = getattr(args, "sweep_threads", None) or SWEEP_THREADS
    chunks = getattr(args, "sweep_chunks", None) or SWEEP_CHUNKS
    size = getattr(args, "size", None) or 1 << 62
    pts = {(t, c) for t in threads for c in chunks if c <= size and t <= max(1, size // c)}
    return sorted(pts | {(t, args.chunk) for t in args.threads})


#: phoenix's sweep: (workers, chunks in flight per worker, chunk size), 2 to 32 MiB in
#: flight (raw's sweep goes down to one thread x 1 MiB). A device that slows down as bytes in
#: flight grow (a loop device: the copy's working set past the last-level cache) wants few;
#: larger chunks cost less CPU per byte; one io_uring worker keeps its queue depth in flight
#: on its own.
PHOENIX_GRID = (
    (1, 2, 1 << 20),
    (1, 4, 1 << 20),
    (1, 2, 2 << 20),
    (1, 2, 4 << 20),
    (1, 8, 1 << 20),
    (1, 16, 1 << 20),
    (1, 32, 1 << 20),
    (2, 4, 2 << 20),
    (4, 2, 2 << 20),
    (1, 4, 4 << 20),
    (1, 8, 4 << 20),
    (1, 2, 8 << 20),
    (1, 4, 8 << 20),
    (1, 2, 16 << 20),
)
#: phoenix's pick: of the points within this fraction of the fastest, the one with the least CPU
CPU_TIE = 0.03


def phoenix_grid(args, op: str) -> list[tuple[int, int, int]]:
    """The (workers, queue depth, chunk) points phoenix is swept over (``--phoenix-sweep``,
    sequential ops only): :data:`PHOENIX_GRID` and phoenix's own --threads at --chunk with
    its default queue depth (0)."""
    if op == "randread" or not getattr(args, "phoenix_sweep", False):
        return []
    if not getattr(args, "raw_sweep", False) or "cold" not in args.temperature or op not in args.ops:
        return []
    return sorted(set(PHOENIX_GRID) | {(t, 0, args.chunk) for t in args.threads})


def phoenix_config_text(workers: int, qd: int, chunk: int) -> str:
    c = f"{chunk >> 20} MiB" if chunk >= 1 << 20 else f"{chunk >> 10} KiB"
    q = f"{qd} in flight each" if qd else "default queue depth"
    return f"{workers} worker{'s' if workers != 1 else ''} x {q} x {c}"


def pick_phoenix(points: list[dict]) -> dict | None:
    """The fastest point, or of those within :data:`CPU_TIE` of it the one with the least CPU."""
    if not points:
        return None
    top = max(p["gbps"] for p in points)
    near = [p for p in points if p["gbps"] >= top * (1 - CPU_TIE)]
    return min(near, key=lambda p: p["cpu_s_per_gb"])


def select_sweep(points: list[dict], threads: int, chunk: int) -> tuple[dict | None, dict | None]:
    """(the best point by GB/s, the point at phoenix's ``threads`` and ``chunk``) of a
    sweep's records; the first of equals is the best; None where absent."""
    best = None
    for p in points:
        if best is None or p["gbps"] > best["gbps"]:
            best = p
    at = next((p for p in points if p["threads"] == threads and p["chunk"] == chunk), None)
    return best, at


def config_text(threads: int, chunk: int, random: bool = False) -> str:
    c = f"{chunk >> 20} MiB" if chunk >= 1 << 20 else f"{chunk >> 10} KiB"
    return f"{threads} in flight x {c}" if random else f"{threads} thread{'s' if threads != 1 else ''} x {c}"


def sweep(b, op: str, progress) -> tuple[dict | None, tuple[int, int, int] | None]:
    """Sweep ``op`` (raw over :func:`sweep_grid`, phoenix over :func:`phoenix_grid`,
    interleaved per point): a ``raw_sweep`` / ``phoenix_sweep`` record per point. Returns
    (raw's best point with ``best_of`` and ``at_concurrency`` filled in, phoenix's pick
    (:func:`pick_phoenix`) as (workers, chunk, queue depth; 0: the default) or None)."""
    args = b.args
    size = args.size
    rand = op == "randread"
    nops = random_nops(args) if rand else 0
    b.prepare_rep = lambda: drop_cache(args.file)
    raw_grid, phx_grid = sweep_grid(args, op), phoenix_grid(args, op)
    raw_pts, phx_pts = [], []
    for i in range(max(len(raw_grid), len(phx_grid))):  # the two sweeps interleaved, point by point
        if i < len(raw_grid):
            t, c = raw_grid[i]
            what = config_text(t, c, rand)
            progress.step(f"sweep {op} raw O_DIRECT {what}")
            nbytes, secs, cpu, _ = b.timed(lambda t=t, c=c: b._raw(op == "write", rand, size, c, t, nops), 1)
            extra = {"iops": nops / secs} if rand else {}
            raw_pts.append(
                b.record(op, "raw_sweep", False, nbytes, secs, cpu, t, c, cache="cold", reps=1, config=what, **extra)
            )
        if i < len(phx_grid):
            w, q, c = phx_grid[i]
            what = phoenix_config_text(w, q, c)
            progress.step(f"sweep {op} phoenix {what}")
            b.prepare_phoenix(w, c, q)  # its worker pool and bounce pool, untimed
            if op == "write":
                fn = lambda w=w, c=c, q=q: b._phoenix_write(size, w, c, q)  # noqa: E731
            else:
                fn = lambda w=w, c=c, q=q: b._phoenix_read(size, w, c, q)  # noqa: E731
            nbytes, secs, cpu, _ = b.timed(fn, 1)
            phx_pts.append(
                b.record(
                    op,
                    "phoenix_sweep",
                    False,
                    nbytes,
                    secs,
                    cpu,
                    w,
                    c,
                    cache="cold",
                    reps=1,
                    config=what,
                    queue_depth=q,
                )
            )
    pbest = pick_phoenix(phx_pts)
    if pbest and not rand:
        # the raw reference then runs at phoenix's pick (its chunks in flight x its chunk): that
        # configuration is swept too, so that the sweep's best is never below the reference's
        q = pbest["queue_depth"]
        t, c = pbest["threads"] * q if q else pbest["threads"], pbest["chunk"]
        if (t, c) not in raw_grid:
            what = config_text(t, c)
            progress.total += 1
            progress.step(f"sweep {op} raw O_DIRECT {what} (phoenix's pick)")
            nbytes, secs, cpu, _ = b.timed(lambda t=t, c=c: b._raw(op == "write", False, size, c, t), 1)
            raw_pts.append(b.record(op, "raw_sweep", False, nbytes, secs, cpu, t, c, cache="cold", reps=1, config=what))
    best, _ = select_sweep(raw_pts, 0, 0)
    if best is not None:
        at = {}
        for t in [args.qd] if rand else args.threads:
            _, p = select_sweep(raw_pts, t, args.random_bs if rand else args.chunk)
            if p is not None:
                at[str(t)] = {"config": p["config"], "gbps": p["gbps"], **({"iops": p["iops"]} if rand else {})}
        best = dict(best, best_of=len(raw_pts), at_concurrency=at, sweep_gbps=best["gbps"])
    return best, ((pbest["threads"], pbest["chunk"], pbest["queue_depth"]) if pbest else None)
