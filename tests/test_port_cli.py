"""``phx-port``: test (capability table, JSON and Markdown report, exit status) and list."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phoenix import conformance

CAPS = list(conformance.CAPABILITIES)


def phx_port_command() -> list[str]:
    """The installed ``phx-port`` script, else the same entry point without the cwd on sys.path.

    (``python -m`` from a source checkout would import the source tree, not the installed package.)
    """
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]


def phx_port(*args: str, env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    env.pop("PHX_VENDOR", None)  # phx-port test sets it from its argument
    return subprocess.run([*phx_port_command(), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """The whole suite on the host vendor with two devices (so no multi-device test skips)."""
    report_dir = tmp_path_factory.mktemp("phx-report")
    proc = phx_port("test", "host", "--report-dir", str(report_dir), env_extra={"PHX_HOST_DEVICES": "2"})
    return proc, report_dir


def test_host_passes_every_capability(host_run):
    proc, _ = host_run
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("phoenix conformance: vendor host") :]
    assert "vendor host (test double): PASS" in table
    for cap in CAPS:
        row = next((line for line in table.splitlines() if line.startswith(cap + " ")), None)
        assert row is not None, f"no row for {cap} in:\n{table}"
        assert row.split()[1] == "pass", row


def test_json_report(host_run):
    proc, report_dir = host_run
    path = report_dir / "conformance-host.json"
    report = json.loads(path.read_text())
    assert report["vendor"] == "host"
    assert report["is_test_double"] is True
    assert report["result"] == "pass"
    assert report["command"].startswith("phx-port test host")
    for key in ("date", "host", "phoenix_version", "python", "platform"):
        assert report[key], key
    from phoenix import __version__

    assert report["phoenix_version"] == __version__
    caps = {c["capability"]: c for c in report["capabilities"]}
    assert list(caps) == CAPS
    assert all(c["result"] == "pass" and c["failed"] == 0 for c in caps.values()), caps
    # nothing skipped but the framework tests (torch, CuPy: not installed here, or no GPU)
    skipped = [t["test"] for t in report["tests"] if t["outcome"] == "skipped"]
    assert all("torch" in t or "cupy" in t for t in skipped), skipped
    assert report["totals"]["failed"] == 0
    assert report["totals"]["passed"] + report["totals"]["skipped"] == len(report["tests"])
    assert len(report["vendor_info"]["devices"]) == 2
    assert str(report_dir / "conformance-host.json") in proc.stdout


def test_markdown_report(host_run):
    _, report_dir = host_run
    md = (report_dir / "conformance-host.md").read_text()
    assert md.startswith("# Phoenix conformance report: `host`")
    assert "test double" in md and "phx-port test host" in md
    assert "| capability | result | tests | reason (first failure or skip) |" in md
    for cap in CAPS:
        assert f"| {cap} | pass |" in md


def test_keyword_quiet_engine(tmp_path):
    proc = phx_port("test", "host", "-q", "-k", "test_discovery", "--engine", "threads", "--report-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("phoenix conformance: vendor host"), "--quiet prints only the table"
    assert "partial run" in proc.stdout.splitlines()[0]
    report = json.loads((tmp_path / "conformance-host.json").read_text())
    assert [c["capability"] for c in report["capabilities"]] == ["discovery"]
    assert report["partial"] is True
    assert report["settings"]["PHX_IO_ENGINE"] == "threads" and report["settings"]["PHX_VENDOR"] == "host"


def test_pytest_args_pass_through(tmp_path):
    proc = phx_port("test", "host", "-q", "--report-dir", str(tmp_path), "--", "-k", "test_set_device")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "conformance-host.json").read_text())
    assert {t["test"].split("::")[1] for t in report["tests"] if t["outcome"] != "not run"} == {
        "test_set_device_each",
        "test_set_device_out_of_range",
    }


def test_failure_exits_nonzero_with_reason(tmp_path):
    broken = Path(__file__).resolve().parent / "broken_vendors"
    proc = phx_port(
        "test",
        "short_copy",
        "-q",
        "-k",
        "test_copy_sync and h2d",
        "--report-dir",
        str(tmp_path),
        env_extra={"PHX_VENDOR_PATH": str(broken)},
    )
    assert proc.returncode == 1
    row = next(line for line in proc.stdout.splitlines() if line.startswith("copies "))
    assert row.split()[1] == "fail" and "test_copy_sync" in row
    report = json.loads((tmp_path / "conformance-short_copy.json").read_text())
    assert report["result"] == "fail" and report["vendor"] == "short_copy"
    copies = next(c for c in report["capabilities"] if c["capability"] == "copies")
    assert "bytes wrong" in copies["reason"], copies["reason"]
    assert "## Failures" in (tmp_path / "conformance-short_copy.md").read_text()
    # -q's lines per reason count the failed tests, not those -k deselected ("not run")
    tail = proc.stdout.partition("\nfailures: ")[2]
    counts = [int(m) for m in re.findall(r"^ +(\d+) tests? ", tail, re.M)]
    assert counts and sum(counts) == sum(t["outcome"] == "failed" for t in report["tests"]), tail
    assert "not run" not in tail


HANGS = """
    import time

    from phoenix.vendors.host.runtime import Runtime as HostRuntime

    class Runtime(HostRuntime):
        name = "hangs"

        def __init__(self):
            super().__init__()
            self._destroyed = set()

        def stream_destroy(self, stream):
            super().stream_destroy(stream)
            self._destroyed.add(stream)

        def stream_synchronize(self, stream):
            if stream in self._destroyed:
                time.sleep(3600)  # waits on a stream that is gone, forever
            super().stream_synchronize(stream)
"""


def test_hung_test_is_stopped_and_the_run_resumes(tmp_path):
    (tmp_path / "vendors" / "hangs").mkdir(parents=True)
    (tmp_path / "vendors" / "hangs" / "runtime.py").write_text(textwrap.dedent(HANGS))
    proc = phx_port(
        "test",
        "hangs",
        "-q",
        "--test-timeout",
        "2",
        "--report-dir",
        str(tmp_path),
        "-k",
        "test_vendor_imports or test_destroyed_stream or test_never_created_stream",
        env_extra={"PHX_VENDOR_PATH": str(tmp_path / "vendors")},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "conformance-hangs.json").read_text())
    caps = {c["capability"]: c for c in report["capabilities"]}
    assert caps["discovery"]["result"] == "pass"
    assert caps["errors"]["result"] == "fail"
    assert caps["errors"]["reason"].startswith("test_errors.py::test_destroyed_stream: hung"), caps["errors"]
    outcome = {t["test"]: t["outcome"] for t in report["tests"] if t["outcome"] != "not run"}
    assert outcome["test_errors.py::test_never_created_stream"] == "passed", "the run did not resume"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e7", "soon"])
def test_test_timeout_out_of_range_is_refused_before_the_suite(tmp_path, monkeypatch, capsys, value):
    from phoenix.cli import port

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PHX_DEBUG", raising=False)
    report = tmp_path / "report"
    argv = ["test", "host", "-q", "-k", "test_vendor_imports", "--report-dir", str(report), "--test-timeout", value]
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        port.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, (exc.value.code, lines)
    assert lines[0].startswith(f"phx-port test: --test-timeout: '{value}'"), lines[0]
    assert "0 (no limit) to 1000000" in lines[0] or "not a number" in lines[0], lines[0]
    assert not report.exists(), "the suite ran"


def test_unknown_vendor(tmp_path):
    """The vendors there are, and how to make a port of that name: not advice to set
    PHX_VENDOR, which phx-port test sets itself from NAME."""
    from phoenix import registry

    for cmd in (["test", "nosuch", "--report-dir", str(tmp_path)], ["check", "nosuch"]):
        proc = phx_port(*cmd)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "'nosuch'" in lines[0] and "phx-port new nosuch" in lines[0] and "phx-port list" in lines[0]
        assert "PHX_VENDOR" not in lines[0].replace("PHX_VENDOR_PATH", ""), lines[0]
        for name in registry.discover():
            assert name in lines[0], (name, lines[0])
    assert not list(tmp_path.iterdir()), "no report for a vendor that does not exist"


def test_quiet_prints_the_table_and_a_line_per_reason(tmp_path):
    """A blank port fails nearly every test: -q prints the table and one line per distinct
    reason (with its count), not every traceback (the guide shows a table)."""
    d = tmp_path / "ports"
    assert phx_port("new", "blank", "--vendors-dir", str(d)).returncode == 0
    proc = phx_port("test", "blank", "-q", "--report-dir", str(tmp_path / "r"), env_extra={"PHX_VENDOR_PATH": str(d)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    out = proc.stdout
    assert out.startswith("phoenix conformance: vendor blank: FAIL"), out[:500]
    assert "Traceback" not in out and 'File "' not in out
    report = json.loads((tmp_path / "r" / "conformance-blank.json").read_text())
    failed = [t for t in report["tests"] if t["outcome"] == "failed"]
    assert len(failed) > 100
    head, _, tail = out.partition("\nfailures: ")
    assert all(f"{c['capability']} " in head for c in report["capabilities"])
    reasons = [ln for ln in tail.splitlines()[1:] if re.match(r" +\d+ tests? ", ln)]
    assert tail.split()[0] == str(len(reasons)) and 1 <= len(reasons) < 40
    assert sum(int(ln.split()[0]) for ln in reasons) == len(failed)
    assert "does not implement device_alloc()" in tail and "runtime.py:" in tail
    assert len(out.splitlines()) < len(report["capabilities"]) + len(reasons) + 20
    assert str(tmp_path / "r" / "conformance-blank.md") in out


def test_report_dir_where_no_file_can_be_made_is_refused_before_the_suite_runs(tmp_path):
    """/proc: a directory its mode says is writable for root, where no file can be made: found
    by making one, when the command line is read."""
    proc = phx_port("test", "host", "-q", "--report-dir", "/proc", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr)
    assert "--report-dir" in lines[0] and "/proc" in lines[0] and "writable directory" in lines[0], lines[0]
    assert "passed" not in proc.stdout


def test_list():
    proc = phx_port("list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["vendor", "source", "available", "reason"]
    rows = {line.split()[0]: line for line in lines[2:] if line.strip()}
    assert "in-tree" in rows["host"] and "yes (test double)" in rows["host"]
    for name, row in rows.items():
        assert len(row.split()) >= 4, f"{name}: no reason given: {row!r}"


def test_help_texts():
    top = phx_port("--help")
    assert top.returncode == 0 and "test" in top.stdout and "list" in top.stdout
    test = phx_port("test", "--help")
    assert test.returncode == 0
    for word in ("--report-dir", "conformance-NAME.json", "-k", "--quiet", "--engine", "PYTEST_ARGS", "test double"):
        assert word in test.stdout, word
    lst = phx_port("list", "--help")
    assert lst.returncode == 0 and "PHX_VENDOR_PATH" in lst.stdout


def test_no_command_is_a_usage_error():
    proc = phx_port()
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_report_dir_refused_before_the_suite_runs(tmp_path, where):
    """``--report-dir`` that cannot be a directory is refused when the command line is read
    (exit 2, one line naming it), not after the suite has run for minutes."""
    f = tmp_path / "report.txt"
    f.write_text("not a directory")
    dest = f if where == "a file" else f / "reports"
    proc = phx_port("test", "host", "-q", "--report-dir", str(dest), timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr)
    assert "--report-dir" in lines[0] and str(dest) in lines[0] and "is a file" in lines[0], lines[0]
    assert "passed" not in proc.stdout and f.read_text() == "not a directory"
