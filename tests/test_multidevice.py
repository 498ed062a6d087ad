"""Several devices at once, on the host vendor with two devices (PHX_HOST_DEVICES=2).

Each case runs in a child process (the device count is read once per process): buffers
registered on both devices, per-device bounce pools and streams in staged mode,
concurrent reads of two files into the two devices, pointer queries naming the device.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

CHILD = r"""
import os, sys, threading
import numpy as np
import phoenix, phoenix.io as pio
from phoenix import registry
from phoenix.vendor import CopyKind, MemoryType

rt = registry.get_runtime("host")
assert len(rt.devices()) == 2, rt.devices()
tmp = sys.argv[1]
size = (24 << 20) + 4096 * 3 + 17          # several chunks, an unaligned tail
rng = np.random.default_rng(7)
data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
paths = []
for d in range(2):
    p = os.path.join(tmp, f"dev{d}.bin")
    data[d].tofile(p)
    paths.append(p)

devbufs = [rt.device_alloc(size + 8192, device=d) for d in range(2)]
for d, ptr in enumerate(devbufs):
    info = rt.pointer_info(ptr + 4096)
    assert info.type is MemoryType.DEVICE and info.device == d and info.base == ptr, info
    poison = np.full(size + 8192, 0xA5, np.uint8)
    rt.memcpy(ptr, poison.ctypes.data, size + 8192, CopyKind.HOST_TO_DEVICE)
    pio.register((ptr, size + 8192))      # registered on both devices at once

errors = []
def read_into(d):
    try:
        with phoenix.open(paths[d], "r") as f:
            n = f.read((devbufs[d] + 4096, size), size, 0, 0)
        assert n == size, n
    except BaseException as exc:
        errors.append(exc)

with phoenix.settings.override(mode="staged", chunk_size="4M", threads=4):
    ts = [threading.Thread(target=read_into, args=(d,)) for d in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
assert not errors, errors
for d in range(2):
    out = np.empty(size + 8192, np.uint8)
    rt.memcpy(out.ctypes.data, devbufs[d], size + 8192, CopyKind.DEVICE_TO_HOST)
    assert (out[:4096] == 0xA5).all() and (out[4096 + size:] == 0xA5).all(), f"device {d}: bytes outside the extent changed"
    assert np.array_equal(out[4096:4096 + size], data[d]), f"device {d}: wrong bytes"

# write from device 1 back to a file, staged, and compare
with phoenix.settings.override(mode="staged"):
    with phoenix.open(os.path.join(tmp, "back.bin"), "w") as f:
        assert f.write((devbufs[1] + 4096, size), size, 0, 0) == size
assert np.array_equal(np.fromfile(os.path.join(tmp, "back.bin"), np.uint8), data[1])

st = pio.stats()
assert st["chunks_staged"] > 0, st
for ptr in devbufs:
    pio.deregister((ptr, size + 8192))
    rt.device_free(ptr)
pio.shutdown()
assert pio.stats()["registrations"] == 0
print("OK", st["chunks_staged"])
"""


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_two_devices_concurrent_staged_io(tmp_path, engine):
    env = {**os.environ, "PHX_HOST_DEVICES": "2", "PHX_VENDOR": "host", "PHX_IO_ENGINE": engine}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


ON_ANOTHER_DEVICE = r"""
import ctypes, os, sys
import numpy as np
import phoenix.io as pio
import phoenix.settings as ps
from phoenix import registry
from phoenix._testing import TEST_HOSTFN, TestHostFn
from phoenix.vendor import CopyKind

rt = registry.get_runtime("host")
tmp, mode = sys.argv[1], sys.argv[2]
n = 3 * (64 << 10) + 123  # several staged chunks, an unaligned tail
rng = np.random.default_rng(11)
keep = []  # host callbacks' arguments outlive the streams' use of them


def hostfn(stream, **kw):
    a = TestHostFn(counter=ctypes.pointer(ctypes.c_int64(0)), seq=-1, result=-999, **kw)
    keep.append(a)
    rt.launch_host_func(stream, TEST_HOSTFN, ctypes.addressof(a))
    return a


def current():
    dev = ctypes.c_int(-1)
    rt.rt.get_device(ctypes.byref(dev))
    return dev.value


buf = rt.device_alloc(n, device=1)
for op in ("read", "write"):
    for handle in (0, 1):  # device 1's default stream, and the legacy default stream's alias
        new, old = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
        path = os.path.join(tmp, f"{op}{handle}.bin")
        (new if op == "read" else old).tofile(path)
        rt.memcpy(buf, (old if op == "read" else old[::-1].copy()).ctypes.data, n, CopyKind.HOST_TO_DEVICE)
        gate = ctypes.c_int64(0)
        # device 1's stream: [gate] [copy -> buf] ... the op must come after both
        rt.set_device(1)
        hostfn(handle, kind=2, src=ctypes.addressof(gate))
        src = old if op == "read" else new
        rt.memcpy_async(buf, src.ctypes.data, n, CopyKind.HOST_TO_DEVICE, handle)
        rt.set_device(0)
        with ps.override(mode=mode, chunk_size="64K"), pio.open(path, "r+") as f:
            io = f.read_async if op == "read" else f.write_async
            sop = io((buf, n), n, 0, 0, stream=handle)  # device 0 current
            assert current() == 0, f"{op} {handle}: the caller's device was not restored"
            rt.set_device(1)
            after = np.full(n, 0x5A, np.uint8)  # device 1's stream after the op sees its bytes
            if op == "read":
                hostfn(handle, kind=0, dst=after.ctypes.data, src=buf, size=n)
            else:
                hostfn(handle, kind=1, fd=os.open(path, os.O_RDONLY), dst=after.ctypes.data, size=n)
            rt.set_device(0)
            rt.stream_synchronize(handle)  # device 0's default stream: holds nothing of the op
            gate.value = 1
            rt.set_device(1)
            rt.stream_synchronize(handle)
            rt.set_device(0)
            assert sop.result(timeout=60) == n, (op, handle, sop.bytes_done)
        got = np.empty(n, np.uint8)
        if op == "read":
            rt.memcpy(got.ctypes.data, buf, n, CopyKind.DEVICE_TO_HOST)
        else:
            got = np.fromfile(path, np.uint8)
        assert np.array_equal(got, new), f"{op} on stream {handle}: raced the work queued before it on device 1"
        assert np.array_equal(after, new), f"{op} on stream {handle}: work queued after it missed its bytes"
rt.device_free(buf)
pio.shutdown()
print("OK")
"""


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_stream_ordered_io_on_another_devices_default_stream(tmp_path, mode):
    """read_async / write_async of a device-1 buffer on the default stream (0, and the legacy
    default's alias 1), called while device 0 is current: the op is queued on device 1's
    default stream, after the work queued there before it (a gate, then a copy into the
    buffer) and before the work queued after it (a snapshot); the caller's device stays
    current. Device 0's default stream is synchronized before the gate opens: an op queued
    there (with the calling thread's device) had finished by then and the copy overwrote it."""
    env = {**os.environ, "PHX_HOST_DEVICES": "2", "PHX_VENDOR": "host"}
    proc = subprocess.run(
        [sys.executable, "-c", ON_ANOTHER_DEVICE, str(tmp_path), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
