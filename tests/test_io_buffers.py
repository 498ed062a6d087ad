"""Buffer adaptation and the registration table."""

from __future__ import annotations

import ctypes
import errno
import time

import numpy as np
import pytest

import phoenix.buffers as pb
import phoenix.io as pio
import phoenix.settings as ps
from phoenix.errors import PhxIOError, RegistrationError
from phoenix.vendor import CopyKind

POISON = 0x5A


# ---- adaptation ----------------------------------------------------------------------------


def test_numpy_and_views():
    a = np.arange(100, dtype=np.float32)
    b = pb.adapt(a, writable=True)
    assert (b.addr, b.nbytes, b.source) == (a.ctypes.data, 400, "array_interface")
    v = a[10:20]
    assert pb.adapt(v, writable=True).addr == a.ctypes.data + 40
    with pytest.raises(TypeError, match="contiguous"):
        pb.adapt(a[::2], writable=True)
    ro = np.frombuffer(b"abcd", np.uint8)
    assert pb.adapt(ro, writable=False).nbytes == 4
    with pytest.raises(TypeError, match="read-only"):
        pb.adapt(ro, writable=True)


def test_buffer_protocol_objects():
    ba = bytearray(b"0123456789")
    b = pb.adapt(ba, writable=True)
    assert b.nbytes == 10 and b.source == "buffer"
    assert ctypes.string_at(b.addr, 10) == b"0123456789"
    with pytest.raises(BufferError):
        ba.extend(b"x")  # the export pins it while the I/O runs
    b.release()
    ba.extend(b"x")
    mv = memoryview(bytearray(b"abcdef"))[2:5]
    b = pb.adapt(mv, writable=True)
    assert ctypes.string_at(b.addr, b.nbytes) == b"cde"
    b.release()
    with pytest.raises(TypeError):
        pb.adapt(b"const", writable=True)
    with pytest.raises(TypeError, match="contiguous"):
        pb.adapt(memoryview(bytearray(10))[::2], writable=False)


def test_raw_pairs_and_refusals():
    b = pb.adapt((0x1000, 64), writable=True)
    assert (b.addr, b.nbytes, b.kind, b.source) == (0x1000, 64, None, "raw")
    with pytest.raises(TypeError, match=r"\(ptr, nbytes\)"):
        pb.adapt(0x1000, writable=True)
    with pytest.raises(ValueError, match="non-NULL"):
        pb.adapt((0, 10), writable=True)
    for bad in ((0x1000, 2**64 + 16), (0x1000, -1), (2**64, 1), (2**64 - 4096, 8192)):
        with pytest.raises(ValueError, match="raw buffer"):  # never wrapped to 64 bits
            pb.adapt(bad, writable=True)
    with pytest.raises(TypeError):  # a bool is not a size
        pb.adapt((0x1000, True), writable=True)
    with pytest.raises(TypeError, match="cannot do I/O"):
        pb.adapt(object(), writable=True)


def test_dlpack_producer():
    a = np.arange(64, dtype=np.uint16)

    class OnlyDLPack:  # hides the other protocols: DLPack alone must do
        def __dlpack__(self, **kw):
            return a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return a.__dlpack_device__()

    b = pb.adapt(OnlyDLPack(), writable=True)
    assert (b.addr, b.nbytes, b.kind, b.source) == (a.ctypes.data, 128, "host", "dlpack")
    b.release()


def test_cuda_array_interface(rt):
    ptr = rt.device_alloc(4096)
    try:

        class FakeCuPy:
            __cuda_array_interface__ = {
                "data": (ptr, False),
                "shape": (1024,),
                "typestr": "<f4",
                "version": 3,
                "strides": None,
            }

        b = pb.adapt(FakeCuPy(), writable=True)
        assert (b.addr, b.nbytes, b.kind) == (ptr, 4096, "device")
        mem, device, _ = pb.classify(rt, b.addr, b.nbytes, b.kind)
        assert mem == pb.MEM_DEVICE_MAPPED and device == 0  # host arena: direct-capable
        with pytest.raises(pb.OutOfBounds):
            pb.classify(rt, ptr, 8192)
    finally:
        rt.device_free(ptr)


def test_torch_tensors(rt, tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.arange(1000, dtype=torch.int32)
    with pio.open(tmp_path / "t.bin", "w+") as f:
        assert f.write(t) == 4000
        u = torch.zeros(1000, dtype=torch.int32)
        assert f.read(u) == 4000
    assert torch.equal(t, u)


def test_freed_device_buffer_is_refused(rt, tmp_path):
    ptr = rt.device_alloc(65536)
    rt.device_free(ptr)
    with pio.open(tmp_path / "freed.bin", "w+") as f:
        f.write(bytearray(65536))
        with pytest.raises(PhxIOError) as ei:
            f.read((ptr + 3, 1000), 1000, 1)
        assert ei.value.errno == errno.EFAULT


# ---- registrations -------------------------------------------------------------------------


@pytest.fixture
def clean_registrations():
    yield
    assert pio.stats()["registrations"] == 0, "a test leaked registrations"


def test_register_refcount_and_overlaps(rt, clean_registrations):
    base = rt.device_alloc(1 << 20)
    try:
        assert pio.register((base, 1 << 20)) == base
        assert pio.register((base, 1 << 20)) == base  # exact duplicate: reference counted
        assert pio.stats()["registrations"] == 1
        with pytest.raises(RegistrationError, match="overlaps"):
            pio.register((base + 4096, 4096))
        with pytest.raises(RegistrationError, match="overlaps"):
            pio.register((base - 4096, 8192))
        pio.deregister((base, 1 << 20))
        assert pio.stats()["registrations"] == 1
        pio.deregister((base, 1 << 20))
        assert pio.stats()["registrations"] == 0
        with pytest.raises(RegistrationError, match="not registered"):
            pio.deregister((base, 1 << 20))
    finally:
        rt.device_free(base)


def test_deregister_drops_only_its_own_registrations(rt, clean_registrations):
    """phoenix.deregister of a range libphxfile registered (phxFileBufRegister) is refused
    and leaves it registered (it once removed it, and libphxfile's close then removed
    phoenix's own registration made at that base since)."""
    from phoenix import phxfile

    lib = phxfile.load()
    buf = np.zeros(1 << 20, np.uint8)
    assert lib.phxFileBufRegister(buf.ctypes.data, buf.nbytes) == 0
    try:
        with pytest.raises(RegistrationError, match="not registered with phoenix.register"):
            pio.deregister(buf)
        assert pio.stats()["registrations"] == 1  # libphxfile's is still there
    finally:
        assert lib.phxFileBufDeregister(buf.ctypes.data) == 0
        assert lib.phxFileDriverClose() == 0  # (its context: BufRegister opened the driver)
    assert pio.stats()["registrations"] == 0


def test_registering_memory_that_is_not_there_is_refused(rt, clean_registrations):
    import mmap

    m = mmap.mmap(-1, 1 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    m.close()  # unmapped: the address is no memory now
    with pytest.raises(RegistrationError, match="not accessible memory"):
        pio.register((addr, 1 << 20))


def test_owned_pairs_and_objects_are_copied_with_memcpy_raw_pairs_are_checked(rt):
    """Which host memory the core copies into with memcpy (PHX_IO_OWNED_MEMORY): a Python
    object's, and an OwnedPair (phoenix's loaders, for arrays they hold); a raw pair goes
    through the kernel's checked copy."""
    from phoenix._abi import PHX_IO_OWNED_MEMORY
    from phoenix._extents import OwnedPair, _resolve

    a = np.zeros(8192, np.uint8)
    for obj, want in (
        (a, PHX_IO_OWNED_MEMORY),
        (OwnedPair((a.ctypes.data, 8192)), PHX_IO_OWNED_MEMORY),
        ((a.ctypes.data, 8192), 0),
    ):
        r = _resolve(None, obj, 4096, 7, True, "x", 0, "read")
        try:
            assert r.owned == want, type(obj)
        finally:
            r.release()


def test_registered_object_is_kept_alive(rt, clean_registrations):
    ba = bytearray(4096)
    pio.register(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")  # cannot move while registered
    pio.deregister(ba)
    ba.extend(b"x")


def test_extent_past_registration_is_refused_and_nothing_moves(rt, tmp_path, clean_registrations):
    """A read that starts in a registration and runs past its end over unregistered bytes
    into another registration (a gap between them): EFAULT, and neither the registered
    region nor the bytes beyond it (the canary) change."""
    n, reg = 1 << 20, 256 * 1024
    ptr = rt.device_alloc(n)
    try:
        poison = np.full(n, POISON, np.uint8)
        rt.memcpy(ptr, poison.ctypes.data, n, CopyKind.HOST_TO_DEVICE)
        path = tmp_path / "reg.bin"
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        pio.register((ptr, reg))
        pio.register((ptr + 2 * reg, reg))  # [reg, 2 * reg) unregistered: a gap
        try:
            with pio.open(path, "r+") as f:
                for mode in ("direct", "staged"):
                    with ps.override(mode=mode):
                        with pytest.raises(PhxIOError) as ei:
                            f.read((ptr, n), 2 * reg + 1, 0, 0)
                        assert ei.value.errno == errno.EFAULT and "registration" in str(ei.value)
                        with pytest.raises(PhxIOError):
                            f.read((ptr, n), reg + 200, 0, reg - 100)
                        with pytest.raises(PhxIOError):  # writes too: the file is unchanged
                            f.write((ptr, n), 2 * reg + 1, 0, 0)
                        r = pio.batch([(f, (ptr, n), 2 * reg + 1, 0, 0, "read"), (f, (ptr, n), 10, 0, 0, "read")])
                        assert isinstance(r[0], PhxIOError) and r[1] == 10
                        with pytest.raises(PhxIOError):  # stream-ordered: refused at submission
                            f.read_async((ptr, n), 2 * reg + 1, 0, 0, 0)
                # inside the registration: fine
                assert f.read((ptr, n), reg, 0, 0) == reg
            got = np.empty(n, np.uint8)
            rt.memcpy(got.ctypes.data, ptr, n, CopyKind.DEVICE_TO_HOST)
            np.testing.assert_array_equal(got[:reg], data[:reg])
            assert (got[reg:] == POISON).all(), "bytes beyond the registration changed"
            assert path.read_bytes() == data.tobytes()
        finally:
            pio.deregister((ptr, reg))
            pio.deregister((ptr + 2 * reg, reg))
    finally:
        rt.device_free(ptr)


def test_many_adjacent_registrations_stay_fast(rt, tmp_path, clean_registrations):
    """LMCache registers one tensor as consecutive 16 MiB regions: 20,000 of them
    (a 320 GiB range of addresses; registration only records it) and lookups stay fast,
    one of an extent over all of them too."""
    lib = pio._lib
    region, count, base = 16 << 20, 20_000, 1 << 46
    t0 = time.perf_counter()
    for i in range(count):
        assert lib.phx_reg_add(base + i * region, region, pb.MEM_DEVICE, 0) == 0
    add_s = time.perf_counter() - t0
    try:
        info = pio._RegInfo()
        t0 = time.perf_counter()
        for i in range(0, count, 7):
            a = base + i * region
            assert lib.phx_reg_lookup(a + region - 1, 1, ctypes.byref(info)) == 0 and info.base == a
            # across into the next region (one run), or past the last into unregistered memory
            assert lib.phx_reg_lookup(a + region - 1, 2, None) == (0 if i < count - 1 else 1)
        # the whole run in one extent: a walk over all of them
        assert lib.phx_reg_lookup(base + 1, count * region - 1, ctypes.byref(info)) == 0
        assert (info.base, info.size) == (base, count * region)
        look_s = time.perf_counter() - t0
        assert lib.phx_reg_lookup(base - 1, 1, None) == 1
        assert lib.phx_reg_add(base + 5 * region + 1, 10, 0, 0) == -errno.EINVAL
        assert pio.stats()["registrations"] == count
    finally:
        for i in range(count):
            assert lib.phx_reg_remove(base + i * region) == 0
    assert add_s < 2.0 and look_s < 1.0, (add_s, look_s)
