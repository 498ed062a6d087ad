"""``phx bench loader``: phxloader against ``safetensors``, fastsafetensors and raw O_DIRECT, cold and warm.

Benchmark side, control plane: it loads a safetensors file through :mod:`phoenix.phxloader`
(the adapter, which knows nothing of this bench), through ``safetensors.torch.load_file`` and,
where it is importable, fastsafetensors (the peers: ``loader_peers.py``), beside a raw
O_DIRECT read of the same file into host memory (``raw.py``), interleaved in one run.
``--make SIZE`` first writes an LLM-like multi-dtype file (:func:`make_bench_file`).

``--fast-device SIZE`` puts the file on a loop device over RAM (``fastdev.py``, a stand-in
for a fast NVMe array) and sweeps the raw reference first (threads x chunk, one cold run per
point); its best configuration is then measured interleaved with the loaders, and every
ratio divides by that re-measured best. phxloader is swept too (I/O workers x bytes in
flight, :data:`PHX_GRID` and the settings' own), and its fastest point is the one measured
with the others, as an operator sets PHX_THREADS and PHX_INFLIGHT for a device. Issue 21's
figure is read off one such run:
phxloader cold at least :data:`TARGET_RAW` x the raw best and faster than safetensors cold.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np

from phoenix.cli._run import comma_list, output_file, positive_int, positive_size, setting, vendor_runtime
from phoenix.phxloader import ALIGN, DEFAULT_CHUNK, DEFAULT_DEPTH, DTYPES, load_file, read_header, save_file
from phoenix.settings import get as settings
from phoenix.settings import override

from . import fastdev
from .args import check_device
from .files import BenchFiles, drop_cache, settings_env, warm_cache
from .loader_peers import fastsafetensors_impl, safetensors_impl
from .raw import raw_transfer
from .sweep import SWEEP_CHUNKS, config_text, select_sweep

RAW_CHUNK = 16 << 20  #: the raw reference's chunk without a sweep
SWEEP_THREADS = (4, 8, 16, 32)  #: the raw sweep's thread counts (phoenix's own are always added)
DEFAULT_NAME = "model.safetensors"  #: the file's name on the fast device when none is given
TARGET_RAW = 0.90  #: issue 21: phxloader cold / the raw best, on the fast device, at least this
OWN_FS = "the file's own file system"
#: phxloader's sweep: (I/O workers, bytes of file I/O in flight), cold, one run per point (the
#: settings' own point is added). A device served by CPU copies (a loop device) is fastest
#: with few bytes and workers in flight (phx bench's read sweep: 2 MiB); a fast NVMe array wants more.
PHX_GRID = (
    (1, 2 << 20),
    (2, 2 << 20),
    (1, 4 << 20),
    (1, 16 << 20),
    (2, 4 << 20),
    (2, 16 << 20),
    (4, 4 << 20),
    (4, 16 << 20),
    (8, 8 << 20),
    (16, 16 << 20),
)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


# -- the raw reference: swept once cold, its best re-measured with the loaders ---------------


def sweep_points(threads, chunks, own: tuple[int, int]) -> list[tuple[int, int]]:
    """The (threads, chunk) points of the raw sweep: ``threads`` x ``chunks`` plus phoenix's
    own (``own``: its I/O threads and chunk size), in order, each once."""
    return sorted({(t, c) for t in threads for c in chunks} | {own})


def raw_sweep(path: str, nbytes: int, points, quiet: bool = False) -> list[dict]:
    """One cold raw O_DIRECT read of ``nbytes`` of ``path`` per point (the page cache dropped
    before each); a record per point."""
    out = []
    for i, (t, c) in enumerate(points):
        drop_cache(path)
        t0 = time.perf_counter()
        n = raw_transfer(path, False, False, nbytes, min(c, nbytes), t)
        secs = time.perf_counter() - t0
        out.append({"threads": t, "chunk": c, "config": config_text(t, c), "gbps": n / secs / 1e9, "seconds": secs})
        if not quiet:
            print(f"raw sweep {i + 1}/{len(points)}: {out[-1]['config']} {out[-1]['gbps']:.2f} GB/s", file=sys.stderr)
    return out


def pick_best(points: list[dict], own: tuple[int, int]) -> dict | None:
    """The sweep's best point by GB/s (the first of equals), with the point at phoenix's own
    configuration beside it; None for an empty sweep."""
    best, at = select_sweep(points, *own)
    if best is None:
        return None
    return {
        "threads": best["threads"],
        "chunk": best["chunk"],
        "config": best["config"],
        "sweep_gbps": best["gbps"],
        "best_of": len(points),
        "at_phoenix": {"config": at["config"], "gbps": at["gbps"]} if at else None,
    }


def phx_config_text(threads: int, inflight: int) -> str:
    """E.g. "4 workers x 4 MiB in flight" (0: the default, 64 MiB per worker)."""
    w = f"{threads} worker{'s' if threads != 1 else ''}"
    return f"{w} x {inflight >> 20} MiB in flight" if inflight else f"{w} x 64 MiB in flight each"


def phx_sweep(path: str, points, run, quiet: bool = False, before=None) -> list[dict]:
    """One cold phxloader load (``run()``: bytes loaded) per (threads, inflight) point, its
    workers and bounce pool made and ``before()`` called (e.g. the device allocator's cache
    emptied, as before every measured load) before the timing; a record per point."""
    import phoenix.io

    out = []
    for i, (t, f) in enumerate(points):
        with override(threads=t, inflight=f):
            phoenix.io.prepare()
            if before:
                before()
            drop_cache(path)
            t0 = time.perf_counter()
            n = run()
            secs = time.perf_counter() - t0
        out.append(
            {"threads": t, "inflight": f, "config": phx_config_text(t, f), "gbps": n / secs / 1e9, "seconds": secs}
        )
        if not quiet:
            print(
                f"phxloader sweep {i + 1}/{len(points)}: {out[-1]['config']} {out[-1]['gbps']:.2f} GB/s",
                file=sys.stderr,
            )
    return out


# -- the run ---------------------------------------------------------------------------------


def bench(
    path,
    device="cuda",
    reps: int = 3,
    *,
    chunk: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
    raw_threads: int | None = None,
    raw_chunk: int = RAW_CHUNK,
    sweep: bool = False,
    sweep_threads=SWEEP_THREADS,
    sweep_chunks=SWEEP_CHUNKS,
    phoenix_sweep: bool = False,
    phoenix_grid=PHX_GRID,
    storage: str = OWN_FS,
    fast_device: dict | None = None,
    vendor: str | None = None,
    test_double: bool = False,
    quiet: bool = False,
) -> dict:
    """phxloader, ``safetensors.torch.load_file(path, device=...)`` and fastsafetensors (where
    importable), each cold and warm, beside a raw O_DIRECT read of the same file into host
    memory, in ``reps`` interleaved repetitions (each starting one implementation further on).

    Cold: the file is dropped from the page cache first (fadvise; drop_caches when root);
    warm: it was read into it first. ``sweep``: the raw reference is first swept over
    ``sweep_threads`` x ``sweep_chunks`` (one cold run per point) and then measured at its
    best point; without, at ``raw_threads`` (phoenix's threads) x ``raw_chunk``.
    ``phoenix_sweep``: phxloader is first swept cold over ``phoenix_grid`` (threads, bytes in
    flight) plus the settings' own point, and measured at its fastest. Meant for an
    accelerator (``device="cuda"``): on ``"cpu"`` safetensors only maps the file (its tensors
    are paged in when touched), so its CPU figures are not comparable. Returns
    ``{impl: {"gbps": median GB/s (1e9), "x_raw": ..., "seconds": [...]}, "ratios": ...,
    "skipped": {peer: why}, ...}`` and prints a table unless ``quiet``. E.g.::

        phx bench loader /nvme/model.safetensors --device cuda --reps 3
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    torch = _torch()
    s = settings()
    own = (s.threads, s.chunk_size)
    raw_size = size // ALIGN * ALIGN  # O_DIRECT: the aligned body of the file (all but < 4 KiB)

    def sync():
        if torch is not None and str(device).startswith("cuda"):
            torch.cuda.synchronize()

    def fresh():
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    sweep_recs: list[dict] = []
    best = None
    if sweep:
        sweep_recs = raw_sweep(path, raw_size, sweep_points(sweep_threads, sweep_chunks, own), quiet)
        best = pick_best(sweep_recs, own)
    raw_t, raw_c = (best["threads"], best["chunk"]) if best else (raw_threads or s.threads, raw_chunk)

    def raw():
        return raw_transfer(path, False, False, raw_size, min(raw_c, raw_size), raw_t)

    last_stats: dict = {}

    def load():
        sd = load_file(path, device, chunk=chunk, depth=depth)
        sync()
        last_stats.update(sd.stats)
        return sd.stats["bytes"]

    own_phx = (s.threads, s.inflight)
    phx_recs: list[dict] = []
    phx_pick = None
    if phoenix_sweep:
        load()  # untimed: the first load's one-time costs (runtime, allocator) are no point's
        phx_recs = phx_sweep(path, sorted(set(phoenix_grid) | {own_phx}), load, quiet, before=fresh)
        phx_pick = max(phx_recs, key=lambda p: p["gbps"])
    pick = {"threads": phx_pick["threads"], "inflight": phx_pick["inflight"]} if phx_pick else {}

    def phx():
        with override(**pick):
            return load()

    impls = [("raw_odirect_cold", raw, False), ("phxloader_cold", phx, False), ("phxloader_warm", phx, True)]
    peers: dict = {}
    skipped: dict = {}
    for peer, make in (("safetensors", safetensors_impl), ("fastsafetensors", fastsafetensors_impl)):
        fn, why, info = make(path, device, torch, sync)
        if fn is None:
            skipped[peer] = why
            continue
        peers[peer] = info
        impls += [(f"{peer}_cold", fn, False), (f"{peer}_warm", fn, True)]
    import phoenix.io

    with override(**pick):
        phoenix.io.prepare()  # the worker pool and its pinned bounce slots, untimed
    runs: dict = {name: [] for name, _, _ in impls}
    stats_of: dict = {}  # phxloader's own stats per repetition
    nbytes: dict = {}
    for rep in range(reps):
        k = rep % len(impls)
        for name, fn, warm in impls[k:] + impls[:k]:
            if name not in runs:  # a peer that failed in an earlier repetition
                continue
            if warm:
                warm_cache(path, size)
            else:
                drop_cache(path)
            fresh()
            t0 = time.perf_counter()
            try:
                nbytes[name] = fn()
            except Exception as exc:
                peer = name.rsplit("_", 1)[0]
                if peer not in peers:
                    raise  # phoenix's own and the reference: an error is reported, not skipped
                skipped[peer] = f"failed: {type(exc).__name__}: {exc}"
                for cache in ("cold", "warm"):
                    runs.pop(f"{peer}_{cache}", None)
                continue
            runs[name].append(time.perf_counter() - t0)
            if fn is phx:
                stats_of.setdefault(name, []).append(dict(last_stats))
    res: dict = {
        "argv": sys.argv,
        "env": settings_env(),
        "file": path,
        "size": size,
        "device": str(device),
        "vendor": vendor,
        "test_double": test_double,
        "storage": storage,
        "reps": reps,
        "chunk": chunk,
        "depth": depth,
        "raw_threads": raw_t,
        "raw_chunk": raw_c,
        "cache_drop": drop_cache(path),
        "impls": [name for name, _, _ in impls if name in runs],
        "skipped": skipped,
        "peers": {p: i for p, i in peers.items() if p not in skipped},
    }
    if fast_device:
        res["fast_device"] = fast_device
    if sweep:
        res["raw_sweep"] = sweep_recs
        res["raw_best"] = best
    if phoenix_sweep:
        at = next((p for p in phx_recs if (p["threads"], p["inflight"]) == own_phx), None)
        res["phoenix_sweep"] = phx_recs
        res["phoenix_pick"] = dict(phx_pick, best_of=len(phx_recs), at_settings=at)
    for name in res["impls"]:
        med = statistics.median(runs[name])
        impl, cache = name.rsplit("_", 1)
        res[name] = {
            "impl": impl,
            "cache": cache,
            "storage": storage,
            "gbps": nbytes[name] / med / 1e9,
            "seconds": runs[name],
            "bytes": nbytes[name],
        }
        if name in stats_of:
            res[name]["stats"] = stats_of[name]
    raw_gbps = res["raw_odirect_cold"]["gbps"]
    res["raw_odirect_cold"].update(threads=raw_t, chunk=raw_c, config=config_text(raw_t, raw_c), best=bool(best))
    for name in res["impls"]:
        res[name]["x_raw"] = res[name]["gbps"] / raw_gbps
    ratios = {"phxloader_cold / raw_odirect_cold": res["phxloader_cold"]["gbps"] / raw_gbps}
    for peer in res["peers"]:
        for cache in ("cold", "warm"):
            a, b = f"phxloader_{cache}", f"{peer}_{cache}"
            ratios[f"{a} / {b}"] = res[a]["gbps"] / res[b]["gbps"]
    res["ratios"] = ratios
    if fast_device:
        res["target"] = target(res)
    if not quiet:
        report(res)
    return res


def target(res: dict) -> dict:
    """Issue 21's figure of this run: phxloader cold / the raw best (at least :data:`TARGET_RAW`)
    and / safetensors cold (above 1); ``met`` is None where safetensors did not run."""
    over_raw = res["ratios"]["phxloader_cold / raw_odirect_cold"]
    over_st = res["ratios"].get("phxloader_cold / safetensors_cold")
    met = None if over_st is None else over_raw >= TARGET_RAW and over_st > 1
    return {"phxloader_cold / raw_best": over_raw, "phxloader_cold / safetensors_cold": over_st, "met": met}


def report(res: dict) -> None:
    """The table (GB/s and the ratio to the raw reference of each implementation, cold and
    warm), the sweep, the peers skipped and why, the ratios and the legend."""
    print(f"{res['file']}: {res['size'] / 1e9:.2f} GB -> {res['device']}, median of {res['reps']}, on {res['storage']}")
    best = res.get("raw_best")
    print(f"  {'impl':16s} {'cache':5s} {'GB/s':>8s} {'x raw':>8s}   seconds of each repetition")
    for name in res["impls"]:
        r = res[name]
        note = ""
        if name == "raw_odirect_cold":
            swept = f", the best of {best['best_of']} swept" if best else ""
            note = f"   ({r['config']}{swept})"
        secs = " ".join(f"{x:.3f}" for x in r["seconds"])
        print(f"  {r['impl']:16s} {r['cache']:5s} {r['gbps']:8.2f} {r['x_raw']:7.3f}x   {secs} s{note}")
    for peer, why in res["skipped"].items():
        print(f"  {peer}: {why}")
    if best:
        pts = ", ".join(f"{p['threads']}x{p['chunk'] >> 20}M {p['gbps']:.2f}" for p in res["raw_sweep"])
        at = best["at_phoenix"]
        print(
            f"  raw O_DIRECT sweep (cold, one run per point, GB/s): {pts}; best {best['config']} "
            f"{best['sweep_gbps']:.2f}" + (f"; at phoenix's {at['config']}: {at['gbps']:.2f}" if at else "")
        )
    pick = res.get("phoenix_pick")
    if pick:
        pts = ", ".join(f"{p['config']} {p['gbps']:.2f}" for p in res["phoenix_sweep"])
        at = pick["at_settings"]
        print(
            f"  phxloader sweep (cold, one run per point, GB/s): {pts}; measured at its fastest, {pick['config']}"
            + (f"; at the settings' own {at['config']}: {at['gbps']:.2f}" if at else "")
        )
    for k, v in res["ratios"].items():
        print(f"  {k:38s} {v:.3f}")
    t = res.get("target")
    if t:
        st = t["phxloader_cold / safetensors_cold"]
        verdict = {True: "MET", False: "NOT MET", None: "not judged (safetensors did not run)"}[t["met"]]
        print(
            f"  issue 21 target (phxloader cold >= {TARGET_RAW:.2f}x the raw best and faster than safetensors cold, "
            f"this run): {t['phxloader_cold / raw_best']:.3f}x raw, "
            + (f"{st:.3f}x safetensors: " if st is not None else "")
            + verdict
        )
    print(
        "  (GB/s: bytes loaded / seconds, 1 GB = 10^9 bytes, median of the interleaved repetitions; cold: the page "
        "cache dropped first, warm: the file in it; raw_odirect: an O_DIRECT read of the file into host memory at the "
        "configuration named in its row"
        + (
            ", the best of the sweep, re-measured with the others"
            if best
            else " (one configuration of the device, not its limit: --raw-sweep looks for the fastest)"
        )
        + "; x raw: GB/s / raw_odirect's; a ratio above 1: phxloader faster)"
    )
    print(f"  storage: {res['storage']}")
    if res.get("test_double"):
        print(
            f"  vendor {res['vendor']} is a test double: 'device memory' is host memory; these are not accelerator figures."
        )
    for st in res["phxloader_cold"].get("stats", []):
        keys = ("requests", "alloc_seconds", "submit_seconds", "wait_seconds", "seconds")
        print("  phxloader_cold: " + ", ".join(f"{k} {st[k]}" for k in keys if k in st))


# -- the bench file ----------------------------------------------------------------------------


def _width(size: int) -> int:
    """The model width of a bench file of ``size``: 4096, halved (down to 256) while one
    layer (22 d^2 bytes) would be larger than the whole file."""
    d = 4096
    while d > 256 and 22 * d * d > size:
        d //= 2
    return d


def bench_file_bytes(size: int) -> int:
    """An upper bound of the bytes :func:`make_bench_file` writes for ``size``: it stops after
    the layer that reaches ``size``."""
    d = _width(size)
    return size + 22 * d * d + 5 * d + (1 << 20)


def make_bench_file(path, size: int = 4 << 30, seed: int = 0) -> str:
    """Write a multi-dtype safetensors file of about ``size`` bytes (LLM-like: a few large
    BF16/F16/F32 matrices per layer, small norms and biases, an F8 and an I64 tensor)."""
    rng = np.random.default_rng(seed)
    tensors, dtypes, total, layer = {}, {}, 0, 0
    d = _width(size)
    while total < size:
        mats = {
            f"layers.{layer}.attn.qkv.weight": (3 * d, d, "BF16"),
            f"layers.{layer}.mlp.up.weight": (4 * d, d, "BF16"),
            f"layers.{layer}.mlp.down.weight": (d, 4 * d, "F16"),
            f"layers.{layer}.norm.weight": (d, 1, "F32"),
            f"layers.{layer}.attn.scale": (d, 1, "F8_E4M3"),
        }
        for name, (r, c, dt) in mats.items():
            isz = DTYPES[dt].itemsize
            raw = rng.integers(0, 256, r * c * isz, dtype=np.uint8)
            tensors[name] = raw.view(np.dtype(DTYPES[dt].raw)).reshape(r, c) if isz > 1 else raw.reshape(r, c)
            dtypes[name] = dt
            total += r * c * isz
        layer += 1
    tensors["position_ids"] = np.arange(8192, dtype=np.int64)
    save_file(
        tensors, path, metadata={"format": "pt", "generator": "phoenix.bench.loader.make_bench_file"}, dtypes=dtypes
    )
    return os.fspath(path)


# -- the command line ----------------------------------------------------------------------------

DEVICE_FORMS = "auto, cuda[:N], phx[:N] or cpu"


def device_arg(text: str) -> str:
    """An argparse type: ``auto``, ``cuda[:N]``, ``phx[:N]`` or ``cpu``."""
    if not re.fullmatch(r"auto|cpu|(cuda|phx)(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: {DEVICE_FORMS}")
    return text


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` where torch sees a CUDA device, else ``phx`` (device memory of the
    selected vendor). ``cuda`` without CUDA is refused with what to use instead."""
    if device != "auto" and not device.startswith("cuda"):
        return device
    torch = _torch()
    if torch is None:
        why = "torch is not installed"
    elif not torch.cuda.is_available():
        why = "torch sees no CUDA device"
    else:
        return "cuda" if device == "auto" else device
    if device == "auto":
        return "phx"
    vendor = vendor_runtime(select_only=True).name
    raise ValueError(
        f"--device {device}: no CUDA on this machine ({why}); use --device phx (device memory of the "
        f"selected vendor, here {vendor!r}) or --device cpu"
    )


def check_device_arg(device: str) -> None:
    """Refuse a device ordinal that is not there (``phx:N``: the vendor's devices; ``cuda:N``:
    torch's), naming --device, before any file is made."""
    kind, _, num = device.partition(":")
    if not num:
        return
    n = int(num)
    if kind == "phx":
        check_device(vendor_runtime(), n, given=device)
        return
    torch = _torch()
    if kind == "cuda" and torch is not None and torch.cuda.is_available() and n >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(
            f"--device {device}: torch sees {count} CUDA device{'s' if count != 1 else ''} (cuda:0 to "
            f"cuda:{count - 1}); pick one of them"
        )


def add_parser(sub) -> None:
    """``phx bench loader [FILE]``: called from phoenix.bench.cli.add_parser."""
    b = sub.add_parser(
        "loader",
        help="phxloader vs safetensors vs fastsafetensors vs raw O_DIRECT, cold and warm",
        description="Load a safetensors file with phxloader, safetensors.torch.load_file and fastsafetensors "
        "(where importable), cold (page cache dropped) and warm, beside a raw O_DIRECT read of the same file, "
        "interleaved.",
    )
    b.add_argument(
        "file",
        nargs="?",
        help="a .safetensors file (--make writes one); with --fast-device: its name on the device "
        f"(default {DEFAULT_NAME}, written there by --make), or the path of an existing file to copy there",
    )
    b.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help=f"where the tensors go: {DEVICE_FORMS} (default auto: cuda where torch sees a CUDA device, "
        "else phx, device memory of the vendor PHX_VENDOR selects)",
    )
    b.add_argument("--reps", type=positive_int, default=3, help="repetitions; the median is reported (default 3)")
    b.add_argument(
        "--chunk",
        type=positive_size,
        default=DEFAULT_CHUNK,
        help="bytes of tensors allocated and submitted per group (default 256M)",
    )
    b.add_argument("--depth", type=positive_int, default=DEFAULT_DEPTH, help="groups in flight (default 8)")
    b.add_argument(
        "--make", metavar="SIZE", type=positive_size, help="first write a multi-dtype file of SIZE (e.g. 8G) if absent"
    )
    fastdev.add_argument(b, "the safetensors file")
    b.add_argument(
        "--raw-sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sweep the raw O_DIRECT reference over threads x chunk sizes first (one cold run per point), then "
        "measure its best point with the loaders, every ratio against it (default: on with --fast-device)",
    )
    b.add_argument(
        "--sweep-threads",
        type=comma_list(item=setting("threads", "the raw reference's threads")),
        default=list(SWEEP_THREADS),
        metavar="N[,N...]",
        help="the sweep's thread counts (default 4,8,16,32; phoenix's own threads x chunk size is always added)",
    )
    b.add_argument(
        "--sweep-chunks",
        type=comma_list(item=setting("chunk_size", "the raw reference's chunk")),
        default=list(SWEEP_CHUNKS),
        metavar="SIZE[,SIZE...]",
        help="the sweep's chunk sizes (default 1M,4M,16M)",
    )
    b.add_argument(
        "--phoenix-sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sweep phxloader over I/O workers x bytes in flight first (1,2,4,8,16 workers, 4-16 MiB, and the "
        "settings' own; one cold run per point), then measure it at its fastest (default: on with --fast-device)",
    )
    b.add_argument("--json", type=output_file, metavar="OUT", help="also write the result as JSON")
    b.set_defaults(func=main)


def _size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def placement(args) -> tuple[str | None, str, int]:
    """With ``--fast-device``: (the file to copy there or None, its name there, the bytes
    it needs), refused before any device is set up where it cannot work."""
    name = args.file or DEFAULT_NAME
    if os.sep in name or (os.altsep and os.altsep in name):
        if os.path.isdir(name):
            raise IsADirectoryError(errno.EISDIR, f"{name}: is a directory; give a .safetensors file")
        if not os.path.isfile(name):
            raise FileNotFoundError(
                errno.ENOENT,
                f"{name}: no such file; with --fast-device, FILE is a name on the device (--make SIZE writes it "
                f"there, e.g. {DEFAULT_NAME}) or the path of an existing file to copy there",
            )
        src, name, need = name, os.path.basename(name), os.path.getsize(name)
    elif not args.make:
        raise ValueError(
            f"--fast-device: the loop device starts empty; give --make SIZE (e.g. --make 8G) to write {name} "
            f"there, or FILE as the path of an existing file to copy there (e.g. ./{name})"
        )
    else:
        src, need = None, bench_file_bytes(args.make)
    want = fastdev.needed(need, "ext4")
    if args.fast_device < want:
        what = f"a {_size_text(need)} copy of {src}" if src else f"the --make {_size_text(args.make)} file"
        raise ValueError(
            f"--fast-device {_size_text(args.fast_device)} cannot hold {what} on ext4: "
            f"give --fast-device {-(-want // 2**20)}M or more"
        )
    return src, name, need


def main(args) -> int:
    sel = vendor_runtime(select_only=True)  # a PHX_VENDOR typo is refused even where only host memory is used
    fast = getattr(args, "fast_device", None)
    if args.raw_sweep is None:
        args.raw_sweep = bool(fast)
    if args.phoenix_sweep is None:
        args.phoenix_sweep = bool(fast)
    if not fast and not args.file:
        raise ValueError("give a .safetensors FILE (--make SIZE writes one there), or --fast-device SIZE --make SIZE")
    src, name, need = placement(args) if fast else (None, args.file, 0)
    check_device_arg(args.device)
    device = resolve_device(args.device)
    if args.device != device:
        print(
            f"device: {device} ({'torch sees a CUDA device' if device == 'cuda' else 'no CUDA here: device memory of the selected vendor'})"
        )
    opts = dict(
        chunk=args.chunk,
        depth=args.depth,
        sweep=args.raw_sweep,
        sweep_threads=args.sweep_threads,
        sweep_chunks=args.sweep_chunks,
        phoenix_sweep=args.phoenix_sweep,
        vendor=sel.name,
        test_double=bool(sel.runtime_cls.is_test_double),
    )
    if fast:
        with fastdev.directory(args, need) as mnt:
            path = os.path.join(mnt, name)
            if src:
                shutil.copyfile(src, path)
            else:
                make_bench_file(path, args.make)
            res = bench(path, device, args.reps, storage=fastdev.LABEL, fast_device=args.fast_device_info, **opts)
    else:
        if os.path.isdir(args.file):
            raise IsADirectoryError(errno.EISDIR, f"{args.file}: is a directory; give a .safetensors file")
        if not args.make and not os.path.isfile(args.file):
            raise FileNotFoundError(
                errno.ENOENT,
                f"{args.file}: no such file; give a .safetensors file, or --make SIZE "
                "(e.g. --make 1G) to write one there first",
            )
        # the file is only read (an existing one of any kind, the user's too, as it is); one
        # --make writes is the bench's, removed if the writing fails or is interrupted; locked
        # for the run either way (two benches on one file measure each other)
        with BenchFiles("phx bench loader") as files:
            made = not os.path.exists(args.file)
            need = bench_file_bytes(args.make) if made else 0
            files.claim(args.file, 0, "FILE", write=made, fill=False, need=need, size_option="--make")
            if made:
                make_bench_file(args.file, args.make)
            read_header(args.file)  # a file that is no safetensors is refused before any timing
            res = bench(args.file, device, args.reps, **opts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"result written to {args.json}")
    return 0
