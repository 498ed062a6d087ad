"""The host reference runtime (phoenix/_testing/hostrt/hostrt.c) through its port (vendors/host/runtime.py).

Strictness is the point of a test double: every copy is checked byte for byte against
random data with poisoned destinations, every refusal must leave the destination
untouched, and freed device memory must fault. Settings are read once per process,
so multi-device and small-arena cases run in a subprocess.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from phoenix.errors import VendorError
from phoenix.vendor import DATA_PATH_ABI, CopyKind, DataPathTable, MemoryType
from phoenix.vendors.host.runtime import Runtime

H2H, H2D, D2H, D2D = CopyKind.HOST_TO_HOST, CopyKind.HOST_TO_DEVICE, CopyKind.DEVICE_TO_HOST, CopyKind.DEVICE_TO_DEVICE
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def rt():
    with Runtime() as runtime:
        yield runtime


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % (1 << 32))


@pytest.fixture(scope="module")
def cfns(tmp_path_factory):
    """Test-only C host functions (a stream host callback must be C, never Python)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        pytest.skip("no C compiler to build the host-callback helpers")
    src = tmp_path_factory.mktemp("cfns") / "cfns.c"
    src.write_text(
        textwrap.dedent("""
        #include <string.h>
        #include <unistd.h>
        struct copy_job { void *dst; const void *src; size_t n; unsigned delay_us; };
        void copy_job(void *arg) {   /* sleeps, then copies: later stream work must wait for it */
            struct copy_job *j = arg;
            if (j->delay_us) usleep(j->delay_us);
            memcpy(j->dst, j->src, j->n);
        }
        struct record { int *log; int *next; int value; };
        void record(void *arg) {     /* appends its value: the log shows the execution order */
            struct record *r = arg;
            r->log[(*r->next)++] = r->value;
        }
    """)
    )
    lib = src.with_suffix(".so")
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", str(src), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


class CopyJob(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("n", ctypes.c_size_t), ("delay_us", ctypes.c_uint)]


class Record(ctypes.Structure):
    _fields_ = [("log", ctypes.c_void_p), ("next", ctypes.c_void_p), ("value", ctypes.c_int)]


def fn_addr(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def random_bytes(rng, n) -> np.ndarray:
    words = rng.integers(0, 1 << 64, (n + 7) // 8, dtype=np.uint64)  # 8 bytes a draw: fast at 64 MiB
    return words.view(np.uint8)[:n]


def device_bytes(rt, ptr, n) -> np.ndarray:
    out = np.empty(n, np.uint8)
    rt.memcpy(addr(out), ptr, n, D2H)
    return out


def raises_named(name):
    return pytest.raises(VendorError, match=name)


def run_child(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        # not the repository root: `-c` puts the working directory first on sys.path, and the
        # source tree's phoenix/ (without vendors/ or the built core) would shadow the installed one
        cwd=tempfile.gettempdir(),
    )


# -- identity and discovery ------------------------------------------------------------------


def test_identity_and_probe():
    probe = Runtime.probe()
    assert probe.usable and "test double" in probe.reason
    assert Runtime.name == "host" and Runtime.is_test_double and Runtime.p2p_page_size == 65536


def test_devices(rt):
    (dev,) = rt.devices()
    assert dev.ordinal == 0 and "test double" in dev.name and dev.pci_bus_id == "0000:f0:00.0"
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rt.rt.mem_get_info(ctypes.byref(free), ctypes.byref(total))
    assert dev.total_memory == total.value == 16 << 30 and 0 < free.value <= total.value
    rt.set_device(0)
    with raises_named("phxhErrorInvalidDevice"):
        rt.set_device(1)
    with raises_named("phxhErrorInvalidDevice"):
        rt.device_alloc(4096, device=1)


def test_error_names_strings_and_last_error(rt):
    lib = ctypes.CDLL(rt.rt.library)  # the library the port bound, with symbols of its own
    lib.phxhGetErrorName.restype = lib.phxhGetErrorString.restype = ctypes.c_char_p
    assert lib.phxhGetErrorName(1) == b"phxhErrorInvalidValue"
    assert lib.phxhGetErrorString(1) == b"invalid argument"
    assert lib.phxhGetErrorName(400) == b"phxhErrorInvalidResourceHandle"
    assert lib.phxhGetErrorName(12345) == lib.phxhGetErrorString(12345) == b"unrecognized error code"
    lib.phxhGetLastError()
    assert lib.phxhFree(ctypes.c_void_p(0x1234)) == 1
    assert lib.phxhGetLastError() == 1 and lib.phxhGetLastError() == 0  # returned, then cleared
    with pytest.raises(VendorError) as err:
        rt.device_free(0x1234)
    assert (err.value.call, err.value.code, err.value.name, err.value.message) == (
        "phxhFree",
        1,
        "phxhErrorInvalidValue",
        "invalid argument",
    )


# -- device memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 255, 64 * KiB, 64 * KiB + 1, 3 * MiB + 5])
def test_alloc_is_aligned_and_queryable(rt, size):
    ptr = rt.device_alloc(size)
    assert ptr % 65536 == 0
    info = rt.pointer_info(ptr + size - 1)
    assert (info.type, info.device, info.base, info.size) == (MemoryType.DEVICE, 0, ptr, size)
    assert device_bytes(rt, ptr, size).sum() == 0  # fresh pages are zero
    rt.device_free(ptr)
    assert rt.pointer_info(ptr).type is MemoryType.HOST  # freed memory is not device memory


def test_alloc_errors(rt):
    with raises_named("phxhErrorInvalidValue"):
        rt.device_alloc(0)
    with raises_named("phxhErrorMemoryAllocation"):
        rt.device_alloc((16 << 30) + 1)
    with raises_named("phxhErrorMemoryAllocation"):
        rt.device_alloc(1 << 62)


def test_bad_frees_are_errors(rt):
    ptr = rt.device_alloc(256 * KiB)
    with raises_named("phxhErrorInvalidValue"):
        rt.device_free(ptr + 64 * KiB)  # inside, not the base
    host = np.zeros(16, np.uint8)
    for bad in (0, addr(host), 0xDEAD0000):
        with raises_named("phxhErrorInvalidValue"):
            rt.device_free(bad)
    rt.device_free(ptr)
    with raises_named("phxhErrorInvalidValue"):
        rt.device_free(ptr)  # double free


def test_freed_memory_is_quarantined_and_accounted(rt):
    free0, total = ctypes.c_size_t(), ctypes.c_size_t()
    rt.rt.mem_get_info(ctypes.byref(free0), ctypes.byref(total))
    first = rt.device_alloc(64 * KiB)
    rt.device_free(first)
    reused_after = None
    for i in range(80):
        p = rt.device_alloc(64 * KiB)
        rt.device_free(p)
        if p == first and reused_after is None:
            reused_after = i
    assert reused_after is None or reused_after >= 63  # no reuse while in the FIFO quarantine
    free1 = ctypes.c_size_t()
    rt.rt.mem_get_info(ctypes.byref(free1), ctypes.byref(total))
    assert free1.value == free0.value


def test_touching_freed_device_memory_faults():
    res = run_child("""
        import ctypes
        from phoenix.vendors.host.runtime import Runtime
        rt = Runtime()
        p = rt.device_alloc(1 << 20)
        ctypes.memset(p, 7, 1 << 20)          # live device memory is host-addressable
        assert ctypes.string_at(p + 12345, 1) == b"\\x07"
        rt.device_free(p)
        print("freed", flush=True)
        ctypes.string_at(p + 12345, 1)        # must fault
        print("survived", flush=True)
    """)
    assert res.stdout.strip() == "freed", res.stderr
    assert res.returncode == -signal.SIGSEGV


# -- copies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 4096, 64 * KiB + 3, MiB + 17, 64 * MiB])
def test_copies_every_kind_every_byte(rt, rng, size):
    slack = 3 * KiB
    a, b = rt.device_alloc(size + 2 * slack), rt.device_alloc(size + 2 * slack)
    try:
        src = random_bytes(rng, size)
        off_a, off_b = (int(x) for x in rng.integers(0, 2 * slack + 1, 2))
        noise = random_bytes(rng, size + 2 * slack)  # kept referenced: addr() does not keep it alive
        rt.memcpy(a, addr(noise), size + 2 * slack, H2D)  # poison a
        rt.memcpy(a + off_a, addr(src), size, H2D)
        after_a = device_bytes(rt, a, size + 2 * slack)
        assert np.array_equal(after_a[off_a : off_a + size], src)
        assert np.array_equal(after_a[:off_a], noise[:off_a]) and np.array_equal(
            after_a[off_a + size :], noise[off_a + size :]
        )

        rt.memcpy(b + off_b, a + off_a, size, D2D)
        out = random_bytes(rng, size + 2 * slack)  # poisoned destination
        poison = out.copy()
        off_h = int(rng.integers(0, 2 * slack + 1))
        rt.memcpy(addr(out) + off_h, b + off_b, size, D2H)
        assert np.array_equal(out[off_h : off_h + size], src)
        assert np.array_equal(out[:off_h], poison[:off_h]) and np.array_equal(
            out[off_h + size :], poison[off_h + size :]
        )

        h2h = np.zeros(size, np.uint8)
        rt.memcpy(addr(h2h), addr(src), size, H2H)
        assert np.array_equal(h2h, src)
    finally:
        rt.device_free(a)
        rt.device_free(b)


def test_default_kind_is_inferred_from_pointers(rt, rng):
    n = 100 * KiB
    dev = rt.device_alloc(n)
    src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
    memcpy = rt.rt.memcpy
    memcpy(dev, addr(src), n, 4)
    memcpy(addr(out), dev, n, 4)
    assert np.array_equal(out, src)
    with raises_named("phxhErrorInvalidValue"):
        memcpy(addr(out), dev + 1, n, 4)  # inferred D2H, extent past the allocation
    rt.device_free(dev)


def test_zero_length_copy_is_a_noop(rt):
    rt.memcpy(0, 0, 0, H2D)
    rt.memcpy_async(0, 0, 0, D2H, 0)


def test_wrong_kind_is_refused_and_changes_nothing(rt, rng):
    n = 64 * KiB
    dev = rt.device_alloc(n)
    content = random_bytes(rng, n)
    rt.memcpy(dev, addr(content), n, H2D)
    host, other = random_bytes(rng, n), random_bytes(rng, n)
    host_before = host.copy()
    direction = "phxhErrorInvalidMemcpyDirection"
    for dst, src, kind in [
        (addr(host), addr(other), H2D),  # dst is host memory
        (dev, dev, H2D),  # src is device memory
        (addr(host), addr(other), D2H),  # src is host memory
        (dev, addr(other), D2H),  # dst is device memory
        (addr(host), dev, H2H),  # device memory as host
        (dev, addr(other), H2H),
        (addr(host), dev, D2D),  # dst is host memory
        (addr(host), addr(other), 7),  # no such kind
    ]:
        with raises_named(direction):
            rt.rt.memcpy(dst, src, n, int(kind))
        with raises_named(direction):
            rt.rt.memcpy_async(dst, src, n, int(kind), 0)
    rt.stream_synchronize(0)
    assert np.array_equal(host, host_before)
    assert np.array_equal(device_bytes(rt, dev, n), content)
    rt.device_free(dev)


def test_extent_outside_a_live_allocation_is_refused(rt, rng):
    n = 64 * KiB - 100  # leaves padding up to the granule: addressable, but not the allocation
    dev, other = rt.device_alloc(n), rt.device_alloc(n)
    content = random_bytes(rng, n)
    rt.memcpy(dev, addr(content), n, H2D)
    big = random_bytes(rng, 2 * n)
    big_before = big.copy()
    freed = rt.device_alloc(n)
    rt.device_free(freed)
    stream = rt.stream_create()
    for dst, src, size, kind in [
        (dev, addr(big), n + 1, H2D),  # one byte past the end
        (dev + n - 10, addr(big), 11, H2D),
        (dev + n, addr(big), 1, H2D),  # padding after the allocation
        (dev + n - 10, addr(big), 10 + 100 + 10, H2D),  # through the padding into the next allocation
        (addr(big), dev + 1, n, D2H),
        (other, dev, n + 1, D2D),
        (freed, addr(big), 1, H2D),  # freed memory
        (addr(big), freed, 1, D2H),
    ]:
        with raises_named("phxhErrorInvalidValue"):
            rt.memcpy(dst, src, size, kind)
        with raises_named("phxhErrorInvalidValue"):
            rt.memcpy_async(dst, src, size, kind, stream)
    rt.stream_synchronize(stream)
    rt.stream_destroy(stream)
    assert np.array_equal(device_bytes(rt, dev, n), content)
    assert np.array_equal(big, big_before)
    rt.device_free(dev)
    rt.device_free(other)


# -- streams ---------------------------------------------------------------------------------


def test_async_copies_every_byte(rt, rng):
    stream = rt.stream_create()
    n = 5 * MiB + 3
    dev = rt.device_alloc(n)
    src = random_bytes(rng, n)
    out = random_bytes(rng, n)
    rt.memcpy_async(dev, addr(src), n, H2D, stream)
    rt.memcpy_async(addr(out), dev, n, D2H, stream)
    rt.stream_synchronize(stream)
    assert np.array_equal(out, src)
    rt.stream_destroy(stream)
    rt.device_free(dev)


def test_stream_order_with_host_functions(rt, rng, cfns):
    """Copies and C callbacks interleaved: each runs after the work before it completed."""
    n = 256 * KiB
    dev = rt.device_alloc(n)
    a, b, c = (random_bytes(rng, n) for _ in range(3))
    snap_a, snap_b, out = (random_bytes(rng, n) for _ in range(3))
    copy_job = fn_addr(cfns, "copy_job")
    jobs = [
        CopyJob(addr(snap_a), dev, n, 20000),  # reads the device after copy 1, slowly
        CopyJob(addr(snap_b), dev, n, 0),  # reads the device after copy 2
        CopyJob(dev, addr(c), n, 20000),  # writes the device, slowly, before copy 3 reads it
    ]
    stream = rt.stream_create()
    rt.memcpy_async(dev, addr(a), n, H2D, stream)
    rt.launch_host_func(stream, copy_job, ctypes.addressof(jobs[0]))
    rt.memcpy_async(dev, addr(b), n, H2D, stream)
    rt.launch_host_func(stream, copy_job, ctypes.addressof(jobs[1]))
    rt.launch_host_func(stream, copy_job, ctypes.addressof(jobs[2]))
    rt.memcpy_async(addr(out), dev, n, D2H, stream)
    rt.stream_synchronize(stream)
    assert np.array_equal(snap_a, a) and np.array_equal(snap_b, b) and np.array_equal(out, c)

    # many callbacks between copies run exactly in queue order
    count = 500
    log = np.full(count, -1, np.int32)
    nxt = np.zeros(1, np.int32)
    recs = [Record(addr(log), addr(nxt), i) for i in range(count)]
    for i, rec in enumerate(recs):
        rt.launch_host_func(stream, fn_addr(cfns, "record"), ctypes.addressof(rec))
        if i % 50 == 0:
            rt.memcpy_async(dev, addr(a), n, H2D, stream)
    rt.stream_synchronize(stream)
    assert nxt[0] == count and np.array_equal(log, np.arange(count))
    rt.stream_destroy(stream)
    rt.device_free(dev)


def test_stream_query_and_destroy_waits_for_queued_work(rt, rng, cfns):
    n = 64 * KiB
    dev = rt.device_alloc(n)
    src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
    stream = rt.stream_create()
    assert rt.rt.stream_query(stream) == 0
    job = CopyJob(dev, addr(src), n, 50000)
    rt.launch_host_func(stream, fn_addr(cfns, "copy_job"), ctypes.addressof(job))
    rt.memcpy_async(addr(out), dev, n, D2H, stream)
    assert rt.rt.stream_query(stream) == 600  # NOT_READY: the callback is still asleep
    rt.stream_destroy(stream)  # returns after the queued work completed
    assert np.array_equal(out, src)
    rt.device_free(dev)


def test_free_waits_for_a_queued_copy(rt, rng, cfns):
    """A copy queued before a free completes before the memory goes (no fault, no stray read)."""
    n = 64 * KiB
    dev = rt.device_alloc(n)
    src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
    rt.memcpy(dev, addr(src), n, H2D)
    stream = rt.stream_create()
    nap = CopyJob(addr(out), addr(out), 0, 50000)
    rt.launch_host_func(stream, fn_addr(cfns, "copy_job"), ctypes.addressof(nap))
    rt.memcpy_async(addr(out), dev, n, D2H, stream)
    rt.device_free(dev)
    assert np.array_equal(out, src)
    rt.stream_destroy(stream)


def test_destroyed_stream_and_bad_handles(rt, cfns):
    stream = rt.stream_create()
    rt.stream_destroy(stream)
    host = np.zeros(16, np.uint8)
    fn = fn_addr(cfns, "copy_job")
    for call in (
        lambda: rt.stream_synchronize(stream),
        lambda: rt.stream_destroy(stream),
        lambda: rt.memcpy_async(addr(host), addr(host), 16, H2H, stream),
        lambda: rt.launch_host_func(stream, fn, 0),
        lambda: rt.stream_synchronize(0xBAD),
        lambda: rt.stream_destroy(0),  # the default stream is not destroyable
    ):
        with raises_named("phxhErrorInvalidResourceHandle"):
            call()
    assert rt.rt.stream_query(stream) == 400
    with raises_named("phxhErrorInvalidValue"):
        rt.launch_host_func(0, 0, 0)  # NULL fn
    assert rt.stream_create() != stream  # handles are never reused


def test_default_stream_orders_with_sync_copy(rt, rng, cfns):
    n = 128 * KiB
    dev = rt.device_alloc(n)
    src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
    job = CopyJob(dev, addr(src), n, 30000)
    rt.launch_host_func(0, fn_addr(cfns, "copy_job"), ctypes.addressof(job))
    rt.memcpy(addr(out), dev, n, D2H)  # waits for the default stream, as cudaMemcpy does
    assert np.array_equal(out, src)
    rt.rt.device_synchronize()
    rt.device_free(dev)


def test_many_small_async_copies_are_cheap(rt, rng):
    count, n = 20000, 4 * KiB
    dev = rt.device_alloc(count * n)
    src, out = random_bytes(rng, count * n), np.zeros(count * n, np.uint8)
    stream = rt.stream_create()
    t0 = time.perf_counter()
    for i in range(count):
        rt.memcpy_async(dev + i * n, addr(src) + i * n, n, H2D, stream)
    rt.stream_synchronize(stream)
    elapsed = time.perf_counter() - t0
    rt.memcpy(addr(out), dev, count * n, D2H)
    assert np.array_equal(out, src)
    assert elapsed < 5.0, f"{count} queued copies took {elapsed:.2f} s"
    rt.stream_destroy(stream)
    rt.device_free(dev)


def test_threads_allocate_copy_and_free_concurrently(rt):
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            stream = rt.stream_create()
            for _ in range(40):
                n = int(rng.integers(1, 300 * KiB))
                dev = rt.device_alloc(n)
                src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
                rt.memcpy_async(dev, addr(src), n, H2D, stream)
                rt.memcpy_async(addr(out), dev, n, D2H, stream)
                rt.stream_synchronize(stream)
                assert np.array_equal(out, src)
                rt.device_free(dev)
            rt.stream_destroy(stream)
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_close_destroys_the_streams_it_created():
    runtime = Runtime()
    stream = runtime.stream_create()
    runtime.close()
    with raises_named("phxhErrorInvalidResourceHandle"):
        runtime.stream_synchronize(stream)
    runtime.close()  # idempotent


# -- host memory -----------------------------------------------------------------------------


def test_pinned_host_memory(rt, rng):
    n = 100 * KiB + 1
    ptr = rt.host_alloc_pinned(n)
    info = rt.pointer_info(ptr + 77)
    assert (info.type, info.base, info.size) == (MemoryType.HOST_PINNED, ptr, n)
    dev = rt.device_alloc(n)
    src = random_bytes(rng, n)
    ctypes.memmove(ptr, addr(src), n)
    rt.memcpy(dev, ptr, n, H2D)
    assert np.array_equal(device_bytes(rt, dev, n), src)
    rt.device_free(dev)
    with raises_named("phxhErrorHostMemoryAlreadyRegistered"):
        rt.host_register(ptr, 4096)  # pinned memory is registered already
    rt.host_free_pinned(ptr)
    assert rt.pointer_info(ptr).type is MemoryType.HOST
    for bad in (ptr, 0, 0xDEAD0000):
        with raises_named("phxhErrorInvalidValue"):
            rt.host_free_pinned(bad)
    with raises_named("phxhErrorInvalidValue"):
        rt.host_alloc_pinned(0)


def test_sizes_past_2_63_are_refused_not_wrapped(rt):
    """A size the runtime's size_t would wrap (2**64 + 4096 allocated 4096 bytes and was
    recorded as 2**64 + 4096: extents past the allocation then passed the checks) is refused,
    as are 0, negatives and bools."""

    for size in (2**64 + 4096, 2**63, 0, -1, True):
        for call in (rt.device_alloc, rt.host_alloc_pinned):
            with pytest.raises(VendorError):
                call(size)
    ptr = rt.device_alloc(np.int64(4096))  # a NumPy integer is an integer
    rt.device_free(ptr)


def test_host_registration(rt):
    buf = np.zeros(1 * MiB, np.uint8)
    base = addr(buf)
    plain = rt.pointer_info(base)
    assert (plain.type, plain.device, plain.base, plain.size) == (MemoryType.HOST, None, base, 0)
    rt.host_register(base + 4096, 512 * KiB)
    info = rt.pointer_info(base + 4096 + 1000)
    assert (info.type, info.base, info.size) == (MemoryType.HOST_PINNED, base + 4096, 512 * KiB)
    assert rt.pointer_info(base).type is MemoryType.HOST  # just outside the registration
    for ptr, size in ((base + 4096, 512 * KiB), (base, 4097), (base + 512 * KiB, 8192), (base, 1 * MiB)):
        with raises_named("phxhErrorHostMemoryAlreadyRegistered"):
            rt.host_register(ptr, size)
    with raises_named("phxhErrorHostMemoryNotRegistered"):
        rt.host_unregister(base + 8192)  # not the base
    rt.host_register(base + 600 * KiB, 4096)  # a disjoint range is fine
    rt.host_unregister(base + 600 * KiB)
    rt.host_unregister(base + 4096)
    with raises_named("phxhErrorHostMemoryNotRegistered"):
        rt.host_unregister(base + 4096)
    assert rt.pointer_info(base + 4096).type is MemoryType.HOST
    with raises_named("phxhErrorInvalidValue"):
        rt.host_register(base, 0)
    with raises_named("phxhErrorInvalidValue"):
        rt.host_register(0, 4096)
    dev = rt.device_alloc(4096)
    with raises_named("phxhErrorInvalidValue"):
        rt.host_register(dev, 4096)  # device memory is not host memory
    rt.device_free(dev)


def test_registering_unmapped_memory_is_refused(rt):
    import mmap

    m = mmap.mmap(-1, 3 * 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(base + 4096, 4096) == 0  # a hole in the middle
    with raises_named("phxhErrorInvalidValue"):
        rt.host_register(base, 3 * 4096)
    rt.host_register(base, 4096)
    rt.host_unregister(base)


# -- data path and direct capability ----------------------------------------------------------


def test_data_path_table_is_the_runtime_c_functions(rt, rng):
    table = rt.data_path()
    assert isinstance(table, DataPathTable) and table.missing() == []
    assert (table.abi_version, table.success) == (DATA_PATH_ABI, 0)
    assert (table.kind_h2h, table.kind_h2d, table.kind_d2h, table.kind_d2d) == (0, 1, 2, 3)
    lib = ctypes.CDLL(rt.rt.library)  # the library the port bound, with symbols of its own
    for field, symbol in [
        ("set_device", "phxhSetDevice"),
        ("memcpy_async", "phxhMemcpyAsync"),
        ("stream_create", "phxhStreamCreateWithFlags"),
        ("stream_synchronize", "phxhStreamSynchronize"),
        ("stream_destroy", "phxhStreamDestroy"),
        ("launch_host_func", "phxhLaunchHostFunc"),
        ("host_register", "phxhHostRegister"),
        ("host_unregister", "phxhHostUnregister"),
    ]:
        assert getattr(table, field) == ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value

    # call through the raw pointers, as the I/O core does
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(vp), ctypes.c_uint)(table.stream_create)
    copy = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, sz, ctypes.c_int, vp)(table.memcpy_async)
    sync = ctypes.CFUNCTYPE(ctypes.c_int, vp)(table.stream_synchronize)
    destroy = ctypes.CFUNCTYPE(ctypes.c_int, vp)(table.stream_destroy)
    n = 3 * MiB
    dev = rt.device_alloc(n)
    src, out = random_bytes(rng, n), np.zeros(n, np.uint8)
    stream = vp()
    assert create(ctypes.byref(stream), table.stream_flags) == 0
    assert copy(dev, addr(src), n, table.kind_h2d, stream) == 0
    assert copy(addr(out), dev, n, table.kind_d2h, stream) == 0
    assert copy(addr(out), dev, n + 1, table.kind_d2h, stream) == 1  # refused at enqueue
    assert sync(stream) == 0 and destroy(stream) == 0 and sync(stream) == 400
    assert np.array_equal(out, src)
    rt.device_free(dev)


def test_direct_capable(rt):
    dev = rt.device_alloc(1 * MiB)
    ok, why = rt.direct_capable(dev + 4096, 1 * MiB - 4096)
    assert ok and "O_DIRECT" in why
    assert not rt.direct_capable(dev + 4096, 1 * MiB)[0]  # runs past the allocation
    host = np.zeros(4096, np.uint8)
    assert not rt.direct_capable(addr(host), 4096)[0]
    rt.device_free(dev)
    assert not rt.direct_capable(dev, 4096)[0]


# -- settings (one process each) ---------------------------------------------------------------


def test_two_devices():
    res = run_child(
        """
        import ctypes, threading
        import numpy as np
        from phoenix.vendor import CopyKind, MemoryType
        from phoenix.vendors.host.runtime import Runtime
        rt = Runtime()
        devs = rt.devices()
        assert [d.ordinal for d in devs] == [0, 1], devs
        assert len({d.pci_bus_id for d in devs}) == 2 and all(d.total_memory == 64 << 20 for d in devs)
        a, b = rt.device_alloc(1 << 20, device=0), rt.device_alloc(1 << 20, device=1)
        assert rt.pointer_info(a).device == 0 and rt.pointer_info(b).device == 1
        cur = ctypes.c_int(); rt.rt.get_device(ctypes.byref(cur)); assert cur.value == 0  # restored
        src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        out = np.zeros_like(src)
        s1 = rt.stream_create(device=1)
        rt.memcpy_async(a, src.ctypes.data, src.size, CopyKind.HOST_TO_DEVICE, s1)
        rt.memcpy_async(b, a, src.size, CopyKind.DEVICE_TO_DEVICE, s1)   # across devices
        rt.memcpy_async(out.ctypes.data, b, src.size, CopyKind.DEVICE_TO_HOST, s1)
        rt.stream_synchronize(s1)
        assert np.array_equal(out, src)
        rt.set_device(1)
        seen = []
        t = threading.Thread(target=lambda: (rt.rt.get_device(ctypes.byref(c := ctypes.c_int())), seen.append(c.value)))
        t.start(); t.join()
        assert seen == [0]  # the current device is per thread
        rt.rt.device_synchronize()
        big = rt.device_alloc(60 << 20, device=1)
        rt.device_free(big)
        big = rt.device_alloc(60 << 20, device=1)   # the quarantine gives way rather than OOM
        try:
            rt.device_alloc(8 << 20, device=1)
        except Exception as exc:
            assert "phxhErrorMemoryAllocation" in str(exc), exc
        else:
            raise AssertionError("over-allocation succeeded")
        rt.close()
        print("OK")
    """,
        PHX_HOST_DEVICES=2,
        PHX_HOST_DEVICE_MEMORY="64M",
    )
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr


@pytest.mark.parametrize(
    "env", [{"PHX_HOST_DEVICES": "lots"}, {"PHX_HOST_DEVICES": "99"}, {"PHX_HOST_DEVICE_MEMORY": "12X"}]
)
def test_bad_settings_make_the_probe_say_why(env):
    res = run_child(
        """
        from phoenix.vendors.host.runtime import Runtime
        p = Runtime.probe()
        print(p.usable, p.reason)
    """,
        **env,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("False") and "phxhErrorInitializationError" in res.stdout


def test_no_devices_is_reported():
    res = run_child(
        """
        from phoenix.vendors.host.runtime import Runtime
        p = Runtime.probe()
        print(p.usable, p.reason)
    """,
        PHX_HOST_DEVICES=0,
    )
    assert res.stdout.startswith("False") and "phxhErrorNoDevice" in res.stdout, res.stdout + res.stderr
