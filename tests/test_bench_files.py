"""The benches never change a file of the user's, and leave nothing behind on failure
(``phoenix.bench.files``): an existing file the bench did not make is only read, and only if it
holds --size bytes; a write test or a smaller file is refused in one line before any work; a
second run on a file in use is refused; a run that fails or is interrupted (ENOSPC, Ctrl-C)
removes what it created and cuts back what it extended; the README's first command runs again
on the file its first run left.

Every user file is random bytes; after each run its size, every byte and its modification time
are checked unchanged, and no mark (xattr, sidecar) or other file appeared beside it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys

import pytest

from phoenix.bench import files as bf

PHX = [sys.executable, "-P", "-m", "phoenix.cli.phx"]
SMALL = ["--size", "8M", "--chunk", "4M", "--threads", "1", "--reps", "1", "--quiet"]
MiB = 1 << 20


def _run(cmd, timeout=240):
    env = dict(os.environ, PHX_VENDOR="host")
    env.pop("PHX_DEBUG", None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _one_line(p, *words):
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _state(path) -> tuple:
    """What must not change: size, every byte, modification time, mode, no mark on it."""
    st = os.stat(path)
    try:
        mark = os.getxattr(path, "user.phoenix.bench")
    except OSError:
        mark = None
    return st.st_size, hashlib.sha256(open(path, "rb").read()).hexdigest(), st.st_mtime_ns, st.st_mode, mark


def _user_file(tmp_path, size: int, read_only: bool = False):
    path = tmp_path / "mine.bin"
    path.write_bytes(os.urandom(size))
    if read_only:
        path.chmod(0o444)
    os.utime(path, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))  # an old mtime: a touch would show
    return path


# ---- phx bench: a file of the user's --------------------------------------------------------------

CASES = {
    # (its size, read-only, ops) -> words of the refusal (None: it runs, reading the file as it is)
    "smaller, read and write": (4 * MiB, False, "read,write", ["not made by phx bench", "less than --size", "new"]),
    "smaller, read only": (4 * MiB, False, "read", ["less than --size 8 MiB", "--size 4194304 or less"]),
    "same size, read and write": (8 * MiB, False, "read,write", ["not written", "--ops read"]),
    "same size, read only": (8 * MiB, False, "read,randread", None),
    "larger, read only": (12 * MiB, False, "read", None),
    "read-only file, write": (8 * MiB, True, "read,write", ["not written", "--ops read"]),
    "read-only file, read": (8 * MiB, True, "read", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_file_of_the_users_is_never_changed(tmp_path, case):
    size, read_only, ops, words = CASES[case]
    path = _user_file(tmp_path, size, read_only)
    before = _state(path)
    p = _run(PHX + ["bench", "--file", str(path), "--ops", ops, "--random-ops", "64", "--qd", "4", *SMALL])
    if words is None:
        assert p.returncode == 0, p.stdout + p.stderr
        assert "read      cold" in p.stdout
    else:
        line = _one_line(p, "--file", str(path), *words)
        assert p.stdout == "", "refused after work was done"
        assert "phoenix.settings" not in line
    assert _state(path) == before, "the user's file changed"
    assert sorted(os.listdir(tmp_path)) == ["mine.bin"], "a mark or another file was left beside it"


def test_the_readme_command_runs_again_on_the_file_it_made(tmp_path):
    """The first run makes the file (marked as the bench's); the next reuses it, writes
    included, and a changed one is refused with rm as the way out."""
    path = tmp_path / "phx-demo.bin"
    for _ in range(2):
        p = _run(PHX + ["bench", "--file", str(path), *SMALL])
        assert p.returncode == 0, p.stdout + p.stderr
        assert path.stat().st_size == 8 * MiB and bf.bench_state(str(path)) == "ours"
        assert "write     cold" in p.stdout
    ino = path.stat().st_ino
    p = _run(PHX + ["bench", "--file", str(path), "--size", "12M", "--chunk", "4M", "--threads", "1", "--reps", "1"])
    assert p.returncode == 0, p.stderr
    assert path.stat().st_size == 12 * MiB and path.stat().st_ino == ino  # its own file, extended in place
    with open(path, "r+b") as fh:  # another program writes it
        fh.write(b"mine now")
    before = _state(path)
    p = _run(PHX + ["bench", "--file", str(path), *SMALL])
    _one_line(p, "changed since", f"rm {path}")
    assert _state(path) == before


def test_a_file_in_use_by_another_run_is_refused(tmp_path):
    path = tmp_path / "b.bin"
    with bf.BenchFiles() as held:  # another bench run holds it (made, locked)
        held.claim(str(path), 8 * MiB)
        held.fill()
        before = _state(path)
        p = _run(PHX + ["bench", "--file", str(path), *SMALL])
        _one_line(p, "--file", "in use by another bench run", "another --file")
        assert _state(path) == before
        p = _run(PHX + ["bench", "loadlat", "--file", str(path), "--size", "8M", "--block", "1M", "--quiet"])
        _one_line(p, "--file", "in use by another bench run")
    assert _state(path) == before


# ---- failures: what the run made goes, nothing else ------------------------------------------------


def _fail_after(monkeypatch, nbytes: int, exc: BaseException):
    """os.pwrite (the fill's writes) fails once ``nbytes`` have been written."""
    real = os.pwrite
    done = [0]

    def pwrite(fd, data, off):
        if done[0] >= nbytes:
            raise exc
        n = real(fd, data, off)
        done[0] += n
        return n

    monkeypatch.setattr(bf.os, "pwrite", pwrite)


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_fill_removes_the_file_it_created(tmp_path, monkeypatch, exc):
    path = tmp_path / "b.bin"
    _fail_after(monkeypatch, 64 * MiB, exc)
    with pytest.raises(type(exc)) as ei:
        with bf.BenchFiles() as files:
            files.claim(str(path), 192 * MiB)
            files.fill()
    if isinstance(exc, OSError):
        assert "filled up" in str(ei.value) and "--file" in str(ei.value)
    assert os.listdir(tmp_path) == [], "the partial file (or its mark) was left"


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_run_leaves_a_users_file_and_cuts_back_its_own(tmp_path, monkeypatch, exc):
    """Beside the bench's own file (extended, then the fill fails) a user's file is claimed for
    reading: the bench's is cut back to its size, its bytes as they were; the user's untouched."""
    mine = _user_file(tmp_path, 8 * MiB)
    own = tmp_path / "own.bin"
    with bf.BenchFiles() as files:
        files.claim(str(own), 64 * MiB)
        files.fill()
    own_before = own.read_bytes()
    user_before = _state(mine)
    _fail_after(monkeypatch, 64 * MiB, exc)
    with pytest.raises(type(exc)):
        with bf.BenchFiles() as files:
            files.claim(str(mine), 8 * MiB, "--file")
            files.claim(str(own), 192 * MiB, "--other")
            files.fill()
    assert own.read_bytes() == own_before and bf.bench_state(str(own)) == "ours"
    assert _state(mine) == user_before
    assert sorted(os.listdir(tmp_path)) == ["mine.bin", "own.bin"]


def test_a_failed_cli_run_removes_the_file_it_created(tmp_path):
    """ENOSPC in the middle of making --file, through the command line: one line, no file left.
    (The fault is injected in the child: os.pwrite fails past 4 MiB.)"""
    path = tmp_path / "b.bin"
    code = (
        "import errno, os, sys\n"
        "real, done = os.pwrite, [0]\n"
        "def pwrite(fd, data, off):\n"
        "    if done[0] >= 4 << 20: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    n = real(fd, data[: 4 << 20], off); done[0] += n; return n\n"  # a short write, then the full disk
        "os.pwrite = pwrite\n"
        "from phoenix.cli.phx import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    p = _run([sys.executable, "-P", "-c", code, "bench", "--file", str(path), *SMALL])
    _one_line(p, "--file", "filled up", "lower --size")
    assert os.listdir(tmp_path) == []


def test_too_little_room_is_refused_before_writing(tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, (1 * MiB) // st.f_frsize

    monkeypatch.setattr(bf.os, "statvfs", lambda d: Small(real(d)))
    with pytest.raises(OSError) as ei:
        with bf.BenchFiles() as files:
            files.claim(str(tmp_path / "b.bin"), 8 * MiB)
    assert ei.value.errno == errno.ENOSPC
    assert "--size 8 MiB" in str(ei.value) and "needs 8 MiB more" in str(ei.value) and "free" in str(ei.value)
    assert os.listdir(tmp_path) == []


# ---- the mark ------------------------------------------------------------------------------------


def test_without_xattrs_a_sidecar_names_the_very_file(tmp_path, monkeypatch):
    """On a file system without user xattrs the mark is FILE.phx-bench, naming the file's inode,
    size and modification time: a file put in its place later is not the bench's, even where it
    reuses the inode number."""

    def no_xattr(*a, **k):
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(bf.os, "setxattr", no_xattr)
    monkeypatch.setattr(bf.os, "getxattr", no_xattr)
    path = tmp_path / "b.bin"
    with bf.BenchFiles() as files:
        files.claim(str(path), 8 * MiB)
        files.fill()
    side = tmp_path / ("b.bin" + bf.SIDECAR)
    assert json.loads(side.read_text())["ino"] == path.stat().st_ino
    assert bf.bench_state(str(path)) == "ours"
    os.unlink(path)
    path.write_bytes(os.urandom(8 * MiB))  # the user's own file of that name, same size
    # never the bench's: another inode, or the same one reused (its modification time then differs)
    assert bf.bench_state(str(path)) in (None, "changed")
    with pytest.raises(ValueError, match="not made by phx bench|changed since"):
        with bf.BenchFiles() as files:
            files.claim(str(path), 8 * MiB, write=True)


# ---- the other benches' files ---------------------------------------------------------------------


def test_loadlat_never_truncates_a_users_write_file(tmp_path):
    """--write-file was opened "w+" (truncated) whatever it was; --file a smaller user file was
    extended with random data."""
    w = tmp_path / "mine.bin"
    w.write_bytes(os.urandom(2 * MiB))
    before = _state(w)
    cmd = PHX + ["bench", "loadlat", "--file", str(tmp_path / "l.bin"), "--size", "8M", "--block", "1M"]
    cmd += ["--loads", "2", "--write-size", "8M", "--write-chunk", "1M", "--quiet"]
    p = _run(cmd + ["--write-file", str(w)])
    _one_line(p, "--write-file", "not made by phx bench loadlat", "new --write-file")
    assert _state(w) == before and sorted(os.listdir(tmp_path)) == ["mine.bin"]
    p = _run(PHX + ["bench", "loadlat", "--file", str(w), "--size", "8M", "--block", "1M", "--quiet"])
    _one_line(p, "--file", "less than --size")
    assert _state(w) == before and sorted(os.listdir(tmp_path)) == ["mine.bin"]


@pytest.mark.parametrize("which", ["slab", "slab.history"])
def test_kv_trace_never_overwrites_or_removes_a_users_slab(tmp_path, which):
    """The slab was written with open("wb") and removed at the end, whatever file was there."""
    mine = tmp_path / which
    mine.write_bytes(os.urandom(1 * MiB))
    before = _state(mine)
    p = _run(PHX + ["bench", "kv-trace", "--dry-run", "--configs", "phoenix", "--slab", str(tmp_path / "slab")])
    _one_line(p, "--slab", str(mine), "not made by phx bench kv-trace")
    assert _state(mine) == before and os.listdir(tmp_path) == [which]


def test_loader_make_interrupted_leaves_no_file(tmp_path):
    """--make writes the file the loader reads; a failure while writing it (here: ENOSPC from the
    writer) removes it."""
    path = tmp_path / "m.safetensors"
    code = (
        "import errno, sys\n"
        "from phoenix.bench import loader\n"
        "def boom(path, size, seed=0):\n"
        "    open(path, 'wb').write(b'x' * 4096)\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "loader.make_bench_file = boom\n"
        "from phoenix.cli.phx import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    p = _run([sys.executable, "-P", "-c", code, "bench", "loader", str(path), "--device", "cpu", "--make", "8M"])
    _one_line(p, "No space left")
    assert os.listdir(tmp_path) == []


def test_records_of_a_run_a_later_failure_stopped_are_kept(tmp_path, monkeypatch, capsys):
    """A write that fails after the reads (a file system gone read-only): the reads' records
    are printed and written, then the one line."""
    from phoenix.bench import throughput
    from phoenix.cli._run import ArgumentParser

    def refused(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(throughput.Bench, "_phoenix_write", refused)
    parser = ArgumentParser(prog="phx")
    throughput.add_parser(parser.add_subparsers())
    out = tmp_path / "b.json"
    args = parser.parse_args(["bench", "--file", str(tmp_path / "b.bin"), "--json", str(out), *SMALL])
    with pytest.raises(OSError, match="read-only"):
        throughput.main(args)
    recs = json.loads(out.read_text())
    assert recs and {r["op"] for r in recs} == {"read"} and all("meta" in r for r in recs)
    text = capsys.readouterr().out
    assert "stopped by an error" in text and "read      cold" in text
    assert os.listdir(tmp_path) == ["b.json"], "the file this failed run made was left"
