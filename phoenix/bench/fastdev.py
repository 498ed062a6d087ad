"""``phx bench --fast-device SIZE``: a loop device over a tmpfs file, set up and always torn down.

Benchmark side, control plane. A stand-in for a fast NVMe array on a machine whose only
disk is slow (the H200 VM's virtio disk, ~2 GB/s): a file of SIZE in ``/dev/shm``, a loop
device over it with direct I/O on (``losetup --direct-io=on``: the loop driver reads the
tmpfs file with O_DIRECT, no second page cache), an ext4 file system on it (or, where
``mkfs.ext4`` is missing, the raw block device) mounted in a temporary directory. The
bench's file lives there; every figure taken on it is labelled :data:`LABEL`.

:class:`FastDevice` tears down what it made (umount, ``losetup -d``, the tmpfs file, the
mount directory) on a normal exit, on an error and on SIGINT/SIGTERM/SIGHUP (those
raise in the main thread while it is active; the teardown runs with them blocked).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile

LABEL = "loop device over RAM (stand-in for a fast NVMe array)"


def label(count: int = 1) -> str:
    """:data:`LABEL`, or for ``count`` devices with files striped over them (a loop device's
    rate is bounded per device; several in parallel add up, as the drives of an array do)."""
    if count <= 1:
        return LABEL
    return f"{count} loop devices over RAM, striped (stand-in for a fast {count}-drive NVMe array)"


SHM = "/dev/shm"
MKFS_OPTS = ["-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0"]  # -m 0: no blocks kept for root
_SIGNALS = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s))


def _size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def needed(size: int, fs: str) -> int:
    """Bytes of loop device a bench file of ``size`` needs: ext4's metadata and journal
    take a few percent (a 40 GiB device showed 38.2 GiB free with 5% kept for root; the
    file system is made with none kept, and this leaves 1/16 besides)."""
    return size if fs == "raw" else size + size // 16 + (64 << 20)


def _sh(*cmd: str, timeout: float = 120) -> str:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise OSError(errno.EIO, f"{' '.join(cmd)} failed (exit {p.returncode}): {msg[-1] if msg else ''}")
    return p.stdout.strip()


def check(
    dev_size: int, file_size: int, fs: str = "ext4", shm: str = SHM, what: str | None = None, count: int = 1
) -> None:
    """Refuse, with what is needed, a fast device (``count`` of them, each holding
    ``file_size``) that cannot be set up here (``what``: the files it is for, as the error
    names them; default a ``--size`` bench file)."""
    need = "--fast-device needs"
    if os.geteuid() != 0:
        raise PermissionError(errno.EPERM, f"{need} root (losetup, mkfs and mount); run as root or drop --fast-device")
    if shutil.which("losetup") is None:
        raise FileNotFoundError(errno.ENOENT, f"{need} losetup (util-linux) on PATH; install util-linux")
    if not (os.path.exists("/dev/loop-control") or os.path.exists("/dev/loop0")):
        raise FileNotFoundError(
            errno.ENODEV, f"{need} loop devices (/dev/loop-control; CONFIG_BLK_DEV_LOOP or modprobe loop)"
        )
    try:
        _sh("losetup", "--find", timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(errno.ENODEV, f"{need} a free loop device: {exc}") from None
    want = needed(file_size, fs)
    if dev_size < want:
        raise ValueError(
            f"--fast-device {_size_text(dev_size)} cannot hold "
            f"{what or f'a --size {_size_text(file_size)} bench file'} on {fs}: "
            f"give --fast-device {-(-want // 2**20)}M or more"
        )
    try:
        st = os.statvfs(shm)
    except OSError:
        raise FileNotFoundError(errno.ENOENT, f"{need} a tmpfs at {shm}") from None
    free = st.f_bavail * st.f_frsize
    if free < dev_size * count:
        each = f" ({count} x {_size_text(dev_size)})" if count > 1 else ""
        raise OSError(
            errno.ENOSPC,
            f"{need} {_size_text(dev_size * count)}{each} free in {shm}; it has {_size_text(free)}: "
            f"free some, or remount it larger (mount -o remount,size=... {shm})",
        )


def pick_fs(fs: str | None = None) -> str:
    """``ext4`` where mkfs.ext4 is on PATH, else ``raw`` (the block device itself)."""
    if fs:
        return fs
    return "ext4" if shutil.which("mkfs.ext4") else "raw"


class FastDevice:
    """Context manager: ``with FastDevice(size) as fd: fd.file`` is the bench file's path
    (on the mounted ext4, or the loop device itself with ``fs="raw"``); ``fd.info()`` is
    what the records carry."""

    def __init__(self, size: int, fs: str | None = None, shm: str = SHM, name: str = "phx-bench.bin"):
        self.size, self.fs, self.shm, self.name = size, pick_fs(fs), shm, name
        self.image = self.loop = self.mnt = self.file = None
        self.mounted = False
        self.dio = None
        self._old: dict = {}

    # -- setup / teardown ------------------------------------------------------------

    def __enter__(self) -> FastDevice:
        self._trap()
        blocked = hasattr(signal, "pthread_sigmask")
        if blocked:  # a signal during setup is taken after it, when every step made is known
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            try:
                self._setup()
            finally:
                if blocked:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _setup(self) -> None:
        fd, self.image = tempfile.mkstemp(prefix="phx-fastdev-", suffix=".img", dir=self.shm)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)  # the RAM reserved now, not at the first write
            except OSError as exc:
                raise OSError(
                    exc.errno, f"--fast-device: cannot reserve {_size_text(self.size)} in {self.shm} ({exc.strerror})"
                ) from None
        finally:
            os.close(fd)
        self.loop = _sh("losetup", "--direct-io=on", "--find", "--show", self.image)
        self.dio = _read(f"/sys/block/{os.path.basename(self.loop)}/loop/dio") == "1"
        if self.fs == "raw":
            self.file = self.loop
            return
        _sh("mkfs.ext4", *MKFS_OPTS, self.loop, timeout=600)
        self.mnt = tempfile.mkdtemp(prefix="phx-fastdev-mnt-")
        _sh("mount", "-t", "ext4", self.loop, self.mnt)
        self.mounted = True
        self.file = os.path.join(self.mnt, self.name)

    def teardown(self) -> list[str]:
        """Undo every step taken, in reverse, each one tried even if another failed;
        signals blocked meanwhile (a second Ctrl-C cannot leave a device behind). Returns
        the steps that failed (also said on stderr)."""
        failed: list[str] = []
        blocked = hasattr(signal, "pthread_sigmask")
        if blocked:
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            pio = sys.modules.get("phoenix.io")
            if pio is not None and self.file:
                try:  # registered page-cache windows map the file: release them, or umount is busy
                    pio.fmap_wait(10)
                    pio.fmap_clear()
                except Exception:
                    pass
            if self.mounted:
                try:
                    _sh("umount", self.mnt)
                except (OSError, subprocess.TimeoutExpired):
                    try:
                        _sh("umount", "-l", self.mnt)  # busy: detach now, freed when the last user goes
                    except (OSError, subprocess.TimeoutExpired) as exc:
                        failed.append(f"umount {self.mnt}: {exc}")
                self.mounted = False
            if self.mnt:
                try:
                    os.rmdir(self.mnt)
                except OSError as exc:
                    failed.append(f"rmdir {self.mnt}: {exc}")
                self.mnt = None
            if self.loop:
                try:
                    _sh("losetup", "-d", self.loop)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    failed.append(f"losetup -d {self.loop}: {exc}")
                self.loop = None
            if self.image:
                try:
                    os.unlink(self.image)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failed.append(f"rm {self.image}: {exc}")
                self.image = None
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            self._untrap()
        for f in failed:
            print(f"phx bench: fast-device teardown: {f}", file=sys.stderr)
        return failed

    # -- signals -----------------------------------------------------------------------

    def _trap(self) -> None:
        """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread while the device
        exists (SIGINT does already), so that ``finally`` blocks run and it is torn down."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def raise_interrupt(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for s in _SIGNALS:
            if s == signal.SIGINT:
                continue
            try:
                self._old[s] = signal.signal(s, raise_interrupt)
            except (OSError, ValueError):
                pass

    def _untrap(self) -> None:
        for s, h in self._old.items():
            try:
                signal.signal(s, h)
            except (OSError, ValueError):
                pass
        self._old.clear()

    def info(self) -> dict:
        return {
            "label": LABEL,
            "device_bytes": self.size,
            "fs": self.fs,
            "fs_text": "ext4 on the loop device" if self.fs == "ext4" else "the raw loop device (no mkfs.ext4 here)",
            "loop": self.loop,
            "direct_io": self.dio,
            "backing": f"tmpfs file in {self.shm}",
        }


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def auto_size(need: int) -> int:
    """A device for ``need`` bytes of files on ext4, rounded up to 256 MiB."""
    q = 256 << 20
    return -(-needed(need, "ext4") // q) * q


def add_argument(p, files: str, auto: bool = False, striped: bool = False) -> None:
    """The ``--fast-device SIZE`` option of a bench subcommand that puts ``files`` there
    (``auto``: ``--fast-device auto`` too, sized by :func:`directory` for the files;
    ``striped``: ``--fast-devices N`` too, for :func:`directories`)."""
    from ..cli._run import positive_int, positive_size

    def size_or_auto(text: str):
        if auto and text.strip().lower() == "auto":
            return "auto"
        return positive_size(text)

    size_or_auto.__name__ = "size"
    p.add_argument(
        "--fast-device",
        type=size_or_auto,
        metavar="SIZE" + ("|auto" if auto else ""),
        help=f"put {files} on a {LABEL}: a SIZE file in {SHM}, a loop device over it with direct I/O on, "
        "ext4 on it; all of it torn down at the end (root; needs SIZE of free RAM in /dev/shm)"
        + ("; auto: as large as they need" if auto else ""),
    )
    if striped:
        p.add_argument(
            "--fast-devices",
            type=positive_int,
            default=1,
            metavar="N",
            help="with --fast-device: N loop devices of SIZE each (auto: sized for their share), "
            f"{files} striped over them block by block, as over the drives of an array: one loop device's rate "
            "is bounded per device, several add up (default 1)",
        )


@contextlib.contextmanager
def directory(args, need: int, quiet: bool = False, what: str | None = None):
    """With ``args.fast_device``: a :class:`FastDevice` (ext4) of that size (``auto``:
    :func:`auto_size` of ``need``), checked to hold ``need`` bytes of files (``what``, as an
    error names them), yielding its mounted directory and setting ``args.fast_device_info``
    (records carry it); without: yields None. Torn down on exit, error or signal."""
    with directories(args, need, quiet, what, count=1) as mnts:
        yield mnts[0] if mnts else None


@contextlib.contextmanager
def directories(args, need: int, quiet: bool = False, what: str | None = None, count: int | None = None):
    """:func:`directory` for ``count`` devices (default ``args.fast_devices``, else 1), each
    holding ``need`` bytes (its share of striped files): yields their mounted directories
    (an empty list without ``args.fast_device``); ``args.fast_device_info`` has the first's
    info with the label of them all (:func:`label`), their count and loop devices."""
    size = getattr(args, "fast_device", None)
    if not size:
        yield []
        return
    count = count or getattr(args, "fast_devices", 1) or 1
    if size == "auto":
        size = auto_size(need)
    if pick_fs("ext4") != "ext4" or shutil.which("mkfs.ext4") is None:
        raise FileNotFoundError(errno.ENOENT, "--fast-device here needs mkfs.ext4 (e2fsprogs) on PATH")
    check(size, need, "ext4", what=what, count=count)
    with contextlib.ExitStack() as stack:
        devs = [stack.enter_context(FastDevice(size, "ext4")) for _ in range(count)]
        info = dict(devs[0].info(), label=label(count))
        if count > 1:
            info.update(devices=count, loops=[d.loop for d in devs], striped="block by block, in turn")
        args.fast_device_info = info
        if not quiet:
            for dev in devs:
                print(
                    f"on a {LABEL}: {dev.loop} over {dev.image}, direct I/O {'on' if dev.dio else 'OFF'}, "
                    f"{dev.info()['fs_text']}, mounted at {dev.mnt}",
                    file=sys.stderr,
                )
        yield [dev.mnt for dev in devs]
