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
        return fn(fh, ctypes.c_void_p(buf_base), ctypes.byref(self.size), ctypes.byref(self.file_offset),
                  ctypes.byref(self.buf_offset), ctypes.byref(self.result), ctypes.c_void_p(stream))


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
    out = subprocess.run([nm, "-D", "--defined-only", phxfile.library_path()], check=True, capture_output=True,
                         text=True).stdout
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


def test_extent_past_its_region_is_refused(lib, rt, stream, tmp_path):
    total = 2 * REGION
    slab = Slab(tmp_path, total)
    dev = rt.device_alloc(total)
    fh = ctypes.c_void_p()
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        for off, n in _regions(total):
            assert lib.phxFileBufRegister(ctypes.c_void_p(dev + off), ctypes.c_size_t(n)) == 0
        view = _view(dev, total)
        view[:] = POISON
        before = slab.contents().copy()
        # region 0 base, an extent running 4 KiB into region 1: refused at submission
        for fn in (lib.phxFileReadAsync, lib.phxFileWriteAsync):
            s = Submission(8192, 0, REGION - 4096)
            assert s.submit(fn, fh, dev, stream) == EFAULT
            assert s.result.value == EFAULT
        # a buf_base inside region 0 (not its base) does not widen it
        s = Submission(8192, 0, 0)
        assert s.submit(lib.phxFileReadAsync, fh, dev + REGION - 4096, stream) == EFAULT
        rt.stream_synchronize(stream)
        assert (view == POISON).all(), "bytes of the device buffer changed"
        assert np.array_equal(slab.contents(), before), "the slab changed"
        # the same extent split at the region boundary is fine
        subs = [Submission(4096, 0, REGION - 4096), Submission(4096, 4096, 0)]
        assert subs[0].submit(lib.phxFileReadAsync, fh, dev, stream) == 0
        assert subs[1].submit(lib.phxFileReadAsync, fh, dev + REGION, stream) == 0
        rt.stream_synchronize(stream)
        assert [s.result.value for s in subs] == [4096, 4096]
    finally:
        rt.stream_synchronize(stream)
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        for off, _ in _regions(total):
            lib.phxFileBufDeregister(ctypes.c_void_p(dev + off))
        slab.close()
        rt.device_free(dev)


def test_bad_arguments_return_negative_errno(lib, rt, stream, tmp_path):
    slab = Slab(tmp_path, 1 << 20)
    fh = ctypes.c_void_p()
    try:
        assert lib.phxFileHandleRegister(None, slab.fd) == -errno.EINVAL
        assert lib.phxFileHandleRegister(ctypes.byref(fh), -1) == -errno.EBADF
        assert lib.phxFileBufRegister(None, 4096) == -errno.EINVAL
        assert lib.phxFileBufRegister(ctypes.c_void_p(4096), 0) == -errno.EINVAL
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        buf = np.zeros(4096, dtype=np.uint8)
        s = Submission(4096, -4096, 0)
        assert s.submit(lib.phxFileReadAsync, fh, buf.ctypes.data, stream) == -errno.EINVAL
        s = Submission(4096, 0, 0)
        assert s.submit(lib.phxFileReadAsync, 0x1000, buf.ctypes.data, stream) == -errno.EBADF  # unknown handle
        assert s.result.value < 0
        assert lib.phxFileHandleDeregister(ctypes.c_void_p(0x1000)) == -errno.EBADF
    finally:
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        slab.close()


def test_unregistered_host_buffer_takes_the_slow_path(lib, rt, stream, tmp_path):
    slab = Slab(tmp_path, 1 << 20)
    fh = ctypes.c_void_p()
    try:
        assert lib.phxFileHandleRegister(ctypes.byref(fh), slab.fd) == 0
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        s = Submission(src.nbytes, 0, 0)
        assert s.submit(lib.phxFileWriteAsync, fh, src.ctypes.data, stream) == 0
        dst = np.zeros_like(src)
        r = Submission(dst.nbytes, 0, 0)
        assert r.submit(lib.phxFileReadAsync, fh, dst.ctypes.data, stream) == 0
        rt.stream_synchronize(stream)
        assert (s.result.value, r.result.value) == (src.nbytes, dst.nbytes)
        assert np.array_equal(src, dst)
    finally:
        if fh.value:
            lib.phxFileHandleDeregister(fh)
        slab.close()


def test_deregister_unknown_base_is_tolerated(lib, rt):
    assert lib.phxFileBufDeregister(ctypes.c_void_p(0x7F0000001000)) == 0
    dev = rt.device_alloc(REGION)
    try:
        assert lib.phxFileBufRegister(ctypes.c_void_p(dev), REGION) == 0
        assert lib.phxFileBufDeregister(ctypes.c_void_p(dev)) == 0
        assert lib.phxFileBufDeregister(ctypes.c_void_p(dev)) == 0  # twice: tolerated
        assert lib.phxFileBufDeregister(ctypes.c_void_p(dev + 4096)) == 0  # not a base
    finally:
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

    code = ("import ctypes, ctypes.util; p = ctypes.util.find_library('phxfile') or 'libphxfile.so'; "
            "lib = ctypes.CDLL(p); print(p, hasattr(lib, 'phxFileReadAsync'))")
    env = dict(os.environ, LD_LIBRARY_PATH=phxfile.library_dir())
    # a neutral working directory: `-c` puts it first on sys.path, and a checkout's phoenix/
    # source tree would shadow the installed package
    cwd = tempfile.gettempdir()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=cwd).stdout
    assert out.split()[-1] == "True", out
    env["LD_LIBRARY_PATH"] = ""
    out = subprocess.run([sys.executable, "-c", "from phoenix import phxfile; print(phxfile.env_hint())"], env=env,
                         capture_output=True, text=True, check=True, cwd=cwd).stdout
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
        "  int (*op)(void) = (int (*)(void))dlsym(h, \"phxFileDriverOpen\");\n"
        "  int (*cl)(void) = (int (*)(void))dlsym(h, \"phxFileDriverClose\");\n"
        "  int (*dr)(const void *) = (int (*)(const void *))dlsym(h, \"phxFileBufDeregister\");\n"
        "  printf(\"%d %d %d\\n\", op(), dr((void *)4096), cl()); return 0; }\n")
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
                    assert np.array_equal(_view(dev + base, per), data[base:base + per])
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
