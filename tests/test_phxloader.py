"""phxloader: safetensors files -> tensors through the phoenix I/O stack, checked against
safetensors' own loader tensor by tensor, byte for byte (CPU; host vendor for "phx")."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from phoenix import phxloader
from phoenix._testing import inject_fault
from phoenix.errors import PhxIOError

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed (pip install torch: CPU wheel)")
FRAMEWORKS = ["numpy", pytest.param("torch", marks=needs_torch)]


def _bytes(x) -> bytes:
    """The raw bytes of a tensor / array (what must be equal)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def _shape(x) -> tuple:
    return tuple(x.shape)


def _numpy_tensors(rng) -> dict:
    """Every dtype NumPy has (safetensors.numpy can write them), odd shapes and offsets."""
    t = {
        "f64": rng.standard_normal((33, 7)),
        "f32": rng.standard_normal((129, 65)).astype(np.float32),
        "f16": rng.standard_normal((1000,)).astype(np.float16),
        "i64": rng.integers(-(2**62), 2**62, (5, 4, 3), dtype=np.int64),
        "i32": rng.integers(-(2**31), 2**31 - 1, (77,), dtype=np.int32),
        "i16": rng.integers(-(2**15), 2**15 - 1, (3, 3), dtype=np.int16),
        "i8": rng.integers(-128, 127, (4099,), dtype=np.int8),
        "u8": rng.integers(0, 255, (4097,), dtype=np.uint8),
        "u16": rng.integers(0, 2**16 - 1, (11, 13), dtype=np.uint16),
        "u32": rng.integers(0, 2**32 - 1, (17,), dtype=np.uint32),
        "u64": rng.integers(0, 2**63, (9,), dtype=np.uint64),
        "bool": rng.integers(0, 2, (31, 3)).astype(np.bool_),
        "c64": (rng.standard_normal(10) + 1j * rng.standard_normal(10)).astype(np.complex64),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "big": rng.standard_normal((300, 1000)).astype(np.float32),  # > one small chunk
    }
    return t


@pytest.fixture(scope="module")
def st_file(tmp_path_factory):
    sn = pytest.importorskip("safetensors.numpy")
    path = tmp_path_factory.mktemp("st") / "multi.safetensors"
    sn.save_file(_numpy_tensors(np.random.default_rng(5)), str(path), metadata={"format": "np", "who": "phoenix"})
    return str(path)


def test_header_parse_matches_safetensors(st_file):
    from safetensors import safe_open

    h = phxloader.read_header(st_file)
    with safe_open(st_file, framework="numpy") as f:
        assert set(h.tensors) == set(f.keys())
        assert h.metadata == f.metadata()
    assert phxloader.read_metadata(st_file) == {"format": "np", "who": "phoenix"}
    (n,) = struct.unpack("<Q", open(st_file, "rb").read(8))
    assert h.data_start == 8 + n


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("chunk,depth", [(phxloader.DEFAULT_CHUNK, 4), (3 * 4096, 2), (8192, 3)])
def test_equals_safetensors_numpy(st_file, framework, chunk, depth):
    import safetensors.numpy as sn

    ref = sn.load_file(st_file)
    got = phxloader.load_file(st_file, "cpu", framework=framework, chunk=chunk, depth=depth)
    assert list(got) == list(phxloader.read_header(st_file).tensors)
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert _shape(got[name]) == want.shape, name
        assert _bytes(got[name]) == want.tobytes(), name
        if framework == "numpy":
            assert got[name].dtype == want.dtype, name
    assert got.metadata == {"format": "np", "who": "phoenix"}
    assert got.stats["bytes"] == sum(a.nbytes for a in ref.values())


@needs_torch
@pytest.mark.parametrize("chunk", [phxloader.DEFAULT_CHUNK, 4096])
def test_every_dtype_equals_safetensors_torch(tmp_path, chunk):
    st = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(7)
    src = {
        "F64": torch.randn(17, 3, dtype=torch.float64, generator=g),
        "F32": torch.randn(1025, dtype=torch.float32, generator=g),
        "F16": torch.randn(9, 9, dtype=torch.float16, generator=g),
        "BF16": torch.randn(33, 65, dtype=torch.bfloat16, generator=g),
        "I64": torch.randint(-(2**62), 2**62, (5, 2), dtype=torch.int64, generator=g),
        "I32": torch.randint(-(2**31), 2**31 - 1, (7,), dtype=torch.int32, generator=g),
        "I16": torch.randint(-(2**15), 2**15 - 1, (3, 5), dtype=torch.int16, generator=g),
        "I8": torch.randint(-128, 127, (4099,), dtype=torch.int8, generator=g),
        "U8": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "BOOL": torch.randint(0, 2, (13, 3), generator=g).bool(),
        "F8_E4M3": torch.randn(64, 3, generator=g).to(torch.float8_e4m3fn),
        "F8_E5M2": torch.randn(5, 7, generator=g).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.0, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    for name, bits in (("U16", 16), ("U32", 32), ("U64", 64)):
        dt = getattr(torch, f"uint{bits}", None)
        if dt is not None:
            src[name] = torch.randint(0, 2**15, (11,), dtype=torch.int64, generator=g).to(dt)
    path = str(tmp_path / "all.safetensors")
    st.save_file(src, path, metadata={"k": "v"})
    header = json.loads(open(path, "rb").read()[8 : 8 + struct.unpack("<Q", open(path, "rb").read(8))[0]])
    ref = st.load_file(path)
    got = phxloader.load_file(path, "cpu", framework="torch", chunk=chunk, depth=2)
    assert set(got) == set(ref) == set(src)
    for name, want in ref.items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert got[name].device.type == "cpu"
        assert _bytes(got[name]) == _bytes(want), name
        assert got.dtypes[name] == header[name]["dtype"]
    assert got.metadata == {"k": "v"}


def test_every_dtype_numpy_raw_bits(tmp_path):
    """Without torch: BF16 and F8 load as their raw bits, equal to the file's bytes."""
    rng = np.random.default_rng(9)
    arrays, dtypes = {}, {}
    for name, d in phxloader.DTYPES.items():
        raw = rng.integers(0, 256, 6 * 5 * d.itemsize, dtype=np.uint8)
        if name == "BOOL":
            raw = raw % 2
        arrays[name] = raw.view(np.dtype(d.raw)).reshape(6, 5)
        dtypes[name] = name
    path = tmp_path / "raw.safetensors"
    phxloader.save_file(arrays, path, metadata={"m": "1"}, dtypes=dtypes)
    h = phxloader.read_header(path)
    data = open(path, "rb").read()
    got = phxloader.load_file(path, "cpu", framework="numpy", chunk=4096, depth=2)
    for name, t in h.tensors.items():
        assert got[name].shape == (6, 5)
        assert got[name].dtype.itemsize == phxloader.DTYPES[name].itemsize
        assert _bytes(got[name]) == data[t.begin : t.end], name
        assert got.dtypes[name] == name
    assert got.metadata == {"m": "1"}


def test_many_files(tmp_path):
    rng = np.random.default_rng(11)
    paths, want = [], {}
    for i in range(3):
        t = {
            f"s{i}.a": rng.standard_normal((100 + i, 33)).astype(np.float32),
            f"s{i}.b": rng.integers(0, 255, 4095 + i, dtype=np.uint8),
            f"s{i}.c": rng.standard_normal(3).astype(np.float64),
        }
        p = tmp_path / f"model-{i:05d}-of-00003.safetensors"
        phxloader.save_file(t, p, metadata={"shard": str(i)})
        paths.append(str(p))
        want.update(t)
    got = phxloader.load(paths, "cpu", framework="numpy", chunk=8192, depth=3)
    assert set(got) == set(want)
    for name, a in want.items():
        assert _bytes(got[name]) == a.tobytes() and got[name].shape == a.shape
    assert got.metadata == {"shard": "0"}
    assert got.file_metadata == {p: {"shard": str(i)} for i, p in enumerate(paths)}
    with pytest.raises(ValueError, match="in both"):
        phxloader.load([paths[0], paths[0]], "cpu", framework="numpy")


def test_vendor_device_memory(tmp_path):
    """device="phx": host-vendor device memory (the arena), NumPy arrays over it."""
    from phoenix.registry import get_runtime
    from phoenix.vendor import MemoryType

    rt = get_runtime()
    rng = np.random.default_rng(13)
    t = {
        "w": rng.standard_normal((257, 129)).astype(np.float32),
        "b": rng.integers(0, 9, 1001, dtype=np.int16),
        "e": np.zeros((0,), dtype=np.float32),
    }
    p = tmp_path / "dev.safetensors"
    phxloader.save_file(t, p)
    got = phxloader.load_file(p, "phx:0", chunk=3 * 4096, depth=2)
    for name, a in t.items():
        assert _bytes(got[name]) == a.tobytes() and got[name].shape == a.shape
    info = rt.pointer_info(got["w"].ctypes.data)
    assert info.type is MemoryType.DEVICE
    del got  # frees the device memory with the arrays


def test_bad_files(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors"):
        phxloader.read_header(p)
    head = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)  # data cut short
    with pytest.raises(ValueError, match="outside"):
        phxloader.read_header(p)
    head = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}).encode()
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16)
    with pytest.raises(ValueError, match="expected"):
        phxloader.read_header(p)
    head = json.dumps({"x": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 4]}}).encode()
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 4)
    with pytest.raises(ValueError, match="unknown dtype"):
        phxloader.read_header(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        phxloader.read_header(p)


def _raw(p, hdr, data_len: int, raw_header: bytes | None = None):
    head = raw_header if raw_header is not None else json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * data_len)


def _t(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


@pytest.mark.parametrize(
    "case,hdr,data_len,match",
    [
        ("overlap", {"a": _t("U8", [4], 0, 4), "b": _t("U8", [4], 2, 6)}, 6, "overlaps the tensor before it"),
        ("gap", {"a": _t("U8", [2], 0, 2), "b": _t("U8", [2], 4, 6)}, 6, "leaves 2 bytes unused"),
        ("trailing", {"a": _t("U8", [2], 0, 2)}, 4, "cover 2 of the 4 data bytes"),
        ("bool offsets", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, 1, "data_offsets"),
        ("bool shape", {"a": _t("U8", [True], 0, 1)}, 1, "bad shape"),
        ("float offsets", {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0.0, 2.0]}}, 2, "data_offsets"),
        ("dimension past 2**63", {"a": _t("U8", [0, 2**64], 0, 0)}, 0, "bad shape"),
        ("no array", {"a": _t("U8", [0, 2**62, 2**62], 0, 0)}, 0, "is no array"),
        ("65 dimensions", {"a": _t("U8", [1] * 65, 0, 1)}, 1, "is no array"),
        ("nested too deeply", None, 0, "nested too deeply"),
    ],
)
def test_headers_safetensors_refuses_are_refused(tmp_path, case, hdr, data_len, match):
    """What safetensors itself refuses (tensors that overlap, leave gaps or bytes after
    them; bools or floats for integers; dimensions no array has; a header nested past the
    JSON parser's depth) is a ValueError naming the file, before anything is read."""
    p = tmp_path / "bad.safetensors"
    _raw(p, hdr, data_len, b"[" * 100000 + b"]" * 100000 if hdr is None else None)
    with pytest.raises(ValueError, match=match) as ei:
        phxloader.read_header(p)
    assert str(p) in str(ei.value)


def test_file_shrinking_under_the_loader_is_an_error(tmp_path, monkeypatch):
    p = tmp_path / "s.safetensors"
    phxloader.save_file({"a": np.arange(100_000, dtype=np.float32)}, p)
    real = phxloader.read_header
    h = real(p)
    monkeypatch.setattr(phxloader, "read_header", lambda path: h)
    os.truncate(p, h.file_size - 4096 * 4)
    with pytest.raises(PhxIOError, match="short read"):
        phxloader.load_file(p, "cpu", framework="numpy", chunk=8192, depth=2)


def test_bench_helper_runs_on_cpu(tmp_path):
    p = str(tmp_path / "bench.safetensors")
    phxloader.save_file(
        {
            "a": np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32),
            "b": np.arange(1000, dtype=np.int64),
        },
        p,
    )
    dev = "cpu" if torch is not None else "phx:0"
    from phoenix.bench import loader

    res = loader.bench(p, dev, reps=1, quiet=True)
    assert res["phxloader_cold"]["bytes"] == 512 * 1024 * 4 + 8000
    assert res["ratios"]["phxloader_cold / raw_odirect_cold"] > 0


def test_failed_read_raises_after_everything_landed(tmp_path, monkeypatch):
    """An EIO in the middle of a load: PhxIOError naming the file, raised only once every
    read of the load has finished (no read may still land in tensors being dropped)."""
    import errno

    import phoenix.io as pio

    p = tmp_path / "eio.safetensors"
    phxloader.save_file(
        {f"t{i}": np.random.default_rng(i).standard_normal(50_000).astype(np.float32) for i in range(12)}, p
    )
    real_open = pio.open

    def faulty_open(path, *a, **kw):
        f = real_open(path, *a, **kw)
        inject_fault(f, 700_000, 1, errno.EIO)
        return f

    monkeypatch.setattr(pio, "open", faulty_open)
    with pytest.raises(PhxIOError) as ei:
        phxloader.load_file(p, "cpu", framework="numpy", chunk=4096, depth=2)
    assert ei.value.errno == errno.EIO and str(p) in str(ei.value)
    s = pio.stats()
    assert s["requests"] == 0 and s["files"] == 0, s
