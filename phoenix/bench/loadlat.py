"""``phx bench loadlat``: block-load latency, idle and with a write stream running (issue 21).

Benchmark side, control plane. A KV engine offloads new KV (writes) while other requests
wait for loads; a load stuck behind gigabytes of queued writes is time to first token
lost. This measures the latency of ``--block`` loads (random block-aligned offsets of
``--file``, into device memory, one at a time) three ways per implementation:

* ``idle``: nothing else running;
* ``background``: a stream of ``--write-size`` bytes of writes (``--write-chunk``
  requests, ``--write-depth`` in flight, from device memory to ``--write-file``) running
  the whole time, phoenix's marked ``priority="background"``;
* ``normal`` (phoenix only): the same stream without the priority (the control).

KvikIO (compat mode, where importable: the nvidia vendor) runs the same loads beside its
own pwrite futures. Each phase drops ``--file`` from the page cache first (cold loads);
p50 / p99 / max per phase, printed as a table and written to ``--json``.

``--file`` is only read: made with random data if absent, an existing one used as it is if
it holds ``--size`` bytes. ``--write-file`` is written: it must be absent (made, and removed
at the end unless ``--keep-write-file``) or one an earlier run kept; a file of the user's is
refused, never truncated (``files.py``). Both are locked for the run and checked, with the
device and the free space, before anything is made.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import socket
import sys
import threading
import time

from phoenix.cli._run import nonnegative_int, output_file, positive_int, positive_size, setting, vendor_runtime
from phoenix.vendor import CopyKind

from . import fastdev
from .args import check_device
from .files import BenchFiles, drop_cache, human, settings_env


class _Done:
    """A write in flight: ``wait()`` blocks until it is done (raises its error)."""

    __slots__ = ("wait",)

    def __init__(self, wait):
        self.wait = wait


class _Impl:
    """One implementation's loads and writes: ``load(off)`` blocks; ``write(off, n)``
    returns something whose ``wait()`` blocks until that write is done."""

    name = ""

    def load(self, off: int) -> int:
        raise NotImplementedError

    def write(self, off: int, n: int, priority: str):
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Phoenix(_Impl):
    name = "phoenix"

    def __init__(self, args, dst: int, src: int):
        import phoenix.io as pio
        import phoenix.settings

        self.args, self.dst, self.src = args, dst, src
        self._ov = phoenix.settings.override(threads=args.threads)
        self._ov.__enter__()
        pio.prepare()
        self.rf = pio.open(args.file, "r")
        self.wf = pio.open(args.write_file, "r+")  # the bench's own (claimed), written from offset 0

    def load(self, off):
        return self.rf.read((self.dst, self.args.block), self.args.block, off)

    def write(self, off, n, priority):
        return _Done(self.wf.pwrite((self.src, n), n, off, priority=priority).result)

    def close(self):
        self.rf.close()
        self.wf.close()
        self._ov.__exit__(None, None, None)


class _KvikIO(_Impl):
    name = "kvikio"

    def __init__(self, args, dst: int, src: int):
        import cupy
        import kvikio
        import kvikio.defaults

        def arr(ptr, n):
            mem = cupy.cuda.UnownedMemory(ptr, n, self)
            return cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

        self.args = args
        self.dst, self.src = arr(dst, args.block), arr(src, args.write_chunk)
        self._set = kvikio.defaults.set(
            {"num_threads": args.threads, "task_size": 16 << 20, "compat_mode": kvikio.CompatMode.ON}
        )
        self._set.__enter__()
        self.rf = kvikio.CuFile(args.file, "r")
        self.wf = kvikio.CuFile(args.write_file, "r+")

    def load(self, off):
        return self.rf.pread(self.dst, self.args.block, off).get()

    def write(self, off, n, priority):
        return _Done(self.wf.pwrite(self.src[:n], n, off).get)

    def close(self):
        self.rf.close()
        self.wf.close()
        self._set.__exit__(None, None, None)


class _Writer(threading.Thread):
    """``--write-size`` bytes of writes, ``--write-depth`` in flight, until done or stopped."""

    def __init__(self, impl: _Impl, args, priority: str):
        super().__init__(daemon=True)
        self.impl, self.args, self.priority = impl, args, priority
        self.stop = threading.Event()
        self.started_io = threading.Event()
        self.bytes = 0
        self.secs = 0.0
        self.error: BaseException | None = None

    def run(self):
        a = self.args
        pending: collections.deque = collections.deque()
        off, t0 = 0, time.perf_counter()
        try:
            while (off < a.write_size or pending) and not self.stop.is_set():
                while off < a.write_size and len(pending) < a.write_depth:
                    n = min(a.write_chunk, a.write_size - off)
                    pending.append((self.impl.write(off, n, self.priority), n))
                    off += n
                self.started_io.set()
                fut, n = pending.popleft()
                fut.wait()
                self.bytes += n
            for fut, n in pending:  # stopped: the rest completes (buffers stay in use until then)
                fut.wait()
                self.bytes += n
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.secs = time.perf_counter() - t0
            self.started_io.set()


def _pct(xs, q):
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _phase(impl: _Impl, args, writes: str, rng) -> dict:
    """One phase: ``--loads`` loads, with a write stream of priority ``writes`` (or none)."""
    drop_cache(args.file)
    nblocks = args.size // args.block
    writer = None
    if writes != "none":
        writer = _Writer(impl, args, writes)
        writer.start()
        writer.started_io.wait()
    lat = []
    try:
        for _ in range(args.loads):
            if writer is not None and not writer.is_alive():
                break  # the stream ended: the rest would be idle loads
            off = int(rng.integers(0, nblocks)) * args.block
            t = time.perf_counter()
            n = impl.load(off)
            lat.append(time.perf_counter() - t)
            if n != args.block:
                raise OSError(5, f"{impl.name}: a load at {off} returned {n} of {args.block} bytes")
    finally:
        if writer is not None:
            writer.stop.set()
            writer.join()
    if writer is not None and writer.error is not None:
        raise writer.error
    ms = [x * 1e3 for x in lat]
    rec = {
        "bench": "loadlat",
        "impl": impl.name,
        "writes": writes,
        "loads": len(ms),
        "block": args.block,
        "p50_ms": _pct(ms, 50),
        "p99_ms": _pct(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
        "lat_ms": ms,
        "threads": args.threads,
    }
    if writer is not None:
        rec.update(write_bytes=writer.bytes, write_gbps=writer.bytes / writer.secs / 1e9 if writer.secs else 0.0)
    return rec


def _check_first_block(rt, dst: int, args) -> None:
    """The bytes of a load of block 0 against the file (read with plain os.pread)."""
    import numpy as np

    host = np.empty(args.block, np.uint8)
    with open(args.file, "rb") as fh:
        want = np.frombuffer(os.pread(fh.fileno(), args.block, 0), np.uint8)
    rt.memcpy(host.ctypes.data, dst, args.block, CopyKind.DEVICE_TO_HOST)
    if not np.array_equal(host, want):
        raise OSError(5, "loadlat: the checked load does not hold the file's bytes")


def run(args, records: list[dict]) -> list[dict]:
    """The phases of every implementation, appended to ``records``; before anything is made:
    the options, the device (its ordinal, its memory for the buffers) and the files (claimed,
    locked, room for them)."""
    check_options(args)
    rt = vendor_runtime()
    check_device(rt, args.device, args.block + args.write_chunk, "--block + --write-chunk")
    with BenchFiles("phx bench loadlat") as files:
        files.claim(args.file, args.size, "--file")
        files.claim(
            args.write_file,
            args.write_size,
            "--write-file",
            write=True,
            fill=False,
            scratch=not args.keep_write_file,
            size_option="--write-size",
        )
        files.fill()
        return _run(args, records, rt)


def check_options(args) -> None:
    """Refuse, in one line naming them, options that contradict each other (nothing has run yet)."""
    if args.size < args.block:
        raise ValueError(f"--size {human(args.size)} is smaller than one --block ({human(args.block)}): lower --block")
    if args.write_chunk > args.write_size:
        raise ValueError(
            f"--write-chunk {human(args.write_chunk)} is larger than --write-size {human(args.write_size)}: "
            "give --write-chunk at most --write-size"
        )


def _run(args, records: list[dict], rt) -> list[dict]:
    import numpy as np

    from .throughput import have_kvikio

    kv_ok, kv_why = have_kvikio(rt.name)
    dst = rt.device_alloc(args.block, args.device)
    src = rt.device_alloc(args.write_chunk, args.device)
    meta = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "vendor": rt.name,
        "test_double": rt.name == "host",
        "file": args.file,
        "write_file": args.write_file,
        "write_size": args.write_size,
        "write_chunk": args.write_chunk,
        "write_depth": args.write_depth,
        "kvikio": kv_why,
        "argv": sys.argv,
        "env": settings_env(),
        **(
            {"storage": fastdev.LABEL, "fast_device": args.fast_device_info}
            if getattr(args, "fast_device_info", None)
            else {}
        ),
    }
    try:
        plans = [(_Phoenix, ("none", "background", "normal"))]
        if kv_ok:
            plans.append((_KvikIO, ("none", "with_writes")))
        for cls, phases in plans:
            try:
                impl = cls(args, dst, src)
            except Exception as exc:
                print(f"{cls.name} failed, left out: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            try:
                impl.load(0)  # warm-up: thread pools, pinned buffers
                _check_first_block(rt, dst, args)
                for writes in phases:
                    if not args.quiet:
                        print(f"{impl.name}: {args.loads} loads, writes {writes}", file=sys.stderr)
                    rng = np.random.default_rng(7)  # the same offsets for every phase
                    rec = _phase(impl, args, "normal" if writes == "with_writes" else writes, rng)
                    rec["writes"] = writes
                    rec["meta"] = meta
                    records.append(rec)
            finally:
                impl.close()
    finally:
        rt.device_free(dst)
        rt.device_free(src)
    return records


def table(records: list[dict]) -> str:
    lines = [
        f"{'impl':<8} {'writes':<11} {'loads':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'p99/idle':>8} {'write GB/s':>10}"
    ]
    idle = {r["impl"]: r["p99_ms"] for r in records if r["writes"] == "none"}
    for r in records:
        base = idle.get(r["impl"])
        ratio = f"{r['p99_ms'] / base:.2f}x" if base and r["writes"] != "none" else ""
        wg = f"{r['write_gbps']:.2f}" if "write_gbps" in r else ""
        lines.append(
            f"{r['impl']:<8} {r['writes']:<11} {r['loads']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
            f"{r['max_ms']:>9.2f} {ratio:>8} {wg:>10}"
        )
    return "\n".join(lines)


def add_parser(sub) -> None:
    """``phx bench loadlat``: called from phoenix.bench.cli.add_parser."""
    b = sub.add_parser(
        "loadlat",
        help="block-load latency (p50/p99), idle and with a background write stream (loads before offloads)",
        description="Latency of --block loads (random offsets, into device memory, one at a time), idle and while a "
        "--write-size stream of writes runs: phoenix's writes marked priority=background, the same without the "
        "priority, and KvikIO (compat) loads beside its own pwrite futures where importable.",
    )
    b.add_argument(
        "--file",
        default="/tmp/phx-loadlat.bin",
        help="file the loads read: made with random data if absent, else read as it is (never written)",
    )
    b.add_argument("--size", type=positive_size, default=4 << 30, help="bytes of --file the loads pick from (4G)")
    b.add_argument("--block", type=positive_size, default=32 << 20, help="bytes per load (default 32M)")
    b.add_argument(
        "--loads", type=positive_int, default=200, help="loads per phase (default 200: p99 is the third slowest)"
    )
    b.add_argument(
        "--write-file",
        default="/tmp/phx-loadlat-w.bin",
        help="file the write stream writes: made by the run (an existing file not the bench's is refused)",
    )
    b.add_argument("--write-size", type=positive_size, default=8 << 30, help="bytes of the write stream (8G)")
    b.add_argument("--write-chunk", type=positive_size, default=64 << 20, help="bytes per write request (64M)")
    b.add_argument("--write-depth", type=positive_int, default=16, help="write requests in flight (default 16)")
    b.add_argument(
        "--threads",
        type=setting("threads"),
        default=8,
        help="I/O threads, 1 to 1024 (phoenix workers, KvikIO's pool; default 8)",
    )
    b.add_argument(
        "--device", type=nonnegative_int, default=0, help="device ordinal (default 0; 'phx info' lists them)"
    )
    b.add_argument(
        "--keep-write-file",
        action="store_true",
        help="keep --write-file (removed at the end if this run made it; a kept one is the bench's, reused next time)",
    )
    b.add_argument("--json", type=output_file, metavar="OUT", help="also write the records as JSON")
    b.add_argument("--quiet", action="store_true", help="no progress lines")
    fastdev.add_argument(b, "--file and --write-file (their names kept, their directories replaced)")
    b.set_defaults(func=main)


def main(args) -> int:
    records: list[dict] = []
    try:
        need = args.size + args.write_size
        with fastdev.directory(args, need, quiet=args.quiet) as where:
            if where:
                args.file = os.path.join(where, os.path.basename(args.file))
                args.write_file = os.path.join(where, os.path.basename(args.write_file))
            run(args, records)
    finally:
        if records:
            print(table(records))
            if records[0]["meta"]["test_double"]:
                print("vendor host is a test double: 'device memory' is host memory; not accelerator figures.")
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(records, fh, indent=1)
                print(f"records written to {args.json}")
    return 0
