"""NVIDIA port, userspace side: the CUDA runtime (libcudart) through the generated shim.

Vendor side, control plane. Every operation, the library search, the probe and the
test-double labelling are the CUDA-shaped ones (:class:`phoenix.cudalike.CudaLikeRuntime`);
this file declares where libcudart is and adds what is NVIDIA's own:

* **the libcudart the process already uses** comes first (torch's or CuPy's, read from
  ``/proc/self/maps``), then cuda-python's locator and the CUDA wheels, so streams and
  pointers are shared with them; then ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda``
  and the loader's path. ``PHX_NVIDIA_LIBRARY`` names one exact libcudart instead;
* **the driver**: libcuda must initialize (``cuInit``), be new enough for the runtime,
  and the runtime must have ``cudaLaunchHostFunc`` (CUDA >= 10);
* **device names and allocation ranges** come from the driver API (``cuDeviceGetName``,
  ``cuPointerGetAttribute``), which libcudart lacks.

When ``PHX_NVIDIA_LIBRARY`` is phoenix's emulated runtime (``phx-port test nvidia
--emulated``: a test double, built with the ``cu*`` driver calls too), those driver calls
go to the emulator itself (without them, names come from cudaGetDeviceProperties and
ranges are unknown); libcuda is never touched, and the runtime reports itself a test
double. An emulator is never picked up by the search, even when one is loaded in the process.
"""

from __future__ import annotations

import glob
import os
import site
import sys

from phoenix.cudalike import CudaLikeRuntime

#: oldest runtime with cudaLaunchHostFunc and the pointer-attribute layout used here
MIN_RUNTIME = 10000
#: what to do after a driver-side reason (no libcuda, cuInit failing)
DRIVER_HINT = (
    "Install the NVIDIA driver (it provides libcuda.so.1; nvidia-smi checks that it is loaded), or put the "
    "directory holding libcuda.so.1 on LD_LIBRARY_PATH; PHX_NVIDIA_LIBRARY names the libcudart to use"
)


def _loaded_libcudart() -> list[tuple[str, str]]:
    """A libcudart already mapped into this process (torch's, CuPy's), to share it."""
    with open("/proc/self/maps") as fh:
        found = [ln.rsplit(None, 1)[-1] for ln in fh if "/libcudart.so" in ln]
    return [("the libcudart already loaded", found[0])] if found else []


class Runtime(CudaLikeRuntime):
    name = "nvidia"
    prefix = "cuda"
    library_names = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
    library_roots = ("CUDA_HOME", "CUDA_PATH")
    library_dirs = ("lib64",)
    default_root = "/usr/local/cuda"
    driver_library = "libcuda.so.1"
    emulated_driver_prefix = "cu"  # names from cuDeviceGetName, ranges from cuPointerGetAttribute
    p2p_page_size = 65536  # GPU pages pinned by nvidia_p2p_get_pages are 64 KiB
    auto_priority = 100
    host_register_read_only_flag = 8  # cudaHostRegisterReadOnly
    runtime_title = "CUDA"
    runtime_description = "CUDA runtime (libcudart) + driver API (libcuda) through ctypes shims"

    @classmethod
    def extra_library_places(cls) -> list[tuple[str, str]]:
        places = _loaded_libcudart()
        try:  # cuda-python's locator, when installed
            from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore

            places.append(("cuda-python's locator", load_nvidia_dynamic_lib("cudart").abs_path))
        except Exception:
            pass
        for root in dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path]):
            wheels = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")), reverse=True)
            places += [("a CUDA wheel", path) for path in wheels]
        return places + [(p, p) for p in sorted(glob.glob("/usr/local/cuda-*/lib64/libcudart.so*"), reverse=True)]

    @classmethod
    def _check_driver(cls, handle, details: dict) -> str | None:
        why = super()._check_driver(handle, details)  # what to do, as the other vendors' reasons say it
        return why and f"{why}. {DRIVER_HINT}"

    @classmethod
    def check_runtime(cls, handle, details: dict) -> str | None:
        rver, dver = details["runtime_version"] or 0, details["driver_version"] or 0
        if details["emulated"]:
            return None
        if rver < MIN_RUNTIME:
            return f"CUDA runtime {details['library']} is version {rver}, older than {MIN_RUNTIME} (needs cudaLaunchHostFunc): install CUDA 10 or newer, or set PHX_NVIDIA_LIBRARY to a newer libcudart"
        if rver // 1000 > dver // 1000:
            return f"driver supports CUDA {dver} but runtime {details['library']} is {rver}: driver too old; update the NVIDIA driver, or set PHX_NVIDIA_LIBRARY to a libcudart of CUDA {dver // 1000} or older"
        return None
