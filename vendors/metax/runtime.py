"""MetaX port, userspace side: the MACA runtime (``libmcruntime.so``) through the generated shim.

Vendor side, control plane. MACA's runtime is the CUDA runtime with ``cuda`` ->
``mc`` (``mcMalloc``, ``mcMemcpyAsync``, ``mcLaunchHostFunc``, ``mcError_t`` with
``mcSuccess`` 0, CUDA's copy-kind numbers), so every operation comes from
:class:`phoenix.cudalike.CudaLikeRuntime` and its shim from
``cuda_shaped_protos("mc")``; the raw data-path pointers are the library's own
``mc*`` functions. This file says what differs:

* **where the library is**: ``PHX_METAX_LIBRARY`` (one exact file, when set), else
  ``$MACA_PATH/lib``, ``$MACA_HOME/lib``, ``$MACA_ROOT/lib``, ``/opt/maca/lib``, then
  the loader's path; the probe names every place it looked and what it found there;
* **pointer attributes**: ``mcPointerAttribute_t``'s memory-type field is named
  ``type`` in some MACA releases and ``memoryType`` in others, and a struct may carry
  both (CUDA 10's shape: the deprecated ``memoryType`` first, shifting every field
  after it). The layout is decided once per process, at the first pointer query:
  (1) ``PHX_METAX_POINTER_ATTRIBUTES=type|memoryType|both`` when set; else (2) the
  header, ``include/mcr/*.h`` of the installation the library came from, read for the
  struct's fields and the ``mcMemoryType`` values; else (3) measured: one device and
  one pinned allocation are queried and the device pointer's offset and the
  memory-type values are read off the answer. :attr:`Runtime.pointer_layout` says
  which, and from where. The buffer handed to the runtime is always larger than any
  known layout, so a longer struct in a future release cannot overrun it;
* **device names**: ``mcGetDeviceProperties`` read only for ``name`` (offset 0, as in
  every CUDA-shaped runtime), into a buffer far larger than the struct;
* **allocation ranges**: the MACA runtime API has no address-range query (CUDA has it
  only in its driver API), so base and size come from this port's record of the
  allocations it made; memory allocated elsewhere reports its pointer with size 0;
* **zero sizes**: CUDA answers ``cudaMalloc(0)``/``cudaMallocHost(0)`` with success and
  NULL (checked on CUDA 13), and MACA follows CUDA; the contract refuses them, so the
  port does, with ``mcErrorInvalidValue``, before calling the runtime.

``pymxc`` (a Python binding, if one is installed) is noted by the probe; nothing here
needs it, and the data path never would (it takes the library's C functions).

Against an emulated runtime (``phx-port test metax --emulated``: phoenix's host
runtime built as ``libmcruntime.so``, a test double) the same code runs unchanged;
the runtime then reports itself as a test double, everywhere.
"""

from __future__ import annotations

import bisect
import ctypes
import glob
import importlib.util
import os
import re
import struct
import threading

from phoenix.cudalike import INVALID_VALUE, MEM_DEVICE, MEM_HOST, MEM_MANAGED, MEM_UNREGISTERED, CudaLikeRuntime
from phoenix.emulator import LABEL as EMULATED_LABEL
from phoenix.emulator import emulator_info
from phoenix.errors import VendorError
from phoenix.shim import NONE, Proto, Shim, cuda_shaped_protos, load_shim
from phoenix.vendor import Probe

PREFIX = "mc"
LIBRARY = "libmcruntime.so"
#: one exact library file; overrides the search below
LIBRARY_ENV = "PHX_METAX_LIBRARY"
#: installation roots, in search order (the library is ``<root>/lib/libmcruntime.so``)
ROOT_VARS = ("MACA_PATH", "MACA_HOME", "MACA_ROOT")
DEFAULT_ROOT = "/opt/maca"
#: forces the pointer-attribute layout: type | memoryType | both
LAYOUT_ENV = "PHX_METAX_POINTER_ATTRIBUTES"

_i, _p = ctypes.c_int, ctypes.c_void_p
EXTRA_PROTOS = [
    Proto("mcGetDeviceProperties", _i, [_p, _i], optional=True),
    Proto("mcRuntimeGetVersion", _i, [ctypes.POINTER(_i)], optional=True),
    Proto("mcDriverGetVersion", _i, [ctypes.POINTER(_i)], optional=True),
    # NOT_READY (mcErrorNotReady) is an answer, not an error: the caller reads the status
    Proto("mcStreamQuery", _i, [_p], errors=NONE, optional=True),
]

#: bytes given to mcGetDeviceProperties and mcPointerGetAttributes: several times any known struct
_PROPS_BYTES = 16384
_ATTR_SLACK = 512


# -- finding the library --------------------------------------------------------------


def search_places() -> list[tuple[str, str | None]]:
    """Where the runtime is looked for, in order: (what, library path or None when unset)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return [(f"${LIBRARY_ENV}", override)]
    places: list[tuple[str, str | None]] = []
    for var in ROOT_VARS:
        root = os.environ.get(var)
        places.append((f"${var}/lib", os.path.join(root, "lib", LIBRARY) if root else None))
    places.append((f"{DEFAULT_ROOT}/lib", os.path.join(DEFAULT_ROOT, "lib", LIBRARY)))
    places.append(("the loader's path (LD_LIBRARY_PATH, ld.so.cache)", LIBRARY))
    return places


def _root_of(library: str) -> str | None:
    """The installation a library file belongs to (``<root>/lib/libmcruntime.so``)."""
    if os.sep not in library:
        return None
    lib_dir = os.path.dirname(os.path.abspath(library))  # the root searched, not where links lead
    return os.path.dirname(lib_dir) if os.path.basename(lib_dir) in ("lib", "lib64") else None


def _find() -> tuple[str | None, ctypes.CDLL | None, list[str]]:
    """(path, handle, what was seen at each place) of the first loadable runtime."""
    looked: list[str] = []
    for what, path in search_places():
        if path is None:
            looked.append(f"{what} (unset)")
            continue
        by_name = os.sep not in path
        if not by_name and not os.path.exists(path):
            looked.append(f"{what}: {path} (no such file)")
            continue
        try:
            # an emulator must not interpose its mc* names on anything else: load it locally
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            looked.append(f"{what}: {'not found' if by_name else f'{path} cannot be loaded: {exc}'}")
            continue
        if by_name:
            path = _loaded_path(handle) or path
        looked.append(f"{what}: {path} (found)")
        return path, handle, looked
    return None, None, looked


def _loaded_path(handle: ctypes.CDLL) -> str | None:
    """The file the loader picked for a library opened by name (from /proc/self/maps)."""
    fn = getattr(handle, "mcGetDeviceCount", None)
    if fn is None:
        return None
    address = ctypes.cast(fn, ctypes.c_void_p).value
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi and len(fields) >= 6:
                    return fields[5]
    except (OSError, ValueError):
        pass
    return None


def _version(handle: ctypes.CDLL, symbol: str) -> int | None:
    fn = getattr(handle, symbol, None)
    if fn is None:
        return None
    value = ctypes.c_int()
    return value.value if fn(ctypes.byref(value)) == 0 else None


# -- pointer-attribute layouts --------------------------------------------------------


def _attributes_struct(fields: list[tuple[str, object]]) -> type[ctypes.Structure]:
    """A ctypes struct of ``fields`` followed by slack (a longer runtime struct cannot overrun it)."""
    return type("mcPointerAttribute_t", (ctypes.Structure,),
                {"_fields_": list(fields) + [("_slack", ctypes.c_ubyte * _ATTR_SLACK)]})


#: the known shapes: the memory-type field(s) first, then device, devicePointer, hostPointer
LAYOUTS: dict[str, list[tuple[str, object]]] = {
    "type": [("type", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
    "memoryType": [("memoryType", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
    "both": [("memoryType", _i), ("type", _i), ("device", _i), ("devicePointer", _p), ("hostPointer", _p)],
}
#: CUDA's cudaMemoryType values (MACA's unless its header says otherwise)
CUDA_MEMORY_TYPES = {MEM_UNREGISTERED: MEM_UNREGISTERED, MEM_HOST: MEM_HOST, MEM_DEVICE: MEM_DEVICE,
                     MEM_MANAGED: MEM_MANAGED}

_C_TYPES = {"int": _i, "signed int": _i, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint,
            "long": ctypes.c_long, "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
            "unsigned long long": ctypes.c_ulonglong, "size_t": ctypes.c_size_t, "bool": ctypes.c_bool,
            "char": ctypes.c_char, "unsigned char": ctypes.c_ubyte, "uint32_t": ctypes.c_uint32,
            "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64, "int64_t": ctypes.c_int64}


def _strip_c(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    return re.sub(r"\b__\w+\s*(\((?:[^()]|\([^()]*\))*\))?", " ", text)  # __attribute__((...)), __MC_DEPRECATED


def _field_type(decl: str) -> object | None:
    """The ctypes type of a C declaration's type part, or None when it is not understood here."""
    if "*" in decl:
        return _p
    words = decl.replace("const ", " ").replace("struct ", " ").split()
    spelled = " ".join(words)
    if spelled in _C_TYPES:
        return _C_TYPES[spelled]
    if len(words) == 2 and words[0] == "enum" or len(words) == 1 and "MemoryType" in words[0]:
        return _i  # an enum (mcMemoryType): int-sized
    return None


def parse_header_layout(text: str, prefix: str = PREFIX) -> dict | None:
    """The pointer-attribute fields and memory-type values declared in a header's text.

    Returns ``{"fields": [(name, ctype), ...], "memory_types": {runtime value: CUDA value}}``
    or None when ``<prefix>PointerAttribute_t`` is not declared there in a form read here
    (members of plain C types and enums; a union of enum members, HIP's way of giving
    the field both names, counts as one field read as ``type``).
    """
    code = _strip_c(text)
    tname = f"{prefix}PointerAttribute_t"
    body_re = r"\{((?:[^{}]|\{[^{}]*\})*)\}"
    m = re.search(r"typedef\s+struct\s*\w*\s*" + body_re + r"\s*" + tname + r"\s*;", code)
    if not m:  # struct X {...}; typedef struct X mcPointerAttribute_t;
        t = re.search(r"typedef\s+struct\s+(\w+)\s+" + tname + r"\s*;", code)
        if t:
            m = re.search(r"struct\s+" + t.group(1) + r"\s*" + body_re + r"\s*;", code)
    if not m:
        return None
    decl_re = re.compile(r"(.+?)\b(\w+)\s*(?:\[\s*(\d+)\s*\])?$")
    fields: list[tuple[str, object]] = []
    for decl in re.findall(r"union\s*\{[^{}]*\}\s*\w*\s*;|[^;{}]+;", m.group(1)):
        decl = decl.strip().rstrip(";").strip()
        if decl.startswith("union"):
            inner = [x.strip() for x in re.search(r"\{([^{}]*)\}", decl).group(1).split(";") if x.strip()]
            members = [decl_re.match(x) for x in inner]
            if not members or any(x is None or _field_type(x.group(1)) is not _i for x in members):
                return None
            if not {x.group(2) for x in members} & {"type", "memoryType"}:
                return None
            fields.append(("type", _i))
            continue
        parts = decl_re.match(decl) if decl else None
        ctype = _field_type(parts.group(1)) if parts else None
        if ctype is None:
            return None  # a type not understood here: measure instead of guessing
        fields.append((parts.group(2), ctype * int(parts.group(3)) if parts.group(3) else ctype))
    names = [n for n, _ in fields]
    if "device" not in names or not {"type", "memoryType"} & set(names):
        return None

    memory_types = dict(CUDA_MEMORY_TYPES)
    for em in re.finditer(r"enum\s*\w*\s*\{([^{}]*)\}", code):
        if f"{prefix}MemoryTypeDevice" not in em.group(1):
            continue
        value, seen = -1, {}
        try:
            for item in em.group(1).split(","):
                key, _, expr = item.strip().partition("=")
                if key.strip():
                    value = int(expr.strip(), 0) if expr.strip() else value + 1
                    seen[key.strip()] = value
        except ValueError:  # an expression, not a number: keep CUDA's values
            break
        cuda_of = {"Unregistered": MEM_UNREGISTERED, "Host": MEM_HOST, "Device": MEM_DEVICE,
                   "Managed": MEM_MANAGED, "Unified": MEM_MANAGED}
        memory_types = {v: cuda_of[k[len(prefix) + 10:]] for k, v in seen.items()
                        if k[len(prefix) + 10:] in cuda_of}
        break
    return {"fields": fields, "memory_types": memory_types}


def header_layout(root: str | None) -> tuple[dict, str] | None:
    """The layout declared by an installation's headers (``<root>/include/mcr/*.h``), and which file."""
    if not root:
        return None
    preferred = os.path.join(root, "include", "mcr", "mc_runtime_api.h")
    headers = [preferred] + sorted(set(glob.glob(os.path.join(root, "include", "mcr", "*.h"))) - {preferred})
    for path in headers:
        try:
            with open(path, errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        if "PointerAttribute_t" not in text:
            continue
        layout = parse_header_layout(text)
        if layout:
            return layout, path
    return None


# -- the port -------------------------------------------------------------------------


class Runtime(CudaLikeRuntime):
    name = "metax"
    prefix = PREFIX
    library_names = (LIBRARY,)
    p2p_page_size = 65536  # MetaX GPU pages pinned for P2P are 64 KiB (equal to vendors/metax/p2p.c)
    runtime_description = "MetaX MACA runtime (libmcruntime.so) through the generated ctypes shim"

    _probe_cache: dict = {}

    @classmethod
    def emulated_env(cls, emulator) -> dict:
        """Point the port at an emulator the way MACA is found: as the installation at ``MACA_PATH``."""
        return {"MACA_PATH": emulator.root, LIBRARY_ENV: None}

    @classmethod
    def probe(cls) -> Probe:
        key = tuple(os.environ.get(v) for v in (LIBRARY_ENV, *ROOT_VARS, "LD_LIBRARY_PATH"))
        if key not in cls._probe_cache:
            cls._probe_cache[key] = cls._probe()
        return cls._probe_cache[key]

    @classmethod
    def _probe(cls) -> Probe:
        path, handle, looked = _find()
        details: dict = {"looked": looked, "pymxc": importlib.util.find_spec("pymxc") is not None}
        if handle is None:
            hint = f"Install MACA or set MACA_PATH to it (or {LIBRARY_ENV} to the library file)"
            return Probe(False, f"{LIBRARY} not found; looked in: " + "; ".join(looked) + f". {hint}", details)
        details.update(library=path, root=_root_of(path))
        emulated = emulator_info(handle, PREFIX)
        details["emulated"] = emulated
        fn = getattr(handle, "mcGetDeviceCount", None)
        if fn is None:
            return Probe(False, f"{path} has no mcGetDeviceCount: not a MACA runtime library", details)
        count = ctypes.c_int()
        rc = fn(ctypes.byref(count))
        details.update(devices=count.value, runtime_version=_version(handle, "mcRuntimeGetVersion"),
                       driver_version=_version(handle, "mcDriverGetVersion"))
        if rc != 0 or count.value <= 0:
            return Probe(False, f"{path} finds no MetaX device (mcGetDeviceCount returned {rc}, "
                                f"count {count.value}): is the MetaX kernel driver loaded, and are its device nodes accessible?", details)
        versions = f"runtime {details['runtime_version']}, driver {details['driver_version']}"
        if emulated:
            return Probe(True, f"{EMULATED_LABEL} at {path}: {count.value} device(s), not MACA ({emulated})", details)
        return Probe(True, f"{count.value} device(s), MACA {versions} ({path})", details)

    def __init__(self):
        super().__init__()
        details = self.probe().details
        self.emulated = details.get("emulated")
        if self.emulated:  # the instance says so wherever it is reported (phx info, reports)
            self.is_test_double = True
            self.runtime_description = f"{EMULATED_LABEL}: libmcruntime.so stand-in at {details['library']}, not MACA"
        self._root = details.get("root")
        self._layout_lock = threading.Lock()
        self.pointer_layout: dict | None = None  # decided at the first pointer query
        self._memory_types = CUDA_MEMORY_TYPES
        self._type_field = "type"
        self._dev_bases: list[int] = []  # sorted bases of the device allocations made here
        self._dev_sizes: dict[int, tuple[int, int]] = {}  # base -> (size, device)

    def library_path(self) -> str:
        return self.probe().details["library"]

    def bind(self) -> Shim:
        P = self.prefix
        return load_shim(self.name, self.library_path(), cuda_shaped_protos(P) + EXTRA_PROTOS, prefix=P,
                         error_name=f"{P}GetErrorName", error_string=f"{P}GetErrorString",
                         mode=ctypes.RTLD_LOCAL if self.probe().details.get("emulated") else ctypes.RTLD_GLOBAL)

    # -- devices -------------------------------------------------------------------

    def device_name(self, ordinal: int) -> str:
        if self.rt.has("mcGetDeviceProperties"):
            props = ctypes.create_string_buffer(_PROPS_BYTES)
            self.rt.get_device_properties(props, ordinal)
            name = props.raw[:256].split(b"\0", 1)[0].decode(errors="replace").strip()
            if name:
                return name
        return super().device_name(ordinal)

    # -- device memory: the allocation record behind address_range ---------------------

    def device_alloc(self, size: int, device: int = 0) -> int:
        if size <= 0:  # CUDA-shaped runtimes answer Malloc(0) with success and NULL; the contract refuses it
            self.rt.raise_for("mcMalloc", INVALID_VALUE)
        ptr = super().device_alloc(size, device)
        with self._lock:
            bisect.insort(self._dev_bases, ptr)
            self._dev_sizes[ptr] = (size, device)
        return ptr

    def device_free(self, ptr: int) -> None:
        super().device_free(ptr)
        with self._lock:
            if self._dev_sizes.pop(ptr, None) is not None:
                del self._dev_bases[bisect.bisect_left(self._dev_bases, ptr)]

    def host_alloc_pinned(self, size: int) -> int:
        if size <= 0:  # as device_alloc: MallocHost(0) "succeeds" with NULL in CUDA-shaped runtimes
            self.rt.raise_for("mcMallocHost", INVALID_VALUE)
        return super().host_alloc_pinned(size)

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        with self._lock:
            i = bisect.bisect_right(self._dev_bases, ptr) - 1
            if i >= 0:
                base = self._dev_bases[i]
                size = self._dev_sizes[base][0]
                if ptr < base + size:
                    return base, size
        return None

    # -- pointer queries: the layout, decided once ------------------------------------

    def pointer_info(self, ptr: int):
        if self.pointer_layout is None:
            self._decide_layout()
        return super().pointer_info(ptr)

    def memory_type(self, attrs) -> int:
        return self._memory_types.get(getattr(attrs, self._type_field), MEM_UNREGISTERED)

    def _use_layout(self, fields, memory_types: dict, source: str, name: str) -> None:
        self.pointer_attributes_type = _attributes_struct(fields)
        names = [n for n, _ in fields]
        self._type_field = "type" if "type" in names else "memoryType"
        self._memory_types = dict(memory_types)
        self.pointer_layout = {"layout": name, "field": self._type_field, "source": source}

    def _decide_layout(self) -> None:
        with self._layout_lock:
            if self.pointer_layout is not None:
                return
            forced = os.environ.get(LAYOUT_ENV)
            if forced:
                if forced not in LAYOUTS:
                    raise ValueError(f"{LAYOUT_ENV}={forced!r}: choose one of {', '.join(LAYOUTS)}")
                self._use_layout(LAYOUTS[forced], CUDA_MEMORY_TYPES, f"${LAYOUT_ENV}", forced)
                return
            found = header_layout(self._root)
            if found:
                layout, path = found
                names = [n for n, _ in layout["fields"]]
                name = "both" if {"type", "memoryType"} <= set(names) else \
                       ("type" if "type" in names else "memoryType")
                self._use_layout(layout["fields"], layout["memory_types"], f"header {path}", name)
                return
            self._calibrate()

    def _calibrate(self) -> None:
        """Measure the layout: query one device and one pinned allocation, read the answers."""
        raw_struct = ctypes.c_ubyte * 256
        fallback = "no header; measuring failed, assuming CUDA's layout"

        def query(ptr: int) -> bytes | None:
            buf = raw_struct(*([0xA5] * 256))
            try:
                self.rt.pointer_get_attributes(ctypes.byref(buf), ctypes.c_void_p(ptr))
            except VendorError:
                return None
            return bytes(buf)

        dev = ctypes.c_void_p()
        host = ctypes.c_void_p()
        device = ctypes.c_int()
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
        if on_dev is None or on_host is None:
            self._use_layout(LAYOUTS["type"], CUDA_MEMORY_TYPES, fallback, "type")
            return
        # where the device pointer comes back says how many memory-type fields precede `device`
        for name, type_off, dev_off, ptr_off in (("type", 0, 4, 8), ("both", 4, 8, 16)):
            (devptr,) = struct.unpack_from("=Q", on_dev, ptr_off)
            (ordinal,) = struct.unpack_from("=i", on_dev, dev_off)
            if devptr == dev.value and ordinal == device.value:
                dev_type = struct.unpack_from("=i", on_dev, type_off)[0]
                host_type = struct.unpack_from("=i", on_host, type_off)[0]
                if dev_type == host_type:
                    break
                # one name or the other at offset 0 reads the same; call it `type`
                self._use_layout(LAYOUTS[name], {dev_type: MEM_DEVICE, host_type: MEM_HOST},
                                 "measured at run time (no MACA header)", name)
                return
        self._use_layout(LAYOUTS["type"], CUDA_MEMORY_TYPES, fallback, "type")
