"""Registered page-cache windows are given back: after a warm phoenix read and the idle
timeout, ``drop_caches`` evicts the file again (issue 22's check on a real machine).

Bench side, control plane. Needs root (drop_caches) and a vendor with device memory.

    PHX_VENDOR=nvidia python3 benchmarks/pagecache_release.py --file /root/phx-pc.bin --size 8G \
        --json out.json

Two phases, each in its own process (a fresh phoenix, default settings but the idle
timeout): ``idle`` (PHX_FMAP_IDLE default) warm-reads the file into device memory twice
(the second read is served from registered windows), waits for the idle timeout, drops the
page cache while the process is still alive, and times a raw buffered read of the file;
``held`` does the same with PHX_FMAP_IDLE=0 (windows never released), for contrast. A
buffered read at device speed means the file was evicted; at memory speed, it was not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import phoenix.io as pio, phoenix.settings as ps
from phoenix import registry
F, wait = sys.argv[1], float(sys.argv[2])
G = 1 << 30
n = os.path.getsize(F)
rt = registry.get_runtime()
ptr = rt.device_alloc(G, 0)
out = {"settings": {"fmap_cache": ps.get().fmap_cache, "fmap_idle": ps.get().fmap_idle}}
with pio.open(F) as f:
    for i in range(2):
        t = time.time()
        for off in range(0, n, G):
            f.read((ptr, G), min(G, n - off), off)
        out[f"phoenix_read_{i}_gbps"] = n / (time.time() - t) / 1e9
        pio.fmap_wait(60)
    info = pio.fmap_info()
    out["warm"] = {"pinned": info["pinned"], "windows": info["windows"], "hits": info["hits"],
                   "stats_fmap_bytes": pio.stats()["fmap_bytes"]}
    time.sleep(wait)
    info = pio.fmap_info()
    out["after_wait"] = {"pinned": info["pinned"], "windows": info["windows"],
                         "idle_releases": info["idle_releases"]}
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as d:
        d.write("3\n")
    fd = os.open(F, os.O_RDONLY)
    t = time.time()
    got = 0
    while True:
        b = os.read(fd, 16 << 20)
        if not b:
            break
        got += len(b)
    out["buffered_read_after_drop_gbps"] = got / (time.time() - t) / 1e9
    os.close(fd)
print(json.dumps(out))
"""


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True)
    ap.add_argument("--size", default="8G")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = parse_size(args.size)
    if not os.path.exists(args.file) or os.path.getsize(args.file) != n:
        block = os.urandom(64 << 20)
        with open(args.file, "wb") as fh:
            for _ in range(n // len(block)):
                fh.write(block)
        os.sync()
    idle = float(os.environ.get("PHX_FMAP_IDLE_DEMO", "30"))
    record = {"argv": sys.argv, "file": args.file, "size": n, "phases": {}}
    for phase, env, wait in (("idle", {"PHX_FMAP_IDLE": str(idle)}, idle + 6), ("held", {"PHX_FMAP_IDLE": "0"}, 3)):
        subprocess.run(["cat", args.file], stdout=subprocess.DEVNULL, check=True)  # in the page cache
        p = subprocess.run(
            [sys.executable, "-c", CHILD, args.file, str(wait)],
            env={**os.environ, **env},
            cwd="/",  # not the source tree: the installed package
            capture_output=True,
            text=True,
        )
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            record["phases"][phase] = {"error": p.stderr[-2000:]}
            continue
        record["phases"][phase] = json.loads(p.stdout.strip().splitlines()[-1])
        print(phase, json.dumps(record["phases"][phase]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
