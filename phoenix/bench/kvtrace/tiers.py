"""The kv-trace's cache tiers: HBM (device memory), DRAM (pinned host memory), SSD (slab files).

Benchmark side. The index (LRU per tier, pins, blocks in transit) is control plane under
one lock; the memory behind it is the vendor's, and the slab is read and written through
phoenix, through KvikIO (``kvikio_io``) or through plain O_DIRECT descriptors (the staged
loop) by the replay.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import threading
import time
from dataclasses import asdict, dataclass

from ..files import BenchFiles, refuse_foreign
from .compute import Geometry

TOOL = "phx bench kv-trace"  #: who the slab's files are refused or removed by, in messages


class Tier:
    """One cache tier: fixed slots of one block each, LRU over resident blocks."""

    def __init__(self, name: str, nslots: int, reserved: int = 0):
        self.name = name
        self.nslots = nslots  # dynamic slots (reserved ones come first and are never reused)
        self.reserved = reserved
        self.reset()

    def reset(self) -> None:
        self.free = list(range(self.reserved + self.nslots - 1, self.reserved - 1, -1))
        self.lru: collections.OrderedDict = collections.OrderedDict()  # key -> slot
        self.pins: collections.Counter = collections.Counter()
        self.tags: dict = {}  # key -> who wrote its copy here (put's tag), while it is resident

    def evictable(self, exclude=()) -> int:
        return sum(1 for k, slot in self.lru.items() if not self.pins[k] and k not in exclude and slot >= self.reserved)

    def take(self, exclude=()):
        """A slot: a free one, else the LRU unpinned block's (returned as the victim)."""
        if self.free:
            return self.free.pop(), None
        for k, slot in self.lru.items():
            if not self.pins[k] and k not in exclude and slot >= self.reserved:
                del self.lru[k]
                self.tags.pop(k, None)
                return slot, k
        return None, None

    def drop(self, key) -> None:
        slot = self.lru.pop(key)
        self.tags.pop(key, None)
        if slot >= self.reserved:
            self.free.append(slot)

    def put(self, key, slot: int, tag: str | None = None) -> None:
        self.lru[key] = slot
        self.lru.move_to_end(key)
        if tag is None:
            self.tags.pop(key, None)
        else:
            self.tags[key] = tag


@dataclass
class Counts:
    rounds: int = 0
    blocks_needed: int = 0
    hbm_hits: int = 0
    dram_loads: int = 0
    ssd_loads: int = 0
    ssd_loads_behind: int = 0  # of those, blocks whose SSD copy the write-behind wrote
    recomputes: int = 0
    bytes_loaded_dram: int = 0
    bytes_loaded_ssd: int = 0
    bytes_verified: int = 0
    verify_failures: int = 0
    blocks_produced: int = 0
    demoted_to_dram: int = 0
    written_to_ssd: int = 0
    written_behind: int = 0  # of those, written ahead of eviction (--write-behind)
    bytes_written_ssd: int = 0
    dropped: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    linear_tflop: float = 0.0
    attention_tflop: float = 0.0
    hbm_waits: int = 0
    # seconds of the rounds' TTFTs (summed): waiting for room in HBM, demotions, loads, the rest
    wait_s: float = 0.0
    demote_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0

    def add(self, other: Counts) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


MAX_SLOTS = 1 << 22  #: blocks a tier indexes at most (its free list is a Python list)


class KVCache:
    """HBM (vendor device memory), DRAM (vendor pinned host memory), SSD (slab files).

    Control plane: an index under one lock. Data moves outside the lock, in the thread of
    the round that needs it; a block being demoted is "in transit" and its owner waits.
    """

    def __init__(self, rt, backend, args, geo: Geometry, history_blocks: int):
        self.rt, self.backend, self.args = rt, backend, args
        self.block_bytes = args.block_tokens * geo.bytes_per_token
        bb = self.block_bytes
        for opt, cap in (("--hbm", args.hbm), ("--dram", args.dram), ("--ssd", args.ssd)):
            if cap // bb > MAX_SLOTS:
                raise ValueError(
                    f"{opt} {cap} holds {cap // bb} blocks of {bb} bytes, more than the {MAX_SLOTS} a tier "
                    "indexes: give a smaller capacity or larger blocks (--block-tokens)"
                )
        self.hbm = Tier("hbm", args.hbm // bb)
        self.dram = Tier("dram", args.dram // bb)
        self.ssd = Tier("ssd", args.ssd // bb, reserved=history_blocks)
        if self.hbm.nslots < 1 or self.dram.nslots < 1:
            raise ValueError(f"--hbm {args.hbm} and --dram {args.dram} must hold at least one block of {bb} bytes")
        nbytes = self.hbm.nslots * bb
        self.hbm_keep = None  # set when the compute library owns the HBM tier's memory
        self.hbm_base = rt.device_alloc(nbytes, args.device)
        self.hbm_alloc = "vendor device_alloc"
        try:
            backend.wrap_hbm(self.hbm_base, nbytes)
        except Exception as exc:
            rt.device_free(self.hbm_base)
            self.hbm_base = 0
            alloc = getattr(backend, "alloc_hbm", None)
            if alloc is None:
                raise RuntimeError(
                    f"the compute backend cannot view vendor device memory: {type(exc).__name__}: {exc}"
                ) from exc
            # the same device memory, allocated by the compute library (phoenix takes its pointers)
            self.hbm_keep, self.hbm_base = alloc(nbytes)
            self.hbm_alloc = (
                f"{backend.name} allocation (vendor memory could not be viewed: {type(exc).__name__}: {exc})"
            )
        self.dram_base = rt.host_alloc_pinned(self.dram.nslots * bb)
        self.cond = threading.Condition()
        self.transit: set = set()
        self.config = None

    def close(self) -> None:
        if self.hbm_base and self.hbm_keep is None:
            self.rt.device_free(self.hbm_base)
        self.hbm_base, self.hbm_keep = 0, None
        if self.dram_base:
            self.rt.host_free_pinned(self.dram_base)
            self.dram_base = 0

    def reset(self, config: str, history: dict) -> None:
        """Empty HBM and DRAM; the SSD tier holds the pre-written history (not for ``dram``)."""
        with self.cond:
            self.config = config
            for t in (self.hbm, self.dram, self.ssd):
                t.reset()
            self.transit.clear()
            if config != "dram":
                for key, slot in history.items():
                    self.ssd.put(key, slot)

    def hbm_ptr(self, slot: int) -> int:
        return self.hbm_base + slot * self.block_bytes

    def dram_ptr(self, slot: int) -> int:
        return self.dram_base + slot * self.block_bytes


# ---- the slab (SSD tier) ------------------------------------------------------------------------


class Slab:
    """The SSD tier's files, per lane (a drive: ``--slab A,B,...`` or ``--fast-devices N``):
    ``<path>.history`` (pre-written history, read-only during the replay) and ``<path>``
    (blocks demoted during the replay). One slot = one block; slots go to the lanes in turn
    (slot i on lane i mod N, as RAID 0 stripes a volume over its drives)."""

    def __init__(self, path, block_bytes: int, history_slots: int, dynamic_slots: int):
        self.bb = block_bytes
        self.history_slots, self.dynamic_slots = history_slots, dynamic_slots
        self.files: dict = {}
        self.fds: dict = {}
        self.claimed = None  # the BenchFiles of the slab's files, from create() on
        self.move(path)

    @property
    def lanes(self) -> int:
        return len(self.paths)

    @property
    def path(self) -> str:  # the first lane's (one lane: the slab's)
        return self.paths[0]

    @property
    def hist_path(self) -> str:
        return self.hist_paths[0]

    def lane_slots(self, lanes: int | None = None) -> tuple[int, int]:
        """(history, dynamic) slots the busiest lane holds, striped over ``lanes`` (default its own)."""
        n = lanes or self.lanes
        return -(-self.history_slots // n), max(1, -(-self.dynamic_slots // n))

    def nbytes(self, lanes: int | None = None) -> int:
        """Bytes one lane's files can come to, striped over ``lanes`` (default its own; one
        lane: the whole slab): its history, and its dynamic region once written."""
        return sum(self.lane_slots(lanes)) * self.bb

    def all_paths(self) -> list[str]:
        return [*self.hist_paths, *self.paths]

    @staticmethod
    def parse(path) -> list[str]:
        """The lanes' files of ``path`` (one file, a comma-separated list or a list); refused
        where one is empty or repeated."""
        paths = path.split(",") if isinstance(path, str) else list(path)
        if not paths or any(not p for p in paths) or len(set(paths)) != len(paths):
            raise ValueError(
                f"--slab {path!r}: give one file, or several to stripe the tier over (comma-separated, distinct)"
            )
        return paths

    def move(self, path) -> None:
        """Put the slab at ``path`` (one file, a comma-separated list or a list: one per lane)
        instead, before :meth:`create`: e.g. on fast devices."""
        self.close()
        self.paths = self.parse(path)
        self.hist_paths = [p + ".history" for p in self.paths]

    @staticmethod
    def refuse_foreign(paths: list[str]) -> None:
        """Refuse now, before the tiers are allocated, a slab path (or its ``.history``) where an
        existing file is not the bench's (a slab an earlier run kept is): the slab is written
        over and removed at the end, and a file of the user's is never changed (:meth:`create`
        claims them, refusing the same)."""
        for p in paths:
            for q in (p, p + ".history"):
                refuse_foreign(q, "--slab", TOOL)

    def check_space(self) -> None:
        """Refuse, before writing anything, a slab its file systems cannot hold (lanes that
        share one are counted together)."""
        need: dict = {}  # st_dev -> [bytes needed, bytes free, directory]
        for path, hist in zip(self.paths, self.hist_paths, strict=True):
            d = os.path.dirname(os.path.abspath(path))
            try:
                st, dev = os.statvfs(d), os.stat(d).st_dev
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"--slab {path}: directory {d} does not exist") from None
            e = need.setdefault(dev, [0, st.f_bavail * st.f_frsize, d])
            e[0] += self.nbytes()
            for p in (path, hist):  # a slab left by an earlier run is overwritten
                try:
                    e[1] += os.stat(p).st_blocks * 512
                except OSError:
                    pass
        h, dyn = self.lane_slots()
        for want, free, d in need.values():
            if free < want:
                lanes = f" striped over {self.lanes} files" if self.lanes > 1 else ""
                raise OSError(
                    errno.ENOSPC,
                    f"--slab {self.path}{lanes}: the SSD tier needs {want / 2**30:.2f} GiB in {d} "
                    f"({h} history blocks + {dyn} of --ssd per file, {self.bb >> 20} MiB each) "
                    f"and it has {free / 2**30:.2f} GiB free: lower --ssd, the largest --concurrency or --warm-start, "
                    "or put --slab elsewhere",
                )

    def where(self, slot: int) -> tuple[str, int]:
        n = self.lanes
        if slot < self.history_slots:
            return self.hist_paths[slot % n], slot // n * self.bb
        d = slot - self.history_slots
        return self.paths[d % n], d // n * self.bb

    def create(self, history: dict, keys: dict, progress=None) -> float:
        """Claim the slab's files (each absent, or the bench's: a slab an earlier run kept), write
        the history blocks (their patterns) and size the dynamic file; returns seconds. A
        failure removes the slab's files (none is left half written)."""
        self.claimed = BenchFiles(TOOL)
        try:
            for p in self.all_paths():
                self.claimed.claim(p, 0, "--slab", write=True, fill=False)
            return self._create(history, keys)
        except BaseException:
            self.claimed.close(failed=True, remove=True)  # the slab's files go: none is left half written
            self.claimed = None
            raise

    def _create(self, history: dict, keys: dict) -> float:
        import phoenix

        self.check_space()
        t0 = time.perf_counter()
        for path in self.paths:
            with open(path, "wb") as fh:
                fh.truncate(self.lane_slots()[1] * self.bb)
        bufsz = 64
        import numpy as np

        stage = np.empty(bufsz * self.bb, np.uint8)
        base = np.arange(self.bb // 8, dtype=np.uint64)
        files: dict = {}
        try:
            for p in self.hist_paths:
                files[p] = phoenix.open(p, "w")
            items = sorted(history.items(), key=lambda kv: kv[1])
            for i in range(0, len(items), bufsz):
                batch = items[i : i + bufsz]
                for j, (key, _slot) in enumerate(batch):
                    np.bitwise_xor(
                        base, np.uint64(keys[key]), out=stage[j * self.bb : (j + 1) * self.bb].view(np.uint64)
                    )
                futs = []
                for j, (_key, slot) in enumerate(batch):
                    path, off = self.where(slot)
                    futs.append(files[path].pwrite(stage, self.bb, off, j * self.bb))
                errors = []
                for fu in futs:  # every write landed or failed before the stage buffer is reused
                    try:
                        fu.result()
                    except Exception as exc:
                        errors.append(exc)
                if errors:
                    raise errors[0]
            for f in files.values():
                f.fsync()
        finally:
            for f in files.values():
                f.close()
        return time.perf_counter() - t0

    def open(self, config: str):
        """Open the files for a configuration: phoenix files, KvikIO files (inside its
        settings), or plain O_DIRECT descriptors."""
        self.close()
        try:  # each file kept as it opens: close() closes those opened before an error
            if config == "phoenix":
                import phoenix

                for p in self.all_paths():
                    self.files[p] = phoenix.open(p, "r+")
            elif config == "kvikio":
                from . import kvikio_io

                # the history is only read; demoted blocks are written to the other files and read back
                for p in self.all_paths():
                    self.files[p] = kvikio_io.open_file(p, "r" if p in self.hist_paths else "r+")
            elif config == "staged":
                for p in self.all_paths():
                    try:
                        self.fds[p] = (os.open(p, os.O_RDWR | os.O_DIRECT), True)
                    except OSError:  # tmpfs and others refuse O_DIRECT: buffered
                        self.fds[p] = (os.open(p, os.O_RDWR), False)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for fd, _ in self.fds.values():
            os.close(fd)
        self.files, self.fds = {}, {}

    def remove(self) -> None:
        """Remove the slab's files: those this run claimed (made, or kept by an earlier run),
        never another file."""
        self.close()
        if self.claimed is not None:
            self.claimed.close(remove=True)
            self.claimed = None

    def release(self) -> None:
        """Keep the slab (``--keep-slab``): its files stay, marked as the bench's, unlocked."""
        self.close()
        if self.claimed is not None:
            self.claimed.close()
            self.claimed = None


def host_view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")
