"""The conformance suite's I/O capabilities on the host vendor, with each I/O engine.

``phx-port test host --engine io_uring`` and ``--engine threads`` (the installed
script, in a child process, as CI runs it): every ``io_*`` capability passes, the
tests of the selected engine ran and passed, and those of the other engine were
skipped saying why. And the I/O capabilities have teeth: vendors built here with one
defect in the data-path table the I/O core uses (a host callback that runs at launch,
a copy that drops its last byte) fail ``io_stream_ordering`` and ``io_roundtrip``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phoenix import conformance

IO_CAPS = [c for c in conformance.CAPABILITIES if c.startswith("io_")]
ENGINES = ("io_uring", "threads")


def phx_port_command() -> list[str]:
    """The installed ``phx-port`` script, else the same entry point without the cwd on sys.path."""
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]


def phx_port_test(vendor: str, report_dir: Path, *args: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    for var in ("PHX_VENDOR", "PHX_IO_ENGINE", "PHX_MODE"):  # the run's own choices only
        env.pop(var, None)
    proc = subprocess.run(
        [*phx_port_command(), "test", vendor, "-q", "--report-dir", str(report_dir), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    path = report_dir / f"conformance-{vendor}.json"
    report = json.loads(path.read_text()) if path.exists() else None
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr, "report": report}


def io_uring_available() -> tuple[bool, str]:
    code = "import json, phoenix.io as p; print(json.dumps(p.capabilities()['engines']['io_uring']))"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; del sys.path[0]; " + code], capture_output=True, text=True, timeout=120
    )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    return info["available"], info["why"]


def test_io_capabilities_are_listed():
    assert IO_CAPS == [
        "io_roundtrip",
        "io_unaligned",
        "io_large_offsets",
        "io_eof",
        "io_concurrency",
        "io_stream_ordering",
        "io_caller_stream",
        "io_extents",
        "io_errors",
    ]


@pytest.fixture(scope="module", params=ENGINES)
def engine_run(request, tmp_path_factory):
    engine = request.param
    if engine == "io_uring":
        ok, why = io_uring_available()
        if not ok:
            pytest.skip(f"io_uring is not available here: {why}")
    report_dir = tmp_path_factory.mktemp(f"io-{engine}")
    return engine, phx_port_test("host", report_dir, "--engine", engine, "-k", "test_io or test_caller_stream")


def test_host_passes_every_io_capability(engine_run):
    engine, run = engine_run
    out = run["out"]
    assert run["report"] is not None, f"no JSON report written; output:\n{out[-3000:]}"
    caps = {c["capability"]: c for c in run["report"]["capabilities"]}
    failing = {n: c["reason"] for n, c in caps.items() if c["result"] != "pass"}
    assert not failing, f"--engine {engine}: {failing}\n{out[-3000:]}"
    assert run["rc"] == 0, out[-3000:]
    assert list(caps) == IO_CAPS, f"capabilities reported: {list(caps)}"
    for cap in IO_CAPS:
        assert caps[cap]["failed"] == 0 and caps[cap]["passed"] > 0, caps[cap]
        row = next((line for line in out.splitlines() if line.startswith(cap + " ")), None)
        assert row is not None and row.split()[1] == "pass", row or f"no row for {cap}:\n{out}"
    assert run["report"]["settings"]["PHX_IO_ENGINE"] == engine


def test_only_the_selected_engine_runs(engine_run):
    engine, run = engine_run
    other = next(e for e in ENGINES if e != engine)
    tests = [t for t in run["report"]["tests"] if t["capability"] in IO_CAPS]
    assert tests
    for t in tests:
        if f"[{engine}" in t["test"]:
            framework = "torch" in t["test"] or "cupy" in t["test"]  # skips here: not installed, or no GPU
            assert t["outcome"] == "passed" or (framework and t["outcome"] == "skipped"), t
        else:
            assert f"[{other}" in t["test"], f"{t['test']}: an I/O test not parametrized by engine"
            assert t["outcome"] == "skipped" and f"selects the {engine} engine" in t["message"], t


#: broken vendors built here: the host vendor with one defect in the C data-path table
#: the I/O core uses (the Python runtime methods stay right, so only I/O shows it)
BROKEN_C = {
    "early_io_callback": (
        "launch_host_func",
        "int broken(void *stream, void (*fn)(void *), void *arg) { (void)stream; fn(arg); return 0; }\n",
    ),
    "short_io_copy": (
        "memcpy_async",
        "#include <stddef.h>\n"
        "int (*phx_orig)(void *, const void *, size_t, int, void *);\n"
        "int broken(void *dst, const void *src, size_t n, int kind, void *stream)\n"
        "{ return phx_orig(dst, src, n ? n - 1 : 0, kind, stream); }\n",
    ),
}

BROKEN_RUNTIME = textwrap.dedent('''\
    """BROKEN ON PURPOSE (built by tests/test_conformance_io.py): the data-path entry
    {field} is replaced by a defective C function (see broken.c)."""
    import ctypes
    import os

    from phoenix.vendor import DataPathTable
    from phoenix.vendors.host.runtime import Runtime as HostRuntime

    _LIB = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libbroken.so"))


    class Runtime(HostRuntime):
        name = "{name}"
        runtime_description = "BROKEN test vendor: defective data-path {field}"

        def data_path(self):
            table = DataPathTable.from_buffer_copy(super().data_path())
            if hasattr(_LIB, "phx_orig"):
                ctypes.c_void_p.in_dll(_LIB, "phx_orig").value = table.{field}
            table.{field} = ctypes.cast(_LIB.broken, ctypes.c_void_p).value
            return table
    ''')

#: broken vendor -> (-k selecting a few tests, the capability that must fail)
DEFECTS = {
    # callbacks at launch: the gate runs in the caller and work behind it runs early
    "early_io_callback": ("test_io_keeps_order_with_callbacks and auto", "io_stream_ordering"),
    # staged copies drop their last byte
    "short_io_copy": ("test_roundtrip and staged", "io_roundtrip"),
}


@pytest.mark.parametrize("vendor", list(DEFECTS))
def test_broken_data_path_is_caught(tmp_path, vendor):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to build the broken vendor's data-path function")
    field, source = BROKEN_C[vendor]
    vdir = tmp_path / "vendors" / vendor
    vdir.mkdir(parents=True)
    (vdir / "broken.c").write_text(source)
    subprocess.run(
        [cc, "-O1", "-shared", "-fPIC", "-o", str(vdir / "libbroken.so"), str(vdir / "broken.c")],
        check=True,
        capture_output=True,
    )
    (vdir / "runtime.py").write_text(BROKEN_RUNTIME.format(name=vendor, field=field))
    keyword, capability = DEFECTS[vendor]
    run = phx_port_test(
        vendor,
        tmp_path / "report",
        "--engine",
        "threads",
        "-k",
        keyword,
        env_extra={"PHX_VENDOR_PATH": str(tmp_path / "vendors")},
    )
    assert run["report"] is not None, f"no JSON report written; output:\n{run['out'][-3000:]}"
    caps = {c["capability"]: c for c in run["report"]["capabilities"]}
    assert caps[capability]["result"] == "fail", f"{vendor}: {caps[capability]}\n{run['out'][-3000:]}"
    assert "AssertionError" in caps[capability]["reason"], caps[capability]["reason"]  # caught, not crashed
    assert run["rc"] != 0
