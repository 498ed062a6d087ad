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
