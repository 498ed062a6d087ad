"""Emulated CUDA-shaped runtimes (phoenix/emulator.py): the builder, the emulator's C surface,
and ``phx-port test <name> --emulated`` for the MetaX, NVIDIA and AMD ports.

Every emulator is phoenix's host runtime (phoenix/_testing/hostrt/hostrt.c) built with another
symbol prefix and library name: a test double, and every report of it must say so.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from phoenix import conformance, emulator
from phoenix.cudalike import CudaLikeRuntime, test_double_info
from phoenix.emulator import EmulatorError

CAPS = list(conformance.CAPABILITIES)
pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no C compiler to build an emulator")


def phx_port(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """The installed ``phx-port`` (not the source tree on the cwd), PHX_VENDOR left to it."""
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    cmd = (
        [script]
        if script
        else [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]
    )
    env = dict(os.environ, **(env_extra or {}))
    env.pop("PHX_VENDOR", None)
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private emulator cache: builds here never touch the user's."""
    return str(tmp_path_factory.mktemp("emulators"))


@pytest.fixture(scope="module")
def cuda_emu(cache):
    """A libcudart stand-in with the driver API, loaded locally (its names stay out of the process scope)."""
    emu = emulator.build("cuda", "libcudart.so", driver_prefix="cu", cache=cache)
    return emu, ctypes.CDLL(emu.library, mode=ctypes.RTLD_LOCAL)


# -- the builder -----------------------------------------------------------------------


def test_build_any_prefix(cache):
    emu = emulator.build("zz", "libzzrt.so", cache=cache)
    assert emu.library == os.path.join(emu.root, "lib", "libzzrt.so") and os.path.exists(emu.library)
    assert emu.label == "emulated runtime (test double)"
    with open(os.path.join(emu.root, emulator.MARKER_FILE)) as fh:
        assert "emulated runtime (test double)" in fh.read()
    lib = ctypes.CDLL(emu.library, mode=ctypes.RTLD_LOCAL)
    for sym in (
        "zzMalloc",
        "zzFree",
        "zzMemcpyAsync",
        "zzLaunchHostFunc",
        "zzPointerGetAttributes",
        "zzGetDeviceProperties",
        "zzEventRecord",
        "zzStreamQuery",
        "zzMemset",
    ):
        assert hasattr(lib, sym), sym
    assert not hasattr(lib, "cuInit"), "a driver API is only built when asked for"
    lib.zzGetErrorName.restype = lib.zzGetErrorString.restype = ctypes.c_char_p
    assert lib.zzGetErrorName(1) == b"zzErrorInvalidValue"
    assert lib.zzGetErrorString(1) == b"invalid argument"
    assert "emulated runtime (test double)" in emulator.emulator_info(lib, "zz")
    assert "prefix zz" in emulator.emulator_info(lib, "zz")
    assert test_double_info(lib, "zz") == emulator.emulator_info(lib, "zz"), "a port labels it as the builder does"
    assert emulator.LABEL == emu.label


def test_build_is_cached(cache):
    first = emulator.build("zz", "libzzrt.so", cache=cache)
    mtime = os.stat(first.library).st_mtime_ns
    again = emulator.build("zz", "libzzrt.so", cache=cache)
    assert again == first and os.stat(again.library).st_mtime_ns == mtime
    other = emulator.build("zz", "libzzrt.so", pointer_layout="both", cache=cache)
    assert other.library != first.library, "another layout is another library"


@pytest.mark.parametrize(
    "args, message",
    [
        (("1x", "libx.so"), "not a C identifier"),
        (("mc", "mcruntime.so"), "lib<name>.so"),
        (("mc", "../libmc.so"), "lib<name>.so"),
        (("mc", "libmc.so", {"pointer_layout": "sideways"}), "choose one of"),
    ],
)
def test_build_refuses_bad_requests(cache, args, message):
    kwargs = args[2] if len(args) > 2 else {}
    with pytest.raises(EmulatorError, match=message):
        emulator.build(args[0], args[1], cache=cache, **kwargs)


def test_compile_failure_is_reported(cache, tmp_path):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'hostrt.c:1: error: something broke' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    with pytest.raises(EmulatorError, match="something broke"):
        emulator.build("qq", "libqq.so", cache=cache, cc=str(fake_cc))
    for d in (d for d in os.listdir(cache) if d.startswith("qq-")):
        assert not os.listdir(os.path.join(cache, d, "lib")), "a failed build leaves nothing behind"


def test_vendor_conventions():
    from phoenix.vendors.amd.runtime import Runtime as Amd
    from phoenix.vendors.host.runtime import Runtime as Host
    from phoenix.vendors.metax.runtime import Runtime as Metax
    from phoenix.vendors.nvidia.runtime import Runtime as Nvidia

    assert emulator.vendor_spec(Metax) == {"prefix": "mc", "library_name": "libmcruntime.so", "driver_prefix": None}
    assert emulator.vendor_spec(Nvidia) == {"prefix": "cuda", "library_name": "libcudart.so", "driver_prefix": "cu"}
    assert emulator.vendor_spec(Amd) == {"prefix": "hip", "library_name": "libamdhip64.so", "driver_prefix": None}
    with pytest.raises(EmulatorError, match="itself a test double"):
        emulator.vendor_spec(Host)

    class NoLibrary(CudaLikeRuntime):
        name = "acme-x"
        prefix = "acme"

    with pytest.raises(EmulatorError, match="library_names"):
        emulator.vendor_spec(NoLibrary)
    NoLibrary.library_names = ("libacmert.so.3",)
    assert emulator.vendor_spec(NoLibrary)["library_name"] == "libacmert.so.3"
    emu = emulator.Emulator("acme", "libacmert.so.3", "/r", "/r/lib/libacmert.so.3", "hostrt.c", "type", None)
    assert emulator.vendor_env(NoLibrary, emu) == {"PHX_ACME_X_LIBRARY": "/r/lib/libacmert.so.3"}
    assert emulator.vendor_env(Metax, emu) == {"MACA_PATH": "/r", "PHX_METAX_LIBRARY": None}
    env = emulator.apply_env({"PHX_METAX_LIBRARY": "/real/lib.so", "X": "1"}, emulator.vendor_env(Metax, emu))
    assert env == {"X": "1", "MACA_PATH": "/r"}
    assert emulator.vendor_env(Amd, emu) == {"ROCM_PATH": "/r", "PHX_AMD_LIBRARY": None}
    assert emulator.vendor_env(Nvidia, emu) == {"PHX_NVIDIA_LIBRARY": "/r/lib/libacmert.so.3"}


def test_vendor_facts_are_declared():
    """auto priority and the read-only registration flag are the port's (the registry and settings read them)."""
    from phoenix.vendors.amd.runtime import Runtime as Amd
    from phoenix.vendors.host.runtime import Runtime as Host
    from phoenix.vendors.metax.runtime import Runtime as Metax
    from phoenix.vendors.nvidia.runtime import Runtime as Nvidia

    assert [R.auto_priority for R in (Nvidia, Amd, Metax, Host)] == [100, 90, 80, 0]
    # the host double takes CUDA's flags, so the read-only registration and its retry run in CI
    assert [R.host_register_read_only_flag for R in (Nvidia, Amd, Metax, Host)] == [8, 8, 0, 8]


# -- the emulator's CUDA-shaped surface beyond the host runtime's ------------------------------


class DeviceProp(ctypes.Structure):
    """The head of the emulator's phxrtDeviceProp (hostrt.h)."""

    _fields_ = [
        ("name", ctypes.c_char * 256),
        ("uuid", ctypes.c_ubyte * 16),
        ("luid", ctypes.c_char * 8),
        ("luidDeviceNodeMask", ctypes.c_uint),
        ("totalGlobalMem", ctypes.c_size_t),
        ("pciBusID", ctypes.c_int),
        ("pciDeviceID", ctypes.c_int),
        ("pciDomainID", ctypes.c_int),
    ]


def test_device_properties_and_attributes(cuda_emu):
    _, lib = cuda_emu
    prop = ctypes.create_string_buffer(4096)  # a caller's larger struct is never overrun past the emulator's
    assert lib.cudaGetDeviceProperties(prop, 0) == 0
    p = DeviceProp.from_buffer(prop)
    assert p.name == b"Phoenix emulated cuda device (test double)"
    bus = ctypes.create_string_buffer(32)
    assert lib.cudaDeviceGetPCIBusId(bus, 32, 0) == 0
    assert bus.value.decode() == f"{p.pciDomainID:04x}:{p.pciBusID:02x}:{p.pciDeviceID:02x}.0"
    assert p.totalGlobalMem > 0
    value = ctypes.c_int(-1)
    assert lib.cudaDeviceGetAttribute(ctypes.byref(value), 33, 0) == 0 and value.value == p.pciBusID
    assert lib.cudaDeviceGetAttribute(ctypes.byref(value), 9999, 0) == 1  # not emulated: refused
    assert lib.cudaGetDeviceProperties(prop, 99) == 101  # invalid device
    version = ctypes.c_int()
    assert lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0 and version.value >= 10000
    assert lib.cudaDriverGetVersion(ctypes.byref(version)) == 0 and version.value >= 10000


def test_events_follow_the_stream(cuda_emu, tmp_path):
    _, lib = cuda_emu
    gcc = emulator.compiler()
    src = tmp_path / "gate.c"
    src.write_text("void wait_gate(void *arg) { volatile int *g = arg; while (!*g) {} }\n")
    so = tmp_path / "libgate.so"
    assert os.system(f"{gcc} -shared -fPIC -O1 {src} -o {so}") == 0
    wait_gate = ctypes.cast(ctypes.CDLL(str(so)).wait_gate, ctypes.c_void_p)

    stream, event = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    assert lib.cudaEventCreateWithFlags(ctypes.byref(event), 0) == 0
    assert lib.cudaEventQuery(event) == 0, "an event never recorded is complete"
    gate = ctypes.c_int(0)
    assert lib.cudaLaunchHostFunc(stream, wait_gate, ctypes.byref(gate)) == 0
    assert lib.cudaEventRecord(event, stream) == 0
    assert lib.cudaEventQuery(event) == 600, "recorded behind held-back work: not ready"
    assert lib.cudaStreamQuery(stream) == 600
    gate.value = 1
    assert lib.cudaEventSynchronize(event) == 0
    assert lib.cudaEventQuery(event) == 0
    assert lib.cudaEventDestroy(event) == 0
    assert lib.cudaEventDestroy(event) == 400, "a destroyed event is an invalid handle"
    assert lib.cudaEventRecord(event, stream) == 400
    assert lib.cudaStreamDestroy(stream) == 0


def test_memset_and_mapped_host_pointers(cuda_emu):
    _, lib = cuda_emu
    dev, host = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(1000)) == 0
    assert lib.cudaMemset(dev, 0x7E, ctypes.c_size_t(1000)) == 0
    out = np.zeros(1000, dtype=np.uint8)
    assert lib.cudaMemcpy(ctypes.c_void_p(out.ctypes.data), dev, ctypes.c_size_t(1000), 2) == 0
    assert (out == 0x7E).all()
    assert lib.cudaMemset(dev, 0, ctypes.c_size_t(1001)) == 1, "past the allocation's end"
    assert lib.cudaMemset(ctypes.c_void_p(out.ctypes.data), 0, ctypes.c_size_t(10)) == 1, "host memory"
    assert lib.cudaMallocHost(ctypes.byref(host), ctypes.c_size_t(4096)) == 0
    mapped = ctypes.c_void_p()
    assert lib.cudaHostGetDevicePointer(ctypes.byref(mapped), host, 0) == 0 and mapped.value == host.value
    assert lib.cudaHostGetDevicePointer(ctypes.byref(mapped), ctypes.c_void_p(out.ctypes.data), 0) == 1
    assert lib.cudaHostGetDevicePointer(ctypes.byref(mapped), host, 1) == 1, "flags must be 0"
    assert lib.cudaFreeHost(host) == 0
    assert lib.cudaFree(dev) == 0
    assert lib.cudaMemset(dev, 0, ctypes.c_size_t(1)) == 1, "freed device memory"


def test_driver_api(cuda_emu):
    _, lib = cuda_emu
    dev = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(5000)) == 0
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    base, size, mtype = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint()
    assert lib.cuInit(0) == 0
    assert lib.cuPointerGetAttribute(ctypes.byref(base), 11, dev.value + 17) == 0 and base.value == dev.value
    assert lib.cuPointerGetAttribute(ctypes.byref(size), 12, dev.value + 17) == 0 and size.value == 5000
    assert lib.cuPointerGetAttribute(ctypes.byref(mtype), 2, dev.value) == 0 and mtype.value == 2
    assert lib.cuPointerGetAttribute(ctypes.byref(mtype), 1, dev.value) == 801, "unsupported attribute"
    plain = np.zeros(8, dtype=np.uint8)
    assert lib.cuPointerGetAttribute(ctypes.byref(base), 11, plain.ctypes.data) == 1
    name = ctypes.c_char_p()
    assert lib.cuGetErrorName(801, ctypes.byref(name)) == 0 and name.value == b"CUDA_ERROR_NOT_SUPPORTED"
    assert lib.cudaFree(dev) == 0


def test_driver_api_needs_init(cache):
    emu = emulator.build("cuda", "libcudart.so", driver_prefix="cu", cache=cache)
    # a fresh copy: its own state, cuInit not yet called
    fresh = os.path.join(os.path.dirname(emu.library), "..", "libcudart-fresh.so")
    shutil.copy(emu.library, fresh)
    lib = ctypes.CDLL(fresh, mode=ctypes.RTLD_LOCAL)
    count = ctypes.c_int()
    assert lib.cuDeviceGetCount(ctypes.byref(count)) == 3, "CUDA_ERROR_NOT_INITIALIZED before cuInit"
    assert lib.cuInit(1) == 1, "cuInit flags must be 0"
    assert lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value >= 1


# -- phx-port test --emulated ------------------------------------------------------------------


def _run(tmp_path_factory, vendor, *extra, env_extra=None):
    report_dir = tmp_path_factory.mktemp(f"report-{vendor}")
    cache = tmp_path_factory.getbasetemp() / "phx-port-emulators"
    env = {"PHX_EMULATOR_CACHE": str(cache), **(env_extra or {})}
    proc = phx_port("test", vendor, "--emulated", "--report-dir", str(report_dir), *extra, env_extra=env)
    return proc, report_dir


@pytest.fixture(scope="module")
def metax_run(tmp_path_factory):
    return _run(tmp_path_factory, "metax")


def _check_every_capability_passes(proc, vendor):
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index(f"phoenix conformance: vendor {vendor}") :]
    assert f"vendor {vendor} (emulated runtime, test double): PASS" in table
    assert "runtime: emulated runtime (test double)" in table
    for cap in CAPS:
        row = next((line for line in table.splitlines() if line.startswith(cap + " ")), None)
        assert row is not None and row.split()[1] == "pass", row or f"no row for {cap}:\n{table}"


def test_metax_emulated_passes_every_capability(metax_run):
    proc, _ = metax_run
    _check_every_capability_passes(proc, "metax")
    assert "libmcruntime.so with mc* symbols" in proc.stdout


def test_metax_emulated_report_says_emulated(metax_run):
    _, report_dir = metax_run
    assert not (report_dir / "conformance-metax.json").exists(), "an emulated report is never the hardware one"
    report = json.loads((report_dir / "conformance-metax-emulated.json").read_text())
    assert report["result"] == "pass" and report["is_test_double"] is True
    emu = report["emulated"]
    assert emu["label"] == "emulated runtime (test double)"
    assert emu["prefix"] == "mc" and emu["library_name"] == "libmcruntime.so"
    assert emu["via"].startswith("MACA_PATH=")
    info = report["vendor_info"]
    assert info["library"] == emu["library"], "the port bound the emulator, found through MACA_PATH"
    assert info["is_test_double"] is True and "emulated runtime (test double)" in info["runtime_description"]
    assert all("emulated mc device (test double)" in d["name"] for d in info["devices"])
    assert report["settings"]["PHX_HOST_DEVICES"] == "2"
    md = (report_dir / "conformance-metax-emulated.md").read_text()
    assert md.startswith("# Phoenix conformance report: `metax` (emulated runtime)")
    assert "emulated runtime (test double): libmcruntime.so (prefix mc)" in md


def test_amd_emulated_passes_every_capability(tmp_path_factory):
    """The AMD port, generated by phx-port new and declared to HIP's facts, on an emulated libamdhip64.so."""
    proc, report_dir = _run(tmp_path_factory, "amd")
    _check_every_capability_passes(proc, "amd")
    assert "libamdhip64.so with hip* symbols" in proc.stdout
    report = json.loads((report_dir / "conformance-amd-emulated.json").read_text())
    assert report["emulated"]["prefix"] == "hip" and report["emulated"]["via"].startswith("ROCM_PATH=")
    assert report["vendor_info"]["library"] == report["emulated"]["library"], "found as the installation at ROCM_PATH"
    assert all("emulated hip device (test double)" in d["name"] for d in report["vendor_info"]["devices"])


def test_amd_port_uses_hips_own_queries(cache, monkeypatch):
    """Names, sizes and allocation ranges from hipDeviceGetName, hipDeviceTotalMem, hipMemGetAddressRange;
    the pointer layout and memory-type numbers measured, whatever the ROCm release's struct."""
    from phoenix.vendors.amd.runtime import Runtime

    for layout in ("type", "memoryType"):  # ROCm 6's `type`; ROCm 5's union read by its other name
        emu = emulator.build("hip", "libamdhip64.so", pointer_layout=layout, cache=cache)
        for key, value in Runtime.emulated_env(emu).items():
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        with Runtime() as rt:
            assert {p.pyname for p in rt.extra_protos()} == {
                "device_name_call",
                "device_memory_call",
                "address_range_call",
            }
            dev = rt.devices()[0]
            assert dev.name == "Phoenix emulated hip device (test double)" and dev.total_memory > 0
            other = ctypes.c_void_p()  # allocated behind the port's back: the runtime still knows its range
            rt.rt.malloc(ctypes.byref(other), ctypes.c_size_t(5000))
            info = rt.pointer_info(other.value + 17)
            assert (info.type.value, info.base, info.size) == ("device", other.value, 5000)
            assert rt.pointer_layout["source"] == "measured at run time"
            rt.rt.free(other)


def test_nvidia_emulated_runs_the_suite(tmp_path_factory):
    proc, report_dir = _run(tmp_path_factory, "nvidia")
    _check_every_capability_passes(proc, "nvidia")
    report = json.loads((report_dir / "conformance-nvidia-emulated.json").read_text())
    assert report["emulated"]["driver_prefix"] == "cu"
    assert report["vendor_info"]["library"] == report["emulated"]["library"]
    assert report["emulated"]["via"].startswith("PHX_NVIDIA_LIBRARY=")


def test_host_cannot_be_emulated():
    proc = phx_port("test", "host", "--emulated")
    assert proc.returncode == 2
    assert "itself a test double" in proc.stderr


def test_vendor_that_ignores_the_emulator_fails(tmp_path_factory, tmp_path, cache):
    """A port that binds some other library than the emulator it was given fails the run."""
    elsewhere = emulator.build("mc", "libmcruntime.so", pointer_layout="memoryType", cache=cache)
    (tmp_path / "stubborn").mkdir()
    (tmp_path / "stubborn" / "runtime.py").write_text(
        textwrap.dedent(f"""
        from phoenix.cudalike import CudaLikeRuntime, test_double_info
        from phoenix.vendor import Probe

        class Runtime(CudaLikeRuntime):
            name = "stubborn"
            prefix = "mc"
            library_names = ("libmcruntime.so",)

            @classmethod
            def probe(cls):
                return Probe(True, "always its own library")

            def library_path(self):
                return {elsewhere.library!r}  # ignores PHX_STUBBORN_LIBRARY
    """)
    )
    proc, _ = _run(
        tmp_path_factory,
        "stubborn",
        "-k",
        "test_vendor_imports or test_probe_usable or identity",
        env_extra={"PHX_VENDOR_PATH": str(tmp_path)},
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "not the emulated runtime" in proc.stdout and "PHX_STUBBORN_LIBRARY" in proc.stdout


# -- the NVIDIA port's emulated path ------------------------------------------------------------


def test_nvidia_port_on_emulator_without_driver_api(cache, monkeypatch):
    """No driver API in the emulator: names from cudaGetDeviceProperties, allocation ranges unknown, said so."""
    from phoenix.vendors.nvidia.runtime import Runtime

    emu = emulator.build("cuda", "libcudart.so", cache=cache)
    monkeypatch.setenv(Runtime.library_env(), emu.library)
    probe = Runtime.probe()
    assert probe.usable and "WITHOUT a driver API" in probe.reason and "emulated runtime (test double)" in probe.reason
    with Runtime() as rt:
        assert rt.is_test_double and rt.devices()[0].name == "Phoenix emulated cuda device (test double)"
        ptr = rt.device_alloc(4096)
        info = rt.pointer_info(ptr + 8)
        assert info.base == ptr + 8 and info.size == 0, "without the driver the range is unknown, not made up"
        rt.device_free(ptr)


def test_nvidia_library_override(tmp_path, monkeypatch):
    from phoenix.vendors.nvidia.runtime import Runtime

    LIBRARY_ENV = Runtime.library_env()
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "libcudart.so"))
    probe = Runtime.probe()
    assert not probe.usable and "no such file" in probe.reason
    gcc = emulator.compiler()
    (tmp_path / "other.c").write_text("int cudaRuntimeGetVersion(int *v) { *v = 12000; return 0; }\n")
    assert os.system(f"{gcc} -shared -fPIC {tmp_path / 'other.c'} -o {tmp_path / 'libother.so'}") == 0
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "libother.so"))
    probe = Runtime.probe()  # not an emulator: the real path, with only this candidate
    assert not probe.usable and "emulated" not in probe.reason
