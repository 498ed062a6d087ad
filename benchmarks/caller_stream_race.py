"""The caller-stream race, measured: torch work queued before a phoenix call, no synchronize.

Benchmark side (GPU). The scenarios of the caller-stream issue, each run ``--runs`` times
on ``--size`` bytes, counting the runs whose bytes are wrong:

* ``zeros_read``: ``t = torch.zeros(n, device="cuda"); f.read(t)`` (the zero fill must
  land before the read's bytes);
* ``side_fill_read``: ``with torch.cuda.stream(s): t.fill_(0); f.read(t)``;
* ``copy_write``: ``y.copy_(x); f.write(y)`` (the file must get x);
* each again with the stream held busy first (``torch.cuda._sleep``), which makes the
  race certain where the code does not order with the caller's stream.

Run it with the phoenix to test first on ``PYTHONPATH`` (the benchmarks compare the tree
before and after the ordering change in one call)::

    PHX_VENDOR=nvidia python benchmarks/caller_stream_race.py --file /dev/shm/race.bin --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True, help="scratch file (made and removed here)")
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes per run (default 1 GiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)

    import torch

    import phoenix
    import phoenix.io as pio

    n = args.size
    dev = torch.device("cuda")
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    with open(args.file, "wb") as fh:
        fh.write(data.cpu().numpy().tobytes())
    expect = data
    cycles = int(2e8)  # about 0.1 s of a spinning kernel

    def zeros_read(f, busy):
        if busy:
            torch.cuda._sleep(cycles)
        t = torch.zeros(n, dtype=torch.uint8, device=dev)
        f.read(t)
        torch.cuda.synchronize()
        return torch.equal(t, expect)

    def side_fill_read(f, busy):
        t = torch.empty(n, dtype=torch.uint8, device=dev)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            if busy:
                torch.cuda._sleep(cycles)
            t.fill_(0)
            f.read(t)
        s.synchronize()
        return torch.equal(t, expect)

    def copy_write(f, busy):
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        y = torch.zeros(n, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(cycles)
        y.copy_(x)
        f.write(y)
        torch.cuda.synchronize()
        back = torch.empty(n, dtype=torch.uint8, device=dev)
        f.read(back)
        torch.cuda.synchronize()
        return torch.equal(back, x)

    out = {"phoenix": os.path.dirname(phoenix.__file__), "size": n, "runs": args.runs, "wrong": {}, "seconds": {}}
    with pio.open(args.file, "r+") as f:
        for name, fn in (("zeros_read", zeros_read), ("side_fill_read", side_fill_read), ("copy_write", copy_write)):
            for busy in (False, True):
                key = name + ("_busy" if busy else "")
                t0 = time.perf_counter()
                wrong = sum(not fn(f, busy) for _ in range(args.runs))
                out["wrong"][key] = wrong
                out["seconds"][key] = round(time.perf_counter() - t0, 3)
                if key.startswith("copy_write"):  # restore the file for the reads
                    torch.cuda.synchronize()
                    f.write(expect)
                print(f"{key:22s} wrong {wrong} of {args.runs}", flush=True)
    os.unlink(args.file)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
