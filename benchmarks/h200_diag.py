"""Diagnostics on the H200 (issue 4's two misses): where random reads and the first warm
read lose their time. Run on the GPU machine with phoenix installed (benchmarks/h200.sh
setup), PHX_VENDOR=nvidia:

    python3 -P benchmarks/h200_diag.py rand --file /root/phx-bench.bin --json rand.json
    python3 -P benchmarks/h200_diag.py warm --file /dev/shm/phx-bench.bin --json warm.json
    python3 -P benchmarks/h200_diag.py rand --fast-device 9G --all --json rand-fastdev.json

(--fast-device SIZE: the file on a "loop device over RAM (stand-in for a fast NVMe array)",
set up and torn down as by phx bench --fast-device.)

rand: 64 KiB random reads at 64 in flight, cold, each variant after a cache drop, the
variants interleaved with the order rotated each repetition (a phoenix variant's context
is started and warmed untimed before each of its runs, since a change of settings makes a
new one): the raw O_DIRECT reference (C threads, fresh offsets each run, 2 MiB-page
buffers), phoenix read_many into device memory (8 x 8 with the same offsets every run and
with fresh ones, 16 x 4, 64 workers of the threads engine), and into host memory of 2 MiB
pages (io_uring 8 x 8, threads engine 64) and of 4 KiB pages: the same I/O without device
copies. Ends with each variant's geometric-mean ratio to the raw run of its repetition.

warm: reads of a file in tmpfs into device memory: the staged path alone (fmap off) with
16 MiB and 4 MiB chunks, twice each; then the default (fmap auto), twice from an empty
cache: the first read (staged, its windows registered afterwards) and the read after it
(from the registered mapping); every figure with the I/O stack's counters (bounce-slot waits,
completion callbacks, page-cache hits).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.bench import fastdev
from phoenix.bench import files as pbf
from phoenix.bench import raw as praw
from phoenix.registry import get_runtime
from phoenix.vendor import parse_size

GB = 1e9


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def stats_delta(before: dict) -> dict:
    now = pio.stats()
    keys = (
        "pool_waits",
        "copy_flushes",
        "cache_hit_bytes",
        "chunks_staged",
        "io_buffered",
        "io_direct",
        "fmap_hits",
        "fmap_misses",
    )
    return {k: now[k] - before[k] for k in keys}


class SlotSampler:
    """Samples the bounce pool's bytes in use every millisecond while a run is timed: the
    slots a staged random read holds (in flight plus awaiting their device copy) are the
    working set its O_DIRECT reads land in (on the H200 VM where they land costs the disk path)."""

    def __init__(self):
        import threading

        self.samples: list[int] = []
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.001):
            self.samples.append(pio.stats()["bounce_in_use"])

    def __enter__(self):
        self.th.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.th.join()

    def summary(self) -> dict:
        s = self.samples or [0]
        return {"slot_mib_max": round(max(s) / 2**20, 2), "slot_mib_mean": round(sum(s) / len(s) / 2**20, 2)}


def timed(fn):
    s0, c0, t0 = pio.stats(), cpu_s(), time.perf_counter()
    n = fn()
    t1, c1 = time.perf_counter(), cpu_s()
    return n, t1 - t0, c1 - c0, stats_delta(s0)


def huge_pages_kb() -> int:
    """AnonHugePages of this process (kB): whether the bounce pool got its 2 MiB pages."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def rand(a) -> list[dict]:
    """Which part of a staged random read costs IOPS against the raw reference: the same
    engine into host memory of 2 MiB pages (no device copies; the raw reference's buffers
    are such pages), into 4 KiB pages, into device memory; the same offsets every
    repetition (as an earlier phx bench did) or fresh ones (as the raw reference and phx bench now)."""
    rt = get_runtime()
    size = parse_size(a.size)
    pbf.prepare_file(a.file, size)
    bs, qd, nops = 64 << 10, 64, a.nops
    span = 4096 * bs  # 256 MiB of destination, reused round robin
    dev = rt.device_alloc(span)
    host = np.empty(span + 4096, np.uint8)
    host.fill(0x5A)  # touched: no first-touch faults in the timed reads
    hoff = (-host.ctypes.data) % 4096
    host_buf = (host.ctypes.data + hoff, span)
    import mmap

    huge = mmap.mmap(-1, span + (2 << 20))
    hbase = np.frombuffer(huge, np.uint8)
    hoff2 = (-hbase.ctypes.data) % (2 << 20)
    huge.madvise(mmap.MADV_HUGEPAGE, hoff2, span)
    hbase[hoff2 : hoff2 + span] = 0x5A
    huge_buf = (hbase.ctypes.data + hoff2, span)
    print(f"AnonHugePages after the host buffers: {huge_pages_kb()} kB", flush=True)
    bufo = (np.arange(nops) % 4096) * bs
    fixed = np.random.default_rng(42).integers(0, size // bs, nops) * bs
    fresh_rng = np.random.default_rng(7)
    out = []

    def raw():
        return praw.raw_transfer(a.file, False, True, size, bs, qd, nops)

    def raw_shared(span_bytes):
        """The raw reference with every read landing round robin in the first span_bytes
        of the 2 MiB-page host buffer (as read_many's destinations do) instead of each
        thread's own reused 64 KiB."""

        def go():
            return praw.raw_shared_transfer(a.file, size, bs, qd, nops, huge_buf[0], span_bytes)

        return go

    def many(buf, workers, engine="auto", fresh=False):
        cfg = dict(threads=workers, queue_depth=qd // workers, engine=engine)

        def go():
            offs = fresh_rng.integers(0, size // bs, nops) * bs if fresh else fixed
            with ps.override(**cfg), pio.open(a.file, "r") as f:
                r = f.read_many(buf, offs, bs, bufo)
            assert (r == bs).all()
            return int(r.sum())

        def start():  # untimed: a change of settings makes a new context (rings, streams, pool)
            with ps.override(**cfg), pio.open(a.file, "r") as f:
                pio.prepare()
                f.read_many(buf, fixed[: qd * 4], bs, bufo[: qd * 4])

        go.start = start
        return go

    variants = [
        ("raw_odirect", raw),
        ("raw_shared_8M", raw_shared(8 << 20)),
        ("raw_shared_256M", raw_shared(span)),
        ("dev_8x8_fresh", many((dev, span), 8, fresh=True)),
        ("dev_4x16_fresh", many((dev, span), 4, fresh=True)),  # phx bench randread's 4 workers x 16
        ("host2M_8x8_fresh", many(huge_buf, 8, fresh=True)),
        ("host2M_4x16_fresh", many(huge_buf, 4, fresh=True)),
        ("host2M_64thr_fresh", many(huge_buf, 64, "threads", fresh=True)),
    ]
    if a.all:  # the variants that explained no loss: fixed offsets, 16 x 4, 4 KiB pages, 64 threads
        variants += [
            ("dev_8x8_fixed", many((dev, span), 8)),
            ("dev_16x4_fresh", many((dev, span), 16, fresh=True)),
            ("host4K_8x8_fresh", many(host_buf, 8, fresh=True)),
            ("dev_64thr_fresh", many((dev, span), 64, "threads", fresh=True)),
        ]
    for rep in range(a.reps):
        k = rep % len(variants)
        for name, fn in variants[k:] + variants[:k]:
            if hasattr(fn, "start"):
                fn.start()
            pbf.drop_cache(a.file)
            t0 = thread_cpu()
            with SlotSampler() as slots:
                n, secs, cpu, st = timed(fn)
            t1 = thread_cpu()
            st.update(slots.summary())
            # by thread name: phx-io, CUDA's, the raw reference's (python3), and io_uring's own
            # iou-wrk (reads the kernel could not start without blocking, punted to a worker)
            by = {k: round(v - t0.get(k, 0.0), 2) for k, v in t1.items() if v - t0.get(k, 0.0) >= 0.01}
            rec = {
                "test": "rand",
                "variant": name,
                "rep": rep,
                "iops": nops / secs,
                "gbps": n / secs / GB,
                "cpu_s": cpu,
                "cpu_cores": cpu / secs,
                "stats": st,
                "anon_huge_kb": huge_pages_kb(),
                "thread_cpu_s": by,
            }
            out.append(rec)
            print(
                f"rand {name:20s} rep {rep}: {rec['iops']:7.0f} IOPS {rec['cpu_cores']:.2f} cores "
                f"huge {rec['anon_huge_kb'] >> 10} MiB slots max {st['slot_mib_max']} mean {st['slot_mib_mean']} MiB "
                f"pool_waits {st['pool_waits']} flushes {st['copy_flushes']} {by}",
                flush=True,
            )
    raw_by_rep = {r["rep"]: r["iops"] for r in out if r["variant"] == "raw_odirect"}
    for name, _ in variants[1:]:
        ratios = [r["iops"] / raw_by_rep[r["rep"]] for r in out if r["variant"] == name]
        gm = float(np.exp(np.mean(np.log(ratios))))
        print(f"rand {name:20s} vs raw: geomean {gm:.3f}x  per rep " + " ".join(f"{x:.3f}" for x in ratios), flush=True)
    rt.device_free(dev)
    return out


def cached_file(a):
    """The runtime, the file's size (made and read into the page cache) and a device
    buffer of that size."""
    rt = get_runtime()
    size = parse_size(a.size)
    pbf.prepare_file(a.file, size)
    pbf.warm_cache(a.file, size)
    return rt, size, rt.device_alloc(size)


def warm(a) -> list[dict]:
    rt, size, dev = cached_file(a)
    out = []

    def read(threads, chunk):
        def go():
            with ps.override(threads=threads, chunk_size=chunk), pio.open(a.file, "r") as f:
                return f.read((dev, size), size, 0, 0)

        return go

    def run(label, threads, chunk, reps, fmap_mode):
        with ps.override(fmap_mode=fmap_mode, threads=threads, chunk_size=chunk):
            pio.prepare()
            for rep in range(reps):
                n, secs, cpu, st = timed(read(threads, chunk))
                rec = {
                    "test": "warm",
                    "variant": label,
                    "rep": rep,
                    "threads": threads,
                    "chunk": chunk,
                    "fmap_mode": fmap_mode,
                    "gbps": n / secs / GB,
                    "cpu_s_per_gb": cpu / (n / GB),
                    "stats": st,
                }
                out.append(rec)
                print(
                    f"warm {label:24s} rep {rep}: {rec['gbps']:6.2f} GB/s  {rec['cpu_s_per_gb']:.3f} CPU s/GB  {st}",
                    flush=True,
                )
                if fmap_mode == "auto":
                    pio.fmap_wait(30)

    run("staged_16thr_16M", 16, 16 << 20, 2, "off")
    run("staged_16thr_4M", 16, 4 << 20, 2, "off")
    for rep in range(2):  # rep 0 of each: the first read (4 MiB chunks: the range is cached); rep 1: the mapping
        pio.fmap_clear()
        run(f"fmap_auto_16thr_16M_{rep}", 16, 16 << 20, 2, "auto")
    rt.device_free(dev)
    return out


def thread_cpu() -> dict:
    """CPU seconds of this process's threads so far, summed by thread name (phx-io: the
    I/O workers; phx-fmap: the registrar; CUDA's own threads; python: the caller)."""
    out: dict = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = st[st.index("(") + 1 : st.rindex(")")].rstrip("0123456789").rstrip("-")  # iou-wrk-123: iou-wrk
        fields = st[st.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def warmcfg(a) -> list[dict]:
    """Reads of a cached file into device memory: phoenix's first read (fmap auto, the
    registrations dropped before each) and its staged path under other settings, against
    KvikIO and raw buffered reads. Each phoenix setting is one group (pool started, pinned
    and warmed before its timed reads: a change of settings makes a new context), the
    peers measured before and after the groups."""
    rt, size, dev = cached_file(a)
    out = []
    M = 1 << 20

    def read():
        with pio.open(a.file, "r") as f:
            return f.read((dev, size), size, 0, 0)

    def kvik(threads, chunk):
        import cupy
        import kvikio
        import kvikio.defaults

        arr = cupy.ndarray((size,), cupy.uint8, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(dev, size, None), 0))

        def go():
            with kvikio.defaults.set({"num_threads": threads, "task_size": chunk, "compat_mode": kvikio.CompatMode.ON}):
                with kvikio.CuFile(a.file, "r") as f:
                    return f.pread(arr, size, 0).get()

        return go

    def measure(name, fn, before=None, after=None):
        for rep in range(a.reps):
            if before:
                before()
            t0 = thread_cpu()
            n, secs, cpu, st = timed(fn)
            t1 = thread_cpu()
            if after:
                after()
            per = {k: round((v - t0.get(k, 0.0)) / (n / GB), 3) for k, v in t1.items() if v - t0.get(k, 0.0) > 0.005}
            rec = {
                "test": "warmcfg",
                "variant": name,
                "rep": rep,
                "gbps": n / secs / GB,
                "cpu_s_per_gb": cpu / (n / GB),
                "thread_cpu_s_per_gb": per,
                "stats": st,
            }
            out.append(rec)
            print(
                f"warmcfg {name:24s} rep {rep}: {rec['gbps']:6.2f} GB/s  {rec['cpu_s_per_gb']:.3f} CPU s/GB "
                f"pool_waits {st['pool_waits']:5d} chunks {st['chunks_staged']:5d}  by thread {per}",
                flush=True,
            )

    def phoenix(name, first, **kw):
        with ps.override(**kw):
            pio.prepare()
            read()  # warm-up: workers, streams, pool pinned
            pio.fmap_wait(30)
            if first:
                measure(name, read, before=pio.fmap_clear, after=lambda: pio.fmap_wait(30))
            else:
                measure(name, read)
            pio.fmap_clear()

    peers = [("raw_buffered_16x16M", lambda: praw.raw_transfer(a.file, False, False, size, 16 * M, 16, 0, False))]
    try:
        k = kvik(16, 16 * M)
        k()  # warm-up: its thread pool and bounce buffers
        peers.append(("kvikio_16x16M", k))
    except ImportError as exc:
        print(f"kvikio left out: {exc}", flush=True)
    for name, fn in peers:
        measure(name, fn)
    phoenix("ph_first_16w_16M", True, threads=16, chunk_size=16 * M, fmap_mode="auto")
    phoenix("ph_first_8w_16M", True, threads=8, chunk_size=16 * M, fmap_mode="auto")
    phoenix("ph_staged_16w_16M", False, threads=16, chunk_size=16 * M, fmap_mode="off")
    phoenix("ph_staged_16w_4M_pool256M", False, threads=16, chunk_size=4 * M, bounce_pool_size=256 * M, fmap_mode="off")
    phoenix("ph_repeat_16w_16M", False, threads=16, chunk_size=16 * M, fmap_mode="auto")  # from the mapping

    def register_then_clear():
        """What a first read (fmap auto) follows: the file's windows registered, then all
        dropped (host_unregister, munmap), as fmap_clear does before each ph_first read."""
        with ps.override(threads=16, chunk_size=16 * M, fmap_mode="auto"):
            read()
            pio.fmap_wait(30)
        pio.fmap_clear()

    # KvikIO after the same unregistration: does what ph_first follows slow every reader of
    # that page cache? (No phoenix staged variant here: registering needs fmap auto, another
    # setting, hence another context whose start would be timed, not the staged path.)
    for name, fn in peers[1:]:
        measure(name + "_after_clear", fn, before=register_then_clear)
    for name, fn in peers:
        measure(name + "_after", fn)
    rt.device_free(dev)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["rand", "warm", "warmcfg"])
    p.add_argument("--file", help="the file (with --fast-device: its name there)")
    fastdev.add_argument(p, "the file")
    p.add_argument("--size", default="8G")
    p.add_argument("--nops", type=int, default=60000)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--all",
        action="store_true",
        help="rand: also the other variants (fixed offsets, 16 x 4, 4 KiB host pages, 64 threads into device memory)",
    )
    p.add_argument("--json")
    a = p.parse_args()
    if not a.file and not a.fast_device:
        p.error("--file or --fast-device is needed")
    with fastdev.directory(a, parse_size(a.size) + (64 << 20)) as d:
        if d:  # the "loop device over RAM (stand-in for a fast NVMe array)", torn down on exit
            a.file = os.path.join(d, os.path.basename(a.file or "phx-bench.bin"))
            print(f"storage: {fastdev.LABEL}: {a.file}", flush=True)
        recs = {"rand": rand, "warm": warm, "warmcfg": warmcfg}[a.what](a)
        for r in recs:
            r["storage"] = fastdev.LABEL if d else a.file
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    pio.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
