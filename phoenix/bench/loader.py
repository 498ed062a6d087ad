"""``phx bench loader``: phxloader against ``safetensors`` and raw O_DIRECT, cold and warm.

Benchmark side, control plane: it loads a safetensors file through :mod:`phoenix.phxloader`
(the adapter, which knows nothing of this bench) and through ``safetensors.torch.load_file``,
beside a raw O_DIRECT read of the same file into host memory (``raw.py``), interleaved in one
run. ``--make SIZE`` first writes an LLM-like multi-dtype file (:func:`make_bench_file`).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import statistics
import sys
import time

import numpy as np

from phoenix.cli._run import positive_int, positive_size, vendor_runtime
from phoenix.phxloader import ALIGN, DEFAULT_CHUNK, DEFAULT_DEPTH, DTYPES, load_file, save_file
from phoenix.settings import get as settings

from .files import drop_cache, warm_cache
from .raw import raw_transfer


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def bench(
    path,
    device="cuda",
    reps: int = 3,
    *,
    chunk: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
    raw_threads: int | None = None,
    raw_chunk: int = 16 << 20,
    quiet: bool = False,
) -> dict:
    """phxloader cold and warm vs ``safetensors.torch.load_file(path, device=...)`` cold and
    warm vs a raw O_DIRECT read of the same file into host memory, interleaved in one run.

    Cold: the file is dropped from the page cache first (fadvise; drop_caches when root).
    Meant for an accelerator (``device="cuda"``): on ``"cpu"`` safetensors only maps the
    file (its tensors are paged in when touched), so its CPU figures are not comparable.
    Returns {impl: {"gbps": median GB/s (1e9), "seconds": [...]}, "ratios": ..., ...} and
    prints a table unless ``quiet``. Run it on the accelerator machine, e.g.::

        phx bench loader /nvme/model.safetensors --device cuda --reps 3
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    torch = _torch()
    threads = raw_threads or settings().threads

    def sync():
        if torch is not None and str(device).startswith("cuda"):
            torch.cuda.synchronize()

    raw_size = size // ALIGN * ALIGN  # O_DIRECT: the aligned body of the file (all but < 4 KiB)

    def raw():
        return raw_transfer(path, False, False, raw_size, min(raw_chunk, raw_size), threads)

    last_stats: dict = {}

    def phx():
        sd = load_file(path, device, chunk=chunk, depth=depth)
        sync()
        last_stats.update(sd.stats)
        return sd.stats["bytes"]

    def st():
        from safetensors.torch import load_file as st_load

        sd = st_load(path, device=str(device))
        sync()
        n = sum(t.numel() * t.element_size() for t in sd.values())
        del sd
        return n

    impls = [("raw_odirect_cold", raw, False), ("phxloader_cold", phx, False), ("phxloader_warm", phx, True)]
    import phoenix.io

    phoenix.io.prepare()  # the worker pool and its pinned bounce slots, untimed
    try:
        import safetensors.torch  # noqa: F401

        if torch is not None and not str(device).startswith("phx"):
            impls += [("safetensors_cold", st, False), ("safetensors_warm", st, True)]
    except ImportError:
        pass
    runs: dict = {name: [] for name, _, _ in impls}
    stats_of: dict = {}  # phxloader's own stats per repetition
    nbytes: dict = {}
    for _ in range(reps):
        for name, fn, warm in impls:
            if warm:
                warm_cache(path, size)
            else:
                drop_cache(path)
            if torch is not None and torch.cuda.is_available():
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            nbytes[name] = fn()
            runs[name].append(time.perf_counter() - t0)
            if fn is phx:
                stats_of.setdefault(name, []).append(dict(last_stats))
    res: dict = {
        "argv": sys.argv,
        "file": path,
        "size": size,
        "device": str(device),
        "reps": reps,
        "chunk": chunk,
        "depth": depth,
        "raw_threads": threads,
        "cache_drop": drop_cache(path),
    }
    for name in runs:
        med = statistics.median(runs[name])
        res[name] = {"gbps": nbytes[name] / med / 1e9, "seconds": runs[name], "bytes": nbytes[name]}
        if name in stats_of:
            res[name]["stats"] = stats_of[name]
    ratios = {"phxloader_cold / raw_odirect_cold": res["phxloader_cold"]["gbps"] / res["raw_odirect_cold"]["gbps"]}
    if "safetensors_cold" in res:
        ratios["phxloader_cold / safetensors_cold"] = res["phxloader_cold"]["gbps"] / res["safetensors_cold"]["gbps"]
        ratios["phxloader_warm / safetensors_warm"] = res["phxloader_warm"]["gbps"] / res["safetensors_warm"]["gbps"]
    res["ratios"] = ratios
    if not quiet:
        print(f"{path}: {size / 1e9:.2f} GB -> {device}, median of {reps}")
        for name in runs:
            print(f"  {name:20s} {res[name]['gbps']:8.2f} GB/s   " + " ".join(f"{s:.3f}" for s in runs[name]) + " s")
        for k, v in ratios.items():
            print(f"  {k:36s} {v:.3f}")
        print(
            "  (GB/s: file bytes / seconds, 1 GB = 10^9 bytes, median of the repetitions, each repetition's seconds "
            "after it; cold: the page cache dropped first, warm: the file in it; raw_odirect: an O_DIRECT read into "
            "host memory, the storage limit; a ratio above 1: phxloader faster)"
        )
        for st in res["phxloader_cold"].get("stats", []):
            print(
                "  phxloader_cold: "
                + ", ".join(
                    f"{k} {st[k]}"
                    for k in ("requests", "alloc_seconds", "submit_seconds", "wait_seconds", "seconds")
                    if k in st
                )
            )
    return res


def make_bench_file(path, size: int = 4 << 30, seed: int = 0) -> str:
    """Write a multi-dtype safetensors file of about ``size`` bytes (LLM-like: a few large
    BF16/F16/F32 matrices per layer, small norms and biases, an F8 and an I64 tensor)."""
    rng = np.random.default_rng(seed)
    tensors, dtypes, total, layer = {}, {}, 0, 0
    while total < size:
        d = 4096
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


def add_parser(sub) -> None:
    """``phx bench loader FILE``: called from phoenix.bench.cli.add_parser."""
    b = sub.add_parser(
        "loader",
        help="phxloader vs safetensors vs raw O_DIRECT, cold and warm",
        description="Load a safetensors file with phxloader and with safetensors.torch.load_file, "
        "cold (page cache dropped) and warm, beside a raw O_DIRECT read of the same file, interleaved.",
    )
    b.add_argument("file", help="a .safetensors file (--make writes one)")
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
    b.add_argument("--json", metavar="OUT", help="also write the result as JSON")
    b.set_defaults(func=main)


def main(args) -> int:
    vendor_runtime(select_only=True)  # a PHX_VENDOR typo is refused even where only host memory is used
    device = resolve_device(args.device)
    if args.device != device:
        print(
            f"device: {device} ({'torch sees a CUDA device' if device == 'cuda' else 'no CUDA here: device memory of the selected vendor'})"
        )
    if args.make and not os.path.exists(args.file):
        make_bench_file(args.file, args.make)
    if not os.path.isfile(args.file):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{args.file}: no such file; give a .safetensors file, or --make SIZE "
            "(e.g. --make 1G) to write one there first",
        )
    res = bench(args.file, device, args.reps, chunk=args.chunk, depth=args.depth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
