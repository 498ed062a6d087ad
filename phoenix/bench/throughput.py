"""``phx bench``: file <-> device-memory throughput, beside raw O_DIRECT and the peers.

Benchmark side (control plane). Every phoenix figure is printed beside figures
measured in the same run, at the same concurrency, on the same file:

* ``raw_odirect``: raw O_DIRECT pread/pwrite of the file into host memory, in C
  (``raw.py``), at phoenix's threads x chunk: one configuration of the device, not its
  limit (``--raw-sweep`` searches for the fastest and divides by it); buffered
  (``raw_buffered``) for warm figures.
* ``naive``: pread a chunk into pinned host memory, synchronous copy to the device (C too).
* ``kvikio``: KvikIO (compat mode) where it is importable and the vendor is nvidia.
* ``h2d_pinned``: pinned host -> device copy (the bus limit; meaningful on GPUs).

Cold figures release phoenix's registered page-cache windows first (``fmap_wait`` then
``fmap_clear``, before every drop from the page cache: pinned pages cannot be dropped), so
they are the disk's; ``PHX_FMAP_MODE=off`` turns the window cache off altogether.

Writes are timed with their sync (phoenix and KvikIO fsync, the raw reference fdatasync);
a write-back cache below the file system (a disk's, a VM host's) may still take them
faster than the device sustains: a write above the run's cold reads is flagged.

The file is the bench's own or only read (``files.py``): an existing file the bench did not
make is never written, and one smaller than ``--size`` is refused; the options are checked
against each other, the vendor's devices and the free space before anything is made.

CPU seconds per GB (user + system of the whole process, all threads) stand beside
every figure. Records go to ``--json`` (a list of dicts: op, impl, vendor, warm,
gbps, cpu_s_per_gb, threads, chunk, size, ...) and a PNG to ``--plot``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import errno
import os
import platform
import resource
import socket
import statistics
import sys
import time

from phoenix.cli._run import vendor_runtime
from phoenix.vendor import CopyKind

from . import throughput_cli
from .args import check_device
from .files import BenchFiles, drop_cache, settings_env, warm_cache
from .raw import naive_transfer, raw_transfer
from .report import FONT, IMPLS, legend, plain_log_axis, plot, report, table  # noqa: F401 (re-exported)
from .sweep import phoenix_config_text, phoenix_grid, random_nops, sweep, sweep_grid
from .throughput_cli import OPS, TEMPERATURES  # noqa: F401 (re-exported)

GB = 1e9


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Progress:
    """One status line on stderr: [k/n] what is being measured."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.k, self.quiet = total, 0, quiet
        self.tty = sys.stderr.isatty()

    def step(self, what: str):
        self.k += 1
        if self.quiet:
            return
        bar_len = 24
        filled = int(bar_len * self.k / max(self.total, 1))
        line = f"[{'#' * filled}{'.' * (bar_len - filled)}] {self.k}/{self.total} {what}"
        sys.stderr.write(("\r\033[K" if self.tty else "") + line + ("" if self.tty else "\n"))
        sys.stderr.flush()

    def done(self):
        if self.tty and not self.quiet:
            sys.stderr.write("\r\033[K")


def _phx_settings(threads: int, chunk: int, qd: int = 0) -> dict:
    """Phoenix's settings for a bench point (qd 0: the queue depth setting as it is)."""
    return {"threads": threads, "chunk_size": chunk, **({"queue_depth": qd} if qd else {})}


def touch_device(rt, dev: int, size: int) -> None:
    """Write a whole device buffer once before anything is timed, so that no implementation
    pays for first-touch faults (the host test double commits its arena lazily) or
    first-use mapping of device pages on behalf of the others."""
    n = min(size, 64 << 20)
    host = rt.host_alloc_pinned(n)
    try:
        ctypes.memset(host, 0x5A, n)
        for off in range(0, size, n):
            rt.memcpy(dev + off, host, min(n, size - off), CopyKind.HOST_TO_DEVICE)
    finally:
        rt.host_free_pinned(host)


class Bench:
    def __init__(self, args, records: list[dict] | None = None, rt=None):
        import phoenix
        import phoenix.io as pio
        import phoenix.settings

        self.args = args
        self.phoenix = phoenix
        self.pio = pio
        phoenix.settings.get()  # a bad PHX_* setting is refused before anything is written or measured
        self.rt = rt or vendor_runtime()
        self.vendor = self.rt.name
        self.records: list[dict] = records if records is not None else []
        self.device = args.device
        self.dev = self.rt.device_alloc(args.size, args.device)
        self.dp = self.rt.data_path()
        touch_device(self.rt, self.dev, self.args.size)

    def settle(self):
        """Let background work of a first read finish (page-cache mapping registrations),
        as it does between two agent rounds; not timed."""
        wait = getattr(self.phoenix.io, "fmap_wait", None)
        if wait is not None:
            wait()

    def prepare_phoenix(self, threads: int, chunk: int, qd: int = 0) -> None:
        """Phoenix's worker pool (threads, rings, streams) for these settings, made and its
        whole bounce pool pinned before timing, as an application does at start; kept
        until the settings change."""
        with self.phoenix.settings.override(**_phx_settings(threads, chunk, qd)):
            self.pio.prepare()

    def close(self):
        if self.dev:
            self.rt.device_free(self.dev)
            self.dev = 0

    # -- one measurement ---------------------------------------------------------

    def record(self, op, impl, warm, nbytes, secs, cpu, threads, chunk, **extra):
        rec = {
            "op": op,
            "impl": impl,
            "vendor": self.vendor,
            "warm": warm,
            "gbps": nbytes / secs / GB if secs > 0 else 0.0,
            "cpu_s_per_gb": cpu / (nbytes / GB) if nbytes else 0.0,
            "threads": threads,
            "chunk": chunk,
            "size": nbytes,
            "seconds": secs,
            "test_double": bool(self.rt.is_test_double),
        }
        fast = getattr(self.args, "fast_device_info", None)
        if fast:  # every figure taken on the stand-in says so
            rec["storage"] = fast["label"]
            rec["fast_device"] = fast
        rec.update(extra)
        self.records.append(rec)
        return rec

    def timed(self, fn, reps):
        """Run fn() reps times; return (bytes, median seconds, median cpu seconds, all)."""
        runs = []
        for _ in range(reps):
            if self.prepare_rep:
                self.prepare_rep()
            c0, t0 = _cpu(), time.perf_counter()
            nbytes = fn()
            t1, c1 = time.perf_counter(), _cpu()
            runs.append((nbytes, t1 - t0, c1 - c0))
        secs = statistics.median(r[1] for r in runs)
        cpu = statistics.median(r[2] for r in runs)
        return runs[0][0], secs, cpu, runs

    prepare_rep = None
    random_seed = 41  # the last seed _phoenix_random drew its offsets with

    def interleaved(self, impls, reps, progress, label):
        """Repetitions interleaved across implementations, each repetition starting one
        further along (ABC BCA CAB ...), so that drift of a shared disk, rising or falling,
        hits every implementation alike and none is always first after another's run:
        {impl: (bytes, median seconds, median CPU seconds, [seconds of each repetition])}.
        ``label`` has a {} for the impl."""
        runs: dict = {impl: [] for impl, _ in impls}
        for rep in range(reps):
            k = rep % len(impls)
            for impl, fn in impls[k:] + impls[:k]:
                progress.step(f"{label.format(impl)} rep {rep + 1}/{reps}")
                runs[impl].append(self.timed(fn, 1)[3][0])
        return {
            impl: (
                rs[0][0],
                statistics.median(r[1] for r in rs),
                statistics.median(r[2] for r in rs),
                [round(r[1], 4) for r in rs],
            )
            for impl, rs in runs.items()
        }

    def _raw(self, op_write, random, size, chunk, threads, nops=0, odirect=True):
        return raw_transfer(self.args.file, op_write, random, size, chunk, threads, nops, odirect)

    def _naive(self, random, size, chunk, threads, nops=0, odirect=True):
        return naive_transfer(
            self.dp, self.device, self.dev, self.args.file, random, size, chunk, threads, nops, odirect
        )

    def _phoenix_read(self, size, threads, chunk, qd=0):
        with self.phoenix.settings.override(**_phx_settings(threads, chunk, qd)):
            with self.phoenix.open(self.args.file, "r") as f:
                return f.read((self.dev, size), size, 0, 0)

    def _phoenix_write(self, size, threads, chunk, qd=0):
        with self.phoenix.settings.override(**_phx_settings(threads, chunk, qd)):
            with self.phoenix.open(self.args.file, "r+", sync=False) as f:
                n = f.write((self.dev, size), size, 0, 0)
                f.fsync()
                return n

    def _random_offsets(self, size, bs, nops):
        """nops bs-aligned file offsets at random (a fresh seed each call: 42, 43, ...) and
        the buffer offsets they land at (in order, wrapping at size)."""
        import numpy as np

        slots = size // bs
        self.random_seed += 1
        offs = np.random.default_rng(self.random_seed).integers(0, slots, nops) * bs
        return offs, (np.arange(nops) % slots) * bs

    def _phoenix_random(self, size, bs, qd, nops, per_request=False):
        """nops random bs-sized reads into device memory, qd in flight in all (as the raw
        reference: qd threads, one each): ``random_threads`` workers with qd / workers each.
        One read_many call (the offsets built by NumPy, no Python per read); with
        ``per_request``, a batch() of nops Python request tuples instead. Every call reads
        other offsets (seeds 42, 43, ...), as the raw reference's threads draw theirs afresh,
        so that no run meets blocks a previous one left in a cache below the guest's."""
        import numpy as np

        offs, bufo = self._random_offsets(size, bs, nops)
        t = max(1, min(qd, getattr(self.args, "random_threads", 8)))
        with self.phoenix.settings.override(threads=t, queue_depth=max(1, -(-qd // t))):
            with self.phoenix.open(self.args.file, "r") as f:
                if per_request:
                    reqs = [
                        (f, (self.dev + int(b), bs), bs, int(o), 0, "read") for o, b in zip(offs, bufo, strict=True)
                    ]
                    results = np.array([r if isinstance(r, int) else -1 for r in self.phoenix.batch(reqs)])
                else:
                    results = f.read_many((self.dev, size), offs, bs, bufo, check=False)
        bad = np.flatnonzero(results != bs)
        if bad.size:
            raise OSError(5, f"phoenix random read: {bad.size} requests short or failed: {results[bad[:3]].tolist()}")
        return nops * bs

    def _kvikio(self, op, size, threads, chunk):
        import cupy  # noqa: F401  (kvikio needs a CUDA array)
        import kvikio
        import kvikio.defaults

        arr = self._kvikio_array(size)
        with kvikio.defaults.set({"num_threads": threads, "task_size": chunk, "compat_mode": kvikio.CompatMode.ON}):
            with kvikio.CuFile(self.args.file, "r" if op == "read" else "r+") as f:
                if op == "read":
                    return f.pread(arr, size, 0).get()
                n = f.pwrite(arr, size, 0).get()
            fd = os.open(self.args.file, os.O_RDONLY)
            try:  # timed with its sync, as phoenix's write and the raw reference's are
                os.fsync(fd)
            finally:
                os.close(fd)
            return n

    def _kvikio_random(self, size, bs, qd, nops):
        """KvikIO's random reads as a user writes them: one ``CuFile.pread`` future per
        bs-sized read into its place in device memory, qd threads (qd in flight), the
        same offsets' distribution as phoenix's (fresh ones each call), then every future
        waited for."""
        import kvikio
        import kvikio.defaults

        arr = self._kvikio_array(size)
        offs, bufo = self._random_offsets(size, bs, nops)
        with kvikio.defaults.set({"num_threads": qd, "task_size": bs, "compat_mode": kvikio.CompatMode.ON}):
            with kvikio.CuFile(self.args.file, "r") as f:
                futs = [f.pread(arr[b : b + bs], bs, int(o)) for o, b in zip(offs.tolist(), bufo.tolist(), strict=True)]
                got = [fu.get() for fu in futs]
        short = sum(1 for g in got if g != bs)
        if short:
            raise OSError(5, f"kvikio random read: {short} requests short")
        return nops * bs

    def _kvikio_array(self, size):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.dev, size, self)
        return cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def _h2d_pinned(self, size):
        chunk = min(size, 1 << 30)
        host = self.rt.host_alloc_pinned(chunk)
        try:
            stream = self.rt.stream_create(self.device)
            try:

                def run():
                    off = 0
                    while off < size:
                        n = min(chunk, size - off)
                        self.rt.memcpy_async(self.dev + off, host, n, CopyKind.HOST_TO_DEVICE, stream)
                        off += n
                    self.rt.stream_synchronize(stream)
                    return size

                run()  # warm-up
                return self.timed(run, self.args.reps)
            finally:
                self.rt.stream_destroy(stream)
        finally:
            self.rt.host_free_pinned(host)


def have_kvikio(vendor: str) -> tuple[bool, str]:
    """Whether KvikIO runs beside phoenix: on the nvidia vendor where it imports, or a
    module that says it is a test double (``kvikio.IS_TEST_DOUBLE``; its records say so)."""
    try:
        import kvikio

        if getattr(kvikio, "IS_TEST_DOUBLE", False):
            return True, "TEST DOUBLE of KvikIO (not KvikIO: tests only)"
        if vendor != "nvidia":
            return False, "KvikIO needs the nvidia vendor"
        return True, "importable"
    except Exception as exc:
        return False, f"not importable ({type(exc).__name__})"


def sequential_plan(args) -> list[tuple[str, str, int]]:
    """The (cache, op, threads) points of the sequential bench, in the order they run (no
    warm writes: a write goes to the page cache either way). With ``--phoenix-sweep`` a
    cold op is one point: phoenix at its best configuration of the sweep."""
    temps = [t for t in TEMPERATURES if t in args.temperature]
    plan = []
    for temp in temps:
        for op in ("read", "write"):
            if op not in args.ops or (op == "write" and temp == "warm"):
                continue
            one = temp == "cold" and phoenix_grid(args, op)
            plan += [(temp, op, t) for t in (args.threads[:1] if one else args.threads)]
    return plan


def planned_steps(args, plan, kvikio: bool, vendor: str) -> int:
    """How many progress steps :func:`run` takes: per point, a warm-up run of each
    implementation where one is taken (warm reads: all; cold: KvikIO's) and ``reps``
    interleaved runs of each (cold ops after a sweep: raw's best too); random reads: a
    warm-up and ``reps`` runs of three implementations (one more with KvikIO, one more after
    a sweep) per block size;
    the sweeps' points; the pinned copy on a real accelerator."""
    steps = 0
    for temp, op, _ in plan:
        n = (3 if op == "read" else 2) + kvikio + bool(temp == "cold" and sweep_grid(args, op))
        steps += (n if temp == "warm" else int(kvikio)) + n * args.reps
    if "randread" in args.ops:
        for bs in random_sizes(args):
            a = _with_bs(args, bs)
            steps += 1 + (3 + kvikio + bool(sweep_grid(a, "randread"))) * args.reps + len(sweep_grid(a, "randread"))
    steps += sum(len(sweep_grid(args, op)) + len(phoenix_grid(args, op)) for op in ("read", "write"))
    return steps + (vendor != "host")


def random_sizes(args) -> list[int]:
    bs = args.random_bs
    return list(bs) if isinstance(bs, (list, tuple)) else [bs]


def _with_bs(args, bs: int):
    a = argparse.Namespace(**vars(args))
    a.random_bs = bs
    return a


def _writable(path: str, exc: OSError) -> OSError:
    """A refused write of the bench file, said as what to do about it."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionError(
            exc.errno,
            f"--file {path} is read-only ({os.strerror(exc.errno)}): the write figures "
            "need a writable file; pass --ops read (or read,randread), or a --file you may write",
        )
    return exc


def _best_record(b, best: dict, nbytes, secs, cpu, runs_s, **extra) -> dict:
    """raw's best point of the sweep, re-measured: the reference its op's ratios divide by
    (``sweep_gbps``: the single sweep run that picked it)."""
    rec = b.record(
        best["op"],
        "raw_best",
        False,
        nbytes,
        secs,
        cpu,
        best["threads"],
        best["chunk"],
        cache="cold",
        reps=len(runs_s),
        runs_s=runs_s,
        config=best["config"],
        best_of=best["best_of"],
        sweep_gbps=best["sweep_gbps"],
        at_concurrency=best["at_concurrency"],
        **extra,
    )
    return rec


def _random(b, args, progress, kvikio: bool = False) -> None:
    """Random reads of ``args.random_bs`` at ``args.qd`` in flight: raw, phoenix (read_many
    and batch), KvikIO (a pread future per read) where importable, and raw at its best
    in-flight count where a sweep ran."""
    size = args.size
    saved, b.args = b.args, args
    try:
        raw_best, _ = sweep(b, "randread", progress)
        bs, qd = args.random_bs, args.qd
        nops = random_nops(args)
        b.prepare_rep = lambda: drop_cache(args.file)
        workers = max(1, min(qd, args.random_threads))
        rimpls = [
            ("raw_odirect", lambda: b._raw(False, True, size, bs, qd, nops)),
            ("phoenix", lambda: b._phoenix_random(size, bs, qd, nops)),
            ("phoenix_batch", lambda: b._phoenix_random(size, bs, qd, nops, per_request=True)),
        ]
        if raw_best:
            bq = raw_best["threads"]
            rimpls.insert(0, ("raw_best", lambda: b._raw(False, True, size, bs, bq, nops)))
        if kvikio:
            try:  # warm-up (its thread pool), untimed; a peer that fails is left out
                b._kvikio_random(size, bs, qd, qd * 4)
                rimpls.append(("kvikio", lambda: b._kvikio_random(size, bs, qd, nops)))
            except Exception as exc:
                print(f"kvikio random reads failed, left out: {type(exc).__name__}: {exc}", file=sys.stderr)
        extra = {
            "phoenix": {"workers": workers, "api": "read_many"},
            "phoenix_batch": {"workers": workers, "api": "batch"},
        }
        # warm-up, untimed, as KvikIO's: these settings make a context of their own
        # (rings, streams, the pinned bounce pool), built once per process
        progress.step(f"random read {bs >> 10} KiB phoenix qd={qd}: first run (warm-up)")
        b._phoenix_random(size, bs, qd, qd * 4)
        measured = b.interleaved(rimpls, args.reps, progress, f"random read {bs >> 10} KiB {{}} qd={qd}")
        for impl, (nbytes, secs, cpu, runs_s) in measured.items():
            if impl == "raw_best":
                _best_record(b, raw_best, nbytes, secs, cpu, runs_s, iops=nops / secs)
                continue
            b.record(
                "randread",
                impl,
                False,
                nbytes,
                secs,
                cpu,
                qd,
                bs,
                iops=nops / secs,
                reps=len(runs_s),
                runs_s=runs_s,
                **extra.get(impl, {}),
            )
    finally:
        b.args = saved


#: how a run that may not write its --file measures it as it is
READ_ONLY_HINT = "pass --ops read (or read,randread)"


def run(args, records: list[dict] | None = None) -> list[dict]:
    """Every measurement of ``args``, appended to ``records`` as it is taken (so that the
    caller keeps what was measured when a later one fails). Before anything is made or
    measured: the settings, the device (its ordinal, its memory for --size) and the file
    (claimed: the bench's own, or one of the user's only read; locked; room for it)."""
    import phoenix.settings

    phoenix.settings.get()  # a bad PHX_* setting is refused before anything is written or measured
    rt = vendor_runtime()
    check_device(rt, args.device, args.size)
    with BenchFiles() as files:
        files.claim(
            args.file,
            args.size,
            "--file",
            write="write" in args.ops,
            made=bool(getattr(args, "file_made", False)),
            read_hint=READ_ONLY_HINT,
        )
        return _run(args, records, rt, files)


def _run(args, records, rt, files: BenchFiles) -> list[dict]:
    size = args.size
    chunk = args.chunk
    b = Bench(args, records, rt)
    progress = Progress(0, args.quiet)
    kv_ok, kv_why = have_kvikio(b.vendor)
    ops = args.ops
    plan = sequential_plan(args)
    progress.total = planned_steps(args, plan, kv_ok, b.vendor)
    try:
        files.fill()
        best: dict = {}  # op -> (raw's best point, phoenix's best (threads, chunk))
        for temp, op, threads in plan:
            warm = temp == "warm"
            c = chunk
            if not warm and op not in best:
                best[op] = sweep(b, op, progress)
            raw_best, phx_best = best.get(op, (None, None)) if not warm else (None, None)
            q = 0
            pt = threads  # the peers' threads: phoenix's chunks in flight (workers x queue depth)
            if phx_best:
                threads, c, q = phx_best
                pt = threads * q if q else threads
            b.prepare_rep = (lambda: warm_cache(args.file, size)) if warm else (lambda: drop_cache(args.file))
            impls = []
            if raw_best:  # raw at its best configuration, re-measured beside the others
                bt, bc = raw_best["threads"], raw_best["chunk"]
                impls.append(("raw_best", lambda bt=bt, bc=bc, o=op: b._raw(o == "write", False, size, bc, bt)))
            if op == "read":
                impls.append(
                    (
                        "raw_odirect" if not warm else "raw_buffered",
                        lambda t=pt, w=warm, c=c: b._raw(False, False, size, c, t, odirect=not w),
                    )
                )
                impls.append(("naive", lambda t=pt, w=warm, c=c: b._naive(False, size, c, t, odirect=not w)))
                impls.append(("phoenix", lambda t=threads, c=c, q=q: b._phoenix_read(size, t, c, q)))
            else:
                impls.append(("raw_odirect", lambda t=pt, c=c: b._raw(True, False, size, c, t)))
                impls.append(("phoenix", lambda t=threads, c=c, q=q: b._phoenix_write(size, t, c, q)))
            if kv_ok:
                impls.append(("kvikio", lambda t=pt, o=op, c=c: b._kvikio(o, size, t, min(c, 16 << 20))))
            # untimed warm-up of each library's machinery (thread pools, pinned bounce buffers),
            # the same amount for each: two chunks per thread, as much as a pool holds
            warm_n = min(size, 2 * pt * c)
            if kv_ok:
                try:  # a peer that fails must not stop phoenix's own figures
                    b._kvikio(op, warm_n, pt, min(c, 16 << 20))
                except Exception as exc:
                    print(f"kvikio failed, left out: {type(exc).__name__}: {exc}", file=sys.stderr)
                    impls.pop()
                    progress.total -= 1 + args.reps  # its warm-up and repetitions are not run
            b.prepare_phoenix(threads, c, q)
            b._phoenix_read(warm_n, threads, c, q)
            b.settle()  # (its page-cache registration, if any, must not overlap a timed read)
            for impl, fn in impls:
                if warm or impl == "kvikio":
                    # warm-up: thread pools, pinned buffers, registrations. For warm reads the
                    # first read is a figure of its own (a KV tier's first hit), kept as first=True
                    progress.step(f"{temp} {op} {impl} threads={threads}: first run (warm-up)")
                    nbytes, secs, cpu, _ = b.timed(fn, 1)
                    if warm and impl in ("phoenix", "kvikio"):
                        b.record(op, impl, warm, nbytes, secs, cpu, threads, c, cache=temp, reps=1, first=True)
                    if impl == "phoenix":
                        b.settle()
            try:
                measured = b.interleaved(impls, args.reps, progress, f"{temp} {op} {{}} threads={threads}")
            except OSError as exc:
                raise (_writable(args.file, exc) if op == "write" else exc) from exc
            for impl, (nbytes, secs, cpu, runs_s) in measured.items():
                if impl == "raw_best":
                    _best_record(b, raw_best, nbytes, secs, cpu, runs_s)
                    continue
                extra = {}
                if phx_best and impl == "phoenix":
                    extra = {
                        "config": phoenix_config_text(threads, q, c),
                        "best_of_sweep": True,
                        "queue_depth": q,
                        "workers": threads,
                    }
                b.record(op, impl, warm, nbytes, secs, cpu, pt, c, cache=temp, reps=len(runs_s), runs_s=runs_s, **extra)
        if "randread" in ops:
            for bs in random_sizes(args):
                _random(b, _with_bs(args, bs), progress, kv_ok)
        if b.vendor != "host":
            progress.step("pinned host -> device copy")
            b.prepare_rep = None
            nbytes, secs, cpu, _ = b._h2d_pinned(size)
            b.record("read", "h2d_pinned", True, nbytes, secs, cpu, 1, min(size, 1 << 30))
    finally:
        progress.done()
        b.close()
        meta = {
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "file": args.file,
            "kvikio": kv_why,
            "argv": sys.argv,
            "env": settings_env(),
            **({"fast_device": args.fast_device_info} if getattr(args, "fast_device_info", None) else {}),
        }  # argv: the command that made the record
        for r in b.records:  # in `finally`: the records of a run a later failure stopped carry it too
            r.setdefault("meta", meta)
    return b.records


def add_parser(sub):
    """``phx bench``'s own parser (``throughput_cli.py``); phoenix.bench.cli hangs the others below it."""
    return throughput_cli.add_parser(sub, main)


def main(args) -> int:
    records: list[dict] = []
    fast = getattr(args, "fast_device", None)
    if getattr(args, "raw_sweep", None) is None:
        args.raw_sweep = bool(fast)
    if getattr(args, "phoenix_sweep", None) is None:
        args.phoenix_sweep = bool(fast)
    throughput_cli.check_options(args)
    try:
        if fast:
            from . import fastdev

            fs = fastdev.pick_fs(getattr(args, "fast_device_fs", None))
            fastdev.check(fast, args.size, fs)
            with fastdev.FastDevice(fast, fs) as dev:
                args.file = dev.file
                args.file_made = fs == "raw"  # the loop device itself: the bench's, set up by it
                args.fast_device_info = dev.info()
                if not getattr(args, "quiet", False):
                    print(
                        f"phx bench: on a {fastdev.LABEL}: {dev.loop} over {dev.image}, "
                        f"direct I/O {'on' if dev.dio else 'OFF'}, {dev.info()['fs_text']}; bench file {dev.file}",
                        file=sys.stderr,
                    )
                run(args, records)
        else:
            run(args, records)
    except BaseException as exc:  # what was measured is kept, then the error is reported (phoenix.cli._run)
        report(records, args, stopped=exc)
        raise
    report(records, args)
    return 0
