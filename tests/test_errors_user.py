"""Errors a person can act on: the standard ``OSError`` subclasses, the file (and the
extent, where there is one) named once, and a message that says what to fix.

On the host vendor, in both engines where the request reaches one.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import phoenix.io as pio
import phoenix.settings as ps
from phoenix.checks import ArgumentError
from phoenix.cli import _run
from phoenix.errors import PhxIOError, extent_error

ENGINES = ["io_uring", "threads"]


@pytest.fixture(params=ENGINES)
def engine(request):
    with ps.override(engine=request.param):
        yield request.param


def once(e: BaseException, path) -> str:
    """The message of ``e``; it names ``path`` exactly once and carries no Python repr."""
    msg = str(e)
    assert msg.count(str(path)) == 1, f"the path is not named exactly once: {msg}"
    assert "[Errno" not in msg and "'" + str(path) + "'" not in msg, msg
    return msg


def opening(e: BaseException, path, cls: type, err: int) -> str:
    """An error of opening ``path``: ``cls`` and PhxIOError, the errno, the file, no extent."""
    assert isinstance(e, cls) and isinstance(e, PhxIOError), type(e).__mro__
    assert e.errno == err and e.filename == str(path) and e.path == str(path), repr(e)
    assert e.offset is None and e.length is None, f"an open has no extent: {e!r}"
    msg = once(e, path)
    assert "offset" not in msg and "length" not in msg, msg
    assert _run.describe(e) == msg  # the CLIs print it as it is
    return msg


def extent(e: BaseException, path, offset: int, length: int, err: int) -> str:
    """An extent error: the errno, the file once, the offset and the length once."""
    assert isinstance(e, PhxIOError), f"{type(e).__name__}: {e}"
    assert e.errno == err, f"errno {e.errno}: {e}"
    assert (e.filename, e.offset, e.length) == (str(path), offset, length), repr(e)
    msg = once(e, path)
    assert msg.startswith(f"{path}, offset {offset}, length {length}: "), msg
    assert msg.count("offset") == msg.count("buffer offset") + 1, msg
    return msg


# ---- opening a file: path only ------------------------------------------------------------


def test_missing_file_is_file_not_found(rt, tmp_path):
    path = tmp_path / "y.bin"
    with pytest.raises(FileNotFoundError) as ei:
        pio.open(path, "r")
    assert opening(ei.value, path, FileNotFoundError, errno.ENOENT) == f"{path}: No such file or directory"
    with pytest.raises(PhxIOError) as ei:  # both catch it
        pio.open(path, "rb")
    assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError) as ei:
        pio.open(path, "r+")
    assert "'w'" in opening(ei.value, path, FileNotFoundError, errno.ENOENT)  # how to create it


def test_missing_directory_names_it(rt, tmp_path):
    path = tmp_path / "no" / "y.bin"
    for mode in ("w", "a", "x+"):
        with pytest.raises(FileNotFoundError) as ei:
            pio.open(path, mode)
        msg = opening(ei.value, path, FileNotFoundError, errno.ENOENT)
        assert f"its directory {tmp_path / 'no'} does not exist" in msg and "create it" in msg, msg


def test_directory_is_a_directory(rt, tmp_path):
    for mode in ("r", "r+", "w"):
        with pytest.raises(IsADirectoryError) as ei:
            pio.open(tmp_path, mode)
        msg = opening(ei.value, tmp_path, IsADirectoryError, errno.EISDIR)
        assert "directory" in msg and "path of a file" in msg, msg


def test_not_a_directory(rt, tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as ei:
        pio.open(f / "y.bin", "r")
    assert "is a file" in opening(ei.value, f / "y.bin", NotADirectoryError, errno.ENOTDIR)


def test_exclusive_create_of_an_existing_file(rt, tmp_path):
    path = tmp_path / "y.bin"
    path.write_bytes(b"x")
    with pytest.raises(FileExistsError) as ei:
        pio.open(path, "x")
    msg = opening(ei.value, path, FileExistsError, errno.EEXIST)
    assert "'x'" in msg and "'w'" in msg and "'r+'" in msg, msg


_AS_NOBODY = r"""
import json, sys
import phoenix.io as pio
out = []
for path, mode in json.loads(sys.argv[1]):
    try:
        pio.open(path, mode).close()
        out.append(None)
    except Exception as e:
        out.append([type(e).__name__, isinstance(e, PermissionError), isinstance(e, pio.PhxIOError), e.errno,
                    e.filename, e.offset, str(e)])
print(json.dumps(out))
"""


def _open_denied(cases):
    """Open each (path, mode) where permission is denied: as this user, or (root) as nobody."""
    import json

    env = dict(os.environ, PHX_VENDOR="host")
    cmd = [sys.executable, "-c", _AS_NOBODY, json.dumps(cases)]
    if os.geteuid() == 0:  # root may open anything: the child runs as nobody
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root, and no setpriv to run a child as nobody")
        cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=120)
    if r.returncode != 0:
        pytest.skip(f"cannot run a child without the permission: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def test_permission_denied_is_permission_error(rt):
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        os.chmod(d, 0o755)
        secret = os.path.join(d, "secret.bin")
        with open(secret, "wb") as fh:
            fh.write(b"x" * 4096)
        os.chmod(secret, 0o000 if os.geteuid() else 0o600)  # (root's file, mode 600: not nobody's)
        locked = os.path.join(d, "locked")
        os.mkdir(locked, 0o555 if os.geteuid() else 0o755)
        new = os.path.join(locked, "new.bin")
        res = _open_denied([[secret, "r"], [secret, "r+"], [new, "w"]])
    for (path, mode), got in zip([(secret, "r"), (secret, "r+"), (new, "w")], res, strict=True):
        assert got is not None, f"{path} opened with {mode!r}: permission was not denied"
        name, is_perm, is_phx, err, filename, offset, msg = got
        assert is_perm and is_phx and err == errno.EACCES, got
        assert filename == path and offset is None, got
        assert msg.count(path) == 1 and "Permission denied" in msg and f"mode {mode!r}" in msg, msg
        if path == new:
            assert f"directory {locked}" in msg, msg
        elif mode == "r+":
            assert "open it with 'r'" in msg, msg


# ---- the wrong open mode: what to open it with ----------------------------------------------


def test_write_to_a_read_only_file_says_how_to_open_it(rt, engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\1" * 16384)
    buf = bytearray(b"\2" * 8192)
    hint = "opened read-only ('r'); open it with 'r+', 'w' or 'a' to write"
    with pio.open(path, "r") as f:
        with pytest.raises(PhxIOError) as ei:
            f.write(buf, 8192, 4096)
        msg = extent(ei.value, path, 4096, 8192, errno.EBADF)
        assert hint in msg and "Bad file descriptor" not in msg, msg
        with pytest.raises(PhxIOError) as ei:
            f.pwrite(buf, 100, 7).result()
        assert hint in extent(ei.value, path, 7, 100, errno.EBADF)
        res = pio.batch([(f, buf, 10, 0, 0, "write"), (f, buf, 10, 0, 0, "read")])
        assert hint in extent(res[0], path, 0, 10, errno.EBADF) and res[1] == 10
        res = pio.batch([(f, buf, 10, 3, 0, "write")])[0]
        assert hint in extent(res, path, 3, 10, errno.EBADF)
        with pytest.raises(PhxIOError) as ei:
            f.write_many(buf, [0, 4096], [100, 100])
        assert hint in extent(ei.value, path, 0, 100, errno.EBADF)
    assert path.read_bytes() == b"\1" * 16384


def test_write_async_to_a_read_only_file(rt, engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\1" * 8192)
    s = rt.stream_create()
    try:
        with pio.open(path, "rb") as f:
            op = f.write_async(bytearray(4096), 4096, 0, 0, s)
            rt.stream_synchronize(s)
            assert op.bytes_done == -errno.EBADF
            with pytest.raises(PhxIOError) as ei:
                op.result()
    finally:
        rt.stream_destroy(s)
    assert "opened read-only ('rb'); open it with 'r+'" in extent(ei.value, path, 0, 4096, errno.EBADF)


@pytest.mark.parametrize("mode", ["w", "a", "x"])
def test_read_from_a_write_only_file_says_how_to_open_it(rt, engine, tmp_path, mode):
    path = tmp_path / "wo.bin"
    if mode != "x":
        path.write_bytes(b"\1" * 8192)
    with pio.open(path, mode) as f:
        with pytest.raises(PhxIOError) as ei:
            f.read(bytearray(4096), 4096, 0)
    msg = extent(ei.value, path, 0, 4096, errno.EBADF)
    assert f"opened write-only ({mode!r}); open it with 'r' or 'r+' to read" in msg, msg


def test_write_through_a_read_only_descriptor(rt, tmp_path):
    path = tmp_path / "fd.bin"
    path.write_bytes(b"\1" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        f = pio.PhxFile(None, fd=fd)
        with f, pytest.raises(PhxIOError) as ei:
            f.write(bytearray(4096), 4096, 0)
    finally:
        os.close(fd)
    e = ei.value
    assert e.errno == errno.EBADF and f"descriptor {fd} is not open for writing" in str(e), str(e)
    assert "O_RDWR" in str(e)


# ---- a buffer too small: what it holds and what the request needs ---------------------------


def test_buffer_too_small_host(rt, engine, tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(b"\1" * (1 << 20))
    buf = bytearray(4096)
    with pio.open(path, "r+") as f:
        for call in (lambda: f.read(buf, 1 << 20), lambda: f.write(buf, 1 << 20), lambda: f.pread(buf, 1 << 20)):
            with pytest.raises(PhxIOError) as ei:
                call()
            msg = extent(ei.value, path, 0, 1 << 20, errno.EFAULT)
            assert "the buffer holds 4096 bytes; the request needs 1048576 from buffer offset 0" in msg, msg
            assert "Bad address" not in msg, msg
        with pytest.raises(PhxIOError) as ei:
            f.read(buf, 4000, 512, 100)
        assert "the buffer holds 4096 bytes; the request needs 4000 from buffer offset 100" in extent(
            ei.value, path, 512, 4000, errno.EFAULT
        )
        res = pio.batch([(f, buf, 8192, 0, 0, "read"), (f, buf, 4096, 0, 0, "read")])
        assert "the buffer holds 4096 bytes; the request needs 8192" in extent(res[0], path, 0, 8192, errno.EFAULT)
        assert res[1] == 4096
        with pytest.raises(PhxIOError) as ei:
            f.read_many(buf, [0, 8192], [4096, 4096], [0, 1])
        msg = extent(ei.value, path, 8192, 4096, errno.EFAULT)
        assert (
            "extent 1 of 2" in msg and "the buffer holds 4096 bytes; the request needs 4096 from buffer offset 1" in msg
        ), msg
    assert path.read_bytes() == b"\1" * (1 << 20)


def test_buffer_too_small_device(rt, engine, dev, tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(b"\1" * (1 << 20))
    d = dev(4096)
    with pio.open(path, "r") as f:
        with pytest.raises(PhxIOError) as ei:
            f.read(d.buf(), 1 << 20)
        assert "the buffer holds 4096 bytes; the request needs 1048576 from buffer offset 0" in extent(
            ei.value, path, 0, 1 << 20, errno.EFAULT
        )
        # a buffer that claims more than its allocation: what the allocation holds
        with pytest.raises(PhxIOError) as ei:
            f.read((d.ptr, 8192), 8192, 0)
        msg = extent(ei.value, path, 0, 8192, errno.EFAULT)
        assert "device allocation" in msg and "holds 4096 bytes; the request needs 8192 from 0 bytes into it" in msg, (
            msg
        )
    assert (d.get() == 0xA5).all()


def test_registration_overrun_says_what_it_holds(rt, engine, tmp_path):
    """An extent from a registration over unregistered bytes into another one (a gap)."""
    path = tmp_path / "reg.bin"
    path.write_bytes(b"\1" * 16384)
    buf = np.zeros(12288, np.uint8)
    pio.register((buf.ctypes.data, 4096))
    pio.register((buf.ctypes.data + 8192, 4096))
    try:
        with pio.open(path, "r") as f, pytest.raises(PhxIOError) as ei:
            f.read((buf.ctypes.data, 12288), 12288, 0)
    finally:
        pio.deregister((buf.ctypes.data, 4096))
        pio.deregister((buf.ctypes.data + 8192, 4096))
    msg = extent(ei.value, path, 0, 12288, errno.EFAULT)
    assert "registration" in msg and "holds 4096 bytes" in msg and "the request needs 12288" in msg, msg
    assert "unregistered bytes" in msg and "register the gap" in msg, msg


# ---- bad arguments stay ValueError / TypeError ----------------------------------------------


def test_bad_arguments_stay_value_and_type_errors(rt, tmp_path):
    path = tmp_path / "args.bin"
    path.write_bytes(b"\1" * 4096)
    with pio.open(path, "r") as f:
        with pytest.raises(ValueError) as ei:
            f.read(bytearray(4096), 10, -1)
        e = ei.value
        assert isinstance(e, ArgumentError) and isinstance(e, PhxIOError) and e.errno == errno.EINVAL
        assert "file_offset=-1" in once(e, path)
        with pytest.raises(TypeError, match="file_offset"):
            f.read(bytearray(4096), 10, 1.5)
        with pytest.raises(ValueError, match="mode"):
            pio.open(path, "rw")
        for mode in (None, 1, b"r"):
            with pytest.raises(TypeError, match="mode must be a string"):
                pio.open(path, mode)
        with pytest.raises(ArgumentError) as ei:
            f.read_many(bytearray(4096), [0, 10], [4, -4])
        assert "extent 1" in once(ei.value, path) and "negative size" in str(ei.value)


@pytest.mark.parametrize("op", ["read_many", "write_many"])
def test_an_extent_whose_buffer_end_passes_2_63_is_refused_before_anything_moves(rt, tmp_path, engine, op):
    """read_many / write_many: buffer offset + size past 2**63-1 (int64 would wrap, and the
    extent be checked against the wrong end of the buffer) is refused naming the extent,
    with nothing read into or out of memory past the buffer (a canary after it), whatever
    the chunk size (a wrapped request once had 0 chunks and hung, or wrote past the buffer)."""
    path = tmp_path / "wrap.bin"
    data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    data.tofile(path)
    big = np.zeros(4096 + 65536, np.uint8)
    buf, canary = big[:4096], big[4096:]
    top = (1 << 63) - 1
    for chunk in ("1M", "1073737728"):
        for bo, sz in (([0, 200], [16, top - 100]), ([0, top], [16, 1]), ([0, top - 3], [16, 16])):
            with ps.override(chunk_size=chunk), pio.open(path, "r+") as f:
                with pytest.raises(ArgumentError) as ei:
                    getattr(f, op)(buf, [0, 0], sz, bo)
                msg = once(ei.value, path)
                assert "extent 1" in msg and "passes 2**63-1" in msg, msg
            assert not canary.any(), "bytes written past the buffer"
    assert np.array_equal(np.fromfile(path, np.uint8), data)  # nothing written to the file either


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_bounce_pool_that_cannot_be_allocated_fails_the_read(tmp_path, engine_name):
    """A read that needs a bounce slot when the pool's memory cannot be allocated (and no
    slot is in use, so none will come back) fails with ENOMEM naming the file and extent,
    instead of waiting forever (in a subprocess: its address space is capped)."""
    script = tmp_path / "nomem.py"
    script.write_text(
        """import os, resource, sys, numpy as np
import phoenix.io as pio
import phoenix.settings as ps
path, engine = sys.argv[1], sys.argv[2]
n = 1 << 20
open(path, "wb").write(os.urandom(n))
a = np.zeros(n + 8192, np.uint8)
off = (-a.ctypes.data) % 4096
with ps.override(engine=engine, bounce_pool_size="1G", mode="auto"):
    with pio.open(path, "r") as f:
        assert f.read(a[off : off + n]) == n  # aligned: no bounce slot; the workers run
        vm = int([x for x in open("/proc/self/status") if x.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
        try:
            f.read(a[off + 7 : off + 7 + n - 4096], n - 4096, 0)  # misaligned: through a slot
        except OSError as e:
            print("ERRNO", e.errno, e)
        else:
            print("READ")
"""
    )
    env = {**os.environ, "PHX_VENDOR": "host"}
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "f.bin"), engine_name],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    if "READ" in p.stdout:
        pytest.skip("the capped address space still let the pool grow here")
    assert f"ERRNO {errno.ENOMEM}" in p.stdout and "f.bin, offset 0, length 1044480" in p.stdout, p.stdout


# ---- the class itself ------------------------------------------------------------------------


def test_errno_classes_are_made_once_and_pickle():
    a = PhxIOError(errno.ENOENT, "/x/y.bin")
    b = PhxIOError(errno.ENOENT, "/x/z.bin", what="open")
    assert type(a) is type(b) and isinstance(a, FileNotFoundError) and isinstance(a, PhxIOError)
    assert type(PhxIOError(errno.EPERM, "/x")) is type(PhxIOError(errno.EACCES, "/x"))  # both PermissionError
    assert issubclass(type(PhxIOError(errno.EACCES, "/x")), PermissionError)
    assert type(PhxIOError(errno.EIO, "/x", 0, 10)) is PhxIOError  # no subclass of its own: OSError's mapping
    assert str(a) == "/x/y.bin: No such file or directory" and a.args == (errno.ENOENT, str(a))
    e = PhxIOError(errno.ENOSPC, "/dev/full", 4096, 100, "pwrite")
    assert str(e) == "/dev/full, offset 4096, length 100: pwrite: No space left on device"
    assert str(PhxIOError(errno.ENODEV, None, 0, 0, "start")) == "start: No such device"
    for x in (
        a,
        e,
        extent_error("/f", 1, 2, "read", "the buffer holds 1 bytes; the request needs 2 from buffer offset 0"),
        ArgumentError(errno.EINVAL, "/f", 5, 6, "read", reason="why"),
    ):
        y = pickle.loads(pickle.dumps(x))
        assert type(y) is type(x) and str(y) == str(x)
        assert (y.errno, y.filename, y.offset, y.length, y.what) == (x.errno, x.filename, x.offset, x.length, x.what)


_BAD_MEMORY = r"""
import ctypes, errno, os, sys
import phoenix.io as pio
import phoenix.settings as ps

path, engine, case = sys.argv[1], sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
n = 3 * 4096
a = libc.mmap(None, n, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
if case == "hole":
    libc.munmap(a + 4096, 4096)
elif case == "read-only":
    libc.mprotect(a, n, 1)
elif case == "registered-then-unmapped":
    pio.register((a, n))
    # unmapped: its pages are gone, and a PROT_NONE mapping holds the addresses so that
    # nothing made later (the io_uring engine's rings) is mapped there in their place
    assert libc.mmap(a, n, 0, 0x32, -1, 0) == a  # PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_FIXED
with ps.override(engine=engine), pio.open(path, "r+") as f:
    for op, boff in (("read", 1), ("read", 3), ("write", 1), ("write", 3)):
        if case == "read-only" and op == "write":
            continue  # readable: a write from it is fine
        try:
            got = f.read((a, n), n - boff - 1, 0, boff) if op == "read" else f.write((a, n), n - boff - 1, 0, boff)
            print(op, boff, "COUNT", got)
        except OSError as e:
            print(op, boff, "ERRNO", e.errno, e)
print("DONE")
"""


@pytest.mark.parametrize("case", ["hole", "read-only", "registered-then-unmapped"])
def test_host_memory_the_process_cannot_use_is_efault_not_a_crash(tmp_path, engine, case):
    """A raw (ptr, nbytes) buffer with a page missing in its middle, one mapped read-only
    (a read into it), or a registered range unmapped since: the staged copy between the
    bounce slot and it (an offset misaligned for O_DIRECT) is EFAULT naming the file and
    extent, not a crash of the process (in a subprocess: a crash must not take the tests)."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    script = tmp_path / "bad_memory.py"
    script.write_text(_BAD_MEMORY)
    p = subprocess.run(
        [sys.executable, str(script), str(path), engine, case],
        env={**os.environ, "PHX_VENDOR": "host"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "DONE" in p.stdout, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    lines = [ln for ln in p.stdout.splitlines() if "ERRNO" in ln or "COUNT" in ln]
    assert lines and all(f"ERRNO {errno.EFAULT}" in ln and f"{path}, offset 0, length" in ln for ln in lines), p.stdout
