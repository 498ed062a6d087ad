"""Pointer queries of a CUDA-shaped runtime: the attribute struct, its layouts, the memory-type numbers.

Core side, control plane. :class:`PointerQueries` is mixed into
:class:`phoenix.cudalike.CudaLikeRuntime`: which memory a pointer is (``pointer_info``), and
the pointer-attribute layout, decided once (declared by the port, forced by
``PHX_<NAME>_POINTER_ATTRIBUTES``, or measured at run time on one device and one pinned
allocation).
"""

from __future__ import annotations

import ctypes
import os
import struct

from .errors import VendorError
from .vendor import MemoryType, PointerInfo

_i, _p = ctypes.c_int, ctypes.c_void_p
#: room after a pointer-attribute struct: a longer struct of a later release cannot overrun it
_ATTR_SLACK = 512


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` (CUDA >= 10): type, device, devicePointer, hostPointer."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        # CUDA 12+ appends reserved words (CUDA 13: long reserved[8], 88 bytes in all) and
        # the runtime writes them: room to spare so no release can overrun the struct
        ("_reserved", ctypes.c_ubyte * _ATTR_SLACK),
    ]


#: memory-type values of ``cudaMemoryType``
MEM_UNREGISTERED, MEM_HOST, MEM_DEVICE, MEM_MANAGED = 0, 1, 2, 3
#: CUDA's memory-type values, as read (a runtime numbering them otherwise maps them onto these)
CUDA_MEMORY_TYPES = {v: v for v in (MEM_UNREGISTERED, MEM_HOST, MEM_DEVICE, MEM_MANAGED)}


#: the pointer-attribute shapes CUDA-shaped runtimes have had: the memory-type field(s),
#: then device, devicePointer, hostPointer. ``type`` is CUDA >= 11 (and HIP >= 6); the
#: same place under its old name reads the same; CUDA 10 had both, shifting the rest.
POINTER_LAYOUTS: dict[str, list[tuple[str, object]]] = {
    "type": [("type", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
    "memoryType": [("memoryType", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
    "both": [("memoryType", _i), ("type", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
}


def attributes_struct(fields: list[tuple[str, object]], name: str = "PointerAttributes") -> type[ctypes.Structure]:
    """A ctypes struct of ``fields`` followed by slack (a longer runtime struct cannot overrun it)."""
    return type(name, (ctypes.Structure,), {"_fields_": list(fields) + [("_slack", ctypes.c_ubyte * _ATTR_SLACK)]})


class PointerQueries:
    """The pointer half of :class:`phoenix.cudalike.CudaLikeRuntime` (uses its ``rt``, ``prefix``,
    ``address_range``, ``_lock``, ``_layout_lock``, ``_host_ranges`` and layout attributes)."""

    # -- pointer queries ---------------------------------------------------------

    def memory_type(self, attrs) -> int:
        """The memory-type field of the runtime's pointer attributes, as CUDA's number."""
        return self._memory_types.get(getattr(attrs, self._type_field), MEM_UNREGISTERED)

    def pointer_info(self, ptr: int) -> PointerInfo:
        if self.pointer_layout is None:
            self._decide_layout()
        attrs = self.pointer_attributes_type()
        try:
            self.rt.pointer_get_attributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        except VendorError:  # old runtimes (and HIP) refuse pageable memory instead of saying so
            return PointerInfo(MemoryType.HOST, None, ptr, 0)
        mtype = self.memory_type(attrs)
        if mtype in (MEM_DEVICE, MEM_MANAGED):
            base, size = self.address_range(ptr) or (ptr, 0)
            return PointerInfo(MemoryType.DEVICE, attrs.device, base, size)
        if mtype == MEM_HOST:
            base, size = self.address_range(ptr) or self._own_host_range(ptr) or (ptr, 0)
            return PointerInfo(MemoryType.HOST_PINNED, None, base, size)
        return PointerInfo(MemoryType.HOST, None, ptr, 0)  # pageable host memory, or freed device memory

    def _own_host_range(self, ptr: int) -> tuple[int, int] | None:
        with self._lock:
            for base, size in self._host_ranges.items():
                if base <= ptr < base + size:
                    return base, size
        return None

    # -- the pointer-attribute layout, decided once ------------------------------------

    def _use_layout(self, fields, memory_types: dict, source: str, name: str) -> None:
        self.pointer_attributes_type = attributes_struct(fields, f"{self.prefix}PointerAttributes")
        self._type_field = "type" if any(n == "type" for n, _ in fields) else "memoryType"
        self._memory_types = dict(memory_types)
        self.pointer_layout = {"layout": name, "field": self._type_field, "source": source}

    def _decide_layout(self) -> None:
        with self._layout_lock:
            if self.pointer_layout is not None:
                return
            env = self.pointer_layout_env()
            forced = os.environ.get(env)
            if forced:
                if forced not in POINTER_LAYOUTS:
                    raise ValueError(f"{env}={forced!r}: choose one of {', '.join(POINTER_LAYOUTS)}")
                self._use_layout(POINTER_LAYOUTS[forced], CUDA_MEMORY_TYPES, f"${env}", forced)
            elif self.calibrate_pointer_layout:
                self._calibrate()
            else:
                self.pointer_layout = {
                    "layout": "declared",
                    "field": self._type_field,
                    "source": f"{type(self).__name__}.pointer_attributes_type",
                }

    def _calibrate(self) -> None:
        """Measure the layout: query one device and one pinned allocation, read the answers.

        Where the device pointer comes back says how many memory-type fields precede
        ``device``; the two memory-type values are the runtime's numbers for device and
        pinned host memory (HIP before 6 numbered them 1 and 0, CUDA 2 and 1).
        """
        raw = ctypes.c_ubyte * 256
        fallback = "measuring failed, assuming CUDA's layout"

        def query(ptr: int) -> bytes | None:
            buf = raw(*([0xA5] * 256))  # poisoned: a field the runtime leaves alone reads as no answer
            try:
                self.rt.pointer_get_attributes(ctypes.byref(buf), ctypes.c_void_p(ptr))
            except VendorError:
                return None
            return bytes(buf)

        dev, host, device = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
        self.rt.get_device(ctypes.byref(device))
        try:
            self.rt.malloc(ctypes.byref(dev), ctypes.c_size_t(256))
            self.rt.malloc_host(ctypes.byref(host), ctypes.c_size_t(4096))
            on_dev, on_host = query(dev.value), query(host.value)
        finally:
            if dev.value:
                self.rt.free(dev)
            if host.value:
                self.rt.free_host(host)
        if on_dev is not None and on_host is not None:
            for name, type_off, dev_off, ptr_off in (("type", 0, 4, 8), ("both", 4, 8, 16)):
                (devptr,) = struct.unpack_from("=Q", on_dev, ptr_off)
                (ordinal,) = struct.unpack_from("=i", on_dev, dev_off)
                if devptr == dev.value and ordinal == device.value:
                    dev_type = struct.unpack_from("=i", on_dev, type_off)[0]
                    host_type = struct.unpack_from("=i", on_host, type_off)[0]
                    if dev_type == host_type:
                        break
                    # one name or the other at offset 0 reads the same; call it `type`
                    self._use_layout(
                        POINTER_LAYOUTS[name], {dev_type: MEM_DEVICE, host_type: MEM_HOST}, "measured at run time", name
                    )
                    return
        self._use_layout(POINTER_LAYOUTS["type"], CUDA_MEMORY_TYPES, fallback, "type")
