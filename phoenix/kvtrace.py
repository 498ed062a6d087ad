"""``phx bench kv-trace``: replay an agentic KV-cache trace through DRAM-only, staged-SSD and phoenix tiers.

Benchmark side (control plane). What is real and what is simulated:

* **Real**: device memory of the selected vendor (the HBM tier), pinned host memory from
  the vendor runtime (the DRAM tier), a slab file (the SSD tier) read through phoenix
  (``phoenix``) or through the naive staged loop (``staged``: ``pread`` into pinned host
  memory, then a synchronous host->device copy), the host<->device copies of promotion and
  demotion, the writes of evicted blocks, and the prefill compute: matrix products and
  attention of the model's shape for every uncached token (torch on cuda, else CuPy, on a
  GPU; NumPy on the CPU with the host vendor, a CPU stand-in).
* **Simulated**: the sessions (a seeded trace with the published statistics of Codex runs on
  SWE-bench Pro, or a trace file), think time between rounds (compressed by
  ``--time-scale``), token counts (``--token-scale``), the model (no weights, no tokens: the
  products have its shape; one layer's weight matrices serve every layer), KV contents (a
  verification pattern per block, not KV values), decode (not run: its tokens' KV is written
  as if produced).

Tiers (blocks of ``--block-tokens`` tokens; LRU in each tier; lower tiers are inclusive):

* a round needs the KV of its prefix's full blocks in HBM; each is an HBM hit, a load from
  DRAM (``memcpy_async`` host->device), a load from SSD, or missing. From the first missing
  block on, the prefix is recomputed (prefix caching needs a contiguous prefix), together
  with the new tokens; the linear layers run while the loads are in flight, attention over
  the context after they land (as an engine overlaps layer-wise loading).
* new KV is produced in HBM; a block evicted from HBM is copied to DRAM (unless already
  there), one evicted from DRAM is written to the SSD slab (``dram``: dropped, recomputed when
  needed again). Demotion runs on the path of the round that needs the space.

Every loaded byte is checked against its block's pattern after the round's TTFT is taken
(untimed); destinations are poisoned before each load so that a load that does not land is
caught. ``hbm_hits + dram_loads + ssd_loads + recomputes == blocks_needed`` for every round.

Trace file (JSON lines, ``write_trace``/``read_trace``): a header line
``{"format": "phx-kv-trace", "version": 1, "params": {...}}`` then one line per round
``{"session": id, "round": r, "think_s": s, "input_tokens": C, "prefix_tokens": P,
"output_tokens": O}``: ``C`` is the round's whole prompt, ``P`` (at most the previous round's
``C + O``) how many of its leading tokens equal the previous round's context (the rest is
new: tool results, user turns, or edited context), ``think_s`` the gap before the round in
seconds (after the previous round's first token). ``prefix_tokens`` may be omitted (taken as
the whole previous context); other keys are ignored.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import json
import math
import os
import platform
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from .vendor import CopyKind, parse_size

FORMAT = "phx-kv-trace"
VERSION = 1
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
CONFIGS = ("dram", "staged", "phoenix")
POISON = 0xA5
MASK63 = (1 << 63) - 1

# ---- trace ------------------------------------------------------------------------------------


@dataclass
class Round:
    think_s: float
    input_tokens: int
    prefix_tokens: int
    output_tokens: int

    @property
    def new_tokens(self) -> int:
        return self.input_tokens - self.prefix_tokens


@dataclass
class Session:
    id: str
    rounds: list[Round] = field(default_factory=list)


@dataclass
class Trace:
    sessions: list[Session]
    params: dict = field(default_factory=dict)


#: the published statistics the generator aims at (Codex on SWE-bench Pro)
TARGETS = {"context_at_round_30": 80_000, "beyond_180k": "some sessions", "new_tokens_per_round": "hundreds to a few thousand",
           "think_s": "a few seconds", "input_output_ratio": 131, "prefix_hit_rate": 0.94}


def generate(sessions: int = 64, seed: int = 0) -> Trace:
    """Agentic sessions with the published statistics of Codex runs on SWE-bench Pro (seeded).

    Per session: a first prompt of system prompt, tools and task (~12K tokens); then rounds
    that each add a tool result or user turn (log-normal, median ~1.6K tokens, 100..8K) and
    the previous answer; a per-session pace factor spreads the growth (context ~80K at round
    30, the long ones past 180K); answers of ~350 tokens (input:output ~131:1); think times
    log-normal around 3 s. About one round in ten edits earlier context (the agent rewrites
    or trims it): the prefix then ends inside the old context, which is resent -- this is
    what brings the prefix hit rate from ~97 % (new tokens only) to ~94 %.
    """
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        n_rounds = int(min(90, max(8, rng.lognormvariate(math.log(38), 0.5))))
        pace = rng.lognormvariate(0.0, 0.3)
        ctx = int(min(20_000, max(6_000, rng.gauss(12_000, 2_000))))
        rounds = [Round(0.0, ctx, 0, _output(rng))]
        for _ in range(1, n_rounds):
            prev = rounds[-1]
            carried = prev.input_tokens + prev.output_tokens
            new = int(min(8_000, max(100, rng.lognormvariate(math.log(1_400), 0.75) * pace)))
            prefix = carried
            if rng.random() < 0.10:  # context edit: the tail of the old context is resent
                prefix = int(carried * rng.uniform(0.55, 0.95))
            think = min(30.0, max(0.5, rng.lognormvariate(math.log(3.0), 0.5)))
            rounds.append(Round(round(think, 3), carried + new, prefix, _output(rng)))
        out.append(Session(f"s{s}", rounds))
    return Trace(out, {"generator": "phoenix.kvtrace.generate", "sessions": sessions, "seed": seed, "targets": TARGETS})


def _output(rng: random.Random) -> int:
    return int(min(4_000, max(20, rng.lognormvariate(math.log(480), 0.6))))


def write_trace(trace: Trace, path: str) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps({"format": FORMAT, "version": VERSION, "params": trace.params}) + "\n")
        for s in trace.sessions:
            for r, rd in enumerate(s.rounds):
                fh.write(json.dumps({"session": s.id, "round": r, "think_s": rd.think_s, "input_tokens": rd.input_tokens,
                                     "prefix_tokens": rd.prefix_tokens, "output_tokens": rd.output_tokens}) + "\n")


def read_trace(path: str) -> Trace:
    """Read a trace file (JSON lines as written by :func:`write_trace`, or one JSON document
    ``{"format": ..., "rounds": [...]}``/a list of round records). Checks every round."""
    with open(path) as fh:
        text = fh.read()
    params: dict = {}
    records: list[dict] = []
    stripped = text.lstrip()
    doc = None
    if stripped.startswith("[") or (stripped.startswith("{") and "\n{" not in stripped.strip()):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None
    if doc is not None:
        if isinstance(doc, dict):
            params = doc.get("params", {})
            records = doc.get("rounds", [])
        else:
            records = doc
    else:
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i + 1}: not JSON: {exc}") from None
            if rec.get("format") == FORMAT:
                if rec.get("version", VERSION) > VERSION:
                    raise ValueError(f"{path}: trace version {rec['version']} is newer than this reader ({VERSION})")
                params = rec.get("params", {})
            else:
                records.append(rec)
    sessions: dict[str, list] = {}
    for i, rec in enumerate(records):
        try:
            sid = str(rec["session"])
            sessions.setdefault(sid, []).append((int(rec.get("round", len(sessions[sid]) if sid in sessions else 0)), rec))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: record {i}: {exc!r} (needs session, input_tokens)") from None
    out = []
    for sid, recs in sessions.items():
        recs.sort(key=lambda x: x[0])
        rounds: list[Round] = []
        for r, rec in recs:
            carried = rounds[-1].input_tokens + rounds[-1].output_tokens if rounds else 0
            c = int(rec["input_tokens"])
            p = int(rec.get("prefix_tokens", min(carried, c)))
            o = int(rec.get("output_tokens", 0))
            if not (0 <= p <= c) or p > carried or o < 0:
                raise ValueError(f"{path}: session {sid} round {r}: prefix_tokens={p} must be within [0, input_tokens={c}] "
                                 f"and at most the previous context {carried}; output_tokens={o} >= 0")
            rounds.append(Round(float(rec.get("think_s", 0.0)), c, p, o))
        out.append(Session(sid, rounds))
    return Trace(out, params)


def trace_stats(trace: Trace) -> dict:
    """The statistics the generator aims at, measured on a trace."""
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

    at30 = [s.rounds[30].input_tokens for s in trace.sessions if len(s.rounds) > 30]
    news = [r.new_tokens for s in trace.sessions for r in s.rounds[1:]]
    added = [b.input_tokens - a.input_tokens - a.output_tokens for s in trace.sessions for a, b in zip(s.rounds, s.rounds[1:], strict=False)]
    thinks = [r.think_s for s in trace.sessions for r in s.rounds[1:]]
    inp = sum(r.input_tokens for s in trace.sessions for r in s.rounds)
    outp = sum(r.output_tokens for s in trace.sessions for r in s.rounds)
    pre = sum(r.prefix_tokens for s in trace.sessions for r in s.rounds)
    peak = [max(r.input_tokens for r in s.rounds) for s in trace.sessions if s.rounds]
    return {
        "sessions": len(trace.sessions), "rounds": sum(len(s.rounds) for s in trace.sessions),
        "context_at_round_30_median": pct(at30, 0.5), "sessions_reaching_round_30": len(at30),
        "sessions_beyond_180k": sum(p > 180_000 for p in peak), "max_context": max(peak, default=0),
        "added_tokens_p10": pct(added, 0.1), "added_tokens_median": pct(added, 0.5), "added_tokens_p90": pct(added, 0.9),
        "new_tokens_p10": pct(news, 0.1), "new_tokens_median": pct(news, 0.5), "new_tokens_p90": pct(news, 0.9),
        "think_s_median": pct(thinks, 0.5), "input_output_ratio": inp / outp if outp else 0.0,
        "prefix_hit_rate": pre / inp if inp else 0.0,
    }


def scale_trace(trace: Trace, token_scale: float) -> Trace:
    """Every token count times ``token_scale`` (at least 1 new token a round)."""
    if token_scale == 1.0:
        return trace
    out = []
    for s in trace.sessions:
        rounds = []
        for rd in s.rounds:
            carried = rounds[-1].input_tokens + rounds[-1].output_tokens if rounds else 0
            p = min(carried, int(rd.prefix_tokens * token_scale))
            c = max(p + 1, int(rd.input_tokens * token_scale))
            rounds.append(Round(rd.think_s, c, p, max(0, int(rd.output_tokens * token_scale))))
        out.append(Session(s.id, rounds))
    return Trace(out, dict(trace.params, token_scale=token_scale))


# ---- model geometry and block contents ----------------------------------------------------------


@dataclass
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    q_heads: int = 32
    hidden: int = 0  # 0: q_heads * head_dim
    ffn: int = 14336
    dtype: str = "fp16"

    def __post_init__(self):
        if not self.hidden:
            self.hidden = self.q_heads * self.head_dim
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"--q-heads {self.q_heads} must be a multiple of --kv-heads {self.kv_heads}")

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def linear_flops(self, tokens: int) -> float:
        h, d = self.hidden, self.head_dim
        per = 2 * h * (self.q_heads + 2 * self.kv_heads) * d + 2 * self.q_heads * d * h + 6 * h * self.ffn
        return float(self.layers) * per * tokens

    def attention_flops(self, tokens: int, ctx: int) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim * tokens * ctx


def _mix(x: int) -> int:
    """splitmix64 finalizer."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def block_key(session: int, block: int, born: int) -> int:
    """The pattern key of one version of one block: 64-bit word i of it is ``key ^ i``."""
    return _mix(_mix(_mix(session) ^ block) ^ born) & MASK63 | (1 << 40)


def host_pattern(nbytes: int, key: int):
    import numpy as np

    return (np.arange(nbytes // 8, dtype=np.uint64) ^ np.uint64(key)).view(np.uint8)


class VerificationError(AssertionError):
    pass


class TooLarge(Exception):
    """A round whose context no longer fits the HBM tier: its session ends there."""


# ---- compute backends (the data side of the replay, per vendor) -----------------------------------


class _DevArray:
    """A ``__cuda_array_interface__`` over raw device memory (for torch.as_tensor / cupy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 2}


class NumpyBackend:
    """Host vendor (a test double) or a GPU without torch/CuPy: block contents go through the
    vendor's copies; compute is NumPy on the CPU (a CPU stand-in for the GPU's prefill)."""

    name = "numpy-cpu"
    label = "NumPy on the CPU (a CPU stand-in for GPU prefill)"
    verify_where = "host: device bytes copied back with the vendor's memcpy and compared"

    def __init__(self, rt, geo: Geometry, max_ctx: int, chunk: int, device: int):
        import numpy as np

        self.np, self.rt, self.geo, self.chunk = np, rt, geo, chunk
        self.dt = np.float32
        rng = np.random.default_rng(0)
        h, d, g = geo.hidden, geo.head_dim, geo
        f32 = np.float32
        self.w_qkv = rng.standard_normal((h, (g.q_heads + 2 * g.kv_heads) * d), f32) * 0.02
        self.w_o = rng.standard_normal((g.q_heads * d, h), f32) * 0.02
        self.w_up = rng.standard_normal((h, 2 * g.ffn), f32) * 0.02
        self.w_down = rng.standard_normal((g.ffn, h), f32) * 0.02
        self.k = rng.standard_normal((g.kv_heads, max_ctx, d), f32)
        self.v = rng.standard_normal((g.kv_heads, max_ctx, d), f32)

    def new_stream(self):
        return None

    def sync(self, stream) -> None:
        pass

    def wrap_hbm(self, ptr: int, nbytes: int):
        return None

    def _host(self, nbytes):
        return self.np.empty(nbytes, self.np.uint8)

    def fill(self, stream, ptr: int, nbytes: int, key: int) -> None:
        src = host_pattern(nbytes, key)
        self.rt.memcpy(ptr, src.ctypes.data, nbytes, CopyKind.HOST_TO_DEVICE)

    def poison(self, stream, ptr: int, nbytes: int) -> None:
        src = self.np.full(nbytes, POISON, self.np.uint8)
        self.rt.memcpy(ptr, src.ctypes.data, nbytes, CopyKind.HOST_TO_DEVICE)

    def verify(self, stream, ptr: int, nbytes: int, key: int) -> bool:
        dst = self._host(nbytes)
        self.rt.memcpy(dst.ctypes.data, ptr, nbytes, CopyKind.DEVICE_TO_HOST)
        return bool(self.np.array_equal(dst, host_pattern(nbytes, key)))

    def linear(self, stream, tokens: int) -> None:
        np = self.np
        for p in range(0, tokens, self.chunk):
            n = min(self.chunk, tokens - p)
            x = np.ones((n, self.geo.hidden), self.dt)
            for _ in range(self.geo.layers):
                qkv = x @ self.w_qkv
                o = qkv[:, : self.w_o.shape[0]] @ self.w_o
                up = o @ self.w_up
                x = up[:, : self.geo.ffn] @ self.w_down

    def attention(self, stream, start: int, tokens: int) -> None:
        np, g = self.np, self.geo
        group = g.q_heads // g.kv_heads
        for p in range(0, tokens, self.chunk):
            n = min(self.chunk, tokens - p)
            ctx = start + p + n
            q = np.ones((g.kv_heads, group * n, g.head_dim), self.dt)
            for _ in range(g.layers):
                s = q @ self.k[:, :ctx].transpose(0, 2, 1)
                _ = s @ self.v[:, :ctx]


class TorchBackend:
    """nvidia with torch: block contents generated and checked on the device; prefill as
    cuBLAS matrix products and SDPA attention on one torch stream per session."""

    name = "torch-cuda"
    verify_where = "device: torch compares the loaded bytes with the regenerated pattern on the GPU"

    def __init__(self, rt, geo: Geometry, max_ctx: int, chunk: int, device: int):
        import torch

        self.torch, self.rt, self.geo, self.chunk = torch, rt, geo, chunk
        self.dev = torch.device("cuda", device)
        torch.cuda.set_device(self.dev)
        self.dt = torch.bfloat16 if geo.dtype == "bf16" else torch.float32 if geo.dtype == "fp32" else torch.float16
        self.label = f"torch {torch.__version__} on {torch.cuda.get_device_name(self.dev)} ({self.dt})"
        h, d, g = geo.hidden, geo.head_dim, geo
        gen = torch.Generator(device=self.dev).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=self.dev, dtype=self.dt) * 0.02

        self.w_qkv = rand(h, (g.q_heads + 2 * g.kv_heads) * d)
        self.w_o = rand(g.q_heads * d, h)
        self.w_up = rand(h, 2 * g.ffn)
        self.w_down = rand(g.ffn, h)
        self.k = rand(g.kv_heads, max_ctx, d)
        self.v = rand(g.kv_heads, max_ctx, d)
        self.arange: dict = {}
        self.hbm = None
        self.hbm_base = 0

    def new_stream(self):
        return self.torch.cuda.Stream(device=self.dev)

    def sync(self, stream) -> None:
        stream.synchronize()

    def wrap_hbm(self, ptr: int, nbytes: int):
        """View the HBM tier (vendor memory) as a torch tensor, without copying."""
        self.hbm = self.torch.as_tensor(_DevArray(ptr, nbytes), device=self.dev)
        self.hbm_base = ptr
        return self.hbm

    def alloc_hbm(self, nbytes: int):
        self.hbm = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.dev)
        self.hbm_base = self.hbm.data_ptr()
        return self.hbm, self.hbm_base

    def _view(self, ptr: int, nbytes: int):
        off = ptr - self.hbm_base
        return self.hbm[off:off + nbytes]

    def _pattern(self, nbytes: int, key: int):
        a = self.arange.get(nbytes)
        if a is None:
            a = self.arange[nbytes] = self.torch.arange(nbytes // 8, dtype=self.torch.int64, device=self.dev)
        return self.torch.bitwise_xor(a, key)

    def fill(self, stream, ptr: int, nbytes: int, key: int) -> None:
        with self.torch.cuda.stream(stream):
            self._view(ptr, nbytes).view(self.torch.int64).copy_(self._pattern(nbytes, key))

    def poison(self, stream, ptr: int, nbytes: int) -> None:
        with self.torch.cuda.stream(stream):
            self._view(ptr, nbytes).fill_(POISON)

    def verify(self, stream, ptr: int, nbytes: int, key: int) -> bool:
        with self.torch.cuda.stream(stream):
            ok = self.torch.equal(self._view(ptr, nbytes).view(self.torch.int64), self._pattern(nbytes, key))
        return bool(ok)

    def linear(self, stream, tokens: int) -> None:
        torch = self.torch
        with torch.cuda.stream(stream):
            for p in range(0, tokens, self.chunk):
                n = min(self.chunk, tokens - p)
                x = torch.ones((n, self.geo.hidden), device=self.dev, dtype=self.dt)
                for _ in range(self.geo.layers):
                    qkv = x @ self.w_qkv
                    o = qkv[:, : self.w_o.shape[0]] @ self.w_o
                    up = o @ self.w_up
                    x = up[:, : self.geo.ffn] @ self.w_down

    def attention(self, stream, start: int, tokens: int) -> None:
        torch, g = self.torch, self.geo
        sdpa = torch.nn.functional.scaled_dot_product_attention
        group = g.q_heads // g.kv_heads
        with torch.cuda.stream(stream):
            for p in range(0, tokens, self.chunk):
                n = min(self.chunk, tokens - p)
                ctx = start + p + n
                # grouped-query attention as kv_heads heads of group*n queries each: its FLOPs
                q = torch.ones((1, g.kv_heads, group * n, g.head_dim), device=self.dev, dtype=self.dt)
                k, v = self.k[None, :, :ctx], self.v[None, :, :ctx]
                for _ in range(g.layers):
                    sdpa(q, k, v)


class CupyBackend(NumpyBackend):
    """nvidia with CuPy (no torch): contents checked on the device, prefill as cuBLAS products."""

    name = "cupy-cuda"
    verify_where = "device: CuPy compares the loaded bytes with the regenerated pattern on the GPU"

    def __init__(self, rt, geo: Geometry, max_ctx: int, chunk: int, device: int):
        import cupy

        self.cp = cupy
        cupy.cuda.Device(device).use()
        self.rt, self.geo, self.chunk = rt, geo, chunk
        dt = cupy.float16 if geo.dtype in ("fp16", "fp8", "bf16") else cupy.float32
        self.label = f"CuPy {cupy.__version__} ({cupy.dtype(dt).name})"
        rs = cupy.random.RandomState(0)
        h, d, g = geo.hidden, geo.head_dim, geo

        def rand(*shape):
            return (rs.standard_normal(shape, dtype=cupy.float32) * 0.02).astype(dt)

        self.np = cupy  # the NumPy-shaped compute below runs on the device
        self.w_qkv = rand(h, (g.q_heads + 2 * g.kv_heads) * d)
        self.w_o = rand(g.q_heads * d, h)
        self.w_up = rand(h, 2 * g.ffn)
        self.w_down = rand(g.ffn, h)
        self.k = rand(g.kv_heads, max_ctx, d)
        self.v = rand(g.kv_heads, max_ctx, d)
        self.dt = dt
        self.hbm_base = 0
        self.hbm = None
        self.arange: dict = {}

    def new_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def sync(self, stream) -> None:
        stream.synchronize()

    def wrap_hbm(self, ptr: int, nbytes: int):
        self.hbm = self.cp.asarray(_DevArray(ptr, nbytes))
        self.hbm_base = ptr
        return self.hbm

    def _view(self, ptr, nbytes):
        off = ptr - self.hbm_base
        return self.hbm[off:off + nbytes]

    def _pattern(self, nbytes, key):
        a = self.arange.get(nbytes)
        if a is None:
            a = self.arange[nbytes] = self.cp.arange(nbytes // 8, dtype=self.cp.uint64)
        return a ^ self.cp.uint64(key)

    def fill(self, stream, ptr, nbytes, key):
        with stream:
            self._view(ptr, nbytes).view(self.cp.uint64)[...] = self._pattern(nbytes, key)

    def poison(self, stream, ptr, nbytes):
        with stream:
            self._view(ptr, nbytes).fill(POISON)

    def verify(self, stream, ptr, nbytes, key):
        with stream:
            ok = bool(self.cp.array_equal(self._view(ptr, nbytes).view(self.cp.uint64), self._pattern(nbytes, key)))
        return ok

    def linear(self, stream, tokens):
        with stream:
            super().linear(stream, tokens)

    def attention(self, stream, start, tokens):
        # S = Q K^T per chunk is materialised here (no SDPA): keep it under ~256 MiB
        g = self.geo
        group = g.q_heads // g.kv_heads
        with stream:
            for p in range(0, tokens, self.chunk):
                n = min(self.chunk, tokens - p)
                ctx = start + p + n
                rows = max(1, min(group * n, (256 << 20) // (2 * g.kv_heads * ctx)))
                for r0 in range(0, group * n, rows):
                    q = self.cp.ones((g.kv_heads, min(rows, group * n - r0), g.head_dim), self.dt)
                    for _ in range(g.layers):
                        s = q @ self.k[:, :ctx].transpose(0, 2, 1)
                        _ = s @ self.v[:, :ctx]

    def _host(self, nbytes):  # not used: verification is on the device
        raise NotImplementedError


def make_backend(rt, geo, max_ctx, chunk, device, want: str = "auto"):
    """torch on cuda, else CuPy, on nvidia; NumPy (CPU stand-in) on the host vendor."""
    if rt.name == "host" or rt.is_test_double or want == "numpy":
        return NumpyBackend(rt, geo, max_ctx, chunk, device)
    errors = []
    for name, cls in (("torch", TorchBackend), ("cupy", CupyBackend)):
        if want not in ("auto", name):
            continue
        try:
            return cls(rt, geo, max_ctx, chunk, device)
        except Exception as exc:  # the next one may serve
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise RuntimeError(f"no GPU compute backend for vendor {rt.name!r} ({'; '.join(errors)}); "
                       "install torch or CuPy, or pass --compute numpy (CPU stand-in)")


# ---- tiers ------------------------------------------------------------------------------------


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

    def evictable(self, exclude=()) -> int:
        return sum(1 for k, slot in self.lru.items() if not self.pins[k] and k not in exclude and slot >= self.reserved)

    def take(self, exclude=()):
        """A slot: a free one, else the LRU unpinned block's (returned as the victim)."""
        if self.free:
            return self.free.pop(), None
        for k, slot in self.lru.items():
            if not self.pins[k] and k not in exclude and slot >= self.reserved:
                del self.lru[k]
                return slot, k
        return None, None

    def drop(self, key) -> None:
        slot = self.lru.pop(key)
        if slot >= self.reserved:
            self.free.append(slot)

    def put(self, key, slot: int) -> None:
        self.lru[key] = slot
        self.lru.move_to_end(key)


@dataclass
class Counts:
    rounds: int = 0
    blocks_needed: int = 0
    hbm_hits: int = 0
    dram_loads: int = 0
    ssd_loads: int = 0
    recomputes: int = 0
    bytes_loaded_dram: int = 0
    bytes_loaded_ssd: int = 0
    bytes_verified: int = 0
    verify_failures: int = 0
    blocks_produced: int = 0
    demoted_to_dram: int = 0
    written_to_ssd: int = 0
    bytes_written_ssd: int = 0
    dropped: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    linear_tflop: float = 0.0
    attention_tflop: float = 0.0
    hbm_waits: int = 0

    def add(self, other: Counts) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


class KVCache:
    """HBM (vendor device memory), DRAM (vendor pinned host memory), SSD (slab files).

    Control plane: an index under one lock. Data moves outside the lock, in the thread of
    the round that needs it; a block being demoted is "in transit" and its owner waits.
    """

    def __init__(self, rt, backend, args, geo: Geometry, history_blocks: int):
        self.rt, self.backend, self.args = rt, backend, args
        self.block_bytes = args.block_tokens * geo.bytes_per_token
        bb = self.block_bytes
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
                raise RuntimeError(f"the compute backend cannot view vendor device memory: {type(exc).__name__}: {exc}") from exc
            # the same device memory, allocated by the compute library (phoenix takes its pointers)
            self.hbm_keep, self.hbm_base = alloc(nbytes)
            self.hbm_alloc = f"{backend.name} allocation (vendor memory could not be viewed: {type(exc).__name__}: {exc})"
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
    """The SSD tier's files: ``<path>.history`` (pre-written history, read-only during the
    replay) and ``<path>`` (blocks demoted during the replay). One slot = one block."""

    def __init__(self, path: str, block_bytes: int, history_slots: int, dynamic_slots: int):
        self.path, self.bb = path, block_bytes
        self.hist_path = path + ".history"
        self.history_slots, self.dynamic_slots = history_slots, dynamic_slots
        self.files: dict = {}
        self.fds: dict = {}

    def where(self, slot: int) -> tuple[str, int]:
        if slot < self.history_slots:
            return self.hist_path, slot * self.bb
        return self.path, (slot - self.history_slots) * self.bb

    def create(self, history: dict, keys: dict, progress=None) -> float:
        """Write the history blocks (their patterns) and size the dynamic file; returns seconds."""
        import phoenix

        t0 = time.perf_counter()
        with open(self.path, "wb") as fh:
            fh.truncate(max(1, self.dynamic_slots) * self.bb)
        bufsz = 64
        import numpy as np

        stage = np.empty(bufsz * self.bb, np.uint8)
        base = np.arange(self.bb // 8, dtype=np.uint64)
        with phoenix.open(self.hist_path, "w") as f:
            items = sorted(history.items(), key=lambda kv: kv[1])
            futs = []
            for i in range(0, len(items), bufsz):
                batch = items[i:i + bufsz]
                for j, (key, _slot) in enumerate(batch):
                    np.bitwise_xor(base, np.uint64(keys[key]), out=stage[j * self.bb:(j + 1) * self.bb].view(np.uint64))
                futs = [f.pwrite(stage, self.bb, slot * self.bb, j * self.bb) for j, (_key, slot) in enumerate(batch)]
                for fu in futs:
                    fu.result()
            f.fsync()
        return time.perf_counter() - t0

    def open(self, config: str):
        """Open the files for a configuration: phoenix files, or plain O_DIRECT descriptors."""
        self.close()
        if config == "phoenix":
            import phoenix

            self.files = {p: phoenix.open(p, "r+") for p in (self.hist_path, self.path)}
        elif config == "staged":
            for p in (self.hist_path, self.path):
                try:
                    self.fds[p] = (os.open(p, os.O_RDWR | os.O_DIRECT), True)
                except OSError:  # tmpfs and others refuse O_DIRECT: buffered
                    self.fds[p] = (os.open(p, os.O_RDWR), False)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for fd, _ in self.fds.values():
            os.close(fd)
        self.files, self.fds = {}, {}

    def remove(self) -> None:
        self.close()
        for p in (self.path, self.hist_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _host_view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


# ---- the replay -------------------------------------------------------------------------------


@dataclass
class SessionState:
    index: int  # number in the trace
    session: Session
    next_round: int
    kid: int = -1  # session id in block keys: a session replayed from round 0 gets one of its own
    born: list = field(default_factory=list)  # per block: the round whose content it holds
    initial: bool = False

    def __post_init__(self):
        if self.kid < 0:
            self.kid = self.index

    def advance_born(self, r: int, B: int) -> None:
        """Block versions after round ``r``'s prefix (a prefix ending inside or before a block
        gives the block new content from round r on)."""
        rd = self.session.rounds[r]
        first_changed = rd.prefix_tokens // B
        total_blocks = (rd.input_tokens + rd.output_tokens) // B
        del self.born[first_changed:]
        self.born.extend([r] * (total_blocks - len(self.born)))

    def key(self, b: int) -> tuple:
        return (self.kid, b, self.born[b])


class Replayer:
    def __init__(self, args, trace: Trace, rt=None, log=print):
        import phoenix.io as pio
        from phoenix import registry

        self.args, self.log = args, log
        self.geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.q_heads, args.hidden, args.ffn, args.dtype)
        self.trace = scale_trace(trace, args.token_scale)
        B = args.block_tokens
        self.bb = B * self.geo.bytes_per_token
        if self.bb % 4096:
            raise ValueError(f"a block is {self.bb} bytes ({B} tokens x {self.geo.bytes_per_token}): choose --block-tokens "
                             "so that it is a multiple of 4096 (O_DIRECT alignment)")
        self.cmax = max(args.concurrency)
        if len(self.trace.sessions) < self.cmax:
            raise ValueError(f"the trace has {len(self.trace.sessions)} sessions, fewer than --concurrency {self.cmax}")
        first_need = max((self.trace.sessions[i].rounds[0].input_tokens + self.trace.sessions[i].rounds[0].output_tokens)
                         // B + 1 for i in range(self.cmax))
        if first_need > args.hbm // self.bb:
            raise ValueError(f"a first round needs {first_need} blocks of {self.bb >> 10} KiB in HBM but --hbm holds "
                             f"{args.hbm // self.bb}: raise --hbm, or lower --token-scale")
        if rt is None:
            if os.environ.get("PHX_VENDOR", "auto") in ("nvidia", "auto") and args.compute in ("auto", "torch"):
                try:  # torch first: the nvidia port then shares torch's libcudart
                    import torch  # noqa: F401
                except Exception:
                    pass
            rt = registry.get_runtime()
        self.rt = rt
        self.pio = pio
        max_ctx = max(r.input_tokens for s in self.trace.sessions for r in s.rounds) + 1
        self.backend = make_backend(rt, self.geo, max_ctx, args.prefill_chunk, args.device, args.compute)
        # initial sessions (one per slot of the largest concurrency) start part-way through
        rng = random.Random(args.seed + 1)
        self.start_round = []
        for s in self.trace.sessions:
            hi = int(len(s.rounds) * args.warm_start)
            self.start_round.append(rng.randrange(hi) if hi > 0 else 0)
        # history: the blocks of the initial sessions' prefixes at their start rounds
        self.history: dict = {}
        for i in range(self.cmax):
            st = self._state(i, initial=True)
            for b in range(len(st.born)):
                self.history[st.key(b)] = len(self.history)
        self.cache = KVCache(rt, self.backend, args, self.geo, len(self.history))
        self.slab = Slab(args.slab, self.bb, len(self.history), self.cache.ssd.nslots)
        self.slab_write_s = 0.0
        self.staging: dict = {}
        self.poison_hook = None  # tests: called with (config, replayer) before a point's replay
        self.abort = False

    def _state(self, i: int, initial: bool) -> SessionState:
        """Session ``i`` before its first replayed round: the blocks of that round's prefix exist."""
        st = SessionState(i, self.trace.sessions[i], self.start_round[i] if initial else 0,
                          kid=i if initial else i + len(self.trace.sessions), initial=initial)
        for r in range(st.next_round):
            st.advance_born(r, self.args.block_tokens)
        if st.next_round < len(st.session.rounds):
            del st.born[st.session.rounds[st.next_round].prefix_tokens // self.args.block_tokens:]
        return st

    # -- setup -----------------------------------------------------------------------------

    def prepare(self) -> None:
        if any(c != "dram" for c in self.args.configs):
            keys = {k: block_key(*k) for k in self.history}
            self.slab_write_s = self.slab.create(self.history, keys)
            self.log(f"slab: {len(self.history)} history blocks ({len(self.history) * self.bb / 2**30:.2f} GiB) written to "
                     f"{self.slab.hist_path} in {self.slab_write_s:.1f} s; dynamic region {self.cache.ssd.nslots} blocks")
        for i in range(self.cmax):
            self.staging[i] = self.rt.host_alloc_pinned(self.bb)

    def close(self) -> None:
        self.slab.close()
        for p in self.staging.values():
            self.rt.host_free_pinned(p)
        self.staging = {}
        self.cache.close()
        if not self.args.keep_slab:
            self.slab.remove()

    # -- one point: (config, concurrency) -----------------------------------------------------

    def run_point(self, config: str, conc: int) -> dict:
        from .bench import drop_cache

        args = self.args
        self.cache.reset(config, self.history)
        if config != "dram":
            for p in (self.slab.hist_path, self.slab.path):
                drop_cache(p)
            if hasattr(self.pio, "fmap_clear"):
                self.pio.fmap_clear()  # every point starts without phoenix's page-cache mappings
        self.slab.open(config)
        if self.poison_hook:
            self.poison_hook(config, self)
        self.point_counts = Counts()
        self.ttfts: list[float] = []
        self.errors: list[str] = []
        self.failures: list[str] = []
        self.abort = False
        self.truncated = 0
        lock = threading.Lock()
        next_session = [self.cmax]  # sessions below cmax are the initial ones (history on the slab)

        # warm-up (untimed): the initial sessions' earlier rounds went through HBM and DRAM
        states = [self._state(i, initial=True) for i in range(conc)]
        self._warm(states)
        t_start = time.perf_counter()
        deadline = t_start + args.duration

        def worker(slot: int, st: SessionState):
            rng = random.Random(args.seed * 1000 + slot)
            stream = self.backend.new_stream()
            copy_stream = self.rt.stream_create(args.device)
            try:
                first = True
                while st is not None:
                    rounds = st.session.rounds
                    while st.next_round < len(rounds):
                        think = rounds[st.next_round].think_s * args.time_scale
                        if first:  # initial sessions arrive spread over one think time
                            think = think * rng.random() if st.initial else 0.0
                        first = False
                        if time.perf_counter() + think >= deadline or self.abort:
                            return
                        time.sleep(think)
                        try:
                            ttft, counts = self.round(config, slot, st, stream, copy_stream)
                        except TooLarge:
                            with lock:
                                self.truncated += 1
                            break
                        with lock:
                            self.ttfts.append(ttft)
                            self.point_counts.add(counts)
                        st.next_round += 1
                    with lock:  # the slot takes the next session of the trace, from its first round
                        i = next_session[0]
                        next_session[0] += 1
                    st = self._state(i, initial=False) if i < len(self.trace.sessions) else None
                    first = True
            except Exception as exc:
                import traceback

                with lock:
                    self.errors.append(f"slot {slot}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                with self.cache.cond:
                    self.abort = True
                    self.cache.cond.notify_all()
            finally:
                self.backend.sync(stream)
                self.rt.stream_destroy(copy_stream)

        threads = [threading.Thread(target=worker, args=(i, states[i]), name=f"kv-session-{i}") for i in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t_start
        self.slab.close()
        if self.errors:
            raise RuntimeError(f"{config} at concurrency {conc}: " + self.errors[0])
        return self._record(config, conc, elapsed)

    def _warm(self, states) -> None:
        """The initial sessions' earlier rounds, interleaved round by round, leave their most
        recent blocks in HBM and the next ones in DRAM (older ones: on the SSD tier's slab for
        staged and phoenix, dropped for dram). Untimed."""
        c, be = self.cache, self.backend
        produced = []  # (round, session, key) of every block version still valid at the start
        for st in states:
            for b in range(len(st.born)):
                produced.append((st.born[b], st.index, st.key(b)))
        produced.sort()
        tail = [k for _, _, k in produced[-(c.hbm.nslots + c.dram.nslots):]]
        n_dram = max(0, len(tail) - c.hbm.nslots)
        stream = be.new_stream()
        scratch, _ = c.hbm.take()  # a free HBM slot to make DRAM contents on the device
        for k in tail[:n_dram]:
            be.fill(stream, c.hbm_ptr(scratch), self.bb, block_key(*k))
            be.sync(stream)
            slot, _ = c.dram.take()
            self.rt.memcpy(c.dram_ptr(slot), c.hbm_ptr(scratch), self.bb, CopyKind.DEVICE_TO_HOST)
            c.dram.put(k, slot)
        c.hbm.free.append(scratch)
        for k in tail[n_dram:]:
            slot, _ = c.hbm.take()
            be.fill(stream, c.hbm_ptr(slot), self.bb, block_key(*k))
            c.hbm.put(k, slot)
        be.sync(stream)
        # low blocks most recent within a session (as rounds leave them)
        for k in sorted(c.hbm.lru, key=lambda k: (-k[1],)):
            c.hbm.lru.move_to_end(k)

    # -- one round ----------------------------------------------------------------------------

    def _classify(self, keys, need):
        c = self.cache
        where = ["hbm" if k in c.hbm.lru else "dram" if k in c.dram.lru else "ssd" if k in c.ssd.lru else None
                 for k in keys[:need]]
        m = where.index(None) if None in where else need
        return where, m

    def round(self, config: str, slot: int, st: SessionState, stream, copy_stream) -> tuple[float, Counts]:
        args, c, be, bb = self.args, self.cache, self.backend, self.bb
        B = args.block_tokens
        r = st.next_round
        rd = st.session.rounds[r]
        n = Counts(rounds=1)
        t0 = time.perf_counter()
        st.advance_born(r, B)
        need = rd.prefix_tokens // B
        produce_end = (rd.input_tokens + rd.output_tokens) // B
        keys = [st.key(b) for b in range(max(need, produce_end))]
        if len(keys) > c.hbm.nslots:
            raise TooLarge(f"session {st.index} round {r}: {len(keys)} blocks, more than the HBM tier's {c.hbm.nslots}")
        with c.cond:
            # where is each prefix block; wait (holding nothing) until HBM can take what must come in
            while True:
                if self.abort:
                    raise RuntimeError("aborted: another session failed")
                if any(k in c.transit for k in keys[:need]):
                    c.cond.wait(1.0)
                    continue
                where, m = self._classify(keys, need)
                loads = [(b, where[b]) for b in range(m) if where[b] != "hbm"]
                produce = list(range(m, produce_end))
                resident = {k for k in keys if k in c.hbm.lru}
                want = [b for b, _ in loads] + [b for b in produce if keys[b] not in resident]
                if len(c.hbm.free) + c.hbm.evictable(exclude=resident) >= len(want):
                    break
                n.hbm_waits += 1
                c.cond.wait(1.0)
            for k in resident:
                c.hbm.pins[k] += 1
            src = {}  # pinned first: the demotions below must not evict what this round loads
            for b, w in loads:
                tier = c.dram if w == "dram" else c.ssd
                tier.pins[keys[b]] += 1
                src[b] = tier.lru[keys[b]]
            dst: dict[int, int] = {}
            tasks = []
            for b in want:
                s, victim = c.hbm.take(exclude=resident)
                dst[b] = s
                if victim is not None:
                    tasks += self._demote(victim, s, n)
        try:
            # data moves outside the lock: demotions first (they free the slots), then loads
            for task in tasks:
                self._run_task(config, task, slot)
        finally:
            with c.cond:
                for task in tasks:
                    self._finish_task(task)
                c.cond.notify_all()
        if args.verify and loads:
            for b, _ in loads:
                be.poison(stream, c.hbm_ptr(dst[b]), bb)
            be.sync(stream)
        start = m * B  # prefill from the first missing block on: recomputed prefix and new tokens
        tokens = rd.input_tokens - start
        dram_loads = [b for b, w in loads if w == "dram"]
        ssd_loads = [b for b, w in loads if w == "ssd"]
        for b in dram_loads:
            self.rt.memcpy_async(c.hbm_ptr(dst[b]), c.dram_ptr(src[b]), bb, CopyKind.HOST_TO_DEVICE, copy_stream)
        futs = []
        if config == "phoenix":
            for b in ssd_loads:
                path, off = self.slab.where(src[b])
                futs.append((path, off, self.slab.files[path].pread((c.hbm_ptr(dst[b]), bb), bb, off)))
        # the linear layers of the uncached tokens run while the prefix loads (queued on the GPU;
        # on the CPU stand-in they run here, beside phoenix's and the copy stream's transfers)
        be.linear(stream, tokens)
        if config == "staged":
            for b in ssd_loads:  # the naive loop: pread into pinned memory, then a synchronous copy
                path, off = self.slab.where(src[b])
                fd, _direct = self.slab.fds[path]
                got = os.preadv(fd, [_host_view(self.staging[slot], bb)], off)
                if got != bb:
                    raise OSError(5, f"{path}: short read, {got} of {bb} bytes at {off}")
                self.rt.memcpy(c.hbm_ptr(dst[b]), self.staging[slot], bb, CopyKind.HOST_TO_DEVICE)
        for path, off, fu in futs:
            got = fu.result()
            if got != bb:
                raise OSError(5, f"{path}: short read, {got} of {bb} bytes at {off}")
        if dram_loads:
            self.rt.stream_synchronize(copy_stream)
        # attention over the whole context, once the prefix is in HBM
        be.attention(stream, start, tokens)
        # the KV this round produces (recomputed prefix blocks, new ones; decode's as if produced)
        for b in produce:
            if keys[b] not in resident:
                be.fill(stream, c.hbm_ptr(dst[b]), bb, block_key(*keys[b]))
        be.sync(stream)
        ttft = time.perf_counter() - t0
        # accounting and verification (untimed)
        n.blocks_needed = need
        n.hbm_hits = sum(1 for w in where[:m] if w == "hbm")
        n.dram_loads, n.ssd_loads = len(dram_loads), len(ssd_loads)
        n.recomputes = need - m
        n.bytes_loaded_dram, n.bytes_loaded_ssd = len(dram_loads) * bb, len(ssd_loads) * bb
        n.blocks_produced = len(produce)
        n.prefill_tokens = tokens
        n.recompute_tokens = max(0, rd.prefix_tokens - start)
        n.linear_tflop = self.geo.linear_flops(tokens) / 1e12
        ch = args.prefill_chunk
        n.attention_tflop = sum(self.geo.attention_flops(min(ch, tokens - p), start + p + min(ch, tokens - p))
                                for p in range(0, tokens, ch)) / 1e12
        if n.hbm_hits + n.dram_loads + n.ssd_loads + n.recomputes != n.blocks_needed:
            raise AssertionError(f"accounting does not add up: {n}")
        try:
            if args.verify:
                for b, w in loads:
                    ok = be.verify(stream, c.hbm_ptr(dst[b]), bb, block_key(*keys[b]))
                    n.bytes_verified += bb
                    if not ok:
                        n.verify_failures += 1
                        self.failures.append(f"{config}: session {st.index} round {r} block {b} loaded from {w} "
                                             "does not hold its pattern")
        finally:
            with c.cond:
                for b in range(len(keys) - 1, -1, -1):  # low blocks most recent: the prefix stays longest
                    k = keys[b]
                    if b in dst:
                        c.hbm.put(k, dst[b])
                    elif k in c.hbm.lru:
                        c.hbm.lru.move_to_end(k)
                for k in resident:
                    c.hbm.pins[k] -= 1
                for b, w in loads:
                    tier = c.dram if w == "dram" else c.ssd
                    tier.pins[keys[b]] -= 1
                    if keys[b] in tier.lru:
                        tier.lru.move_to_end(keys[b])
                c.cond.notify_all()
        return ttft, n

    # -- demotion ------------------------------------------------------------------------------

    def _demote(self, victim, hbm_slot: int, n: Counts) -> list:
        """Under the lock: where an HBM victim goes (and what that evicts). Returns tasks."""
        c = self.cache
        tasks = []
        if victim in c.dram.lru or victim in c.ssd.lru:
            return tasks  # lower tiers are inclusive: a copy is there already
        c.transit.add(victim)
        dslot, dvictim = c.dram.take()
        if dslot is not None:
            if dvictim is not None:
                tasks += self._to_ssd(dvictim, ("dram", dslot), n)
            tasks.append(("h2dram", victim, hbm_slot, dslot))
            n.demoted_to_dram += 1
            return tasks
        # DRAM has no slot to give (all pinned by loads in flight): straight to SSD, or dropped
        tasks += self._to_ssd(victim, ("hbm", hbm_slot), n)
        return tasks

    def _to_ssd(self, key, src, n: Counts) -> list:
        c = self.cache
        if key in c.ssd.lru:
            c.transit.discard(key)
            return [("nop", key)]
        if c.config == "dram":
            n.dropped += 1
            return [("nop", key)]
        sslot, _svictim = c.ssd.take()
        if sslot is None:
            n.dropped += 1
            return [("nop", key)]
        c.transit.add(key)
        n.written_to_ssd += 1
        n.bytes_written_ssd += self.bb
        return [("to_ssd", key, src, sslot)]

    def _run_task(self, config: str, task, slot: int) -> None:
        c, bb = self.cache, self.bb
        if task[0] == "h2dram":
            _, _key, hslot, dslot = task
            self.rt.memcpy(c.dram_ptr(dslot), c.hbm_ptr(hslot), bb, CopyKind.DEVICE_TO_HOST)
        elif task[0] == "to_ssd":
            _, _key, (tier, sslot_src), sslot = task
            path, off = self.slab.where(sslot)
            if config == "phoenix":
                ptr = c.dram_ptr(sslot_src) if tier == "dram" else c.hbm_ptr(sslot_src)
                got = self.slab.files[path].write((ptr, bb), bb, off)
            else:
                if tier == "dram":
                    ptr = c.dram_ptr(sslot_src)
                else:
                    ptr = self.staging[slot]
                    self.rt.memcpy(ptr, c.hbm_ptr(sslot_src), bb, CopyKind.DEVICE_TO_HOST)
                fd, _direct = self.slab.fds[path]
                got = os.pwritev(fd, [_host_view(ptr, bb)], off)
            if got != bb:
                raise OSError(5, f"{path}: short write {got} of {bb} at {off}")

    def _finish_task(self, task) -> None:
        c = self.cache
        if task[0] == "h2dram":
            c.dram.put(task[1], task[3])
        elif task[0] == "to_ssd":
            c.ssd.put(task[1], task[3])
        c.transit.discard(task[1])

    # -- records ---------------------------------------------------------------------------------

    def _record(self, config: str, conc: int, elapsed: float) -> dict:
        t = sorted(self.ttfts)
        n = self.point_counts
        rec = {
            "config": config, "concurrency": conc, "vendor": self.rt.name, "test_double": bool(self.rt.is_test_double),
            "rounds": len(t), "seconds": elapsed, "qps": len(t) / elapsed if elapsed > 0 else 0.0,
            "ttft_mean_s": sum(t) / len(t) if t else None, "ttft_p50_s": _pct(t, 0.50), "ttft_p99_s": _pct(t, 0.99),
            "ttft_max_s": t[-1] if t else None, "threshold_s": self.args.threshold,
            "under_threshold": bool(t) and _pct(t, 0.99) < self.args.threshold,
            "sessions_ended_hbm_full": self.truncated, "counts": asdict(n), "verified": n.verify_failures == 0, "failures": self.failures[:10],
        }
        return rec


def _pct(xs: list, q: float):
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


# ---- report ------------------------------------------------------------------------------------


def best_concurrency(records: list[dict]) -> dict:
    """Per config: the most concurrent sessions with p99 TTFT under the threshold (0: none)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["config"], 0)
        if r["under_threshold"]:
            out[r["config"]] = max(out[r["config"]], r["concurrency"])
    return out


def table(records: list[dict]) -> str:
    lines = [f"{'config':<8} {'conc':>4} {'rounds':>6} {'QPS':>7} {'TTFT mean':>9} {'p50':>7} {'p99':>7}  "
             f"{'hbm':>5} {'dram':>5} {'ssd':>5} {'recomp':>6} {'GB ld':>7} {'verified':>8}"]
    for r in records:
        c = r["counts"]

        def f(x):
            return f"{x:.3f}" if x is not None else "-"

        lines.append(f"{r['config']:<8} {r['concurrency']:>4} {r['rounds']:>6} {r['qps']:>7.2f} {f(r['ttft_mean_s']):>9} "
                     f"{f(r['ttft_p50_s']):>7} {f(r['ttft_p99_s']):>7}  {c['hbm_hits']:>5} {c['dram_loads']:>5} "
                     f"{c['ssd_loads']:>5} {c['recomputes']:>6} {(c['bytes_loaded_dram'] + c['bytes_loaded_ssd']) / 1e9:>7.2f} "
                     f"{'yes' if r['verified'] else 'NO':>8}")
    best = best_concurrency(records)
    thr = records[0]["threshold_s"] if records else 0
    lines.append(f"most concurrent sessions with p99 TTFT < {thr:g} s: " +
                 ", ".join(f"{k} {v}" for k, v in best.items()))
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'phoenix-direct-storage[bench]'): no plot written"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for cfg in CONFIGS:
        pts = sorted((r["concurrency"], r["ttft_p99_s"], r["qps"]) for r in records if r["config"] == cfg and r["ttft_p99_s"] is not None)
        if not pts:
            continue
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=cfg)
    if records:
        axes[0].axhline(records[0]["threshold_s"], color="gray", linestyle="--", label=f"threshold {records[0]['threshold_s']:g} s")
    for ax, yl in zip(axes, ("p99 TTFT (s)", "rounds per second (QPS)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


# ---- command line -------------------------------------------------------------------------------

DRY_RUN = {"layers": 2, "kv_heads": 2, "head_dim": 64, "q_heads": 4, "hidden": 256, "ffn": 512, "block_tokens": 16,
           "token_scale": 0.01, "hbm": parse_size("2M"), "dram": parse_size("512K"), "ssd": parse_size("64M"), "sessions": 8,
           "duration": 1.5, "time_scale": 0.01, "concurrency": [1, 4], "prefill_chunk": 256}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _configs(s: str) -> list[str]:
    out = [x for x in s.split(",") if x]
    bad = [x for x in out if x not in CONFIGS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown config {bad}: choose from {', '.join(CONFIGS)}")
    return out


def _trace_args(p) -> None:
    p.add_argument("--sessions", type=int, default=64, help="sessions to generate (default 64)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")


def add_parser(sub) -> None:
    """``phx bench kv-trace [gen]``: called from phoenix.bench.add_parser."""
    p = sub.add_parser(
        "kv-trace", help="replay an agentic KV-cache trace through DRAM-only, staged-SSD and phoenix tiers",
        description="Replay agentic sessions (a seeded trace with the statistics of Codex runs on SWE-bench Pro, or "
        "--trace FILE) through an HBM tier (vendor device memory), a DRAM tier (pinned host memory) and an SSD tier "
        "(a slab file), for the configurations dram (evicted KV is recomputed), staged (SSD through the naive staged "
        "loop) and phoenix (SSD through phoenix); prefill of uncached tokens is real compute of the model's shape. "
        "Reports TTFT (mean, p50, p99), QPS and the most concurrent sessions under the TTFT threshold. "
        "'phx bench kv-trace gen --out FILE' writes a trace.")
    _trace_args(p)
    p.add_argument("--trace", metavar="FILE", help="replay this trace file instead of generating one")
    p.add_argument("--configs", type=_configs, default=list(CONFIGS), help="comma-separated of dram,staged,phoenix (default all)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16], help="concurrent sessions to sweep (default 1,2,4,8,16)")
    p.add_argument("--threshold", type=float, default=5.0, help="TTFT threshold in seconds (default 5)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of replay per (config, concurrency) point (default 20)")
    p.add_argument("--time-scale", type=float, default=1.0, help="think times are multiplied by this (default 1: real time)")
    p.add_argument("--token-scale", type=float, default=1.0, help="token counts are multiplied by this (default 1)")
    p.add_argument("--warm-start", type=float, default=0.6,
                   help="initial sessions start at a round drawn from the first FRACTION of their rounds, their history "
                   "already cached (default 0.6; 0: from round 0)")
    g = p.add_argument_group("model geometry (bytes per token = layers x 2 x kv-heads x head-dim x dtype)")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--q-heads", type=int, default=32)
    g.add_argument("--hidden", type=int, default=0, help="hidden size (default q-heads x head-dim)")
    g.add_argument("--ffn", type=int, default=14336, help="FFN intermediate size (default 14336)")
    g.add_argument("--dtype", default="fp16", choices=list(DTYPE_BYTES))
    t = p.add_argument_group("tiers")
    t.add_argument("--block-tokens", type=int, default=256, help="tokens per KV block (default 256)")
    t.add_argument("--hbm", type=parse_size, default=parse_size("8G"), help="HBM tier capacity (default 8G)")
    t.add_argument("--dram", type=parse_size, default=parse_size("8G"), help="DRAM tier capacity, pinned (default 8G)")
    t.add_argument("--ssd", type=parse_size, default=parse_size("32G"),
                   help="SSD tier capacity for blocks demoted during the replay (default 32G; history comes on top)")
    t.add_argument("--slab", default="/tmp/phx-kvtrace.slab", help="slab file of the SSD tier (and SLAB.history)")
    t.add_argument("--keep-slab", action="store_true", help="leave the slab files in place")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="chunked prefill: tokens per chunk (default 4096)")
    p.add_argument("--compute", default="auto", choices=["auto", "torch", "cupy", "numpy"],
                   help="prefill backend (default auto: torch, else CuPy on GPUs; NumPy on the host vendor)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="do not poison and check loaded blocks")
    p.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")
    p.add_argument("--label", default="", help="a label for the records and the plot (e.g. 'local disk')")
    p.add_argument("--dry-run", action="store_true", help="tiny geometry, trace and capacities: the same code path in seconds")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of p99 TTFT and QPS against concurrency")
    p.set_defaults(func=main, kv_cmd=None, _kv_parser=p)
    ksub = p.add_subparsers(dest="kv_cmd", metavar="{gen}")
    gp = ksub.add_parser("gen", help="write a generated trace (JSON lines) and print its statistics")
    _trace_args(gp)
    gp.add_argument("--out", required=True, metavar="FILE", help="trace file to write")
    gp.set_defaults(func=main_gen)


def apply_dry_run(args) -> None:
    """The --dry-run sizes, for every option left at its default."""
    parser = getattr(args, "_kv_parser", None)
    for k, v in DRY_RUN.items():
        if parser is None or getattr(args, k) == parser.get_default(k):
            setattr(args, k, v)


def main_gen(args) -> int:
    trace = generate(args.sessions, args.seed)
    write_trace(trace, args.out)
    print(json.dumps(trace_stats(trace), indent=1))
    print(f"trace of {len(trace.sessions)} sessions written to {args.out}")
    return 0


def _meta(args, rp, stats) -> dict:
    return {
        "host": socket.gethostname(), "platform": platform.platform(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "label": args.label, "compute": rp.backend.name, "compute_label": rp.backend.label, "verify": args.verify,
        "verify_where": rp.backend.verify_where if args.verify else "off", "hbm_alloc": rp.cache.hbm_alloc,
        "geometry": asdict(rp.geo), "bytes_per_token": rp.geo.bytes_per_token, "block_tokens": args.block_tokens,
        "block_bytes": rp.bb, "hbm_bytes": rp.cache.hbm.nslots * rp.bb, "dram_bytes": rp.cache.dram.nslots * rp.bb,
        "ssd_dynamic_bytes": rp.cache.ssd.nslots * rp.bb, "history_bytes": len(rp.history) * rp.bb, "slab": args.slab,
        "slab_write_s": rp.slab_write_s, "time_scale": args.time_scale, "token_scale": args.token_scale,
        "duration_s": args.duration, "warm_start": args.warm_start, "trace": args.trace or f"generated seed {args.seed}",
        "trace_stats": stats, "dry_run": args.dry_run, "real": "I/O (slab reads and writes), host<->device copies, "
        "prefill compute of the model's shape", "simulated": "sessions and their statistics (trace), think time "
        "(time scale), token counts (token scale), the model (no weights or tokens; one layer's matrices serve every "
        "layer), KV contents (verification patterns), decode (not run)",
    }


def run(args, log=print, on_record=None) -> list[dict]:
    """Every (concurrency, config) point; ``on_record(records)`` after each (partial results survive a kill)."""
    if args.dry_run:
        apply_dry_run(args)
    trace = read_trace(args.trace) if args.trace else generate(args.sessions, args.seed)
    stats = trace_stats(trace)
    rp = Replayer(args, trace, log=log)
    records: list[dict] = []
    try:
        log(f"kv-trace: vendor {rp.rt.name}{' (TEST DOUBLE: device memory is host memory)' if rp.rt.is_test_double else ''}, "
            f"compute {rp.backend.label}; {rp.geo.bytes_per_token >> 10} KiB/token, block {rp.bb >> 10} KiB "
            f"({args.block_tokens} tokens); HBM {rp.cache.hbm.nslots} blocks, DRAM {rp.cache.dram.nslots}, "
            f"SSD {rp.cache.ssd.nslots} + {len(rp.history)} history")
        log(f"simulated: trace ({'file ' + args.trace if args.trace else f'generated, seed {args.seed}'}), think times x "
            f"{args.time_scale:g}, token counts x {args.token_scale:g}, {args.duration:g} s per point; decode not run")
        rp.prepare()
        meta = _meta(args, rp, stats)
        for conc in args.concurrency:
            for cfg in args.configs:
                rec = rp.run_point(cfg, conc)
                rec["label"] = args.label
                rec["meta"] = meta
                records.append(rec)
                log(f"  {cfg:<8} conc {conc:>3}: {rec['rounds']} rounds, p99 TTFT "
                    f"{rec['ttft_p99_s'] if rec['ttft_p99_s'] is None else round(rec['ttft_p99_s'], 3)} s, "
                    f"QPS {rec['qps']:.2f}{'' if rec['verified'] else ', VERIFICATION FAILED'}")
                if on_record:
                    on_record(records)
    finally:
        rp.close()
    return records


def _write_json(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(records, fh, indent=1)
    os.replace(tmp, path)


def main(args) -> int:
    records = run(args, on_record=(lambda recs: _write_json(args.json, recs)) if args.json else None)
    print(table(records))
    if records and records[0]["test_double"]:
        print(f"\nvendor {records[0]['vendor']} is a test double: 'device memory' is host memory and the prefill is a CPU "
              "stand-in; these are not accelerator figures.")
    m = records[0]["meta"] if records else {}
    print(f"simulated: think times x {m.get('time_scale')}, token counts x {m.get('token_scale')}; real: I/O, copies, compute of the shape.")
    if args.json:
        _write_json(args.json, records)
        print(f"records written to {args.json}")
    if args.plot:
        lab = f" [{args.label}]" if args.label else ""
        title = (f"phx bench kv-trace{lab}: vendor {m.get('vendor', records[0]['vendor'] if records else '?')}"
                 f"{' (test double)' if records and records[0]['test_double'] else ''}, {m.get('bytes_per_token', 0) >> 10} KiB/token, "
                 f"think x{m.get('time_scale')}, tokens x{m.get('token_scale')}")
        print(plot(records, args.plot, title))
    failed = [r for r in records if not r["verified"]]
    if failed:
        print(f"VERIFICATION FAILED in {len(failed)} points: {failed[0]['failures'][:3]}", file=sys.stderr)
        return 1
    return 0
