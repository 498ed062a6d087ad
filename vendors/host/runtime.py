"""The host reference vendor: "device memory" is host memory. A TEST DOUBLE.

Vendor side, control plane. The model port: copy it for a CUDA-shaped runtime.

The contract is :class:`phoenix.vendor.VendorRuntime` (its docstrings are the contract).
A CUDA-shaped port subclasses :class:`phoenix.cudalike.CudaLikeRuntime`, which does
every operation through the runtime's ``<prefix>*`` calls, and says only what differs:

* ``name``, ``prefix``, ``library_names``: the vendor (its directory's name), the
  runtime's symbol prefix and its library's file name;
* ``find_library`` / ``library_path``: where that library is (``$PHX_<NAME>_LIBRARY``
  first; here the package's own ``libphxhostrt.so`` otherwise);
* ``probe``: whether it can serve here, and if not precisely why; it never raises;
* ``extra_protos`` and the queries libcudart does not answer portably (``device_name``,
  ``device_memory``, ``address_range``); ``direct_capable`` for the direct path.

The runtime bound here is phoenix's host runtime, a library of its own built from
``phoenix/_testing/hostrt/`` (device memory is an arena of host memory that faults when
freed, streams are ordered worker threads, the stream host callback is a queued C call),
found by path and bound through the generated shim as the NVIDIA port binds libcudart.

A forked child keeps using the runtime it inherited: the library restarts its stream
workers there and drops the work the parent had queued (``hostrt.h`` says how that is
reported), and CudaLikeRuntime gives the child fresh locks for the runtime's bookkeeping
(a thread of the parent may have held one at the fork; it does not exist in the child).
"""

from __future__ import annotations

import ctypes
import os

import phoenix
from phoenix.cudalike import CudaLikeRuntime
from phoenix.errors import VendorError
from phoenix.shim import NONE, Proto
from phoenix.vendor import MemoryType, Probe

PREFIX = "phxh"
LIBRARY = "libphxhostrt.so"
#: one exact host runtime library to load instead of the package's own
LIBRARY_ENV = "PHX_HOST_LIBRARY"
#: where the package build leaves the library: beside its sources
PACKAGE_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(phoenix.__file__)), "_testing", "hostrt", LIBRARY)

# Calls beyond the CUDA-shaped table: a device's name and memory size (libcudart answers
# through cudaGetDeviceProperties, whose layout differs between runtimes and releases), the
# allocation holding an address (the driver API's cuMemGetAddressRange), and StreamQuery.
EXTRA_PROTOS = [
    Proto("phxhDeviceGetName", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    Proto("phxhDeviceTotalMem", ctypes.c_int, [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]),
    Proto(
        "phxhMemGetAddressRange",
        ctypes.c_int,
        [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p],
    ),
    # NOT_READY is an answer, not an error: the caller reads the status itself
    Proto("phxhStreamQuery", ctypes.c_int, [ctypes.c_void_p], errors=NONE),
]


def find_library() -> tuple[str | None, ctypes.CDLL | None, list[str]]:
    """(path, handle, what was seen) of the runtime library: ``$PHX_HOST_LIBRARY``, else the package's."""
    override = os.environ.get(LIBRARY_ENV)
    what, path = (f"${LIBRARY_ENV}", override) if override else ("the package", PACKAGE_LIBRARY)
    try:
        handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)  # the shim binds it; this only looks
    except OSError as exc:
        return None, None, [f"{what}: {path} cannot be loaded ({exc})"]
    return path, handle, [f"{what}: {path} (found)"]


class Runtime(CudaLikeRuntime):
    name = "host"
    prefix = PREFIX
    library_names = (LIBRARY,)
    p2p_page_size = 65536  # the arena's allocation granule, equal to NVIDIA's and MetaX's P2P page
    host_register_flags = 0
    host_register_read_only_flag = 8  # the double takes CUDA's flags: the read-only retry is tested
    is_test_double = True
    runtime_description = f"phoenix host reference runtime ({PREFIX}*, {LIBRARY}): device memory is host memory"

    @classmethod
    def probe(cls) -> Probe:
        # Serves wherever the package is built. Counting devices also checks the settings
        # (PHX_HOST_DEVICES, PHX_HOST_DEVICE_MEMORY), which the runtime reads at first use.
        path, lib, looked = find_library()
        if lib is None:
            return Probe(
                False,
                f"host reference runtime unavailable: {looked[-1]}; build the package (pip install -e .)",
                {"looked": looked},
            )
        if not hasattr(lib, "phxhPhoenixTestDouble"):
            return Probe(False, f"{path} is not phoenix's host runtime (it has no phxhPhoenixTestDouble)")
        count = ctypes.c_int()
        rc = lib.phxhGetDeviceCount(ctypes.byref(count))
        if rc != 0:
            name, message = lib.phxhGetErrorName, lib.phxhGetErrorString
            name.restype = message.restype = ctypes.c_char_p
            return Probe(
                False,
                f"host reference runtime unavailable: phxhGetDeviceCount failed with "
                f"{name(rc).decode()}: {message(rc).decode()} (code {rc})",
                {"library": path},
            )
        return Probe(
            True,
            "host reference vendor: device memory is host memory (test double)",
            {"library": path, "devices": count.value},
        )

    def library_path(self) -> str:
        return self.probe().details["library"]

    def extra_protos(self) -> list[Proto]:
        return list(EXTRA_PROTOS)

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
