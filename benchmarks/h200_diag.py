"""Separating the two H200 misses of issue 4 (run 4): where random reads and the first warm
read lose their time. Run on the GPU machine with phoenix installed (benchmarks/h200.sh
setup), PHX_VENDOR=nvidia:

    python3 -P benchmarks/h200_diag.py rand --file /root/phx-bench.bin --json rand.json
    python3 -P benchmarks/h200_diag.py warm --file /dev/shm/phx-bench.bin --json warm.json

rand: 64 KiB random reads at 64 in flight, cold, each variant after a cache drop, the
variants interleaved (ABCABC; a phoenix variant's context is started and warmed untimed
before each of its runs, since a change of settings makes a new one): the raw O_DIRECT reference (C threads), phoenix read_many
into device memory with 16 io_uring workers x 4, 8 x 8 and 32 x 2, and with 64 workers of
the threads engine; read_many into host memory (the same I/O, no device copies); with
--batch also batch() (a Python tuple per read).

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
from phoenix import bench as pb
from phoenix.registry import get_runtime

GB = 1e9


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def stats_delta(before: dict) -> dict:
    now = pio.stats()
    keys = ("pool_waits", "copy_flushes", "cache_hit_bytes", "chunks_staged", "io_buffered", "io_direct", "fmap_hits",
            "fmap_misses")
    return {k: now[k] - before[k] for k in keys}


def timed(fn):
    s0, c0, t0 = pio.stats(), cpu_s(), time.perf_counter()
    n = fn()
    t1, c1 = time.perf_counter(), cpu_s()
    return n, t1 - t0, c1 - c0, stats_delta(s0)


def rand(a) -> list[dict]:
    rt = get_runtime()
    size = pb.parse_size(a.size)
    pb.prepare_file(a.file, size)
    bs, qd, nops = 64 << 10, 64, a.nops
    span = 4096 * bs  # 256 MiB of destination, reused round robin
    dev = rt.device_alloc(span)
    host = np.empty(span + 4096, np.uint8)
    host.fill(0x5A)  # touched: no first-touch faults in the timed reads
    hoff = (-host.ctypes.data) % 4096
    host_buf = (host.ctypes.data + hoff, span)
    rng = np.random.default_rng(42)
    offs = rng.integers(0, size // bs, nops) * bs
    bufo = (np.arange(nops) % 4096) * bs
    out = []

    def raw():
        return pb.raw_transfer(a.file, False, True, size, bs, qd, nops)

    def many(buf, workers, engine="auto"):
        cfg = dict(threads=workers, queue_depth=qd // workers, engine=engine)

        def go():
            with ps.override(**cfg), pio.open(a.file, "r") as f:
                r = f.read_many(buf, offs, bs, bufo)
            assert (r == bs).all()
            return int(r.sum())

        def start():  # untimed: a change of settings makes a new context (rings, streams, pool)
            with ps.override(**cfg), pio.open(a.file, "r") as f:
                pio.prepare()
                f.read_many(buf, offs[:qd * 4], bs, bufo[:qd * 4])
        go.start = start
        return go

    def per_request(workers):
        def go():
            with ps.override(threads=workers, queue_depth=qd // workers), pio.open(a.file, "r") as f:
                reqs = [(f, (dev + int(b), bs), bs, int(o), 0, "read") for o, b in zip(offs, bufo, strict=True)]
                r = pio.batch(reqs)
            assert all(x == bs for x in r)
            return nops * bs
        go.start = many((dev, span), workers).start
        return go

    variants = [("raw_odirect", raw), ("read_many_dev_16x4", many((dev, span), 16)),
                ("read_many_host_16x4", many(host_buf, 16)), ("read_many_dev_8x8", many((dev, span), 8)),
                ("read_many_dev_32x2", many((dev, span), 32)),
                ("read_many_dev_64_threads_engine", many((dev, span), 64, "threads"))]
    if a.batch:
        variants.append(("batch_dev_16x4", per_request(16)))
    for rep in range(a.reps):
        for name, fn in variants:
            if hasattr(fn, "start"):
                fn.start()
            pb.drop_cache(a.file)
            n, secs, cpu, st = timed(fn)
            rec = {"test": "rand", "variant": name, "rep": rep, "iops": nops / secs, "gbps": n / secs / GB,
                   "cpu_s": cpu, "cpu_cores": cpu / secs, "stats": st}
            out.append(rec)
            print(f"rand {name:22s} rep {rep}: {rec['iops']:9.0f} IOPS  {rec['cpu_cores']:.2f} cores  {st}", flush=True)
    rt.device_free(dev)
    return out


def cached_file(a):
    """The runtime, the file's size (made and read into the page cache) and a device
    buffer of that size."""
    rt = get_runtime()
    size = pb.parse_size(a.size)
    pb.prepare_file(a.file, size)
    pb.warm_cache(a.file, size)
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
                rec = {"test": "warm", "variant": label, "rep": rep, "threads": threads, "chunk": chunk,
                       "fmap_mode": fmap_mode, "gbps": n / secs / GB, "cpu_s_per_gb": cpu / (n / GB), "stats": st}
                out.append(rec)
                print(f"warm {label:24s} rep {rep}: {rec['gbps']:6.2f} GB/s  {rec['cpu_s_per_gb']:.3f} CPU s/GB  {st}",
                      flush=True)
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
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
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
            rec = {"test": "warmcfg", "variant": name, "rep": rep, "gbps": n / secs / GB, "cpu_s_per_gb": cpu / (n / GB),
                   "thread_cpu_s_per_gb": per, "stats": st}
            out.append(rec)
            print(f"warmcfg {name:24s} rep {rep}: {rec['gbps']:6.2f} GB/s  {rec['cpu_s_per_gb']:.3f} CPU s/GB "
                  f"pool_waits {st['pool_waits']:5d} chunks {st['chunks_staged']:5d}  by thread {per}", flush=True)

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

    peers = [("raw_buffered_16x16M", lambda: pb.raw_transfer(a.file, False, False, size, 16 * M, 16, 0, False))]
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
    for name, fn in peers:
        measure(name + "_after", fn)
    rt.device_free(dev)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["rand", "warm", "warmcfg"])
    p.add_argument("--file", required=True)
    p.add_argument("--size", default="8G")
    p.add_argument("--nops", type=int, default=60000)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--batch", action="store_true", help="rand: also batch() (a Python tuple per read)")
    p.add_argument("--json")
    a = p.parse_args()
    recs = {"rand": rand, "warm": warm, "warmcfg": warmcfg}[a.what](a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    pio.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
