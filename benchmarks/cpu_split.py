"""Where phoenix's CPU goes on a fast device (issue 21): per thread, per op, per setting.

Bench side, a diagnostic. On the GPU machine with phoenix installed (benchmarks/h200.sh
setup), PHX_VENDOR=nvidia, as root:

    python3 -P benchmarks/cpu_split.py --fast-device 5G --size 4G --json split.json

On a "loop device over RAM (stand-in for a fast NVMe array)" (phoenix.bench.fastdev), a
random file of --size is read cold into device memory and written back from it, once per
setting (workers:queue depth:chunk[:inflight]), after an untimed warm-up of that setting's
context; then random reads (--random size:workers:queue depth, one read_many call, at most
4 GiB). Each run reports GB/s, the process's CPU seconds per GB and how they split over
its threads (/proc/self/task: the caller, phoenix's workers "phx-io", the vendor runtime's
own threads, e.g. CUDA's callback thread), with the I/O stack's counters (chunks, ring
enters, copy flushes, bounce-slot waits) per chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.bench import fastdev
from phoenix.bench.files import drop_cache, prepare_file
from phoenix.bench.throughput import touch_device
from phoenix.registry import get_runtime
from phoenix.vendor import parse_size

TICK = os.sysconf("SC_CLK_TCK")
COUNTERS = ("chunks_staged", "uring_enters", "copy_flushes", "copy_events", "pool_waits", "bg_held", "io_fixed")


def threads_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        fields = st[st.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def group(tid: int, name: str) -> str:
    if tid == os.getpid():
        return "caller"
    if name.startswith("phx-"):
        return name
    return f"other:{name}"


def split(before: dict, after: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        if d > 0:
            key = group(tid, name)
            out[key] = out.get(key, 0.0) + d
    return out


def parse_point(text: str) -> dict:
    parts = text.split(":")
    w, q, c = int(parts[0]), int(parts[1]), parse_size(parts[2])
    s = {"threads": w, "chunk_size": c}
    if q:
        s["queue_depth"] = q
    if len(parts) > 3:
        s["inflight"] = parse_size(parts[3])
    return s


def _random(f, dev, size, bs, nops, seed) -> int:
    """nops bs-sized reads at random aligned offsets, one read_many call; bytes read."""
    import numpy as np

    slots = size // bs
    offs = np.random.default_rng(seed).integers(0, slots, nops) * bs
    got = f.read_many((dev, size), offs, bs, (np.arange(nops) % slots) * bs, check=False)
    if (got != bs).any():
        raise OSError(5, f"random reads: {(got != bs).sum()} of {nops} short")
    return nops * bs


def run_one(path, dev, size, op, settings, bs=0) -> dict:
    """One cold run of op (read, write, or randread of bs-sized reads) after a warm-up."""
    with ps.override(**settings, mode="staged"):
        pio.prepare()
        with pio.open(path, "r" if op != "write" else "r+") as f:  # warm-up, untimed
            if op == "randread":
                _random(f, dev, size, bs, 256, 1)
            else:
                f.read((dev, 64 << 20), 64 << 20, 0) if op == "read" else f.write((dev, 64 << 20), 64 << 20, 0)
        drop_cache(path)
        want = min(size, 4 << 30) // bs * bs if op == "randread" else size
        c0, t0, s0 = threads_cpu(), time.perf_counter(), pio.stats()
        with pio.open(path, "r" if op != "write" else "r+") as f:
            if op == "randread":
                n = _random(f, dev, size, bs, want // bs, 2)
            else:
                n = f.read((dev, size), size, 0) if op == "read" else f.write((dev, size), size, 0)
            if op == "write":
                f.fsync()
        secs = time.perf_counter() - t0
        c1, s1 = threads_cpu(), pio.stats()
        size = want
    if n != size:
        raise OSError(5, f"{op}: {n} of {size} bytes")
    by = split(c0, c1)
    gb = size / 1e9
    d = {k: s1[k] - s0[k] for k in COUNTERS}
    chunks = max(1, d["chunks_staged"])
    return {
        "op": op,
        "settings": settings,
        "gbps": gb / secs,
        "cpu_s_per_gb": sum(by.values()) / gb,
        "by_thread_s_per_gb": {k: v / gb for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
        "counters": d,
        "cpu_us_per_chunk": sum(by.values()) / chunks * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fastdev.add_argument(ap, "the file")
    ap.add_argument("--size", type=parse_size, default=4 << 30)
    ap.add_argument("--file", help="without --fast-device: the file to use")
    ap.add_argument(
        "--points",
        default="1:8:1M,1:16:1M,1:4:4M,2:2:4M,1:2:16M,16:0:8M",
        help="workers:queue depth (0: the setting's):chunk[:inflight] points (empty: none)",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--random",
        default="64K:8:8",
        help="random reads after the sequential points: size:workers:queue depth, comma-separated (read_many; empty: none)",
    )
    ap.add_argument(
        "--fixed-buffers",
        default="on",
        help="fixed_buffers settings to run each point with, alternating (on,off: registered buffers against not)",
    )
    ap.add_argument(
        "--copy-completion",
        default="auto",
        help="copy_completion settings to run each point with, alternating (auto,callback: polled events against callbacks; auto,steps: writes looked at at their predicted ends against doubled steps)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = [
        {"fixed_buffers": fb, "copy_completion": cc}
        for fb in args.fixed_buffers.split(",")
        for cc in args.copy_completion.split(",")
    ]
    rt = get_runtime()
    dev = rt.device_alloc(args.size, 0)
    touch_device(rt, dev, args.size)
    recs = []
    try:
        with fastdev.directory(args, args.size + (64 << 20)) as d:
            path = os.path.join(d, "split.bin") if d else args.file
            prepare_file(path, args.size)
            runs = [(p, op) for p in args.points.split(",") if p for op in ("read", "write")]
            for spec in filter(None, args.random.split(",")):
                bs, w, q = spec.split(":")
                runs.append((f"{w}:{q}:{bs}", "randread"))
            for rep in range(args.reps):
                for (p, op), var in ((run, var) for run in runs for var in variants):
                    pt = {**parse_point(p), **var}
                    bs = pt["chunk_size"] if op == "randread" else 0
                    r = run_one(path, dev, args.size, op, pt, bs)
                    r.update(rep=rep, point=p, storage=fastdev.LABEL if d else path)
                    recs.append(r)
                    top = ", ".join(f"{k} {v:.4f}" for k, v in list(r["by_thread_s_per_gb"].items())[:4])
                    c = r["counters"]
                    print(
                        f"{op:8s} {p:12s} {var['fixed_buffers']:>3s}/{var['copy_completion']:8s} {r['gbps']:5.2f} GB/s cpu {r['cpu_s_per_gb']:.4f} s/GB "
                        f"({r['cpu_us_per_chunk']:.0f} us/chunk; {top}) chunks {c['chunks_staged']} "
                        f"enters {c['uring_enters']} flushes {c['copy_flushes']} waits {c['pool_waits']} fixed {c['io_fixed']} events {c['copy_events']}",
                        flush=True,
                    )
    finally:
        rt.device_free(dev)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
