"""The bench's files: claimed (never one of the user's changed), made with random data, locked,
removed after a failed run; evicted from the page cache or warmed into it.

Benchmark side, control plane. Shared by ``phx bench``, ``loadlat``, the kv-trace slab and
the loader bench; every cold figure starts with :func:`drop_cache`.

A bench file is the bench's own or the user's, and only its own is ever written:

* **absent**: created (``O_EXCL``), marked as the bench's (below), filled with random data;
* **the bench's** (its mark, the size and modification time it left): used, written by the
  write tests, extended if ``--size`` grew;
* **the user's** (no mark): only read, and only if it holds ``--size`` bytes; a write test or
  a smaller file is refused before anything runs, in one line saying what to pass instead;
* **the bench's, changed since** (its size or modification time is not what the bench left:
  another program wrote it, or a run was killed while writing): refused as the user's would
  be for writing, with ``rm`` as the way to have it made afresh.

The mark is an extended attribute (``user.phoenix.bench``: it follows the file through a
rename and dies with it), or, on a file system without user xattrs, a sidecar
``FILE.phx-bench`` that names the file's device and inode. A run holds an exclusive advisory
lock (``flock``) on each of its files, so that a second bench on the same file is refused
instead of measuring a shared disk. A run that fails or is interrupted (ENOSPC, Ctrl-C)
removes the files it created and cuts a file it extended back to its size; nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys

#: the extended attribute that marks a file the bench made
MARK_XATTR = "user.phoenix.bench"
#: where the mark goes on a file system without user xattrs: FILE + this
SIDECAR = ".phx-bench"
_MADE_BY = "phx bench"
_NO_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)
_BLOCK = 64 << 20  # the random data's block: one is made, stamped per copy


def settings_env() -> dict[str, str]:
    """The ``PHX_*`` environment of this run (settings the command line does not show):
    records carry it beside ``argv``, so that the command that made them can be rerun."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("PHX_")}


def drop_cache(*paths: str) -> str:
    """Evict the files from the page cache; returns how (for the record).

    phoenix's own page-cache registrations go first: a registered mapping pins its pages,
    so neither fadvise nor drop_caches could evict them, and a "cold" read would be served
    from memory (found on the H200: a cold phxloader repetition at 0.08 s). Each file is
    synced and fadvised; the system-wide ``drop_caches`` is written once for all of them
    (it walks every cached inode, tmpfs's too: seconds on a host whose RAM holds loop
    devices' backing files)."""
    pio = sys.modules.get("phoenix.io")
    if pio is not None:
        pio.fmap_wait(10)  # registrations under way finish (or they would pin pages after the drop)
        pio.fmap_clear()
    failed = []  # every file is tried; the first failure is what the record says
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as exc:
            failed.append(exc)
    how = "fadvise"
    if failed:  # the others are still dropped, below
        how = (
            f"not dropped ({failed[0]})"
            + (f" and {len(failed) - 1} more" if len(failed) > 1 else "")
            + "; others fadvise"
        )
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        how += "+drop_caches"
    except OSError:
        pass
    return how


def warm_cache(path: str, size: int) -> None:
    """Read the file once, buffered, so it sits in the page cache."""
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(64 << 20)
        mv = memoryview(buf)
        left = size
        while left > 0:
            n = fh.readinto(mv[: min(len(buf), left)])
            if not n:
                break
            left -= n


def human(n: int) -> str:
    """``1 GiB``, ``1.5 MiB``, ``4096 B``: a size as a message says it."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


# ---- the mark ------------------------------------------------------------------------------------


def _read_mark(path: str, st: os.stat_result) -> dict | None:
    """The bench's mark on ``path`` (as stat'ed: ``st``), or None."""
    raw = None
    try:
        raw = os.getxattr(path, MARK_XATTR)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, *_NO_XATTR):
            return None
    if raw is None:  # no xattr (or none possible): the sidecar, if it names this very file
        try:
            with open(path + SIDECAR, "rb") as fh:
                raw = fh.read(4096)
        except OSError:
            return None
    try:
        mark = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(mark, dict) or mark.get("by") != _MADE_BY:
        return None
    if "ino" in mark and (mark.get("dev"), mark.get("ino")) != (st.st_dev, st.st_ino):
        return None  # a sidecar left beside a file that has been replaced since
    return mark


def bench_state(path: str, st: os.stat_result | None = None) -> str | None:
    """``"ours"`` (made by the bench and as it left it; ``"filling"`` too: a fill a killed run
    left unfinished), ``"changed"`` (made by the bench, written by something else since), or
    None (not the bench's)."""
    st = st or os.stat(path)
    mark = _read_mark(path, st)
    if mark is None:
        return None
    if mark.get("state") == "filling":
        return "ours"
    if (mark.get("size"), mark.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
        return "ours"
    return "changed"


def _mark(path: str, state: str) -> None:
    """Mark ``path`` as the bench's, with its size and modification time now (``state``:
    ``filling`` while its data is being written, else ``complete``)."""
    st = os.stat(path)
    mark = {"by": _MADE_BY, "state": state, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "pid": os.getpid()}
    try:
        os.setxattr(path, MARK_XATTR, json.dumps(mark).encode())
        return
    except OSError as exc:
        if exc.errno not in _NO_XATTR:
            raise
    side = path + SIDECAR
    if os.path.exists(side) and _read_mark(path, st) is None:
        try:  # a sidecar of an earlier bench file of this name is the bench's to replace
            with open(side, "rb") as fh:
                if json.loads(fh.read(4096)).get("by") != _MADE_BY:
                    return  # someone else's file of that name: left alone (the file stays unmarked)
        except (OSError, ValueError, AttributeError):
            return
    mark.update(dev=st.st_dev, ino=st.st_ino)
    tmp = f"{side}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(mark, fh)
    os.replace(tmp, side)


def _unmark(path: str) -> None:
    side = path + SIDECAR
    try:
        st = os.stat(path)
    except OSError:
        st = None
    try:
        with open(side, "rb") as fh:
            mark = json.loads(fh.read(4096))
        if mark.get("by") == _MADE_BY and (st is None or (mark.get("dev"), mark.get("ino")) == (st.st_dev, st.st_ino)):
            os.unlink(side)
    except (OSError, ValueError, AttributeError):
        pass


# ---- one run's files -------------------------------------------------------------------------------


class Claim:
    """One file of a run: where, how large, whether written, and what the run did to it."""

    def __init__(self, path: str, option: str, size: int, write: bool, scratch: bool):
        self.path, self.option, self.size, self.write, self.scratch = path, option, size, write, scratch
        self.fd: int | None = None  # the lock's descriptor
        self.created = False  # made by this run
        self.made = False  # the bench's (made now or by an earlier run, or set up by it: a fast device)
        self.old_size = 0  # its size when claimed
        self.fill_from: int | None = None  # where its random data is to be written from (None: nothing to write)
        self.filled = False


class BenchFiles:
    """The files one run of a bench uses (``with BenchFiles() as files:``): :meth:`claim`
    checks and locks each before anything is measured, :meth:`fill` writes the random data
    of those that need it; on leaving, the locks go, marks are brought up to date, and after
    a failure (any exception, Ctrl-C included) what this run created is removed and what it
    extended is cut back. ``tool`` names the bench in messages."""

    def __init__(self, tool: str = "phx bench"):
        self.tool = tool
        self.claims: list[Claim] = []

    def __enter__(self) -> BenchFiles:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    # -- claiming ----------------------------------------------------------------------------

    def claim(
        self,
        path,
        size: int,
        option: str = "--file",
        *,
        write: bool = False,
        fill: bool = True,
        scratch: bool = False,
        made: bool = False,
        size_option: str = "--size",
        read_hint: str = "",
        need: int = 0,
    ) -> Claim:
        """Claim ``path`` for ``size`` bytes (``option`` names it in messages): refused, with what
        to do, where it is a directory, in a directory that does not exist or cannot be written
        (to create it), in use by another bench, not the bench's while ``write`` (``read_hint``:
        how to run without writing it) or holding fewer than ``size`` bytes, or where its file
        system cannot hold what is still to be written. ``fill``: it is to hold random data
        (else only created, e.g. a file the run writes itself); ``scratch``: removed at the end
        of the run if it made it; ``made``: set up by the bench itself (a loop device), taken
        as it is; ``need``: bytes a file to be created will take that the run writes itself
        (checked against the free space as a fill is). Nothing is written here but a created
        file's mark."""
        path = os.fspath(path)
        c = Claim(path, option, size, write, scratch)
        for other in self.claims:
            if _same(other.path, path):
                raise ValueError(f"{option} {path} is {other.option} too: give each its own file")
        if made:
            c.made, c.fill_from = True, 0 if fill else None
            self.claims.append(c)
            return c
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise IsADirectoryError(
                errno.EISDIR, f"{option} {path} is a directory; give a file path (the bench creates it if absent)"
            )
        if not os.path.isdir(parent):
            raise FileNotFoundError(
                errno.ENOENT,
                f"{option} {path}: its directory {parent} does not exist; create it or pick a {option} in an "
                "existing directory",
            )
        if not os.path.lexists(path):
            self._create(c, parent, fill, size_option, need)
        else:
            self._existing(c, fill, size_option, read_hint)
        self.claims.append(c)
        return c

    def _create(self, c: Claim, parent: str, fill: bool, size_option: str, need: int = 0) -> None:
        if fill or need:
            _room(c, parent, c.size if fill else need, size_option)
        try:
            fd = os.open(c.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # made meanwhile (another bench): judged as an existing file
            return self._existing(c, fill, size_option, "")
        except OSError as exc:
            hint = (
                f"the directory {parent} is read-only; pick a {c.option} in a writable directory"
                if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                else f"pick a {c.option} elsewhere"
            )
            raise type(exc)(
                exc.errno, f"{c.option} {c.path}: cannot create it ({os.strerror(exc.errno)}); {hint}"
            ) from None
        c.fd, c.created, c.made = fd, True, True
        try:
            self._lock(c)
            _mark(c.path, "filling" if fill else "complete")
        except BaseException:
            os.close(fd)
            c.fd = None
            _remove(c.path)
            raise
        c.fill_from = 0 if fill else None

    def _existing(self, c: Claim, fill: bool, size_option: str, read_hint: str) -> None:
        try:
            c.fd = os.open(c.path, os.O_RDONLY)
        except OSError as exc:
            raise type(exc)(
                exc.errno,
                f"{c.option} {c.path} cannot be read ({os.strerror(exc.errno)}); pick a {c.option} you may read",
            ) from None
        try:
            self._lock(c)
            st = os.fstat(c.fd)
            c.old_size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(
                    f"{c.option} {c.path} is not a regular file: the bench uses files it may make; give a file path"
                )
            state = bench_state(c.path, st)
            new = f"give a new {c.option} path (the bench creates it)"
            if state != "ours":
                self._refuse_or_read(c, st, state, new, size_option, read_hint)
                return  # read as it is
            c.made = True
            if c.write and not os.access(c.path, os.W_OK):
                how = f"{read_hint} to read it as it is, or make it writable" if read_hint else "make it writable"
                raise PermissionError(errno.EACCES, f"{c.option} {c.path} is read-only: {how}, or {new}")
            if fill and _read_mark(c.path, st).get("state") == "filling":
                c.fill_from = 0  # a fill a killed run left unfinished: made whole
            elif fill and st.st_size < c.size:
                c.fill_from = st.st_size // _BLOCK * _BLOCK  # extended: from the block it stops in
            if c.fill_from is not None:
                if not os.access(c.path, os.W_OK):
                    raise PermissionError(
                        errno.EACCES,
                        f"{c.option} {c.path} is read-only and holds {human(st.st_size)}, less than {size_option} "
                        f"{human(c.size)}: make it writable, or {new}",
                    )
                _room(c, os.path.dirname(os.path.abspath(c.path)), c.size - st.st_blocks * 512, size_option)
        except BaseException:
            os.close(c.fd)
            c.fd = None
            raise

    def _refuse_or_read(self, c: Claim, st, state: str | None, new: str, size_option: str, read_hint: str) -> None:
        """A file not the bench's (``state`` None), or the bench's changed since (``"changed"``):
        read as it is where that is all the run does and it is large enough, else refused in
        one line with every way out."""
        small = c.size > st.st_size
        if not (c.write or small):
            return
        if state == "changed":
            whose = (
                f"was made by {self.tool} but has changed since (another program wrote it, or a run was killed "
                "while writing it)"
            )
        else:
            whose = f"was not made by {self.tool}, which never changes such a file"
        problems = (["it may be read, not written"] if c.write else []) + (
            [f"it holds {human(st.st_size)}, less than {size_option} {human(c.size)}"] if small else []
        )
        ways = ([f"remove it (rm {c.path}) to have it made afresh"] if state == "changed" else []) + [new]
        fits = st.st_size // 4096 * 4096
        if (read_hint or not c.write) and (fits or not small):  # it can be read as it is
            as_is = ([read_hint] if c.write else []) + ([f"{size_option} {fits} or less"] if small else [])
            ways.append(" with ".join(as_is) + " to read it as it is")
        raise ValueError(f"{c.option} {c.path} {whose}: {', and '.join(problems)}; {', or '.join(ways)}")

    def _lock(self, c: Claim) -> None:
        try:
            fcntl.flock(c.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                f"{c.option} {c.path} is in use by another bench run (it holds the file's lock): wait for it to "
                f"finish, or give another {c.option} (two runs on one file measure each other)",
            ) from None

    # -- filling -----------------------------------------------------------------------------

    def fill(self) -> None:
        """Write the random data of every claimed file that needs it (created, extended, or
        left half-written by a killed run), then mark it complete."""
        for c in self.claims:
            if c.fill_from is None or c.filled:
                continue
            try:
                _write_random(c.path, c.fill_from, max(c.size, c.old_size))
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise OSError(
                        exc.errno,
                        f"{c.option} {c.path}: the file system filled up while the bench wrote its {human(c.size)} "
                        "(what it wrote is removed); lower --size or put the file on a file system with room",
                    ) from None
                raise
            c.filled = True
            self._remark(c)

    def _remark(self, c: Claim) -> None:
        if c.fill_from is not None and not c.filled:
            return  # its data is still to be written: it stays marked as filling
        if c.made and os.path.isfile(c.path):
            try:
                _mark(c.path, "complete")
            except OSError:
                pass  # unmarked: a later run refuses it with what to do

    # -- the end ------------------------------------------------------------------------------

    def close(self, failed: bool = False, remove: bool = False) -> None:
        """Release the run's files: after a failure, what it created is removed and what it
        extended is cut back to its size; scratch files it created are removed in any case,
        and with ``remove`` every file of the bench's it claimed (a slab at the end of its run);
        the marks of the bench's files it wrote are brought up to date; the locks released."""
        for c in reversed(self.claims):
            try:
                if (c.created and (failed or c.scratch)) or (remove and c.made and os.path.isfile(c.path)):
                    _remove(c.path)
                elif failed and c.made and c.fill_from is not None and not c.created and os.path.isfile(c.path):
                    if c.fill_from == 0 and c.old_size < c.size:  # a fill left unfinished: the bench's, partial
                        _remove(c.path)
                    else:
                        os.truncate(c.path, c.old_size)
                        _mark(c.path, "complete")  # as it was: the bench's, whole
                elif c.made and (c.write or c.filled):
                    self._remark(c)
            except OSError as exc:
                print(f"{self.tool}: could not clean up {c.path}: {exc}", file=sys.stderr)
            finally:
                if c.fd is not None:
                    os.close(c.fd)  # the lock goes with it
                    c.fd = None
        self.claims.clear()


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _room(c: Claim, directory: str, need: int, size_option: str) -> None:
    """Refuse, before writing, ``need`` bytes more than ``directory``'s file system has free."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise OSError(
            errno.ENOSPC,
            f"{size_option} {human(c.size)}: {c.option} {c.path} needs {human(need)} more and {directory} has "
            f"{human(free)} free; lower {size_option}, or put {c.option} on a file system with room",
        )


def _remove(path: str) -> None:
    _unmark(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_random(path: str, start: int, size: int) -> None:
    """Random data from ``start`` (a multiple of the block) to ``size`` in ``path``, synced."""
    import numpy as np

    # one random block, stamped per copy so that no two blocks are equal: random enough
    # for a disk (no compression or dedup in the path) and written at disk speed
    block = np.random.default_rng(1234).integers(0, 256, _BLOCK, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY)
    try:
        off, i = start, start // _BLOCK
        while off < size:
            n = min(_BLOCK, size - off)
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            mv = memoryview(block[:n])
            done = 0
            while done < n:
                done += os.pwrite(fd, mv[done:], off + done)
            off, i = off + n, i + 1
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_foreign(path: str, option: str, tool: str = "phx bench") -> None:
    """Refuse now, as :meth:`BenchFiles.claim` would when the run writes ``path``, an existing
    file that is not the bench's (or is in use), before the run sets anything up; an absent
    one passes (made when claimed)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        with BenchFiles(tool) as files:
            files.claim(path, 0, option, write=True, fill=False)


def prepare_file(path: str, size: int, option: str = "--file") -> None:
    """For scripts (benchmarks/): ``path`` made (or extended, if the bench's) to ``size`` bytes of
    random data, as a bench run makes its file, then released; a file of the user's is never
    changed (refused unless it holds ``size`` bytes, then used as it is)."""
    with BenchFiles("prepare_file") as files:
        files.claim(path, size, option)
        files.fill()
