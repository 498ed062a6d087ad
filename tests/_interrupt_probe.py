"""Interrupt phoenix's calls at random points and check that nothing moves afterwards.

Run as a script by tests/test_interrupts.py (a subprocess each: a hang or a crash fails
the test instead of the test run). One call kind, one kind of memory, one way to deliver
the interruption; prints one JSON line of what it saw:

* an exception (a signal handler's, or KeyboardInterrupt) that leaves a call must leave
  nothing of the call running: the destination (a read) or the file (a write) is the same
  30 ms later as when the exception arrived ("stray"), and holds only the bytes it had or
  the right ones ("garbage");
* afterwards no user is counted in the file or the engine, no request, stream op or fence
  is live in the core, and a read from another thread finishes.

The interruptions come from ``setitimer`` (SIGALRM in the main thread), from another thread
(``pthread_kill`` of the main thread with SIGUSR1) or as KeyboardInterrupt
(``_thread.interrupt_main``), at a random moment of the call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np

import phoenix.io as pio
import phoenix.settings as ps
from phoenix._futures import _prune_stream_ops

POISON = 0xA5
KINDS = (
    "read",
    "pread",
    "write",
    "read_many",
    "write_many",
    "batch_read",
    "batch_write",
    "read_async",
    "write_async",
    "open_close",
    "register",
)
WRITES = {"write", "write_many", "batch_write", "write_async"}
STREAM = {"read_async", "write_async"}


class Interrupt(Exception):
    """What the signal handler raises."""


def _raise(signum, frame):
    raise Interrupt(signum)


class Memory:
    """The destination / source: host memory (NumPy) or the host vendor's device memory."""

    def __init__(self, kind: str, n: int):
        self.kind, self.n = kind, n
        if kind == "host":
            self.arr = np.empty(n, np.uint8)
            self.obj = self.arr
        elif kind == "bytearray":  # resizable: exported while any request of a call uses it
            self.ba = bytearray(n)
            self.obj = self.ba
        else:
            from phoenix.registry import get_runtime

            self.rt = get_runtime()  # the selected vendor's (PHX_VENDOR): the host vendor's arena in CI
            self.ptr = self.rt.device_alloc(n)
            self.obj = (self.ptr, n)

    def fill(self, data: np.ndarray) -> None:
        if self.kind == "bytearray":
            self.ba[:] = data.tobytes()
        elif self.kind == "host":
            self.arr[:] = data
        else:
            from phoenix.vendor import CopyKind

            self.rt.memcpy(self.ptr, data.ctypes.data, data.nbytes, CopyKind.HOST_TO_DEVICE)

    def get(self) -> np.ndarray:
        if self.kind == "bytearray":
            return np.frombuffer(bytes(self.ba), np.uint8)
        if self.kind == "host":
            return self.arr.copy()
        from phoenix.vendor import CopyKind

        out = np.empty(self.n, np.uint8)
        self.rt.memcpy(out.ctypes.data, self.ptr, self.n, CopyKind.DEVICE_TO_HOST)
        return out


def file_bytes(path: str, n: int) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(os.pread(fd, n, 0), np.uint8).copy()
    finally:
        os.close(fd)


class Source:
    """Delivers one interruption at a random moment after arm()."""

    def __init__(self, how: str, rng: random.Random, most_s: float):
        self.how, self.rng, self.most = how, rng, most_s
        self.main = threading.get_ident()
        signal.signal(signal.SIGALRM, _raise)
        signal.signal(signal.SIGUSR1, _raise)
        self._timer = None

    def arm(self) -> None:
        delay = self.rng.uniform(0, self.most)
        if self.how == "itimer":
            signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
            return
        import _thread

        def fire():
            if self.how == "thread":
                signal.pthread_kill(self.main, signal.SIGUSR1)
            else:
                _thread.interrupt_main()

        self._timer = threading.Timer(delay, fire)
        self._timer.start()

    def disarm(self) -> None:
        """Wait for the interruption to have been delivered (or cancel it)."""
        if self.how == "itimer":
            signal.setitimer(signal.ITIMER_REAL, 0)
        elif self._timer is not None:
            self._timer.cancel()
            self._timer.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--memory", default="host", choices=("host", "device", "bytearray"))
    ap.add_argument("--source", default="itimer", choices=("itimer", "thread", "kbd"))
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    nrng = np.random.default_rng(args.seed)

    size = 16 << 20
    path = os.path.join(args.dir, f"probe-{args.kind}.bin")
    content = nrng.integers(0, 256, size, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(content.tobytes())
    new = nrng.integers(0, 256, size, dtype=np.uint8)  # what writes write
    mem = Memory(args.memory, size)
    nblk = size // 4096
    perm = nrng.permutation(nblk).astype(np.int64)
    offs = perm * 4096  # read_many: block i of the buffer <- block perm[i] of the file
    f = pio.open(path, "r+")
    with ps.override(chunk_size="64K"):
        t0 = time.perf_counter()
        run(args.kind, f, mem, path, size, offs, new)  # (also builds the engine)
        t0 = time.perf_counter()
        run(args.kind, f, mem, path, size, offs, new)
        took = time.perf_counter() - t0
    src = Source(args.source, rng, 1.3 * took)  # interruptions land anywhere in a call
    out = {"kind": args.kind, "memory": args.memory, "source": args.source, "calls": 0, "interrupted": 0}
    out.update(stray=0, garbage=0, max_changed=0, other=[], call_s=round(took, 4))
    want_dest = content[(offs[:, None] + np.arange(4096)).reshape(-1)] if args.kind == "read_many" else content

    with ps.override(chunk_size="64K"):  # many chunks per call: the window is wide
        for _ in range(args.trials):
            if args.kind in WRITES:
                with open(path, "r+b") as fh:
                    fh.write(content.tobytes())
                mem.fill(new)
            else:
                mem.fill(np.full(size, POISON, np.uint8))
            raised = None
            held.clear()
            try:
                src.arm()
                run(args.kind, f, mem, path, size, offs, new)
            except (Interrupt, KeyboardInterrupt) as exc:
                raised = exc
            except Exception as exc:  # anything else is a finding
                raised = exc
                out["other"].append(f"{type(exc).__name__}: {exc}"[:200])
            # the check runs with no interruption pending
            try:
                src.disarm()
            except (Interrupt, KeyboardInterrupt):
                pass
            out["calls"] += 1
            if raised is None or args.kind in ("open_close", "register"):
                continue
            out["interrupted"] += 1
            for fut in held:  # (returned to the caller: theirs to wait for)
                fut.wait()
            held.clear()
            if args.kind in STREAM:
                # an op whose call returned runs when its stream gets there: let it, then
                # nothing may change any more (a call that raised queued nothing)
                _prune_stream_ops(wait=True)
            if args.kind in WRITES:
                before = file_bytes(path, size)
                time.sleep(0.03)
                after = file_bytes(path, size)
                ok = (after == content) | (after == new)
            else:
                before = mem.get()
                time.sleep(0.03)
                after = mem.get()
                ok = (after == POISON) | (after == want_dest)
            changed = int(np.count_nonzero(before != after))
            if changed:
                out["stray"] += 1
                out["max_changed"] = max(out["max_changed"], changed)
            if not ok.all():
                out["garbage"] += 1
            if args.memory == "bytearray":  # no export may outlive the call that raised
                try:
                    mem.ba.append(0)
                    del mem.ba[-1]
                except BufferError:
                    out["still_exported"] = out.get("still_exported", 0) + 1
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # nothing left counted, nothing left live, and another thread's read finishes
    out["file_users"] = f._users
    eng = pio._current_engine()
    out["engine_users"] = eng.users if hasattr(eng, "users") else getattr(eng, "_users", None)
    probe = np.empty(1 << 20, np.uint8)
    t = threading.Thread(target=lambda: f.read(probe, 1 << 20, 0), daemon=True)
    t.start()
    t.join(20)
    out["other_thread_read"] = not t.is_alive()
    f.close()
    st = pio.stats()
    out["live"] = {k: st[k] for k in ("requests", "stream_ops", "files")}
    print(json.dumps(out))
    sys.stdout.flush()
    return 0


held: list = []  # futures the calls under test returned


def run(kind, f, mem, path, size, offs, new) -> None:
    if kind == "read":
        f.read(mem.obj, size, 0)
    elif kind == "pread":
        # the future is the caller's once pread returned: an exception inside its result()
        # leaves it running, the caller's to wait for (the probe does); pread itself must not
        held.append(f.pread(mem.obj, size, 0))
        held[-1].result()
    elif kind == "write":
        f.write(mem.obj, size, 0)
    elif kind == "read_many":
        f.read_many(mem.obj, offs, 4096)
    elif kind == "write_many":
        f.write_many(mem.obj, np.arange(offs.size, dtype=np.int64) * 4096, 4096)
    elif kind in ("batch_read", "batch_write"):
        op = "read" if kind == "batch_read" else "write"
        step = 64 << 10
        pio.batch([(f, mem.obj, step, o, o, op) for o in range(0, size, step)])
    elif kind in ("read_async", "write_async"):
        # one op per call: an op whose call returned is the caller's to wait for
        call = f.read_async if kind == "read_async" else f.write_async
        call(mem.obj, size, 0, 0, 0).result()
    elif kind == "open_close":
        for _ in range(20):
            with pio.open(path, "r") as g:
                g.size()
    elif kind == "register":
        for _ in range(20):
            pio.register(mem.obj)
            pio.deregister(mem.obj)


if __name__ == "__main__":
    sys.exit(main())
