"""The host reference vendor: "device memory" is host memory. A TEST DOUBLE.

Vendor side, control plane. This is the model port of a CUDA-shaped runtime: the
runtime here is the ``phxh*`` host runtime compiled into phoenix's C core
(``phoenix/csrc/hostrt.c``: device memory is an arena of host memory that faults
when freed, streams are ordered worker threads, the stream host callback is a queued
C call), bound through the generated shim exactly as the NVIDIA port binds
``libcudart.so`` and the MetaX port ``libmcruntime.so``. Every operation of the
contract (:class:`phoenix.vendor.VendorRuntime`, whose docstrings are the contract)
comes from :class:`phoenix.cudalike.CudaLikeRuntime`; this file says what differs:
the prefix, the library, the probe, three queries, and the direct path. To port a
CUDA-shaped runtime, copy this file and change those.
"""

from __future__ import annotations

import ctypes
import functools

from phoenix._core import core_path
from phoenix.cudalike import CudaLikeRuntime
from phoenix.errors import VendorError
from phoenix.shim import NONE, Proto, Shim, cuda_shaped_protos, load_shim
from phoenix.vendor import MemoryType, Probe

PREFIX = "phxh"

# Calls beyond the CUDA-shaped table: a device's name and memory size (libcudart answers
# through cudaGetDeviceProperties, whose layout differs between runtimes and releases), the
# allocation holding an address (the driver API's cuMemGetAddressRange), and StreamQuery.
EXTRA_PROTOS = [
    Proto("phxhDeviceGetName", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    Proto("phxhDeviceTotalMem", ctypes.c_int, [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]),
    Proto("phxhMemGetAddressRange", ctypes.c_int,
          [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]),
    # NOT_READY is an answer, not an error: the caller reads the status itself
    Proto("phxhStreamQuery", ctypes.c_int, [ctypes.c_void_p], errors=NONE),
]


class Runtime(CudaLikeRuntime):
    name = "host"
    prefix = PREFIX
    p2p_page_size = 65536  # the arena's allocation granule, equal to NVIDIA's and MetaX's P2P page
    host_register_flags = 0
    is_test_double = True
    runtime_description = "phoenix host reference runtime (phxh*, in phoenix._phxcore): device memory is host memory"

    @classmethod
    def probe(cls) -> Probe:
        # Needs only phoenix's own C core, so it serves anywhere the package is built.
        # Binding it here also checks the settings (PHX_HOST_DEVICES, PHX_HOST_DEVICE_MEMORY).
        try:
            rt = _shim()
            count = ctypes.c_int()
            rt.get_device_count(ctypes.byref(count))
        except (ImportError, OSError, VendorError) as exc:
            return Probe(False, f"host reference runtime unavailable: {exc}")
        return Probe(True, "host reference vendor: device memory is host memory (test double)",
                     {"library": rt.library, "devices": count.value})

    def bind(self) -> Shim:
        return _shim()  # one binding per process: the C runtime's state is per process too

    def device_name(self, ordinal: int) -> str:
        name = ctypes.create_string_buffer(256)
        self.rt.device_get_name(name, len(name), ordinal)
        return name.value.decode()

    def device_memory(self, ordinal: int) -> int:
        total = ctypes.c_size_t()
        self.rt.device_total_mem(ctypes.byref(total), ordinal)
        return total.value

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            self.rt.mem_get_address_range(ctypes.byref(base), ctypes.byref(size), ptr)
        except VendorError:
            return None
        return base.value or 0, size.value

    def direct_capable(self, ptr: int, size: int) -> tuple[bool, str]:
        info = self.pointer_info(ptr)
        if info.type is not MemoryType.DEVICE:
            return False, f"{ptr:#x} is not in a live device allocation"
        if ptr + size > info.base + info.size:
            return False, f"[{ptr:#x}, +{size}) runs past its allocation [{info.base:#x}, +{info.size})"
        return True, "host arena memory is plain host-addressable memory: O_DIRECT can land in it"


@functools.cache
def _shim() -> Shim:
    """The bound host runtime, loaded once per process."""
    return load_shim("host", core_path(), cuda_shaped_protos(PREFIX) + EXTRA_PROTOS, prefix=PREFIX,
                     error_name=f"{PREFIX}GetErrorName", error_string=f"{PREFIX}GetErrorString")
