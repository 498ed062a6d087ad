"""``phx``: the operator's command (info, bench).

Operator side, control plane. ``phx info`` answers "what will phoenix do here, and why":
version, the selected vendor and the reason, every vendor's availability, devices, the I/O
engines and paths possible here, and known environment problems (another package
installing an import package named ``phoenix``). ``phx bench`` and its subcommands come
from phoenix.bench.cli (the CLI is the benchmarks' only importer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from ._run import DIST_NAME, ArgumentParser, add_debug_flag, describe, run_main, version


def import_clashes() -> list[str]:
    """Other installed distributions that also provide the ``phoenix`` import package (the
    console scripts' entry refuses to start on one; shown here for ``phx info --json``)."""
    try:
        from _phx_entry import clash_message
    except ImportError:  # a source tree whose top level is not on the path
        return []
    message = clash_message()
    return [message] if message else []


def gather_info() -> dict:
    """Everything ``phx info`` prints, as a dict (``--json``)."""
    import phoenix
    from phoenix import registry
    from phoenix.errors import PhxError

    info: dict = {
        "version": version(),
        "distribution": DIST_NAME,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "package_path": os.path.dirname(phoenix.__file__),
        "clashes": import_clashes(),
        "PHX_VENDOR": phoenix.settings.effective("vendor"),
    }
    vendors = registry.discover()
    rows = []
    for name, entry in vendors.items():
        probe = entry.probe()
        rows.append(
            {
                "name": name,
                "source": entry.source,
                "usable": probe.usable,
                "reason": probe.reason,
                "test_double": entry.is_test_double,
            }
        )
    info["vendors"] = rows
    try:
        sel = registry.select(vendors=vendors)
    except PhxError as exc:
        info["selected"] = None
        info["error"] = str(exc)
        info["_exception"] = exc
        return info
    info["selected"] = {"name": sel.name, "reason": sel.reason, "skipped": sel.skipped}
    try:
        rt = registry.get_runtime(sel.name)
        info["devices"] = [d.__dict__ for d in rt.devices()]
        info["p2p_page_size"] = rt.p2p_page_size
        info["test_double"] = rt.is_test_double
    except Exception as exc:  # report, never crash: this is the diagnostic command
        info["devices_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from phoenix import kmod

        info["kernel"] = kmod.status()
    except Exception as exc:
        info["kernel"] = {"why": f"{type(exc).__name__}: {exc}"}
    try:
        from phoenix import io as phx_io

        info["io"] = phx_io.capabilities()
    except (PhxError, ValueError, OSError) as exc:  # a bad PHX_* setting: the reason, and exit status 2
        info["io_error"] = describe(exc)
        info["_exception"] = exc
    except Exception as exc:
        info["io_error"] = f"{type(exc).__name__}: {exc}"
    return info


SIZE_KEYS = {
    "total_memory",
    "chunk_size",
    "bounce_pool_size",
    "fmap_cache",
    "fmap_window",
    "bounce_pool",
    "chunk",
    "staged_chunk",
    "max_slot",
    "budget",
    "window",
    "bytes",
    "pinned",
}
SECONDS_KEYS = {"fmap_idle", "idle"}  # page-cache windows' idle timeout: 0 is never
IO_TITLES = {
    "settings": "settings (PHX_* environment)",
    "sizes": "sizes",
    "engines": "engines",
    "o_direct": "O_DIRECT",
    "page_cache_probe": "page-cache probe",
    "vendor": "vendor data path",
    "stream_ordered": "stream-ordered I/O",
    "caller_stream": "ordering after the caller's stream",
    "modes": "paths",
}


def human_size(n) -> str:
    """``1.0 GiB``, ``8.0 MiB``, ``512 B`` (binary units); anything not an int as it is."""
    if isinstance(n, bool) or not isinstance(n, int):
        return str(n)
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):  # noqa: B007 (the last unit is used below)
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _value(key: str, value) -> str:
    if key in SIZE_KEYS:
        return human_size(value)
    if key in SECONDS_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g} s" if value > 0 else "0 (never)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_value(key, v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(k, v)}" for k, v in value.items()) or "-"
    return str(value)


class _Printer:
    """Nested plain data as indented lines: ``name: yes, why`` for {available, why} pairs,
    human sizes, and a long reason printed once (later: "as above")."""

    def __init__(self):
        self.seen: set[str] = set()

    def why(self, text: str) -> str:
        if len(text) > 40 and text in self.seen:
            return "(as above)"
        self.seen.add(text)
        return text

    def item(self, key: str, value, indent: int) -> None:
        pad = " " * indent
        if isinstance(value, dict) and "available" in value:
            rest = {k: v for k, v in value.items() if k not in ("available", "why", "state")}
            head = "yes" if value["available"] else "no"
            extra = f" ({_value('', rest)})" if rest else ""
            why = self.why(str(value.get("why") or ""))
            print(f"{pad}{key}: {head}{extra}" + (f": {why}" if why else ""))
            if isinstance(value.get("state"), dict):
                state = {k: v for k, v in value["state"].items() if k != "why" and v not in ("", None)}
                print(f"{pad}  now: {_value('', state)}")
        elif isinstance(value, dict) and value and any(isinstance(v, dict) for v in value.values()):
            print(f"{pad}{key}:")
            for k, v in value.items():
                self.item(k, v, indent + 2)
        elif isinstance(value, dict):
            print(f"{pad}{key}:")
            for k, v in value.items():
                text = self.why(v) if k.endswith("why") and isinstance(v, str) else _value(k, v)
                print(f"{pad}  {k}: {text}")
        else:
            text = self.why(value) if key.endswith("why") and isinstance(value, str) else _value(key, value)
            print(f"{pad}{key}: {text}")


def _print_info(info: dict) -> None:
    print(f"phoenix {info['version']} ({info['distribution']}), Python {info['python']}, {info['platform']}")
    print(f"  package: {info['package_path']}")
    for clash in info["clashes"]:
        print(f"  WARNING: {clash}")
    print(f"\nvendor: PHX_VENDOR={info['PHX_VENDOR']}")
    sel = info.get("selected")
    if sel:
        print(f"  selected: {sel['name']} ({sel['reason']})")
        if sel["skipped"]:  # their reasons are in the vendor list below, once
            print(f"  skipped:  {', '.join(sel['skipped'])} (unavailable: why, below)")
    else:
        print(f"  ERROR: {info.get('error')}")
    print("\nvendors:")
    width = max([len(r["name"]) for r in info["vendors"]] + [4])
    for r in info["vendors"]:
        state = "usable" if r["usable"] else "unavailable"
        tag = " [test double]" if r["test_double"] else ""
        print(f"  {r['name']:<{width}}  {state:<11} {r['source']}{tag}: {r['reason']}")
    if info.get("devices"):
        print("\ndevices:")
        for d in info["devices"]:
            print(f"  {d['ordinal']}: {d['name']}  pci {d['pci_bus_id']}  {human_size(d['total_memory'])}")
    elif info.get("devices_error"):
        print(f"\ndevices: ERROR {info['devices_error']}")
    kernel = info.get("kernel")
    if kernel:
        if kernel.get("why") or not kernel.get("core_loaded"):
            print(f"\nkernel module: {kernel.get('why') or 'not loaded'}")
        else:
            print(f"\nkernel module: loaded (ABI {kernel.get('abi')})")
            for b in kernel.get("backends", []):
                print(f"  backend: {_value('', b)}")
            for d in kernel.get("devices", []):
                print(f"  device:  {_value('', d)}")
    io = info.get("io")
    if io:
        print("\nI/O:")
        printer = _Printer()
        for key, value in io.items():
            printer.item(IO_TITLES.get(key, key), value, 2)
        fm = io.get("modes", {}).get("zero_copy_file_mappings", {}).get("state")
        if isinstance(fm, dict) and fm.get("mode") != "off":  # this process's pool: pinned now, of the budget
            print(
                f"  page-cache windows pinned: {human_size(fm['pinned'])} in {fm['windows']} windows "
                f"(budget {human_size(fm['budget'])}, released after {_value('idle', fm['idle'])} unread "
                f"and under memory pressure)"
            )
    elif info.get("io_error"):
        print(f"\nI/O: unavailable: {info['io_error']}")


def cmd_info(args) -> int:
    info = gather_info()
    problem = info.pop("_exception", None)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_info(info)
    if problem is not None:
        raise problem  # after the report: one line on stderr naming what to fix, exit status 2
    return 0


def vendor_choices() -> str:
    """``auto|amd|host|...|<port>``: PHX_VENDOR's values, the vendors discovery finds here
    (in-tree, entry points, PHX_VENDOR_PATH), never a list written down that misses one."""
    try:
        from phoenix import registry

        names = list(registry.discover())
    except Exception:  # help must come even where discovery cannot run: the shape of the value
        names = []
    return "|".join(["auto", *names, "<port>"])


class _PhxParser(ArgumentParser):
    """``phx``'s parser: its help names the vendors found, looked up only when help is shown
    (every other command line is parsed without running discovery for it)."""

    def format_help(self) -> str:
        self.description = (
            "Phoenix: direct-storage I/O between files and accelerator memory. "
            f"The vendor is chosen by PHX_VENDOR ({vendor_choices()})."
        )
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _PhxParser(prog="phx")
    parser.add_argument("--version", action="version", version=f"phx {version()} ({DIST_NAME})")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=ArgumentParser)
    p_info = sub.add_parser("info", help="what is selected here and why: vendors, devices, I/O engines and paths")
    p_info.add_argument("--json", action="store_true", help="print the information as JSON (sizes in bytes)")
    p_info.set_defaults(func=cmd_info)
    try:  # `phx info` must work (and tell what is wrong) even where a bench cannot load
        from phoenix.bench import cli as bench_cli
    except ImportError as exc:
        why = describe(exc)
        p_bench = sub.add_parser("bench", help=f"unavailable here: {why}")
        p_bench.set_defaults(
            func=lambda args: (_ for _ in ()).throw(ImportError(f"phx bench cannot load: {why}")), unavailable=True
        )
    else:
        bench_cli.add_parser(sub)
    return parser


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unavailable", False):  # a bench that cannot load says why, not "unrecognized"
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """The ``phx`` console script: a user's mistake is one line on stderr and exit status 2."""
    return run_main("phx", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
