"""The kv-trace's write-behind: DRAM blocks written to the SSD tier before they are evicted.

Benchmark side. The choice of blocks is control plane, under the cache's lock; the writes
are the engines' (phoenix at ``priority="background"``, KvikIO's ``pwrite``), in this
thread. What an engine that offloads asynchronously does (LMCache stores in the
background): it keeps the ``--write-behind`` least recently used DRAM blocks on the SSD
tier too, so a round that needs a DRAM slot finds a clean one (the tiers are inclusive: a
block already on the SSD tier leaves DRAM without a write) instead of writing one in its
TTFT. A block being written is pinned in DRAM (no round evicts it; rounds still load from
it) and its SSD slot is out of the SSD tier's free list and LRU until the write is done.
The staged loop writes on eviction, in the round (the naive loop); ``dram`` writes nothing.
"""

from __future__ import annotations

import threading

from .tiers import Counts

#: configurations whose engines write behind (asynchronous writes with futures)
ENGINES = ("phoenix", "kvikio")


class WriteBehind:
    """One point's writer thread: :meth:`start` after the warm-up, :meth:`stop` after the sessions."""

    def __init__(self, replayer, config: str, depth: int, batch: int = 4):
        self.rp, self.config, self.depth, self.batch = replayer, config, depth, batch
        self.counts = Counts()
        self.writing: set = set()  # keys being written
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-write-behind", daemon=True)
        self._thread.start()

    def stop(self) -> Counts:
        """Ends the thread after the writes in flight; returns what it wrote."""
        c = self.rp.cache
        with c.cond:
            self._stop = True
            c.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        return self.counts

    def pick(self) -> list:
        """Under the lock: up to ``batch`` of the ``depth`` least recently used DRAM blocks not
        yet on the SSD tier and not pinned, each with an SSD slot taken for it (if none is free,
        the SSD tier's least recently used block not also in DRAM drops out, as a
        demotion's write drops one)."""
        c = self.rp.cache
        out = []
        for i, (key, dslot) in enumerate(c.dram.lru.items()):
            if i >= self.depth or len(out) >= self.batch:
                break
            if key in c.ssd.lru or c.dram.pins[key] or key in c.transit or key in self.writing:
                continue
            # not the SSD copy of a DRAM block: it would only need writing again
            sslot, _victim = c.ssd.take(exclude=c.dram.lru)
            if sslot is None:
                break
            c.dram.pins[key] += 1
            self.writing.add(key)
            out.append((key, dslot, sslot))
        return out

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # the point fails with it, not without its write-behind
            rp = self.rp
            with rp.cache.cond:
                rp.errors.append(f"write-behind ({self.config}): {type(exc).__name__}: {exc}")
                rp.abort = True
                rp.cache.cond.notify_all()

    def _loop(self) -> None:
        rp, c = self.rp, self.rp.cache
        while True:
            with c.cond:
                while True:
                    if self._stop or rp.abort:
                        return
                    batch = self.pick()
                    if batch:
                        break
                    c.cond.wait(0.05)
            error: Exception | None = RuntimeError("the write-behind thread was interrupted")
            try:
                error = self._write(batch)
            finally:
                with c.cond:
                    for key, _dslot, sslot in batch:
                        if error is None:
                            c.ssd.put(key, sslot, tag="behind")
                        else:  # the slot's content is unknown: back to the free list
                            c.ssd.free.append(sslot)
                        c.dram.pins[key] -= 1
                        self.writing.discard(key)
                    if error is not None:
                        rp.errors.append(f"write-behind ({self.config}): {type(error).__name__}: {error}")
                        rp.abort = True
                    c.cond.notify_all()
            if error is not None:
                return

    def _write(self, batch) -> Exception | None:
        """The batch's writes, started together and every one waited for; the first error, if any."""
        tasks = [("to_ssd", key, ("dram", dslot), sslot) for key, dslot, sslot in batch]
        written, error = self.rp._write_blocks(self.config, tasks, "background")
        self.counts.written_to_ssd += written
        self.counts.written_behind += written
        self.counts.bytes_written_ssd += written * self.rp.bb
        return error
