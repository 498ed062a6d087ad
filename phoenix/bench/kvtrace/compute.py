"""The kv-trace's model and compute: geometry, block patterns, and the prefill per vendor.

Benchmark side. The geometry gives bytes per token and FLOPs; every block version has a
pattern (64-bit word i is ``key ^ i``) that a load must reproduce; a backend fills,
poisons and verifies blocks in device memory and runs the prefill's matrix products and
attention: torch or CuPy on a GPU, NumPy on the CPU as a labelled stand-in (host vendor).
"""

from __future__ import annotations

from dataclasses import dataclass

from phoenix.vendor import CopyKind

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
POISON = 0xA5
MASK63 = (1 << 63) - 1


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


# ---- compute backends (the data side of the replay, per vendor) -----------------------------------


class _DevArray:
    """A ``__cuda_array_interface__`` over raw device memory (for torch.as_tensor / cupy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


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
        return self.hbm[off : off + nbytes]

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
        return self.hbm[off : off + nbytes]

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
    raise RuntimeError(
        f"no GPU compute backend for vendor {rt.name!r} ({'; '.join(errors)}); "
        "install torch or CuPy, or pass --compute numpy (CPU stand-in)"
    )
