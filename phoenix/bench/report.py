"""``phx bench``'s report: the table, its legend, the plot (what the records say).

Benchmark side, control plane: reads the records ``throughput.py`` measured; imports
nothing that moves bytes.
"""

from __future__ import annotations

import json

GB = 1e9


#: per-point records of the sweeps: in the JSON only
SWEPT = ("raw_sweep", "phoenix_sweep")


def _bs(r: dict) -> int:
    """Random reads are grouped by block size too (``--random-bs 4K,64K,1M``)."""
    return r["chunk"] if r["op"] == "randread" else 0


def _cache(r: dict) -> str:
    return r.get("cache", "warm" if r["warm"] else "cold")


def _chunk_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def config_of(r: dict) -> str:
    """The configuration a raw figure was measured at: ``4 threads x 16 MiB`` (random reads:
    ``64 in flight x 64 KiB``), as its record names it or from its threads and chunk."""
    if r.get("config"):
        return r["config"]
    if r["op"] == "randread":
        return f"{r['threads']} in flight x {_chunk_text(r['chunk'])}"
    return f"{r['threads']} thread{'s' if r['threads'] != 1 else ''} x {_chunk_text(r['chunk'])}"


def references(records: list[dict]) -> dict:
    """(op, cache, block size) -> the record every ratio of that op divides by where a raw
    sweep ran: the fastest raw O_DIRECT figure of the run's repetitions, raw_best (the sweep's
    pick, re-measured) or a raw_odirect that came out faster (so that the reference is never
    below a raw configuration measured beside it)."""
    refs: dict = {}
    for r in records:
        if r["impl"] == "raw_best":
            refs[(r["op"], _cache(r), _bs(r))] = r
    for r in records:
        key = (r["op"], _cache(r), _bs(r))
        if r["impl"] == "raw_odirect" and key in refs and r["gbps"] > refs[key]["gbps"]:
            refs[key] = r
    return refs


#: a cold write faster than this times the cold read reference of the run is flagged
WRITE_FLAG = 1.10


def write_flags(records: list[dict]) -> dict:
    """id(record) -> why a write figure is not the device's sustained rate: a cold write faster
    than the run's cold sequential reads (the raw reference's) was taken by a write-back cache
    below the file system (a disk's, a VM host's), though it was timed with its sync."""
    reads = [r["gbps"] for r in records if r["op"] == "read" and _cache(r) == "cold" and r["impl"].startswith("raw")]
    if not reads:
        return {}
    top = max(reads)
    return {
        id(r): f"{r['gbps'] / top:.1f}x the cold reads: a write-back cache below the file system took it"
        for r in records
        if r["op"] == "write" and r["impl"] not in SWEPT and r["gbps"] > top * WRITE_FLAG
    }


def table(records: list[dict]) -> str:
    """Rows grouped by (op, cache, threads), each ratio against the reference: where a raw
    O_DIRECT sweep of that op and cache ran, the fastest raw configuration measured (its row
    first, configuration named), else raw of that group (its configuration named). The thr
    column is each row's own concurrency. Sweep points are in the JSON only."""
    lines = [
        f"{'op':<9} {'cache':<5} {'thr':>4} {'impl':<13} {'GB/s':>8} {'ratio':>7} {'vs bus':>7} {'CPU s/GB':>9} {'IOPS':>9}"
    ]
    bus = next((r["gbps"] for r in records if r["impl"] == "h2d_pinned"), None)
    bests = references(records)
    swept = {(r["op"], _cache(r), _bs(r)): r for r in records if r["impl"] == "raw_best"}
    flags = write_flags(records)
    groups: dict = {}
    for r in records:
        if r["impl"] not in SWEPT + ("raw_best",):
            groups.setdefault((r["op"], _cache(r), r["threads"], _bs(r)), []).append(r)
    shown: set = set()
    for (op, cache, _thr, bs), rows in groups.items():
        best = bests.get((op, cache, bs))
        ref = best or next((x for x in rows if x["impl"].startswith("raw") and not x.get("first")), None)
        # raw_best heads its op once (a raw_odirect that beat it is the reference in its own row)
        pick = swept.get((op, cache, bs))
        head = [pick] if pick is not None and id(pick) not in shown else []
        shown.update(id(x) for x in head)
        for r in head + rows:
            ratio = f"{r['gbps'] / ref['gbps']:.3f}x" if ref and ref["gbps"] else "-"
            vbus = f"{r['gbps'] / bus:.3f}x" if bus and r["warm"] and op == "read" else ""
            iops = f"{r['iops']:.0f}" if "iops" in r else ""
            name = r["impl"] + (" 1st" if r.get("first") else "")
            notes = []
            if r is ref and best is not None:
                of = f" of {r['best_of']} swept" if r.get("best_of") else " (faster than the sweep's pick)"
                notes.append(f"reference: the fastest raw O_DIRECT configuration measured{of}, {config_of(r)}")
            elif r is pick:
                notes.append(f"the sweep's pick of {r['best_of']}: {config_of(r)}")
            elif r is ref:
                notes.append(f"reference: raw at {config_of(r)}")
            notes += [f"its best of the sweep: {r['config']}"] if r.get("best_of_sweep") else []
            notes += [f"{bs >> 10} KiB reads"] if bs and r is rows[0] else []
            notes += [flags[id(r)]] if id(r) in flags else []
            notes += [r["storage"]] if r.get("storage") else []
            note = f"  [{'; '.join(notes)}]" if notes else ""
            lines.append(
                f"{op:<9} {cache:<5} {r['threads']:>4} {name:<13} {r['gbps']:>8.2f} {ratio:>7} {vbus:>7} "
                f"{r['cpu_s_per_gb']:>9.3f} {iops:>9}{note}"
            )
    return "\n".join(lines)


IMPLS = {
    "raw_odirect": "O_DIRECT pread/pwrite of the file into host memory, in C, at phoenix's threads x chunk (named): "
    "the reference; one configuration of the device, not its limit (--raw-sweep looks for the fastest)",
    "raw_best": "raw O_DIRECT at the best point of its sweep (threads x chunk; random reads: in flight; one run "
    "per point), configuration named, re-measured in the repetitions: where present (or raw_odirect, where it came "
    "out faster), the reference every ratio of its op divides by",
    "raw_buffered": "buffered pread of the file into host memory (page cache), in C: the reference of warm reads",
    "naive": "pread into pinned host memory, then a synchronous copy to the device, in C: the loop phoenix replaces",
    "phoenix": "this library, file <-> device memory",
    "phoenix_batch": "phoenix, the same random reads submitted as one batch() of Python requests",
    "kvikio": "KvikIO (compat mode), file <-> device memory",
    "h2d_pinned": "pinned host -> device copy, no file: the bus limit",
}


def legend(records: list[dict]) -> str:
    """What every column of :func:`table` means, and each implementation present."""
    lines = [
        "columns:",
        "  op        read, write: sequential, the whole --size in --chunk pieces; randread: --random-bs reads at random",
        "            offsets, --qd in flight",
        "  cache     cold: the file is dropped from the page cache before every repetition (the disk's speed),",
        "            phoenix's pinned page-cache windows released first (fmap_clear; PHX_FMAP_MODE=off: none at all);",
        "            warm: it is in the page cache (memory's speed)",
        "  thr       concurrency: I/O threads (randread: reads in flight, the queue depth)",
        "  impl      what moved the bytes (below); '1st' marks the first warm run, a cache's first hit, not a median",
        "  GB/s      bytes moved / seconds, median of --reps repetitions (1 GB = 10^9 bytes)",
        "  ratio     GB/s / the reference's GB/s of the same op and cache (its row says 'reference'): raw O_DIRECT",
        "            at the same thr and chunk, one configuration of the device and not its limit (above 1.000x:",
        "            phoenix's pipeline beats that configuration, not the storage); where a raw sweep ran",
        "            (--raw-sweep), the fastest raw O_DIRECT configuration measured in this run, named",
        "  vs bus    warm reads: GB/s / the pinned host -> device copy of this run (h2d_pinned; on accelerators only)",
        "  CPU s/GB  CPU seconds (user + system, all threads of the process) per GB moved: lower is cheaper",
        "  IOPS      randread: reads per second",
        "  write     the whole --size written, then synced (phoenix and KvikIO fsync, raw fdatasync), the sync timed;",
        "            a write-back cache below the file system (a disk's, a VM host's) may still take it faster than",
        "            the device sustains: a cold write above the cold reads of the run is flagged in its row",
        "impl:",
    ]
    present = {r["impl"] for r in records} or set(IMPLS)
    lines += [f"  {name:<13} {text}" for name, text in IMPLS.items() if name in present]
    lines += [f"  {name}" for name in sorted(present - set(IMPLS) - set(SWEPT))]
    if any(r.get("best_of_sweep") for r in records):
        lines += [
            "sweeps: phoenix was swept over the same grid as raw and runs at its best point (named); the impls beside",
            "  it (raw_odirect, naive, kvikio) run at that point too; every sweep point is in the JSON",
        ]
    storage = next((r["fast_device"] for r in records if r.get("fast_device")), None)
    if storage:
        lines += [
            f"storage: {storage['label']}: a {_size_label(storage['device_bytes'])} {storage['backing']}, "
            f"{storage['loop']} (direct I/O {'on' if storage['direct_io'] else 'OFF'}), {storage['fs_text']}"
        ]
    return "\n".join(lines)


def _size_label(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


#: plot font sizes (points): readable at a glance in a slide or a README
FONT = {"base": 12, "tick": 11, "note": 10, "legend": 10, "title": 13, "suptitle": 13}


def plain_log_axis(ax, which: str = "x", values=None, base: int = 2) -> None:
    """A log axis labelled in plain numbers (1, 2, 4, 16; 0.1, 1, 10), not 2^0: ticks at
    ``values`` where given."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=base)
    if values:
        axis.set_ticks(sorted(set(values)))
    axis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _label(r: dict) -> str:
    if r["impl"] == "raw_best" and r.get("config"):
        return f"raw_best\n({r['config']})"
    return r["impl"] + (" 1st" if r.get("first") else "")


def plot(records: list[dict], path: str) -> str:
    """One panel per operation and cache state. A panel measured at one concurrency is a
    bar per implementation (GB/s, or IOPS for random reads) annotated with its ratio to
    the raw reference and its CPU s/GB; several concurrencies make a line per
    implementation. Warm reads carry the pinned host-to-device copy as the bus line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'phoenix-direct-storage[bench]'): no plot written"
    h2d = [r for r in records if r["impl"] == "h2d_pinned"]
    groups: dict = {}
    for r in records:
        if r["impl"] not in ("h2d_pinned",) + SWEPT:
            op = r["op"] if r["op"] != "randread" else f"randread {_bs(r) >> 10} KiB"
            groups.setdefault((op, r.get("cache") or ("warm" if r.get("warm") else "cold")), []).append(r)
    if not groups:
        return "no records to plot"
    with plt.rc_context(
        {
            "font.size": FONT["base"],
            "axes.labelsize": FONT["base"],
            "xtick.labelsize": FONT["tick"],
            "ytick.labelsize": FONT["tick"],
        }
    ):
        return _plot(plt, groups, h2d, records, path)


def _plot(plt, groups, h2d, records, path) -> str:
    order = {"read": 0, "write": 1}
    keys = sorted(groups, key=lambda k: (k[1] != "cold", order.get(k[0], 9), k[0]))
    fig, axes = plt.subplots(1, len(keys), figsize=(max(7.0, 5.6 * len(keys)), 5.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        op, cache = key
        recs = groups[key]
        iops = op.startswith("randread")
        unit = "IOPS" if iops else "GB/s"

        def val(r, iops=iops):
            return r.get("iops") or 0 if iops else r["gbps"]

        swept = [r for r in recs if r["impl"] == "raw_best"]
        if swept:  # the fastest raw figure of the repetitions, as the table's reference
            ref = max(swept + [r for r in recs if r["impl"] == "raw_odirect"], key=val)
        else:
            ref = next((r for r in recs if r["impl"] in ("raw_odirect", "raw_buffered") and not r.get("first")), None)
        bus = h2d[-1]["gbps"] if h2d and cache == "warm" and not iops else None  # the pinned copy of the run
        threads = sorted({r["threads"] for r in recs if r["impl"] != "raw_best"} or {r["threads"] for r in recs})
        if len(threads) == 1:
            names = [_label(r) for r in recs]
            vals = [val(r) for r in recs]
            colors = [
                "tab:green" if r["impl"].startswith("phoenix") else "tab:gray" if r is ref else "tab:blue" for r in recs
            ]
            bars = ax.barh(range(len(recs)), vals, color=colors)
            ax.set_yticks(range(len(recs)), names, fontsize=FONT["tick"])
            ax.invert_yaxis()
            for b, r in zip(bars, recs, strict=True):
                note = f" {val(r) / val(ref):.2f}x" if ref and val(ref) else ""
                ax.text(
                    b.get_width(),
                    b.get_y() + b.get_height() / 2,
                    f"{note}  {r['cpu_s_per_gb']:.2f} CPU s/GB",
                    va="center",
                    fontsize=FONT["note"],
                )
            ax.set_xlim(0, max(vals + [bus or 0]) * 1.45)
            ax.set_xlabel(unit)
            if bus:
                ax.axvline(bus, color="gray", linestyle="--", label="pinned H2D (bus)")
                ax.legend(fontsize=FONT["legend"], loc="lower right")
            ax.set_title(f"{op} ({cache}), {'QD' if iops else 'threads'} {threads[0]}", fontsize=FONT["title"])
        else:
            series: dict = {}
            for r in recs:
                if r is ref and r["impl"] == "raw_best":
                    ax.axhline(val(r), color="black", linestyle=":", label=_label(r))
                    continue
                series.setdefault(_label(r), []).append((r["threads"], val(r)))
            for name, pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            if bus:
                ax.axhline(bus, color="gray", linestyle="--", label="pinned H2D (bus)")
            plain_log_axis(ax, "x", threads)
            ax.set_xlabel("threads (concurrency)")
            ax.set_ylabel(unit)
            ax.legend(fontsize=FONT["legend"])
            ax.set_title(f"{op} ({cache})", fontsize=FONT["title"])
        ax.grid(alpha=0.3)
    r0 = next((r for r in records if r["impl"] not in SWEPT + ("raw_best",)), records[0])
    double = " (test double)" if r0.get("test_double") else ""
    storage = next((r["storage"] for r in records if r.get("storage")), None)
    where = f"\n{storage}" if storage else ""
    raw0 = next((r for r in records if r["impl"] in ("raw_odirect", "raw_buffered")), r0)
    refname = (
        "the fastest raw O_DIRECT configuration measured"
        if any(r["impl"] == "raw_best" for r in records)
        else f"raw O_DIRECT at {config_of(raw0)} (one configuration, not the device's limit)"
    )
    fig.suptitle(
        f"phx bench, vendor {r0['vendor']}{double}, chunk {r0['chunk'] >> 20} MiB, "
        f"{_size_label(r0['size'])}{where}\nbars: ratio to {refname}, CPU s/GB",
        fontsize=FONT["suptitle"],
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def report(records: list[dict], args, stopped: BaseException | None = None) -> None:
    """The table, its legend, the JSON and the plot; after a failure (``stopped``), of the
    records measured before it."""
    if stopped is not None:
        if not records:
            return
        why = "an interrupt" if isinstance(stopped, KeyboardInterrupt) else "an error (the last line says which)"
        print(f"stopped by {why} after {len(records)} measurements; what was measured before it:")
    print(table(records))
    print()
    print(legend(records))
    if records and records[0].get("test_double"):
        print(
            f"\nvendor {records[0]['vendor']} is a test double: 'device memory' is host memory; these are not accelerator figures."
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
        print(f"records written to {args.json}")
    if args.plot and records:
        print(plot(records, args.plot))
