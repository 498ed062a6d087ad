"""The kernel side: phoenix.kmod, the modules built with -Werror, and the QEMU direct-path test.

What runs where:
* kmod against fake sysfs trees and its ioctl numbers against kernel/phx_ioctl.h: anywhere
  (the header check needs gcc and linux-libc-dev);
* the build of phx_core.ko and every vendors/<name>/p2p.c backend with -Werror (and sparse
  when installed): needs Debian's linux-headers-amd64;
* the QEMU test (kernel/qemu/run.py): needs the headers, the matching kernel image, QEMU,
  a static busybox and e2fsprogs. ``kernel/ci.sh`` installs all of it on Debian 12.
Each skips with the reason when what it needs is absent. PHX_KERNEL_TEST=0 skips the
build and the QEMU test.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from phoenix import kmod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join(ROOT, "kernel")
VENDORS = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "vendors", "*", "p2p.c")))

skip_heavy = pytest.mark.skipif(os.environ.get("PHX_KERNEL_TEST") == "0", reason="PHX_KERNEL_TEST=0")


# ---- kmod: what userspace reads ---------------------------------------------------------------

BACKENDS = (
    "amd unavailable devices=0 page_size=65536 reason: the AMD driver is not loaded "
    "(amdkfd_query_rdma_interface not found: ...) (-2)\n"
    "host available devices=1 page_size=65536\n"
    "metax unavailable devices=0 page_size=65536 reason: the MetaX driver is not loaded "
    "(metax_p2p_acquire_mem not found) (-2)\n"
    "nvidia unavailable devices=0 page_size=65536 reason: the NVIDIA driver is not loaded (...) (-2)\n"
)
HOST0 = {
    "vendor": "host",
    "ordinal": "0",
    "page_size": "65536",
    "map_mode": "full",
    "pci_bdf": "0000:00:01.0",
    "bar": "2",
    "bar_size": "134217728",
    "max_map": "134217728",
    "mappings": "0",
    "pinned_bytes": "0",
    "reclaims": "0",
    "abi": "1",
}


def fake_tree(tmp_path, files: dict[str, str], dev_nodes=("phx_host0",), mode=0o600):
    """A sysfs tree (and /dev) made of the given files: {"/sys/...": text}."""
    for path, text in files.items():
        dest = tmp_path / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    (tmp_path / "dev").mkdir(exist_ok=True)
    for name in dev_nodes:
        node = tmp_path / "dev" / name
        node.write_text("")
        node.chmod(mode)
    return str(tmp_path / "sys"), str(tmp_path / "dev")


def loaded_tree(tmp_path, **kw):
    files = {
        "/sys/module/phx_core/initstate": "live\n",
        "/sys/class/phx/backends": BACKENDS,
        "/sys/class/phx/abi": "ioctl=1 p2p=1\n",
    }
    files.update({f"/sys/class/phx/phx_host0/{k}": v + "\n" for k, v in HOST0.items()})
    return fake_tree(tmp_path, files, **kw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_without_the_module_every_answer_says_why(tmp_path):
    sysfs, dev = fake_tree(tmp_path, {}, dev_nodes=())
    st = kmod.status(sysfs, dev)
    assert st["core_loaded"] is False and st["backends"] == [] and st["devices"] == []
    assert "not loaded" in st["why"] and "insmod" in st["why"]
    ok, why = kmod.direct_status("nvidia", 0, sysfs=sysfs, dev=dev)
    assert not ok and "phx_core" in why and "phx_nvidia.ko" in why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_backends_devices_and_reasons(tmp_path):
    sysfs, dev = loaded_tree(tmp_path)
    bes = {b.name: b for b in kmod.backends(sysfs)}
    assert set(bes) == {"amd", "host", "metax", "nvidia"}
    assert bes["host"].available and bes["host"].devices == 1 and bes["host"].page_size == 65536
    assert not bes["nvidia"].available and bes["nvidia"].reason.startswith("the NVIDIA driver is not loaded")
    assert not bes["amd"].available and bes["amd"].reason.startswith("the AMD driver is not loaded")
    (d,) = kmod.devices("host", sysfs, dev)
    assert (d.name, d.path, d.ordinal, d.bar, d.bar_size, d.map_mode) == (
        "phx_host0",
        os.path.join(dev, "phx_host0"),
        0,
        2,
        128 << 20,
        "full",
    )
    ok, why = kmod.direct_status("host", 0, page_size=65536, sysfs=sysfs, dev=dev)
    if os.geteuid() == 0 or os.access(d.path, os.R_OK | os.W_OK):
        assert ok, why
        assert "phx_host0" in why and "ZONE_DEVICE" in why
    ok, why = kmod.direct_status("nvidia", 0, sysfs=sysfs, dev=dev)
    assert not ok and "cannot serve: the NVIDIA driver is not loaded" in why
    ok, why = kmod.direct_status("host", 1, sysfs=sysfs, dev=dev)
    assert not ok and "no host device 1" in why
    ok, why = kmod.direct_status("host", 0, page_size=4096, sysfs=sysfs, dev=dev)
    assert not ok and "disagree" in why
    ok, why = kmod.direct_status("mychip", 0, sysfs=sysfs, dev=dev)
    assert not ok and "phx_mychip.ko" in why
    st = kmod.status(sysfs, dev)
    assert st["core_loaded"] and st["why"] == "" and st["devices"][0]["name"] == "phx_host0"
    assert st["abi"] == "ioctl=1 p2p=1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_missing_node_and_permission_reasons(tmp_path):
    sysfs, dev = loaded_tree(tmp_path, dev_nodes=())
    ok, why = kmod.direct_status("host", 0, sysfs=sysfs, dev=dev)
    assert not ok and "does not exist" in why
    if os.geteuid() != 0:
        sysfs, dev = loaded_tree(tmp_path / "b", mode=0o000)
        ok, why = kmod.direct_status("host", 0, sysfs=sysfs, dev=dev)
        assert not ok and "no permission" in why and "udev" in why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_open_without_the_module_says_why(tmp_path):
    with pytest.raises(OSError) as exc:
        kmod.Device("host", 0, dev=str(tmp_path))
    assert "phx_host0" in str(exc.value)


def _open_files(target: str) -> list[str]:
    """This process's descriptors open on ``target`` (resolved)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                out.append(fd)
        except OSError:  # the listing's own descriptor, gone by now
            pass
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_open_refuses_what_is_not_the_cores_node_and_leaks_no_file(tmp_path):
    """A regular file at /dev/phx_<vendor><N> is refused as not a character device, before any
    ioctl; a character device that is not phoenix's fails INFO; neither leaves its file open."""
    import errno

    node = tmp_path / "phx_host0"
    node.write_bytes(os.urandom(4096))
    with pytest.raises(OSError) as exc:
        kmod.Device("host", 0, dev=str(tmp_path))
    assert exc.value.errno == errno.ENODEV and "not a character device" in str(exc.value), exc.value
    assert str(node) in str(exc.value)
    assert _open_files(str(node)) == [], "the refused node's file was left open"
    if not os.path.exists("/dev/full"):
        return
    os.symlink("/dev/full", tmp_path / "phx_host1")  # a character device, not phoenix's: INFO fails
    before = _open_files("/dev/full")
    with pytest.raises(OSError) as exc:
        kmod.Device("host", 1, dev=str(tmp_path))
    assert "INFO failed" in str(exc.value), exc.value
    assert _open_files("/dev/full") == before, "the device's file was left open after INFO failed"


def test_window_rounds_to_pages():
    d = kmod.Device.__new__(kmod.Device)
    d.page_size = 65536
    assert d.window(0x10000, 0x10000) == (0x10000, 0x10000, 0)
    assert d.window(0x10100, 0x100) == (0x10000, 0x10000, 0x100)
    assert d.window(0x1FF00, 0x200) == (0x10000, 0x20000, 0xFF00)


@pytest.mark.skipif(not shutil.which("gcc"), reason="gcc is not installed")
def test_ioctl_numbers_match_the_header(tmp_path):
    src = tmp_path / "ioc.c"
    src.write_text(
        '#include <stdio.h>\n#include "phx_ioctl.h"\nint main(void) {\n'
        '  printf("%lu %lu %lu %d\\n", (unsigned long)PHX_IOC_INFO, (unsigned long)PHX_IOC_MAP,\n'
        "         (unsigned long)PHX_IOC_UNMAP, PHX_IOCTL_ABI);\n  return 0;\n}\n"
    )
    exe = tmp_path / "ioc"
    r = subprocess.run(["gcc", "-I", KERNEL, "-o", str(exe), str(src)], capture_output=True, text=True)
    if r.returncode and "linux/types.h" in r.stderr:
        pytest.skip("linux-libc-dev (linux/types.h) is not installed")
    assert r.returncode == 0, r.stderr
    info, map_, unmap, abi = map(
        int, subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    )
    assert (info, map_, unmap, abi) == (kmod.PHX_IOC_INFO, kmod.PHX_IOC_MAP, kmod.PHX_IOC_UNMAP, kmod.IOCTL_ABI)


# ---- the modules --------------------------------------------------------------------------------


def headers_dir() -> str | None:
    found = sorted(
        glob.glob("/usr/src/linux-headers-*-amd64"),
        key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)],
    )
    return found[-1] if found and os.path.exists(os.path.join(found[-1], "Makefile")) else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every module built with -Werror (and sparse when installed) into a fresh directory."""
    if os.environ.get("PHX_KERNEL_TEST") == "0":
        pytest.skip("PHX_KERNEL_TEST=0")
    hdr = headers_dir()
    if not hdr:
        pytest.skip(
            "Debian's kernel headers are not installed (apt-get install linux-headers-amd64; "
            "kernel/ci.sh installs everything)"
        )
    if not shutil.which("make") or not shutil.which("gcc"):
        pytest.skip("make and gcc are needed to build the modules")
    build = str(tmp_path_factory.mktemp("kbuild"))
    target = "check" if shutil.which("sparse") else "modules"
    r = subprocess.run(
        ["make", "-C", KERNEL, f"KDIR={hdr}", f"BUILD={build}", target, "ktest"], capture_output=True, text=True
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    findings = [line for line in out.splitlines() if re.search(r"(warning|error):", line)]
    assert not findings, "\n".join(findings)
    return {
        "dir": build,
        "headers": hdr,
        "krel": os.path.basename(hdr).removeprefix("linux-headers-"),
        "sparse": target == "check",
    }


@skip_heavy
def test_modules_build_with_werror(built):
    kos = sorted(f for f in os.listdir(built["dir"]) if f.endswith(".ko"))
    assert kos == sorted(["phx_core.ko"] + [f"phx_{v}.ko" for v in VENDORS])
    for ko in kos:
        data = open(os.path.join(built["dir"], ko), "rb").read()
        assert b"license=GPL" in data, f"{ko} must be GPL (memremap_pages is EXPORT_SYMBOL_GPL)"
        assert f"vermagic={built['krel']} ".encode() in data
    # the vendors' P2P interfaces are resolved with symbol_get at load time, never linked
    for ko, sym, prefix in (
        ("phx_nvidia.ko", b"nvidia_p2p_get_pages", b"nvidia"),
        ("phx_amd.ko", b"amdkfd_query_rdma_interface", b"amdkfd"),
    ):
        data = open(os.path.join(built["dir"], ko), "rb").read()
        assert sym in data, ko
        assert not re.search(rb"__ksymtab_" + prefix + rb"|__crc_" + prefix, data), ko


# ---- the emulated machine -----------------------------------------------------------------------


def image_root(krel: str) -> str | None:
    for root in (os.environ.get("PHX_KIMAGE_DIR", "/var/cache/phx-kimage") + f"/{krel}", "/"):
        if os.path.exists(os.path.join(root, "boot", f"vmlinuz-{krel}")) and os.path.isdir(
            os.path.join(root, "lib", "modules", krel, "kernel")
        ):
            return root
    return None


@skip_heavy
@pytest.mark.slow
def test_direct_path_in_qemu(built, tmp_path):
    """O_DIRECT into and out of ZONE_DEVICE pages over a fake accelerator's BAR, in a VM."""
    root = image_root(built["krel"])
    missing = [
        what
        for what, ok in (
            (f"the kernel image {built['krel']} (linux-image-{built['krel']}, or kernel/ci.sh)", root),
            ("qemu-system-x86_64 (qemu-system-x86)", shutil.which("qemu-system-x86_64")),
            ("busybox (busybox-static)", shutil.which("busybox") or os.path.exists("/bin/busybox")),
            ("mkfs.ext4 and debugfs (e2fsprogs)", shutil.which("mkfs.ext4") and shutil.which("debugfs")),
        )
        if not ok
    ]
    if missing:
        pytest.skip("not installed: " + ", ".join(missing))
    dump = tmp_path / "sysfs.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(KERNEL, "qemu", "run.py"),
            "--build",
            built["dir"],
            "--root",
            root,
            "--krel",
            built["krel"],
            "--sysfs-dump",
            str(dump),
            "--timeout",
            os.environ.get("PHX_KTEST_TIMEOUT", "300"),
        ],
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("PHX_KTEST_TIMEOUT", "300")) + 120,
    )
    out = r.stdout + r.stderr
    summary = [line for line in out.splitlines() if line.startswith("PHX-KERNEL-TEST")]
    print("\n" + "\n".join(summary))
    assert r.returncode == 0 and summary and "PASS" in summary[0], out[-12000:]
    m = re.search(r"PASS: (\d+) bytes verified in the guest, (\d+) bytes verified from the host", summary[0])
    assert m and int(m.group(1)) >= 128 << 20 and int(m.group(2)) >= 80 << 20
    for needle in (
        "kill -9 during O_DIRECT I/O: mappings released",
        "unloaded cleanly",
        "touching a revoked mapping -> SIGBUS",
        "MAP overflowing range (end past 2^64)",
        "child: UNMAP the parent's mapping (inherited fd)",
    ):
        assert needle in out, f"the guest did not report: {needle}"

    # what the real kernel published, read through kmod
    files = json.loads(dump.read_text())
    sysfs, dev = fake_tree(tmp_path / "guest", files)
    st = kmod.status(sysfs, dev)
    assert st["core_loaded"] and st["why"] == "", st
    names = {b["name"]: b for b in st["backends"]}
    assert names["host"]["available"] and names["host"]["devices"] == 1
    assert names["amd"]["reason"].startswith("the AMD driver is not loaded (amdkfd_query_rdma_interface not found")
    for vendor in VENDORS:
        if vendor != "host":
            assert not names[vendor]["available"] and "driver is not loaded" in names[vendor]["reason"]
            ok, why = kmod.direct_status(vendor, sysfs=sysfs, dev=dev)
            assert not ok and "cannot serve" in why
    (d,) = [kmod.DeviceInfo(**x) for x in st["devices"]]
    assert (d.vendor, d.page_size, d.map_mode, d.bar) == ("host", 65536, "full", 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_unreadable_sysfs_numbers_are_reasons_not_exceptions(tmp_path):
    """What another core version (or a damaged tree) might write: nothing raises (``phx info``
    prints kmod.status), the backend says why it cannot serve, a device's number falls back."""
    sysfs, dev = loaded_tree(tmp_path)
    with open(os.path.join(sysfs, "class", "phx", "backends"), "a") as f:
        f.write("weird available devices=two page_size=64K\n")
    with open(os.path.join(sysfs, "class", "phx", "phx_host0", "mappings"), "w") as f:
        f.write("lots\n")
    bes = {b.name: b for b in kmod.backends(sysfs)}
    assert bes["host"].available and bes["host"].devices == 1  # the good lines as before
    w = bes["weird"]
    assert not w.available and (w.devices, w.page_size) == (0, 0)
    assert "unreadable line" in w.reason and "devices=two" in w.reason
    (d,) = kmod.devices("host", sysfs, dev)
    assert d.mappings == 0 and d.ordinal == 0 and d.bar_size == 128 << 20
    st = kmod.status(sysfs, dev)  # what `phx info` shows
    assert any(b["name"] == "weird" and "unreadable" in b["reason"] for b in st["backends"])
    ok, why = kmod.direct_status("weird", 0, sysfs=sysfs, dev=dev)
    assert not ok and "unreadable line" in why
