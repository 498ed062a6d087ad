#!/usr/bin/env python3
"""Boot Debian's kernel in QEMU with the phoenix modules and run the direct-path test.

Test harness, host side (stdlib only). What it does:

1. builds a busybox initramfs holding the guest's disk and file-system modules (from the
   kernel image's module tree, dependencies resolved from modules.dep), the phoenix
   modules from kernel/build/, the static test program phx_ktest and an /init script;
2. makes an ext4 image (on an emulated NVMe disk), a raw disk (virtio-blk) and the fake
   accelerator's memory: a 128 MiB file in /dev/shm behind QEMU's ivshmem-plain BAR;
3. boots (KVM when /dev/kvm works, else software emulation), bounded by --timeout;
4. checks the guest's verdicts, scans the guest log (dmesg) for warnings and oopses, and
   verifies from the host: the BAR's backing file and the file as debugfs reads it from
   the ext4 image, and the raw image, against the same pattern (phx_ktest hostverify).

Prints "PHX-KERNEL-TEST: PASS ... bytes verified" and exits 0, or says what failed.

    python3 kernel/qemu/run.py [--build kernel/build] [--root /] [--krel 6.1.0-57-amd64]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_DIR = os.path.dirname(HERE)

#: guest modules the test needs beyond the kernel image (dependencies added from modules.dep)
GUEST_MODULES = ["virtio_pci", "virtio_blk", "nvme", "crc32c_generic", "crc64_rocksoft_generic", "ext4"]
BAR_BYTES = 128 << 20
#: what must never appear in the guest log
BAD_LOG = re.compile(
    r"WARNING:|BUG:|Oops|general protection|kernel BUG|Call Trace|UBSAN|KASAN|list_(add|del) corruption|"
    r"Bad page|bad pte|refcount_t:|blocked for more than|soft lockup|hard LOCKUP|RIP: |"
    r"x86/PAT: .*(conflicting|expected)|page dumped because|Misaligned __add_pages|Conflicting mapping"
)

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /mnt /tmp /bin
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say() { echo "PHX-GUEST: $*"; }
say "booted $(uname -r), $(nproc) cpus, $(awk '/MemTotal/ {print $2 / 1024}' /proc/meminfo) MiB"
for m in $(cat /lib/modules/load-order); do
    insmod /lib/modules/$m || say "insmod $m failed"
done
rc=0
for i in $(seq 1 200); do [ -b /dev/nvme0n1 ] && [ -b /dev/vda ] && break; sleep 0.05; done
mount -t ext4 /dev/nvme0n1 /mnt || { say "mount of the ext4 disk failed"; rc=1; }
t0=$(date +%s)
phx_ktest prepare || rc=1
insmod /phx/phx_core.ko || { say "insmod phx_core failed"; rc=1; }
for v in /phx/phx_*.ko; do
    case $v in */phx_core.ko) ;; *) insmod $v || { say "insmod $v failed"; rc=1; } ;; esac
done
say "backends:"; cat /sys/class/phx/backends
for d in /sys/class/phx/phx_*; do
    [ -e "$d" ] || continue
    line="device $(basename $d):"
    for a in vendor ordinal page_size map_mode pci_bdf bar bar_size mappings; do line="$line $a=$(cat $d/$a)"; done
    say "$line"
done
# what userspace (phoenix/kmod.py) reads, for the host to check kmod against
for f in /sys/module/phx_core/initstate /sys/class/phx/backends /sys/class/phx/abi /sys/class/phx/phx_*/*; do
    [ -f "$f" ] && [ -r "$f" ] && echo "PHX-SYSFS: $f $(tr '\n' '|' < $f)"
done
if mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null; then
    grep -i "write-combining" /sys/kernel/debug/x86/pat_memtype_list | while read l; do say "PAT: $l"; done
fi
phx_ktest direct /dev/phx_host0 /mnt/phx.bin /dev/vda || rc=1
for v in /phx/phx_*.ko; do
    n=$(basename $v .ko)
    [ $n = phx_core ] || rmmod $n || { say "rmmod $n failed"; rc=1; }
done
rmmod phx_core || { say "rmmod phx_core failed"; rc=1; }
if grep -q '^phx_' /proc/modules; then say "modules still loaded: $(grep '^phx_' /proc/modules)"; rc=1; else say "unloaded cleanly"; fi
phx_ktest verify || rc=1
umount /mnt || rc=1
sync
say "guest test took $(( $(date +%s) - t0 )) s"
echo PHX-DMESG-BEGIN
dmesg
echo PHX-DMESG-END
say "done rc=$rc"
poweroff -f
"""


def log(msg: str) -> None:
    print(f"[kernel-test] {msg}", flush=True)


class Cpio:
    """A newc cpio archive written in memory (what the kernel unpacks as initramfs)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _add(self, name: str, mode: int, data: bytes = b"", target: str | None = None) -> None:
        if target is not None:
            data = target.encode()
        nameb = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nameb), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08x" % f for f in fields) + nameb)
        self.buf.write(b"\0" * (-self.buf.tell() % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-self.buf.tell() % 4))

    def dir(self, name: str) -> None:
        self._add(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._add(name, stat.S_IFREG | mode, data)

    def finish(self) -> bytes:
        self._add("TRAILER!!!", 0)
        return self.buf.getvalue()


def module_bytes(path: str) -> bytes:
    data = open(path, "rb").read()
    if path.endswith(".xz"):
        return lzma.decompress(data)
    if path.endswith(".zst"):
        return subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout
    return data


def guest_modules(moddir: str, wanted: list[str]) -> list[tuple[str, bytes]]:
    """(file name, contents) of the wanted modules and their dependencies, in load order.

    Dependencies come from each module's own .modinfo (depends=), so an image package
    unpacked without running depmod (no modules.dep) works too.
    """
    paths: dict[str, str] = {}
    for dirpath, _, files in os.walk(os.path.join(moddir, "kernel")):
        for f in files:
            if ".ko" in f:
                paths[f.split(".ko")[0].replace("-", "_")] = os.path.join(dirpath, f)
    ordered: list[tuple[str, bytes]] = []  # dependencies before their users
    seen: set[str] = set()

    def visit(name: str) -> None:
        key = name.replace("-", "_")
        if key in seen:
            return
        seen.add(key)
        path = paths.get(key)
        if path is None:
            raise SystemExit(f"module {name} not found under {moddir}/kernel (another kernel, or built in?)")
        data = module_bytes(path)
        m = re.search(rb"depends=([^\0]*)\0", data)
        for dep in m.group(1).decode().split(",") if m else []:
            if dep:
                visit(dep)
        ordered.append((os.path.basename(path).split(".ko")[0] + ".ko", data))

    for name in wanted:
        visit(name)
    return ordered


def build_initramfs(path: str, root: str, krel: str, build: str) -> None:
    moddir = os.path.join(root, "lib/modules", krel)
    busybox = shutil.which("busybox") or "/bin/busybox"
    bb = open(busybox, "rb").read()
    if b"/lib64/ld-linux" in bb[:4096]:
        raise SystemExit(f"{busybox} is dynamically linked: install busybox-static")
    cp = Cpio()
    for d in ("bin", "dev", "proc", "sys", "mnt", "tmp", "lib", "lib/modules", "phx"):
        cp.dir(d)
    cp.file("init", INIT.encode(), 0o755)
    cp.file("bin/busybox", bb, 0o755)
    cp.file("bin/sh", bb, 0o755)
    cp.file("bin/phx_ktest", open(os.path.join(build, "phx_ktest"), "rb").read(), 0o755)
    order = []
    for name, data in guest_modules(moddir, GUEST_MODULES):
        cp.file(f"lib/modules/{name}", data)
        order.append(name)
    cp.file("lib/modules/load-order", ("\n".join(order) + "\n").encode())
    kos = sorted(f for f in os.listdir(build) if f.startswith("phx_") and f.endswith(".ko"))
    if "phx_core.ko" not in kos or "phx_host.ko" not in kos:
        raise SystemExit(f"{build} lacks phx_core.ko / phx_host.ko: run make -C kernel first")
    for ko in kos:
        cp.file(f"phx/{ko}", open(os.path.join(build, ko), "rb").read())
    with open(path, "wb") as f:
        f.write(gzip.compress(cp.finish(), compresslevel=1))
    log(f"initramfs: busybox, {len(order)} guest modules ({' '.join(m[:-3] for m in order)}), {' '.join(kos)}")


def vermagic(ko: str) -> str:
    data = open(ko, "rb").read()
    m = re.search(rb"vermagic=(\S+)", data)
    if not m:
        raise SystemExit(f"no vermagic in {ko}")
    return m.group(1).decode()


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(KERNEL_DIR, "build"), help="where make -C kernel put the modules")
    ap.add_argument("--root", default="/", help="root of the kernel image package (boot/vmlinuz-*, lib/modules/*)")
    ap.add_argument("--krel", help="kernel release to boot (default: the modules' vermagic)")
    ap.add_argument(
        "--accel",
        choices=["auto", "kvm", "tcg"],
        default=os.environ.get("PHX_KTEST_ACCEL", "tcg"),
        help="tcg (default: software emulation, works everywhere, also nested), kvm, or auto "
        "(kvm when /dev/kvm opens; nested KVM in some VMs hangs at boot)",
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds for boot and test together")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--smp", type=int, default=2)
    ap.add_argument("--sysfs-dump", help="write the guest's phoenix sysfs files (path -> text) to this JSON file")
    args = ap.parse_args()

    t0 = time.monotonic()
    build = os.path.abspath(args.build)
    krel = args.krel or vermagic(os.path.join(build, "phx_core.ko"))
    vmlinuz = os.path.join(args.root, "boot", f"vmlinuz-{krel}")
    if not os.path.exists(vmlinuz):
        raise SystemExit(f"{vmlinuz} not found: install linux-image-{krel} (or pass --root/--krel)")
    qemu = shutil.which("qemu-system-x86_64")
    if not qemu:
        raise SystemExit("qemu-system-x86_64 not found: install qemu-system-x86")
    accel = args.accel
    if accel == "auto":
        accel = "kvm" if kvm_usable() else "tcg"

    work = tempfile.mkdtemp(prefix="phx-ktest-")
    shm_dir = "/dev/shm" if os.access("/dev/shm", os.W_OK) else work
    bar = os.path.join(shm_dir, f"phx-bar-{os.getpid()}")
    try:
        initrd = os.path.join(work, "initrd.gz")
        build_initramfs(initrd, args.root, krel, build)
        ext4 = os.path.join(work, "nvme.img")
        raw = os.path.join(work, "raw.img")
        with open(ext4, "wb") as f:
            f.truncate(256 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "phx", ext4], check=True)
        with open(raw, "wb") as f:
            f.truncate(32 << 20)
        with open(bar, "wb") as f:
            f.truncate(BAR_BYTES)

        cmd = [
            qemu,
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
            "-monitor",
            "none",
            "-serial",
            "stdio",
            "-machine",
            f"q35,accel={accel}",
            "-cpu",
            "host" if accel == "kvm" else "max",
            "-smp",
            str(args.smp),
            "-m",
            "1024",
            "-kernel",
            vmlinuz,
            "-initrd",
            initrd,
            "-append",
            "console=ttyS0 loglevel=4 panic=-1 oops=panic rdinit=/init",
            "-object",
            f"memory-backend-file,id=phxbar,size={BAR_BYTES},mem-path={bar},share=on",
            "-device",
            "ivshmem-plain,memdev=phxbar",
            "-drive",
            f"file={ext4},if=none,id=nvm,format=raw",
            "-device",
            "nvme,serial=phx0,drive=nvm",
            "-drive",
            f"file={raw},if=virtio,format=raw",
        ]
        log(f"booting {krel} under {accel.upper()} (timeout {args.timeout} s)")
        console = os.path.join(work, "console.log")
        tboot = time.monotonic()
        lines: list[str] = []
        with open(console, "w") as clog:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            in_dmesg = False
            timed_out = False
            deadline = tboot + args.timeout
            assert proc.stdout
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            pending = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    proc.kill()
                    break
                if not sel.select(timeout=min(left, 1.0)):
                    if proc.poll() is not None:
                        break
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                pending += chunk
                *done, pending = pending.split(b"\n")
                for raw_line in done:
                    line = raw_line.decode(errors="replace").rstrip("\r")
                    lines.append(line)
                    clog.write(line + "\n")
                    if line.startswith("PHX-DMESG-BEGIN"):
                        in_dmesg = True
                    elif line.startswith("PHX-DMESG-END"):
                        in_dmesg = False
                    elif not in_dmesg and not line.startswith("PHX-SYSFS: "):
                        print("  | " + line, flush=True)
            proc.wait()
        tguest = time.monotonic() - tboot

        problems: list[str] = []
        if timed_out:
            problems.append(f"the guest did not finish within {args.timeout} s")
        dmesg: list[str] = []
        inside = False
        for line in lines:
            if line.startswith("PHX-DMESG-BEGIN"):
                inside = True
            elif line.startswith("PHX-DMESG-END"):
                inside = False
            elif inside:
                dmesg.append(line)
        if not dmesg:
            problems.append("no guest log (dmesg) came back")
        bad = [line for line in lines if BAD_LOG.search(line)]
        if bad:
            problems.append("the guest log shows warnings or oopses:\n    " + "\n    ".join(bad[:40]))
        phx_log = [line for line in dmesg if re.search(r"phx_|phx:", line)]
        if phx_log:
            print("  guest log, phoenix lines:")
            for line in phx_log:
                print("    " + line)
        if not any(line.startswith("PHX-GUEST: done rc=0") for line in lines):
            problems.append("the guest test did not pass (PHX-GUEST: done rc=0 missing)")
        guest_bytes = 0
        for line in lines:
            m = re.match(r"PHX-KTEST: (\w+): (\d+) bytes verified, (\d+) failures", line)
            if m:
                guest_bytes += int(m.group(2))
                if m.group(3) != "0":
                    problems.append(f"phx_ktest {m.group(1)}: {m.group(3)} failures")
        for step in ("direct", "verify"):
            if not any(re.match(rf"PHX-KTEST: {step}: ", line) for line in lines):
                problems.append(f"phx_ktest {step} did not report")

        # the other side, outside the guest: the BAR's backing file, the ext4 image, the raw disk
        host_bytes = 0
        dump = os.path.join(work, "phx.bin")
        r = subprocess.run(["debugfs", "-R", f"dump -p /phx.bin {dump}", ext4], capture_output=True, text=True)
        if not os.path.exists(dump):
            problems.append(f"debugfs could not read /phx.bin from the ext4 image: {r.stderr.strip()}")
        else:
            r = subprocess.run(
                [os.path.join(build, "phx_ktest"), "hostverify", bar, dump, raw], capture_output=True, text=True
            )
            for line in r.stdout.splitlines():
                print("  host| " + line)
                m = re.match(r"PHX-KTEST: hostverify: (\d+) bytes verified, (\d+) failures", line)
                if m:
                    host_bytes = int(m.group(1))
            if r.returncode:
                problems.append("host-side verification failed")

        if args.sysfs_dump:
            dump_sysfs = {}
            for line in lines:
                if line.startswith("PHX-SYSFS: "):
                    path, _, value = line[len("PHX-SYSFS: ") :].partition(" ")
                    dump_sysfs[path] = value.replace("|", "\n")
            with open(args.sysfs_dump, "w") as f:
                json.dump(dump_sysfs, f, indent=1, sort_keys=True)

        total = time.monotonic() - t0
        if problems:
            print("PHX-KERNEL-TEST: FAIL")
            for p in problems:
                print("  - " + p)
            print(f"  console log: {console} (kept)")
            args.keep = True
            return 1
        print(
            f"PHX-KERNEL-TEST: PASS: {guest_bytes} bytes verified in the guest, {host_bytes} bytes verified "
            f"from the host; guest {tguest:.0f} s under {accel.upper()}, {total:.0f} s in all"
        )
        return 0
    finally:
        if os.path.exists(bar):
            os.unlink(bar)
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
