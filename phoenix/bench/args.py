"""What the benches check of their command line before any work: option types and the vendor's devices.

Benchmark side, control plane. The types refuse a value when the command line is read, the
message naming the option (``--size``: a multiple of 4096, O_DIRECT's unit; ``--qd``: the
raw reference runs a thread per read in flight); :func:`check_device` refuses a device
ordinal the vendor does not have, or a buffer larger than that device's memory, naming the
option, before a file is made or memory allocated (the vendor's own error names neither).
"""

from __future__ import annotations

import argparse

from phoenix.cli._run import positive_size

#: O_DIRECT's unit: the raw references move whole multiples of it
ALIGN = 4096
#: the most threads the C references start (bench_raw.c refuses more)
MAX_RAW_THREADS = 1024


def aligned_size(text: str) -> int:
    """An argparse type: a size of at least 4096 and a multiple of it (the references read
    and write O_DIRECT, whole 4 KiB units)."""
    n = positive_size(text)
    if n % ALIGN:
        down = n // ALIGN * ALIGN
        hint = f"{down} or {down + ALIGN}" if down else f"{ALIGN}"
        raise argparse.ArgumentTypeError(f"{text!r}: O_DIRECT moves whole 4096-byte units; give a multiple ({hint})")
    return n


aligned_size.__name__ = "size"


def in_flight(text: str) -> int:
    """An argparse type: random reads in flight, 1 to :data:`MAX_RAW_THREADS` (the raw
    reference runs one thread per read in flight)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= MAX_RAW_THREADS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be between 1 and {MAX_RAW_THREADS} (the raw reference runs a thread per read in flight)"
        )
    return n


in_flight.__name__ = "number"


def check_device(
    rt, ordinal: int, need: int = 0, need_option: str = "--size", option: str = "--device", given: str = ""
) -> None:
    """Refuse a device ordinal ``rt`` does not have, or ``need`` bytes of device memory (what
    ``need_option`` asks for) more than that device has, in one line naming the option
    (``given``: the value as the command line gave it, default the ordinal)."""
    from .files import human

    devices = rt.devices()
    n = len(devices)
    if not 0 <= ordinal < n:
        have = "ordinal 0 only" if n == 1 else f"ordinals 0 to {n - 1}"
        raise ValueError(
            f"{option} {given or ordinal}: vendor {rt.name} has {n} device{'s' if n != 1 else ''} here ({have}); "
            "pick one of them ('phx info' lists them)"
        )
    total = devices[ordinal].total_memory
    if need and total and need > total:
        raise ValueError(
            f"{need_option} {human(need)} is more than device {ordinal}'s memory ({human(total)}, vendor {rt.name}): "
            f"the bench holds it in device memory; lower {need_option}"
        )
