"""The caller's stream: which stream an I/O call on device memory is ordered after.

Core side, control plane. :mod:`phoenix.io` states the rule; this module finds the
stream. For each call it is, in order:

1. the call's ``stream=`` argument: a vendor handle (``int``; 0 the default stream), a
   torch stream (``cuda_stream``), a CuPy stream (``ptr``), an object with the CUDA
   Python stream protocol (``__cuda_stream__``), a ctypes ``c_void_p`` (``value``), or
   cuda-python's ``CUstream`` (``getPtr()``, ``int()``);
2. the current stream of the buffer's framework, which :mod:`phoenix.buffers` records
   when it finds the extent (``Buffer.stream``): ``torch.cuda.current_stream(device)``
   for torch tensors, CuPy's current stream for CuPy arrays, the producer's stream a
   ``__cuda_array_interface__`` names (v3 ``"stream"``), the default stream for DLPack
   (the protocol's consumer stream when none is given);
3. the vendor's default stream (0).

Host memory is ordered only when the call names a stream.
"""

from __future__ import annotations

import ctypes

from . import buffers as _buffers

_MAX_HANDLE = (1 << 64) - 1


def handle(stream) -> int:
    """The vendor handle of a stream object (see the module docstring); TypeError otherwise."""
    if isinstance(stream, bool):
        raise TypeError("stream: a bool is not a stream handle")
    if isinstance(stream, int):
        return _checked(stream, stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if callable(proto):
        value = proto()
        if isinstance(value, tuple) and len(value) == 2:
            return _checked(value[1], stream)
    for attr in ("cuda_stream", "ptr", "handle", "value"):
        v = getattr(stream, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return _checked(v, stream)
        if attr == "value" and isinstance(stream, ctypes.c_void_p):
            return 0 if v is None else _checked(v, stream)
    get_ptr = getattr(stream, "getPtr", None)  # cuda-python's CUstream / cudaStream_t
    if callable(get_ptr):
        return _checked(int(get_ptr()), stream)
    if not isinstance(stream, (str, bytes, float, complex)) and hasattr(type(stream), "__int__"):
        return _checked(int(stream), stream)
    raise TypeError(
        f"cannot use {type(stream).__module__}.{type(stream).__name__} as a stream: pass the vendor's "
        "stream handle (an int), a torch or CuPy stream, or an object with __cuda_stream__"
    )


def _checked(value, original) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_HANDLE:
        raise TypeError(f"stream {original!r}: handle {value!r} is not an unsigned 64-bit value")
    return value


def caller_stream(buf: _buffers.Buffer | None, mem: int, explicit: int | None) -> int | None:
    """The stream an I/O call on ``buf`` (memory kind ``mem``, a ``MEM_*`` value) is ordered
    after: ``explicit`` (a handle) when the call named one, else the framework's stream for
    device memory, else the default stream (0); None for host memory with no stream named."""
    if explicit is not None:
        return explicit
    if mem == _buffers.MEM_HOST:
        return None
    if buf is not None and buf.stream is not None:
        return buf.stream
    return 0
