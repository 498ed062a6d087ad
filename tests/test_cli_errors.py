"""The user boundary of every command line: a user's mistake is one line on stderr naming
what to fix, exit status 2, never a traceback (``--debug`` shows it); ``phx --version``.

Each case runs the command as a user would (a subprocess, the host vendor where a vendor
is needed) and checks: exit status 2, exactly one line on stderr, no "Traceback", and the
words that name the thing to fix.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import stat
import subprocess
import sys

import pytest

from phoenix.cli import _run

PHX = [sys.executable, "-P", "-m", "phoenix.cli.phx"]
SMALL = ["--size", "8M", "--chunk", "4M", "--threads", "1", "--reps", "1", "--quiet"]


def _run_cmd(cmd, env=None, preexec_fn=None, timeout=240):
    full_env = dict(os.environ, PHX_VENDOR="host")
    full_env.pop("PHX_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


def assert_one_line(p, prog, *names):
    """Exit status 2, one stderr line ``<prog>: ...`` without a traceback, naming each of ``names``."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{prog}: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _drop_dac_override():
    """In the child, as root: give up CAP_DAC_OVERRIDE, so that file modes hold for it too."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(24, 1, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE: gone from the exec'd program


@pytest.fixture(scope="module")
def modes_hold(tmp_path_factory):
    """A preexec_fn under which a mode-0444 file cannot be written (None: not needed), or skip."""
    if os.geteuid() != 0:
        return None
    probe = tmp_path_factory.mktemp("ro") / "probe"
    probe.write_text("x")
    probe.chmod(0o444)
    p = subprocess.run(
        [sys.executable, "-c", f"open({str(probe)!r}, 'a')"],
        preexec_fn=_drop_dac_override,
        capture_output=True,
        text=True,
    )
    if p.returncode == 0:
        pytest.skip("running as root and CAP_DAC_OVERRIDE cannot be dropped: file modes do not hold")
    return _drop_dac_override


# ---- phx bench -----------------------------------------------------------------------------------


def test_unknown_vendor(tmp_path):
    p = _run_cmd(PHX + ["bench", "--file", str(tmp_path / "b.bin"), *SMALL], env={"PHX_VENDOR": "nosuch"})
    assert_one_line(p, "phx bench", "'nosuch'", "PHX_VENDOR", "host")


def test_unusable_vendor(tmp_path):
    from phoenix import registry

    entry = registry.discover().get("nvidia")
    if entry is None or entry.probe().usable:
        pytest.skip("needs the nvidia vendor installed and unusable here")
    p = _run_cmd(PHX + ["bench", "--file", str(tmp_path / "b.bin"), *SMALL], env={"PHX_VENDOR": "nvidia"})
    assert_one_line(p, "phx bench", "PHX_VENDOR=nvidia", "cannot serve here", "PHX_VENDOR=auto")


def test_auto_where_not_even_the_host_fallback_can_serve(tmp_path):
    """PHX_VENDOR=auto, no accelerator, and the host vendor unable to serve (no host device): one
    line naming auto, the fallback and why, before any work (it was chosen, then failed to start)."""
    from phoenix import registry

    if any(n != "host" and e.probe().usable for n, e in registry.discover().items()):
        pytest.skip("an accelerator vendor is usable here: auto picks it")
    slab = tmp_path / "s.slab"
    p = _run_cmd(
        PHX + ["bench", "kv-trace", "--dry-run", "--slab", str(slab)], {"PHX_VENDOR": "auto", "PHX_HOST_DEVICES": "0"}
    )
    assert_one_line(p, "phx bench kv-trace", "PHX_VENDOR=auto", "the fallback 'host' cannot", "PHX_HOST_DEVICES=0")
    assert not list(tmp_path.iterdir())


def test_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "b.bin"
    p = _run_cmd(PHX + ["bench", "--file", str(path), *SMALL])
    assert_one_line(p, "phx bench", "--file", str(path.parent), "does not exist")


def test_file_is_a_directory(tmp_path):
    p = _run_cmd(PHX + ["bench", "--file", str(tmp_path), *SMALL])
    assert_one_line(p, "phx bench", "--file", "is a directory")


def test_read_only_directory(tmp_path, modes_hold):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        p = _run_cmd(PHX + ["bench", "--file", str(d / "b.bin"), *SMALL], preexec_fn=modes_hold)
    finally:
        d.chmod(0o755)
    assert_one_line(p, "phx bench", "--file", "cannot create", "read-only", "writable directory")


def test_read_only_bench_file_is_refused_before_any_work(tmp_path, modes_hold):
    """A file the bench made, made read-only since: a run that writes it is refused at once
    (not after its reads), naming --ops read; the file is left as it was."""
    path = tmp_path / "b.bin"
    p = _run_cmd(PHX + ["bench", "--file", str(path), "--ops", "read", *SMALL])
    assert p.returncode == 0, p.stderr
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    out = tmp_path / "b.json"
    p = _run_cmd(
        PHX + ["bench", "--file", str(path), "--ops", "read,write", "--json", str(out), *SMALL], preexec_fn=modes_hold
    )
    assert_one_line(p, "phx bench", "--file", "read-only", "--ops read")
    assert p.stdout == "" and not out.exists()
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


# ---- output destinations: checked before the run, not at its end -----------------------------------

KV_DRY = ["kv-trace", "--dry-run", "--configs", "dram,phoenix", "--concurrency", "1"]
# (prog, argv before the destination, the option, the work's first file: it must not appear)
DESTINATIONS = {
    "bench --json": ("phx bench", ["--file", "{work}", *SMALL], "--json"),
    "bench --plot": ("phx bench", ["--file", "{work}", *SMALL], "--plot"),
    "kv-trace --json": ("phx bench kv-trace", [*KV_DRY, "--slab", "{work}"], "--json"),
    "kv-trace --plot": ("phx bench kv-trace", [*KV_DRY, "--slab", "{work}"], "--plot"),
    "kv-trace gen --out": ("phx bench kv-trace gen", ["kv-trace", "gen", "--sessions", "2"], "--out"),
    "kv-trace plot --out": ("phx bench kv-trace plot", ["kv-trace", "plot", "{records}"], "--out"),
    "loader --json": (
        "phx bench loader",
        ["loader", "{work}", "--device", "cpu", "--make", "8M", "--reps", "1"],
        "--json",
    ),
    "loadlat --json": ("phx bench loadlat", ["loadlat", "--file", "{work}", "--size", "8M", "--block", "1M"], "--json"),
}


def _destination_case(tmp_path, case, dest):
    prog, argv, option = DESTINATIONS[case]
    records = tmp_path / "run.json"
    records.write_text(json.dumps([{"config": "dram", "concurrency": 1, "threshold_s": 5.0, "skipped": "not run"}]))
    work = tmp_path / "work.bin"
    argv = [a.format(work=work, records=records) for a in argv]
    return prog, PHX + ["bench", *argv, option, str(dest)], option, work


@pytest.mark.parametrize("case", list(DESTINATIONS))
@pytest.mark.parametrize("problem", ["no directory", "a directory"])
def test_output_destinations_are_checked_before_the_run(tmp_path, case, problem):
    dest = tmp_path / "no" / "such" / "out.x" if problem == "no directory" else tmp_path
    prog, cmd, option, work = _destination_case(tmp_path, case, dest)
    p = _run_cmd(cmd)
    words = [str(dest.parent), "does not exist"] if problem == "no directory" else ["is a directory"]
    assert_one_line(p, prog, option, *words)
    assert not work.exists() and not (tmp_path / "no").exists(), "work was done before the refusal"


@pytest.mark.parametrize("case", ["bench --json", "kv-trace gen --out"])
def test_output_destination_in_a_read_only_directory(tmp_path, modes_hold, case):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        prog, cmd, option, work = _destination_case(tmp_path, case, d / "out.x")
        p = _run_cmd(cmd, preexec_fn=modes_hold)
    finally:
        d.chmod(0o755)
    assert_one_line(p, prog, option, "read-only", "writable directory")
    assert not work.exists() and not list(d.iterdir())


def test_bad_chunk_size_setting(tmp_path):
    p = _run_cmd(PHX + ["bench", "--file", str(tmp_path / "b.bin"), *SMALL], env={"PHX_CHUNK_SIZE": "abc"})
    assert_one_line(p, "phx bench", "PHX_CHUNK_SIZE", "'abc'")
    assert not (tmp_path / "b.bin").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--ops", "raed"], ["--ops", "'raed'", "read, write, randread"]),
        (["--temperature", "hot"], ["--temperature", "'hot'", "cold, warm"]),
        (["--size", "abc"], ["--size", "'abc' is not a size", "64M"]),
        (["--chunk", "0"], ["--chunk", "more than 0"]),
        (["--threads", "1,x"], ["--threads", "'x'"]),
        (["--reps", "0"], ["--reps", "at least 1"]),
    ],
)
def test_bad_options_are_refused_in_one_line(argv, names):
    p = _run_cmd(PHX + ["bench", *argv])
    assert_one_line(p, "phx bench", *names, "phx bench --help")
    assert p.stdout == ""  # no empty table


@pytest.mark.parametrize(
    "argv,names",
    [
        (["--ops", "randread", "--qd", "99999999999999"], ["--qd", "between 1 and 1024", "a thread per read"]),
        (["--ops", "randread", "--qd", "2000"], ["--qd", "'2000'", "between 1 and 1024"]),
        (
            ["--ops", "randread", "--size", "1M", "--chunk", "1M", "--random-bs", "2M"],
            ["--random-bs 2097152", "larger than --size"],
        ),
        (["--ops", "randread", "--random-bs", "4097"], ["--random-bs", "'4097'", "4096-byte units", "4096 or 8192"]),
        (["--size", "-1G"], ["--size", "'-1G'", "cannot be negative"]),
        (["--chunk", "-4K"], ["--chunk", "'-4K'", "cannot be negative"]),
        (["--threads", "-1,2"], ["--threads", "'-1'", "at least 1"]),
        (["--size", "1000001"], ["--size", "'1000001'", "4096-byte units", "999424 or 1003520"]),
        (["--chunk", "3"], ["--chunk", "'3'", "multiple of 4096 between 4K and 1G", "chunk_size"]),
        (["--threads", "1,2000"], ["--threads", "'2000'", "between 1 and 1024"]),
        (["--sweep-threads", "4,5000"], ["--sweep-threads", "'5000'", "between 1 and 1024", "raw reference"]),
        (["--random-threads", "0"], ["--random-threads", "at least 1"]),
        (["--device", "-1"], ["--device", "'-1'", "0 or more"]),
        (["--chunk", "1G", "--size", "64M"], ["--chunk 1 GiB", "larger than --size 64 MiB", "at most --size"]),
        (["--size", "8M", "--chunk", "4M", "--threads", "4"], ["--threads 4", "2 chunks", "2 or fewer"]),
        (
            ["--size", "8M", "--chunk", "4M", "--threads", "1", "--sweep-chunks", "1M,16M"],
            ["--sweep-chunks 16 MiB", "--size 8 MiB"],
        ),
        (["--size", "100T"], ["--size 100 TiB", "device 0's memory", "lower --size"]),
        (["--device", "7"], ["--device 7", "vendor host has", "pick one of them"]),
    ],
)
def test_options_that_cannot_work_together_are_refused_before_any_work(tmp_path, argv, names):
    """Each said in one line naming the option and what is valid, when the command line is read:
    never the vendor's error, ``phoenix.settings.override``, or argparse's "expected one argument"
    for a negative value; a list's every item is checked before any of it runs."""
    p = _run_cmd(PHX + ["bench", "--file", str(tmp_path / "b.bin"), "--reps", "1", "--quiet", *argv])
    line = assert_one_line(p, "phx bench", *names)
    assert "phoenix.settings" not in line and "expected one argument" not in line and "phxh" not in line
    assert p.stdout == "" and not list(tmp_path.iterdir()), "work was done before the refusal"


def test_unknown_option_and_command():
    p = _run_cmd(PHX + ["bench", "--no-such-option"])
    assert_one_line(p, "phx", "unrecognized arguments", "--no-such-option")
    p = _run_cmd(PHX + ["bnech"])
    assert_one_line(p, "phx", "'bnech'", "info", "bench")


@pytest.mark.parametrize(
    "argv, prog, names",
    [
        (["--size", "1G", "loader", "{w}.safetensors", "--device", "cpu", "--make", "8M"], "phx bench", ["--size"]),
        (["--quiet", "--reps", "2", "loadlat", "--file", "{w}", "--size", "8M"], "phx bench", ["--quiet, --reps"]),
        (["--json", "{w}.json", "kv-trace", "--dry-run", "--slab", "{w}"], "phx bench", ["--json"]),
        (["kv-trace", "--sessions", "5", "gen", "--out", "{w}"], "phx bench kv-trace", ["--sessions"]),
        (["kv-trace", "--seed", "3", "plot", "{w}.json", "--out", "{w}"], "phx bench kv-trace", ["--seed"]),
    ],
)
def test_options_before_a_bench_subcommand_are_refused(tmp_path, argv, prog, names):
    """`phx bench --size 1G loader x`: --size is the throughput bench's, which does not run; it was
    ignored (the loader ran without it). Refused in one line naming it, before any work."""
    work = tmp_path / "w"
    argv = [a.format(w=work) for a in argv]
    sub = next(a for a in argv if a in ("loader", "loadlat", "kv-trace", "gen", "plot") and a != prog.split()[-1])
    p = _run_cmd(PHX + ["bench", *argv])
    assert_one_line(p, prog, *names, f"of '{prog}' itself", f"before the subcommand '{sub}'", f"after '{sub}'")
    assert not list(tmp_path.iterdir()), "work was done before the refusal"


def test_debug_shows_the_traceback(tmp_path):
    cmd = PHX + ["bench", "--file", str(tmp_path / "b.bin"), *SMALL]
    for extra, env in ((["--debug"], {}), ([], {"PHX_DEBUG": "1"})):
        p = _run_cmd(cmd + extra, env={"PHX_CHUNK_SIZE": "abc", **env})
        assert p.returncode != 0 and "Traceback" in p.stderr and "PHX_CHUNK_SIZE" in p.stderr, p.stderr


# ---- phx bench loader, kv-trace; phx info ---------------------------------------------------------


def test_loader_cuda_without_cuda(tmp_path):
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    except ImportError:
        pass
    p = _run_cmd(PHX + ["bench", "loader", str(tmp_path / "m.safetensors"), "--device", "cuda"])
    assert_one_line(p, "phx bench loader", "--device cuda", "no CUDA", "--device phx", "'host'", "--device cpu")


def test_loader_vendor_typo_is_not_ignored_for_host_memory(tmp_path):
    p = _run_cmd(
        PHX + ["bench", "loader", str(tmp_path / "m.safetensors"), "--device", "cpu"], env={"PHX_VENDOR": "hots"}
    )
    assert_one_line(p, "phx bench loader", "'hots'", "PHX_VENDOR")


def test_loader_missing_file_and_bad_device(tmp_path):
    p = _run_cmd(PHX + ["bench", "loader", str(tmp_path / "m.safetensors"), "--device", "cpu"])
    assert_one_line(p, "phx bench loader", "m.safetensors", "no such file", "--make")
    p = _run_cmd(PHX + ["bench", "loader", "m.safetensors", "--device", "gpu"])
    assert_one_line(p, "phx bench loader", "--device", "'gpu'", "cuda[:N]")


def test_python_m_phxloader_points_to_the_bench():
    p = _run_cmd([sys.executable, "-P", "-m", "phoenix.phxloader", "bench", "x.safetensors"])
    assert_one_line(p, "python -m phoenix.phxloader", "phx bench loader")


def test_kv_trace_mistakes(tmp_path):
    p = _run_cmd(PHX + ["bench", "kv-trace", "--configs", "dram,fast"])
    assert_one_line(p, "phx bench kv-trace", "--configs", "'fast'", "dram, staged, kvikio, phoenix")
    p = _run_cmd(PHX + ["bench", "kv-trace", "--dry-run", "--slab", str(tmp_path / "s")], env={"PHX_VENDOR": "nosuch"})
    assert_one_line(p, "phx bench kv-trace", "'nosuch'", "PHX_VENDOR")
    p = _run_cmd(PHX + ["bench", "kv-trace", "--trace", str(tmp_path / "none.jsonl")])
    assert_one_line(p, "phx bench kv-trace", "--trace", "no such file", "kv-trace gen")
    bad = {
        "int.jsonl": ("5\n", "a record is a JSON object"),
        "noin.jsonl": ('{"session":"a","round":0}\n', "no input_tokens"),
        "inf.jsonl": ('{"session":"a","round":0,"input_tokens":100,"think_s":Infinity}\n' * 2, "think_s=inf"),
        "dir": (None, "is a directory"),
    }
    for name, (text, words) in bad.items():
        path = tmp_path / name
        if text is None:
            path.mkdir()
        else:
            path.write_text(text)
        p = _run_cmd(PHX + ["bench", "kv-trace", "--dry-run", "--slab", str(tmp_path / "s"), "--trace", str(path)])
        assert_one_line(p, "phx bench kv-trace", str(path), words)


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--min-samples", "-1"], ["--min-samples", "'-1'", "at least 0"]),
        (["--min-samples", "many"], ["--min-samples", "'many'", "whole number"]),
        (["--max-duration", "0"], ["--max-duration", "more than 0"]),
        (["--stop-over", "0.5"], ["--stop-over", "'0.5'", "0 (off) or at least 1"]),
        (["--kvikio-threads", "0"], ["--kvikio-threads", "at least 1"]),
        (["--kvikio-task", "0"], ["--kvikio-task", "more than 0"]),
        (["--fast-device", "lots"], ["--fast-device", "'lots'", "not a size"]),
        (["--duration", "5", "--max-duration", "2"], ["--max-duration 2", "shorter than --duration 5"]),
        (["--hbm", "1e18"], ["--hbm", "more than the 4194304 a tier indexes"]),
        (["--hbm", "1e30"], ["--hbm", "'1e30'", "not a size"]),
        (["--ssd", "1000T"], ["--ssd", "more than the 4194304 a tier indexes"]),
        (["--seed", "-1"], ["--seed", "at least 0"]),
        (["--hidden", "-5"], ["--hidden", "at least 0"]),
        (["--warm-start", "1.5"], ["--warm-start", "'1.5'", "between 0 and 1"]),
        (["--warm-start", "-0.1"], ["--warm-start", "'-0.1'", "between 0 and 1"]),
        (["--warm-start", "nan"], ["--warm-start", "'nan'", "between 0 and 1"]),
    ],
)
def test_kv_trace_bad_option_values(tmp_path, extra, names):
    p = _run_cmd(PHX + ["bench", "kv-trace", "--dry-run", "--slab", str(tmp_path / "s"), *extra])
    assert_one_line(p, "phx bench kv-trace", *names)


def test_kv_trace_kvikio_where_it_cannot_run(tmp_path):
    try:
        import kvikio  # noqa: F401

        pytest.skip("kvikio is importable here")
    except ImportError:
        pass
    p = _run_cmd(PHX + ["bench", "kv-trace", "--dry-run", "--slab", str(tmp_path / "s"), "--configs", "kvikio"])
    assert_one_line(p, "phx bench kv-trace", "--configs kvikio", "kvikio is not importable", "install KvikIO")


def test_info_with_a_bad_engine_setting():
    p = _run_cmd(PHX + ["info"], env={"PHX_IO_ENGINE": "bogus"})
    assert_one_line(p, "phx info", "PHX_IO_ENGINE", "'bogus'", "io_uring")
    assert "vendors:" in p.stdout  # the report still comes, the reason last
    p = _run_cmd(PHX + ["info", "--json"], env={"PHX_IO_ENGINE": "bogus"})
    assert_one_line(p, "phx info", "PHX_IO_ENGINE")
    assert "PHX_IO_ENGINE" in json.loads(p.stdout)["io_error"]


def test_info_with_an_unknown_vendor():
    p = _run_cmd(PHX + ["info"], env={"PHX_VENDOR": "nosuch"})
    assert_one_line(p, "phx info", "'nosuch'", "PHX_VENDOR")


def test_info_is_readable():
    p = _run_cmd(PHX + ["info"])
    assert p.returncode == 0, p.stderr
    assert "{'" not in p.stdout and "GiB" in p.stdout, p.stdout  # no dict reprs; human sizes
    long_reasons = [ln.split(": ", 1)[1] for ln in p.stdout.splitlines() if ": " in ln and len(ln) > 90]
    assert len(long_reasons) == len(set(long_reasons)), "a long reason is printed twice"
    j = json.loads(_run_cmd(PHX + ["info", "--json"]).stdout)
    assert isinstance(j["io"]["settings"]["chunk_size"], int)  # exact bytes in JSON


# ---- phx --version, phx with no command ----------------------------------------------------------


def test_version():
    p = _run_cmd(PHX + ["--version"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["phx", importlib.metadata.version("phoenix-direct-storage")]


def test_no_command_prints_help_and_exits_2():
    p = _run_cmd(PHX)
    assert p.returncode == 2 and "usage: phx" in p.stderr and "Traceback" not in p.stderr


# ---- the runner, in process ----------------------------------------------------------------------


def test_runner_maps_errors_to_one_line(capsys):
    from phoenix.errors import UnknownVendorError

    def boom(exc):
        def fn():
            raise exc

        return fn

    assert _run.guarded("x", boom(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "x: interrupted\n"
    assert _run.guarded("x", boom(UnknownVendorError("nosuch", ["host"]))) == 2
    assert capsys.readouterr().err.startswith("x: unknown vendor 'nosuch'")
    assert _run.guarded("x", boom(ValueError("first\nsecond"))) == 2
    assert capsys.readouterr().err == "x: first second\n"
    assert _run.guarded("x", lambda: None) == 0 and _run.guarded("x", lambda: 3) == 3
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        _run.guarded("x", boom(RuntimeError("bug")))
    with pytest.raises(ValueError):
        _run.guarded("x", boom(ValueError("v")), debug=True)


def test_describe_names_a_file_once():
    assert _run.describe(FileNotFoundError(2, "No such file or directory", "/a/b")) == "/a/b: No such file or directory"
    assert (
        _run.describe(PermissionError(13, "cannot write /a/b: Permission denied", "/a/b"))
        == "cannot write /a/b: Permission denied"
    )
    assert _run.describe(KeyError("k")) == "k"


def test_take_debug_stops_at_double_dash(monkeypatch):
    monkeypatch.delenv("PHX_DEBUG", raising=False)
    assert _run.take_debug(["bench", "--debug", "--size", "1M"]) == (["bench", "--size", "1M"], True)
    assert _run.take_debug(["test", "host", "--", "--debug"]) == (["test", "host", "--", "--debug"], False)
    monkeypatch.setenv("PHX_DEBUG", "0")
    assert _run.take_debug(["info"]) == (["info"], False)
    monkeypatch.setenv("PHX_DEBUG", "1")
    assert _run.take_debug(["info"]) == (["info"], True)


def test_size_and_list_types():
    import argparse

    assert _run.size("64K") == 64 << 10 and _run.positive_size("1G") == 1 << 30
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        _run.size("abc")
    parse = _run.comma_list(["read", "write"])
    assert parse("read, write") == ["read", "write"]
    with pytest.raises(argparse.ArgumentTypeError, match="'raed' is not one of read, write"):
        parse("raed")
    assert _run.comma_list(item=_run.positive_int)("1,4,16") == [1, 4, 16]


# ---- the same refusals in the other benches -------------------------------------------------------


@pytest.mark.parametrize(
    "argv, prog, names",
    [
        (["loadlat", "--threads", "2000"], "phx bench loadlat", ["--threads", "'2000'", "between 1 and 1024"]),
        (["loadlat", "--size", "-1G"], "phx bench loadlat", ["--size", "cannot be negative"]),
        (["loadlat", "--device", "9"], "phx bench loadlat", ["--device 9", "vendor host has"]),
        (
            ["loadlat", "--size", "8M", "--block", "1M", "--write-size", "8M", "--write-chunk", "64M"],
            "phx bench loadlat",
            ["--write-chunk 64 MiB", "larger than --write-size 8 MiB"],
        ),
        (
            [
                "loader",
                "{w}.safetensors",
                "--make",
                "8M",
                "--device",
                "cpu",
                "--raw-sweep",
                "--sweep-threads",
                "4,2000",
            ],
            "phx bench loader",
            ["--sweep-threads", "'2000'", "between 1 and 1024"],
        ),
        (
            ["loader", "{w}.safetensors", "--make", "8M", "--device", "cpu", "--raw-sweep", "--sweep-chunks", "1M,3"],
            "phx bench loader",
            ["--sweep-chunks", "'3'", "multiple of 4096"],
        ),
        (
            ["loader", "{w}.safetensors", "--make", "8M", "--device", "phx:9"],
            "phx bench loader",
            ["--device phx:9", "vendor host has"],
        ),
        (["kv-trace", "--dry-run", "--slab", "{w}", "--device", "9"], "phx bench kv-trace", ["--device 9"]),
    ],
)
def test_other_benches_refuse_before_any_work(tmp_path, argv, prog, names):
    work = tmp_path / "w"
    argv = [a.format(w=work) for a in argv]
    if argv[0] == "loadlat":
        argv += ["--file", str(tmp_path / "l.bin"), "--write-file", str(tmp_path / "lw.bin")]
    p = _run_cmd(PHX + ["bench", *argv])
    assert_one_line(p, prog, *names)
    assert not list(tmp_path.iterdir()), "work was done before the refusal"


NO_MATPLOTLIB = [
    sys.executable,
    "-P",
    "-c",
    "import sys; sys.modules['matplotlib'] = None; from phoenix.cli.phx import main; sys.exit(main(sys.argv[1:]))",
]


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["--file", "{w}", *SMALL, "--plot", "{w}.png"], "phx bench"),
        (["kv-trace", "--dry-run", "--slab", "{w}", "--plot", "{w}.png"], "phx bench kv-trace"),
        (["kv-trace", "plot", "{w}.json", "--out", "{w}.png"], "phx bench kv-trace plot"),
    ],
)
def test_plot_without_matplotlib_is_refused_when_the_command_line_is_read(tmp_path, argv, prog):
    """Not after the run, with a note and exit status 0."""
    work = tmp_path / "w"
    argv = [a.format(w=work) for a in argv]
    p = _run_cmd(NO_MATPLOTLIB + ["bench", *argv])
    option = "--out" if "plot" in argv[:2] else "--plot"
    assert_one_line(p, prog, option, "matplotlib", "pip install")
    assert not list(tmp_path.iterdir()), "work was done before the refusal"


def test_help_lists_every_vendor_found():
    """``phx --help`` names PHX_VENDOR's values as discovery finds them (amd, a port on
    PHX_VENDOR_PATH), not a list written down."""
    from phoenix import registry

    p = _run_cmd(PHX + ["--help"])
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for name in registry.discover():
        assert name in text, (name, text)
