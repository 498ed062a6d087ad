"""phxloader: safetensors files -> device tensors through the phoenix I/O stack.

Adapter, control plane. ``safetensors.torch.load_file(path, device="cuda")`` maps the
file, lets the page cache fault it in, and copies tensor by tensor. phxloader instead:

* parses the header itself (8-byte little-endian length, JSON: dtype, shape,
  data_offsets per tensor, optional ``__metadata__``), checking every extent;
* allocates each destination tensor (``torch.empty(shape, dtype, device)``) in file
  order and reads its bytes straight into it through :mod:`phoenix.io` (one request per
  tensor, submitted in groups of about ``chunk`` bytes, ``depth`` groups in flight, so
  the allocations overlap with the reads): for device memory that is phoenix's staged
  pipeline (O_DIRECT into pinned bounce slots, the vendor's copy on per-worker streams,
  the next chunk read while this one is copied) or its direct path, for host memory
  O_DIRECT in place; all of it in the C core's workers, without the GIL. No staging
  ring of its own and no second copy.

Destinations (``device``): ``"cuda"`` / ``"cuda:N"`` / a ``torch.device`` (torch), ``"cpu"``
(torch CPU tensors, or NumPy arrays without torch or with ``framework="numpy"``), and
``"phx"`` / ``"phx:N"``: device memory of the vendor ``PHX_VENDOR`` selects, allocated by
phoenix (NumPy arrays over it where the CPU can address it, as with the ``host`` test
vendor; else :class:`DeviceArray`, which has ``__cuda_array_interface__``).

Dtypes: every safetensors dtype: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3
F8_E5M2 C64, and U16 U32 U64 (torch >= 2.3) and F8_E8M0 where torch has them. NumPy has
no bfloat16 nor float8: without ``ml_dtypes`` those load as their raw bits (uint16 /
uint8 arrays of the same shape), the safetensors dtype in :attr:`LoadedTensors.dtypes`.

::

    from phoenix import phxloader
    sd = phxloader.load_file("model.safetensors", device="cuda")       # dict name -> tensor
    sd.metadata                                                          # the file's __metadata__
    sd = phxloader.load(["model-00001-of-00002.safetensors", ...], device="cuda:0")

Its bench (against ``safetensors`` and raw O_DIRECT) is ``phx bench loader`` (phoenix.bench.loader).

Settings: the phoenix I/O settings (``PHX_THREADS``, ``PHX_CHUNK_SIZE``, ``PHX_MODE`` ...)
apply to the reads; ``chunk`` and ``depth`` (submission groups) are arguments here. CUDA
tensors need phoenix's ``nvidia`` vendor (``PHX_VENDOR=nvidia``, or ``auto`` on a CUDA
machine): phoenix copies into them itself.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import json
import math
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DTYPES",
    "TensorInfo",
    "Header",
    "LoadedTensors",
    "DeviceArray",
    "read_header",
    "read_metadata",
    "load_file",
    "load",
    "save_file",
]

ALIGN = 4096
MAX_HEADER = 100_000_000  # safetensors' own limit
DEFAULT_CHUNK = 256 << 20  # bytes of tensors per submitted group
DEFAULT_DEPTH = 8  # groups in flight


@dataclass(frozen=True)
class _DType:
    itemsize: int
    numpy: str | None  # NumPy's dtype (None: no NumPy type; ml_dtypes' or raw bits)
    torch: str  # torch attribute name
    raw: str  # NumPy dtype of the raw bits when NumPy has no type
    ml_dtypes: str | None = None  # ml_dtypes attribute name, if that package is installed


#: safetensors dtype -> item size, NumPy and torch types
DTYPES: dict[str, _DType] = {
    "F64": _DType(8, "<f8", "float64", "<f8"),
    "F32": _DType(4, "<f4", "float32", "<f4"),
    "F16": _DType(2, "<f2", "float16", "<f2"),
    "BF16": _DType(2, None, "bfloat16", "<u2", "bfloat16"),
    "I64": _DType(8, "<i8", "int64", "<i8"),
    "I32": _DType(4, "<i4", "int32", "<i4"),
    "I16": _DType(2, "<i2", "int16", "<i2"),
    "I8": _DType(1, "i1", "int8", "i1"),
    "U64": _DType(8, "<u8", "uint64", "<u8"),
    "U32": _DType(4, "<u4", "uint32", "<u4"),
    "U16": _DType(2, "<u2", "uint16", "<u2"),
    "U8": _DType(1, "u1", "uint8", "u1"),
    "BOOL": _DType(1, "?", "bool", "?"),
    "F8_E4M3": _DType(1, None, "float8_e4m3fn", "u1", "float8_e4m3fn"),
    "F8_E5M2": _DType(1, None, "float8_e5m2", "u1", "float8_e5m2"),
    "F8_E8M0": _DType(1, None, "float8_e8m0fnu", "u1", "float8_e8m0fnu"),
    "C64": _DType(8, "<c8", "complex64", "<c8"),
}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype phxloader gives a safetensors dtype (raw bits where NumPy has none)."""
    d = DTYPES[name]
    if d.numpy is not None:
        return np.dtype(d.numpy)
    if d.ml_dtypes:
        try:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, d.ml_dtypes))
        except (ImportError, AttributeError):
            pass
    return np.dtype(d.raw)


def torch_dtype(torch, name: str):
    t = getattr(torch, DTYPES[name].torch, None)
    if t is None:
        raise TypeError(f"safetensors dtype {name}: this torch ({torch.__version__}) has no torch.{DTYPES[name].torch}")
    return t


# ---- the header ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  #: safetensors dtype name
    shape: tuple
    begin: int  #: absolute file offset of the first byte
    end: int  #: absolute file offset past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: str
    file_size: int
    data_start: int  #: absolute offset of the data section (8 + header length)
    tensors: dict  #: name -> TensorInfo, in header order
    metadata: dict | None  #: ``__metadata__`` (str -> str), None when absent


def read_header(path) -> Header:
    """Parse and check a safetensors header (ValueError naming what is wrong)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes: no 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: header length {n} is invalid for a file of {size} bytes")
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the header is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: the header is not a safetensors header (JSON nested too deeply)") from None
    if not isinstance(hdr, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data_start = 8 + n
    data_len = size - data_start
    metadata = hdr.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise ValueError(f"{path}: __metadata__ must map strings to strings")
    tensors = {}
    for name, e in hdr.items():
        try:
            dtype, shape, (b, en) = e["dtype"], e["shape"], e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: needs dtype, shape and data_offsets [begin, end]") from None
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_count(s) and s < 1 << 63 for s in shape):
            raise ValueError(f"{path}: tensor {name!r}: bad shape {shape!r} (dimensions are integers in [0, 2**63))")
        if len(shape) > 64 or math.prod(s for s in shape if s) * DTYPES[dtype].itemsize >= 1 << 63:
            raise ValueError(
                f"{path}: tensor {name!r}: shape {shape!r} is no array (at most 64 dimensions, 2**63 bytes)"
            )
        if not (_count(b) and _count(en) and b <= en <= data_len):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets [{b}, {en}) outside the {data_len}-byte data")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if en - b != want:
            raise ValueError(f"{path}: tensor {name!r}: {en - b} bytes for {dtype} {tuple(shape)} ({want} expected)")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + b, data_start + en)
    # as safetensors: the tensors tile the data section, in offset order, with no gap, no
    # overlap and nothing after the last
    end = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != end:
            how = "overlaps the tensor before it" if t.begin < end else f"leaves {t.begin - end} bytes unused before it"
            raise ValueError(
                f"{path}: tensor {t.name!r}: data_offsets [{t.begin - data_start}, {t.end - data_start}) {how} "
                "(the tensors must tile the data section)"
            )
        end = t.end
    if end != size:
        raise ValueError(
            f"{path}: the tensors cover {end - data_start} of the {data_len} data bytes "
            "(the tensors must tile the data section)"
        )
    return Header(path, size, data_start, tensors, metadata)


def _count(x) -> bool:
    """A JSON count: an int >= 0 (not a bool, which Python counts as an int)."""
    return type(x) is int and x >= 0


def read_metadata(path) -> dict | None:
    """The file's ``__metadata__`` (None when absent)."""
    return read_header(path).metadata


def save_file(tensors: dict, path, metadata: dict | None = None, dtypes: dict | None = None) -> None:
    """Write NumPy arrays as a safetensors file (for tests and benches; no torch needed).

    ``dtypes`` overrides the safetensors dtype of some tensors (``{"w": "BF16"}`` for a
    uint16 array holding bfloat16 bits; the item sizes must agree). Tensors are laid out
    largest item size first, so every tensor is aligned to its item size.
    """
    by_np = {np.dtype(d.numpy).str: k for k, d in DTYPES.items() if d.numpy}
    by_np[np.dtype("?").str] = "BOOL"
    entries, blobs, off = {}, [], 0
    dtypes = dtypes or {}
    order = sorted(tensors, key=lambda k: -np.asarray(tensors[k]).dtype.itemsize)
    for name in order:
        a = np.ascontiguousarray(tensors[name])
        st = dtypes.get(name) or by_np.get(a.dtype.str) or by_np.get(a.dtype.newbyteorder("<").str)
        if st is None:
            raise TypeError(f"{name}: no safetensors dtype for {a.dtype}; say it in dtypes=")
        if DTYPES[st].itemsize != a.dtype.itemsize:
            raise TypeError(f"{name}: {st} has {DTYPES[st].itemsize}-byte items, the array {a.dtype.itemsize}")
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        entries[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata is not None:
        entries = {"__metadata__": dict(metadata), **entries}
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the data section starts 8-aligned, as safetensors writes it
    with open(os.fspath(path), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


# ---- results ------------------------------------------------------------------------------


class LoadedTensors(dict):
    """name -> tensor, plus :attr:`metadata` (the ``__metadata__`` of the file, or of the
    first file that has one), :attr:`file_metadata` (path -> metadata), :attr:`dtypes`
    (name -> safetensors dtype) and :attr:`stats` (bytes, seconds, chunks)."""

    metadata: dict | None = None
    file_metadata: dict
    dtypes: dict
    stats: dict


class _DevMem:
    """One vendor device allocation, freed when the last array over it goes."""

    def __init__(self, rt, size: int, device: int):
        self.rt = rt
        self.size = size
        self.ptr = rt.device_alloc(size, device) if size else 0

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                self.rt.device_free(ptr)
            except Exception:
                pass


class DeviceArray:
    """A tensor in vendor device memory the CPU cannot address (``device="phx"``):
    ``__cuda_array_interface__`` for torch / CuPy, ``ptr``, ``nbytes``, ``dtype``, ``shape``."""

    def __init__(self, mem: _DevMem, dtype: str, shape: tuple, npdtype: np.dtype):
        self._mem = mem
        self.ptr = mem.ptr
        self.nbytes = mem.size
        self.dtype = dtype
        self.shape = shape
        self._np = npdtype

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self._np.str, "data": (self.ptr, False), "version": 3, "strides": None}

    def to_numpy(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self._np)
        if self.nbytes:
            from .vendor import CopyKind

            self._mem.rt.memcpy(out.ctypes.data, self.ptr, self.nbytes, CopyKind.DEVICE_TO_HOST)
        return out

    def __repr__(self):
        return f"<DeviceArray {self.dtype} {self.shape} at {self.ptr:#x}>"


# ---- destinations (sinks) -------------------------------------------------------------------


class _Sink:
    """Where tensors go: allocation, and the buffer phoenix reads each one into."""

    name = "?"

    def alloc(self, info: TensorInfo):  # -> (object returned to the user, its address)
        raise NotImplementedError

    def close(self) -> None:
        pass


class _NumpySink(_Sink):
    name = "numpy"

    def alloc(self, info):
        a = np.empty(info.shape, dtype=numpy_dtype(info.dtype))
        return a, a.ctypes.data


class _TorchSink(_Sink):
    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.name = f"torch:{device}"
        if device.type == "cuda":
            _check_runtime_sees(torch.empty(1, dtype=torch.uint8, device=device), device)

    def alloc(self, info):
        t = self.torch.empty(info.shape, dtype=torch_dtype(self.torch, info.dtype), device=self.device)
        return t, t.data_ptr()


def _check_runtime_sees(probe, device) -> None:
    """phoenix reads into CUDA tensors through its vendor runtime: that runtime must know
    CUDA memory as device memory (PHX_VENDOR=nvidia, or auto on a CUDA machine)."""
    import importlib

    from .buffers import MEM_HOST, classify

    rt = importlib.import_module("phoenix.io")._runtime()
    mem = classify(rt, probe.data_ptr(), 1, "device", device.index)[0] if rt is not None else MEM_HOST
    if mem == MEM_HOST:
        name = getattr(rt, "name", None)
        raise ValueError(
            f"device {device}: the phoenix vendor runtime {name!r} does not know CUDA memory; "
            "select PHX_VENDOR=nvidia (or auto) to load into CUDA tensors"
        )


class _VendorSink(_Sink):
    def __init__(self, rt, ordinal: int):
        from .buffers import MEM_DEVICE_MAPPED, classify

        self.rt = rt
        self.ordinal = ordinal
        self.name = f"phx:{rt.name}:{ordinal}"
        probe = rt.device_alloc(1 << 16, ordinal)
        try:
            self.addressable = classify(rt, probe, 1 << 16)[0] == MEM_DEVICE_MAPPED
        finally:
            rt.device_free(probe)

    def alloc(self, info):
        npd = numpy_dtype(info.dtype)
        mem = _DevMem(self.rt, info.nbytes, self.ordinal)
        if self.addressable:
            if not info.nbytes:
                return np.empty(info.shape, dtype=npd), 0
            carr = (ctypes.c_uint8 * info.nbytes).from_address(mem.ptr)
            carr._phx_owner = mem  # the array's base keeps the allocation alive
            return np.frombuffer(carr, dtype=npd).reshape(info.shape), mem.ptr
        return DeviceArray(mem, info.dtype, info.shape, npd), mem.ptr


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _sink(device, framework: str | None) -> _Sink:
    if framework not in (None, "torch", "numpy"):
        raise ValueError(f"framework {framework!r}: 'torch', 'numpy' or None (torch when installed)")
    if isinstance(device, int):
        torch = _torch()
        device = f"cuda:{device}" if torch is not None and torch.cuda.is_available() else f"phx:{device}"
    dev = "cpu" if device is None else device
    if isinstance(dev, str) and (dev == "phx" or dev.startswith("phx:")):
        from .registry import get_runtime

        ordinal = int(dev.split(":", 1)[1]) if ":" in dev else 0
        import importlib

        rt = importlib.import_module("phoenix.io")._runtime() or get_runtime()
        return _VendorSink(rt, ordinal)
    torch = _torch() if framework != "numpy" else None
    if torch is None:
        if framework == "torch":
            raise ImportError("framework='torch' but torch is not installed")
        if str(dev) != "cpu":
            raise ValueError(f"device {dev!r} needs torch (not installed); use 'cpu' or 'phx:N'")
        return _NumpySink()
    tdev = torch.device(dev)
    if tdev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {dev!r}: phxloader loads to 'cpu', 'cuda[:N]' or 'phx[:N]'")
    if tdev.type == "cuda" and tdev.index is None:
        tdev = torch.device("cuda", torch.cuda.current_device())
    return _TorchSink(torch, tdev)


# ---- the pipeline -----------------------------------------------------------------------------


def load(
    paths, device="cpu", *, framework: str | None = None, chunk: int = DEFAULT_CHUNK, depth: int = DEFAULT_DEPTH
) -> LoadedTensors:
    """Load one or many safetensors files; name -> tensor (see :class:`LoadedTensors`).

    A tensor name in two files is an error (ValueError). Tensors are allocated in file
    order and submitted in groups of about ``chunk`` bytes (a positive multiple of 4096),
    one :func:`phoenix.io.batch` each; at most ``depth`` (>= 1) groups are in flight, so
    the allocations of a group overlap with the reads of the groups before it.
    """
    import collections
    import importlib

    pio = importlib.import_module("phoenix.io")
    OwnedPair = importlib.import_module("phoenix._extents").OwnedPair
    from .errors import PhxIOError

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk {chunk}: a positive multiple of {ALIGN}")
    if depth < 1:
        raise ValueError(f"depth {depth}: at least 1 group in flight")
    t0 = time.perf_counter()
    headers = [read_header(p) for p in paths]
    out = LoadedTensors()
    out.file_metadata = {h.path: h.metadata for h in headers}
    out.metadata = next((h.metadata for h in headers if h.metadata is not None), None)
    out.dtypes = {}
    owner: dict = {}
    for h in headers:
        for name in h.tensors:
            if name in owner:
                raise ValueError(f"tensor {name!r} is in both {owner[name]} and {h.path}")
            owner[name] = h.path

    sink = _sink(device, framework)
    dst: dict = {}
    files: dict = {}
    inflight: collections.deque = collections.deque()  # [(futures, [(path, offset, size)])]
    nreq = ngroups = 0
    spent = {"alloc": 0.0, "submit": 0.0, "wait": 0.0}  # seconds of this thread, for stats

    def drain_one():
        futs, meta = inflight[0]
        tw = time.perf_counter()
        errs = [fut.exception() for fut in futs]  # the whole group has landed (or failed) first
        spent["wait"] += time.perf_counter() - tw
        inflight.popleft()
        for fut, err, (path, off, size) in zip(futs, errs, meta, strict=True):
            if err is not None:
                raise err  # PhxIOError naming the file, offset and length
            got = fut.result()
            if got < size:
                raise PhxIOError(
                    _errno.EIO, path, off, size, f"short read ({got} bytes): the file is shorter than its header says"
                )

    try:
        reqs, meta, group_bytes = [], [], 0

        def submit():
            nonlocal reqs, meta, group_bytes, nreq, ngroups
            if reqs:
                ts = time.perf_counter()
                inflight.append((pio.batch(reqs, wait=False), meta))
                spent["submit"] += time.perf_counter() - ts
                nreq, ngroups = nreq + len(reqs), ngroups + 1
                reqs, meta, group_bytes = [], [], 0
                while len(inflight) >= depth + 1 or (inflight and inflight[0][0][-1].done()):
                    drain_one()

        for fi, h in enumerate(headers):
            for t in sorted(h.tensors.values(), key=lambda t: t.begin):
                ta = time.perf_counter()
                obj, addr = dst[(fi, t.name)] = sink.alloc(t)
                spent["alloc"] += time.perf_counter() - ta
                if not t.nbytes:
                    continue
                f = files.get(fi)
                if f is None:
                    f = files[fi] = pio.open(h.path, "r")
                # (the sink holds obj in dst: its memory is copied into with memcpy)
                reqs.append((f, OwnedPair((addr, t.nbytes)), t.nbytes, t.begin, 0, "read"))
                meta.append((h.path, t.begin, t.nbytes))
                group_bytes += t.nbytes
                if group_bytes >= chunk:
                    submit()
        submit()
        while inflight:
            drain_one()
    finally:
        for futs, _ in inflight:  # a failure: wait for the reads still landing in the tensors
            for fut in futs:
                fut.exception()
        for f in files.values():
            f.close()
        sink.close()
    nbytes = 0
    for fi, h in enumerate(headers):  # header order
        for name, t in h.tensors.items():
            out[name] = dst[(fi, name)][0]
            out.dtypes[name] = t.dtype
            nbytes += t.nbytes
    out.stats = {
        "bytes": nbytes,
        "seconds": time.perf_counter() - t0,
        "requests": nreq,
        "groups": ngroups,
        "chunk": chunk,
        "depth": depth,
        "sink": sink.name,
        "files": len(paths),
        **{f"{k}_seconds": round(v, 4) for k, v in spent.items()},
    }
    return out


def load_file(path, device="cpu", **kw) -> LoadedTensors:
    """Load one safetensors file (``safetensors.torch.load_file``'s shape); see :func:`load`."""
    return load([path], device, **kw)


if __name__ == "__main__":  # the bench that lived here is `phx bench loader` (an adapter imports no CLI)
    import sys

    print(
        "python -m phoenix.phxloader: phxloader is a library; its bench is `phx bench loader FILE` "
        "(see `phx bench loader --help`)",
        file=sys.stderr,
    )
    sys.exit(2)
