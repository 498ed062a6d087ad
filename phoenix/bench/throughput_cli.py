"""``phx bench``'s command line: its options, their checks against each other, and its entry.

Benchmark side, control plane. Every value is refused when the command line is read, in one
line naming the option: each by its type (a setting's own rule for --threads, --chunk and
--random-threads, every item of a list), the combinations by :func:`check_options` (a chunk
larger than --size, more threads than --size has chunks, a random read larger than the file),
all before a vendor is started or a file made (:func:`phoenix.bench.throughput.main` calls it
first). It imports nothing of the bench that measures.
"""

from __future__ import annotations

import argparse

from phoenix.cli._run import comma_list, output_file, plot_file, positive_int, positive_size, setting

from .args import aligned_size, in_flight
from .files import human
from .sweep import SWEEP_CHUNKS, SWEEP_THREADS

OPS = ("read", "write", "randread")
TEMPERATURES = ("cold", "warm")

_RAW_THREADS = "the raw reference's threads"


def add_parser(sub, func):
    """``phx bench``'s own parser (the throughput bench), running ``func(args)``
    (:func:`phoenix.bench.throughput.main`); phoenix.bench.cli hangs the others below it."""
    p = sub.add_parser(
        "bench",
        help="file <-> device throughput beside raw O_DIRECT, the naive loop and KvikIO",
        description="Measure reads and writes between a file and device memory of the selected vendor (PHX_VENDOR), "
        "beside, in the same run and at the same concurrency: raw O_DIRECT to host memory at the same threads x "
        "chunk (one configuration of the device, not its limit: --raw-sweep searches for the fastest), the naive "
        "loop (pread + synchronous copy), KvikIO where importable, and the pinned host->device copy on GPUs. Cold "
        "figures drop the file from the page cache first (fadvise; drop_caches when root); writes are timed with "
        "their fsync. The bench writes only a --file it made itself: a file of yours is only read (--ops read), "
        "and only if it holds --size bytes.",
    )
    p.add_argument(
        "--file",
        default="/tmp/phx-bench.bin",
        help="the bench file: created with random data if absent (and kept, marked as the bench's, for the next "
        "run); an existing file the bench did not make is only read, never written or extended: give it with "
        "--ops read and at most its size as --size (default /tmp/phx-bench.bin)",
    )
    p.add_argument(
        "--size",
        type=aligned_size,
        default=1 << 30,
        help="bytes to move, a multiple of 4096, e.g. 512M, 2G (default 1G)",
    )
    p.add_argument(
        "--threads",
        type=comma_list(item=setting("threads")),
        default=[4],
        metavar="N[,N...]",
        help="comma-separated concurrency levels, 1 to 1024 each, e.g. 1,4,16 (default 4)",
    )
    p.add_argument(
        "--chunk",
        type=setting("chunk_size"),
        default=16 << 20,
        help="chunk size per request piece, a multiple of 4096 from 4K to 1G, at most --size (default 16M)",
    )
    p.add_argument("--reps", type=positive_int, default=3, help="repetitions; the median is reported (default 3)")
    p.add_argument(
        "--ops",
        type=comma_list(OPS),
        default=["read", "write"],
        metavar="{" + ",".join(OPS) + "}[,...]",
        help="comma-separated of read, write, randread (default read,write)",
    )
    p.add_argument(
        "--temperature",
        type=comma_list(TEMPERATURES),
        default=["cold"],
        metavar="{cold,warm}[,...]",
        help="cold, warm or cold,warm (default cold)",
    )
    p.add_argument(
        "--random-bs",
        type=comma_list(item=aligned_size),
        default=[64 << 10],
        metavar="SIZE[,SIZE...]",
        help="random read sizes, multiples of 4096, each measured on its own, e.g. 4K,64K,1M (default 64K)",
    )
    p.add_argument(
        "--qd", type=in_flight, default=64, help="random reads in flight, 1 to 1024 (default 64: a raw thread each)"
    )
    p.add_argument("--random-ops", type=positive_int, default=20000, help="random reads per repetition (default 20000)")
    p.add_argument(
        "--random-threads",
        type=setting("threads"),
        default=8,
        help="phoenix workers for random reads; each keeps qd/threads reads in flight (default 8: "
        "on the H200 VM 8 x 8 matched the raw rate at 0.7x the CPU of 16 x 4)",
    )
    p.add_argument("--device", type=_device, default=0, help="device ordinal (default 0; 'phx info' lists the devices)")
    p.add_argument("--json", type=output_file, metavar="FILE", help="write the records as a JSON list")
    p.add_argument(
        "--plot",
        type=plot_file,
        metavar="FILE",
        help="write a PNG (needs matplotlib): a panel per operation and cache state, bars with "
        "the ratio to the raw reference and CPU s/GB (lines where several concurrencies ran)",
    )
    p.add_argument(
        "--fast-device",
        type=positive_size,
        metavar="SIZE",
        help="run on a loop device over RAM (stand-in for a fast NVMe array): a SIZE file in /dev/shm, a loop device "
        "over it with direct I/O on, ext4 on it (the raw device where mkfs.ext4 is missing), the bench file there; "
        "all torn down at the end, on errors and on Ctrl-C. Needs root, a free loop device and SIZE free in /dev/shm; "
        "SIZE a little above --size (ext4's metadata). --file is not used",
    )
    p.add_argument(
        "--fast-device-fs",
        choices=("ext4", "raw"),
        help="ext4 (default where mkfs.ext4 exists) or raw: the loop device itself as the bench file",
    )
    p.add_argument(
        "--raw-sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the raw O_DIRECT reference of each cold op over a grid of threads x chunk sizes (random reads: in "
        "flight), the plain reference's own point included, and divide the ratios by the fastest raw configuration "
        "measured, named (default: on with --fast-device)",
    )
    p.add_argument(
        "--phoenix-sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sweep phoenix too over the raw sweep's grid (sequential cold ops) and measure it at its best point, "
        "raw at its own best beside it (default: on with --fast-device)",
    )
    p.add_argument(
        "--sweep-threads",
        type=comma_list(item=setting("threads", _RAW_THREADS)),
        default=list(SWEEP_THREADS),
        metavar="N[,N...]",
        help="the sweep's thread counts, 1 to 1024 each (default 1,4,8,16,32; phoenix's own --threads are always "
        "added)",
    )
    p.add_argument(
        "--sweep-chunks",
        type=comma_list(item=setting("chunk_size", "the raw reference's chunk")),
        default=None,
        metavar="SIZE[,SIZE...]",
        help="the sweep's chunk sizes, at most --size each (default 1M,4M,16M, those up to --size; phoenix's own "
        "--chunk is always added)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=func)
    return p


def _device(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ordinal (0, 1, ...)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a device ordinal is 0 or more ('phx info' lists the devices)")
    return n


_device.__name__ = "ordinal"


def check_options(args) -> None:
    """Refuse, in one line naming them, options that contradict each other (nothing has run yet)."""
    size = args.size
    seq = bool({"read", "write"} & set(args.ops))  # random reads alone use neither --chunk nor --threads
    if seq and args.chunk > size:
        raise ValueError(
            f"--chunk {human(args.chunk)} is larger than --size {human(size)}: the file would be one piece, which "
            "one thread moves while the others idle; give --chunk at most --size (or a larger --size)"
        )
    pieces = size // args.chunk
    for t in args.threads if seq else ():
        if t > pieces:
            raise ValueError(
                f"--threads {t} at --chunk {human(args.chunk)}: --size {human(size)} has {pieces} chunk"
                f"{'s' if pieces != 1 else ''}, so only {pieces} thread{'s' if pieces != 1 else ''} would move data; "
                f"give --threads {pieces} or fewer, a smaller --chunk or a larger --size"
            )
    if args.sweep_chunks is None:  # the default grid: the chunks that fit
        args.sweep_chunks = [c for c in SWEEP_CHUNKS if c <= size] or [args.chunk]
    else:
        for c in args.sweep_chunks:
            if c > size:
                raise ValueError(f"--sweep-chunks {human(c)} is larger than --size {human(size)}: give chunks up to it")
    if args.phoenix_sweep and not args.raw_sweep:
        raise ValueError("--phoenix-sweep compares each side's best: it needs --raw-sweep too")
    if "randread" in args.ops:
        for bs in args.random_bs:
            if bs > size:
                raise ValueError(f"--random-bs {bs} is larger than --size {size}: no read fits in the file")
