"""MetaX port, userspace side: the MACA runtime (``libmcruntime.so``) through the generated shim.

Vendor side, control plane. MACA's runtime is the CUDA runtime with ``cuda`` -> ``mc``
(``mcMalloc``, ``mcMemcpyAsync``, ``mcLaunchHostFunc``, ``mcSuccess`` 0, CUDA's copy-kind
numbers), so this port is a declaration: every operation, the library search, the probe
and the test-double labelling come from :class:`phoenix.cudalike.CudaLikeRuntime`. What
the declaration says:

* **where the library is**: ``PHX_METAX_LIBRARY`` (one exact file), else
  ``$MACA_PATH/lib``, ``$MACA_HOME/lib``, ``$MACA_ROOT/lib``, ``/opt/maca/lib``, then the
  loader's path; the probe names every place it looked and what it found there;
* **pointer attributes**: ``mcPointerAttribute_t``'s memory-type field is ``type`` in
  some MACA releases and ``memoryType`` in others, and a struct may carry both (CUDA 10's
  shape, shifting every field after it). So the layout is measured at the first pointer
  query (a device and a pinned allocation are queried, and where the answers land says
  the layout and the memory-type numbers), unless ``PHX_METAX_POINTER_ATTRIBUTES=
  type|memoryType|both`` forces one. ``Runtime().pointer_layout`` says which, and whence;
* **device names**: ``mcGetDeviceProperties``' ``name`` (offset 0, as in every
  CUDA-shaped runtime), into a buffer far larger than the struct;
* **allocation ranges**: MACA's runtime API has no address-range query (CUDA has one only
  in its driver API), so base and size come from the port's record of the allocations it
  made; memory allocated elsewhere reports its pointer with size 0;
* **read-only registration**: MACA documents no ``mcHostRegisterReadOnly``, so none is
  declared (0) and phoenix registers read-only mappings as ordinary ones.

``pymxc`` (a Python binding, if one is installed) is noted by the probe; nothing here needs
it, and the data path never would (it takes the library's C functions). Against an emulated
runtime (``phx-port test metax --emulated``: found as the installation at ``MACA_PATH``) the
same code runs, and the runtime reports itself a test double, everywhere.
"""

from __future__ import annotations

import importlib.util

from phoenix.cudalike import CudaLikeRuntime


class Runtime(CudaLikeRuntime):
    name = "metax"
    prefix = "mc"
    library_names = ("libmcruntime.so",)
    library_roots = ("MACA_PATH", "MACA_HOME", "MACA_ROOT")
    library_dirs = ("lib",)
    default_root = "/opt/maca"
    emulated_via_root = True  # an emulator is found as an installation, the way MACA is
    calibrate_pointer_layout = True
    p2p_page_size = 65536  # MetaX GPU pages pinned for P2P are 64 KiB (equal to vendors/metax/p2p.c)
    auto_priority = 80
    host_register_read_only_flag = 0
    runtime_title = "MACA"
    runtime_description = "MetaX MACA runtime (libmcruntime.so) through the generated ctypes shim"

    @classmethod
    def check_runtime(cls, handle, details: dict) -> str | None:
        details["pymxc"] = importlib.util.find_spec("pymxc") is not None
        return None
