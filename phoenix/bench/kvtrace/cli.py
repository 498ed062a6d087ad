"""``phx bench kv-trace [gen | plot]``: options, the run over (concurrency, configuration) points.

Benchmark side, control plane. ``run`` replays every point and records it (``on_record``
after each, so a killed run keeps what finished). Points run concurrency-major (every
configuration at one concurrency, then the next); ``--stop-over F`` leaves a configuration's
higher concurrencies unrun once the lower bound of its p99's interval exceeds F x the
threshold (a ``skipped`` record says so). ``--fast-device`` puts the slab on a loop device
over RAM (``phoenix.bench.fastdev``). ``report`` has the table, the plots and the limits;
``plot`` (the subcommand) draws several runs, one storage tier per panel column.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import math
import os
import platform
import socket
import sys
from dataclasses import asdict

from phoenix.cli._run import (
    add_subcommands,
    comma_list,
    nonnegative_float,
    nonnegative_int,
    output_file,
    plot_file,
    positive_int,
    positive_size,
    size,
    vendor_runtime,
)
from phoenix.vendor import parse_size

from .. import fastdev
from ..files import settings_env
from .compute import DTYPE_BYTES
from .replay import CONFIGS, Replayer
from .report import (  # noqa: F401 (re-exported: phoenix.bench.kvtrace.cli was their home)
    LEGEND,
    TIERS,
    best_concurrency,
    concurrency_limits,
    limits_text,
    plot,
    plot_tiers,
    round_phases,
    sample_warnings,
    table,
    tier_warnings,
)
from .trace import generate, read_trace, trace_stats, write_trace

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


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    x = nonnegative_float(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return x


def _fraction(text: str) -> float:
    """An argparse type: a number between 0 and 1."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be between 0 and 1 (a fraction of a session's rounds)")
    return x


def _factor(text: str) -> float:
    """An argparse type: 0 (off), or a multiple of the threshold of at least 1."""
    x = nonnegative_float(text)
    if 0 < x < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 (off) or at least 1 (a multiple of --threshold)")
    return x


def _trace_args(p) -> None:
    p.add_argument("--sessions", type=positive_int, default=64, help="sessions to generate (default 64)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="trace seed (default 0)")


def add_parser(sub) -> None:
    """``phx bench kv-trace [gen]``: called from phoenix.bench.cli.add_parser."""
    p = sub.add_parser(
        "kv-trace",
        help="replay an agentic KV-cache trace through DRAM-only, staged-SSD, KvikIO and phoenix tiers",
        description="Replay agentic sessions (a seeded trace with the statistics of Codex runs on SWE-bench Pro, or "
        "--trace FILE) through an HBM tier (vendor device memory), a DRAM tier (pinned host memory) and an SSD tier "
        "(a slab file), for the configurations dram (evicted KV is recomputed), staged (SSD through the naive staged "
        "loop), kvikio (SSD through KvikIO in compat mode) and phoenix (SSD through phoenix); prefill of uncached "
        "tokens is real compute of the model's shape. Reports TTFT (mean, p50, p99 with a bootstrap 95% CI), QPS and "
        "the most concurrent sessions under the TTFT threshold. 'phx bench kv-trace gen --out FILE' writes a trace; "
        "'phx bench kv-trace plot A.json B.json --out X.png' plots runs side by side (one per storage tier).",
    )
    _trace_args(p)
    p.add_argument("--trace", metavar="FILE", help="replay this trace file instead of generating one")
    p.add_argument(
        "--configs",
        type=comma_list(CONFIGS),
        default=None,
        metavar="{" + ",".join(CONFIGS) + "}[,...]",
        help="comma-separated of dram,staged,kvikio,phoenix (default all four; kvikio left out, with a note, where "
        "KvikIO and CuPy are not importable or the vendor is not nvidia)",
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
        help="seconds of replay per (config, concurrency) point, at least (default 20)",
    )
    p.add_argument(
        "--min-samples",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="a point also runs until it has N TTFT samples (rounds), up to --max-duration (default 0)",
    )
    p.add_argument(
        "--max-duration",
        type=_seconds,
        default=120.0,
        metavar="S",
        help="the longest a point runs to reach --min-samples; one stopped there has 'samples_short' in its record "
        "(default 120)",
    )
    p.add_argument(
        "--stop-over",
        type=_factor,
        default=0.0,
        metavar="FACTOR",
        help="once a configuration's p99 TTFT is certainly over FACTOR x --threshold (its 95%% CI's lower bound), "
        "its higher concurrencies are not run (default 0: off)",
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
        type=_fraction,
        default=0.6,
        help="initial sessions start at a round drawn from the first FRACTION of their rounds, their history "
        "already cached (default 0.6; 0: from round 0)",
    )
    g = p.add_argument_group("model geometry (bytes per token = layers x 2 x kv-heads x head-dim x dtype)")
    g.add_argument("--layers", type=positive_int, default=32)
    g.add_argument("--kv-heads", type=positive_int, default=8)
    g.add_argument("--head-dim", type=positive_int, default=128)
    g.add_argument("--q-heads", type=positive_int, default=32)
    g.add_argument("--hidden", type=nonnegative_int, default=0, help="hidden size (default q-heads x head-dim)")
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
    t.add_argument(
        "--slab",
        default="/tmp/phx-kvtrace.slab",
        help="slab file of the SSD tier (and SLAB.history); several, comma-separated (one per drive): the tier "
        "striped over them block by block",
    )
    t.add_argument("--keep-slab", action="store_true", help="leave the slab files in place (not on a --fast-device)")
    fastdev.add_argument(t, "the SSD tier's slab (--slab's file name)", auto=True, striped=True)
    k = p.add_argument_group("kvikio (the KvikIO configuration: compat mode, POSIX I/O in its thread pool)")
    k.add_argument("--kvikio-threads", type=positive_int, default=16, help="KvikIO's num_threads (default 16)")
    k.add_argument(
        "--kvikio-task", type=positive_size, default=parse_size("4M"), help="KvikIO's task_size (default 4M)"
    )
    k.add_argument(
        "--kvikio-direct",
        choices=("on", "off"),
        default="on",
        help="KvikIO's opportunistic Direct I/O (auto_direct_io_read/_write) for the slab (default on: O_DIRECT, as "
        "phoenix and staged read it; off: through the page cache, which on a host whose RAM holds the slab is an "
        "unbounded RAM tier the other configurations do not have)",
    )
    p.add_argument(
        "--write-behind",
        type=nonnegative_int,
        default=8,
        metavar="BLOCKS",
        help="phoenix and kvikio keep the BLOCKS least recently used DRAM blocks written to the SSD tier ahead of "
        "their eviction, in a writer thread (phoenix's writes at priority background), as an engine that offloads "
        "asynchronously does; a round that needs a DRAM slot then finds a clean one. The staged loop writes on "
        "eviction, in the round. 0: every configuration writes on eviction (default 8)",
    )
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
    p.add_argument(
        "--device", type=nonnegative_int, default=0, help="device ordinal (default 0; 'phx info' lists the devices)"
    )
    p.add_argument(
        "--label",
        default="",
        help="a label for the records and the plot (e.g. 'local disk'; with --fast-device, by default its own)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="tiny geometry, trace and capacities: the same code path in seconds"
    )
    p.add_argument("--json", type=output_file, metavar="FILE", help="write the records as a JSON list")
    p.add_argument(
        "--plot", type=plot_file, metavar="FILE", help="write a PNG of p99 TTFT (95%% CI) and QPS against concurrency"
    )
    p.set_defaults(func=main, kv_cmd=None, _kv_parser=p)
    ksub = add_subcommands(p, dest="kv_cmd", metavar="{gen,plot}")  # the replay's options: not before gen, plot
    gp = ksub.add_parser("gen", help="write a generated trace (JSON lines) and print its statistics")
    _trace_args(gp)
    gp.add_argument("--out", required=True, type=output_file, metavar="FILE", help="trace file to write")
    gp.set_defaults(func=main_gen)
    pp = ksub.add_parser(
        "plot",
        help="plot runs (their --json files) side by side: one panel column per storage tier",
        description="One panel column per FILE (a storage tier, titled by its records' label): p99 TTFT (log scale, "
        "95% CI bars, the threshold) and QPS against concurrent sessions, one line per configuration in the same "
        "color everywhere; points not run (--stop-over) are absent. Needs matplotlib.",
    )
    pp.add_argument("files", nargs="+", metavar="FILE", help="records of a run (phx bench kv-trace --json FILE)")
    pp.add_argument("--out", required=True, type=plot_file, metavar="PNG", help="the PNG to write")
    pp.add_argument("--title", default="", help="the figure's title (default: from the records)")
    pp.set_defaults(func=main_plot)


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


def _meta(args, rp, stats, note: str) -> dict:
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "env": settings_env(),
        "label": args.label,
        "configs": list(args.configs),
        "configs_note": note,
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
        "slab": ",".join(rp.slab.paths),
        "slab_write_s": rp.slab_write_s,
        "storage": args.fast_device_info["label"] if getattr(args, "fast_device_info", None) else "",
        "fast_device": getattr(args, "fast_device_info", None),
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
        "duration_s": args.duration,
        "min_samples": args.min_samples,
        "max_duration_s": args.max_duration,
        "stop_over": args.stop_over,
        "kvikio_threads": args.kvikio_threads,
        "kvikio_task": args.kvikio_task,
        "kvikio_direct": args.kvikio_direct,
        "write_behind": args.write_behind,
        "warm_start": args.warm_start,
        "trace": args.trace or f"generated seed {args.seed}",
        "trace_stats": stats,
        "dry_run": args.dry_run,
        "real": "I/O (slab reads and writes), host<->device copies, prefill compute of the model's shape",
        "simulated": "sessions and their statistics (trace), think time "
        "(time scale), token counts (token scale), the model (no weights or tokens; one layer's matrices serve every "
        "layer), KV contents (verification patterns), decode (not run)",
    }


def check_options(args) -> None:
    """Refuse option values that contradict each other (after --dry-run's sizes)."""
    if args.max_duration < args.duration:
        raise ValueError(
            f"--max-duration {args.max_duration:g} is shorter than --duration {args.duration:g}: give it at least "
            "as long (it caps the time a point spends reaching --min-samples)"
        )
    n = getattr(args, "fast_devices", 1)
    if n > 1 and not getattr(args, "fast_device", None):
        raise ValueError(
            f"--fast-devices {n} stripes the slab over loop devices that --fast-device makes: give --fast-device "
            "SIZE|auto too (or --slab A,B,... to stripe it over files of your own drives)"
        )
    if getattr(args, "fast_device", None) and "," in args.slab:
        raise ValueError(
            f"--fast-device puts one slab file on each loop device (--fast-devices N of them): give --slab one "
            f"file name, not {args.slab!r}"
        )


def resolve_configs(args, vendor: str) -> tuple[list[str], str]:
    """The configurations to run, and a note: ``kvikio`` asked for where it cannot run is
    refused (one line, why); left to the default, it is left out with a note."""
    asked = args.configs
    if asked is not None and "kvikio" not in asked:
        return list(asked), ""
    from . import kvikio_io

    ok, why = kvikio_io.support(vendor)
    if asked is None:
        if ok:
            return list(CONFIGS), ""
        return [c for c in CONFIGS if c != "kvikio"], f"kvikio left out of the default configs: {why}"
    if not ok:
        raise (ImportError if "importable" in why else ValueError)(f"--configs kvikio: {why}; {kvikio_io.HINT}")
    return list(asked), ""


def _skipped(cfg: str, conc: int, reason: str, rp, args, meta: dict) -> dict:
    """The record of a point not run (--stop-over): no figures, the reason."""
    return {
        "config": cfg,
        "concurrency": conc,
        "skipped": reason,
        "vendor": rp.rt.name,
        "test_double": bool(rp.rt.is_test_double),
        "rounds": 0,
        "samples": 0,
        "qps": None,
        "ttft_mean_s": None,
        "ttft_p50_s": None,
        "ttft_p99_s": None,
        "ttft_p99_ci_s": None,
        "threshold_s": args.threshold,
        "under_threshold": False,
        "verified": True,
        "label": args.label,
        "storage": meta["storage"],
        "meta": meta,
        "warnings": [],
    }


def run(args, log=print, on_record=None, records: list[dict] | None = None) -> list[dict]:
    """Every (concurrency, config) point, appended to ``records`` as it finishes;
    ``on_record(records)`` after each (partial results survive a kill)."""
    if args.dry_run:
        apply_dry_run(args)
    check_options(args)
    trace = read_trace(args.trace) if args.trace else generate(args.sessions, args.seed)
    stats = trace_stats(trace)
    rp = Replayer(args, trace, log=log)
    records = records if records is not None else []
    try:
        args.configs, note = resolve_configs(args, rp.rt.name)
        if note:
            log(f"note: {note}")
        n = getattr(args, "fast_devices", 1) if getattr(args, "fast_device", None) else rp.slab.lanes
        need = rp.slab.nbytes(n) if any(c != "dram" for c in args.configs) else 4096
        share = f" per device, {n} files striped" if n > 1 else ""
        with fastdev.directories(args, need, what=f"the SSD tier's slab ({need / 2**30:.2f} GiB{share})") as mnts:
            if mnts:
                rp.slab.move([os.path.join(m, os.path.basename(rp.slab.path)) for m in mnts])
                args.label = args.label or args.fast_device_info["label"]
            try:
                _points(args, rp, stats, note, log, on_record, records)
            finally:
                rp.close()  # the slab goes before the device under it
    finally:
        rp.close()
    return records


def _points(args, rp, stats, note, log, on_record, records) -> None:
    log(
        f"kv-trace: vendor {rp.rt.name}{' (TEST DOUBLE: device memory is host memory)' if rp.rt.is_test_double else ''}, "
        f"compute {rp.backend.label}; {rp.geo.bytes_per_token >> 10} KiB/token, block {rp.bb >> 10} KiB "
        f"({args.block_tokens} tokens); HBM {rp.cache.hbm.nslots} blocks, DRAM {rp.cache.dram.nslots}, "
        f"SSD {rp.cache.ssd.nslots} + {len(rp.history)} history; configs {','.join(args.configs)}"
    )
    per_point = f"{args.duration:g} s per point" + (
        f" and {args.min_samples} samples (at most {args.max_duration:g} s)" if args.min_samples else ""
    )
    log(
        f"simulated: trace ({'file ' + args.trace if args.trace else f'generated, seed {args.seed}'}), think times x "
        f"{args.time_scale:g}, token counts x {args.token_scale:g}, {per_point}; decode not run"
    )
    rp.prepare()
    meta = _meta(args, rp, stats, note)
    over: dict = {}  # config -> (concurrency, why): --stop-over, its higher concurrencies are not run
    for conc in args.concurrency:
        for cfg in args.configs:
            if cfg in over and conc > over[cfg][0]:
                rec = _skipped(cfg, conc, over[cfg][1], rp, args, meta)
                records.append(rec)
                log(f"  {cfg:<8} conc {conc:>3}: not run, {rec['skipped']}")
                if on_record:
                    on_record(records)
                continue
            rec = rp.run_point(cfg, conc)
            rec["label"] = args.label
            if meta["storage"]:
                rec["storage"], rec["fast_device"] = meta["storage"], meta["fast_device"]
            rec["meta"] = meta
            rec["warnings"] = tier_warnings(rec) + sample_warnings(rec)
            records.append(rec)
            empty = [t.upper() for t in TIERS.get(cfg, ()) if rec["counts"].get(f"{t}_loads", 0) == 0]
            ci, p99 = rec["ttft_p99_ci_s"], rec["ttft_p99_s"]
            log(
                f"  {cfg:<8} conc {conc:>3}: {rec['rounds']} rounds in {rec['seconds']:.1f} s, p99 TTFT "
                f"{'-' if ci is None else f'{p99:.3f} s (95% CI {ci[0]:.3f}-{ci[1]:.3f})'}, "
                f"QPS {rec['qps']:.2f}{'' if rec['verified'] else ', VERIFICATION FAILED'}"
                f" (besides: {', '.join(f'{k} {v:.1f} s' for k, v in rec.get('phase_s', {}).items())})"
                f"; a round's TTFT, mean: {round_phases(rec)}"
                f"{'; WARNING: loaded nothing from ' + ' or '.join(empty) if empty else ''}"
            )
            for w in sample_warnings(rec):
                log(f"  WARNING: {w}")
            limit = args.stop_over * args.threshold
            if args.stop_over and ci and ci[0] > limit and (cfg not in over or conc < over[cfg][0]):
                over[cfg] = (
                    conc,
                    f"p99 already {rec['ttft_p99_s']:.3g} s at concurrency {conc} (95% CI from {ci[0]:.3g} s, over "
                    f"--stop-over {args.stop_over:g} x the {args.threshold:g} s threshold)",
                )
            if on_record:
                on_record(records)


def _write_json(path: str, records: list[dict]) -> None:
    """``path`` replaced whole (a kill leaves the previous records, never half a file), through a
    temporary file of its own beside it (never another file of that name)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open(path, "w") would make it (mkstemp's is 0600)
        with os.fdopen(fd, "w") as fh:
            json.dump(records, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _title(records: list[dict], what: str) -> str:
    r = next((r for r in records if r.get("meta")), records[0] if records else {})
    m = r.get("meta", {})
    return (
        f"phx bench kv-trace{what}: vendor {r.get('vendor', '?')}{' (test double)' if r.get('test_double') else ''}, "
        f"{m.get('bytes_per_token', 0) >> 10} KiB/token, think x{m.get('time_scale')}, tokens x{m.get('token_scale')}"
    )


def main(args) -> int:
    if args.trace and os.path.isdir(args.trace):
        raise IsADirectoryError(errno.EISDIR, f"--trace {args.trace}: is a directory; give a trace file")
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
            if args.plot:  # a run cut by a time limit still draws what it measured
                print(plot(records, args.plot, _title(records, f" [{args.label}]" if args.label else "")))
        raise
    print(table(records))
    if records and records[0]["test_double"]:
        print(
            f"\nvendor {records[0]['vendor']} is a test double: 'device memory' is host memory and the prefill is a CPU "
            "stand-in; these are not accelerator figures."
        )
    kv = next((r["kvikio"] for r in records if r.get("kvikio")), None)
    if kv and kv["test_double"]:
        print("the kvikio module is a test double (tests/kvikio_double.py): its figures are not KvikIO's.")
    m = records[0]["meta"] if records else {}
    print(
        f"simulated: think times x {m.get('time_scale')}, token counts x {m.get('token_scale')}; real: I/O, copies, compute of the shape."
    )
    if args.json:
        _write_json(args.json, records)
        print(f"records written to {args.json}")
    if args.plot:
        print(plot(records, args.plot, _title(records, f" [{args.label}]" if args.label else "")))
    failed = [r for r in records if not r["verified"]]
    if failed:
        print(f"VERIFICATION FAILED in {len(failed)} points: {failed[0]['failures'][:3]}", file=sys.stderr)
        return 1
    return 0


def read_records(path: str) -> list[dict]:
    """The records of a run (``--json``), refused in one line where the file is not one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            errno.ENOENT, f"{path}: no such file (give the --json files of 'phx bench kv-trace' runs)"
        )
    try:
        with open(path) as fh:
            records = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    not_a_run = "not the records of a 'phx bench kv-trace' run (its --json: a list of points)"
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: {not_a_run}")
    for i, r in enumerate(records):
        problem = record_problem(r)
        if problem:
            raise ValueError(f"{path}: record {i}: {problem}; {not_a_run}")
    return records


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record_problem(r) -> str | None:
    """What makes ``r`` no point record that the table, the limits and the plots can read (None:
    nothing): the keys they read, of the types ``--json`` writes them with."""
    if not isinstance(r, dict):
        return f"a {type(r).__name__}, not a JSON object"
    missing = [k for k in ("config", "concurrency", "threshold_s") if k not in r]
    if missing:
        return f"no {', '.join(missing)}"
    if not isinstance(r["config"], str):
        return f"config is {r['config']!r}, not a name"
    if not isinstance(r["concurrency"], int) or isinstance(r["concurrency"], bool) or r["concurrency"] < 1:
        return f"concurrency is {r['concurrency']!r}, not a whole number of at least 1"
    if not _number(r["threshold_s"]) or r["threshold_s"] < 0:
        return f"threshold_s is {r['threshold_s']!r}, not a number of seconds"
    for k in ("label", "storage"):
        if r.get(k) is not None and not isinstance(r[k], str):
            return f"{k} is {r[k]!r}, not text"
    if r.get("skipped"):  # a point not run: its reason, no figures
        return None if isinstance(r["skipped"], str) else f"skipped is {r['skipped']!r}, not a reason"
    if not isinstance(r.get("under_threshold"), bool):
        return f"under_threshold is {r.get('under_threshold')!r}, not true or false"
    p99, ci, qps = r.get("ttft_p99_s"), r.get("ttft_p99_ci_s"), r.get("qps")
    if p99 is not None and not _number(p99):
        return f"ttft_p99_s is {p99!r}, not a number of seconds"
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(_number(x) for x in ci)):
        return f"ttft_p99_ci_s is {ci!r}, not [low, high] in seconds"
    if p99 is not None and not _number(qps):
        return f"qps is {qps!r}, not a number"
    return None


def main_plot(args) -> int:
    runs = [(os.path.basename(p), read_records(p)) for p in args.files]
    title = args.title or _title(runs[0][1], ": p99 TTFT (95% CI) and QPS per storage tier")
    print(plot_tiers(runs, args.out, title))
    for name, recs in runs:
        print(f"{name}: {limits_text(recs)}")
    return 0
