"""NVIDIA port, userspace side: the CUDA runtime (libcudart) through the generated shim.

Every operation is the CUDA-shaped one (phoenix.cudalike); this file says where
libcudart and the driver are, why the port cannot serve when it cannot, and the two
things libcudart lacks: device names and allocation ranges, from the driver API
(libcuda). The raw data-path pointers (cudaMemcpyAsync, cudaLaunchHostFunc,
cudaStreamSynchronize, ...) come from the same libcudart the process already uses
(torch's or CuPy's when one of them is loaded), so streams and pointers are shared.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys

from phoenix.cudalike import CudaLikeRuntime
from phoenix.vendor import Probe

#: oldest runtime with cudaLaunchHostFunc and the pointer-attribute layout used here
MIN_RUNTIME = 10000
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
CU_ERRORS = {100: "no CUDA-capable device is detected", 3: "driver not initialized",
             999: "unknown error", 35: "driver is older than the runtime", 803: "system driver mismatch",
             304: "OS call failed (is /dev/nvidia* accessible?)"}


def _loaded_libcudart() -> str | None:
    """A libcudart already mapped into this process (torch's, CuPy's), to share it."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def _libcudart_candidates() -> list[str]:
    cands = []
    loaded = _loaded_libcudart()
    if loaded:
        cands.append(loaded)
    try:  # cuda-python's locator, when installed
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore

        cands.append(load_nvidia_dynamic_lib("cudart").abs_path)
    except Exception:
        pass
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
    for root in dict.fromkeys(roots):
        cands += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")), reverse=True)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands += sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libcudart.so*")), reverse=True)
    cands += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"), reverse=True)
    cands += ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    return list(dict.fromkeys(cands))


class Runtime(CudaLikeRuntime):
    name = "nvidia"
    prefix = "cuda"
    p2p_page_size = 65536  # GPU pages pinned by nvidia_p2p_get_pages are 64 KiB
    runtime_description = "CUDA runtime (libcudart) + driver API (libcuda) through ctypes shims"

    _probe_cache: Probe | None = None

    @classmethod
    def probe(cls) -> Probe:
        if cls._probe_cache is None:
            cls._probe_cache = cls._probe()
        return cls._probe_cache

    @classmethod
    def _probe(cls) -> Probe:
        try:
            drv = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return Probe(False, "no NVIDIA driver: libcuda.so.1 is not on the loader path")
        rc = drv.cuInit(0)
        if rc != 0:
            return Probe(False, f"the NVIDIA driver does not initialize: cuInit returned {rc} ({CU_ERRORS.get(rc, 'see cuda.h')})")
        dver = ctypes.c_int()
        drv.cuDriverGetVersion(ctypes.byref(dver))
        looked = []
        for cand in _libcudart_candidates():
            looked.append(cand)
            try:
                rt = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            rver = ctypes.c_int()
            if rt.cudaRuntimeGetVersion(ctypes.byref(rver)) != 0:
                continue
            if rver.value < MIN_RUNTIME:
                return Probe(False, f"CUDA runtime {cand} is version {rver.value}, older than {MIN_RUNTIME} (needs cudaLaunchHostFunc)")
            if rver.value // 1000 > dver.value // 1000:
                return Probe(False, f"driver supports CUDA {dver.value} but runtime {cand} is {rver.value}: driver too old")
            n = ctypes.c_int()
            rc = rt.cudaGetDeviceCount(ctypes.byref(n))
            if rc != 0 or n.value == 0:
                return Probe(False, f"no CUDA device visible (cudaGetDeviceCount returned {rc}, count {n.value})")
            return Probe(True, f"{n.value} device(s), driver CUDA {dver.value}, runtime {rver.value} ({cand})",
                         {"libcudart": cand, "runtime_version": rver.value, "driver_version": dver.value, "devices": n.value})
        return Probe(False, "no usable libcudart found; looked in: " + ", ".join(looked[:8]))

    def __init__(self):
        super().__init__()
        self._drv = ctypes.CDLL("libcuda.so.1")
        self._drv.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._drv.cuDeviceGetName.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]

    def library_path(self) -> str:
        return self.probe().details["libcudart"]

    def device_name(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(256)
        if self._drv.cuDeviceGetName(buf, 256, ordinal) == 0:
            return buf.value.decode()
        return super().device_name(ordinal)

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        """Allocation base and size from the driver (libcudart has no such query)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._drv.cuPointerGetAttribute(ctypes.byref(base), CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) != 0:
            return None
        if self._drv.cuPointerGetAttribute(ctypes.byref(size), CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) != 0:
            return None
        return base.value, size.value
