"""The bench's files: made once with random data, evicted from the page cache, or warmed into it.

Benchmark side, control plane. Shared by ``phx bench``, the kv-trace replay and the loader
bench; every cold figure starts with :func:`drop_cache`.
"""

from __future__ import annotations

import errno
import os
import sys


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


def check_bench_file(path: str, size: int, option: str = "--file") -> None:
    """Refuse, before anything is measured, a bench file that cannot be used: a directory, one
    in a directory that does not exist, or one too small that cannot be written (messages
    name ``option`` and what to do). A read-only file that is large enough passes: its reads
    are measured, and a write then fails with the records of the reads kept."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(
            errno.EISDIR,
            f"{option} {path} is a directory; give a file path (it is created "
            f"with {size} bytes of random data if absent)",
        )
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{option} {path}: its directory {parent} does not exist; create it or "
            f"pick a {option} in an existing directory",
        )
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise PermissionError(errno.EACCES, f"{option} {path} is not readable; pick a {option} you may read and write")


def prepare_file(path: str, size: int, option: str = "--file") -> None:
    """Create ``path`` with ``size`` bytes of random data unless it already has that size."""
    if os.path.exists(path) and os.path.getsize(path) >= size:
        return
    what = f"extend it to {size} bytes" if os.path.exists(path) else "create it"
    try:
        _write_random(path, size)
    except OSError as exc:
        hint = (
            f"the directory {os.path.dirname(os.path.abspath(path))} is read-only; pick a {option} in a "
            "writable directory"
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and what == "create it"
            else f"pick a {option} you may write, or one that already holds {size} bytes"
        )
        raise type(exc)(exc.errno, f"{option} {path}: cannot {what} ({os.strerror(exc.errno)}); {hint}") from exc


def _write_random(path: str, size: int) -> None:
    import numpy as np

    # one random block, stamped per copy so that no two blocks are equal: random enough
    # for a disk (no compression or dedup in the path) and written at disk speed
    block = np.random.default_rng(1234).integers(0, 256, 64 << 20, dtype=np.uint8)
    with open(path, "wb") as fh:
        left, i = size, 0
        while left > 0:
            n = min(len(block), left)
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            fh.write(block[:n].tobytes())
            left, i = left - n, i + 1
        fh.flush()
        os.fsync(fh.fileno())
