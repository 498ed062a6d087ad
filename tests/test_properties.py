"""Property-based tests (hypothesis): random sequences of every kind of operation against
a reference model, in both engines, every mode, small pools and small chunks.

``test_random_sequences_match_the_model``: each example opens a file and runs a random
sequence of read / pread (size None too), write / pwrite, futures (several pread /
pwrite in flight, waited in any order), read_many / write_many (packed, gapped or
permuted extents), batch (tuple, dict and IORequest forms, over two handles of the
file, with a request past its buffer that must fail alone with EFAULT), stream-ordered
I/O (read_async / write_async on one or two vendor streams or the default stream, the
vendor's copies queued before a write and after a read on the same stream), external
writes (os.pwrite through another descriptor, buffered or O_DIRECT), truncation
(os.truncate / os.ftruncate, shrinking and growing), fsync, fmap_wait and reopen (modes
r+, a+, w+ and r: writes on a read-only handle must fail with EBADF; direct
None/True/False). Sizes run from 0 and 1 byte to a few MiB, around multiples of the
chunk, and past a chunk and the bounce pool; file offsets are aligned, unaligned, just
before, at and past EOF, and around 4 GiB (sparse). Buffers are NumPy arrays (anywhere,
page aligned, at odd addresses), memoryviews, the host vendor's device memory and pinned
memory (page aligned or odd), sometimes registered (phoenix.io.register), always between
poisoned guards. The model (``tests/_model.py``) is a sparse bytearray of the file:
every read's count and every byte of its destination (the bytes returned, the rest of
the extent past the count, the guards) are checked, every write's count and that its
source is unchanged, and the whole file at the end.

``test_concurrent_threads_on_disjoint_regions``: 2-4 threads on one file (one shared
handle or one each), each running its own random operations (every API above, external
writes too) in its own region, checked against its own model as it goes and the whole
file at the end; some operations change settings (process-wide) around them, so that
pools are replaced while other threads' requests are in flight.

``test_far_file_offsets``: offsets past 4 GiB, the file system's limit, 2**63 and 2**64
through every API: no wrap-around, reads past EOF return 0, refusals change nothing.

Settings: the sequence tests are parametrized by engine (io_uring, threads) x mode (auto,
staged, direct) x pool/chunk (``POOLS``: defaults; a 1M bounce pool with the default
chunk; 1M pool with 64K chunks; 1M pool with 4K chunks; 4K chunks; 20K chunks), and draw
threads (1..4), queue depth and fmap_mode (auto, sync, off) per example, so every
combination runs in CI; the other tests draw them.

Profiles (environment ``PHX_HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized (the same examples every run), bounded (minutes).
* ``long``: random, enough examples for more than 20,000 operations per engine.

``PHX_HYPOTHESIS_EXAMPLES=<n>`` sets the examples per parametrized test in either.
The operations executed per engine are counted; the totals are printed at the end of
the module (with or without ``-s``) and written as JSON to ``PHX_HYPOTHESIS_REPORT``
(default: ``operation_totals.json`` in the module's pytest tmp directory).
"""

from __future__ import annotations

import errno
import faulthandler
import json
import mmap
import os
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
from _model import KINDS, Guarded, SparseFile, file_mismatch  # tests/_model.py
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.errors import PhxIOError
from phoenix.vendor import CopyKind

# ---- profiles ---------------------------------------------------------------------------

_COMMON = dict(
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
    ],
)
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("long", derandomize=False, database=None, **_COMMON)
# the first failure as it happened, not shrunk (shrinking runs failing examples again in a
# process whose state the first failure may have changed)
settings.register_profile(
    "first", derandomize=False, database=None, **dict(_COMMON, phases=[Phase.explicit, Phase.generate])
)
PROFILE = os.environ.get("PHX_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long", "first"):
    raise ValueError(f"PHX_HYPOTHESIS_PROFILE={PROFILE!r}: ci, long or first")
_EX = os.environ.get("PHX_HYPOTHESIS_EXAMPLES")
#: examples per parametrized test: (sequence tests, concurrency tests, far-offset test)
EXAMPLES = {"ci": (50, 80, 150), "long": (150, 300, 1000), "first": (150, 300, 1000)}[PROFILE]
if _EX:
    EXAMPLES = (int(_EX), int(_EX), int(_EX))
#: operations per sequence (at most)
MAX_OPS = {"ci": 16, "long": 24, "first": 24}[PROFILE]


def profile(n: int):
    return settings(settings.get_profile(PROFILE), max_examples=n)


#: seconds after which an operation that has not completed is a hang
HANG_S = float(os.environ.get("PHX_HYPOTHESIS_HANG_S", "120"))


def _hung(what, log=()):
    """An operation that never completes: the process cannot go on (closing its file or
    shutting the pool down would wait for it too), so say what hung, after which
    operations, dump every thread's stack and exit (status 70)."""
    sys.stderr.write(
        f"\nphoenix properties: HANG: {what} did not complete in {HANG_S:.0f} s\n"
        f"  settings: {ps.get()}\n  operations:\n    " + "\n    ".join(log) + "\n"
    )
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    os._exit(70)


def _result(fut, what, log=()):
    """fut.result(), or a hang after HANG_S."""
    try:
        return fut.result(HANG_S)
    except TimeoutError:
        _hung(what, log)


def _stream_sync(rt, stream, ops, what, log=()):
    """Wait for the stream ops (a hang after HANG_S each), then synchronize the stream."""
    for op in ops:
        if isinstance(op, pio.StreamIO) and not op.wait(HANG_S):
            _hung(f"{what}: {op!r}", log)
    rt.stream_synchronize(stream)


# ---- the settings matrix ------------------------------------------------------------------

ENGINES = ("io_uring", "threads")
MODES = ("auto", "staged", "direct")
POOLS = {
    "default": {},
    "pool1M": {"bounce_pool_size": "1M"},  # the default 8M chunk with a 1 MiB bounce pool
    "small": {"bounce_pool_size": "1M", "chunk_size": "64K"},
    "tiny": {"bounce_pool_size": "1M", "chunk_size": "4K"},
    "chunk4K": {"chunk_size": "4K"},
    "chunk20K": {"chunk_size": "20K"},  # a valid chunk size that is not a power of two
}
POOL_CHOICES = list(POOLS)
MiB = 1 << 20
BIG_CAP = 40 * MiB  # the largest single request

_last_pool_key = [None]


def _enter_settings(engine, mode, pool, threads, queue_depth, fmap_mode="auto"):
    """An override for one example; shuts the previous pool down when the pool changes (a
    pool per settings tuple: dozens alive at once would hold their bounce pools)."""
    kw = dict(engine=engine, mode=mode, threads=threads, queue_depth=queue_depth, fmap_mode=fmap_mode, **POOLS[pool])
    # a backstop for the calls without a timeout (read, read_many, batch, close, shutdown):
    # every thread's stack, and exit, if one example runs past 3 x HANG_S
    faulthandler.dump_traceback_later(3 * HANG_S, exit=True)
    ctx = ps.override(**kw)
    s = ctx.__enter__()
    if _last_pool_key[0] != s.pool_key():
        pio.shutdown()
        _last_pool_key[0] = s.pool_key()
    return ctx, s


def _leave_settings(ctx):
    ctx.__exit__(None, None, None)
    faulthandler.cancel_dump_traceback_later()


# ---- counting -----------------------------------------------------------------------------


class Tally:
    """Operations per engine: calls of the API, requests (extents) they carried, and the
    external operations between them; mismatches (failed checks)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = defaultdict(lambda: defaultdict(int))
        self.requests = defaultdict(int)
        self.mismatches = 0
        self.examples = defaultdict(int)

    def op(self, engine, kind, requests=1):
        with self.lock:
            self.calls[engine][kind] += 1
            self.requests[engine] += requests

    def summary(self) -> dict:
        with self.lock:
            return {
                "profile": PROFILE,
                "engines": {
                    e: {
                        "operations": sum(v for k, v in c.items() if not k.startswith("ext_")),
                        "external_operations": sum(v for k, v in c.items() if k.startswith("ext_")),
                        "requests": self.requests[e],
                        "examples": self.examples[e],
                        "by_kind": dict(sorted(c.items())),
                    }
                    for e, c in self.calls.items()
                },
                "mismatches": self.mismatches,
            }


_TALLY = Tally()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("props")


@pytest.fixture(scope="module")
def tally(workdir, request):
    yield _TALLY
    s = _TALLY.summary()
    path = os.environ.get("PHX_HYPOTHESIS_REPORT") or str(workdir / "operation_totals.json")
    with open(path, "w") as fh:
        json.dump(s, fh, indent=1)
    parts = [
        f"{e}: {v['operations']} operations ({v['requests']} requests, {v['external_operations']} external "
        f"operations, {v['examples']} examples)"
        for e, v in sorted(s["engines"].items())
    ]
    line = f"phoenix properties [{PROFILE}]: {'; '.join(parts)}; {s['mismatches']} mismatches; totals: {path}"
    cap = request.config.pluginmanager.getplugin("capturemanager")
    if cap is not None:
        with cap.global_and_fixture_disabled():  # shown without -s too
            print("\n" + line)
    else:
        print(line)
    pio.shutdown()
    _last_pool_key[0] = None


class Mismatch(AssertionError):
    pass


#: The contract (phoenix.io's docstring): a read writes nothing outside its extent; inside
#: the extent, the bytes past the count it returned are the file's end read as the kernel
#: reads it: an O_DIRECT read that reaches EOF may zero them (the file system serves the
#: blocks past EOF as a hole), so zeros are accepted there, and nothing else (no stale
#: bytes, no other file's data). True demands poison there too.
STRICT_EOF_TAIL = False


def _tail_ok(ranges):
    return () if STRICT_EOF_TAIL else ranges


# ---- draws --------------------------------------------------------------------------------


@dataclass
class Env:
    engine: str
    mode: str
    chunk: int
    pool: int  # bytes (0: auto)


def draw_size(data, env: Env, cap: int = BIG_CAP) -> int:
    """1 byte .. a few MiB; sometimes around multiples of the chunk, sometimes larger than
    a chunk and than the pool (chunking, pool waits); now and then 0."""
    b = data.draw(st.integers(0, 99), label="size class")
    if b < 2:
        return 0
    if b < 30:
        n = data.draw(st.integers(1, 4100), label="size")
    elif b < 62:
        n = data.draw(st.integers(1, 256 << 10), label="size")
    elif b < 86:
        n = data.draw(st.integers(1, 3 * MiB), label="size")
    elif b < 96:
        k = data.draw(st.integers(1, 3), label="chunks")
        n = max(1, k * env.chunk + data.draw(st.integers(-4097, 4097), label="delta"))
    else:
        unit = max(env.chunk, env.pool or 0)
        lo = min(unit + 1, cap)
        n = data.draw(st.integers(lo, max(lo, min(3 * unit + 4097, cap))), label="big size")
    return min(n, cap)


FOUR_G = 1 << 32


def draw_offset(data, size_now: int, far: bool = True) -> int:
    """Aligned, unaligned, near EOF, past EOF, around 4 GiB (sparse)."""
    b = data.draw(st.integers(0, 99), label="offset class")
    if b < 10:
        return 0
    if b < 28:
        return 4096 * data.draw(st.integers(0, (size_now + MiB) // 4096), label="page")
    if b < 55:
        return data.draw(st.integers(0, size_now), label="offset")
    if b < 65:  # just before EOF: a request that crosses it
        return max(0, size_now - data.draw(st.integers(1, 4096), label="before eof"))
    if b < 78:
        return max(0, size_now + data.draw(st.integers(-8192, 8192), label="eof delta"))
    if b < 95 or not far:
        return size_now + data.draw(st.integers(1, 4 * MiB), label="past eof")
    return FOUR_G + data.draw(st.integers(-(1 << 17), 1 << 17), label="4G delta")


def draw_buffer(data, rt, n: int, label="buffer") -> Guarded:
    kind = data.draw(st.sampled_from(KINDS), label=f"{label} kind")
    lead = data.draw(st.integers(0, 4096), label=f"{label} lead")
    poison = data.draw(st.integers(0, 255), label=f"{label} poison")
    register = data.draw(st.integers(0, 5), label=f"{label} registered?") == 0
    return Guarded(rt, kind, n, poison, lead, register=register)


def rand_bytes(seed: int, n: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8).copy() if n else np.zeros(0, np.uint8)


# ---- one example: a sequence of operations ------------------------------------------------


@dataclass
class Req:
    op: str
    off: int
    size: int
    buf: Guarded
    bo: int
    src: np.ndarray | None = None  # writes: the bytes the request must write
    want: np.ndarray | None = None  # reads: the bytes the model says it returns
    bad: bool = False  # an extent past the buffer (EFAULT, moves nothing)
    content: np.ndarray | None = None  # writes: the whole source buffer as filled

    def describe(self):
        return (
            f"{self.op} {self.size} B at file offset {self.off} {'(EFAULT) ' if self.bad else ''}"
            f"from/to {self.buf.kind} buffer (n={self.buf.n}, addr {self.buf.addr:#x}) + {self.bo}"
        )


def conflict(a: Req, b: Req, size0: int) -> bool:
    """Can two requests in flight together give an order-dependent outcome? Writes: their
    byte ranges overlap; a read and a write: the write touches what the read sees, or the
    read runs past EOF (size0, the smallest size the group sees) and the write could move EOF
    under it. Reads never conflict."""
    if a.bad or b.bad or a.size == 0 or b.size == 0 or (a.op == "read" and b.op == "read"):
        return False
    if a.op == "write" and b.op == "write":
        return a.off < b.off + b.size and b.off < a.off + a.size
    r, w = (a, b) if a.op == "read" else (b, a)
    r_end = r.off + r.size if r.off + r.size <= size0 else float("inf")
    return r.off < w.off + w.size and w.off < r_end


class Sequence:
    """One example's file, handles, streams and model."""

    def __init__(self, rt, path, env: Env, tally: Tally, data):
        self.rt, self.path, self.env, self.tally, self.data = rt, path, env, tally, data
        self.model = SparseFile()
        self.log: list[str] = []
        self.f = None
        self.f_mode = "w+"
        self.f2 = None
        self.streams: list[int] = []
        self.bufs: list[Guarded] = []

    # -- helpers -------------------------------------------------------------------------

    def fail(self, msg):
        try:
            on_disk = os.stat(self.path).st_size
        except OSError as exc:
            on_disk = repr(exc)
        raise Mismatch(
            f"{msg}\n  settings: {self.env} {ps.get()}\n  file: {self.path} (size in model "
            f"{self.model.size}, on disk {on_disk})\n  stats: {pio.stats()}\n  operations so far:\n    "
            + "\n    ".join(self.log[-60:])
        )

    def count(self, kind, requests=1):
        self.tally.op(self.env.engine, kind, requests)

    def buffer(self, n, label="buffer") -> Guarded:
        b = draw_buffer(self.data, self.rt, n, label)
        self.bufs.append(b)
        return b

    def free_buffers(self):
        for b in self.bufs:
            b.free()
        self.bufs.clear()

    @property
    def writable(self):
        return self.f_mode != "r"

    def seed(self):
        return self.data.draw(st.integers(0, 2**32 - 1), label="seed")

    def new_req(self, op, size_cap=BIG_CAP, allow_bad=False) -> Req:
        d = self.data
        size = draw_size(d, self.env, size_cap)
        off = draw_offset(d, self.model.size)
        bo = d.draw(st.sampled_from([0, 0, 1, 4096, 511]) | st.integers(0, 5000), label="buf offset")
        extra = d.draw(st.sampled_from([0, 0, 1]) | st.integers(0, 5000), label="room after")
        bad = allow_bad and size > 0 and d.draw(st.integers(0, 19), label="bad?") == 0
        n = bo + size + extra
        if bad:
            n = bo + size - d.draw(st.integers(1, size), label="short by")
        buf = self.buffer(max(n, 1) if not bad else n, label=op)
        r = Req(op, off, size, buf, bo, bad=bad)
        if op == "write":
            r.content = rand_bytes(self.seed(), buf.n)
            buf.fill(r.content)
            r.src = r.content[bo : bo + size]
        else:
            r.want = self.model.read(off, size)
        return r

    def expect_write_count(self, r: Req):
        if r.bad:
            return "EFAULT"
        if not self.writable:
            return 0 if r.size == 0 else "EBADF"
        return r.size

    def check_result(self, r: Req, got, what):
        """got: a count, or the exception the call raised / returned."""
        if r.op == "read":
            want = "EFAULT" if r.bad else r.want.size
        else:
            want = self.expect_write_count(r)
        if isinstance(want, str):
            code = getattr(errno, want)
            if not (isinstance(got, PhxIOError) and got.errno == code) and not (
                want == "EBADF" and r.size == 0 and got == 0
            ):
                self.fail(f"{what}: {r.describe()}: want {want}, got {got!r}")
        elif isinstance(got, BaseException):
            self.fail(f"{what}: {r.describe()}: want {want}, raised {got!r}")
        elif got != want:
            self.fail(f"{what}: {r.describe()}: count {got}, want {want}")
        if r.op == "read":
            # a refused extent (past the buffer) moves nothing: all poison, guards included
            msg = r.buf.mismatch(
                [] if r.bad else [(r.bo, r.want)],
                [(r.bo, r.size, r.want.size if not r.bad else 0)],
                _tail_ok([(r.bo + r.want.size, r.bo + r.size)]),
            )
            if msg:
                self.fail(f"{what}: {r.describe()}: {msg}")
        else:
            msg = r.buf.mismatch([(0, r.content)])  # a write leaves its source alone
            if msg:
                self.fail(f"{what}: {r.describe()}: the source buffer changed: {msg}")

    def apply(self, r: Req, got):
        if r.op == "write" and not r.bad and self.writable and not isinstance(got, BaseException):
            self.model.write(r.off, r.src)

    # -- handles ---------------------------------------------------------------------------

    def open(self, mode="w+", direct=None):
        self.f = pio.open(self.path, mode, direct=direct)
        self.f_mode = mode
        if mode.startswith("w"):
            self.model.truncate(0)

    def close(self):
        for h in (self.f, self.f2):
            if h is not None:
                h.close()
        self.f = self.f2 = None

    # -- operations ------------------------------------------------------------------------

    def op_read(self):
        r = self.new_req("read")
        api = self.data.draw(st.sampled_from(["read", "pread"]), label="api")
        # size None: to the end of the buffer
        size = None if r.buf.n == r.bo + r.size and self.data.draw(st.booleans(), label="size None") else r.size
        self.log.append(f"{api}: {r.describe()}{' (size None)' if size is None else ''}")
        try:
            got = (
                self.f.read(r.buf.obj, size, r.off, r.bo)
                if api == "read"
                else _result(self.f.pread(r.buf.obj, size, r.off, r.bo), "pread", self.log)
            )
        except PhxIOError as exc:
            got = exc
        self.count(api)
        self.check_result(r, got, api)

    def op_write(self):
        r = self.new_req("write")
        api = self.data.draw(st.sampled_from(["write", "pwrite"]), label="api")
        self.log.append(f"{api}: {r.describe()}")
        try:
            got = (
                self.f.write(r.buf.obj, r.size, r.off, r.bo)
                if api == "write"
                else _result(self.f.pwrite(r.buf.obj, r.size, r.off, r.bo), "pwrite", self.log)
            )
        except PhxIOError as exc:
            got = exc
        self.count(api)
        self.check_result(r, got, api)
        self.apply(r, got)

    def _group(self, k, cap, allow_bad=False, ops=("read", "write")):
        """Up to k requests that may run together (no order-dependent outcome)."""
        reqs = []
        for _ in range(k):
            op = self.data.draw(st.sampled_from(ops), label="op")
            r = self.new_req(op, cap, allow_bad)
            if any(conflict(r, q, self.model.size) for q in reqs):
                continue
            reqs.append(r)
        return reqs

    def op_futures(self):
        k = self.data.draw(st.integers(1, 6), label="futures")
        reqs = self._group(k, 8 * MiB)
        self.log.append("futures: " + "; ".join(r.describe() for r in reqs))
        # (every draw before the first submission: a draw may end the example, and the
        # buffers of requests in flight must not be freed under them)
        order = self.data.draw(st.permutations(range(len(reqs))), label="wait order")
        futs = []
        for r in reqs:
            fn = self.f.pread if r.op == "read" else self.f.pwrite
            try:
                futs.append(fn(r.buf.obj, r.size, r.off, r.bo))
            except PhxIOError as exc:
                futs.append(exc)
        results = [None] * len(reqs)
        for i in order:
            fut = futs[i]
            if isinstance(fut, BaseException):
                results[i] = fut
                continue
            try:
                results[i] = _result(fut, f"future {i}", self.log)
            except PhxIOError as exc:
                results[i] = exc
        self.count("futures", len(reqs))
        for r, got in zip(reqs, results, strict=True):
            self.check_result(r, got, "pread/pwrite future")
        for r, got in zip(reqs, results, strict=True):
            self.apply(r, got)

    def op_batch(self):
        k = self.data.draw(st.integers(1, 8), label="batch size")
        reqs = self._group(k, 8 * MiB, allow_bad=True)
        use2 = self.data.draw(st.booleans(), label="second handle")
        if use2 and self.f2 is None:
            direct = self.data.draw(st.sampled_from([None, True, False]), label="f2 direct")
            self.f2 = pio.open(self.path, "r+" if self.writable else "r", direct=direct)
        handles = [self.f2 if use2 and self.data.draw(st.booleans(), label="on f2") else self.f for _ in reqs]
        wait = self.data.draw(st.booleans(), label="wait")
        self.log.append(
            f"batch(wait={wait}): "
            + "; ".join(f"[{'f2' if h is self.f2 else 'f'}] {r.describe()}" for r, h in zip(reqs, handles, strict=True))
        )
        forms = [self.data.draw(st.sampled_from(["tuple", "dict", "IORequest"]), label="form") for _ in reqs]
        tuples = [
            (h, r.buf.obj, r.size, r.off, r.bo, r.op)
            if form == "tuple"
            else {"file": h, "buf": r.buf.obj, "size": r.size, "file_offset": r.off, "buf_offset": r.bo, "op": r.op}
            if form == "dict"
            else pio.IORequest(h, r.buf.obj, r.size, r.off, r.bo, r.op)
            for r, h, form in zip(reqs, handles, forms, strict=True)
        ]
        if wait:
            results = pio.batch(tuples)
        else:
            results = []
            for fut in pio.batch(tuples, wait=False):
                try:
                    results.append(_result(fut, "batch future", self.log))
                except PhxIOError as exc:
                    results.append(exc)
        self.count("batch", len(reqs))
        if len(results) != len(reqs):
            self.fail(f"batch: {len(results)} results for {len(reqs)} requests")
        for r, got in zip(reqs, results, strict=True):
            self.check_result(r, got, "batch")
        for r, got in zip(reqs, results, strict=True):
            self.apply(r, got)

    def _extents(self, k, read):
        """k (file offset, size) pairs; for writes, disjoint in the file."""
        d = self.data
        fo, sz = [], []
        for _ in range(k):
            size = (
                draw_size(d, self.env, 2 * MiB)
                if d.draw(st.integers(0, 3), label="large?") == 0
                else d.draw(st.integers(0, 20000), label="extent size")
            )
            off = draw_offset(d, self.model.size)
            if not read and any(off < o + s and o < off + size for o, s in zip(fo, sz, strict=True) if s and size):
                continue
            fo.append(off)
            sz.append(size)
        return fo, sz

    def op_many(self, read: bool):
        d = self.data
        k = d.draw(st.integers(1, 40), label="extents")
        fo, sz = self._extents(k, read)
        packed = d.draw(st.booleans(), label="packed")
        if packed:
            bo = list(np.concatenate([[0], np.cumsum(sz[:-1])]).astype(int)) if sz else []
            end = sum(sz)
        else:
            bo, pos = [], 0
            for s in sz:
                if read:  # destinations must not overlap
                    pos += d.draw(st.integers(0, 300), label="gap")
                    bo.append(pos)
                    pos += s
                else:  # sources may
                    bo.append(d.draw(st.integers(0, max(0, sum(sz) // 2)), label="src offset"))
            if read and d.draw(st.booleans(), label="shuffle"):
                # the same extents in another order in the buffer
                perm = d.draw(st.permutations(range(len(sz))), label="perm")
                sizes_p = [sz[i] for i in perm]
                offs, pos = [0] * len(sz), 0
                for i, s in zip(perm, sizes_p, strict=True):
                    pos += d.draw(st.integers(0, 64), label="gap")
                    offs[i] = pos
                    pos += s
                bo = offs
            end = max([b + s for b, s in zip(bo, sz, strict=True)] + [0])
        extra = d.draw(st.integers(0, 300), label="room after")
        buf = self.buffer(max(end + extra, 1), "many")
        api = "read_many" if read else "write_many"
        content = None
        if not read:
            content = rand_bytes(self.seed(), buf.n)
            buf.fill(content)
            want_counts = [s if self.writable or s == 0 else -1 for s in sz]
        else:
            wants = [self.model.read(o, s) for o, s in zip(fo, sz, strict=True)]
            want_counts = [w.size for w in wants]
        self.log.append(
            f"{api}({'packed' if packed else 'offsets'}) into {buf.kind} (n={buf.n}, "
            f"addr {buf.addr:#x}): " + ", ".join(f"{o}+{s}->{b}" for o, s, b in zip(fo, sz, bo, strict=True))
        )
        fn = self.f.read_many if read else self.f.write_many
        try:
            got = fn(buf.obj, fo, sz, None if packed else bo)
        except PhxIOError as exc:
            got = exc
        self.count(api, len(fo))
        if not read and not self.writable and any(sz):
            if not (isinstance(got, PhxIOError) and got.errno == errno.EBADF):
                self.fail(f"{api} on a read-only handle: want EBADF, got {got!r}")
            return
        if isinstance(got, BaseException):
            self.fail(f"{api}: raised {got!r}")
        if list(got) != want_counts:
            bad = [i for i in range(len(fo)) if got[i] != want_counts[i]]
            self.fail(
                f"{api}: counts differ at extents {bad[:8]}: got {[int(got[i]) for i in bad[:8]]}, "
                f"want {[want_counts[i] for i in bad[:8]]}"
            )
        if read:
            msg = buf.mismatch(
                list(zip(bo, wants, strict=True)),
                [(b, s, w.size) for b, s, w in zip(bo, sz, wants, strict=True)],
                _tail_ok([(b + w.size, b + s) for b, w, s in zip(bo, wants, sz, strict=True)]),
            )
            if msg:
                self.fail(f"{api}: {msg}")
        else:
            msg = buf.mismatch([(0, content)])
            if msg:
                self.fail(f"{api}: the source buffer changed: {msg}")
            for o, s, b in zip(fo, sz, bo, strict=True):
                if s:
                    self.model.write(o, content[b : b + s])

    def op_stream(self):
        d, rt = self.data, self.rt
        nstreams = d.draw(st.integers(1, 2), label="streams")
        while len(self.streams) < nstreams:
            self.streams.append(rt.stream_create())
        handles = self.streams[:nstreams]
        if d.draw(st.integers(0, 3), label="default stream?") == 0:
            handles = [0] + handles[1:]  # the vendor's default stream
        k = d.draw(st.integers(1, 6), label="stream ops")
        size0 = self.model.size
        plan = []  # (req, stream index, staging array or None)
        for _ in range(k):
            op = d.draw(st.sampled_from(["read", "write"]), label="op")
            si = d.draw(st.integers(0, nstreams - 1), label="stream")
            r = self.new_req(op, 8 * MiB)
            if any(conflict(r, q, size0) for q, sj in plan if sj != si):
                continue
            plan.append((r, si))
        # each stream in submission order: writes change the model for what follows
        self.log.append(
            "stream: "
            + "; ".join(f"[{'default stream' if handles[si] == 0 else f's{si}'}] {r.describe()}" for r, si in plan)
        )
        ops, keep = [], []
        for r, si in plan:
            s = handles[si]
            if r.op == "write":
                # the source reaches the buffer on the stream, just before the write
                if r.buf.kind.startswith(("device", "pinned")) and r.size:
                    staged = np.ascontiguousarray(r.src).copy()
                    keep.append(staged)
                    r.buf.fill(np.full(r.size, r.buf.poison ^ 0x5A, np.uint8), r.bo)
                    kind = CopyKind.HOST_TO_DEVICE if r.buf.is_device else CopyKind.HOST_TO_HOST
                    rt.memcpy_async(r.buf.addr + r.bo, staged.ctypes.data, r.size, kind, s)
                try:
                    op = self.f.write_async(r.buf.obj, r.size, r.off, r.bo, s)
                except PhxIOError as exc:
                    op = exc
                ops.append((op, None))
            else:
                r.want = self.model.read(r.off, r.size)
                try:
                    op = self.f.read_async(r.buf.obj, r.size, r.off, r.bo, s)
                except PhxIOError as exc:
                    op = exc
                after = None
                if r.buf.kind.startswith(("device", "pinned")) and r.size:
                    # work queued after the read sees its bytes
                    after = np.full(r.size, r.buf.poison ^ 0x33, np.uint8)
                    kind = CopyKind.DEVICE_TO_HOST if r.buf.is_device else CopyKind.HOST_TO_HOST
                    rt.memcpy_async(after.ctypes.data, r.buf.addr + r.bo, r.size, kind, s)
                ops.append((op, after))
            if r.op == "write" and self.writable and r.size:
                self.model.write(r.off, r.src)
        for si, s in enumerate(handles):
            _stream_sync(
                rt, s, [op for (_, sj), (op, _) in zip(plan, ops, strict=True) if sj == si], "stream op", self.log
            )
        self.count("stream", len(plan))
        for (r, _si), (op, after) in zip(plan, ops, strict=True):
            if isinstance(op, BaseException):
                got = op
            else:
                v = op.bytes_done
                if v is None:
                    self.fail(f"stream op {r.describe()}: bytes_done unbound after stream_synchronize")
                got = v if v >= 0 else PhxIOError(-v, self.path, r.off, r.size, "stream")
            self.check_result(r, got, f"stream {r.op}_async")
            if after is not None:
                want = np.full(r.size, r.buf.poison, np.uint8)
                want[: r.want.size] = r.want
                if not STRICT_EOF_TAIL:
                    tail = after[r.want.size :]
                    want[r.want.size :][tail == 0] = 0
                if not np.array_equal(after, want):
                    bad = np.flatnonzero(after != want)
                    self.fail(
                        f"stream read_async: {r.describe()}: a copy queued after it on the stream saw "
                        f"{bad.size} wrong bytes (first at {bad[0]})"
                    )

    def op_external_write(self):
        d = self.data
        size = draw_size(d, self.env, 4 * MiB)
        off = draw_offset(d, self.model.size, far=False)
        odirect = d.draw(st.integers(0, 4), label="O_DIRECT?") == 0
        content = rand_bytes(self.seed(), size)
        if odirect:
            off, size = off // 4096 * 4096, max(4096, size // 4096 * 4096)
            content = rand_bytes(self.seed(), size)
        self.log.append(f"external {'O_DIRECT ' if odirect else ''}pwrite {size} B at {off}")
        fd = os.open(self.path, os.O_WRONLY | (os.O_DIRECT if odirect else 0))
        try:
            if odirect:
                m = mmap.mmap(-1, size)
                try:
                    m[:] = content.tobytes()
                    n = os.pwrite(fd, m, off)
                finally:
                    m.close()
            else:
                n = os.pwrite(fd, content.tobytes(), off)
        finally:
            os.close(fd)
        assert n == size
        if size:
            self.model.write(off, content)
        self.count("ext_write")

    def op_truncate(self):
        d = self.data
        b = d.draw(st.integers(0, 9), label="truncate class")
        sz = self.model.size
        n = (
            0
            if b == 0
            else d.draw(st.integers(0, sz), label="shrink to")
            if b < 6
            else sz + d.draw(st.integers(0, 2 * MiB), label="grow by")
        )
        how = d.draw(st.sampled_from(["truncate", "ftruncate"]), label="how")
        self.log.append(f"external {how} to {n}")
        if how == "truncate":
            os.truncate(self.path, n)
        else:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, n)
            finally:
                os.close(fd)
        self.model.truncate(n)
        self.count("ext_truncate")

    def op_reopen(self):
        d = self.data
        mode = d.draw(st.sampled_from(["r+", "a+", "w+", "r"]), label="reopen mode")
        direct = d.draw(st.sampled_from([None, True, False]), label="direct")
        self.log.append(f"reopen {mode} direct={direct}")
        self.close()
        self.open(mode, direct)
        self.count("reopen")

    def op_fmap_wait(self):
        """Let the background registrations of the file-mapping cache finish: the next
        staged reads into device memory of those ranges are served from the mapping."""
        self.log.append("fmap_wait")
        pio.fmap_wait(2.0)
        self.count("fmap_wait")

    def op_fsync(self):
        self.log.append("fsync")
        if self.writable:
            self.f.fsync()
        self.count("fsync")

    OPS = (
        "read",
        "write",
        "futures",
        "read_many",
        "write_many",
        "batch",
        "stream",
        "external_write",
        "truncate",
        "reopen",
        "fsync",
        "fmap_wait",
    )

    def run_op(self, name):
        if name == "read_many":
            self.op_many(True)
        elif name == "write_many":
            self.op_many(False)
        else:
            getattr(self, "op_" + name)()


# ---- the tests ------------------------------------------------------------------------------

_counter = iter(range(1 << 62))


def _env(engine, mode, s) -> Env:
    return Env(engine, mode, s.chunk_size, s.bounce_pool_size)


@pytest.mark.parametrize("pool", POOL_CHOICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine", ENGINES)
@profile(EXAMPLES[0])
@given(data=st.data())
def test_random_sequences_match_the_model(rt, workdir, tally, engine, mode, pool, data):
    threads = data.draw(st.integers(1, 4), label="threads")
    qd = data.draw(st.sampled_from([32, 1, 4]), label="queue_depth")
    fmap = data.draw(st.sampled_from(["auto", "sync", "off"]), label="fmap_mode")
    ctx, s = _enter_settings(engine, mode, pool, threads, qd, fmap)
    path = workdir / f"seq-{next(_counter)}.bin"
    seq = Sequence(rt, path, _env(engine, mode, s), tally, data)
    try:
        assert pio._current_engine(s).engine == engine
        base = pio.stats()
        tally.examples[engine] += 1
        init = data.draw(st.sampled_from([0, 1, 4096, 100_000]) | st.integers(0, 3 * MiB), label="initial size")
        content = rand_bytes(seq.seed(), init)
        path.write_bytes(content.tobytes())
        seq.model.write(0, content)
        seq.open("r+", data.draw(st.sampled_from([None, True, False]), label="direct"))
        n = data.draw(st.integers(1, MAX_OPS), label="operations")
        for _ in range(n):
            name = data.draw(st.sampled_from(Sequence.OPS), label="op")
            other = data.draw(st.integers(0, 9), label="mode override?") == 0
            try:
                if other:
                    m = data.draw(st.sampled_from(MODES), label="mode")
                    seq.log.append(f"(mode {m})")
                    with ps.override(mode=m):
                        seq.run_op(name)
                else:
                    seq.run_op(name)
            finally:
                seq.free_buffers()
        seq.close()
        seq.log.append("final check")
        msg = file_mismatch(path, seq.model)
        if msg:
            seq.fail(f"at the end: {msg}")
        # nothing left behind: files closed, requests and stream ops released, bounce slots
        # back in the pool, registrations dropped
        st_ = pio.stats()
        live = {k: st_[k] - base[k] for k in ("files", "registrations") if st_[k] != base[k]}
        live.update({k: st_[k] for k in ("requests", "stream_ops", "bounce_in_use") if st_[k]})
        if live:
            seq.fail(f"at the end, still live: {live}")
    except Mismatch:
        with tally.lock:
            tally.mismatches += 1
        raise
    finally:
        try:
            # the streams run dry and close() waits for the file's requests: then the
            # buffers may go
            for st_ in seq.streams:
                rt.stream_synchronize(st_)
                rt.stream_destroy(st_)
            seq.close()
            seq.free_buffers()
        finally:
            _leave_settings(ctx)
            if path.exists():
                path.unlink()


# ---- concurrency: threads on disjoint regions of one file ---------------------------------

THREAD_APIS = (
    "read",
    "write",
    "pread",
    "pwrite",
    "read_many",
    "write_many",
    "batch",
    "read_async",
    "write_async",
    "ext_write",
)


@dataclass
class ThreadOp:
    api: str
    extents: list  # [(relative file offset, size, buffer offset)]
    buf: Guarded | None = None
    content: np.ndarray | None = None
    override: dict = field(default_factory=dict)  # settings changed (process-wide) around the op


def _draw_thread_plan(data, rt, region, n_ops, bufs):
    plan = []
    for _ in range(n_ops):
        api = data.draw(st.sampled_from(THREAD_APIS), label="api")
        k = data.draw(st.integers(1, 4), label="extents") if api in ("read_many", "write_many", "batch") else 1
        exts, pos = [], 0
        for _ in range(k):
            rel = data.draw(st.integers(0, region - 1), label="rel offset")
            size = data.draw(st.integers(0, region - rel), label="size")
            if api in ("write_many", "batch", "write", "pwrite", "write_async", "ext_write") and any(
                rel < r + s and r < rel + size for r, s, _ in exts
            ):
                continue  # writes of one call: disjoint
            if api == "batch" and any(rel < r + s and r < rel + size for r, s, _ in exts):
                continue
            pos += data.draw(st.integers(0, 100), label="gap")
            exts.append((rel, size, pos))
            pos += size
        op = ThreadOp(api, exts)
        if data.draw(st.integers(0, 5), label="churn?") == 0:
            # overrides are process-wide: the other threads' requests that follow go to a
            # new worker pool while theirs in flight finish on the old one
            op.override = dict(
                POOLS[data.draw(st.sampled_from(POOL_CHOICES), label="churn pool")],
                threads=data.draw(st.integers(1, 3), label="churn threads"),
                mode=data.draw(st.sampled_from(MODES), label="churn mode"),
            )
        if api != "ext_write":
            op.buf = draw_buffer(data, rt, max(pos, 1))
            bufs.append(op.buf)
        if api in ("write", "pwrite", "write_many", "write_async", "ext_write") or (
            api == "batch" and data.draw(st.booleans(), label="batch writes")
        ):
            op.content = rand_bytes(data.draw(st.integers(0, 2**32 - 1), label="seed"), max(pos, 1))
            if op.buf is not None:
                op.buf.fill(op.content)
        plan.append(op)
    return plan


class _RegionWorker:
    """One thread's region: [base, base + region), its model (the last region may end
    before the region does: EOF moves only there)."""

    def __init__(self, idx, f, path, base, region, model, plan, stream, rt, engine, tally):
        self.idx, self.f, self.path, self.base, self.region = idx, f, path, base, region
        self.model = model  # np.ndarray of what the region holds now (up to EOF for the last)
        self.plan, self.stream, self.rt, self.engine, self.tally = plan, stream, rt, engine, tally
        self.error = None
        self.log = []

    def want(self, rel, size):
        return self.model[rel : rel + size] if rel < self.model.size else self.model[:0]

    def put(self, rel, data):
        if not data.size:
            return  # (a write of nothing does not move EOF)
        end = rel + data.size
        if end > self.model.size:
            self.model = np.concatenate([self.model, np.zeros(end - self.model.size, np.uint8)])
        self.model[rel:end] = data

    def fail(self, msg):
        raise Mismatch(
            f"thread {self.idx} (region at {self.base}, +{self.region}): {msg}\n  settings: {ps.get()}\n"
            "  its operations:\n    " + "\n    ".join(self.log[-10:])
        )

    def run(self):
        try:
            for op in self.plan:
                if op.override:
                    with ps.override(**op.override):
                        self.one(op)
                else:
                    self.one(op)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def one(self, op: ThreadOp):
        f, b = self.f, op.buf
        api = op.api
        self.log.append(
            f"{api} {[(self.base + r, s, bo) for r, s, bo in op.extents]} "
            f"{b.kind + ' ' + hex(b.addr) if b else ''} {op.override or ''}"
        )
        is_write = op.content is not None
        wants = [self.want(r, s) for r, s, _ in op.extents]
        if api == "ext_write":
            fd = os.open(self.path, os.O_WRONLY)
            try:
                for r, s, bo in op.extents:
                    assert os.pwrite(fd, op.content[bo : bo + s].tobytes(), self.base + r) == s
            finally:
                os.close(fd)
            got = [s for _, s, _ in op.extents]
        elif api in ("read", "write", "pread", "pwrite"):
            ((r, s, bo),) = op.extents
            fn = {
                "read": f.read,
                "write": f.write,
                "pread": lambda *a: _result(f.pread(*a), "pread", self.log),
                "pwrite": lambda *a: _result(f.pwrite(*a), "pwrite", self.log),
            }[api]
            got = [fn(b.obj, s, self.base + r, bo)]
        elif api in ("read_many", "write_many"):
            fn = f.read_many if api == "read_many" else f.write_many
            got = list(
                fn(
                    b.obj,
                    [self.base + r for r, _, _ in op.extents],
                    [s for _, s, _ in op.extents],
                    [bo for _, _, bo in op.extents],
                )
            )
        elif api == "batch":
            got = pio.batch(
                [(f, b.obj, s, self.base + r, bo, "write" if is_write else "read") for r, s, bo in op.extents]
            )
        else:
            ((r, s, bo),) = op.extents
            fn = f.read_async if api == "read_async" else f.write_async
            sop = fn(b.obj, s, self.base + r, bo, self.stream)
            _stream_sync(self.rt, self.stream, [sop], api, self.log)
            got = [sop.bytes_done]
        self.tally.op(self.engine, "ext_write" if api == "ext_write" else "thread_" + api, len(op.extents))
        if is_write:
            for (r, s, bo), g in zip(op.extents, got, strict=True):
                if g != s:
                    self.fail(f"{api}: count {g!r} for {s} bytes at {self.base + r}")
                self.put(r, op.content[bo : bo + s])
            if b is not None:
                msg = b.mismatch([(0, op.content)])
                if msg:
                    self.fail(f"{api}: the source buffer changed: {msg}")
        else:
            for (r, s, _bo), g, w in zip(op.extents, got, wants, strict=True):
                if g != w.size:
                    self.fail(f"{api}: count {g!r} for {s} bytes at {self.base + r}, want {w.size}")
            msg = b.mismatch(
                [(bo, w) for (_, _, bo), w in zip(op.extents, wants, strict=True)],
                [(bo, s, w.size) for (_, s, bo), w in zip(op.extents, wants, strict=True)],
                _tail_ok([(bo + w.size, bo + s) for (_, s, bo), w in zip(op.extents, wants, strict=True)]),
            )
            if msg:
                self.fail(f"{api}: {msg}")


@pytest.mark.parametrize("engine", ENGINES)
@profile(EXAMPLES[1])
@given(data=st.data())
def test_concurrent_threads_on_disjoint_regions(rt, workdir, tally, engine, data):
    mode = data.draw(st.sampled_from(MODES), label="mode")
    pool = data.draw(st.sampled_from(POOL_CHOICES), label="pool")
    threads = data.draw(st.integers(1, 4), label="threads")
    qd = data.draw(st.sampled_from([32, 1, 4]), label="queue_depth")
    fmap = data.draw(st.sampled_from(["auto", "sync", "off"]), label="fmap_mode")
    nthr = data.draw(st.integers(2, 4), label="application threads")
    region = data.draw(st.sampled_from([4096, 65537, MiB - 3, 3 * MiB + 5]), label="region")
    shared = data.draw(st.booleans(), label="one handle")
    direct = data.draw(st.sampled_from([None, True, False]), label="direct")
    last = data.draw(st.integers(0, region), label="last region's initial bytes")
    ctx, s = _enter_settings(engine, mode, pool, threads, qd, fmap)
    path = workdir / f"conc-{next(_counter)}.bin"
    bufs, handles, streams, workers = [], [], [], []
    try:
        tally.examples[engine] += 1
        init = rand_bytes(data.draw(st.integers(0, 2**32 - 1), label="seed"), (nthr - 1) * region + last)
        path.write_bytes(init.tobytes())
        plans = [
            _draw_thread_plan(data, rt, region, data.draw(st.integers(1, 8), label="ops"), bufs) for _ in range(nthr)
        ]
        f0 = pio.open(path, "r+", direct=direct)
        handles.append(f0)
        for i in range(nthr):
            f = f0 if shared else pio.open(path, "r+", direct=direct)
            if f is not f0:
                handles.append(f)
            streams.append(rt.stream_create())
            workers.append(
                _RegionWorker(
                    i,
                    f,
                    str(path),
                    i * region,
                    region,
                    init[i * region : (i + 1) * region].copy(),
                    plans[i],
                    streams[i],
                    rt,
                    engine,
                    tally,
                )
            )
        ts = [threading.Thread(target=w.run) for w in workers]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for w in workers:
            if w.error is not None:
                raise w.error
        for f in handles:
            f.close()
        handles.clear()
        model = SparseFile()
        for w in workers:
            model.write(w.base, w.model)
        model.truncate(max(model.size, init.size))
        msg = file_mismatch(path, model)
        if msg:
            raise Mismatch(f"at the end: {msg}\n  settings: {ps.get()}")
    except Mismatch:
        with tally.lock:
            tally.mismatches += 1
        raise
    finally:
        try:
            for f in handles:
                f.close()
            for s_ in streams:
                rt.stream_synchronize(s_)
                rt.stream_destroy(s_)
            for b in bufs:
                b.free()
        finally:
            _leave_settings(ctx)
            if path.exists():
                path.unlink()


# ---- far file offsets: past 4 GiB, the file system's limit, 2**63 and 2**64 ----------------

FAR = (
    2**31 - 1,
    2**32,
    2**40,
    2**44 - 4096,
    2**44,
    2**62,
    2**63 - 4096,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 4096,
    2**65,
)
OFF_MAX = 2**63 - 1
FAR_APIS = (
    "read",
    "pread",
    "write",
    "pwrite",
    "read_many",
    "write_many",
    "batch_read",
    "batch_write",
    "read_async",
    "write_async",
)
REFUSED = (errno.EINVAL, errno.EFBIG, errno.EOVERFLOW)


@pytest.mark.parametrize("engine", ENGINES)
@profile(EXAMPLES[2])
@given(data=st.data())
def test_far_file_offsets(rt, workdir, tally, engine, data):
    """A read at or past EOF returns 0 and moves nothing; a write lands exactly at its
    offset or is refused (EINVAL / EFBIG / EOVERFLOW, or a TypeError / ValueError /
    OverflowError in Python) with nothing changed outside its extent (a prefix of it may
    land, as pwrite(2) does at the file system's size limit); past 2**63 - 1 nothing can
    succeed. An offset must never wrap (2**64 + k is not k)."""
    mode = data.draw(st.sampled_from(MODES), label="mode")
    ctx, s = _enter_settings(engine, mode, "small", 2, 32)
    path = workdir / f"far-{next(_counter)}.bin"
    b = stream = None
    try:
        tally.examples[engine] += 1
        init = rand_bytes(data.draw(st.integers(0, 2**32 - 1), label="seed"), data.draw(st.integers(1, 70000)))
        path.write_bytes(init.tobytes())
        api = data.draw(st.sampled_from(FAR_APIS), label="api")
        off = max(0, data.draw(st.sampled_from(FAR), label="far") + data.draw(st.integers(-4097, 4097), label="d"))
        size = data.draw(st.integers(1, 70000), label="size")
        bo = data.draw(st.integers(0, 100), label="buf offset")
        b = draw_buffer(data, rt, bo + size + 10)
        content = rand_bytes(data.draw(st.integers(0, 2**32 - 1), label="seed"), b.n)
        write = "write" in api
        if write:
            b.fill(content)
        with pio.open(path, "r+", direct=data.draw(st.sampled_from([None, True, False]), label="direct")) as f:
            try:
                if api in ("read", "write"):
                    got = getattr(f, api)(b.obj, size, off, bo)
                elif api in ("pread", "pwrite"):
                    got = _result(getattr(f, api)(b.obj, size, off, bo), api)
                elif api in ("read_many", "write_many"):
                    got = int(getattr(f, api)(b.obj, [off], [size], [bo])[0])
                elif api.startswith("batch"):
                    got = pio.batch([(f, b.obj, size, off, bo, "write" if write else "read")])[0]
                    if isinstance(got, BaseException):
                        raise got
                else:
                    stream = rt.stream_create()
                    sop = getattr(f, api)(b.obj, size, off, bo, stream)
                    _stream_sync(rt, stream, [sop], api)
                    got = sop.bytes_done
                    if got < 0:
                        raise PhxIOError(-got, str(path), off, size, api)
            except PhxIOError as exc:
                got = exc
            except (TypeError, ValueError, OverflowError) as exc:
                got = exc
        tally.op(engine, "far_" + api)
        refused = isinstance(got, (TypeError, ValueError, OverflowError)) or (
            isinstance(got, PhxIOError) and got.errno in REFUSED
        )
        what = f"{api} of {size} bytes at file offset {off} ({off - 2**63:+d} from 2**63) into {b.kind}"
        if isinstance(got, BaseException) and not refused:
            raise Mismatch(f"{what}: unexpected {got!r}")
        if not write:
            if off + size <= OFF_MAX and got != 0:
                raise Mismatch(f"{what}: want 0 (past EOF), got {got!r}")
            if not refused and got != 0:
                raise Mismatch(f"{what}: want 0 or a refusal, got {got!r}")
            msg = b.mismatch([], [(bo, size, 0)])
            if msg:
                raise Mismatch(f"{what}: {msg}")
            msg = file_mismatch(path, _model_of(init))
            if msg:
                raise Mismatch(f"{what}: the file changed: {msg}")
        else:
            msg = b.mismatch([(0, content)])
            if msg:
                raise Mismatch(f"{what}: the source changed: {msg}")
            if off + size > OFF_MAX and not refused:
                raise Mismatch(f"{what}: past 2**63 - 1, want a refusal, got {got!r}")
            model = _model_of(init)
            if not refused:
                if got != size:
                    raise Mismatch(f"{what}: count {got!r}, want {size}")
                fd = os.open(path, os.O_RDONLY)
                try:
                    landed = np.frombuffer(os.pread(fd, size, off), np.uint8)
                    fsize = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                if fsize != max(init.size, off + size) or not np.array_equal(landed, content[bo : bo + size]):
                    raise Mismatch(
                        f"{what}: file size {fsize} (want {max(init.size, off + size)}); the bytes at the "
                        f"offset {'match' if np.array_equal(landed, content[bo : bo + size]) else 'differ'}"
                    )
                os.truncate(path, init.size)  # (the sparse tail goes; the head must be unchanged)
            else:
                # refused: like pwrite(2) at the file system's size limit, a prefix of the
                # extent may have been written before the refusal; nothing outside the extent
                fd = os.open(path, os.O_RDONLY)
                try:
                    fsize = os.fstat(fd).st_size
                    part = np.frombuffer(os.pread(fd, max(0, fsize - off), off), np.uint8) if fsize > off else None
                finally:
                    os.close(fd)
                if fsize > max(init.size, off + size):
                    raise Mismatch(f"{what}: refused, but the file grew to {fsize}")
                if part is not None and not np.array_equal(part, content[bo : bo + part.size]):
                    raise Mismatch(f"{what}: refused, but the file's bytes at the offset are not the request's")
                if fsize > init.size:
                    os.truncate(path, init.size)
            msg = file_mismatch(path, model)
            if msg:
                raise Mismatch(
                    f"{what}: {'refused, but ' if refused else ''}the file's first {init.size} bytes changed: {msg}"
                )
    except Mismatch:
        with tally.lock:
            tally.mismatches += 1
        raise
    finally:
        try:
            if stream is not None:
                rt.stream_synchronize(stream)
                rt.stream_destroy(stream)
            if b is not None:
                b.free()
        finally:
            _leave_settings(ctx)
            if path.exists():
                path.unlink()


def _model_of(data: np.ndarray) -> SparseFile:
    m = SparseFile()
    m.write(0, data)
    return m


def test_operation_totals(tally):
    """(Last in the module: the totals so far, per engine; the full line is printed at the
    module's end.) No check failed in this process."""
    s = tally.summary()
    for e, v in sorted(s["engines"].items()):
        print(f"{e}: {v['operations']} operations, {v['requests']} requests, {v['external_operations']} external")
    assert s["mismatches"] == 0
