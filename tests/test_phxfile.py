"""libphxfile.so, the phxFile* C ABI that LMCache's `phx` GDS backend loads.

The library is loaded through ctypes with LMCache's own signatures and driven the way
LMCache drives it (lmcache/v1/gpu_connector/gds_backends/phx.py and gds_context): a
slab file created, posix_fallocate'd and reopened O_RDWR|O_DIRECT, a "GPU tensor"
(host-vendor device memory) registered as consecutive regions of at most 16 MiB,
transfers split at region boundaries, results read from bytes_done after the stream is
synchronized. No phxFileDriverOpen first: LMCache never calls it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix import phxfile
from phoenix.registry import get_runtime

REGION = 16 << 20
POISON = 0xA5
EFAULT = -errno.EFAULT


@pytest.fixture(scope="module")
def lib():
    try:
        path = phxfile.library_path()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    lib = phxfile.load(path)
    yield lib
    assert lib.phxFileDriverClose() == 0


@pytest.fixture(scope="module")
def rt():
    return get_runtime()  # PHX_VENDOR=host (tests/conftest.py), the vendor the library selects too


@pytest.fixture
def stream(rt):
    s = rt.stream_create(0)
    yield s
    rt.stream_synchronize(s)
    rt.stream_destroy(s)


def _view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


class Slab:
    """LMCache's slab: <dir>/lmcache_gds_slab.bin, created, fallocated, reopened O_DIRECT."""

    def __init__(self, directory, size):
        self.path = os.path.join(directory, "lmcache_gds_slab.bin")
        self.size = (size + 4095) // 4096 * 4096
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.size)
        finally:
            os.close(fd)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            self.direct = True
        except OSError:  # tmpfs and some overlay file systems refuse O_DIRECT
            self.fd = os.open(self.path, os.O_RDWR)
            self.direct = False

    def contents(self) -> np.ndarray:
        with open(self.path, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)

    def close(self):
        os.close(self.fd)


class Submission:
    """What LMCache keeps alive until the stream sync: the four pointed-to arguments."""

    def __init__(self, size, file_offset, buf_offset):
        self.size = ctypes.c_size_t(size)
        self.file_offset = ctypes.c_int64(file_offset)
        self.buf_offset = ctypes.c_int64(buf_offset)
        self.result = ctypes.c_int64(-12345)

    def submit(self, fn, fh, buf_base, stream) -> int:
        return fn(
            fh,
            ctypes.c_void_p(buf_base),
            ctypes.byref(self.size),
            ctypes.byref(self.file_offset),
            ctypes.byref(self.buf_offset),
            ctypes.byref(self.result),
            ctypes.c_void_p(stream),
        )


def _regions(total: int):
    return [(off, min(REGION, total - off)) for off in range(0, total, REGION)]


def _pieces(total: int):
    """Transfers split at region boundaries, two per region (the second at a non-zero buf_offset)."""
    out = []
    for off, n in _regions(total):
        half = (n // 2) // 4096 * 4096 or n
        out.append((off, 0, half))
        if half < n:
            out.append((off, half, n - half))
    return out


def test_exports_exactly_the_ten_symbols():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    out = subprocess.run(
        [nm, "-D", "--defined-only", phxfile.library_path()], check=True, capture_output=True, text=True
    ).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == sorted(phxfile.SYMBOLS), out
    assert len(names) == 10


def test_library_has_soname_and_no_libpython_dependency():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) not installed")
    out = subprocess.run([objdump, "-p", phxfile.library_path()], check=True, capture_output=True, text=True).stdout
    assert "SONAME               libphxfile.so" in out
    assert "libpython" not in out


def test_env_hint_says_what_to_set():
    hint = phxfile.env_hint()
    assert phxfile.library_path() in hint
    if phxfile.library_dir() not in os.environ.get("LD_LIBRARY_PATH", ""):
        assert f"LD_LIBRARY_PATH={phxfile.library_dir()}" in hint


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_lmcache_sequence_round_trip(lib, rt, stream, tmp_path, mode):
    # the driver reads PHX_MODE when it opens: close it, and let the first call open it
    assert lib.phxFileDriverClose() == 0
    total = 4 * REGION + (1 << 20)  # the last region is short, as LMCache's can be
    slab = Slab(tmp_path, total)
    dev = rt.device_alloc(total)
    fh = ctypes.c_void_p()
    try:
        with ps.override(mode=mode):
            assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0  # opens the driver lazily
        assert fh.value
        for off, n in _regions(total):
            assert lib.phxFileBufRegister(ctypes.c_void_p(dev + off), ctypes.c_size_t(n)) == 0
        assert lib.phxFileStreamRegister(ctypes.c_void_p(stream)) == 0

        view = _view(dev, total)
        data = np.random.default_rng(8).integers(0, 256, total, dtype=np.uint8)
        view[:] = data
        subs = []
        for region, boff, n in _pieces(total):
            s = Submission(n, region + boff, boff)
            assert s.submit(lib.phxFileWriteAsync, fh, dev + region, stream) == 0
            subs.append(s)
        rt.stream_synchronize(stream)
        assert [s.result.value for s in subs] == [s.size.value for s in subs]
        assert np.array_equal(slab.contents()[:total], data)

        view[:] = POISON
        subs = []
        for region, boff, n in reversed(_pieces(total)):
            s = Submission(n, region + boff, boff)
            assert s.submit(lib.phxFileReadAsync, fh, dev + region, stream) == 0
            subs.append(s)
        rt.stream_synchronize(stream)
        assert [s.result.value for s in subs] == [s.size.value for s in subs]
        bad = np.flatnonzero(view != data)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:4]}"

        for off, _ in _regions(total):
            assert lib.phxFileBufDeregister(ctypes.c_void_p(dev + off)) == 0
        assert lib.phxFileStreamDeregister(ctypes.c_void_p(stream)) == 0
        assert lib.phxFileHandleDeregister(fh) == 0
    finally:
        rt.stream_synchronize(stream)
        lib.phxFileDriverClose()
        slab.close()
        rt.device_free(dev)


def test_extent_past_its_regions_is_refused(lib, rt, stream, tmp_path):
    """Regions registered one after another are one run: an extent across their boundary
    is served (from region 0's base, or a buf_base inside region 0); one that runs past the
    last region is refused at submission and moves nothing (a registration is the only end
    of a buffer libphxfile knows)."""
    total = 2 * REGION
    slab = Slab(tmp_path, total + 2 * REGION)
    dev = rt.device_alloc(total + REGION)  # memory past the regions, allocated, not registered
    fh = ctypes.c_void_p()
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        for off, n in _regions(total):
            assert lib.phxFileBufRegister(ctypes.c_void_p(dev + off), ctypes.c_size_t(n)) == 0
        view = _view(dev, total + REGION)
        view[:] = POISON
        before = slab.contents().copy()
        # past the last region (from region 0's base, and from region 1's): refused at submission
        for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
            for base, boff in ((dev, total - 4096), (dev + REGION, REGION - 4096)):
                s = Submission(8192, 0, boff)
                assert s.submit(fn, fh, base, stream) == EFAULT
                assert s.result.value == EFAULT
        # a buf_base inside the last region (not its base) does not widen it
        s = Submission(8192, 0, 0)
        assert s.submit(lib.phxFileReadAsync, fh, dev + total - 4096, stream) == EFAULT
        rt.stream_synchronize(stream)
        assert (view == POISON).all(), "bytes of the device buffer changed"
        assert np.array_equal(slab.contents(), before), "the slab changed"
        # across the boundary of regions 0 and 1: served, from region 0's base or inside it
        data = np.random.default_rng(9).integers(0, 256, 8192, dtype=np.uint8)
        with open(slab.path, "r+b") as out:
            out.write(data.tobytes())
        for base in (dev, dev + REGION - 4096):
            view[:] = POISON
            s = Submission(8192, 0, dev + REGION - 4096 - base)
            assert s.submit(lib.phxFileReadAsync, fh, base, stream) == 0
            rt.stream_synchronize(stream)
            assert s.result.value == 8192
            assert np.array_equal(view[REGION - 4096 : REGION + 4096], data)
            assert (view[: REGION - 4096] == POISON).all() and (view[REGION + 4096 :] == POISON).all()
    finally:
        rt.stream_synchronize(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        for off, _ in _regions(total):
            lib.phxFileBufDeregister(ctypes.c_void_p(dev + off))
        slab.close()
        rt.device_free(dev)


def test_overlapping_registration_refused_duplicate_counted(lib, rt):
    dev = rt.device_alloc(2 * REGION)
    try:
        assert lib.phxFileBufRegister(ctypes.c_void_p(dev), REGION) == 0
        assert lib.phxFileBufRegister(ctypes.c_void_p(dev), REGION) == 0  # exact duplicate: counted
        assert lib.phxFileBufRegister(ctypes.c_void_p(dev + 4096), REGION) == -errno.EINVAL
        assert lib.phxFileBufDeregister(ctypes.c_void_p(dev)) == 0
        assert pio._lib.phx_reg_lookup(dev, 1, None) == 0  # one reference left
        assert lib.phxFileBufDeregister(ctypes.c_void_p(dev)) == 0
        assert pio._lib.phx_reg_lookup(dev, 1, None) == 1
    finally:
        rt.device_free(dev)


def test_driver_close_is_idempotent_and_drops_only_its_registrations(lib, rt, tmp_path):
    regs_before = pio.stats()["registrations"]
    assert lib.phxFileDriverOpen() == 0
    assert lib.phxFileDriverOpen() == 0
    mine = rt.device_alloc(REGION)
    theirs = np.zeros(1 << 16, dtype=np.uint8)
    slab = Slab(tmp_path, 1 << 20)
    fh = ctypes.c_void_p()
    try:
        pio.register(theirs)  # a registration of phoenix.io's own, in the same core table
        assert lib.phxFileBufRegister(ctypes.c_void_p(mine), REGION) == 0
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        assert lib.phxFileDriverClose() == 0
        assert lib.phxFileDriverClose() == 0
        assert pio._lib.phx_reg_lookup(mine, 1, None) == 1  # dropped
        assert pio._lib.phx_reg_lookup(theirs.ctypes.data, 1, None) == 0  # kept
        assert lib.phxFileHandleDeregister(fh) == -errno.EBADF  # closed with the driver
        # and it opens again on the next call
        assert lib.phxFileBufRegister(ctypes.c_void_p(mine), REGION) == 0
        assert lib.phxFileDriverClose() == 0
        assert pio._lib.phx_reg_lookup(mine, 1, None) == 1
    finally:
        pio.deregister(theirs)
        slab.close()
        rt.device_free(mine)
    assert pio.stats()["registrations"] == regs_before


def test_found_the_way_lmcache_looks_with_ld_library_path():
    """What env_hint says to set works for LMCache's lookup (find_library, else the bare name)."""
    import sys

    code = (
        "import ctypes, ctypes.util; p = ctypes.util.find_library('phxfile') or 'libphxfile.so'; "
        "lib = ctypes.CDLL(p); print(p, hasattr(lib, 'phxFileReadAsync'))"
    )
    env = dict(os.environ, LD_LIBRARY_PATH=phxfile.library_dir())
    # a neutral working directory: `-c` puts it first on sys.path, and a checkout's phoenix/
    # source tree would shadow the installed package
    cwd = tempfile.gettempdir()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=cwd
    ).stdout
    assert out.split()[-1] == "True", out
    env["LD_LIBRARY_PATH"] = ""
    out = subprocess.run(
        [sys.executable, "-c", "from phoenix import phxfile; print(phxfile.env_hint())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    ).stdout
    assert f"export LD_LIBRARY_PATH={phxfile.library_dir()}" in out


def test_outside_python_every_call_says_enosys(tmp_path):
    """No libpython dependency: a C program can load the library; without an interpreter
    to ask for the vendor, the calls return -ENOSYS (nothing crashes)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "noc.c"
    src.write_text(
        "#include <dlfcn.h>\n#include <stdio.h>\n"
        "int main(int c, char **v) { void *h = dlopen(v[1], RTLD_NOW); if (!h) { puts(dlerror()); return 2; }\n"
        '  int (*op)(void) = (int (*)(void))dlsym(h, "phxFileDriverOpen");\n'
        '  int (*cl)(void) = (int (*)(void))dlsym(h, "phxFileDriverClose");\n'
        '  int (*dr)(const void *) = (int (*)(const void *))dlsym(h, "phxFileBufDeregister");\n'
        '  printf("%d %d %d\\n", op(), dr((void *)4096), cl()); return 0; }\n'
    )
    exe = tmp_path / "noc"
    subprocess.run([cc, str(src), "-o", str(exe), "-ldl"], check=True, capture_output=True)
    r = subprocess.run([str(exe), phxfile.library_path()], capture_output=True, text=True, check=True)
    assert r.stdout.split() == [str(-errno.ENOSYS), "0", "0"], r.stdout + r.stderr
    assert "no Python interpreter" in r.stderr


def test_threads_on_their_own_streams(lib, rt, tmp_path):
    """Several Python threads submit at once, each on its own stream and regions (the
    I/O path takes no GIL and no global lock but a shared one)."""
    import threading

    nthreads, per = 4, 2 * REGION
    total = nthreads * per
    slab = Slab(tmp_path, total)
    dev = rt.device_alloc(total)
    fh = ctypes.c_void_p()
    errors = []
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        for off, n in _regions(total):
            assert lib.phxFileBufRegister(ctypes.c_void_p(dev + off), ctypes.c_size_t(n)) == 0
        data = np.random.default_rng(21).integers(0, 256, total, dtype=np.uint8)
        view = _view(dev, total)
        view[:] = data

        def worker(i):
            try:
                s = rt.stream_create(0)
                base = i * per
                for _rep in range(3):
                    subs = []
                    for off in range(base, base + per, REGION):
                        w = Submission(REGION, off, 0)
                        assert w.submit(lib.phxFileWriteAsync, fh, dev + off, s) == 0
                        subs.append(w)
                    rt.stream_synchronize(s)
                    _view(dev + base, per)[:] = POISON
                    for off in range(base, base + per, REGION):
                        r = Submission(REGION, off, 0)
                        assert r.submit(lib.phxFileReadAsync, fh, dev + off, s) == 0
                        subs.append(r)
                    rt.stream_synchronize(s)
                    assert all(x.result.value == REGION for x in subs)
                    assert np.array_equal(_view(dev + base, per), data[base : base + per])
                rt.stream_destroy(s)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        for off, _ in _regions(total):
            lib.phxFileBufDeregister(ctypes.c_void_p(dev + off))
        slab.close()
        rt.device_free(dev)


# ---- faults: threads, lock order, the ABI boundary ---------------------------------------
#
# Anything that could hang runs in a subprocess under a timeout: a deadlock fails the test
# instead of hanging the run.

HANG_TIMEOUT = 60


def _run_script(code: str, *args, timeout: float = HANG_TIMEOUT) -> str:
    import sys

    try:
        r = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"hung: no exit within {timeout}s (deadlock)\n{out}")
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


_FIRST_CALLS = r"""
import ctypes, errno, os, sys, threading
import numpy as np
from phoenix import phxfile
lib = phxfile.load()
if sys.argv[3] == "pydll":  # a caller that keeps the GIL through the call
    py = ctypes.PyDLL(lib._name)
    for name in phxfile.SYMBOLS:
        getattr(py, name).argtypes, getattr(py, name).restype = getattr(lib, name).argtypes, ctypes.c_int
    lib = py
fd = os.open(sys.argv[1], os.O_RDWR)
rounds, nthreads = int(sys.argv[2]), 8
buf = np.zeros(1 << 16, dtype=np.uint8)
for rnd in range(rounds):
    barrier = threading.Barrier(nthreads)
    res = [None] * nthreads

    def first_call(i):
        barrier.wait()
        kind = i % 4
        if kind == 0:  # the first call of LMCache: a handle
            fh = ctypes.c_void_p()
            rc = lib.phxFileHandleRegister(ctypes.byref(fh), fd)
            if rc == 0:
                rc = lib.phxFileHandleDeregister(fh)
        elif kind == 1:  # a submission (on a handle nobody registered: opens, then EBADF)
            n, fo, bo, done = ctypes.c_size_t(4096), ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(1)
            rc = lib.phxFileReadAsync(ctypes.c_void_p(0x1000), ctypes.c_void_p(buf.ctypes.data), ctypes.byref(n),
                                      ctypes.byref(fo), ctypes.byref(bo), ctypes.byref(done), None)
            rc = 0 if rc == -errno.EBADF and done.value == rc else rc
        elif kind == 2:  # a buffer registration (classified through Python)
            p = ctypes.c_void_p(buf.ctypes.data + 4096 * i)
            rc = lib.phxFileBufRegister(p, 4096)
            if rc == 0:
                rc = lib.phxFileBufDeregister(p)
        else:
            rc = lib.phxFileStreamRegister(None)
        res[i] = rc

    ts = [threading.Thread(target=first_call, args=(i,), daemon=True) for i in range(nthreads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert res == [0] * nthreads, (rnd, res)
    assert lib.phxFileDriverClose() == 0  # and the next round's first calls open it again
print("ok", rounds)
"""


@pytest.mark.parametrize("loader", ["cdll", "pydll"])
def test_first_calls_from_eight_threads_at_once_do_not_deadlock(tmp_path, loader):
    """Eight Python threads make their first call at once without phxFileDriverOpen, through
    ctypes.CDLL (LMCache's: the GIL let go for the call) or PyDLL (the GIL kept): one opens
    (asking Python, which lets the GIL go and takes it back), the others wait for it; none
    may wait for the opener while holding the GIL."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (1 << 20))
    assert _run_script(_FIRST_CALLS, path, 20, loader).split() == ["ok", "20"]


_CLOSE_RACE = r"""
import ctypes, errno, os, sys, threading, time
import numpy as np
from phoenix import phxfile
from phoenix.registry import get_runtime
lib = phxfile.load()
rt = get_runtime()
fd = os.open(sys.argv[1], os.O_RDWR)
duration, nsub, N = float(sys.argv[2]), 3, 1 << 16
stop = time.monotonic() + duration
bad, done, devs = [], [0] * nsub, []
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64

def submitter(i):
    s = rt.stream_create(0)
    host = np.full(N, i + 1, dtype=np.uint8)
    dev = rt.device_alloc(N)
    try:
        while time.monotonic() < stop:
            fh = V()
            rc = lib.phxFileHandleRegister(P(fh), fd)
            if rc != 0:
                if rc > 0 or fh.value:
                    bad.append(("HandleRegister", rc))
                continue
            rb = lib.phxFileBufRegister(V(dev), N)
            if rb > 0:
                bad.append(("BufRegister", rb))
            subs = []
            for fn, base in ((lib.phxFileWriteAsync, host.ctypes.data), (lib.phxFileReadAsync, dev)):
                n, fo, bo, res = ctypes.c_size_t(N), I64(i * N), I64(0), I64(12345)
                rc = fn(fh, V(base), P(n), P(fo), P(bo), P(res), V(s))
                subs.append((rc, res))
            rt.stream_synchronize(s)
            for rc, res in subs:
                if rc > 0 or (rc == 0 and res.value != N) or (rc < 0 and res.value != rc):
                    bad.append(("submit", rc, res.value))
                elif rc == 0:
                    done[i] += 1
            if rb == 0 and lib.phxFileBufDeregister(V(dev)) != 0:
                bad.append("BufDeregister")
            rc = lib.phxFileHandleDeregister(fh)
            if rc not in (0, -errno.EBADF):  # EBADF: the driver closed it meanwhile
                bad.append(("HandleDeregister", rc))
    except BaseException as exc:
        bad.append(repr(exc))
    finally:
        rt.stream_synchronize(s)
        rt.stream_destroy(s)
        devs.append(dev)

def closer():
    k = 0
    while time.monotonic() < stop:
        rc = lib.phxFileDriverClose()
        if rc != 0:
            bad.append(("DriverClose", rc))
        if k % 2:
            rc = lib.phxFileDriverOpen()
            if rc != 0:
                bad.append(("DriverOpen", rc))
        k += 1
        time.sleep(0.002)

assert lib.phxFileDriverOpen() == 0  # the race under test is close/open, not the first calls
ts = [threading.Thread(target=submitter, args=(i,), daemon=True) for i in range(nsub)]
ts.append(threading.Thread(target=closer, daemon=True))
for t in ts:
    t.start()
for t in ts:
    t.join()
assert lib.phxFileDriverClose() == 0
assert not bad, bad[:10]
assert all(done), done
import phoenix.io as pio
assert all(pio._lib.phx_reg_lookup(d, 1, None) == 1 for d in devs), "registrations left behind"
print("ok", sum(done))
"""


def test_driver_close_and_open_racing_submitters(tmp_path):
    """Submitters (handle, buffer, write + read, stream sync) while another thread loops
    phxFileDriverClose / phxFileDriverOpen: nothing hangs or crashes; every call gives 0 or a
    clean negative errno, and an accepted submission its full byte count; no registration is
    left behind."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (4 << 16))
    out = _run_script(_CLOSE_RACE, path, 2.0)
    assert out.split()[0] == "ok", out


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("size", [100, 4096], ids=["unaligned", "aligned"])
def test_handle_on_o_append_fd_writes_at_the_offset(lib, rt, stream, tmp_path, direct, size):
    """Writes are positional (pwrite): a handle registered on an O_APPEND descriptor writes at
    the file offset asked for, not at the end; the caller's descriptor keeps its flags."""
    path = tmp_path / "append.bin"
    old = np.full(8192, 0x41, dtype=np.uint8)
    path.write_bytes(old.tobytes())
    flags = os.O_RDWR | os.O_APPEND | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        pytest.skip("the file system refuses O_DIRECT")
    fh = ctypes.c_void_p()
    raw = np.full(2 * 4096, 0x42, dtype=np.uint8)
    src = raw[(-raw.ctypes.data) % 4096 :][:size]  # page aligned: O_DIRECT can take it
    try:
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert lib.phxFileHandleRegister(ctypes.byref(fh), fd) == 0
        assert fcntl.fcntl(fd, fcntl.F_GETFL) == fl  # the caller's flags untouched
        s = Submission(size, 0, 0)
        assert s.submit(lib.phxFileWriteAsync, fh, src.ctypes.data, stream) == 0
        rt.stream_synchronize(stream)
        assert s.result.value == size
        got = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        want = old.copy()
        want[:size] = 0x42
        assert got.size == want.size, f"the write landed at the end: {got.size} bytes, not {want.size}"
        assert np.array_equal(got, want)
        # the caller's own descriptor still appends
        os.lseek(fd, 0, os.SEEK_SET)
        if not direct:
            os.write(fd, b"C")
            assert path.stat().st_size == 8193
    finally:
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        os.close(fd)


def test_out_of_range_extents_move_nothing(lib, rt, stream, tmp_path):
    """Offsets and sizes at the ABI boundary: negative offsets, nbytes at or past 2**63, a file
    range past 2**63, buf_offset + nbytes past the registered region (also by wrapping
    around): a negative errno at submission (also in *bytes_done), and no byte moves."""
    slab = Slab(tmp_path, 1 << 20)
    dev = rt.device_alloc(2 * REGION)
    host = np.full(1 << 16, POISON, dtype=np.uint8)
    fh = ctypes.c_void_p()
    big = 1 << 63
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        assert lib.phxFileBufRegister(ctypes.c_void_p(dev), REGION) == 0  # region 1 left unregistered
        view = _view(dev, 2 * REGION)
        view[:] = POISON
        before = slab.contents().copy()
        cases = [  # (nbytes, file_offset, buf_offset)
            (4096, -1, 0),
            (4096, -(1 << 63), 0),
            (4096, 0, -1),
            (4096, 0, -(1 << 63)),
            (big, 0, 0),
            (big + 4096, 0, 0),
            ((1 << 64) - 1, 0, 0),
            ((1 << 64) - 4096, 0, 4096),  # buf_base + buf_offset + nbytes wraps to buf_base
            (8192, big - 4096, 0),  # file_offset + nbytes past 2**63 - 1
            (4096, (1 << 63) - 1, 0),
        ]
        past_region = [  # only a registration says where a buffer ends
            (4096, 0, REGION),  # starts at the region's end
            (4096, 0, REGION - 4095),  # ends one byte past it
            (1, 0, (1 << 63) - 1),
            (big, 0, 0),
        ]
        for base, extents in ((dev, cases + past_region), (host.ctypes.data, cases)):
            for nbytes, foff, boff in extents:
                for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
                    s = Submission(nbytes, foff, boff)
                    rc = s.submit(fn, fh, base, stream)
                    assert rc < 0 and s.result.value == rc, (hex(base), nbytes, foff, boff, fn.__name__, rc)
        rt.stream_synchronize(stream)
        assert (view == POISON).all(), "bytes of the device buffer changed"
        assert (host == POISON).all(), "bytes of the host buffer changed"
        assert np.array_equal(slab.contents(), before), "the slab changed"
    finally:
        rt.stream_synchronize(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        lib.phxFileBufDeregister(ctypes.c_void_p(dev))
        slab.close()
        rt.device_free(dev)


_HUGE_REGISTRATION = r"""
import ctypes, errno, os
import numpy as np
import phoenix.io as pio
from phoenix import phxfile
from phoenix.registry import get_runtime
lib = phxfile.load()
host = np.zeros(1 << 16, dtype=np.uint8)
dev = get_runtime().device_alloc(1 << 20)
for base in (host.ctypes.data, dev):
    for length in (1 << 63, (1 << 63) + 4096, (1 << 64) - 4096):
        rc = lib.phxFileBufRegister(ctypes.c_void_p(base), ctypes.c_size_t(length))
        assert rc == -errno.EINVAL, (hex(base), length, rc)
    assert pio._lib.phx_reg_lookup(base, 1, None) == 1
assert lib.phxFileDriverClose() == 0
print("ok")
"""


def test_buf_register_of_2_63_bytes_or_more_is_refused():
    """phxFileBufRegister of 2**63 bytes or more (no buffer is that large; *bytes_done could
    not count it): -EINVAL, nothing registered. In a fresh process: no other registration
    above the buffer for the huge range to collide with."""
    assert _run_script(_HUGE_REGISTRATION).split() == ["ok"]


def test_null_pointers_return_negative_errno(lib, rt, stream, tmp_path):
    """NULL for any pointer argument: a negative errno (stored into *bytes_done where that is
    given), never a crash; a NULL bytes_done is allowed (nobody reads the count)."""
    slab = Slab(tmp_path, 1 << 20)
    fh = ctypes.c_void_p()
    buf = np.zeros(4096, dtype=np.uint8)
    V, P = ctypes.c_void_p, ctypes.byref
    try:
        assert lib.phxFileHandleRegister(P(fh), slab.fd) == 0
        n, fo, bo = ctypes.c_size_t(4096), ctypes.c_int64(0), ctypes.c_int64(0)
        for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
            args = [fh, V(buf.ctypes.data), P(n), P(fo), P(bo)]
            for i in range(5):
                res = ctypes.c_int64(12345)
                bad = list(args)
                bad[i] = None
                rc = fn(*bad, P(res), V(stream))
                assert rc == -errno.EINVAL and res.value == rc, (fn.__name__, i, rc, res.value)
            assert fn(*args, None, V(stream)) == 0  # no bytes_done: fine
        rt.stream_synchronize(stream)
        assert lib.phxFileHandleDeregister(None) == -errno.EINVAL
        assert lib.phxFileBufDeregister(None) == 0
        assert lib.phxFileStreamDeregister(None) == 0
    finally:
        rt.stream_synchronize(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        slab.close()


def test_unregistered_host_extent_into_unmapped_memory_is_refused(lib, rt, stream, tmp_path):
    """An unregistered host buffer has no known end; an extent that runs into memory not
    mapped at all is refused (-EFAULT) at submission instead of faulting in the core; so is
    a registration of such a range."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    import mmap

    page = mmap.PAGESIZE
    # far from where the process maps memory (top down from below the stack), so that no
    # allocation of this process fills the hole made below while the test runs
    hint = 0x2345_0000_0000
    addr = libc.mmap(
        ctypes.c_void_p(hint),
        4 * page,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000,
        -1,
        0,
    )  # MAP_FIXED_NOREPLACE
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    assert libc.munmap(ctypes.c_void_p(addr + 2 * page), 2 * page) == 0  # the second half: unmapped
    slab = Slab(tmp_path, 1 << 20)
    fh = ctypes.c_void_p()
    try:
        ctypes.memset(addr, POISON, 2 * page)
        before = slab.contents().copy()
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        for nbytes, boff in ((4 * page, 0), (page + 1, page), (100, 2 * page - 50), (4096, 3 * page)):
            for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
                s = Submission(nbytes, 0, boff)
                assert s.submit(fn, fh, addr, stream) == EFAULT, (nbytes, boff, fn.__name__)
                assert s.result.value == EFAULT
        rt.stream_synchronize(stream)
        assert (_view(addr, 2 * page) == POISON).all()
        assert np.array_equal(slab.contents(), before)
        s = Submission(2 * page, 0, 0)  # the mapped half is fine
        assert s.submit(lib.phxFileReadAsync, fh, addr, stream) == 0
        rt.stream_synchronize(stream)
        assert s.result.value == 2 * page
        # a registration (which the I/O path then trusts) is checked once, when it is made
        assert lib.phxFileBufRegister(ctypes.c_void_p(addr), 4 * page) == EFAULT
        assert lib.phxFileBufRegister(ctypes.c_void_p(addr + 3 * page), page) == EFAULT
        assert pio._lib.phx_reg_lookup(addr, 1, None) == 1
    finally:
        rt.stream_synchronize(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        slab.close()
        libc.munmap(ctypes.c_void_p(addr), 2 * page)


_C_THREADS_SRC = r"""
#include <pthread.h>
#include <stdint.h>
typedef int (*reg_fn)(void **, int);
typedef int (*dereg_fn)(void *);
static reg_fn reg; static dereg_fn dereg; static int the_fd;
static pthread_barrier_t bar;
static void *worker(void *arg) {
    void *fh = 0;
    pthread_barrier_wait(&bar);
    intptr_t rc = reg(&fh, the_fd);
    if (rc == 0) rc = dereg(fh);
    return (void *)rc;
}
/* n threads, not created by Python, make their first call at once; how many failed */
int run(void *r, void *d, int fd, int n) {
    pthread_t t[64]; reg = (reg_fn)r; dereg = (dereg_fn)d; the_fd = fd;
    if (n > 64) n = 64;
    pthread_barrier_init(&bar, 0, n);
    for (int i = 0; i < n; i++) pthread_create(&t[i], 0, worker, 0);
    int bad = 0;
    for (int i = 0; i < n; i++) { void *rc; pthread_join(t[i], &rc); bad += rc != 0; }
    pthread_barrier_destroy(&bar);
    return bad;
}
"""

_C_THREADS = r"""
import ctypes, os, sys, threading
from phoenix import phxfile
lib = phxfile.load()
c = ctypes.CDLL(sys.argv[1])
c.run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
fd = os.open(sys.argv[2], os.O_RDWR)
addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
py_busy = True

def spin():  # a Python thread that wants the GIL all along
    x = 0
    while py_busy:
        x += 1

t = threading.Thread(target=spin, daemon=True)
t.start()
for rnd in range(int(sys.argv[3])):
    bad = c.run(addr(lib.phxFileHandleRegister), addr(lib.phxFileHandleDeregister), fd, 8)
    assert bad == 0, (rnd, bad)
    assert lib.phxFileDriverClose() == 0
py_busy = False
print("ok")
"""


def test_first_calls_from_threads_not_created_by_python(tmp_path):
    """Eight C threads (no Python thread state) make their first call at once while a
    Python thread holds the GIL whenever it can."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "cthreads.c"
    src.write_text(_C_THREADS_SRC)
    so = tmp_path / "cthreads.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-pthread", str(src), "-o", str(so)], check=True, capture_output=True
    )
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    assert _run_script(_C_THREADS, so, path, 20).split() == ["ok"]


def test_close_between_classification_and_registration(lib, rt, monkeypatch):
    """A phxFileDriverClose that lands while phxFileBufRegister asks Python where the buffer
    lives: the registration is refused (-ESHUTDOWN), not made after the close dropped this
    library's registrations (where no Deregister would ever drop it)."""
    buf = np.zeros(1 << 16, dtype=np.uint8)
    real = phxfile._c_classify

    def classify_then_close(addr, size, out):
        rc = real(addr, size, out)
        assert lib.phxFileDriverClose() == 0  # (ctypes: the GIL let go; the close takes it itself)
        return rc

    assert lib.phxFileDriverOpen() == 0
    monkeypatch.setattr(phxfile, "_c_classify", classify_then_close)
    try:
        rc = lib.phxFileBufRegister(ctypes.c_void_p(buf.ctypes.data), buf.nbytes)
    finally:
        monkeypatch.undo()
    assert rc == -errno.ESHUTDOWN
    assert lib.phxFileBufDeregister(ctypes.c_void_p(buf.ctypes.data)) == 0
    assert pio._lib.phx_reg_lookup(buf.ctypes.data, 1, None) == 1, "a registration was left in the core's table"


_DEREG_RACE = r"""
import ctypes, errno, os, sys, threading
import numpy as np
from phoenix import phxfile
from phoenix.registry import get_runtime
lib = phxfile.load()
rt = get_runtime()
fd = os.open(sys.argv[1], os.O_RDWR)
V, P, I64 = ctypes.c_void_p, ctypes.byref, ctypes.c_int64
N, nsub, bad = 1 << 16, 2, []
buf = np.zeros(nsub * N, dtype=np.uint8)
assert lib.phxFileBufRegister(V(buf.ctypes.data), buf.nbytes) == 0
for rnd in range(int(sys.argv[2])):
    fh = V()
    assert lib.phxFileHandleRegister(P(fh), fd) == 0
    go = threading.Barrier(nsub + 1)

    def submitter(i):
        s = rt.stream_create(0)
        go.wait()
        subs = []
        for k in range(50):
            n, fo, bo, res = ctypes.c_size_t(N), I64(0), I64(i * N), I64(12345)
            rc = lib.phxFileReadAsync(fh, V(buf.ctypes.data), P(n), P(fo), P(bo), P(res), V(s))
            subs.append((rc, n, fo, bo, res))
            if rc == -errno.EBADF:
                break
        rt.stream_synchronize(s)
        rt.stream_destroy(s)
        for rc, *_, res in subs:
            if not ((rc == 0 and res.value == N) or (rc == -errno.EBADF and res.value == rc)):
                bad.append((rc, res.value))

    ts = [threading.Thread(target=submitter, args=(i,)) for i in range(nsub)]
    for t in ts:
        t.start()
    go.wait()
    rc = lib.phxFileHandleDeregister(fh)  # waits for the reads it let in
    if rc != 0:
        bad.append(("HandleDeregister", rc))
    for t in ts:
        t.join()
assert lib.phxFileBufDeregister(V(buf.ctypes.data)) == 0
assert lib.phxFileDriverClose() == 0
assert not bad, bad[:10]
print("ok")
"""


def test_handle_deregister_racing_in_flight_reads(tmp_path):
    """phxFileHandleDeregister while other threads submit reads on the handle: each read
    is either accepted and completes with its byte count, or refused with -EBADF."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\1" * (1 << 16))
    assert _run_script(_DEREG_RACE, path, 20).split() == ["ok"]


_FINALIZE = r"""
import ctypes, os, sys, threading
import numpy as np
from phoenix import phxfile
lib = phxfile.load()
fd = os.open(sys.argv[1], os.O_RDWR)
buf = np.zeros(1 << 16, dtype=np.uint8)
started = threading.Event()

def busy():  # a daemon thread still calling in (and opening, closing) while the interpreter exits
    V, P = ctypes.c_void_p, ctypes.byref
    while True:
        fh = V()
        if lib.phxFileHandleRegister(P(fh), fd) == 0:
            n, fo, bo, res = ctypes.c_size_t(4096), ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(0)
            lib.phxFileReadAsync(fh, V(buf.ctypes.data), P(n), P(fo), P(bo), P(res), None)
            lib.phxFileHandleDeregister(fh)
        lib.phxFileBufRegister(V(buf.ctypes.data + 4096), 4096)  # classified through Python
        lib.phxFileBufDeregister(V(buf.ctypes.data + 4096))
        lib.phxFileDriverClose()
        started.set()

for _ in range(3):
    threading.Thread(target=busy, daemon=True).start()
started.wait()
print("exiting", flush=True)
"""


def test_calls_during_interpreter_exit(tmp_path):
    """Daemon threads keep calling in while the interpreter finalizes: the process exits
    (no hang, no crash)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    for _ in range(5):
        assert _run_script(_FINALIZE, path, timeout=30).split() == ["exiting"]
