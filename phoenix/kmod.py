"""The kernel side, seen from userspace: is the direct path possible here, and mapping through it.

Control plane. The core module (``kernel/phx_core.c``) and one backend module per vendor
(``vendors/<name>/p2p.c`` -> ``phx_<name>.ko``) turn device memory into ZONE_DEVICE pages:
``Device.map(dev_va, length)`` returns a plain user address that maps the device memory,
and O_DIRECT ``pread``/``pwrite`` on that address make the disk DMA straight into (or out
of) the device. This module reads what the kernel publishes and speaks its ioctls:

* ``/sys/module/phx_core``: the core is loaded;
* ``/sys/class/phx/backends``: one line per backend module, ``<name> available|unavailable
  devices=<n> page_size=<bytes>[ reason: <why>]``;
* ``/sys/class/phx/phx_<vendor><N>/``: one directory per accelerator (``vendor``,
  ``ordinal``, ``page_size``, ``map_mode``, ``pci_bdf``, ``bar``, ``bar_size``, ``max_map``,
  ``mappings``, ``pinned_bytes``, ``reclaims``, ``abi``), and ``/dev/phx_<vendor><N>``;
* the ioctls of ``kernel/phx_ioctl.h`` (INFO, MAP, UNMAP), mirrored below.

Nothing here raises on a machine without the module: :func:`status` and
:func:`direct_status` say why the direct path is not possible, in words an operator can
act on (``phx info`` prints them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import sys
import threading
from dataclasses import asdict, dataclass

#: must equal PHX_IOCTL_ABI in kernel/phx_ioctl.h
IOCTL_ABI = 1
_MAGIC = 0xB7
_INFO = struct.Struct("<IIQQQ16s")  # struct phx_info_args
_MAP = struct.Struct("<QQIIQQ")  # struct phx_map_args
_UNMAP = struct.Struct("<QII")  # struct phx_unmap_args


def _ioc(direction: int, nr: int, size: int) -> int:
    """Linux's _IOC() for x86, arm64, riscv (asm-generic ioctl.h layout)."""
    return (direction << 30) | (size << 16) | (_MAGIC << 8) | nr


_IOC_WRITE, _IOC_READ = 1, 2
PHX_IOC_INFO = _ioc(_IOC_READ, 0, _INFO.size)
PHX_IOC_MAP = _ioc(_IOC_READ | _IOC_WRITE, 1, _MAP.size)
PHX_IOC_UNMAP = _ioc(_IOC_WRITE, 2, _UNMAP.size)

SYSFS = "/sys"
DEV = "/dev"
BUILD_HINT = "make -C kernel && insmod kernel/build/phx_core.ko && insmod kernel/build/phx_{vendor}.ko"


@dataclass(frozen=True)
class Backend:
    """One backend module as the core lists it."""

    name: str
    available: bool
    devices: int
    page_size: int
    reason: str  #: why it cannot serve (empty when available and every device attached)


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator the core serves: its sysfs attributes and device node."""

    name: str  #: phx_<vendor><ordinal>
    path: str  #: /dev/phx_<vendor><ordinal>
    vendor: str
    ordinal: int
    page_size: int
    map_mode: str
    pci_bdf: str
    bar: int
    bar_size: int
    max_map: int
    mappings: int
    pinned_bytes: int
    reclaims: int


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def core_loaded(sysfs: str = SYSFS) -> bool:
    """Is the core module (phx_core) loaded?"""
    return os.path.isdir(os.path.join(sysfs, "module", "phx_core")) and os.path.isdir(
        os.path.join(sysfs, "class", "phx")
    )


def backends(sysfs: str = SYSFS) -> list[Backend]:
    """The backend modules registered with the core (empty when the core is not loaded)."""
    text = _read(os.path.join(sysfs, "class", "phx", "backends")) or ""
    out = []
    for line in text.splitlines():
        head, _, reason = line.partition(" reason: ")
        words = head.split()
        if len(words) < 2:
            continue
        fields = dict(w.split("=", 1) for w in words[2:] if "=" in w)
        devs, page = _number(fields.get("devices", "0")), _number(fields.get("page_size", "0"))
        readable = devs is not None and page is not None
        reason = reason.strip()
        if not readable:  # not what this phoenix's core writes: say so, raise nothing
            where = os.path.join(sysfs, "class", "phx", "backends")
            reason = f"unreadable line in {where}: {line.strip()!r} (a core module of another phoenix version?)"
        out.append(
            Backend(
                name=words[0],
                available=words[1] == "available" and readable,
                devices=devs or 0,
                page_size=page or 0,
                reason=reason,
            )
        )
    return out


def _number(text: str) -> int | None:
    """A sysfs number (decimal, or 0x... hexadecimal), or None where it is not one."""
    for base in (10, 0):
        try:
            return int(text.strip(), base)
        except ValueError:
            pass
    return None


def devices(vendor: str | None = None, sysfs: str = SYSFS, dev: str = DEV) -> list[DeviceInfo]:
    """The accelerators the core serves (of one vendor), by vendor and ordinal."""
    root = os.path.join(sysfs, "class", "phx")
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("phx_"))
    except OSError:
        return []
    out = []
    for name in names:
        d = os.path.join(root, name)

        def attr(a: str, default: str = "0", d: str = d) -> str:
            v = _read(os.path.join(d, a))
            return default if v is None else v

        def num(a: str, default: int = 0) -> int:  # unreadable: the default (-1 for an ordinal: no device)
            v = _number(attr(a, str(default)))
            return default if v is None else v

        info = DeviceInfo(
            name=name,
            path=os.path.join(dev, name),
            vendor=attr("vendor", ""),
            ordinal=num("ordinal", -1),
            page_size=num("page_size"),
            map_mode=attr("map_mode", ""),
            pci_bdf=attr("pci_bdf", ""),
            bar=num("bar", -1),
            bar_size=num("bar_size"),
            max_map=num("max_map"),
            mappings=num("mappings"),
            pinned_bytes=num("pinned_bytes"),
            reclaims=num("reclaims"),
        )
        if vendor is None or info.vendor == vendor:
            out.append(info)
    return sorted(out, key=lambda i: (i.vendor, i.ordinal))


def direct_status(
    vendor: str, ordinal: int = 0, page_size: int | None = None, sysfs: str = SYSFS, dev: str = DEV
) -> tuple[bool, str]:
    """Can this process map ``vendor``'s device ``ordinal`` through the kernel? (answer, reason)

    ``page_size``: the userspace vendor's ``p2p_page_size``, checked against the kernel's.
    The reason says what to do when the answer is no.
    """
    if not sys.platform.startswith("linux"):
        return False, f"the direct path needs Linux's kernel module (this is {sys.platform})"
    if not core_loaded(sysfs):
        return False, (
            "the phoenix kernel module is not loaded (phx_core; build and load it with: "
            + BUILD_HINT.format(vendor=vendor)
            + ")"
        )
    be = {b.name: b for b in backends(sysfs)}.get(vendor)
    if be is None:
        return False, f"the {vendor} backend module is not loaded (insmod phx_{vendor}.ko)"
    if not be.available:
        return False, f"the {vendor} backend cannot serve: {be.reason or 'its init failed'}"
    devs = {d.ordinal: d for d in devices(vendor, sysfs, dev)}
    d = devs.get(ordinal)
    if d is None:
        extra = f" ({be.reason})" if be.reason else ""
        return False, f"no {vendor} device {ordinal} in the kernel: its backend serves {len(devs)} device(s){extra}"
    if page_size is not None and page_size != d.page_size:
        return False, (
            f"{d.name}: kernel page size {d.page_size} differs from the vendor runtime's "
            f"p2p_page_size {page_size} (the two halves of the {vendor} port disagree)"
        )
    if not os.path.exists(d.path):
        return False, f"{d.path} does not exist (no devtmpfs or udev on this system?)"
    if not os.access(d.path, os.R_OK | os.W_OK):
        return False, (
            f"no permission to open {d.path} (root only by default; a udev rule can give a group "
            'access: SUBSYSTEM=="phx", GROUP="...", MODE="0660")'
        )
    return True, (
        f"{d.name}: {vendor} device {ordinal} at {d.pci_bdf}, BAR {d.bar} ({d.bar_size >> 20} MiB) is "
        f"ZONE_DEVICE memory (map_mode {d.map_mode}, page size {d.page_size})"
    )


def status(sysfs: str = SYSFS, dev: str = DEV) -> dict:
    """Everything ``phx info`` shows about the kernel side, as plain data."""
    loaded = core_loaded(sysfs)
    out: dict = {
        "core_loaded": loaded,
        "abi": _read(os.path.join(sysfs, "class", "phx", "abi")) if loaded else None,
        "backends": [asdict(b) for b in backends(sysfs)],
        "devices": [asdict(d) for d in devices(None, sysfs, dev)],
    }
    if not sys.platform.startswith("linux"):
        out["why"] = f"the direct path needs Linux's kernel module (this is {sys.platform})"
    elif not loaded:
        out["why"] = (
            "the phoenix kernel module is not loaded (phx_core): the direct path is off, "
            "every transfer is staged (build and load: " + BUILD_HINT.format(vendor="<vendor>") + ")"
        )
    elif not out["backends"]:
        out["why"] = "phx_core is loaded but no vendor backend module is (insmod phx_<vendor>.ko)"
    elif not out["devices"]:
        out["why"] = "; ".join(f"{b['name']}: {b['reason'] or 'no device'}" for b in out["backends"])
    else:
        out["why"] = ""
    return out


# ---- mapping ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    """One MAP: device memory [dev_va, dev_va + length) at user address ``addr``."""

    handle: int
    addr: int
    dev_va: int
    length: int


class Device:
    """An open ``/dev/phx_<vendor><N>``: map and unmap device memory of this process.

    The kernel ties the file to the process that opened it (a fork child gets EPERM), so
    :func:`device` keeps one per process. Mappings end at :meth:`unmap`, :meth:`close` or
    process exit; the vendor may revoke one earlier (the memory was freed): the address
    then faults and I/O into it fails with EFAULT.
    """

    def __init__(self, vendor: str, ordinal: int = 0, dev: str = DEV):
        self.vendor = vendor
        self.ordinal = ordinal
        self.path = os.path.join(dev, f"phx_{vendor}{ordinal}")
        self.pid = os.getpid()
        self.fd = -1
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            ok, why = direct_status(vendor, ordinal, dev=dev)
            raise OSError(exc.errno, f"open {self.path}: {exc.strerror}" + ("" if ok else f" ({why})")) from None
        self.fd = fd
        try:  # every way out but success closes the file
            if not stat.S_ISCHR(os.fstat(fd).st_mode):  # the core's node is a character device; an ioctl
                raise OSError(  # on a regular file or a FIFO left at its name would mean nothing
                    errno.ENODEV,
                    f"{self.path} is not a character device (the phoenix core module makes it): "
                    "remove what is there and load phx_core",
                )
            buf = bytearray(_INFO.size)
            self._ioctl(PHX_IOC_INFO, buf, "INFO")
            abi, ordinal_, self.page_size, self.bar_size, self.max_map, name = _INFO.unpack(buf)
            if abi != IOCTL_ABI:
                raise OSError(errno.EPROTO, f"{self.path}: kernel ioctl ABI {abi}, this phoenix speaks {IOCTL_ABI}")
        except BaseException:
            self.close()
            raise

    def _ioctl(self, request: int, buf: bytearray, what: str) -> None:
        try:
            fcntl.ioctl(self.fd, request, buf, True)
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: {what} failed: {os.strerror(exc.errno)}") from None

    def map(self, dev_va: int, length: int) -> Mapping:
        """Pin device memory [dev_va, dev_va + length) and map it; both page_size aligned.

        Errors (OSError): EINVAL (zero or unaligned, more than the device, not device
        memory of this process), EEXIST (overlaps a mapping of this file), EOVERFLOW,
        EPERM (another process's file), ENODEV (the backend went away).
        """
        buf = bytearray(_MAP.pack(dev_va, length, 0, 0, 0, 0))
        self._ioctl(PHX_IOC_MAP, buf, f"MAP [{dev_va:#x}, +{length})")
        _, _, _, _, handle, addr = _MAP.unpack(buf)
        return Mapping(handle=handle, addr=addr, dev_va=dev_va, length=length)

    def unmap(self, mapping: Mapping | int) -> None:
        """Unpin and unmap (the user address is gone afterwards)."""
        handle = mapping.handle if isinstance(mapping, Mapping) else int(mapping)
        self._ioctl(PHX_IOC_UNMAP, bytearray(_UNMAP.pack(handle, 0, 0)), f"UNMAP {handle:#x}")

    def window(self, ptr: int, size: int) -> tuple[int, int, int]:
        """The page-aligned device range covering [ptr, ptr + size): (dev_va, length, offset of ptr)."""
        ps = self.page_size
        start = ptr - ptr % ps
        end = -(-(ptr + size) // ps) * ps
        return start, end - start, ptr - start

    def close(self) -> None:
        """Close the file: every mapping made through it ends. Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_devices: dict[tuple[str, int], Device] = {}
_lock = threading.RLock()


def _after_fork_in_child() -> None:
    # The parent's files are useless here (EPERM) and would keep its mappings pinned
    # until this process exits: close our copies.
    global _lock
    _lock = threading.RLock()
    for d in _devices.values():
        d.close()
    _devices.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def device(vendor: str, ordinal: int = 0) -> Device:
    """This process's open :class:`Device` for (vendor, ordinal), opened on first use.

    After a fork the child opens its own (the parent's file is refused by the kernel).
    """
    with _lock:
        d = _devices.get((vendor, ordinal))
        if d is None or d.fd < 0:
            d = Device(vendor, ordinal)
            _devices[(vendor, ordinal)] = d
        return d
