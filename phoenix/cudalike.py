"""A vendor runtime over any CUDA-shaped C runtime (``cuda*``, ``mc*``, ``hip*``, ``musa*``, ``phxh*``).

Core side, control plane. Most accelerator runtimes are the CUDA runtime with another
symbol prefix, so a CUDA-shaped port is data: :class:`CudaLikeRuntime` does everything a
port of such a runtime does, from the facts the port declares (its prefix, library
names, installation roots, page size, and the few calls where its runtime differs), and
a port's ``runtime.py`` is a short declaration. What lives here, once for every port:

* **finding the library**: ``PHX_<NAME>_LIBRARY`` (one exact file), else the port's own
  places (:meth:`CudaLikeRuntime.extra_library_places`), each root variable's ``lib``
  directories, the default root, the loader's path; the probe names each place and what
  it saw there;
* **the probe**, cached per search environment: the library loads, it is this runtime
  (``<prefix>GetDeviceCount``), the port's own checks pass (driver, versions), a device
  is found;
* **test doubles**: an emulated runtime exports ``<prefix>PhoenixTestDouble``; it is used
  only when the operator named it (the library variable or a root variable), never picked
  up on the way, and once bound the runtime says "emulated runtime (test double)" everywhere;
* **binding**: the generated shim, ``RTLD_LOCAL`` for a test double (its names must never
  interpose on a real runtime in the process), ``RTLD_GLOBAL`` otherwise;
* **device names and sizes**, **allocation ranges**, and the **pointer-attribute layout**
  (declared, forced by ``PHX_<NAME>_POINTER_ATTRIBUTES``, or measured at run time).

Ports whose runtime is not CUDA-shaped subclass :class:`phoenix.vendor.VendorRuntime`.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import operator
import os
import threading
import weakref

from .checks import I64_MAX
from .cudalike_pointers import (
    CUDA_MEMORY_TYPES,
    PointerAttributes,
    PointerQueries,
)
from .errors import VendorError, VendorUnavailable
from .shim import Proto, Shim, cuda_shaped_protos, load_shim
from .vendor import (
    DATA_PATH_ABI,
    EMULATED_LABEL,
    CopyKind,
    DataPathTable,
    Device,
    MemoryType,
    Probe,
    VendorRuntime,
    library_env_var,
)

_i, _p = ctypes.c_int, ctypes.c_void_p
#: bytes handed to GetDeviceProperties: several times any known cudaDeviceProp
_PROPS_BYTES = 16384


#: ``cudaErrorInvalidValue``
INVALID_VALUE = 1
#: ``cudaErrorInvalidMemcpyDirection``
INVALID_MEMCPY_DIRECTION = 21
#: ``cudaErrorInvalidResourceHandle``
INVALID_RESOURCE_HANDLE = 400
#: (source is device memory, destination is device memory) of each copy kind
_DEVICE_SIDES = {
    CopyKind.HOST_TO_HOST: (False, False),
    CopyKind.HOST_TO_DEVICE: (False, True),
    CopyKind.DEVICE_TO_HOST: (True, False),
    CopyKind.DEVICE_TO_DEVICE: (True, True),
}


def test_double_info(library: ctypes.CDLL, prefix: str) -> str | None:
    """What a loaded runtime library says it is when it is phoenix's test double; None for a real one.

    An emulated runtime exports ``<prefix>PhoenixTestDouble()``; no real runtime does.
    """
    fn = getattr(library, f"{prefix}PhoenixTestDouble", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    raw = fn()
    return raw.decode(errors="replace") if raw else EMULATED_LABEL


test_double_info.__test__ = False  # a helper, not a test, when a test module imports it


def _loaded_path(handle: ctypes.CDLL, symbol: str) -> str | None:
    """The file the loader picked for a library opened by name (from /proc/self/maps)."""
    fn = getattr(handle, symbol, None)
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


def _root_of(library: str) -> str | None:
    """The installation a library file belongs to (``<root>/lib/libx.so``), as searched."""
    if os.sep not in library:
        return None
    lib_dir = os.path.dirname(os.path.abspath(library))  # the root searched, not where links lead
    return os.path.dirname(lib_dir) if os.path.basename(lib_dir) in ("lib", "lib64") else None


def _version(handle: ctypes.CDLL, symbol: str) -> int | None:
    fn = getattr(handle, symbol, None)
    if fn is None:
        return None
    value = ctypes.c_int()
    return value.value if fn(ctypes.byref(value)) == 0 else None


_probe_cache: dict = {}


class CudaLikeRuntime(PointerQueries, VendorRuntime):
    """Every contract operation over a CUDA-shaped runtime bound by the shim generator.

    A port declares the facts below; it overrides a method only where its runtime truly
    differs (NVIDIA: where its wheels put libcudart, its version rules). The hooks a port may override are
    :meth:`extra_library_places`, :meth:`check_runtime`, :meth:`device_name`,
    :meth:`device_memory`, :meth:`address_range` and :meth:`extra_protos`.
    """

    #: symbol prefix of the runtime (``cuda``, ``mc``, ``hip``, ...)
    prefix: str = "cuda"
    #: environment variables naming an installation root, searched in order
    #: (``MACA_PATH``, ``ROCM_PATH``); the library is ``<root>/<dir>/<name>``
    library_roots: tuple[str, ...] = ()
    #: the installation root searched after the variables (``/opt/maca``), or None
    default_root: str | None = None
    #: directories below a root that hold the library, in order
    library_dirs: tuple[str, ...] = ("lib", "lib64")
    #: what the runtime is called in a reason ("not MACA", "no HIP device")
    runtime_title: str = ""
    #: point an emulated runtime at the port through the first root variable (as an
    #: installation: the real search runs) rather than through ``PHX_<NAME>_LIBRARY``
    emulated_via_root: bool = False
    #: a runtime call ``(char *name, int len, int device)`` answering a device's name
    #: (HIP: ``DeviceGetName``, without the prefix); None: ``GetDeviceProperties``' name
    device_name_call: str | None = None
    #: a runtime call ``(size_t *bytes, int device)`` answering a device's memory size
    #: (HIP: ``DeviceTotalMem``); None: ``MemGetInfo`` on that device
    device_memory_call: str | None = None
    #: a runtime call ``(void **base, size_t *size, void *ptr)`` answering the allocation
    #: holding an address (HIP: ``MemGetAddressRange``); None: this port's record of the
    #: allocations it made (memory allocated elsewhere then reports size 0)
    address_range_call: str | None = None
    #: the driver library of a CUDA-shaped driver API the port also calls (NVIDIA:
    #: ``libcuda.so.1``, prefix :attr:`emulated_driver_prefix` ``cu``). It must initialize
    #: (``<p>Init``) for the probe to say usable; device names come from ``<p>DeviceGetName``
    #: and allocation ranges from ``<p>PointerGetAttribute``. A test double carrying those
    #: calls stands in for it; one without them leaves ranges unknown (size 0), said so.
    driver_library: str | None = None
    #: the pointer-attribute layout and memory-type numbers differ between the runtime's
    #: releases: measure them at the first pointer query (one device and one pinned
    #: allocation are queried). False: CUDA's (:attr:`pointer_attributes_type`).
    #: ``PHX_<NAME>_POINTER_ATTRIBUTES=type|memoryType|both`` forces a layout either way.
    calibrate_pointer_layout: bool = False
    #: copy-kind values of the runtime (CUDA's unless a runtime differs)
    copy_kinds = {
        CopyKind.HOST_TO_HOST: 0,
        CopyKind.HOST_TO_DEVICE: 1,
        CopyKind.DEVICE_TO_HOST: 2,
        CopyKind.DEVICE_TO_DEVICE: 3,
    }
    #: streams do not wait for the default stream (cudaStreamNonBlocking)
    stream_flags = 1
    #: flags of host registration (cudaHostRegisterPortable: usable from every device)
    host_register_flags = 1
    #: flags of the events the I/O core records (cudaEventDisableTiming: cheaper records)
    event_flags = 2
    #: the status of an event query before the stream reaches the record (cudaErrorNotReady; HIP's is equal)
    not_ready = 600
    #: the runtime's error numbers for the errors the port raises itself (CUDA's; HIP's are equal)
    invalid_value = INVALID_VALUE
    invalid_memcpy_direction = INVALID_MEMCPY_DIRECTION
    invalid_resource_handle = INVALID_RESOURCE_HANDLE
    pointer_attributes_type = PointerAttributes

    def __init__(self):
        probe = self.probe()
        if not probe.usable:
            raise VendorUnavailable(f"{self.name}: {probe.reason}")
        self.rt: Shim = self.bind()
        # reentrant: a signal handler that does I/O may query pointers while the interrupted
        # code holds them; made again in a forked child (_after_fork_in_child)
        self._lock = threading.RLock()
        self._streams: set[int] = set()  # created here, destroyed by close()
        # destroyed here and not handed out again: refused, since CUDA-shaped handles are
        # pointers and the runtime itself would crash on them
        self._destroyed: set[int] = set()
        self._host_ranges: dict[int, int] = {}  # pinned allocations and registrations made here
        self._dev_bases: list[int] = []  # sorted bases of the device allocations made here
        self._dev_sizes: dict[int, int] = {}  # base -> size
        self._layout_lock = threading.RLock()
        _live.add(self)
        self.pointer_layout: dict | None = None  # decided at the first pointer query
        self._memory_types = CUDA_MEMORY_TYPES
        self._type_field = "type"
        driver = probe.details.get("driver")
        self._drv = ctypes.CDLL(driver, mode=ctypes.RTLD_LOCAL) if driver else None
        if self._drv is not None:
            dp = self.emulated_driver_prefix
            getattr(self._drv, f"{dp}PointerGetAttribute").argtypes = [_p, _i, ctypes.c_uint64]
            getattr(self._drv, f"{dp}DeviceGetName").argtypes = [ctypes.c_char_p, _i, _i]
        self.emulated = probe.details.get("emulated")
        if self.emulated:  # the instance says so wherever it is reported (phx info, reports)
            self.is_test_double = True
            self.runtime_description = (
                f"{EMULATED_LABEL}: {self.library_names[0] if self.library_names else 'runtime'}"
                f" stand-in at {self.rt.library}, not {self._title()}"
            )

    # -- finding the library -------------------------------------------------------

    @classmethod
    def _title(cls) -> str:
        return cls.runtime_title or cls.name

    @classmethod
    def extra_library_places(cls) -> list[tuple[str, str]]:
        """(what, path) of places to try before the root variables (NVIDIA: the libcudart
        already loaded by torch or CuPy, the CUDA wheels). A test double found at one of
        them is passed over. Default: none."""
        return []

    @classmethod
    def library_places(cls) -> list[tuple[str, list[str] | None, bool]]:
        """Where the runtime is looked for, in order: (what, candidate files, explicit).

        Candidates are None when the variable is unset, bare file names for the loader's
        path. ``explicit`` places are the operator's choice: only there is a test double used.
        """
        env = cls.library_env()
        override = os.environ.get(env)
        if override:
            return [(f"${env}", [override], True)]
        places = [(what, [path], False) for what, path in cls.extra_library_places()]
        for var in cls.library_roots:
            root = os.environ.get(var)
            places += [
                (f"${var}/{d}", [os.path.join(root, d, n) for n in cls.library_names] if root else None, True)
                for d in cls.library_dirs
            ]
        for d in cls.library_dirs if cls.default_root else ():
            places.append(
                (
                    os.path.join(cls.default_root, d),
                    [os.path.join(cls.default_root, d, n) for n in cls.library_names],
                    False,
                )
            )
        places.append(("the loader's path (LD_LIBRARY_PATH, ld.so.cache)", list(cls.library_names), False))
        return places

    @classmethod
    def find_runtime(cls) -> tuple[str | None, ctypes.CDLL | None, list[str], str | None]:
        """(path, handle, what was seen at each place, test-double info) of the first runtime that loads."""
        looked: list[str] = []
        for what, paths, explicit in cls.library_places():
            if paths is None:
                looked.append(f"{what} (unset)")
                continue
            seen = len(looked)
            for path in paths:
                by_name = os.sep not in path
                if not by_name and not os.path.exists(path):
                    continue
                try:  # locally first: an emulator's names must never interpose on anything else
                    handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                except OSError as exc:
                    if not by_name:
                        looked.append(f"{what}: {path} cannot be loaded: {exc}")
                    continue
                if by_name:
                    path = _loaded_path(handle, f"{cls.prefix}GetDeviceCount") or path
                info = test_double_info(handle, cls.prefix)
                if info and not explicit:
                    looked.append(
                        f"{what}: {path} (a test double: used only through ${cls.library_env()} or a root variable)"
                    )
                    continue
                looked.append(f"{what}: {path} (found)")
                return path, handle, looked, info
            if len(looked) == seen and paths:
                looked.append(f"{what}: not found" if os.sep not in paths[0] else f"{what}: {paths[0]} (no such file)")
        return None, None, looked, None

    @classmethod
    def locate_library(cls) -> tuple[str | None, list[str]]:
        path, _, looked, _ = cls.find_runtime()
        return path, looked

    # -- the probe -----------------------------------------------------------------

    @classmethod
    def probe(cls) -> Probe:
        """Can this runtime serve here? Never raises; cached per search environment."""
        env = (cls.library_env(), *cls.library_roots, "LD_LIBRARY_PATH")
        key = (cls, tuple(os.environ.get(v) for v in env))
        if key not in _probe_cache:
            try:
                _probe_cache[key] = cls._probe()
            except (AttributeError, OSError, ValueError) as exc:  # whatever the file is, the probe answers
                _probe_cache[key] = Probe(False, f"probing the {cls._title()} runtime failed: {exc}")
        return _probe_cache[key]

    @classmethod
    def check_runtime(cls, handle: ctypes.CDLL, details: dict) -> str | None:
        """The port's own checks once the library is found (a driver, versions): why the
        vendor cannot serve, or None. ``details`` holds what was found (``library``,
        ``emulated``, ``runtime_version``, ``driver_version``); what the check adds to it is
        reported, and ``details["note"]`` is added to the reason. Default: no check."""
        return None

    @classmethod
    def _probe(cls) -> Probe:
        P, title = cls.prefix, cls._title()
        path, handle, looked, emulated = cls.find_runtime()
        details: dict = {"looked": looked}
        if handle is None:
            root = (
                f"set {cls.library_roots[0]} to it (or {cls.library_env()} to the library file)"
                if cls.library_roots
                else f"set {cls.library_env()} to the library file"
            )
            name = cls.library_names[0] if cls.library_names else f"the {title} runtime"
            return Probe(
                False, f"{name} not found; looked in: " + "; ".join(looked) + f". Install {title} or {root}", details
            )
        details.update(
            library=path,
            root=_root_of(path),
            emulated=emulated,
            runtime_version=_version(handle, f"{P}RuntimeGetVersion"),
            driver_version=_version(handle, f"{P}DriverGetVersion"),
        )
        count_fn = getattr(handle, f"{P}GetDeviceCount", None)
        if count_fn is None:
            return Probe(False, f"{path} has no {P}GetDeviceCount: not the {title} runtime library", details)
        why = cls._check_driver(handle, details) or cls.check_runtime(handle, details)
        if why:
            return Probe(False, why, details)
        count = ctypes.c_int()
        rc = count_fn(ctypes.byref(count))
        details["devices"] = count.value
        if rc != 0 or count.value <= 0:
            return Probe(
                False,
                f"{path} finds no {title} device ({P}GetDeviceCount returned {rc}, count "
                f"{count.value}): is the driver loaded, and are its device nodes accessible?",
                details,
            )
        note = f", {details['note']}" if details.get("note") else ""
        if emulated:
            return Probe(
                True, f"{EMULATED_LABEL} at {path}: {count.value} device(s){note}; not {title} ({emulated})", details
            )
        return Probe(
            True,
            f"{count.value} device(s), {title} runtime {details['runtime_version']}, driver "
            f"{details['driver_version']}{note} ({path})",
            details,
        )

    @classmethod
    def _check_driver(cls, handle: ctypes.CDLL, details: dict) -> str | None:
        """The declared driver API initializes (an emulated runtime's own stands in for it)."""
        dp = cls.emulated_driver_prefix
        if not (cls.driver_library and dp):
            return None
        emulated = details["emulated"]
        if emulated and not hasattr(handle, f"{dp}Init"):
            details.update(
                driver=None, note="WITHOUT a driver API: device names from the runtime, allocation ranges unknown"
            )
            return None
        driver = details["library"] if emulated else cls.driver_library
        try:
            drv = ctypes.CDLL(driver, mode=ctypes.RTLD_LOCAL)
        except OSError:
            return f"no {cls._title()} driver: {driver} is not on the loader path"
        rc = getattr(drv, f"{dp}Init")(0)
        if rc != 0:
            name = ctypes.c_char_p()
            if getattr(drv, f"{dp}GetErrorName", lambda *a: 1)(rc, ctypes.byref(name)) != 0:
                name.value = b"see the driver's header"
            return f"the {cls._title()} driver does not initialize: {dp}Init returned {rc} ({name.value.decode()})"
        details.update(driver=driver, note="with its driver API" if emulated else "")
        return None

    @classmethod
    def emulated_env(cls, emulator) -> dict[str, str | None]:
        if cls.emulated_via_root and cls.library_roots:  # found as an installation, as the real one is
            return {cls.library_roots[0]: emulator.root, cls.library_env(): None}
        return super().emulated_env(emulator)

    @classmethod
    def pointer_layout_env(cls) -> str:
        """``PHX_<NAME>_POINTER_ATTRIBUTES``: forces the pointer-attribute layout (type | memoryType | both)."""
        return library_env_var(cls.name or cls.__name__).removesuffix("_LIBRARY") + "_POINTER_ATTRIBUTES"

    # -- binding -------------------------------------------------------------------

    def library_path(self) -> str:
        """Path (or loader name) of the runtime library the probe found."""
        return self.probe().details["library"]

    @classmethod
    def extra_protos(cls) -> list[Proto]:
        """Rows beyond :func:`phoenix.shim.cuda_shaped_protos`: the declared calls (names,
        sizes, ranges). A port calling more of its runtime adds rows here."""
        P, sz, vp = cls.prefix, ctypes.c_size_t, ctypes.c_void_p
        rows = []
        if cls.device_name_call:
            rows.append(Proto(f"{P}{cls.device_name_call}", _i, [ctypes.c_char_p, _i, _i], pyname="device_name_call"))
        if cls.device_memory_call:
            rows.append(
                Proto(f"{P}{cls.device_memory_call}", _i, [ctypes.POINTER(sz), _i], pyname="device_memory_call")
            )
        if cls.address_range_call:
            rows.append(
                Proto(
                    f"{P}{cls.address_range_call}",
                    _i,
                    [ctypes.POINTER(vp), ctypes.POINTER(sz), vp],
                    pyname="address_range_call",
                )
            )
        return rows

    @classmethod
    def prototype_table(cls) -> list[Proto]:
        try:
            extra = cls.extra_protos()
        except TypeError:  # a port of an older phoenix: extra_protos(self)
            extra = cls.extra_protos(object.__new__(cls))
        return cuda_shaped_protos(cls.prefix) + list(extra)

    def bind(self) -> Shim:
        """Load the runtime library through the shim generator: locally for a test double."""
        P = self.prefix
        mode = ctypes.RTLD_LOCAL if self.probe().details.get("emulated") else ctypes.RTLD_GLOBAL
        return load_shim(
            self.name,
            self.library_path(),
            cuda_shaped_protos(P) + list(self.extra_protos()),
            prefix=P,
            error_name=f"{P}GetErrorName",
            error_string=f"{P}GetErrorString",
            mode=mode,
        )

    # -- what differs between runtimes -----------------------------------------------

    def device_name(self, ordinal: int) -> str:
        """The declared name call, else ``GetDeviceProperties``' ``name`` (offset 0 in every runtime)."""
        buf = ctypes.create_string_buffer(_PROPS_BYTES if not self.device_name_call else 256)
        if (
            self._drv is not None
            and getattr(self._drv, f"{self.emulated_driver_prefix}DeviceGetName")(buf, 256, ordinal) == 0
        ):
            return buf.value.decode(errors="replace")
        if self.device_name_call:
            self.rt.device_name_call(buf, 256, ordinal)
        elif self.rt.has(f"{self.prefix}GetDeviceProperties"):
            self.rt.get_device_properties(buf, ordinal)
        name = buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace").strip()
        return name or f"{self.name} device {ordinal}"

    def device_memory(self, ordinal: int) -> int:
        """The declared size call, else ``MemGetInfo``'s total on that device."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self.device_memory_call:
            self.rt.device_memory_call(ctypes.byref(total), ordinal)
            return total.value
        with self._on_device(ordinal):
            self.rt.mem_get_info(ctypes.byref(free), ctypes.byref(total))
        return total.value

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        """(base, size) of the allocation or registration containing ``ptr``, or None."""
        if self.address_range_call:
            base, size = ctypes.c_void_p(), ctypes.c_size_t()
            try:
                self.rt.address_range_call(ctypes.byref(base), ctypes.byref(size), ctypes.c_void_p(ptr))
            except VendorError:
                return None
            return base.value or 0, size.value
        if self.driver_library:  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR (11) and _SIZE (12)
            start, size = ctypes.c_uint64(), ctypes.c_size_t()
            query = getattr(self._drv, f"{self.emulated_driver_prefix}PointerGetAttribute", None)
            if query is None or query(ctypes.byref(start), 11, ptr) != 0 or query(ctypes.byref(size), 12, ptr) != 0:
                return None  # no driver API (a test double without one): unknown, never made up
            return start.value, size.value
        with self._lock:
            i = bisect.bisect_right(self._dev_bases, ptr) - 1
            if i >= 0:
                base = self._dev_bases[i]
                if ptr < base + self._dev_sizes[base]:
                    return base, self._dev_sizes[base]
        return None

    # -- helpers -----------------------------------------------------------------

    @contextlib.contextmanager
    def _on_device(self, device: int):
        """Make ``device`` current for a call, as CUDA allocates on the current device."""
        prev = ctypes.c_int()
        self.rt.get_device(ctypes.byref(prev))
        if prev.value != device:
            self.rt.set_device(device)
        try:
            yield
        finally:
            if prev.value != device:
                self.rt.set_device(prev.value)

    def _refuse_null(self, call: str, ptr: int) -> None:
        if not ptr:  # CUDA's Free(NULL) succeeds; the contract says NULL is no allocation
            self.rt.raise_for(f"{self.prefix}{call}", self.invalid_value)

    def _refuse_zero(self, call: str, size: int) -> None:
        # CUDA's Malloc(0) succeeds with NULL; the contract says zero is an error. A size
        # past 2**63-1 would wrap in the size_t the runtime takes (and be recorded unwrapped).
        try:
            n = operator.index(size)
        except TypeError:
            n = 0
        if isinstance(size, bool) or n <= 0 or n > I64_MAX:
            self.rt.raise_for(f"{self.prefix}{call}", self.invalid_value)

    def _live_stream(self, call: str, stream: int) -> ctypes.c_void_p:
        if stream in self._destroyed:
            self.rt.raise_for(f"{self.prefix}{call}", self.invalid_resource_handle)
        return ctypes.c_void_p(stream)

    @property
    def stream_handles_validated(self) -> bool:
        """Whether made-up stream handles are refused: only by test-double runtimes (CUDA's are pointers)."""
        return self.is_test_double

    # -- discovery ---------------------------------------------------------------

    def devices(self) -> list[Device]:
        count = ctypes.c_int()
        self.rt.get_device_count(ctypes.byref(count))
        out = []
        for i in range(count.value):
            bus = ctypes.create_string_buffer(64)
            self.rt.device_get_pci_bus_id(bus, len(bus), i)
            out.append(Device(i, self.device_name(i), bus.value.decode(), self.device_memory(i)))
        return out

    def set_device(self, ordinal: int) -> None:
        self.rt.set_device(int(ordinal))

    # -- device memory -----------------------------------------------------------

    def device_alloc(self, size: int, device: int = 0) -> int:
        self._refuse_zero("Malloc", size)
        ptr = ctypes.c_void_p()
        with self._on_device(device):
            self.rt.malloc(ctypes.byref(ptr), ctypes.c_size_t(size))
        with self._lock:  # the record behind address_range when the runtime has no range query
            bisect.insort(self._dev_bases, ptr.value)
            self._dev_sizes[ptr.value] = size
        return ptr.value

    def device_free(self, ptr: int) -> None:
        self._refuse_null("Free", ptr)
        self.rt.free(ctypes.c_void_p(ptr))
        with self._lock:
            if self._dev_sizes.pop(ptr, None) is not None:
                del self._dev_bases[bisect.bisect_left(self._dev_bases, ptr)]

    # -- host memory -------------------------------------------------------------

    def host_register(self, ptr: int, size: int) -> None:
        self._refuse_zero("HostRegister", size)
        self._refuse_null("HostRegister", ptr)
        self.rt.host_register(ctypes.c_void_p(ptr), ctypes.c_size_t(size), self.host_register_flags)
        with self._lock:
            self._host_ranges[ptr] = size

    def host_unregister(self, ptr: int) -> None:
        self.rt.host_unregister(ctypes.c_void_p(ptr))
        with self._lock:
            self._host_ranges.pop(ptr, None)

    def host_alloc_pinned(self, size: int) -> int:
        self._refuse_zero("MallocHost", size)
        ptr = ctypes.c_void_p()
        self.rt.malloc_host(ctypes.byref(ptr), ctypes.c_size_t(size))
        with self._lock:
            self._host_ranges[ptr.value] = size
        return ptr.value

    def host_free_pinned(self, ptr: int) -> None:
        self._refuse_null("FreeHost", ptr)
        self.rt.free_host(ctypes.c_void_p(ptr))
        with self._lock:
            self._host_ranges.pop(ptr, None)

    # -- copies ------------------------------------------------------------------

    def _check_copy(self, call: str, dst: int, src: int, size: int, kind: CopyKind) -> None:
        """Refuse a copy whose pointers are not of its kind's memory types, or whose device
        extent runs past its allocation: with unified addressing CUDA infers the direction
        and copies anyway (a freed or host pointer named as device memory included). The
        same check runs on a test double as on hardware.

        Device memory named as host memory, or pinned host memory named as device memory, is
        a wrong direction; any other pointer named as device memory is no live allocation
        (freed, never allocated, pageable: a pointer query cannot tell these apart), an
        invalid value, as is an extent running past its allocation.
        """
        if size <= 0:
            return
        sides = [
            (ptr, want, self.pointer_info(ptr))
            for ptr, want in zip((src, dst), _DEVICE_SIDES[CopyKind(kind)], strict=True)
        ]
        for _, want_device, info in sides:
            if (info.type is MemoryType.DEVICE) != want_device and info.type is not MemoryType.HOST:
                self.rt.raise_for(f"{self.prefix}{call}", self.invalid_memcpy_direction)
        for ptr, want_device, info in sides:
            if want_device and (info.type is not MemoryType.DEVICE or info.size and ptr + size > info.base + info.size):
                self.rt.raise_for(f"{self.prefix}{call}", self.invalid_value)

    def memcpy(self, dst: int, src: int, size: int, kind: CopyKind) -> None:
        self._check_copy("Memcpy", dst, src, size, kind)
        self.rt.memcpy(
            ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size), self.copy_kinds[CopyKind(kind)]
        )

    def memcpy_async(self, dst: int, src: int, size: int, kind: CopyKind, stream: int) -> None:
        self._check_copy("MemcpyAsync", dst, src, size, kind)
        self.rt.memcpy_async(
            ctypes.c_void_p(dst),
            ctypes.c_void_p(src),
            ctypes.c_size_t(size),
            self.copy_kinds[CopyKind(kind)],
            self._live_stream("MemcpyAsync", stream),
        )

    # -- streams -----------------------------------------------------------------

    def stream_create(self, device: int = 0) -> int:
        stream = ctypes.c_void_p()
        with self._on_device(device):
            self.rt.stream_create_with_flags(ctypes.byref(stream), self.stream_flags)
        with self._lock:
            self._streams.add(stream.value)
            self._destroyed.discard(stream.value)
        return stream.value

    def stream_synchronize(self, stream: int) -> None:
        self.rt.stream_synchronize(self._live_stream("StreamSynchronize", stream))

    def stream_destroy(self, stream: int) -> None:
        self.rt.stream_destroy(self._live_stream("StreamDestroy", stream))
        with self._lock:
            self._streams.discard(stream)
            if stream:
                self._destroyed.add(stream)

    def launch_host_func(self, stream: int, fn: int, arg: int) -> None:
        if not fn:
            self.rt.raise_for(f"{self.prefix}LaunchHostFunc", self.invalid_value)
        self.rt.launch_host_func(self._live_stream("LaunchHostFunc", stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))

    # -- data path ---------------------------------------------------------------

    def data_path(self) -> DataPathTable:
        # The runtime's own C functions: the I/O core calls them from its threads, no GIL.
        P, addr, k = self.prefix, self.rt.address, self.copy_kinds
        return DataPathTable(
            abi_version=DATA_PATH_ABI,
            success=0,
            kind_h2h=k[CopyKind.HOST_TO_HOST],
            kind_h2d=k[CopyKind.HOST_TO_DEVICE],
            kind_d2h=k[CopyKind.DEVICE_TO_HOST],
            kind_d2d=k[CopyKind.DEVICE_TO_DEVICE],
            stream_flags=self.stream_flags,
            host_register_read_only=self.host_register_read_only_flag,
            host_register_flags=self.host_register_flags,
            set_device=addr(f"{P}SetDevice"),
            memcpy_async=addr(f"{P}MemcpyAsync"),
            stream_create=addr(f"{P}StreamCreateWithFlags"),
            stream_synchronize=addr(f"{P}StreamSynchronize"),
            stream_destroy=addr(f"{P}StreamDestroy"),
            launch_host_func=addr(f"{P}LaunchHostFunc"),
            host_register=addr(f"{P}HostRegister"),
            host_unregister=addr(f"{P}HostUnregister"),
            # ordering with the caller's stream: all of them, or none (a runtime without
            # events is synchronized instead; DataPathTable says how)
            **self._event_entries(),
        )

    def _event_entries(self) -> dict:
        P, h = self.prefix, self.rt.handle
        names = {
            "get_device": f"{P}GetDevice",
            "event_create": f"{P}EventCreateWithFlags",
            "event_record": f"{P}EventRecord",
            "stream_wait_event": f"{P}StreamWaitEvent",
            "event_synchronize": f"{P}EventSynchronize",
            "event_destroy": f"{P}EventDestroy",
        }
        if not all(hasattr(h, sym) for sym in names.values()):
            return {}
        out = {"event_flags": self.event_flags, **{field: self.rt.address(sym) for field, sym in names.items()}}
        if hasattr(h, f"{P}EventQuery"):  # completion by polling (optional)
            out.update(not_ready=self.not_ready, event_query=self.rt.address(f"{P}EventQuery"))
        return out

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, set()
        for stream in streams:
            with contextlib.suppress(VendorError):  # already destroyed elsewhere
                self.rt.stream_destroy(ctypes.c_void_p(stream))


#: every CUDA-shaped runtime made in this process (their locks are made again after fork)
_live: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for rt in list(_live):  # (a thread of the parent may have held them at the fork)
        rt._lock = threading.RLock()
        rt._layout_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
