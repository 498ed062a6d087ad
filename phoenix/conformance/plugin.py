"""pytest plugin of the conformance suite: vendor option, fixtures, capability records.

Control plane, test side. ``phx-port test <name>`` loads it with
``-p phoenix.conformance.plugin``; to run the suite by hand::

    pytest -p phoenix.conformance.plugin --phx-vendor host --pyargs phoenix.conformance

What it gives the suite:

* ``--phx-vendor NAME`` (default ``$PHX_VENDOR``, else ``auto``) and the ``rt``
  fixture: that vendor's runtime, created once per session through
  :func:`phoenix.registry.get_runtime` (so the I/O stack, when a later test module
  uses it, shares the instance under test);
* the ``capability`` marker (every suite test carries exactly one) and, with
  ``--phx-results FILE``, one JSON line per event (collected tests with their
  capability, each test's start and outcome) written as it happens, so that the
  runner can tell which test a crashed or hung process was in and resume after it
  (``--phx-resume``);
* a per-test watchdog (``--phx-test-timeout``): a test that hangs dumps its
  threads' stacks and ends the process, which the runner reports as that test's
  failure instead of waiting forever;
* helpers the test modules import: :class:`Resources` (allocations that are freed
  after each test), byte-exact comparison, random data that never contains the
  poison values, and :class:`CHelper`, the C host callbacks that the stream-ordering
  tests launch (compiled at test time; the LaunchHostFunc primitive takes a C
  function pointer, and a stream callback must never be Python).
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix import registry
from phoenix.errors import PhxError, UnknownVendorError, VendorUnavailable
from phoenix.vendor import CopyKind

from . import CAPABILITIES, read_events

H2H, H2D, D2H, D2D = CopyKind.HOST_TO_HOST, CopyKind.HOST_TO_DEVICE, CopyKind.DEVICE_TO_HOST, CopyKind.DEVICE_TO_DEVICE

#: what destinations are filled with before a copy (device-side and host-side)
POISON = 0xA5
#: what read-back buffers are filled with before a device-to-host read
READBACK_POISON = 0x5A
KiB, MiB = 1 << 10, 1 << 20

_SUITE_DIR = os.path.dirname(os.path.abspath(__file__))


# -- options and session state ---------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("phoenix", "Phoenix conformance suite")
    group.addoption(
        "--phx-vendor", default=None, metavar="NAME", help="vendor under test (default: $PHX_VENDOR, else auto)"
    )
    group.addoption(
        "--phx-results",
        default=None,
        metavar="FILE",
        help="append one JSON line per event (tests collected, started, finished) to FILE",
    )
    group.addoption(
        "--phx-resume",
        action="store_true",
        help="deselect the tests already recorded in --phx-results (resuming after a crash)",
    )
    group.addoption(
        "--phx-seed",
        type=int,
        default=0x5EED,
        metavar="N",
        help="base seed of the random data (each test derives its own from it and its name)",
    )
    group.addoption(
        "--phx-test-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="a test running longer dumps its stacks and ends the run (0: no limit)",
    )


class _Recorder:
    """Writes the JSON-lines event log the runner reads (one os.write per line)."""

    def __init__(self, path: str | None):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def emit(self, event: str, **fields):
        if self.fd is None:
            return
        line = json.dumps({"event": event, **fields}, default=str) + "\n"
        os.write(self.fd, line.encode())

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _vendor_name(config) -> str:
    import phoenix.settings

    return (config.getoption("--phx-vendor") or phoenix.settings.effective("vendor") or "auto").strip()


def pytest_configure(config):
    config.addinivalue_line("markers", "capability(name): conformance capability a test belongs to")
    config._phx_recorder = _Recorder(config.getoption("--phx-results"))
    _STATE["config"] = config
    # the watchdog writes here: the real stderr, not a test's captured output
    _STATE["stderr_fd"] = os.dup(2)


def pytest_sessionstart(session):
    config = session.config
    name = _vendor_name(config)
    rec = config._phx_recorder
    rec.emit("session", vendor=name, pid=os.getpid(), python=sys.version.split()[0])
    try:
        vendors = registry.discover()
        if name != "auto" and name not in vendors:
            raise UnknownVendorError(name, list(vendors))
    except UnknownVendorError as exc:
        rec.emit("error", message=str(exc))
        raise pytest.UsageError(str(exc)) from None
    # the stack under test (and anything it spawns) selects the same vendor
    os.environ["PHX_VENDOR"] = name


def pytest_unconfigure(config):
    rec = getattr(config, "_phx_recorder", None)
    if rec is not None:
        rec.close()
    fd = _STATE.pop("stderr_fd", None)
    if fd is not None:
        os.close(fd)


def _capability(item) -> str | None:
    marks = list(item.iter_markers("capability"))
    return marks[0].args[0] if marks and marks[0].args else None


def _in_suite(item) -> bool:
    return os.path.dirname(str(item.path)) == _SUITE_DIR


@pytest.hookimpl(tryfirst=True)  # before -k deselects: the report knows the whole suite
def pytest_collection_modifyitems(session, config, items):
    unmarked = [it.nodeid for it in items if _in_suite(it) and _capability(it) is None]
    if unmarked:
        raise pytest.UsageError("conformance tests without a capability marker: " + ", ".join(unmarked))
    # run in capability order (discovery first, errors last), keeping file order within each
    order = {name: i for i, name in enumerate(CAPABILITIES)}
    items.sort(key=lambda it: order.get(_capability(it) or "", len(order)))
    rec = config._phx_recorder
    rec.emit("collected", tests=[{"nodeid": it.nodeid, "capability": _capability(it)} for it in items])
    if config.getoption("--phx-resume") and rec.path:
        done = {ev["nodeid"] for ev in read_events(rec.path) if ev.get("event") == "result"}
        keep = [it for it in items if it.nodeid not in done]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[it for it in items if it.nodeid in done])
            items[:] = keep


def pytest_collectreport(report):
    # a suite module that fails to import must fail the run, not vanish from the table
    if report.failed:
        _STATE["config"]._phx_recorder.emit(
            "error", message=f"collecting {report.nodeid or 'the suite'} failed: {_short_message(report)}"
        )


# -- per-test records and the watchdog ----------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    config = item.config
    timeout = config.getoption("--phx-test-timeout") or 0
    config._phx_recorder.emit("start", nodeid=item.nodeid, capability=_capability(item), t=time.time(), timeout=timeout)
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout, exit=True, file=_STATE["stderr_fd"])
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


def _short_message(report) -> str:
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (path, lineno, reason)
        return str(lr[2]).removeprefix("Skipped: ")
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and crash.message:
        # keep the assertion's own message, drop pytest's "assert x\n + where ..." explanation
        lines = crash.message.splitlines()
        keep = [lines[0]]
        for line in lines[1:]:
            if line.lstrip().startswith(("assert ", "+", "where ", "and ")):
                break
            keep.append(line)
        # "phoenix.errors.VendorError: ..." -> "VendorError: ..."
        return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Z]\w*: )", "", " ".join(x.strip() for x in keep))
    return str(lr).strip().splitlines()[-1] if str(lr).strip() else ""


def _trim_traceback(text: str) -> str:
    """Drop pytest's own frames from a native traceback: start at the suite's first frame."""
    i = text.find(f'File "{_SUITE_DIR}{os.sep}')
    if i < 0:
        return text
    start = text.rfind("\n", 0, i) + 1
    return "Traceback (most recent call last):\n" + text[start:]


#: per-process state: the config (for hooks that are not given it) and test outcomes
_STATE: dict = {}
_OUTCOMES: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    # setup, call and teardown each report; one test's outcome is the worst of them
    st = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "message": "", "duration": 0.0})
    st["duration"] += report.duration
    if report.failed:
        if st["outcome"] != "failed":
            st["outcome"] = "failed"
            phase = "" if report.when == "call" else f"error in {report.when}: "
            st["message"] = phase + _short_message(report)
            st["longrepr"] = _trim_traceback(report.longreprtext or "")[-4000:]
    elif report.skipped and st["outcome"] == "passed":
        st["outcome"] = "skipped"
        st["message"] = _short_message(report)


def pytest_runtest_logfinish(nodeid, location):
    st = _OUTCOMES.pop(nodeid, None)
    if st is None:
        return
    _STATE["config"]._phx_recorder.emit("result", nodeid=nodeid, **st)


def pytest_sessionfinish(session, exitstatus):
    session.config._phx_recorder.emit("finish", exitstatus=int(exitstatus))


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def phx_vendor(request) -> str:
    """Name of the vendor under test (as requested: may be ``auto``)."""
    return _vendor_name(request.config)


@pytest.fixture(scope="session")
def vendor_entry(phx_vendor):
    """The registry's entry of the vendor under test (resolving ``auto``)."""
    vendors = registry.discover()
    name = phx_vendor
    if name == "auto":
        try:
            name = registry.select("auto", vendors).name
        except PhxError as exc:
            pytest.fail(f"auto selection found no vendor: {exc}")
    return vendors[name]


@pytest.fixture(scope="session")
def rt(request, vendor_entry):
    """The runtime under test, created once per session (skips when the vendor cannot serve)."""
    try:
        runtime = registry.get_runtime(vendor_entry.name)
    except VendorUnavailable as exc:
        if vendor_entry.probe().usable:  # a constructor must not refuse what the probe accepted
            pytest.fail(f"probe() says usable, but creating the runtime refused: {exc}", pytrace=False)
        pytest.skip(f"vendor unavailable: {exc}")
    rec = request.config._phx_recorder
    try:
        devices = [vars(d) if hasattr(d, "__dict__") else str(d) for d in runtime.devices()]
    except Exception as exc:  # reported by the discovery tests; the record is informational
        devices = f"devices() raised {type(exc).__name__}: {exc}"
    rec.emit(
        "vendor",
        name=vendor_entry.name,
        source=vendor_entry.source,
        location=vendor_entry.location,
        cls=f"{type(runtime).__module__}.{type(runtime).__qualname__}",
        is_test_double=bool(runtime.is_test_double),
        runtime_description=runtime.runtime_description,
        # the runtime library a shim-bound port loaded (an --emulated run checks it is the emulator)
        library=getattr(getattr(runtime, "rt", None), "library", None),
        p2p_page_size=runtime.p2p_page_size,
        devices=devices,
    )
    yield runtime
    registry.reset()


@pytest.fixture(scope="session")
def devices(rt):
    return rt.devices()


@pytest.fixture(scope="session")
def two_devices(devices):
    """Ordinals 0 and 1; skips on a vendor with a single device."""
    if len(devices) < 2:
        pytest.skip(
            f"needs 2 devices, the vendor has {len(devices)} (the host vendor exposes more with PHX_HOST_DEVICES=2)"
        )
    return devices[0].ordinal, devices[1].ordinal


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from --phx-seed and the test's name (reproducible per test)."""
    seed = (request.config.getoption("--phx-seed") ^ zlib.crc32(request.node.nodeid.encode())) & 0xFFFFFFFF
    return np.random.default_rng(seed)


@pytest.fixture
def mem(rt):
    """A :class:`Resources` for the test; everything it handed out is released afterwards."""
    res = Resources(rt)
    yield res
    res.release()


def _pool(request, n: int) -> np.ndarray:
    seed = request.config.getoption("--phx-seed") ^ n
    return avoid_poisons(np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy())


@pytest.fixture(scope="session")
def random_pool(request):
    """16 MiB + 64 KiB of random bytes, none equal to POISON or READBACK_POISON (made once)."""
    return _pool(request, 16 * MiB + 64 * KiB)


@pytest.fixture(scope="session")
def big_random_pool(request):
    """64 MiB + 64 KiB of random bytes, as :func:`random_pool` (made once, when a test needs it)."""
    return _pool(request, 64 * MiB + 64 * KiB)


@pytest.fixture(scope="session")
def chelper(tmp_path_factory) -> CHelper:
    """The compiled C host callbacks (skips when there is no C compiler)."""
    return CHelper.build(str(tmp_path_factory.mktemp("phx-chelper")))


# -- helpers the suite imports ----------------------------------------------------------


def addr(arr: np.ndarray) -> int:
    """Address of a numpy buffer's first byte."""
    return arr.ctypes.data


def host_view(ptr: int, n: int) -> np.ndarray:
    """A uint8 numpy view of ``n`` bytes of host memory at ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def avoid_poisons(a: np.ndarray) -> np.ndarray:
    """Replace, in place, bytes equal to a poison value, so that an unwritten byte always shows."""
    for p in (POISON, READBACK_POISON):
        a[a == p] = 0x3C
    return a


def random_bytes(rng, n: int) -> np.ndarray:
    return avoid_poisons(np.frombuffer(rng.bytes(n), dtype=np.uint8).copy())


def assert_bytes(actual: np.ndarray, expected: np.ndarray, what: str):
    """Assert two byte arrays are equal, every byte; the message locates the damage briefly."""
    assert actual.shape == expected.shape, f"{what}: {actual.size} bytes, expected {expected.size}"
    diff = np.flatnonzero(actual != expected)
    if diff.size:
        i, j = int(diff[0]), int(diff[-1])
        raise AssertionError(
            f"{what}: {diff.size} of {expected.size} bytes wrong, at offsets {i}..{j}; "
            f"first: got 0x{int(actual[i]):02x} expected 0x{int(expected[i]):02x}"
            + (f", last: got 0x{int(actual[j]):02x} expected 0x{int(expected[j]):02x}" if j != i else "")
        )


def write_device(rt, ptr: int, data: np.ndarray):
    """Synchronous host-to-device copy of a whole numpy buffer."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rt.memcpy(ptr, addr(data), data.size, H2D)


def fill_device(rt, ptr: int, n: int, value: int):
    write_device(rt, ptr, np.full(n, value, dtype=np.uint8))


def read_device(rt, ptr: int, n: int) -> np.ndarray:
    """Synchronous device-to-host copy into a fresh (poisoned) buffer."""
    out = np.full(n, READBACK_POISON, dtype=np.uint8)
    rt.memcpy(addr(out), ptr, n, D2H)
    return out


class Resources:
    """Allocations of one test, released in reverse order at teardown.

    A test that frees something itself (to check a refusal) calls :meth:`forget`.
    Releasing errors are collected and raised together: a runtime that cannot free
    what it handed out fails the test that used it.
    """

    def __init__(self, rt):
        self.rt = rt
        self._undo: list[tuple[str, int, object]] = []

    def dev(self, size: int, device: int = 0) -> int:
        ptr = self.rt.device_alloc(size, device)
        self._undo.append(("device_free", ptr, None))
        return ptr

    def pinned(self, size: int) -> tuple[int, np.ndarray]:
        """Pinned host memory: (address, numpy view)."""
        ptr = self.rt.host_alloc_pinned(size)
        self._undo.append(("host_free_pinned", ptr, None))
        return ptr, host_view(ptr, size)

    def register(self, arr: np.ndarray) -> int:
        """Register a numpy buffer (kept alive until it is unregistered)."""
        ptr = addr(arr)
        self.rt.host_register(ptr, arr.nbytes)
        self._undo.append(("host_unregister", ptr, arr))
        return ptr

    def stream(self, device: int = 0) -> int:
        s = self.rt.stream_create(device)
        self._undo.append(("stream_destroy", s, None))
        return s

    def keep(self, obj):
        """Keep ``obj`` (a buffer, a ctypes argument) alive until the test's resources go."""
        self._undo.append(("keep", 0, obj))
        return obj

    def forget(self, handle: int):
        for i in range(len(self._undo) - 1, -1, -1):
            if self._undo[i][1] == handle and self._undo[i][0] != "keep":
                del self._undo[i]
                return
        raise KeyError(handle)

    def release(self):
        errors = []
        # streams first (synchronized, so no queued work touches memory freed below)
        streams = [u for u in self._undo if u[0] == "stream_destroy"]
        for _, s, _ in streams:
            try:
                self.rt.stream_synchronize(s)
            except Exception as exc:
                errors.append(f"stream_synchronize({s:#x}): {exc}")
        for op, handle, _ in reversed(self._undo):
            if op == "keep":
                continue
            try:
                getattr(self.rt, op)(handle)
            except Exception as exc:
                errors.append(f"{op}({handle:#x}): {type(exc).__name__}: {exc}")
        self._undo.clear()
        if errors:
            raise AssertionError("releasing the test's resources failed: " + "; ".join(errors))


# -- the I/O stack on the vendor under test (the io_* capabilities) --------------------------

ENGINES = ("io_uring", "threads")
MODES = ("auto", "staged", "direct")
#: small chunks, so that modest sizes span several chunks (and chunk boundaries)
CHUNK = 64 * KiB
#: a small bounce pool: quick to pin on a real accelerator, still many chunks in flight
BOUNCE = 16 * MiB


@pytest.fixture(scope="module")
def io(rt):
    """phoenix.io bound to the runtime under test; what it can do here (``capabilities()``)."""
    pio.use_runtime(rt)
    try:
        yield pio.capabilities()
    finally:
        pio.shutdown()
        pio.use_runtime(None)


@pytest.fixture(params=ENGINES)
def engine(request, io):
    """Each I/O engine in turn (small chunks and bounce pool for the test)."""
    name = request.param
    selected = ps.get().engine  # PHX_IO_ENGINE: `phx-port test --engine`
    if selected != "auto" and selected != name:
        pytest.skip(f"this run selects the {selected} engine (PHX_IO_ENGINE={selected})")
    info = io["engines"][name]
    if not info["available"]:
        pytest.skip(f"the {name} engine is not available here: {info['why']}")
    with ps.override(engine=name, chunk_size=CHUNK, bounce_pool_size=BOUNCE):
        yield name


@pytest.fixture(params=MODES)
def mode(request, io, engine):
    """Each mode in turn: ``direct`` only where the vendor's device memory is direct-capable."""
    name = request.param
    if name != "auto":
        info = io["modes"][name]
        if not info["available"]:
            pytest.skip(f"mode {name} is not possible with this vendor: {info['why']}")
    with ps.override(mode=name):
        yield name


# -- the C host callbacks ----------------------------------------------------------------

CHELPER_SOURCE = r"""
/* Host callbacks of the conformance suite: launched with LaunchHostFunc, they run on
 * the runtime's thread in stream order and touch only host memory. One function, its
 * behaviour set by the task it is given (see phx_ct_task in plugin.py). */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
    long *counter;          /* shared sequence counter (atomic) */
    long seq;               /* order in which this task ran; -1 until it runs */
    long calls;             /* times it ran */
    long t_ns;              /* CLOCK_MONOTONIC when it finished */
    int *gate;              /* non-NULL: first wait until *gate != 0 ... */
    long gate_timeout_ns;   /* ... at most this long */
    int gate_timed_out;
    long sleep_ns;          /* then sleep this long */
    int fill;               /* then: fill >= 0: memset(dst, fill, n); else memcpy(dst, src, n) */
    const uint8_t *src;
    uint8_t *dst;
    size_t n;
    void *arg_seen;         /* the argument it was called with */
} phx_ct_task;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&ts, &ts) != 0) {}
}

void phx_ct_run(void *arg) {
    phx_ct_task *t = (phx_ct_task *)arg;
    t->arg_seen = arg;
    if (t->gate) {
        long deadline = now_ns() + t->gate_timeout_ns;
        while (!__atomic_load_n(t->gate, __ATOMIC_ACQUIRE)) {
            if (now_ns() > deadline) { t->gate_timed_out = 1; break; }
            sleep_ns(100000);
        }
    }
    if (t->sleep_ns > 0) sleep_ns(t->sleep_ns);
    if (t->dst && t->n) {
        if (t->fill >= 0) memset(t->dst, t->fill, t->n);
        else memcpy(t->dst, t->src, t->n);
    }
    t->t_ns = now_ns();
    __atomic_fetch_add(&t->calls, 1, __ATOMIC_ACQ_REL);
    t->seq = __atomic_fetch_add(t->counter, 1, __ATOMIC_ACQ_REL);
}
"""


class Task(ctypes.Structure):
    """Argument of ``phx_ct_run`` (layout of ``phx_ct_task`` in :data:`CHELPER_SOURCE`)."""

    _fields_ = [
        ("counter", ctypes.POINTER(ctypes.c_long)),
        ("seq", ctypes.c_long),
        ("calls", ctypes.c_long),
        ("t_ns", ctypes.c_long),
        ("gate", ctypes.POINTER(ctypes.c_int)),
        ("gate_timeout_ns", ctypes.c_long),
        ("gate_timed_out", ctypes.c_int),
        ("sleep_ns", ctypes.c_long),
        ("fill", ctypes.c_int),
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("n", ctypes.c_size_t),
        ("arg_seen", ctypes.c_void_p),
    ]

    @property
    def address(self) -> int:
        return ctypes.addressof(self)


class CHelper:
    """The compiled callbacks: ``fn`` is the address of ``phx_ct_run`` for launch_host_func."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.fn = ctypes.cast(self.lib.phx_ct_run, ctypes.c_void_p).value
        self.counter = ctypes.c_long(0)
        self._keep: list = []

    @classmethod
    def build(cls, workdir: str) -> CHelper:
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
        if not cc:
            pytest.skip(
                "no C compiler (gcc, cc or clang; or set CC): the host-callback tests "
                "compile a tiny C callback, since a stream callback may not be Python"
            )
        src = os.path.join(workdir, "phx_chelper.c")
        lib = os.path.join(workdir, "libphx_chelper.so")
        with open(src, "w") as fh:
            fh.write(CHELPER_SOURCE)
        proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", lib, src], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"the C compiler {cc} failed on the callback helper: {proc.stderr.strip()[:500]}")
        return cls(lib)

    def task(
        self,
        *,
        gate: ctypes.c_int | None = None,
        gate_timeout_s: float = 2.0,
        sleep_s: float = 0.0,
        fill: int | None = None,
        src: int = 0,
        dst: int = 0,
        n: int = 0,
    ) -> Task:
        """A new task (kept alive by the helper); its ``address`` is the callback's argument."""
        t = Task()
        t.counter = ctypes.pointer(self.counter)
        t.seq = -1
        if gate is not None:
            t.gate = ctypes.pointer(gate)
            t.gate_timeout_ns = int(gate_timeout_s * 1e9)
        t.sleep_ns = int(sleep_s * 1e9)
        t.fill = -1 if fill is None else fill
        t.src, t.dst, t.n = src, dst, n
        self._keep.append(t)
        return t

    def launch(self, rt, stream: int, task: Task):
        rt.launch_host_func(stream, self.fn, task.address)
