"""Buffer adaptation: any array-like -> (address, size in bytes, where it lives).

Core side, control plane. The I/O stack moves bytes between a file and one contiguous
extent of memory; this module finds that extent in what a user hands in, without
copying and without importing any array library:

================================  ==========================================================
what                              how
================================  ==========================================================
``(ptr, nbytes)``                 a raw address and length (ints): device or host memory
torch tensors                     ``data_ptr()``, ``numel() * element_size()``, ``device``
``__cuda_array_interface__``      CuPy, Numba, PyTorch CUDA tensors, ...: device memory
``__array_interface__``           NumPy arrays and views: host memory (or any memory the
                                  vendor recognises: the host vendor's arena wrapped in NumPy)
buffer protocol                   ``bytearray``, ``memoryview``, ``bytes`` (read-only: writes
                                  only), ``mmap``, ``array.array``: host memory
``__dlpack__``                    any DLPack producer (CPU and device tensors)
================================  ==========================================================

Every extent must be C-contiguous, and its items plain bytes: an array whose items are
Python object references (NumPy's object dtype, any dtype with ``hasobject`` -- structured
ones with an object field, StringDType --, an interface type string or descr of kind
'O', a buffer format with an 'O' item) is refused with a TypeError naming its dtype, for
reads (file bytes over PyObject pointers crash the process) and writes (addresses into
the file) alike. The adapted :class:`Buffer` keeps what must stay alive while I/O runs
(the object, its buffer export, its DLPack capsule) until :meth:`Buffer.release`.

:func:`classify` then asks the vendor where an address lives (``pointer_info``) and
whether the CPU and the kernel can address it (``direct_capable``): host memory, device
memory the I/O can land in directly, or device memory that must be staged.
"""

from __future__ import annotations

import ctypes
import math
import re
import sys
from dataclasses import dataclass, field

from .checks import raw_buffer
from .vendor import MemoryType

# where an extent lives: the C core's enum phx_mem (phoenix/csrc/phx_io.h)
MEM_HOST = 0  #: host memory (plain, pinned or registered)
MEM_DEVICE = 1  #: device memory only the vendor's copies reach: staged
MEM_DEVICE_MAPPED = 2  #: device memory the CPU and the kernel address: direct


class OutOfBounds(ValueError):
    """An extent runs outside the memory it starts in (the I/O layer reports it as EFAULT)."""


@dataclass
class Buffer:
    """One contiguous extent of memory found in a user's object."""

    addr: int
    nbytes: int
    #: "host", "device" or None (unknown: the vendor's pointer query decides)
    kind: str | None
    device: int | None
    readonly: bool
    source: str  #: which protocol found it ("raw", "torch", "cuda_array_interface", ...)
    _keep: list = field(default_factory=list, repr=False)
    _view: object | None = field(default=None, repr=False)  #: a phoenix._phxcalls.Export
    #: the stream its producer orders its work on, when the object says (torch's current
    #: stream, CuPy's, a ``__cuda_array_interface__`` "stream"): the caller's stream of an
    #: I/O call that names none (:mod:`phoenix.streams`); None: not said
    stream: int | None = None

    def release(self) -> None:
        """Let go of the object (and its buffer export): the I/O on it is over."""
        view, self._view = self._view, None
        if view is not None:
            view.release()
        self._keep.clear()


# ---- the buffer protocol through the C API (works for read-only exporters too) ----------


#: a field name in a buffer format (``T{<q:a:O:b:}``): skipped when looking for 'O' items
_FORMAT_NAME = re.compile(rb":[^:]*:")


def _from_buffer_protocol(obj, writable: bool) -> Buffer:
    # the export is a C object (phoenix._phxcalls.Export): released in C, by release() or when
    # it is collected, so no exception can leave the exporter locked (a bytearray unresizable)
    from ._core import calls

    try:
        view = calls().Export(obj, writable)  # (PyBUF_ND | PyBUF_FORMAT: C-contiguous, its format)
    except BufferError as exc:
        what = "writable and C-contiguous" if writable else "C-contiguous"
        raise TypeError(f"{type(obj).__name__}: the buffer must be {what} to be read into: {exc}") from None
    fmt = view.format
    if b"O" in _FORMAT_NAME.sub(b"", fmt.encode()):
        view.release()
        raise TypeError(_not_plain(obj, f"buffer format {fmt!r}"))
    return Buffer(view.addr, view.nbytes, "host", None, view.readonly, "buffer", [obj], view)


def _not_plain(obj, what: str, why: str = "") -> str:
    why = why or (
        "its items are references (to Python objects, or a string's bytes), not plain bytes: a read "
        "would write file bytes over them, a write would put addresses in the file"
    )
    return f"{type(obj).__name__} of {what}: {why}; use a dtype of numbers, bytes or fixed-width strings"


def _plain_typestr(typestr) -> bool:
    """An array-interface type string of plain bytes: the protocol's grammar, not kind 'O'
    (an unknown type string, like a NumPy StringDType's, is no known layout of bytes)."""
    m = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
    return m is not None and m.group(1) != "O"


def _descr_objects(descr) -> str | None:
    """The first type string of an interface ``descr`` (fields, nested) that is not plain
    bytes, else None."""
    if not isinstance(descr, (list, tuple)):
        return None
    for item in descr:
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            continue
        t = item[1]
        if isinstance(t, (list, tuple)):
            bad = _descr_objects(t)
            if bad is not None:
                return bad
        elif not _plain_typestr(t):
            return f"({item[0]!r}, {t!r})" if isinstance(item[0], str) else repr(t)
    return None


def _check_plain(obj, iface: dict) -> None:
    """Refuse an interface object whose items are not plain bytes (TypeError naming its dtype)."""
    dtype = getattr(obj, "dtype", None)
    if getattr(dtype, "hasobject", False) is True:  # NumPy (and CuPy) dtypes: object fields, StringDType
        raise TypeError(_not_plain(obj, f"dtype {dtype}"))
    typestr = iface.get("typestr")
    if not _plain_typestr(typestr):
        m = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
        why = "" if m else "no type string of the array interface, so its items are not known to be plain bytes"
        raise TypeError(_not_plain(obj, f"type string {typestr!r}", why))
    bad = _descr_objects(iface.get("descr"))
    if bad is not None:
        raise TypeError(_not_plain(obj, f"type string {typestr!r} with field {bad}"))


# ---- array interfaces ---------------------------------------------------------------------


def _contiguous_nbytes(shape, strides, itemsize: int, where: str) -> int:
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape) * itemsize
    if strides is None or n == 0:
        return n
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(tuple(int(s) for s in strides)), strict=True):
        if dim != 1 and stride != expect:
            raise TypeError(f"{where}: the array is not C-contiguous (shape {shape}, strides {tuple(strides)})")
        expect *= dim
    return n


#: an array-interface type string: byte order, kind, size (unicode: in characters), unit
_TYPESTR = re.compile(r"^[<>|=]?([a-zA-Z])(\d+)(\[\w+\])?$")


def _itemsize(obj, typestr: str) -> int:
    """Bytes per element: the exporter's own ``itemsize`` when it has one (NumPy, CuPy),
    else the type string's size ("<U4" is 4 characters of 4 bytes; "<M8[ns]" 8 bytes)."""
    size = getattr(obj, "itemsize", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _TYPESTR.match(str(typestr))
    if not m:
        raise TypeError(f"{type(obj).__name__}: cannot read the element size from type string {typestr!r}")
    return int(m.group(2)) * (4 if m.group(1) in "Uw" else 1)


def _cai_stream(iface: dict) -> int | None:
    """The producer's stream a ``__cuda_array_interface__`` (v3) names: 1 is the legacy
    default stream (the runtime's 0), 2 the per-thread default stream; absent or None:
    none named."""
    s = iface.get("stream")
    if s is None or isinstance(s, bool) or not isinstance(s, int):
        return None
    return 0 if s in (0, 1) else s


def _from_interface(obj, iface: dict, kind: str | None, source: str, writable: bool) -> Buffer:
    _check_plain(obj, iface)
    ptr, readonly = iface["data"]
    if writable and readonly:
        raise TypeError(f"{type(obj).__name__}: read-only array cannot be read into")
    nbytes = _contiguous_nbytes(
        iface["shape"], iface.get("strides"), _itemsize(obj, iface["typestr"]), type(obj).__name__
    )
    own = getattr(obj, "nbytes", None)
    if isinstance(own, int) and not isinstance(own, bool) and own != nbytes:
        raise TypeError(
            f"{type(obj).__name__}: its interface describes {nbytes} bytes but the object says "
            f"nbytes={own}: refusing an extent that may not be the array"
        )
    stream = None
    if source == "cuda_array_interface":
        stream = _cupy_stream(obj)
        if stream is None:
            stream = _cai_stream(iface)
    return Buffer(int(ptr or 0), nbytes, kind, None, bool(readonly), source, [obj], stream=stream)


def _cupy_stream(obj) -> int | None:
    """CuPy's current stream for a CuPy array (the stream its work is queued on), else None."""
    mod = type(obj).__module__ or ""
    cupy = sys.modules.get("cupy")
    if cupy is None or not (mod == "cupy" or mod.startswith("cupy.")):
        return None
    ptr = cupy.cuda.get_current_stream().ptr
    return 0 if ptr in (0, 1) else int(ptr)


# ---- torch (without importing it) -------------------------------------------------------


def _is_torch_tensor(obj) -> bool:
    mod = type(obj).__module__ or ""
    return (mod == "torch" or mod.startswith("torch.")) and hasattr(obj, "data_ptr") and hasattr(obj, "element_size")


def _from_torch(obj, writable: bool) -> Buffer | None:
    dev = obj.device
    if dev.type not in ("cpu", "cuda"):
        return None  # other backends: DLPack says where
    if not obj.is_contiguous():
        raise TypeError("torch tensor is not contiguous (call .contiguous() first)")
    nbytes = obj.numel() * obj.element_size()
    if dev.type == "cpu":
        return Buffer(obj.data_ptr(), nbytes, "host", None, False, "torch", [obj])
    index = dev.index if dev.index is not None else 0
    torch = sys.modules["torch"]
    stream = torch.cuda.current_stream(index).cuda_stream  # the stream torch queues its work on
    return Buffer(obj.data_ptr(), nbytes, "device", index, False, "torch", [obj], stream=stream)


# ---- DLPack -------------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_DL_HOST_TYPES = {1, 3, 11}  # kDLCPU, kDLCUDAHost, kDLROCMHost


def _from_dlpack(obj, writable: bool, stream: int | None = None) -> Buffer:
    # A legacy "dltensor" capsule (DLManagedTensor starts with its DLTensor). It is not
    # consumed: its destructor returns it to the producer when we let go of it.
    # The consumer's stream goes to the producer, which orders its work before it (the
    # DLPack protocol); none given: the default stream (CUDA's legacy one), as the
    # protocol assumes for stream=None.
    capsule = None
    if stream is not None and _dlpack_on_device(obj):
        try:
            capsule = obj.__dlpack__(stream=1 if stream == 0 else stream)
        except TypeError:  # a producer of the old protocol, without the stream argument
            capsule = None
    if capsule is None:
        capsule = obj.__dlpack__()
    ptr = _PyCapsule_GetPointer(capsule, b"dltensor")
    t = _DLTensor.from_address(ptr)
    ndim = t.ndim
    shape = [t.shape[i] for i in range(ndim)]
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    strides = None if not t.strides else [t.strides[i] * itemsize for i in range(ndim)]
    nbytes = _contiguous_nbytes(shape, strides, itemsize, type(obj).__name__)
    host = t.device.device_type in _DL_HOST_TYPES
    addr = (t.data or 0) + t.byte_offset
    return Buffer(
        addr,
        nbytes,
        "host" if host else "device",
        None if host else t.device.device_id,
        False,
        "dlpack",
        [obj, capsule],
        stream=None if host else (stream if stream is not None else 0),
    )


def _dlpack_on_device(obj) -> bool:
    try:
        dev_type, _ = obj.__dlpack_device__()
    except Exception:
        return False
    return int(dev_type) not in _DL_HOST_TYPES


# ---- entry points -------------------------------------------------------------------------


def adapt(obj, *, writable: bool, stream: int | None = None) -> Buffer:
    """Find the contiguous extent of ``obj``; ``writable`` when it will be read into.

    ``stream``: the stream the caller's I/O is ordered on, when the caller names one (a
    DLPack producer orders its work before it). Raises TypeError naming what is wrong
    (not contiguous, read-only, unknown type).
    """
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and all(_is_integer(v) for v in obj):
        ptr, nbytes = raw_buffer(*obj)
        return Buffer(ptr, nbytes, None, None, False, "raw")
    if isinstance(obj, int):
        raise TypeError("a bare address has no size: pass (ptr, nbytes)")
    if _is_torch_tensor(obj):
        b = _from_torch(obj, writable)
        if b is not None:
            return b
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        return _from_interface(obj, iface, "device", "cuda_array_interface", writable)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return _from_interface(obj, iface, None, "array_interface", writable)
    if isinstance(obj, (bytes, bytearray, memoryview)) or _has_buffer(obj):
        return _from_buffer_protocol(obj, writable)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, writable, stream)
    raise TypeError(
        f"cannot do I/O on a {type(obj).__module__}.{type(obj).__name__}: pass a torch tensor, a CuPy or NumPy "
        "array, anything with __cuda_array_interface__, __array_interface__, the buffer protocol or __dlpack__, "
        "or a (ptr, nbytes) pair"
    )


def _is_integer(v) -> bool:
    return not isinstance(v, bool) and hasattr(type(v), "__index__")


def _has_buffer(obj) -> bool:
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


def classify(runtime, addr: int, size: int, kind: str | None = None, device: int | None = None) -> tuple[int, int, str]:
    """Where ``[addr, addr+size)`` lives: (MEM_*, device ordinal, why).

    Asks the vendor (``pointer_info``, ``direct_capable``). Without a runtime, memory not
    known to be device memory is host memory. Raises TypeError for device memory with no
    vendor runtime to move it; OutOfBounds for a device extent past its allocation.
    """
    if runtime is None:
        if kind == "device":
            raise TypeError("device memory given, but no vendor runtime is selected (PHX_VENDOR)")
        return MEM_HOST, 0, "host memory (no vendor runtime)"
    info = runtime.pointer_info(addr)
    if info.type is not MemoryType.DEVICE:
        if kind == "device":
            # the object says device memory but the vendor does not know it (freed?)
            raise TypeError(f"{addr:#x} is not memory of vendor {runtime.name!r} (freed, or another runtime's)")
        return MEM_HOST, 0, f"{info.type.value} memory"
    if info.size and addr + size > info.base + info.size:
        raise OutOfBounds(
            f"its device allocation [{info.base:#x}, +{info.size}) holds {info.size} bytes; the request "
            f"needs {size} from {addr - info.base} bytes into it"
        )
    ok, why = runtime.direct_capable(addr, size)
    return (MEM_DEVICE_MAPPED if ok else MEM_DEVICE), int(info.device or 0), why
