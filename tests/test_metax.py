"""The MetaX port (vendors/metax/runtime.py): finding libmcruntime.so, errors, pointer layouts.

No MetaX hardware here: the port runs against phoenix's emulated runtime built as
libmcruntime.so (a test double) in a MACA-like tree (``<root>/lib``). The port is a
declaration over phoenix.cudalike, so these tests also hold the CUDA-shaped machinery
to what a MetaX installation needs: the search order, the labels, the layouts.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from phoenix import emulator
from phoenix.errors import VendorError, VendorUnavailable
from phoenix.vendor import CopyKind, MemoryType
from phoenix.vendors.metax import runtime as metax

pytestmark = pytest.mark.skipif(emulator.compiler() is None, reason="no C compiler to build the emulated MACA runtime")

LIBRARY_ENV = metax.Runtime.library_env()
LAYOUT_ENV = metax.Runtime.pointer_layout_env()
MACA_VARS = (LIBRARY_ENV, *metax.Runtime.library_roots, LAYOUT_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    """No MACA settings from the machine running the tests."""
    for var in MACA_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emulators"))


def maca_tree(base, cache, layout: str = "type") -> str:
    """A MACA-like installation whose libmcruntime.so is an emulator (its own copy: its own state)."""
    emu = emulator.build("mc", "libmcruntime.so", pointer_layout=layout, cache=cache)
    os.makedirs(os.path.join(base, "lib"))
    shutil.copy(emu.library, os.path.join(base, "lib", "libmcruntime.so"))
    return str(base)


@pytest.fixture(scope="module")
def maca(tmp_path_factory, cache):
    return maca_tree(tmp_path_factory.mktemp("maca"), cache)


@pytest.fixture
def rt(clean_env, maca):
    clean_env.setenv("MACA_PATH", maca)
    with metax.Runtime() as runtime:
        yield runtime


# -- finding the runtime ------------------------------------------------------------------


def phx_info(env: dict) -> subprocess.CompletedProcess:
    script = shutil.which("phx", path=os.path.dirname(sys.executable))
    cmd = (
        [script]
        if script
        else [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.phx import main; sys.exit(main())"]
    )
    return subprocess.run([*cmd, "info"], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.path.exists("/opt/maca/lib/libmcruntime.so"), reason="MACA is installed here")
def test_phx_info_without_maca(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in MACA_VARS and k != "LD_LIBRARY_PATH"}
    env.update(PHX_VENDOR="metax", MACA_HOME=str(tmp_path / "nothing"))
    proc = phx_info(env)
    assert proc.returncode != 0, "metax requested explicitly and unavailable: phx info must fail"
    out = proc.stdout
    assert "libmcruntime.so not found" in out
    for place in (
        "$MACA_PATH/lib (unset)",
        f"$MACA_HOME/lib: {tmp_path}/nothing/lib/libmcruntime.so (no such file)",
        "$MACA_ROOT/lib (unset)",
        "/opt/maca/lib",
        "the loader's path",
    ):
        assert place in out, f"{place!r} missing from:\n{out}"


def test_probe_search_order(clean_env, tmp_path, maca):
    clean_env.setenv("MACA_PATH", str(tmp_path / "empty"))
    clean_env.setenv("MACA_HOME", maca)
    clean_env.setenv("MACA_ROOT", str(tmp_path / "never-reached"))
    probe = metax.Runtime.probe()
    assert probe.usable, probe.reason
    assert probe.details["library"] == os.path.join(maca, "lib", "libmcruntime.so")
    assert probe.details["root"] == maca
    looked = probe.details["looked"]
    assert looked[0].startswith("$MACA_PATH/lib") and "no such file" in looked[0]
    assert looked[1].startswith("$MACA_HOME/lib") and looked[1].endswith("(found)")
    assert len(looked) == 2, "the search stops at the first library found"
    assert "emulated runtime (test double)" in probe.reason and "not MACA" in probe.reason


def test_library_override(clean_env, tmp_path, maca):
    clean_env.setenv("MACA_PATH", str(tmp_path / "ignored"))
    clean_env.setenv(LIBRARY_ENV, os.path.join(maca, "lib", "libmcruntime.so"))
    probe = metax.Runtime.probe()
    assert probe.usable and probe.details["looked"] == [f"${LIBRARY_ENV}: {probe.details['library']} (found)"]
    clean_env.setenv(LIBRARY_ENV, str(tmp_path / "libmcruntime.so"))
    probe = metax.Runtime.probe()
    assert not probe.usable and "no such file" in probe.reason
    with pytest.raises(VendorUnavailable, match="libmcruntime.so not found"):
        metax.Runtime()


def test_not_a_maca_library(clean_env, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmcruntime.so").write_text("not an ELF file")
    clean_env.setenv("MACA_PATH", str(tmp_path))
    probe = metax.Runtime.probe()
    assert not probe.usable and "cannot be loaded" in probe.reason


# -- the port against the emulated runtime ----------------------------------------------------


def test_identity(rt, maca):
    assert rt.name == "metax" and rt.prefix == "mc" and rt.p2p_page_size == 65536
    assert rt.is_test_double and "emulated runtime (test double)" in rt.runtime_description
    assert rt.rt.library == os.path.join(maca, "lib", "libmcruntime.so")
    assert not metax.Runtime.is_test_double, "only an instance bound to an emulator is a test double"
    devices = rt.devices()
    assert devices and devices[0].name == "Phoenix emulated mc device (test double)"
    assert devices[0].pci_bus_id == "0000:f0:00.0" and devices[0].total_memory > 0


def test_error_carries_maca_name_and_string(rt):
    with pytest.raises(VendorError) as info:
        rt.device_alloc(0)
    err = info.value
    assert (err.vendor, err.call, err.code) == ("metax", "mcMalloc", 1)
    assert err.name == "mcErrorInvalidValue" and err.message == "invalid argument"
    assert str(err) == "metax: mcMalloc failed with mcErrorInvalidValue: invalid argument (code 1)"

    dev = rt.device_alloc(4096)
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(VendorError) as info:  # a device pointer given as the host side
        rt.memcpy(dev, host.ctypes.data, 4096, CopyKind.DEVICE_TO_HOST)
    assert info.value.name == "mcErrorInvalidMemcpyDirection"
    rt.device_free(dev)
    with pytest.raises(VendorError) as info:
        rt.device_free(dev)
    assert info.value.name == "mcErrorInvalidValue" and info.value.call == "mcFree"
    with pytest.raises(VendorError) as info:
        rt.stream_synchronize(0xDEAD)
    assert info.value.name == "mcErrorInvalidResourceHandle"


def test_zero_sizes_refused_by_the_port(rt, monkeypatch):
    """MACA, like CUDA, may answer Malloc(0) with success and NULL: the port refuses before asking."""

    def permissive(ptr, size):
        return 0

    monkeypatch.setattr(rt.rt, "malloc", permissive)
    monkeypatch.setattr(rt.rt, "malloc_host", permissive)
    for call, op in (("mcMalloc", rt.device_alloc), ("mcMallocHost", rt.host_alloc_pinned)):
        with pytest.raises(VendorError) as info:
            op(0)
        assert (info.value.call, info.value.name) == (call, "mcErrorInvalidValue")


def test_data_path_is_the_library(rt, maca):
    table = rt.data_path()
    lib = ctypes.CDLL(os.path.join(maca, "lib", "libmcruntime.so"), mode=ctypes.RTLD_LOCAL)
    assert table.memcpy_async == ctypes.cast(lib.mcMemcpyAsync, ctypes.c_void_p).value
    assert table.launch_host_func == ctypes.cast(lib.mcLaunchHostFunc, ctypes.c_void_p).value
    assert table.missing() == []


def test_allocation_ranges(rt):
    a, b = rt.device_alloc(1000), rt.device_alloc(3 * 65536 + 5)
    assert rt.address_range(a + 999) == (a, 1000)
    assert rt.address_range(a + 1000) is None or rt.address_range(a + 1000)[0] != a
    assert rt.address_range(b + 65536) == (b, 3 * 65536 + 5)
    rt.device_free(a)
    assert rt.address_range(a) is None
    assert rt.pointer_info(a).type is MemoryType.HOST  # freed: not device memory any more
    rt.device_free(b)


# -- pointer-attribute layouts ----------------------------------------------------------------


def check_pointer_queries(runtime):
    dev = runtime.device_alloc(8192)
    pinned = runtime.host_alloc_pinned(4096)
    plain = np.zeros(4096, dtype=np.uint8)
    try:
        info = runtime.pointer_info(dev + 100)
        assert (info.type, info.device, info.base, info.size) == (MemoryType.DEVICE, 0, dev, 8192)
        info = runtime.pointer_info(pinned + 10)
        assert (info.type, info.base) == (MemoryType.HOST_PINNED, pinned)
        assert runtime.pointer_info(plain.ctypes.data).type is MemoryType.HOST
    finally:
        runtime.device_free(dev)
        runtime.host_free_pinned(pinned)


@pytest.mark.parametrize("layout, measured", [("type", "type"), ("memoryType", "type"), ("both", "both")])
def test_layout_measured(clean_env, tmp_path, cache, layout, measured):
    clean_env.setenv("MACA_PATH", maca_tree(tmp_path / "maca", cache, layout))
    with metax.Runtime() as runtime:
        check_pointer_queries(runtime)
        assert runtime.pointer_layout["layout"] == measured
        assert runtime.pointer_layout["source"].startswith("measured at run time")
        assert runtime.pointer_layout["field"] == "type"  # one name or the other at offset 0 reads the same


def test_layout_forced(clean_env, tmp_path, cache):
    clean_env.setenv("MACA_PATH", maca_tree(tmp_path / "maca", cache, "both"))
    clean_env.setenv(LAYOUT_ENV, "both")
    with metax.Runtime() as runtime:
        check_pointer_queries(runtime)
        assert runtime.pointer_layout == {"layout": "both", "field": "type", "source": f"${LAYOUT_ENV}"}


def test_emulated_env_points_at_the_installation():
    emu = emulator.Emulator("mc", "libmcruntime.so", "/emu", "/emu/lib/libmcruntime.so", "hostrt.c", "type", None)
    assert metax.Runtime.emulated_env(emu) == {"MACA_PATH": "/emu", LIBRARY_ENV: None}


def test_declared_facts():
    """What the registry, the settings and phx-port read off the port, declared, never guessed."""
    R = metax.Runtime
    assert (R.prefix, R.library_names, R.emulated_driver_prefix) == ("mc", ("libmcruntime.so",), None)
    assert R.auto_priority == 80 and R.host_register_read_only_flag == 0
    assert LIBRARY_ENV == "PHX_METAX_LIBRARY" and LAYOUT_ENV == "PHX_METAX_POINTER_ATTRIBUTES"
    assert [p.symbol for p in R.prototype_table()][:2] == ["mcGetDeviceCount", "mcSetDevice"]


def test_layout_forced_refuses_a_bad_name(clean_env, maca):
    clean_env.setenv("MACA_PATH", maca)
    clean_env.setenv(LAYOUT_ENV, "sideways")
    with metax.Runtime() as runtime, pytest.raises(ValueError, match="choose one of"):
        runtime.pointer_info(0x1000)


def test_an_emulator_is_never_picked_up_on_the_way(clean_env, tmp_path, maca):
    """A test double at a place the operator did not name (the default root, the loader's path) is passed over."""

    class Installed(metax.Runtime):  # MACA's default root holding an emulator
        default_root = maca

    probe = Installed.probe()
    assert not probe.usable, probe.reason
    assert "a test double: used only through $PHX_METAX_LIBRARY or a root variable" in probe.reason
