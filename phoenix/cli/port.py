"""``phx-port``: the porter's command. Scaffold a port, check it, run the conformance suite, list vendors.

Core side, control plane. A port is ``vendors/<name>/runtime.py`` (in-tree), a package in the
``phoenix.vendors`` entry-point group, or a directory on ``PHX_VENDOR_PATH``::

    phx-port new <name> --like cuda --prefix mc --lib libmcruntime.so   # render templates/
    phx-port check <name>                # both files, every operation, page size, kernel build
    phx-port list                        # every vendor found, available or not, and why
    phx-port test <name>                 # the conformance suite -> capability table + report
    phx-port test <name> -k copies       # only some tests (pytest -k)
    phx-port test <name> -- -x -vv       # anything after -- goes to pytest
    phx-port test <name> --emulated      # against an emulated CUDA-shaped runtime (a test double)

Exit status of ``test``: 0 when no capability fails (skips allowed), 1 when one
does, 2 for a usage error (an unknown vendor, pytest or numpy missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import sys

from phoenix import registry

from ._run import ArgumentParser, add_debug_flag, output_dir, run_main

DEFAULT_REPORT_DIR = "phx-report"

EPILOG_TEST = """\
Arguments after -- are passed to pytest as they are (e.g. -- -x -vv).

The suite runs in a child process (python -m pytest with phoenix's conformance
plugin), with PHX_VENDOR set to NAME. Each test belongs to one capability; the table
shows each capability as pass, fail or skip with the reason of its first failure or
skip. A test that crashes the process (a segfault in the vendor's C code) or hangs
past --test-timeout is recorded as failed, and the suite resumes after it.

The report is written as <report-dir>/conformance-NAME.json and .md: vendor, whether
it is a test double, the command, date, host, phoenix version, every capability and
every test. Vendors under development: put their parent directory on PHX_VENDOR_PATH.

--emulated runs the suite against an emulated runtime instead of the vendor's own:
phoenix's host runtime (phoenix/_testing/hostrt/hostrt.c) built with the port's symbol prefix
and library name (Runtime.prefix, Runtime.library_names[0]), e.g. libmcruntime.so
with mc* names for metax. The port is pointed at it by the environment its
Runtime.emulated_env() gives: PHX_<NAME>_LIBRARY by default, the installation root
for ports that declare it (MACA_PATH for metax, ROCM_PATH for amd); it must bind
that library, or the run fails. The emulator has PHX_HOST_DEVICES devices (2 unless
set). It is a test double: the report says "emulated runtime" and is written as
conformance-NAME-emulated.json and .md. Needs a C compiler; built libraries are
cached in $PHX_EMULATOR_CACHE (default ~/.cache/phoenix/emulators).
"""

EPILOG_LIST = """\
Sources: in-tree (vendors/<name>/ of this installation), entry point (an installed
package in the phoenix.vendors group), PHX_VENDOR_PATH (a directory holding
<name>/runtime.py). A vendor whose module fails to import is listed with its error.
"""


#: the longest --test-timeout (about 11.6 days): past it a number is a typo, not a limit
TEST_TIMEOUT_MAX = 1e6


def test_timeout(text: str) -> float:
    """An argparse type: seconds from 0 (no limit) to :data:`TEST_TIMEOUT_MAX`."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= x <= TEST_TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds from 0 (no limit) to {TEST_TIMEOUT_MAX:.0f}")
    return x


test_timeout.__test__ = False  # not a test, for pytest's collection of a module importing it


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="phx-port",
        description="Port phoenix to an accelerator: check a vendor port against the conformance suite.",
        epilog="Start with `phx-port list`, then `phx-port test <name>` until every capability passes.",
    )
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_new(sub)
    _add_check(sub)

    p = sub.add_parser(
        "test",
        usage="phx-port test [options] NAME [-- PYTEST_ARGS ...]",
        help="run the conformance suite for one vendor and write a capability report",
        description="Run the conformance suite against vendor NAME, print a capability table and write "
        "it as JSON and Markdown. Exits non-zero if any capability fails.",
        epilog=EPILOG_TEST,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="vendor to test (see `phx-port list`)")
    p.add_argument(
        "--report-dir",
        default=DEFAULT_REPORT_DIR,
        type=output_dir,
        metavar="DIR",
        help=f"where to write conformance-NAME.json and .md (default: ./{DEFAULT_REPORT_DIR}/)",
    )
    p.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPR",
        help="only tests matching this pytest -k expression (e.g. 'copies and not 64mib')",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only the capability table (pytest's output is shown only on failure)",
    )
    p.add_argument(
        "--test-timeout",
        type=test_timeout,
        default=120.0,
        metavar="SECONDS",
        help="a single test running longer is stopped and counted as failed (default 120; 0: none)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "io_uring", "threads"),
        metavar="ENGINE",
        help="I/O engine for the suite's I/O capabilities: auto, io_uring or threads "
        "(sets PHX_IO_ENGINE for the run; recorded in the report)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument(
        "--emulated",
        action="store_true",
        help="run against an emulated runtime (a test double) built with the port's symbol prefix "
        "and library name, instead of the vendor's own runtime",
    )
    # Arguments after `--` go to pytest untouched (main() splits them off before parsing).
    p.set_defaults(func=cmd_test, pytest_args=[])

    p = sub.add_parser(
        "list",
        help="list the vendors found, with source, availability and why",
        description="List every vendor phoenix can find, where it comes from, whether it can serve on this "
        "machine (its probe), and why not. Import errors are shown, not raised.",
        epilog=EPILOG_LIST,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_list)
    return parser


EPILOG_NEW = """\
Writes NAME's two files, runtime.py (userspace) and p2p.c (kernel), and a README:
into vendors/NAME/ of this phoenix checkout, into --vendors-dir DIR/NAME/, or, with
--out DIR, as an out-of-tree package (DIR/pyproject.toml with the phoenix.vendors entry
point, DIR/phoenix_vendor_NAME/). Nothing outside that directory is touched, and an
existing directory is never overwritten.

--like cuda --prefix P --lib LIB: the runtime is CUDA-shaped (PMalloc, PMemcpyAsync,
PLaunchHostFunc, ...: CUDA's API with another prefix). runtime.py is then a declaration
(prefix, library, root variable, page size) over phoenix.cudalike, complete as generated
(the library found through PHX_NAME_LIBRARY, $NAME_PATH/lib or the loader's path), and
`phx-port test NAME --emulated` passes against an emulated LIB unedited.
Without --like: a blank port whose every operation is a marked place to fill, with
its contract beside it; the suite fails each one, naming its file:line.

p2p.c is a skeleton in both cases (kernel P2P interfaces differ by vendor): it builds,
loads, and registers as unavailable until its TODO(phx-port) places are filled.

Examples:
  phx-port new acme --like cuda --prefix acme --lib libacmert.so --pci-vendor 0x1eac
  phx-port new acme --out ./phoenix-vendor-acme          # blank, out of tree
Then: phx-port check NAME; phx-port test NAME [--emulated]; docs/porting.md.
"""

EPILOG_CHECK = """\
Checks, each reported as file:line: level: message (levels: ok, error, not implemented,
skipped, note):
  files            runtime.py and p2p.c present, no third .py/.c/.h beside them
  import, name     runtime.py imports; Runtime.name equals NAME
  operations       every operation of phoenix/vendor.py implemented (a method that
                   still calls the generated _fill_me placeholder is not)
  page size        p2p.c's .page_size equals runtime.py's p2p_page_size, a power of two
  kernel side      each TODO(phx-port) place of p2p.c still to fill
  kernel build     p2p.c built with the core module by kernel/Makefile (-Werror) against
                   the running kernel's headers or /usr/src/linux-headers-*; without
                   headers (or --kdir none) a gcc -fsyntax-only check against stub headers
  prototype table  every required symbol of the port's table present in the runtime
                   library, when the library is installed here
Exit status: 0 when nothing is an error or not implemented, 1 otherwise, 2 for a usage error.
"""


def _add_new(sub) -> None:
    p = sub.add_parser(
        "new",
        help="scaffold a new port (runtime.py + p2p.c) from phoenix's templates",
        description="Render phoenix's jinja2 templates into a new vendor port: runtime.py, p2p.c and a README.",
        epilog=EPILOG_NEW,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "name",
        help="vendor name: a lowercase Python identifier, not reserved, not an existing vendor "
        "(it names the directory, PHX_VENDOR=NAME and phx_NAME.ko)",
    )
    p.add_argument(
        "--like",
        choices=("cuda",),
        default=None,
        help="the runtime's shape: 'cuda' for a CUDA-shaped runtime with another symbol prefix "
        "(needs --prefix and --lib); without it, a blank port",
    )
    p.add_argument("--prefix", metavar="P", help="the runtime's symbol prefix (mc for mcMalloc, hip for hipMalloc)")
    p.add_argument(
        "--lib",
        dest="library",
        metavar="LIB",
        help="the runtime library's file name, lib<name>.so[.N] (libmcruntime.so); with --like cuda "
        "also the emulator's name for `phx-port test NAME --emulated`",
    )
    p.add_argument(
        "--pci-vendor",
        metavar="0xNNNN",
        help="PCI vendor id of the devices, for p2p.c (lspci -nn); left as a place to fill if not given",
    )
    p.add_argument(
        "--page-size",
        default="65536",
        metavar="BYTES",
        help="P2P page size, a power of two >= 4096 (65536, 64K, 2M), written equal into runtime.py "
        "(p2p_page_size) and p2p.c (.page_size); default 65536",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        metavar="DIR",
        help="write an out-of-tree package into DIR (pyproject.toml with the phoenix.vendors entry "
        "point, DIR/phoenix_vendor_NAME/) instead of vendors/NAME/",
    )
    where.add_argument(
        "--vendors-dir",
        metavar="DIR",
        help="write DIR/NAME/ instead of this checkout's vendors/NAME/ (found through PHX_VENDOR_PATH=DIR)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=cmd_new)


def _add_check(sub) -> None:
    p = sub.add_parser(
        "check",
        help="static checks of a port: both files, every operation, page size, kernel build, prototype table",
        description="Check a vendor port without running it: both files present, every operation implemented, "
        "the page size equal on both sides, the kernel file compiling, the prototype table "
        "resolving against the runtime library. Each finding points at file:line.",
        epilog=EPILOG_CHECK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="vendor to check (see `phx-port list`)")
    p.add_argument(
        "--dir", metavar="DIR", help="the directory holding runtime.py and p2p.c (default: where phoenix finds NAME)"
    )
    p.add_argument(
        "--kdir",
        metavar="DIR",
        help="kernel build tree to compile p2p.c against (default: /lib/modules/$(uname -r)/build, "
        "else the newest /usr/src/linux-headers-*-amd64); 'none': syntax check with stub headers",
    )
    p.add_argument("--no-kernel-build", action="store_true", help="do not compile p2p.c")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_check)


# -- new / check ---------------------------------------------------------------------------


def cmd_new(args) -> int:
    from phoenix import scaffold

    try:
        req = scaffold.NewPort(
            name=args.name,
            like=args.like,
            prefix=args.prefix,
            library=args.library,
            pci_vendor=scaffold.parse_pci_vendor(args.pci_vendor) if args.pci_vendor is not None else None,
            page_size=scaffold.parse_page_size(args.page_size),
            out=args.out,
            vendors_dir=args.vendors_dir,
            command="phx-port " + shlex.join(args.argv),
        )
        target, files = scaffold.generate(req)
    except scaffold.ScaffoldError as exc:
        print(f"phx-port new: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"vendor": args.name, "directory": target, "files": files}, indent=2))
        return 0
    kind = f"CUDA-shaped port ({args.prefix}*, {args.library})" if args.like else "blank port"
    print(f"{kind} {args.name!r} written to {target}:")
    for f in files:
        print(f"  {f}")
    find = ""
    if args.vendors_dir:
        find = f"PHX_VENDOR_PATH={os.path.abspath(args.vendors_dir)} "
    elif args.out:
        print(f"\ninstall it so phoenix finds it: pip install -e {target}")
    print("\nnext:")
    print(
        f"  {find}phx-port check {args.name}"
        + (f" --dir {os.path.dirname(next(f for f in files if f.endswith('runtime.py')))}" if args.out else "")
    )
    if args.like:
        print(f"  {find}phx-port test {args.name} --emulated     # the suite against an emulated {args.library}")
    else:
        print(f"  {find}phx-port test {args.name}                # names every operation still to fill")
    print("  docs/porting.md walks through the rest")
    return 0


def check_args(args) -> None:
    """Refuse, before any check runs, what ``phx-port check`` cannot use: a name no port can
    have, an empty --dir or --kdir (else silently the default), a --kdir that is no kernel
    build tree (checked before kernel/ is looked for: an installed phoenix has none)."""
    from phoenix import portcheck, scaffold

    scaffold.validate_name_shape(args.name)
    for option, path in (("--dir", args.dir), ("--kdir", args.kdir)):
        if path is not None and not path.strip():
            raise scaffold.ScaffoldError(f"{option} is empty: give a directory (or leave {option} out)")
    problem = portcheck.kdir_problem(args.kdir)
    if problem:
        raise scaffold.ScaffoldError(problem)


def cmd_check(args) -> int:
    from phoenix import portcheck

    check_args(args)
    rep = portcheck.check(args.name, directory=args.dir, kdir=args.kdir, compile_kernel=not args.no_kernel_build)
    if rep.directory is None:
        known = list(registry.discover())
        hint = f"; {_vendors_and_new(args.name, known)}" if args.dir is None and args.name not in known else ""
        print(f"phx-port check: {rep.findings[0].message}{hint}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(f"phx-port check {args.name}: {rep.directory or '(not found)'}")
        for f in rep.findings:
            print(f.format())
        todo = sum(f.level == "todo" for f in rep.findings)
        err = sum(f.level == "error" for f in rep.findings)
        print(f"\n{args.name}: {'FAIL' if rep.failed else 'PASS'}: {err} error(s), {todo} not implemented")
    args.rc = 1 if rep.failed else 0
    return args.rc


def _vendors_and_new(name: str, installed: list[str]) -> str:
    """What there is instead of vendor ``name``, and how to make a port of that name."""
    have = ", ".join(installed) or "none"
    return (
        f"the vendors found here are {have} ('phx-port list' shows where each comes from); to start a port "
        f"named {name}: phx-port new {name} (docs/porting.md)"
    )


# -- list -------------------------------------------------------------------------------


def vendor_rows() -> list[dict]:
    """One row per discovered vendor: source, location, availability and reason."""
    rows = []
    for name, entry in registry.discover().items():
        cls = entry.load()
        if cls is None:
            rows.append(
                {
                    "vendor": name,
                    "source": entry.source,
                    "location": entry.location,
                    "available": False,
                    "test_double": None,
                    "reason": entry.error,
                }
            )
            continue
        probe = entry.probe()
        rows.append(
            {
                "vendor": name,
                "source": entry.source,
                "location": entry.location,
                "available": bool(probe.usable),
                "test_double": bool(cls.is_test_double),
                "reason": probe.reason,
            }
        )
    return rows


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for k, r in enumerate(rows):
        cells = [f"{c:<{w}}" for c, w in zip(r, widths, strict=False)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 30)
    return "\n".join(lines)


def cmd_list(args) -> int:
    rows = vendor_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no vendors found (in-tree, phoenix.vendors entry points, PHX_VENDOR_PATH)")
        return 0
    table = [("vendor", "source", "available", "reason")]
    for r in rows:
        if r["test_double"] is None:
            avail = "no (import error)"
        else:
            avail = ("yes" if r["available"] else "no") + (" (test double)" if r["test_double"] else "")
        table.append((r["vendor"], r["source"], avail, " ".join(str(r["reason"]).split())))
    print(_table(table))
    return 0


# -- test -------------------------------------------------------------------------------


def _missing_tools() -> list[str]:
    return [m for m in ("pytest", "numpy") if importlib.util.find_spec(m) is None]


def cmd_test(args) -> int:
    from phoenix import conformance

    name = args.name
    missing = _missing_tools()
    if missing:
        print(
            f"phx-port test: the conformance suite needs {' and '.join(missing)}: "
            "pip install 'phoenix-direct-storage[test]'",
            file=sys.stderr,
        )
        return 2
    vendors = registry.discover()
    if name not in vendors:
        print(f"phx-port test: no vendor {name!r}: {_vendors_and_new(name, list(vendors))}", file=sys.stderr)
        return 2
    entry = vendors[name]
    extra = list(args.pytest_args)
    command = "phx-port " + shlex.join(args.argv)
    env = dict(os.environ, PHX_VENDOR=name)  # what the suite's process sees
    if args.engine:
        env["PHX_IO_ENGINE"] = args.engine
    emulated = None
    if args.emulated:
        emulated = _emulate(entry, env, announce=not (args.quiet or args.json))
        if emulated is None:
            return 2
    run = conformance.run_suite(
        name, pytest_args=extra, keyword=args.keyword, quiet=args.quiet, test_timeout=args.test_timeout, env=env
    )
    report = conformance.build_report(
        name,
        run,
        command=command,
        is_test_double=entry.is_test_double,
        vendor_info={"source": entry.source, "location": entry.location},
        settings={k: v for k, v in sorted(env.items()) if k.startswith("PHX_")},
        emulated=emulated,
    )
    failed = report["result"] != "pass"
    args.rc = 1 if failed else 0  # what main() returns even if stdout goes away below
    if args.json:
        json_path, md_path = conformance.write_report(report, args.report_dir)
        print(json.dumps(report, indent=2, default=str))
        return args.rc
    # the table first: a report that cannot be written (the directory went away meanwhile) must not lose it
    if args.quiet and failed and not report["tests"] and run["output"]:
        print("\n".join(run["output"].rstrip().splitlines()[-QUIET_TAIL:]))  # nothing ran: why, in pytest's words
    if not args.quiet:
        print()
    print(conformance.format_table(report))
    if args.quiet and any(t["outcome"] == "failed" for t in report["tests"]):
        print(failure_summary(report))
    sys.stdout.flush()
    json_path, md_path = conformance.write_report(report, args.report_dir)
    print(f"report: {json_path}\n        {md_path}")
    return args.rc


#: lines of pytest's held-back output -q shows when no test ran at all (a collection error)
QUIET_TAIL = 30
#: the longest reason -q prints on its line
REASON_WIDTH = 220


def failure_summary(report: dict) -> str:
    """-q's account of the failures: one line per distinct reason (the failure's message, the
    phase it failed in aside), with how many tests it failed and the first of them; the whole
    tracebacks are in the report's Markdown."""
    reasons: dict[str, list[str]] = {}
    for t in report["tests"]:
        if t["outcome"] == "failed":  # (not "not run": tests -k deselected)
            msg = re.sub(r"^error in (setup|teardown): ", "", t.get("message") or t["outcome"])
            reasons.setdefault(" ".join(msg.split()) or t["outcome"], []).append(t["test"])
    lines = [
        f"failures: {len(reasons)} distinct reason{'s' if len(reasons) != 1 else ''} (the tracebacks: the .md report)"
    ]
    for msg, tests in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        cut = msg if len(msg) <= REASON_WIDTH else msg[: REASON_WIDTH - 3] + "..."
        first = re.sub(r"^[\w./]+\.py::", "", tests[0])
        lines.append(f"  {len(tests):>4} test{'s' if len(tests) != 1 else ' '} {cut} (first: {first})")
    return "\n".join(lines)


def _emulate(entry, env: dict, announce: bool = True) -> dict | None:
    """Build the emulated runtime for ``entry``'s port and point ``env`` at it; None after an error.

    ``announce`` prints what was built (the table and the report say it in any case).
    """
    from phoenix import emulator

    cls = entry.load()
    if cls is None:
        print(f"phx-port test: vendor {entry.name!r} does not import: {entry.error}", file=sys.stderr)
        return None
    try:
        emu, changes = emulator.for_vendor(cls)
    except emulator.EmulatorError as exc:
        print(f"phx-port test --emulated: {exc}", file=sys.stderr)
        return None
    emulator.apply_env(env, changes)
    env.setdefault("PHX_HOST_DEVICES", "2")  # the emulator's device count: exercise multi-device paths
    via = ", ".join(k if v is None else f"{k}={v}" for k, v in changes.items() if v is not None)
    if announce:
        print(
            f"{emulator.LABEL}: {emu.library_name} with {emu.prefix}* symbols, built from {emu.source}\n"
            f"  library: {emu.library}\n  vendor {entry.name!r} pointed at it with {via}",
            flush=True,
        )
    return {**emu.describe(), "via": via}


def main(argv: list[str] | None = None) -> int:
    """The ``phx-port`` console script: a user's mistake is one line on stderr and exit status 2."""
    return run_main("phx-port", _main, argv)


def _main(argv: list[str]) -> int:
    ours, passthrough = argv, []
    if "--" in argv:
        cut = argv.index("--")
        ours, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(ours)
    if passthrough:
        if args.command != "test":
            parser.error(f"arguments after -- are for pytest, only with `test`: {shlex.join(passthrough)}")
        args.pytest_args = passthrough
    args.argv = argv
    args.rc = 0
    try:
        return args.func(args)
    except BrokenPipeError:  # `phx-port ... | head`: the reader left; the exit status stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return args.rc


if __name__ == "__main__":
    sys.exit(main())
