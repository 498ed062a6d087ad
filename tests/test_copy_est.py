"""When a polling worker looks at its copies again (phoenix/csrc/io_copy_est.h), against a
model of one stream that runs copies in order.

Test side. The header is pure arithmetic; it is built alone into a small library here and
driven by a simulated worker: a batch of copies is queued, the worker sleeps for what
copy_est_due says (or, with nothing predicted, for poll_ns steps doubled from IO_POLL_NS
as the worker does), looks, and tells copy_est_seen when it finds the batch done. The
model knows when each copy really ended, so it checks what a worker pays (looks per batch)
and what a caller pays (time between a copy's end and the look that sees it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phoenix

CSRC = Path(phoenix.__file__).parent / "csrc"
POLL_NS = 20_000  # IO_POLL_NS (io_common.h): the first step when nothing is predicted
POLL_MAX_NS = 320_000  # IO_POLL_MAX_NS
MIN_NS = DUE_MAX_NS = LEARN_BYTES = NS_B_MAX = 0.0  # io_copy_est.h's, read from the built library (lib)

WRAP = r"""
#include "io_copy_est.h"
int est_queued(struct copy_est *c) { return copy_est_queued(c); }
void est_seen(struct copy_est *c, uint64_t b, int64_t q, int64_t now, int learn) { copy_est_seen(c, b, q, now, learn); }
int64_t est_due(const struct copy_est *c, uint64_t b, int64_t q, int probe, int64_t now)
{ return copy_est_due(c, b, q, probe, now); }
const double est_limits[] = {IO_POLL_MIN_NS, IO_POLL_DUE_MAX_NS, IO_POLL_LEARN_BYTES, IO_POLL_NS_B_MAX};
"""


class Est(ctypes.Structure):
    _fields_ = [
        ("ns_b", ctypes.c_double),
        ("seen_ns", ctypes.c_int64),
        ("batches", ctypes.c_uint),
        ("chain", ctypes.c_int),
    ]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to build io_copy_est.h")
    d = tmp_path_factory.mktemp("est")
    (d / "wrap.c").write_text(WRAP)
    so = d / "libest.so"
    subprocess.run(
        [cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", f"-I{CSRC}", "-o", str(so), str(d / "wrap.c")], check=True
    )
    lib = ctypes.CDLL(str(so))
    p = ctypes.POINTER(Est)
    lib.est_queued.argtypes, lib.est_queued.restype = [p], ctypes.c_int
    lib.est_seen.argtypes = [p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.est_seen.restype = None
    lib.est_due.argtypes = [p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    lib.est_due.restype = ctypes.c_int64
    global MIN_NS, DUE_MAX_NS, LEARN_BYTES, NS_B_MAX
    MIN_NS, DUE_MAX_NS, LEARN_BYTES, NS_B_MAX = (ctypes.c_double * 4).in_dll(lib, "est_limits")
    return lib


def run(lib, copies, nbytes, start_ns=1_000_000):
    """A worker queues each batch of nbytes when it saw the last one done (the stream is then
    idle) and looks until it sees it done; copies[i] is how long batch i's copy really takes.
    Returns, per batch, (looks, ns between the copy's end and the look that saw it)."""
    est, t, out = Est(), start_ns, []
    for took in copies:
        queued, ends = t, t + took
        probe = lib.est_queued(ctypes.byref(est))
        looks, step = 0, POLL_NS
        while True:
            due = lib.est_due(ctypes.byref(est), nbytes, queued, probe, t)
            assert due == 0 or MIN_NS <= due <= DUE_MAX_NS, due
            if not due:  # the worker's own steps (io_worker.c poll_bound)
                due, step = step, min(step * 2, POLL_MAX_NS)
            t += due
            looks += 1
            if t >= ends:
                lib.est_seen(ctypes.byref(est), nbytes, queued, t, 1)
                break
        out.append((looks, t - ends))
    return out, est


# batches of 1-64 MiB whose copies take 50 us - 0.9 ms: the range the prediction is for
MIB = st.integers(1, 64)
TOOK = st.integers(50_000, 900_000)


@settings(max_examples=60, deadline=None)
@given(MIB, TOOK, st.sampled_from([0.0, 0.02, 0.05, 0.1]), st.randoms(use_true_random=False))
def test_steady_copies_are_seen_in_few_looks_and_soon(lib, mib, took, jitter, rnd):
    """Copies of one size at one speed (within a jitter of up to 10%): after a warm-up a batch
    costs the worker 1.3 looks on average without jitter, under 2 with it (steps doubled
    from 20 us: 2-6), and each is seen within an eighth of its time, plus two poll steps
    where a copy ran slower than the one before, of its end."""
    nbytes = mib << 20
    copies = [int(took * (1 + rnd.uniform(-jitter, jitter))) for _ in range(96)]
    out, _ = run(lib, copies, nbytes)
    steady = out[32:]
    mean_looks = sum(n for n, _ in steady) / len(steady)
    assert mean_looks <= 1.3 + 6 * jitter, f"{mean_looks:.2f} looks per batch: {steady[:8]}"
    for (_, late), c in zip(steady, copies[32:], strict=True):
        assert late <= c / 7 + 3 * POLL_NS, f"seen {late / 1e3:.0f} us after a {c / 1e3:.0f} us copy"


@settings(max_examples=40, deadline=None)
@given(MIB, TOOK, st.integers(2, 2000))
def test_a_long_first_copy_is_forgotten(lib, mib, took, factor):
    """The first batch waited (for the caller's stream, a cold start) factor times its copy:
    within 24 batches the looks are as close to the copies' ends as in the steady state."""
    nbytes = mib << 20
    out, _ = run(lib, [took * factor] + [took] * 48, nbytes)
    for _, late in out[25:]:
        assert late <= took / 7 + POLL_NS + 1_000, f"{late / 1e3:.0f} us late, {out[1:26]}"


@settings(max_examples=40, deadline=None)
@given(MIB, TOOK, TOOK)
def test_copies_that_change_speed_are_followed(lib, mib, before, after):
    """The copies become slower or faster (up to 18 times) after 32 batches: 40 batches
    later a batch again costs 1.3 looks on average, each seen soon after its end."""
    nbytes = mib << 20
    out, _ = run(lib, [before] * 32 + [after] * 88, nbytes)
    steady = out[72:]
    assert sum(n for n, _ in steady) / len(steady) <= 1.3, steady[:8]
    for _, late in steady:
        assert late <= after / 7 + POLL_NS + 1_000, f"{late / 1e3:.0f} us late after a {after / 1e3:.0f} us copy"


@settings(max_examples=60, deadline=None)
@given(MIB, TOOK, st.integers(2, 10**6))
def test_one_long_wait_raises_the_estimate_by_an_eighth_at_most(lib, mib, took, factor):
    """A batch that waited long (the caller's stream) moves the estimate up by an eighth of
    itself at most: it is not taken for the copies' speed."""
    nbytes = mib << 20
    _, est = run(lib, [took] * 24, nbytes)
    learnt = est.ns_b
    t = est.seen_ns
    lib.est_queued(ctypes.byref(est))
    lib.est_seen(ctypes.byref(est), nbytes, t, t + took * factor, 1)
    assert est.ns_b <= learnt * 9 / 8 * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**64 - 1),  # bytes
            st.integers(0, 2**62),  # queued at
            st.integers(0, 2**62),  # seen at / looked at
            st.booleans(),  # learn / probe
        ),
        max_size=30,
    )
)
def test_any_input_gives_a_due_in_range(lib, ops):
    """Whatever the sizes and times (0 bytes, 2^64 - 1 bytes, clocks far apart or going
    back): the estimate stays in [0, IO_POLL_NS_B_MAX] and a due is 0 or within
    [IO_POLL_MIN_NS, IO_POLL_DUE_MAX_NS]; batches under IO_POLL_LEARN_BYTES teach nothing."""
    est = Est()
    for nbytes, queued, now, flag in ops:
        probe = lib.est_queued(ctypes.byref(est))
        assert probe in (0, 1)
        due = lib.est_due(ctypes.byref(est), nbytes, queued, int(flag), now)
        assert due == 0 or MIN_NS <= due <= DUE_MAX_NS
        before = est.ns_b
        lib.est_seen(ctypes.byref(est), nbytes, queued, now, int(flag))
        assert 0 <= est.ns_b <= NS_B_MAX
        if nbytes < LEARN_BYTES or not flag:
            assert est.ns_b == before
