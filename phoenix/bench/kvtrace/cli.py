"""``phx bench kv-trace [gen]``: options, the run over (concurrency, configuration) points, report.

Benchmark side, control plane. ``run`` replays every point and records it (``on_record``
after each, so a killed run keeps what finished); ``table`` and ``plot`` report TTFT, QPS
and the most concurrent sessions under the threshold.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import socket
import sys
from dataclasses import asdict

from phoenix.cli._run import comma_list, nonnegative_float, positive_int, size, vendor_runtime
from phoenix.vendor import parse_size

from .compute import DTYPE_BYTES
from .replay import CONFIGS, Replayer
from .trace import generate, read_trace, trace_stats, write_trace


def best_concurrency(records: list[dict]) -> dict:
    """Per config: the most concurrent sessions with p99 TTFT under the threshold (0: none)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["config"], 0)
        if r["under_threshold"]:
            out[r["config"]] = max(out[r["config"]], r["concurrency"])
    return out


#: the tiers below HBM each configuration loads from
TIERS = {"dram": ("dram",), "staged": ("dram", "ssd"), "phoenix": ("dram", "ssd")}


def tier_warnings(rec: dict) -> list[str]:
    """The tiers of ``rec``'s configuration it loaded nothing from: such a point does not
    measure that tier's path (the SSD one, for staged and phoenix, is the point of the bench)."""
    c = rec["counts"]
    empty = [t for t in TIERS.get(rec["config"], ()) if c.get(f"{t}_loads", 0) == 0]
    if not empty:
        return []
    names = " and ".join(t.upper() for t in empty)
    tiers, paths = ("tier", "that path") if len(empty) == 1 else ("tiers", "those paths")
    return [
        f"{rec['config']} at concurrency {rec['concurrency']} loaded nothing from the {names} {tiers}: the point "
        f"does not measure {paths}; more sessions (--concurrency), smaller --hbm / --dram or a longer --duration "
        "make it load"
    ]


LEGEND = """\
columns:
  config    dram: KV evicted from DRAM is dropped and recomputed; staged: the SSD tier read by pread into pinned
            host memory and a synchronous copy (the naive loop); phoenix: the SSD tier read through phoenix
  conc      concurrent sessions
  rounds    rounds (requests) that reached their first token within the point's --duration
  QPS       rounds per second
  TTFT      time to first token of a round, in seconds (loads of its cached prefix + prefill of the rest):
            mean, p50 (median), p99
  hbm       blocks of the rounds' prefixes already in HBM (device memory)
  dram      blocks loaded from DRAM (pinned host memory)
  ssd       blocks loaded from the SSD tier (the slab file)
  recomp    blocks recomputed (not cached, or after the first missing one)
  GB ld     GB (10^9 bytes) loaded into HBM from DRAM and SSD
  verified  every loaded block matched its pattern (yes) or not (NO)"""


def table(records: list[dict]) -> str:
    lines = [
        f"{'config':<8} {'conc':>4} {'rounds':>6} {'QPS':>7} {'TTFT mean':>9} {'p50':>7} {'p99':>7}  "
        f"{'hbm':>5} {'dram':>5} {'ssd':>5} {'recomp':>6} {'GB ld':>7} {'verified':>8}"
    ]
    for r in records:
        c = r["counts"]

        def f(x):
            return f"{x:.3f}" if x is not None else "-"

        lines.append(
            f"{r['config']:<8} {r['concurrency']:>4} {r['rounds']:>6} {r['qps']:>7.2f} {f(r['ttft_mean_s']):>9} "
            f"{f(r['ttft_p50_s']):>7} {f(r['ttft_p99_s']):>7}  {c['hbm_hits']:>5} {c['dram_loads']:>5} "
            f"{c['ssd_loads']:>5} {c['recomputes']:>6} {(c['bytes_loaded_dram'] + c['bytes_loaded_ssd']) / 1e9:>7.2f} "
            f"{'yes' if r['verified'] else 'NO':>8}"
        )
    best = best_concurrency(records)
    thr = records[0]["threshold_s"] if records else 0
    lines.append(
        f"most concurrent sessions with p99 TTFT < {thr:g} s: " + ", ".join(f"{k} {v}" for k, v in best.items())
    )
    lines += ["", LEGEND]
    warned = [w for r in records for w in r.get("warnings", [])]
    lines += [f"WARNING: {w}" for w in warned]
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'phoenix-direct-storage[bench]'): no plot written"
    from ..throughput import FONT, plain_log_axis

    with plt.rc_context({"font.size": FONT["base"], "xtick.labelsize": FONT["tick"], "ytick.labelsize": FONT["tick"]}):
        return _plot(plt, records, path, title, FONT, plain_log_axis)


def _plot(plt, records, path, title, FONT, plain_log_axis) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for cfg in CONFIGS:
        pts = sorted(
            (r["concurrency"], r["ttft_p99_s"], r["qps"])
            for r in records
            if r["config"] == cfg and r["ttft_p99_s"] is not None
        )
        if not pts:
            continue
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=cfg)
    if records:
        axes[0].axhline(
            records[0]["threshold_s"], color="gray", linestyle="--", label=f"threshold {records[0]['threshold_s']:g} s"
        )
    concs = sorted({r["concurrency"] for r in records})
    for ax, yl in zip(axes, ("p99 TTFT (s)", "rounds per second (QPS)"), strict=True):
        plain_log_axis(ax, "x", concs)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=FONT["legend"])
    plain_log_axis(axes[0], "y", base=10)
    fig.suptitle(title, fontsize=FONT["suptitle"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


# ---- command line -------------------------------------------------------------------------------

DRY_RUN = {
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 64,
    "q_heads": 4,
    "hidden": 256,
    "ffn": 512,
    "block_tokens": 16,
    "token_scale": 0.01,
    "hbm": parse_size("2M"),
    "dram": parse_size("512K"),
    "ssd": parse_size("64M"),
    "sessions": 8,
    "duration": 1.5,
    "time_scale": 0.01,
    "concurrency": [1, 4],
    "prefill_chunk": 256,
}


def _trace_args(p) -> None:
    p.add_argument("--sessions", type=positive_int, default=64, help="sessions to generate (default 64)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")


def add_parser(sub) -> None:
    """``phx bench kv-trace [gen]``: called from phoenix.bench.cli.add_parser."""
    p = sub.add_parser(
        "kv-trace",
        help="replay an agentic KV-cache trace through DRAM-only, staged-SSD and phoenix tiers",
        description="Replay agentic sessions (a seeded trace with the statistics of Codex runs on SWE-bench Pro, or "
        "--trace FILE) through an HBM tier (vendor device memory), a DRAM tier (pinned host memory) and an SSD tier "
        "(a slab file), for the configurations dram (evicted KV is recomputed), staged (SSD through the naive staged "
        "loop) and phoenix (SSD through phoenix); prefill of uncached tokens is real compute of the model's shape. "
        "Reports TTFT (mean, p50, p99), QPS and the most concurrent sessions under the TTFT threshold. "
        "'phx bench kv-trace gen --out FILE' writes a trace.",
    )
    _trace_args(p)
    p.add_argument("--trace", metavar="FILE", help="replay this trace file instead of generating one")
    p.add_argument(
        "--configs",
        type=comma_list(CONFIGS),
        default=list(CONFIGS),
        metavar="{" + ",".join(CONFIGS) + "}[,...]",
        help="comma-separated of dram,staged,phoenix (default all)",
    )
    p.add_argument(
        "--concurrency",
        type=comma_list(item=positive_int),
        default=[1, 2, 4, 8, 16],
        metavar="N[,N...]",
        help="concurrent sessions to sweep (default 1,2,4,8,16)",
    )
    p.add_argument("--threshold", type=nonnegative_float, default=5.0, help="TTFT threshold in seconds (default 5)")
    p.add_argument(
        "--duration",
        type=nonnegative_float,
        default=20.0,
        help="seconds of replay per (config, concurrency) point (default 20)",
    )
    p.add_argument(
        "--time-scale",
        type=nonnegative_float,
        default=1.0,
        help="think times are multiplied by this (default 1: real time)",
    )
    p.add_argument(
        "--token-scale", type=nonnegative_float, default=1.0, help="token counts are multiplied by this (default 1)"
    )
    p.add_argument(
        "--warm-start",
        type=nonnegative_float,
        default=0.6,
        help="initial sessions start at a round drawn from the first FRACTION of their rounds, their history "
        "already cached (default 0.6; 0: from round 0)",
    )
    g = p.add_argument_group("model geometry (bytes per token = layers x 2 x kv-heads x head-dim x dtype)")
    g.add_argument("--layers", type=positive_int, default=32)
    g.add_argument("--kv-heads", type=positive_int, default=8)
    g.add_argument("--head-dim", type=positive_int, default=128)
    g.add_argument("--q-heads", type=positive_int, default=32)
    g.add_argument("--hidden", type=int, default=0, help="hidden size (default q-heads x head-dim)")
    g.add_argument("--ffn", type=positive_int, default=14336, help="FFN intermediate size (default 14336)")
    g.add_argument("--dtype", default="fp16", choices=list(DTYPE_BYTES))
    t = p.add_argument_group("tiers")
    t.add_argument("--block-tokens", type=positive_int, default=256, help="tokens per KV block (default 256)")
    t.add_argument("--hbm", type=size, default=parse_size("8G"), help="HBM tier capacity (default 8G)")
    t.add_argument("--dram", type=size, default=parse_size("8G"), help="DRAM tier capacity, pinned (default 8G)")
    t.add_argument(
        "--ssd",
        type=size,
        default=parse_size("32G"),
        help="SSD tier capacity for blocks demoted during the replay (default 32G; history comes on top)",
    )
    t.add_argument("--slab", default="/tmp/phx-kvtrace.slab", help="slab file of the SSD tier (and SLAB.history)")
    t.add_argument("--keep-slab", action="store_true", help="leave the slab files in place")
    p.add_argument(
        "--prefill-chunk", type=positive_int, default=4096, help="chunked prefill: tokens per chunk (default 4096)"
    )
    p.add_argument(
        "--compute",
        default="auto",
        choices=["auto", "torch", "cupy", "numpy"],
        help="prefill backend (default auto: torch, else CuPy on GPUs; NumPy on the host vendor)",
    )
    p.add_argument("--no-verify", dest="verify", action="store_false", help="do not poison and check loaded blocks")
    p.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")
    p.add_argument("--label", default="", help="a label for the records and the plot (e.g. 'local disk')")
    p.add_argument(
        "--dry-run", action="store_true", help="tiny geometry, trace and capacities: the same code path in seconds"
    )
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of p99 TTFT and QPS against concurrency")
    p.set_defaults(func=main, kv_cmd=None, _kv_parser=p)
    ksub = p.add_subparsers(dest="kv_cmd", metavar="{gen}")
    gp = ksub.add_parser("gen", help="write a generated trace (JSON lines) and print its statistics")
    _trace_args(gp)
    gp.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    gp.set_defaults(func=main_gen)


def apply_dry_run(args) -> None:
    """The --dry-run sizes, for every option left at its default."""
    parser = getattr(args, "_kv_parser", None)
    for k, v in DRY_RUN.items():
        if parser is None or getattr(args, k) == parser.get_default(k):
            setattr(args, k, v)


def main_gen(args) -> int:
    trace = generate(args.sessions, args.seed)
    write_trace(trace, args.out)
    print(json.dumps(trace_stats(trace), indent=1))
    print(f"trace of {len(trace.sessions)} sessions written to {args.out}")
    return 0


def _meta(args, rp, stats) -> dict:
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "label": args.label,
        "compute": rp.backend.name,
        "compute_label": rp.backend.label,
        "verify": args.verify,
        "verify_where": rp.backend.verify_where if args.verify else "off",
        "hbm_alloc": rp.cache.hbm_alloc,
        "geometry": asdict(rp.geo),
        "bytes_per_token": rp.geo.bytes_per_token,
        "block_tokens": args.block_tokens,
        "block_bytes": rp.bb,
        "hbm_bytes": rp.cache.hbm.nslots * rp.bb,
        "dram_bytes": rp.cache.dram.nslots * rp.bb,
        "ssd_dynamic_bytes": rp.cache.ssd.nslots * rp.bb,
        "history_bytes": len(rp.history) * rp.bb,
        "slab": args.slab,
        "slab_write_s": rp.slab_write_s,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
        "duration_s": args.duration,
        "warm_start": args.warm_start,
        "trace": args.trace or f"generated seed {args.seed}",
        "trace_stats": stats,
        "dry_run": args.dry_run,
        "real": "I/O (slab reads and writes), host<->device copies, prefill compute of the model's shape",
        "simulated": "sessions and their statistics (trace), think time "
        "(time scale), token counts (token scale), the model (no weights or tokens; one layer's matrices serve every "
        "layer), KV contents (verification patterns), decode (not run)",
    }


def run(args, log=print, on_record=None, records: list[dict] | None = None) -> list[dict]:
    """Every (concurrency, config) point, appended to ``records`` as it finishes;
    ``on_record(records)`` after each (partial results survive a kill)."""
    if args.dry_run:
        apply_dry_run(args)
    trace = read_trace(args.trace) if args.trace else generate(args.sessions, args.seed)
    stats = trace_stats(trace)
    rp = Replayer(args, trace, log=log)
    records = records if records is not None else []
    try:
        log(
            f"kv-trace: vendor {rp.rt.name}{' (TEST DOUBLE: device memory is host memory)' if rp.rt.is_test_double else ''}, "
            f"compute {rp.backend.label}; {rp.geo.bytes_per_token >> 10} KiB/token, block {rp.bb >> 10} KiB "
            f"({args.block_tokens} tokens); HBM {rp.cache.hbm.nslots} blocks, DRAM {rp.cache.dram.nslots}, "
            f"SSD {rp.cache.ssd.nslots} + {len(rp.history)} history"
        )
        log(
            f"simulated: trace ({'file ' + args.trace if args.trace else f'generated, seed {args.seed}'}), think times x "
            f"{args.time_scale:g}, token counts x {args.token_scale:g}, {args.duration:g} s per point; decode not run"
        )
        rp.prepare()
        meta = _meta(args, rp, stats)
        for conc in args.concurrency:
            for cfg in args.configs:
                rec = rp.run_point(cfg, conc)
                rec["label"] = args.label
                rec["meta"] = meta
                rec["warnings"] = tier_warnings(rec)
                records.append(rec)
                empty = [t.upper() for t in TIERS.get(cfg, ()) if rec["counts"].get(f"{t}_loads", 0) == 0]
                log(
                    f"  {cfg:<8} conc {conc:>3}: {rec['rounds']} rounds, p99 TTFT "
                    f"{rec['ttft_p99_s'] if rec['ttft_p99_s'] is None else round(rec['ttft_p99_s'], 3)} s, "
                    f"QPS {rec['qps']:.2f}{'' if rec['verified'] else ', VERIFICATION FAILED'}"
                    f"{'; WARNING: loaded nothing from ' + ' or '.join(empty) if empty else ''}"
                )
                if on_record:
                    on_record(records)
    finally:
        rp.close()
    return records


def _write_json(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(records, fh, indent=1)
    os.replace(tmp, path)


def main(args) -> int:
    if args.trace and not os.path.isfile(args.trace):
        raise FileNotFoundError(
            errno.ENOENT,
            f"--trace {args.trace}: no such file; write one with "
            "'phx bench kv-trace gen --out FILE', or leave --trace out to generate the trace",
        )
    vendor_runtime(select_only=True)  # an unknown or unusable PHX_VENDOR says what to set, before any work
    records: list[dict] = []
    try:
        run(args, on_record=(lambda recs: _write_json(args.json, recs)) if args.json else None, records=records)
    except BaseException as exc:  # the points that finished are reported, then the error (phoenix.cli._run)
        if records:
            why = "an interrupt" if isinstance(exc, KeyboardInterrupt) else "an error (the last line says which)"
            print(f"stopped by {why} after {len(records)} points; the points before it:")
            print(table(records))
        raise
    print(table(records))
    if records and records[0]["test_double"]:
        print(
            f"\nvendor {records[0]['vendor']} is a test double: 'device memory' is host memory and the prefill is a CPU "
            "stand-in; these are not accelerator figures."
        )
    m = records[0]["meta"] if records else {}
    print(
        f"simulated: think times x {m.get('time_scale')}, token counts x {m.get('token_scale')}; real: I/O, copies, compute of the shape."
    )
    if args.json:
        _write_json(args.json, records)
        print(f"records written to {args.json}")
    if args.plot:
        lab = f" [{args.label}]" if args.label else ""
        title = (
            f"phx bench kv-trace{lab}: vendor {m.get('vendor', records[0]['vendor'] if records else '?')}"
            f"{' (test double)' if records and records[0]['test_double'] else ''}, {m.get('bytes_per_token', 0) >> 10} KiB/token, "
            f"think x{m.get('time_scale')}, tokens x{m.get('token_scale')}"
        )
        print(plot(records, args.plot, title))
    failed = [r for r in records if not r["verified"]]
    if failed:
        print(f"VERIFICATION FAILED in {len(failed)} points: {failed[0]['failures'][:3]}", file=sys.stderr)
        return 1
    return 0
