"""``phx``: the operator's command (info, bench).

Operator side, control plane. ``phx info`` answers "what will phoenix do here, and why":
version, the selected vendor and the reason, every vendor's availability, devices, the I/O
engines and paths possible here, and known environment problems (another package
installing an import package named ``phoenix``). ``phx bench`` and its subcommands come
from phoenix.bench.cli (the CLI is the benchmarks' only importer).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys

DIST_NAME = "phoenix-direct-storage"
#: distributions known to install an import package named `phoenix` too
CLASHING_DISTS = ("arize-phoenix",)


def import_clashes() -> list[str]:
    """Other installed distributions that also provide the ``phoenix`` import package."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name == DIST_NAME:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        files = dist.files or []
        provides = "phoenix" in top or any(str(f).startswith("phoenix/") for f in files[:2000])
        if provides or name in CLASHING_DISTS:
            found.append(
                f"{dist.metadata.get('Name')} {dist.version} also installs an import package named "
                f"'phoenix' (files of the two overwrite each other): install {DIST_NAME} in its own "
                "virtual environment"
            )
    return found


def gather_info() -> dict:
    """Everything ``phx info`` prints, as a dict (``--json``)."""
    import phoenix
    from phoenix import registry
    from phoenix.errors import PhxError

    info: dict = {
        "version": phoenix.__version__,
        "distribution": DIST_NAME,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "package_path": os.path.dirname(phoenix.__file__),
        "clashes": import_clashes(),
        "PHX_VENDOR": os.environ.get("PHX_VENDOR", "auto"),
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
    except Exception as exc:
        info["io_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _print_info(info: dict) -> None:
    print(f"phoenix {info['version']} ({info['distribution']}), Python {info['python']}, {info['platform']}")
    print(f"  package: {info['package_path']}")
    for clash in info["clashes"]:
        print(f"  WARNING: {clash}")
    print(f"\nvendor: PHX_VENDOR={info['PHX_VENDOR']}")
    sel = info.get("selected")
    if sel:
        print(f"  selected: {sel['name']} ({sel['reason']})")
        for name, why in sel["skipped"].items():
            print(f"  skipped:  {name}: {why}")
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
            print(f"  {d['ordinal']}: {d['name']}  pci {d['pci_bus_id']}  {d['total_memory'] / 2**30:.1f} GiB")
    elif info.get("devices_error"):
        print(f"\ndevices: ERROR {info['devices_error']}")
    kernel = info.get("kernel")
    if kernel:
        print(f"\nkernel module: {kernel.get('why', kernel)}")
    io = info.get("io")
    if io:
        print("\nI/O:")
        for key, value in io.items():
            if isinstance(value, dict):
                print(f"  {key}:")
                for k, v in value.items():
                    print(f"    {k}: {v}")
            else:
                print(f"  {key}: {value}")
    elif info.get("io_error"):
        print(f"\nI/O: unavailable ({info['io_error']})")


def cmd_info(args) -> int:
    info = gather_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_info(info)
    return 0 if info.get("selected") else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="phx",
        description="Phoenix: direct-storage I/O between files and accelerator memory. "
        "The vendor is chosen by PHX_VENDOR (auto|host|nvidia|metax|<port>).",
    )
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p_info = sub.add_parser("info", help="what is selected here and why: vendors, devices, I/O engines and paths")
    p_info.add_argument("--json", action="store_true", help="print the information as JSON")
    p_info.set_defaults(func=cmd_info)
    try:
        from phoenix.bench import cli as bench_cli

        bench_cli.add_parser(sub)
    except ImportError:
        pass
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
