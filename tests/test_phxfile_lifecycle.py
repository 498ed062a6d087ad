"""libphxfile across the life of what it is handed: memory freed and made again, a forked
child, a Python signal handler that raises while a call runs Python.

Test side, adapter (phoenix/csrc/phxfile). The library is loaded with LMCache's ctypes
signatures (phoenix.phxfile.load); the vendor is the host reference vendor (tests/conftest.py).
Anything that could crash or hang runs in a subprocess under a timeout, started in tmp_path
(never the checkout: `python -c` there would import the unbuilt source tree).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

HANG_TIMEOUT = 60


def _run_script(code: str, tmp_path, *args, timeout: float = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """`python -c code args` in tmp_path (not the checkout: its phoenix/ is not built); a hang fails."""
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"hung: no exit within {timeout}s\n{out}")


_REALLOC = r"""
import ctypes, errno, os, sys
import numpy as np
from phoenix import phxfile
from phoenix.registry import get_runtime
lib, rt = phxfile.load(), get_runtime()
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64
G = 64 << 10  # the host vendor's allocation unit
BIG = 2 * G
s = rt.stream_create(0)

def view(addr, n):
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))

def io(fn, fh, base, nbytes):
    n, fo, bo, res = ctypes.c_size_t(nbytes), I64(0), I64(0), I64(12345)
    rc = fn(fh, V(base), P(n), P(fo), P(bo), P(res), V(s))
    rt.stream_synchronize(s)
    return rc, res.value

def alloc_at(addr, size):
    # the host vendor hands a freed range out again first fit, once its quarantine (the
    # 64 frees after it) lets it go: allocations that land elsewhere are held until one
    # lands at addr (a fresh process: its arena has no holes below addr), then freed
    held, got = [], None
    for _ in range(4096):
        p = rt.device_alloc(size)
        if p == addr:
            got = p
            break
        held.append(p)
        if len(held) % 2 == 0:
            rt.device_free(held.pop(0))
    for p in held:
        rt.device_free(p)
    return got

data = np.frombuffer(open(sys.argv[1], "rb").read(), dtype=np.uint8)
fd = os.open(sys.argv[1], os.O_RDWR)
fh = V()
assert lib.phxFileHandleRegister(P(fh), fd) == 0
a = rt.device_alloc(BIG)
# the old allocation: a read and a write of all of it, unregistered (classified)
assert io(lib.phxFileReadAsync, fh, a, BIG) == (0, BIG)
assert np.array_equal(view(a, BIG), data)
assert io(lib.phxFileWriteAsync, fh, a, BIG) == (0, BIG)
rt.device_free(a)
b = alloc_at(a, G)  # at the same address, half the size
assert b == a, "the vendor did not hand the freed address out again"
c = rt.device_alloc(G)  # first fit: right after it
assert c == b + G, (hex(b), hex(c))
view(b, G)[:] = 0x11
neighbour = np.random.default_rng(6).integers(0, 256, G, dtype=np.uint8)
view(c, G)[:] = neighbour
results = [io(fn, fh, b, BIG) for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync)]
bad = np.flatnonzero(view(c, G) != neighbour)
assert bad.size == 0, f"{bad.size} bytes of the next allocation changed, first at {bad[:4]} ({results})"
assert (view(b, G) == 0x11).all(), f"the buffer changed ({results})"
on_disk = np.frombuffer(open(sys.argv[1], "rb").read(), dtype=np.uint8)
assert np.array_equal(on_disk, data), f"the file changed ({results})"
assert results == [(-errno.EFAULT, -errno.EFAULT)] * 2, results
# the extent that fits the new allocation moves
assert io(lib.phxFileReadAsync, fh, b, G) == (0, G)
assert np.array_equal(view(b, G), data[:G]) and np.array_equal(view(c, G), neighbour)
assert lib.phxFileHandleDeregister(fh) == 0
assert lib.phxFileDriverClose() == 0
print("ok")
"""


def test_an_allocation_freed_and_made_again_is_classified_again(tmp_path):
    """An unregistered device buffer is classified through the vendor at each call: after its
    allocation is freed and a smaller one is made at the same address, an extent that fitted
    the old allocation runs past the new one and is refused (-EFAULT, also in *bytes_done);
    the allocation after it (random bytes) and the file keep every byte. In a fresh process,
    whose host-vendor arena hands the freed address out again."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(5).integers(0, 256, 2 << 16, dtype=np.uint8).tobytes())
    r = _run_script(_REALLOC, tmp_path, path)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"


_FORK = r"""
import ctypes, os, signal, sys, traceback
import numpy as np
from phoenix import phxfile
from phoenix.registry import get_runtime
lib, rt = phxfile.load(), get_runtime()
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64
N = 1 << 16
fd = os.open(sys.argv[1], os.O_RDWR)

def io(fn, fh, base, nbytes, foff, stream):
    n, fo, bo, res = ctypes.c_size_t(nbytes), I64(foff), I64(0), I64(12345)
    rc = fn(fh, V(base), P(n), P(fo), P(bo), P(res), V(stream))
    rt.stream_synchronize(stream)
    assert rc == 0 and res.value == nbytes, (fn.__name__, rc, res.value)

def round_trip(fh, dev, foff, seed, stream):
    # a registered device buffer and an unregistered host buffer: write, read back, every byte
    data = np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(dev))
    view[:] = data
    io(lib.phxFileWriteAsync, fh, dev, N, foff, stream)
    view[:] = 0xA5
    io(lib.phxFileReadAsync, fh, dev, N, foff, stream)
    assert np.array_equal(view, data), "device buffer"
    host = np.full(N, 0xA5, dtype=np.uint8)
    io(lib.phxFileReadAsync, fh, host.ctypes.data, N, foff, stream)
    assert np.array_equal(host, data), "host buffer"
    return data

# the parent: an open driver with a handle, a registration, a stream op done
s = rt.stream_create(0)
dev = rt.device_alloc(N)
fh = V()
assert lib.phxFileDriverOpen() == 0
assert lib.phxFileHandleRegister(P(fh), fd) == 0
assert lib.phxFileBufRegister(V(dev), N) == 0
mine = round_trip(fh, dev, 0, 1, s)

pid = os.fork()
if pid == 0:
    code = 1
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(30)  # a hang kills the child (SIGALRM), the parent reports it
        cs = rt.stream_create(0)
        cfh = V()
        assert lib.phxFileHandleRegister(P(cfh), fd) == 0
        assert lib.phxFileBufRegister(V(dev), N) == 0
        round_trip(cfh, dev, N, 2, cs)
        host = np.zeros(N, dtype=np.uint8)
        io(lib.phxFileReadAsync, cfh, host.ctypes.data, N, 0, cs)  # the parent's bytes
        assert np.array_equal(host, mine), "the parent's bytes"
        assert lib.phxFileBufDeregister(V(dev)) == 0
        assert lib.phxFileHandleDeregister(cfh) == 0
        assert lib.phxFileDriverClose() == 0
        rt.stream_destroy(cs)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
    f"child: exit {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else f"child: signal {os.WTERMSIG(status)}"
)
# the parent's driver still works, and sees the child's bytes
theirs = np.zeros(N, dtype=np.uint8)
io(lib.phxFileReadAsync, fh, theirs.ctypes.data, N, N, s)
assert np.array_equal(theirs, np.random.default_rng(2).integers(0, 256, N, dtype=np.uint8)), "the child's bytes"
round_trip(fh, dev, 0, 3, s)
assert lib.phxFileBufDeregister(V(dev)) == 0
assert lib.phxFileHandleDeregister(fh) == 0
assert lib.phxFileDriverClose() == 0
print("ok")
"""


def test_a_forked_child_opens_a_driver_of_its_own(tmp_path):
    """os.fork after the driver opened (a handle, a registration, I/O done): the child's first
    call opens a driver of its own (the parent's context has no threads in the child) and its
    open / register / write / read / close work, every byte checked; the parent's driver
    keeps working and sees the child's bytes."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (2 << 16))
    r = _run_script(_FORK, tmp_path, path)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"


_SIGNAL = r"""
import ctypes, errno, os, signal, sys
import numpy as np
import phoenix.io as pio
from phoenix import phxfile
from phoenix.registry import get_runtime
lib, rt = phxfile.load(), get_runtime()
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64
EXC = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[sys.argv[2]]
N = 1 << 16
fd = os.open(sys.argv[1], os.O_RDONLY)
data = np.frombuffer(open(sys.argv[1], "rb").read(), dtype=np.uint8)[:N]
s = rt.stream_create(0)
fh = V()
assert lib.phxFileHandleRegister(P(fh), fd) == 0
buf = np.full(N, 0xA5, dtype=np.uint8)

def handler(signum, frame):  # Ctrl-C's KeyboardInterrupt, or a handler that exits
    raise EXC(3)

signal.signal(signal.SIGUSR1, handler)
real = phxfile._c_classify

def classify_signalled(addr, size, out):  # the signal lands while libphxfile runs Python
    signal.raise_signal(signal.SIGUSR1)
    return real(addr, size, out)

def read(res):
    n, fo, bo = ctypes.c_size_t(N), I64(0), I64(0)
    return lib.phxFileReadAsync(fh, V(buf.ctypes.data), P(n), P(fo), P(bo), P(res), V(s))

caught = []
for op in ("read", "register"):
    res = I64(12345)
    phxfile._c_classify = classify_signalled
    try:
        if op == "read":  # an unregistered buffer: classified through Python
            read(res)
        else:
            lib.phxFileBufRegister(V(buf.ctypes.data), N)
        for _ in range(100):  # the handed-back exception is raised here at the latest
            pass
    except EXC as exc:
        caught.append((op, exc.args))
    finally:
        phxfile._c_classify = real
    rt.stream_synchronize(s)
    if op == "read":
        assert res.value == -errno.EINTR, res.value
        assert (buf == 0xA5).all(), "the refused read moved bytes"
    else:
        assert pio._lib.phx_reg_lookup(buf.ctypes.data, 1, None) == 1, "registered"
assert caught == [("read", (3,)), ("register", (3,))], caught
# the library goes on working
res = I64(12345)
assert read(res) == 0
rt.stream_synchronize(s)
assert res.value == N and np.array_equal(buf, data)
assert lib.phxFileHandleDeregister(fh) == 0
assert lib.phxFileDriverClose() == 0
print("ok")
"""


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit"])
def test_a_signal_handler_raising_inside_a_call_reaches_the_caller(tmp_path, exc):
    """A Python signal handler raises (Ctrl-C's KeyboardInterrupt, SystemExit) while a
    libphxfile call runs Python (classifying a buffer): the call fails with -EINTR (also in
    *bytes_done), moves nothing, registers nothing, and the exception reaches the caller
    (the process neither exits from inside the library nor loses the interrupt)."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    r = _run_script(_SIGNAL, tmp_path, path, exc)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
