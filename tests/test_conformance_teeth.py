"""The conformance suite has teeth: each deliberately broken vendor is caught.

Every vendor under ``tests/broken_vendors/`` is the host vendor with one defect.
Each is run through ``phx-port test`` (found through ``PHX_VENDOR_PATH``, with two
host devices so multi-device defects show), and the capability that owns its defect
must fail, while discovery still passes (the defect is reported where it is, not as
a vendor that does not load). The unbroken host vendor, run the same way, passes.

The runs skip the 64 MiB copies (``-k "not 64mib"``): every defect shows at every
size, and those copies are the slowest part of the suite (test_port_cli runs them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BROKEN_DIR = Path(__file__).resolve().parent / "broken_vendors"


def phx_port_command() -> list[str]:
    """The installed ``phx-port`` script, else the same entry point without the cwd on sys.path.

    (``python -m`` from a source checkout would import the source tree, not the installed package.)
    """
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]


#: broken vendor -> the capability its defect must fail
DEFECTS = {
    "short_copy": "copies",
    "overrun_copy": "copies",
    "early_callback": "stream_ordering",
    "wrong_pointer_base": "pointer_queries",
    "wrong_pointer_device": "pointer_queries",
    "crash_on_double_free": "errors",
    "skip_stream_wait": "io_caller_stream",
}


def run_port_test(vendor: str, report_dir: Path) -> dict:
    env = dict(os.environ, PHX_VENDOR_PATH=str(BROKEN_DIR), PHX_HOST_DEVICES="2")
    env.pop("PHX_VENDOR", None)
    proc = subprocess.run(
        [*phx_port_command(), "test", vendor, "-q", "--report-dir", str(report_dir), "-k", "not 64mib"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report_path = report_dir / f"conformance-{vendor}.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr, "report": report}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """One phx-port test run per vendor (the host vendor and every broken one), two at a time."""
    names = ["host", *DEFECTS]
    dirs = {n: tmp_path_factory.mktemp(f"report-{n}") for n in names}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda n: run_port_test(n, dirs[n]), names)
        return dict(zip(names, results, strict=True))


def capabilities(run: dict) -> dict[str, dict]:
    assert run["report"] is not None, f"no JSON report written; output:\n{run['out'][-3000:]}"
    return {c["capability"]: c for c in run["report"]["capabilities"]}


def test_every_broken_vendor_is_listed():
    on_disk = sorted(p.name for p in BROKEN_DIR.iterdir() if (p / "runtime.py").exists())
    assert on_disk == sorted(DEFECTS), "each broken vendor needs its expected capability in DEFECTS"


def test_host_vendor_passes(runs):
    run = runs["host"]
    caps = capabilities(run)
    failing = {n: c["reason"] for n, c in caps.items() if c["result"] != "pass"}
    assert not failing, f"the host vendor does not pass: {failing}\n{run['out'][-3000:]}"
    assert run["rc"] == 0


@pytest.mark.parametrize("vendor", list(DEFECTS))
def test_broken_vendor_caught(runs, vendor):
    run = runs[vendor]
    caps = capabilities(run)
    expected = DEFECTS[vendor]
    assert caps[expected]["result"] == "fail", (
        f"{vendor}: its defect should fail {expected!r}, which says {caps[expected]['result']}; "
        f"table:\n{run['out'][-3000:]}"
    )
    assert caps["discovery"]["result"] == "pass", f"{vendor}: discovery failed: {caps['discovery']['reason']}"
    assert run["rc"] != 0, f"{vendor}: phx-port test exited 0 although {expected} failed"
    assert run["report"]["result"] == "fail"
    assert run["report"]["is_test_double"] is True


def test_defects_are_localised(runs):
    """Defects outside copies do not spill into unrelated capabilities."""
    for vendor in ("early_callback", "wrong_pointer_base", "crash_on_double_free"):
        caps = capabilities(runs[vendor])
        failing = {n for n, c in caps.items() if c["result"] == "fail"}
        assert failing == {DEFECTS[vendor]}, f"{vendor}: failing capabilities {sorted(failing)}"


def test_crash_is_reported_and_the_rest_still_runs(runs):
    report = runs["crash_on_double_free"]["report"]
    crashed = [c for c in report["crashes"] if c["nodeid"]]
    assert crashed, "the double free should have crashed the test process"
    assert "test_double_free" in crashed[0]["nodeid"] and "SIGSEGV" in crashed[0]["message"]
    caps = capabilities(runs["crash_on_double_free"])
    assert caps["errors"]["reason"].startswith("test_errors.py::test_double_free: crashed")
    # tests after the crash still ran, in a fresh process
    after = [t for t in report["tests"] if t["capability"] == "errors" and t["outcome"] == "passed"]
    assert len(after) >= 10, f"only {len(after)} errors tests passed: the run did not resume after the crash"
