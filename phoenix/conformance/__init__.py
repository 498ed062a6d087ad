"""The conformance suite: one pytest suite that every vendor port must pass.

Control plane, test side. It ships inside the package so that an out-of-tree port
runs it as it is: ``phx-port test <name>`` (see :func:`run_suite`), or by hand with
``pytest -p phoenix.conformance.plugin --phx-vendor <name> --pyargs phoenix.conformance``.

Each test carries one capability marker (``@pytest.mark.capability("copies")``);
the report is a table of capabilities, each pass, fail or skip (with the reason
of its first failure or skip). The capabilities, in the order they run and print:

========================  ==========================================================
discovery                 probe, devices (ordinal, name, PCI bus id, memory), set_device
memory                    device alloc/free: sizes, alignment, many allocations, every device
host_registration         pin existing host memory, pinned alloc/free, refusals
copies                    four typed directions, sync and on a stream, 1 B..64 MiB, every byte
streams                   create / synchronize / destroy, many streams, the default stream
host_callback             LaunchHostFunc runs a C function pointer once, with its argument
stream_ordering           work runs in stream order; a callback sees earlier work finished
                          and holds back later work; streams do not wait for each other
pointer_queries           device (ordinal, allocation base and size), pinned and plain host
data_path_table           the raw C entry points the I/O core calls without the GIL
errors                    bad and freed pointers, double free, zero and absurd sizes, wrong
                          directions, destroyed streams: VendorError, never a crash
========================  ==========================================================

``phx-port test <name> --emulated`` runs the same suite against an emulated runtime
(:mod:`phoenix.emulator`: a test double built with the port's prefix and library name);
its report carries ``emulated`` (what was built) and is marked "emulated runtime"
in the table, the JSON and the Markdown, written as ``conformance-<name>-emulated.*``.

Adding a capability (the I/O issues add theirs) is adding a ``test_<topic>.py``
module here whose tests carry the new marker, and a line in :data:`CAPABILITIES`
(which only orders and describes them: a marker missing from it still reports).
Test modules use the fixtures and helpers of :mod:`phoenix.conformance.plugin`
and nothing outside the package.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

#: capability -> what it covers (run and report order)
CAPABILITIES: dict[str, str] = {
    "discovery": "probe, devices (ordinal, name, PCI bus id, memory size), set_device",
    "memory": "device memory alloc/free: sizes, alignment, many allocations, every device",
    "host_registration": "register/unregister existing host memory, pinned alloc/free, refusals",
    "copies": "typed copies (H2D, D2H, D2D, H2H), sync and on a stream, 1 B..64 MiB, every byte checked",
    "streams": "stream create/synchronize/destroy, many streams, the default stream",
    "host_callback": "LaunchHostFunc: a C function pointer runs once, in order, with its argument",
    "stream_ordering": "a callback sees earlier work finished and holds back later work; streams are independent",
    "pointer_queries": "device (ordinal, allocation base and size), pinned and plain host, freed memory",
    "data_path_table": "raw C entry points for the I/O core: ABI version, required fields, callable",
    "errors": "bad/freed pointers, double free, zero/absurd sizes, wrong direction, destroyed stream",
    "io_roundtrip": "file <-> device memory in each I/O engine and mode (futures, batches, host memory, every device)",
    "io_unaligned": "unaligned file offsets, buffer offsets and sizes; the file around an extent survives",
    "io_large_offsets": "sparse files: extents at and beyond 4 GiB, holes read as zeros",
    "io_eof": "short reads at end of file return the count; bytes beyond it untouched",
    "io_concurrency": "reads and writes from several threads at once, checked against a reference",
    "io_stream_ordering": "read_async/write_async keep stream order with copies and host callbacks",
    "io_caller_stream": "blocking calls and futures run after work queued on the caller's stream (raw handles, "
    "default and side streams, torch and CuPy current streams)",
    "io_extents": "an extent past its allocation: EFAULT, nothing written; past a registration into valid memory: served (guards checked)",
    "io_errors": "closed file, wrong open mode, ENOSPC, bad arguments: PhxIOError naming file, offset, length",
}

#: how many crashed or hung tests a run steps over before it gives up
MAX_CRASHES = 8
REPORT_SCHEMA = 1


def suite_dir() -> str:
    """Directory of the suite's test modules (inside the installed package)."""
    return os.path.dirname(os.path.abspath(__file__))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def run_suite(
    vendor: str,
    *,
    pytest_args: list[str] | tuple[str, ...] = (),
    keyword: str | None = None,
    quiet: bool = False,
    test_timeout: float | None = None,
    env: dict | None = None,
    workdir: str | None = None,
) -> dict:
    """Run the suite against ``vendor`` in a child process; return the results.

    The child is ``python -m pytest`` with the plugin; it records every test as it
    starts and ends. When the child dies inside a test (a crash in the vendor's C
    code, or a hang stopped by the watchdog) that test is recorded as failed with
    the cause and the run resumes after it, so one segfault does not hide the rest.

    Returns a dict with ``events`` (the plugin's records), ``crashes``, ``exit_codes``,
    ``output`` (the child's output when ``quiet``) and ``duration_s``; see
    :func:`build_report`.
    """
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="phx-conformance-")
    results = os.path.join(workdir, "results.jsonl")
    open(results, "w").close()
    # an ini file of our own: the suite runs the same whatever pytest configuration
    # (addopts, conftest.py files) the directory it is run from has
    ini = os.path.join(workdir, "pytest.ini")
    with open(ini, "w") as fh:
        fh.write("[pytest]\n")
    sdir = suite_dir()
    # `python -m pytest` would put the working directory first on sys.path: run from a
    # source checkout, that shadows the installed phoenix (its vendors, its C core)
    cmd = [
        sys.executable,
        "-c",
        "import sys; del sys.path[0]; import pytest; sys.exit(pytest.main())",
        "-c",
        ini,
        "--rootdir",
        sdir,
        "--confcutdir",
        sdir,
        "-p",
        "phoenix.conformance.plugin",
        "-p",
        "no:cacheprovider",
        "--phx-vendor",
        vendor,
        "--phx-results",
        results,
        "-rfE",
        # Python's own tracebacks: as clear here, and a third of the cost of pytest's
        # when a broken port fails hundreds of tests (a later --tb in pytest_args wins)
        "--tb=native",
    ]
    if quiet:
        cmd.append("-q")
    if keyword:
        cmd += ["-k", keyword]
    if test_timeout is not None:
        cmd += ["--phx-test-timeout", str(test_timeout)]
    cmd += list(pytest_args)
    cmd.append(sdir)
    child_env = dict(os.environ if env is None else env)
    child_env["PHX_VENDOR"] = vendor

    t0 = time.monotonic()
    crashes: list[dict] = []
    exit_codes: list[int] = []
    output: list[str] = []
    while True:
        argv = cmd[:-1] + (["--phx-resume"] if exit_codes else []) + cmd[-1:]
        proc = subprocess.run(
            argv,
            env=child_env,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
            text=True,
            errors="replace",
        )
        exit_codes.append(proc.returncode)
        if quiet:
            output.append(proc.stdout or "")
        events = read_events(results)
        if any(ev.get("event") == "finish" for ev in events[_last_session(events) :]):
            break
        # the child died before the end of the session: inside which test?
        finished = {ev["nodeid"] for ev in events if ev.get("event") == "result"}
        started = [ev for ev in events if ev.get("event") == "start" and ev["nodeid"] not in finished]
        if not started:
            crashes.append(
                {
                    "nodeid": None,
                    "message": f"the test process ended outside any test ({_describe_exit(proc.returncode)})",
                }
            )
            break
        ev = started[-1]
        elapsed = time.time() - ev.get("t", time.time())
        hung = ev.get("timeout") and elapsed >= ev["timeout"] - 0.5
        cause = (
            f"hung: still running after {ev['timeout']:g} s, stopped by the watchdog"
            if hung
            else f"crashed: the test process died ({_describe_exit(proc.returncode)})"
        )
        message = f"{cause}; later tests ran in a fresh process"
        crashes.append(
            {"nodeid": ev["nodeid"], "capability": ev.get("capability"), "message": message, "exit": proc.returncode}
        )
        with open(results, "a") as fh:  # so the resumed run deselects it
            fh.write(
                json.dumps(
                    {
                        "event": "result",
                        "nodeid": ev["nodeid"],
                        "outcome": "failed",
                        "message": message,
                        "duration": elapsed,
                    }
                )
                + "\n"
            )
        if len(crashes) > MAX_CRASHES:
            crashes.append(
                {
                    "nodeid": None,
                    "message": f"gave up after {len(crashes)} crashed or hung tests; the tests after them did not run",
                }
            )
            break
    events = read_events(results)
    if own_dir:
        try:
            for name in os.listdir(workdir):
                os.unlink(os.path.join(workdir, name))
            os.rmdir(workdir)
        except OSError:
            pass
    return {
        "events": events,
        "crashes": crashes,
        "exit_codes": exit_codes,
        "output": "".join(output),
        "duration_s": round(time.monotonic() - t0, 3),
        "argv": cmd,
    }


def read_events(path: str) -> list[dict]:
    """The events of a ``--phx-results`` file (a torn last line is ignored)."""
    events = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return events


def _last_session(events: list[dict]) -> int:
    idx = [i for i, ev in enumerate(events) if ev.get("event") == "session"]
    return idx[-1] if idx else 0


def _strip_nodeid(nodeid: str) -> str:
    """``phoenix/conformance/test_copies.py::x`` -> ``test_copies.py::x``."""
    path, sep, rest = nodeid.partition("::")
    return os.path.basename(path) + sep + rest


def build_report(
    vendor: str,
    run: dict,
    *,
    command: str = "",
    is_test_double: bool | None = None,
    vendor_info: dict | None = None,
    settings: dict | None = None,
    emulated: dict | None = None,
) -> dict:
    """The capability report of one run (what is written as JSON and rendered as a table).

    ``emulated`` (``phx-port test --emulated``) describes the emulated runtime the vendor
    was pointed at (:meth:`phoenix.emulator.Emulator.describe`): the report is then
    marked "emulated runtime (test double)", and fails if the vendor bound another library.
    """
    from phoenix import __version__

    events = run["events"]
    capability_of: dict[str, str] = {}
    for ev in events:
        if ev.get("event") == "collected":
            for t in ev["tests"]:
                capability_of[t["nodeid"]] = t["capability"] or "uncategorized"
        elif ev.get("event") == "start":
            capability_of.setdefault(ev["nodeid"], ev.get("capability") or "uncategorized")
    results: dict[str, dict] = {}
    for ev in events:
        if ev.get("event") == "result":
            results[ev["nodeid"]] = ev
    info = dict(vendor_info or {})
    for ev in events:
        if ev.get("event") == "vendor":
            info.update({k: v for k, v in ev.items() if k != "event"})
    errors = [ev["message"] for ev in events if ev.get("event") == "error"]
    if emulated:
        errors += _emulation_errors(info, emulated)

    tests = []
    for nodeid, cap in capability_of.items():
        res = results.get(nodeid)
        tests.append(
            {
                "test": _strip_nodeid(nodeid),
                "capability": cap,
                "outcome": res["outcome"] if res else "not run",
                "message": (res or {}).get("message", ""),
                "duration_s": round((res or {}).get("duration", 0.0), 4),
                **({"details": res["longrepr"]} if res and res.get("longrepr") else {}),
            }
        )
    ran = [t for t in tests if t["outcome"] != "not run"]

    names = list(CAPABILITIES) + sorted({t["capability"] for t in ran} - set(CAPABILITIES))
    caps = []
    for name in names:
        mine = [t for t in ran if t["capability"] == name]
        if not mine:
            continue  # deselected (-k) or not collected
        count = {o: sum(t["outcome"] == o for t in mine) for o in ("passed", "failed", "skipped")}
        failed = [t for t in mine if t["outcome"] == "failed"]
        skipped = [t for t in mine if t["outcome"] == "skipped"]
        if failed:
            result, first = "fail", failed[0]
        elif count["passed"]:
            result, first = "pass", (skipped[0] if skipped else None)
        else:
            result, first = "skip", skipped[0]
        reason = (
            f"{first['test']}: {first['message']}" if first and result == "fail" else (first or {}).get("message", "")
        )
        caps.append(
            {
                "capability": name,
                "description": CAPABILITIES.get(name, ""),
                "result": result,
                "tests": len(mine),
                **count,
                "reason": reason,
            }
        )

    crashed_outside = [c for c in run.get("crashes", []) if c.get("nodeid") is None]
    if not ran:
        errors.append("no test ran: nothing was collected, or -k / the pytest arguments deselected everything")
    totals = {o: sum(t["outcome"] == o for t in ran) for o in ("passed", "failed", "skipped")}
    totals["selected"], totals["suite"] = len(ran), len(tests)
    ok = bool(caps) and not any(c["result"] == "fail" for c in caps) and not errors and not crashed_outside
    if is_test_double is None:
        is_test_double = bool(info.get("is_test_double", False))
    return {
        "schema": REPORT_SCHEMA,
        "vendor": vendor,
        "is_test_double": bool(is_test_double or emulated),
        #: the emulated runtime the suite ran against (None: the vendor's own runtime)
        "emulated": dict(emulated) if emulated else None,
        "vendor_info": info,
        "result": "pass" if ok else "fail",
        "partial": len(ran) < len(tests),  #: -k or pytest arguments left tests out
        "command": command,
        "settings": dict(settings or {}),  #: the PHX_* environment of the run
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "phoenix_version": __version__,
        "duration_s": run.get("duration_s"),
        "pytest_argv": run.get("argv", []),
        "errors": errors + [c["message"] for c in crashed_outside],
        "crashes": run.get("crashes", []),
        "totals": totals,
        "capabilities": caps,
        "tests": tests,
    }


def _emulation_errors(info: dict, emulated: dict) -> list[str]:
    """An emulated run must have run against the emulator: the vendor has to have bound it."""
    if "name" not in info:  # no runtime was created: the suite's own failures say why
        return []
    bound = info.get("library")
    if not bound:
        return [
            f"--emulated: cannot tell which runtime library vendor {info['name']!r} bound (its runtime has "
            f"no shim `rt` with a `library`): the report cannot show the emulator was used"
        ]
    if os.path.realpath(bound) != os.path.realpath(emulated["library"]):
        return [
            f"--emulated: vendor {info['name']!r} bound {bound}, not the emulated runtime "
            f"{emulated['library']}: it does not honour {emulated.get('via') or 'the environment it was given'}"
        ]
    return []


def _emulated_line(report: dict) -> str | None:
    emu = report.get("emulated")
    if not emu:
        return None
    return (
        f"runtime: {emu.get('label', 'emulated runtime (test double)')}: {emu.get('library_name')} "
        f"(prefix {emu.get('prefix')}) built from {os.path.basename(emu.get('source', 'hostrt.c'))}, "
        f"not the vendor's runtime or hardware"
    )


def _cell(text: str, width: int = 0) -> str:
    text = " ".join(str(text).split())
    return text if not width or len(text) <= width else text[: width - 3] + "..."


def _counts(c: dict) -> str:
    parts = [f"{c['passed']}/{c['tests']} passed"]
    if c["failed"]:
        parts.append(f"{c['failed']} failed")
    if c["skipped"]:
        parts.append(f"{c['skipped']} skipped")
    return ", ".join(parts)


def format_table(report: dict, width: int = 110) -> str:
    """The capability table for a terminal."""
    rows = [("capability", "result", "tests", "reason (first failure or skip)")]
    for c in report["capabilities"]:
        reason = re.sub(r"^[\w.]+\.py::", "", c["reason"])  # the test's name is enough here
        rows.append((c["capability"], c["result"], _counts(c), _cell(reason, width)))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w) + "  " + "-" * 30)
    double = (
        " (emulated runtime, test double)"
        if report.get("emulated")
        else " (test double)"
        if report["is_test_double"]
        else ""
    )
    t = report["totals"]
    partial = f" (partial run: {t['selected']} of {t['suite']} tests)" if report.get("partial") else ""
    head = f"phoenix conformance: vendor {report['vendor']}{double}: {report['result'].upper()}{partial}"
    emulated = _emulated_line(report)
    tail = f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in {report['duration_s']} s"
    extra = [f"error: {e}" for e in report["errors"]]
    return "\n".join([head, *([emulated] if emulated else []), "", *lines, "", tail, *extra])


def format_markdown(report: dict) -> str:
    """The report as Markdown (a table of capabilities, then the failures in full)."""
    esc = lambda s: _cell(s).replace("|", "\\|")  # noqa: E731
    emulated = _emulated_line(report)
    out = [
        f"# Phoenix conformance report: `{report['vendor']}`" + (" (emulated runtime)" if emulated else ""),
        "",
        *([f"> **{esc(emulated)}**", ""] if emulated else []),
        f"- result: **{report['result'].upper()}**"
        + (
            f" (partial run: {report['totals']['selected']} of {report['totals']['suite']} tests)"
            if report.get("partial")
            else ""
        ),
        f"- vendor: `{report['vendor']}`"
        + (" (**test double**: not real hardware)" if report["is_test_double"] else ""),
    ]
    info = report.get("vendor_info") or {}
    if info.get("runtime_description"):
        out.append(f"- runtime: {esc(info['runtime_description'])}")
    if isinstance(info.get("devices"), list):
        out.append(
            f"- devices: {len(info['devices'])}: "
            + ", ".join(
                esc(f"{d.get('ordinal')}: {d.get('name')} ({d.get('pci_bus_id')})")
                for d in info["devices"]
                if isinstance(d, dict)
            )
        )
    out += [
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- host: {report['host']} ({report['platform']}, Python {report['python']})",
        f"- phoenix version: {report['phoenix_version']}",
        *(
            [f"- settings: {esc(' '.join(f'{k}={v}' for k, v in report['settings'].items()))}"]
            if report.get("settings")
            else []
        ),
        f"- tests: {report['totals']['passed']} passed, {report['totals']['failed']} failed, "
        f"{report['totals']['skipped']} skipped in {report['duration_s']} s",
        "",
        "| capability | result | tests | reason (first failure or skip) |",
        "| --- | --- | --- | --- |",
    ]
    for c in report["capabilities"]:
        out.append(f"| {c['capability']} | {c['result']} | {_counts(c)} | {esc(c['reason'])} |")
    for e in report["errors"]:
        out += ["", f"**error:** {esc(e)}"]
    failed = [t for t in report["tests"] if t["outcome"] == "failed"]
    if failed:
        out += ["", "## Failures", ""]
        for t in failed:
            out += [f"### `{t['test']}` ({t['capability']})", "", esc(t["message"]), ""]
            if t.get("details"):
                out += ["```", t["details"].rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def report_paths(report_dir: str, vendor: str, emulated: bool = False) -> tuple[str, str]:
    """``conformance-<vendor>`` (``-emulated`` for an emulated run, never mistaken for hardware's)."""
    base = os.path.join(report_dir, f"conformance-{vendor}" + ("-emulated" if emulated else ""))
    return base + ".json", base + ".md"


def write_report(report: dict, report_dir: str) -> tuple[str, str]:
    """Write ``conformance-<vendor>[-emulated].json`` and ``.md`` into ``report_dir``; return their paths."""
    os.makedirs(report_dir, exist_ok=True)
    json_path, md_path = report_paths(report_dir, report["vendor"], bool(report.get("emulated")))
    with open(json_path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
        fh.write("\n")
    with open(md_path, "w") as fh:
        fh.write(format_markdown(report))
    return json_path, md_path
