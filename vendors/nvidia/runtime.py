"""NVIDIA port, userspace side: the CUDA runtime (libcudart) through the generated shim.

Every operation is the CUDA-shaped one (phoenix.cudalike); this file says where
libcudart and the driver are, why the port cannot serve when it cannot, and the two
things libcudart lacks: device names and allocation ranges, from the driver API
(libcuda). The raw data-path pointers (cudaMemcpyAsync, cudaLaunchHostFunc,
cudaStreamSynchronize, ...) come from the same libcudart the process already uses
(torch's or CuPy's when one of them is loaded), so streams and pointers are shared.

``PHX_NVIDIA_LIBRARY`` names one libcudart to use instead. When that is phoenix's
emulated runtime (``phx-port test nvidia --emulated``: a test double, found by its
``cudaPhoenixTestDouble`` mark), the driver calls go to the emulator's own driver API
(or, without one, names come from cudaGetDeviceProperties and ranges are unknown),
libcuda is never touched, and the runtime reports itself a test double. An emulator
is never picked up by the search otherwise, even when one is loaded in the process.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys

from phoenix.cudalike import CudaLikeRuntime
from phoenix.emulator import LABEL as EMULATED_LABEL
from phoenix.emulator import emulator_info
from phoenix.shim import Shim, cuda_shaped_protos, load_shim
from phoenix.vendor import Probe

#: oldest runtime with cudaLaunchHostFunc and the pointer-attribute layout used here
MIN_RUNTIME = 10000
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
#: one exact libcudart to load instead of searching: a real one, or phoenix's emulated one
#: (a test double, used by `phx-port test nvidia --emulated`; its driver API stands in for libcuda)
LIBRARY_ENV = "PHX_NVIDIA_LIBRARY"
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
    library_names = ("libcudart.so",)
    #: an emulated libcudart also carries the driver calls this port makes (cuInit, cuPointerGetAttribute, ...)
    emulated_driver_prefix = "cu"
    p2p_page_size = 65536  # GPU pages pinned by nvidia_p2p_get_pages are 64 KiB
    runtime_description = "CUDA runtime (libcudart) + driver API (libcuda) through ctypes shims"

    _probe_cache: dict = {}

    @classmethod
    def probe(cls) -> Probe:
        key = os.environ.get(LIBRARY_ENV)
        if key not in cls._probe_cache:
            cls._probe_cache[key] = cls._probe_override(key) if key else cls._probe()
        return cls._probe_cache[key]

    @classmethod
    def _probe_override(cls, path: str) -> Probe:
        """$PHX_NVIDIA_LIBRARY: that libcudart only; phoenix's emulated one (a test double) or a real one."""
        try:
            # loaded locally first: an emulator's cuda* and cu* names must never interpose on a real CUDA
            rt = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            return Probe(False, f"${LIBRARY_ENV}={path} cannot be loaded: {exc}")
        info = emulator_info(rt, "cuda")
        if info is None:  # a real libcudart at a place of the operator's choosing
            try:
                return cls._probe(only=path)
            except AttributeError as exc:  # the probe must not raise, whatever the file is
                return Probe(False, f"${LIBRARY_ENV}={path} is not a CUDA runtime: {exc}")
        details = {"libcudart": path, "emulated": info, "driver": None}
        rver = ctypes.c_int()
        rt.cudaRuntimeGetVersion(ctypes.byref(rver))
        details["runtime_version"] = rver.value
        if hasattr(rt, "cuInit"):  # the emulator's driver API stands in for libcuda
            rc = rt.cuInit(0)
            if rc != 0:
                return Probe(False, f"emulated driver: cuInit returned {rc} ({CU_ERRORS.get(rc, 'see cuda.h')})", details)
            details["driver"] = path
        n = ctypes.c_int()
        rc = rt.cudaGetDeviceCount(ctypes.byref(n))
        details["devices"] = n.value
        if rc != 0 or n.value == 0:
            return Probe(False, f"emulated runtime {path}: no device (cudaGetDeviceCount returned {rc})", details)
        driver = "with its driver API" if details["driver"] else \
            "WITHOUT a driver API: device names from cudaGetDeviceProperties, allocation ranges unknown"
        return Probe(True, f"{EMULATED_LABEL} at {path}: {n.value} device(s), {driver}; not NVIDIA hardware ({info})",
                     details)

    @classmethod
    def _probe(cls, only: str | None = None) -> Probe:
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
        for cand in [only] if only else _libcudart_candidates():
            looked.append(cand)
            try:
                if emulator_info(ctypes.CDLL(cand, mode=ctypes.RTLD_LOCAL), "cuda"):
                    continue  # phoenix's emulated libcudart: a test double is used only through $PHX_NVIDIA_LIBRARY
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
        details = self.probe().details
        self.emulated = details.get("emulated")
        if self.emulated:  # the instance says so wherever it is reported (phx info, reports)
            self.is_test_double = True
            self.runtime_description = f"{EMULATED_LABEL}: libcudart stand-in at {details['libcudart']}, not CUDA"
            driver = details.get("driver")
            self._drv = ctypes.CDLL(driver, mode=ctypes.RTLD_LOCAL) if driver else None
        else:
            self._drv = ctypes.CDLL("libcuda.so.1")
        if self._drv is not None:
            self._drv.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            self._drv.cuDeviceGetName.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]

    def library_path(self) -> str:
        return self.probe().details["libcudart"]

    def bind(self) -> Shim:
        if not self.probe().details.get("emulated"):
            return super().bind()
        # an emulated libcudart is bound locally, so it never stands in for a real one elsewhere
        return load_shim(self.name, self.library_path(), cuda_shaped_protos("cuda"), prefix="cuda",
                         error_name="cudaGetErrorName", error_string="cudaGetErrorString", mode=ctypes.RTLD_LOCAL)

    def device_name(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(256)
        if self._drv is not None and self._drv.cuDeviceGetName(buf, 256, ordinal) == 0:
            return buf.value.decode()
        if self._drv is None:  # no driver API: cudaGetDeviceProperties' name (offset 0 in every release)
            props = ctypes.create_string_buffer(16384)  # far larger than any cudaDeviceProp
            fn = self.rt.handle.cudaGetDeviceProperties
            if fn(props, ordinal) == 0 and props.value:
                return props.value.decode(errors="replace")
        return super().device_name(ordinal)

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        """Allocation base and size from the driver (libcudart has no such query)."""
        if self._drv is None:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._drv.cuPointerGetAttribute(ctypes.byref(base), CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) != 0:
            return None
        if self._drv.cuPointerGetAttribute(ctypes.byref(size), CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) != 0:
            return None
        return base.value, size.value
