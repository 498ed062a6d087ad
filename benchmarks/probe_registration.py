"""Probe what the warm-read path can build on: registering a page-cache mapping.

Measures on the selected vendor (meant for nvidia), for a file already in memory
(tmpfs or page cache): mmap + populate, host registration of the mapping (one call,
and split across threads), one DMA from it, and unregistration. Prints one JSON line
per figure. Used to choose the registration-cache design; not a product benchmark.

    python benchmarks/probe_registration.py /dev/shm/probe.bin 8G
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading
import time

from phoenix import registry
from phoenix.vendor import CopyKind, parse_size

REGISTER_PORTABLE, REGISTER_READ_ONLY = 1, 8


def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(label, fn, nbytes):
    c0, t0 = cpu(), time.perf_counter()
    out = fn()
    t, c = time.perf_counter() - t0, cpu() - c0
    print(json.dumps({"what": label, "seconds": round(t, 4), "gbps": round(nbytes / t / 1e9, 2),
                      "cpu_s_per_gb": round(c / (nbytes / 1e9), 4)}), flush=True)
    return out


def main():
    path, size = sys.argv[1], parse_size(sys.argv[2] if len(sys.argv) > 2 else "8G")
    rt = registry.get_runtime()
    if not os.path.exists(path) or os.path.getsize(path) < size:
        block = os.urandom(64 << 20)
        with open(path, "wb") as fh:
            for _ in range(size // len(block)):
                fh.write(block)
    fd = os.open(path, os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    MAP_SHARED, MAP_POPULATE, PROT_READ = 1, 0x8000, 1
    base = timed("mmap(MAP_POPULATE)", lambda: libc.mmap(None, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0), size)
    dev = rt.device_alloc(size, 0)
    stream = rt.stream_create(0)
    reg = rt.rt.host_register
    for flags in (REGISTER_PORTABLE | REGISTER_READ_ONLY, REGISTER_READ_ONLY, 0):
        try:
            timed(f"register 1 call flags={flags}", lambda f=flags: reg(ctypes.c_void_p(base), ctypes.c_size_t(size), f), size)
        except Exception as exc:
            print(json.dumps({"what": f"register flags={flags}", "error": str(exc)}), flush=True)
            continue

        def dma():
            off, step = 0, 1 << 30
            while off < size:
                rt.memcpy_async(dev + off, base + off, min(step, size - off), CopyKind.HOST_TO_DEVICE, stream)
                off += step
            rt.stream_synchronize(stream)

        timed("dma from registered mapping (first)", dma, size)
        timed("dma from registered mapping (again)", dma, size)
        timed("unregister", lambda: rt.rt.host_unregister(ctypes.c_void_p(base)), size)
        for nthreads in (4, 8, 16):
            piece = size // nthreads

            def par(flags=flags, n=nthreads, piece=piece):
                errs = []

                def one(i):
                    try:
                        reg(ctypes.c_void_p(base + i * piece), ctypes.c_size_t(piece), flags)
                    except Exception as exc:
                        errs.append(str(exc))

                ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
                [t.start() for t in ts]
                [t.join() for t in ts]
                if errs:
                    raise RuntimeError(errs[0])

            try:
                timed(f"register {nthreads} threads flags={flags}", par, size)
            except Exception as exc:
                print(json.dumps({"what": f"register {nthreads} threads", "error": str(exc)}), flush=True)
            for i in range(nthreads):
                try:
                    rt.rt.host_unregister(ctypes.c_void_p(base + i * piece))
                except Exception:
                    pass
        break
    rt.stream_destroy(stream)
    rt.device_free(dev)


if __name__ == "__main__":
    main()
