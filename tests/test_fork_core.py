"""fork() at any moment, through the public API: the child gets a working phoenix of its own.

Test side, core (phoenix/csrc/io_fork.c, phx_io.h "fork"), the host vendor's runtime (a test
double: phoenix/_testing/hostrt/hostrt_fork.c, vendors/host/runtime.py) and libphxfile
(phoenix/csrc/phxfile). Each scenario is a script run in a subprocess under a timeout (a
hung parent fails; a child is killed by its own alarm, which the parent reports), started in
tmp_path (not the checkout: its phoenix/ is not built). A child always ends by exiting the
interpreter normally, so what runs at exit (phoenix's atexit shutdown, the finalizers of the
parent's files, futures and stream ops) is part of what must not hang. tests/test_fork_core_c.py
is the same without Python (the C side alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import phoenix.io as pio

TIMEOUT = 180
ENGINES = ("io_uring", "threads")


def _run_script(code: str, tmp_path, *args, engine: str = "threads") -> subprocess.CompletedProcess:
    env = dict(os.environ, PHX_VENDOR="host", PHX_IO_ENGINE=engine)
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=tmp_path,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"hung: no exit within {TIMEOUT}s\n{out}")


@pytest.fixture(params=ENGINES)
def engine(request):
    if request.param == "io_uring" and pio.capabilities()["engines"]["io_uring"]["available"] is not True:
        pytest.skip("io_uring is not available here")
    return request.param


def _ok(r: subprocess.CompletedProcess):
    assert r.returncode == 0 and r.stdout.split()[:1] == ["ok"], f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"


# What every child does with a phoenix of its own (host and device memory, blocking and
# ordered on the host vendor's default stream), then how a script forks and reports.
_COMMON = r"""
import ctypes, errno, os, signal, sys, threading, time, traceback
import numpy as np
import phoenix.io as pio
from phoenix.errors import PhxIOError, VendorError
from phoenix.registry import get_runtime
from phoenix.vendor import CopyKind
rt = get_runtime()
DIR, FORKS = sys.argv[1], int(sys.argv[2])
H2D, D2H = CopyKind.HOST_TO_DEVICE, CopyKind.DEVICE_TO_HOST
POISON = 0xA5

def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

def looping(k, body):
    # a thread running body() until the script's `stop`, counting into loops[k]; a failure
    # goes to `errors` and stops them all
    def run():
        try:
            while not stop.is_set():
                body()
                loops[k] += 1
        except BaseException:
            errors.append(traceback.format_exc())
            stop.set()
    return threading.Thread(target=run)

def dev(n, data=None):
    d = rt.device_alloc(n)
    data = np.full(n, POISON, np.uint8) if data is None else data
    rt.memcpy(d, data.ctypes.data, n, H2D)
    return d

def dev_get(d, n):
    out = np.empty(n, np.uint8)
    rt.memcpy(out.ctypes.data, d, n, D2H)
    return out

def own_phoenix(i):
    n = (3 << 20) + 17 * i + 1
    x, y = rand(n, 100 + i), rand(n, 200 + i)
    with pio.open(os.path.join(DIR, f"child-{i}.bin"), "w+") as c:
        assert c.write(x) == n
        got = np.full(n + 8192, POISON, np.uint8)
        assert c.read(got, n, 0, 4096) == n
        assert np.array_equal(got[4096:4096 + n], x), "host bytes"
        assert (got[:4096] == POISON).all() and (got[4096 + n:] == POISON).all(), "bytes beside the extent"
        offs = np.arange(8) * 300_001
        many = np.zeros(8 * 4096, np.uint8)
        assert (c.read_many(many, offs, 4096) == 4096).all()
        assert all(np.array_equal(many[k * 4096:(k + 1) * 4096], x[o:o + 4096]) for k, o in enumerate(offs))
        a, b = dev(n, y), dev(n + 8192)
        w = c.write_async((a, n), n, 0, 0, 0)  # ordered on the default stream
        r = c.read_async((b, n + 8192), n, 0, 4096, 0)
        rt.stream_synchronize(0)
        assert w.result() == n and r.result() == n
        got = dev_get(b, n + 8192)
        assert np.array_equal(got[4096:4096 + n], y), "stream-ordered bytes"
        assert (got[:4096] == POISON).all() and (got[4096 + n:] == POISON).all(), "device bytes beside the extent"
        assert c.pread((b, n), n, 0, 0).result() == n and np.array_equal(dev_get(b, n), y), "device read"
        rt.device_free(a)
        rt.device_free(b)

def fork_each(k, child):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(30)  # also over the interpreter's exit: a hang there kills it too
        code = 1
        try:
            child(k)
            code = 0
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(code)  # a normal exit: atexit, finalizers of the parent's objects
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
"""

_BUSY = (
    _COMMON
    + r"""
N = (2 << 20) + 123
data = rand(N, 1)
f = pio.open(os.path.join(DIR, "parent.bin"), "w+")
assert f.write(data) == N
stop, errors, loops = threading.Event(), [], [0, 0, 0]


buf, small = np.empty(N, np.uint8), np.empty(8 * 4096, np.uint8)
offs = np.arange(8) * 257 * 1024 + np.arange(8)

def io_body():
    assert f.write(data) == N
    buf[:] = 0
    assert f.read(buf) == N and np.array_equal(buf, data)
    assert (f.read_many(small, offs, 4096) == 4096).all()
    assert all(np.array_equal(small[k * 4096:(k + 1) * 4096], data[o:o + 4096]) for k, o in enumerate(offs))
    assert f.pread(buf, 65536, 4096).result() == 65536 and np.array_equal(buf[:65536], data[4096:4096 + 65536])

hosts = [np.empty(1 << 16, np.uint8) for _ in range(16)]
devs = [(rt.device_alloc(1 << 16), 1 << 16) for _ in range(4)]
# 20,000 registrations above those (a later mapping): each registration of the thread's
# shifts them all, under the table's lock, which a fork then often finds held
table = np.empty(20_000 << 12, np.uint8)
for k in range(20_000):
    pio.register(table[k << 12 : (k + 1) << 12])

def reg_body():
    for b in hosts + devs:
        pio.register(b)
    for b in hosts + devs:
        pio.deregister(b)

S = (1 << 20) + 4097
s = rt.stream_create(0)
sdata = rand(S, 2)
d1, d2 = dev(S, sdata), dev(S)
g = pio.open(os.path.join(DIR, "stream.bin"), "w+")

def stream_body():
    w = g.write_async((d1, S), S, 0, 0, s)
    r = g.read_async((d2, S), S, 0, 0, s)
    rt.stream_synchronize(s)
    assert w.result() == S and r.result() == S
    assert np.array_equal(dev_get(d2, S), sdata)

bodies = {"io": io_body, "reg": reg_body, "stream": stream_body}
threads = [looping(k, bodies[name]) for k, name in enumerate(sys.argv[3].split(","))]
loops = loops[: len(threads)]
for t in threads:
    t.start()
time.sleep(0.2)
rng = np.random.default_rng(3)
bad = []
for k in range(FORKS):
    time.sleep(rng.random() * 0.03)
    code = fork_each(k, own_phoenix)
    if code:
        bad.append((k, code))
stop.set()
for t in threads:
    t.join()
assert not errors, errors[0]
assert all(loops), loops
io_body()  # the parent's I/O still completes correctly
stream_body()
assert not bad, f"children that failed (exit status, or -signal: -14 is its alarm): {bad}"
print("ok", loops)
"""
)


def test_children_forked_while_threads_do_io_and_registrations(tmp_path, engine):
    """Fork at random moments while one thread loops writes, reads, gathers and futures (every
    byte checked) and one registers and deregisters host and device buffers: each child
    writes and reads random bytes through a phoenix of its own (host and device memory,
    blocking and on the default stream; every byte checked, bytes beside each extent
    untouched) and exits normally within its bound; the parent's threads never fail and its
    I/O still works after. Before the fix a child now and then hung at its first request (the
    registration table's lock held at the fork by the registering thread; without Python in
    the way, tests/test_fork_core_c.py finds it held in most children)."""
    _ok(_run_script(_BUSY, tmp_path, tmp_path, 24, "io,reg", engine=engine))


def test_children_forked_while_a_thread_loops_stream_ops(tmp_path, engine):
    """As above, with one thread queueing stream-ordered writes and reads of device memory on a
    stream of its own and synchronizing it (every byte checked) and one doing blocking I/O:
    the children's own phoenix works and the parent's stream keeps working."""
    _ok(_run_script(_BUSY, tmp_path, tmp_path, 12, "io,stream", engine=engine))


_HELD = (
    _COMMON
    + r"""
import phoenix.settings as ps
from phoenix._testing import TEST_HOSTFN, TestHostFn
N = (1 << 20) + 4097
old, new, kept = rand(N, 1), rand(N, 2), rand(N, 3)
f = pio.open(os.path.join(DIR, "written.bin"), "w+")
k = pio.open(os.path.join(DIR, "kept.bin"), "w+")
assert f.write(old) == N and k.write(kept) == N
s = rt.stream_create(0)
gate = ctypes.c_int64(0)
hold = TestHostFn(kind=2, src=ctypes.addressof(gate), seq=-1, result=-999)
rt.launch_host_func(s, TEST_HOSTFN, ctypes.addressof(hold))
d1, d2, d3 = dev(N, new), dev(N), dev(N)
w = f.write_async((d1, N), N, 0, 0, s)  # behind the gate: listed, not done
r = f.read_async((d2, N), N, 0, 0, s)
with ps.override(mode="staged"):  # (direct, the call itself would wait for the stream)
    fut = k.pread((d3, N), N, 0, 0, stream=s)  # its device copy waits for the stream

def echild(call, what):
    try:
        call()
    except PhxIOError as exc:
        assert exc.errno == errno.ECHILD, (what, exc)
        return str(exc)
    raise AssertionError(f"{what}: no error")

def child(i):
    t0 = time.monotonic()
    # the parent's stream ops and future: done at once, ECHILD (nothing runs them here)
    assert w.wait(0) and r.wait(0) and w.done() and fut.done()
    msg = echild(w.result, "write_async")
    assert "written.bin" in msg, msg
    echild(r.result, "read_async")
    echild(fut.result, "pread")
    # a read of the range the parent's write covers: what the file has, at once
    got = np.zeros(N, np.uint8)
    assert f.read(got) == N and np.array_equal(got, old)
    # the held stream: its dropped work said once, then it runs new work
    try:
        rt.stream_synchronize(s)
        raise AssertionError("the held stream's dropped work was not reported")
    except VendorError as exc:
        assert "fork" in str(exc), exc
    rt.stream_synchronize(s)
    counter = ctypes.c_int64(0)
    tick = TestHostFn(kind=3, size=1, counter=ctypes.pointer(counter), seq=-1, result=-999)
    rt.launch_host_func(s, TEST_HOSTFN, ctypes.addressof(tick))
    rt.stream_synchronize(s)
    assert tick.seq == 0 and tick.result == 0 and counter.value == 1
    own_phoenix(i)
    assert k.read(got) == N and np.array_equal(got, kept)  # a parent's file, this child's engine
    f.close()  # the parent's file, with the parent's ops in flight: no waiting
    assert time.monotonic() - t0 < 20

codes = [fork_each(i, child) for i in range(FORKS)]
gate.value = 1
rt.stream_synchronize(s)
assert w.result() == N and r.result() == N and fut.result() == N
assert np.array_equal(dev_get(d2, N), new) and np.array_equal(dev_get(d3, N), kept)
got = np.zeros(N, np.uint8)
assert f.read(got) == N and np.array_equal(got, new)
assert codes == [0] * FORKS, f"children's exit status (or -signal: -14 is its alarm): {codes}"
print("ok")
"""
)


def test_children_forked_with_stream_ops_queued_on_a_held_stream(tmp_path, engine):
    """A stream held by a gate with a write_async, a read_async and a stream-ordered pread queued
    behind it, then fork: in the child those are done at once with ECHILD (the message names the
    file), a blocking read of the range the parent's write covers returns the file's bytes at
    once, the held stream reports its dropped work once and then runs new work, the child's own
    phoenix works (both engines, the default stream), the parent's files are read and closed
    without waiting, and the child exits normally; the parent's held work then completes with
    the right bytes. Before the fix: the child hung (waiting for the parent's stream ops)."""
    _ok(_run_script(_HELD, tmp_path, tmp_path, 2, engine=engine))


_PHXFILE = (
    r"""
import ctypes, os, sys
from phoenix import phxfile
lib = phxfile.load()  # before anything imports phoenix.io and its core, as LMCache does
"""
    + _COMMON
    + r"""
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64
N = 1 << 20
path = os.path.join(DIR, "slab.bin")
with open(path, "wb") as out:
    out.write(bytes(8 * N))
fd = os.open(path, os.O_RDWR)

def io(fn, fh, base, off, stream):
    n, fo, bo, res = ctypes.c_size_t(N), I64(off), I64(0), I64(12345)
    rc = fn(fh, V(base), P(n), P(fo), P(bo), P(res), V(stream))
    rt.stream_synchronize(stream)
    return rc, res.value

def round_trip(fh, slot, seed, stream):
    data = rand(N, seed)
    a, b = dev(N, data), dev(N)
    assert lib.phxFileBufRegister(V(a), N) == 0 and lib.phxFileBufRegister(V(b), N) == 0
    assert io(lib.phxFileWriteAsync, fh, a, slot * N, stream) == (0, N)
    assert io(lib.phxFileReadAsync, fh, b, slot * N, stream) == (0, N)
    assert np.array_equal(dev_get(b, N), data), "device bytes"
    host = np.full(N, POISON, np.uint8)
    assert io(lib.phxFileReadAsync, fh, host.ctypes.data, slot * N, stream) == (0, N)
    assert np.array_equal(host, data), "host bytes"
    assert lib.phxFileBufDeregister(V(a)) == 0 and lib.phxFileBufDeregister(V(b)) == 0
    rt.device_free(a)
    rt.device_free(b)

fh = V()
assert lib.phxFileHandleRegister(P(fh), fd) == 0
stop, errors, loops = threading.Event(), [], [0, 0]
s = rt.stream_create(0)


hosts = [np.empty(1 << 16, np.uint8) for _ in range(16)]

def reg_body():
    for h in hosts:
        assert lib.phxFileBufRegister(V(h.ctypes.data), h.nbytes) == 0
    for h in hosts:
        assert lib.phxFileBufDeregister(V(h.ctypes.data)) == 0

threads = [looping(0, lambda: round_trip(fh, 0, 1, s)), looping(1, reg_body)]
for t in threads:
    t.start()
time.sleep(0.2)

def child(i):
    n, fo, bo, res = ctypes.c_size_t(N), I64(0), I64(0), I64(12345)
    host = np.zeros(N, np.uint8)
    # the parent's handle is not the child's driver's
    assert lib.phxFileReadAsync(fh, V(host.ctypes.data), P(n), P(fo), P(bo), P(res), V(0)) == -errno.EBADF
    cfh = V()
    assert lib.phxFileHandleRegister(P(cfh), fd) == 0
    round_trip(cfh, 1 + i % 7, 100 + i, 0)  # on the default stream
    own_phoenix(i)
    assert lib.phxFileHandleDeregister(cfh) == 0
    assert lib.phxFileDriverClose() == 0

rng = np.random.default_rng(3)
codes = []
for i in range(FORKS):
    time.sleep(rng.random() * 0.03)
    codes.append(fork_each(i, child))
stop.set()
for t in threads:
    t.join()
assert not errors, errors[0]
assert all(loops), loops
round_trip(fh, 0, 2, s)  # the parent's driver still works
assert codes == [0] * FORKS, f"children's exit status (or -signal: -14 is its alarm): {codes}"
assert lib.phxFileHandleDeregister(fh) == 0 and lib.phxFileDriverClose() == 0
print("ok", loops)
"""
)


def test_children_forked_while_threads_use_libphxfile(tmp_path, engine):
    """libphxfile loaded before phoenix's core (as LMCache loads it), one thread looping
    register / write / read / deregister of device buffers through a handle (every byte
    checked), one registering and deregistering host buffers; fork at random moments: the
    parent's handle says EBADF in the child, whose own handle, registrations and round trips
    on the default stream work (every byte checked), as does its phoenix, and whose driver
    closes; the parent's driver keeps working."""
    _ok(_run_script(_PHXFILE, tmp_path, tmp_path, 6, engine=engine))


def _blocked(tid: int) -> set[int]:
    with open(f"/proc/self/task/{tid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return {sig for sig in range(1, 65) if mask & (1 << (sig - 1))}


def test_worker_threads_block_asynchronous_signals(tmp_path, engine, rt, dev):
    """The core's workers and file-mapping registrar and the host runtime's stream workers block
    the asynchronous signals (a process-directed SIGINT or SIGTERM goes to an application
    thread: Python's handlers) and not the synchronous ones a thread raises itself (SIGBUS of a
    copy from a truncated mapping must reach the fault guard). Before the fix the core's
    threads blocked nothing."""
    import phoenix.settings as ps

    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    data.tofile(tmp_path / "sig.bin")  # in the page cache: a read of it misses the file-mapping cache
    d = dev(data.nbytes)
    s = rt.stream_create(0)
    try:
        settings = ps.override(engine=engine, mode="staged", fmap_mode="auto", fmap_window=2 << 20)
        with settings, pio.open(tmp_path / "sig.bin", "r") as f:
            assert f.read(d.buf()) == data.nbytes  # staged: the workers' streams exist now
            assert np.array_equal(d.get(), data)
            assert pio.fmap_wait(timeout=30)  # a miss: the registrar started
            op = f.read_async(d.buf(), data.nbytes, 0, 0, s)
            rt.stream_synchronize(s)
            assert op.result() == data.nbytes
            names = {}
            for tid in map(int, os.listdir("/proc/self/task")):
                with open(f"/proc/self/task/{tid}/comm") as c:
                    names[tid] = c.read().strip()
            kinds = {"phx-io", "phx-fmap", "hostrt-stream"}
            workers = [t for t, n in names.items() if n in kinds]
            assert kinds <= set(names.values()), names
            for tid in workers:
                blocked = _blocked(tid)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGALRM):
                    assert sig in blocked, f"{names[tid]} ({tid}) does not block {sig!r}"
                for sig in (signal.SIGBUS, signal.SIGSEGV, signal.SIGFPE, signal.SIGILL):
                    assert sig not in blocked, f"{names[tid]} ({tid}) blocks {sig!r}"
            assert signal.SIGINT not in _blocked(threading.get_native_id())
    finally:
        rt.stream_destroy(s)
