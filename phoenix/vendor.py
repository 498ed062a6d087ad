"""The vendor contract, userspace side: what ``vendors/<name>/runtime.py`` implements.

Core side, control plane. A port subclasses :class:`VendorRuntime` in its ``runtime.py`` and
exposes it as ``Runtime``. Every operation below has its contract in its docstring:
what it must do and what it raises. An operation a port leaves out raises
:class:`~phoenix.errors.VendorNotImplemented` naming the operation and the file to
fill, so the conformance suite reports it as failing with a pointer to the place.

Three rules hold for every port:

* Addresses are plain integers (``int``), device or host; handles (streams) are
  integers too (the runtime's ``cudaStream_t`` value, 0 for the default stream).
* Failures raise :class:`~phoenix.errors.VendorError` with the runtime's error name
  and message (the generated shim does this for every call).
* :meth:`VendorRuntime.data_path` returns raw C function pointers: the C I/O core
  calls them from its own threads without the GIL, so they must be the runtime
  library's functions (or C functions of the port), never Python callbacks.

The kernel side of the contract is declared in ``kernel/phx_p2p.h``.
"""

from __future__ import annotations

import ctypes
import enum
import fractions
import inspect
import os
import re
from dataclasses import dataclass, field

from .checks import I64_MAX
from .errors import VendorNotImplemented

#: Version of the :class:`DataPathTable` layout; bumped on any change to it.
DATA_PATH_ABI = 3

#: What a test-double runtime is called wherever it shows (probe reasons, reports, phx info).
#: Defined here, on the core side, so a port labels an emulator without importing the
#: emulator's builder (``phoenix.emulator`` imports it from here).
EMULATED_LABEL = "emulated runtime (test double)"


def library_env_var(vendor: str) -> str:
    """``PHX_<NAME>_LIBRARY``: the variable every port honours to load one exact runtime library."""
    return "PHX_" + re.sub(r"[^A-Za-z0-9]", "_", vendor).upper() + "_LIBRARY"


class CopyKind(enum.IntEnum):
    """Typed copy directions (numerically CUDA's; a port maps them if its differ)."""

    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3


class MemoryType(enum.Enum):
    """What a pointer query says an address is."""

    HOST = "host"  #: ordinary pageable host memory, unknown to the runtime
    HOST_PINNED = "host_pinned"  #: host memory allocated pinned or registered
    DEVICE = "device"  #: device memory of one device


@dataclass(frozen=True)
class Probe:
    """The answer of :meth:`VendorRuntime.probe`: can this vendor serve here?"""

    usable: bool
    reason: str  #: why not (or what was found, when usable)
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Device:
    ordinal: int
    name: str
    pci_bus_id: str  #: ``dddd:bb:dd.f``
    total_memory: int  #: bytes


@dataclass(frozen=True)
class PointerInfo:
    type: MemoryType
    device: int | None  #: device ordinal for device memory (and pinned memory a runtime ties to one)
    base: int  #: base address of the allocation or registration holding the pointer
    size: int  #: size of that allocation or registration (0 when unknown: pageable memory)


#: C signature of a stream host callback: ``void fn(void *arg)``.
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DataPathTable(ctypes.Structure):
    """Raw C entry points the I/O core calls without the GIL (``phoenix/csrc/phx_vendor.h``).

    Signatures are the CUDA runtime's; a CUDA-shaped runtime fills the table with
    its own symbols. Every function returns the runtime's status (``success`` means ok).

    :data:`REQUIRED` entries must all be there. The :data:`EVENTS` group orders I/O with
    the caller's stream (the rule in :mod:`phoenix.io`) and is all or nothing:

    * ``event_create(&ev, event_flags)`` makes an event on the current device;
      ``event_record(ev, stream)`` marks the point "now" of ``stream`` (0: the current
      device's default stream); ``event_synchronize(ev)`` blocks until the stream has
      passed the latest record; ``event_destroy(ev)`` frees it (records in flight may
      still complete). ``stream_wait_event(stream, ev, 0)`` makes work queued on
      ``stream`` afterwards wait for the latest record of ``ev`` (of any stream and
      device). ``get_device(&ordinal)`` is the calling thread's current device.
    * With them, an I/O call on device memory records an event on the caller's stream;
      phoenix's worker streams wait for it before their copies, and memory the CPU or
      the disk writes directly waits for it on the host. Without them, phoenix
      synchronizes the caller's stream before it submits (correct, but the caller's
      thread waits for all its queued work first); ``phx info`` says which.
    * ``event_query(ev)`` (optional, with the events; ``not_ready`` is its status before
      the stream reaches the record): phoenix's io_uring workers record an event after
      their copies and query it between I/Os, instead of a host callback per batch of
      copies (a callback costs the runtime's callback thread tens of microseconds).
      Without it they launch host callbacks.
    """

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("success", ctypes.c_int),
        ("kind_h2h", ctypes.c_int),
        ("kind_h2d", ctypes.c_int),
        ("kind_d2h", ctypes.c_int),
        ("kind_d2d", ctypes.c_int),
        ("stream_flags", ctypes.c_uint),  # flags for stream_create (non-blocking)
        ("host_register_flags", ctypes.c_uint),
        # int set_device(int ordinal)
        ("set_device", ctypes.c_void_p),
        # int memcpy_async(void *dst, const void *src, size_t n, int kind, void *stream)
        ("memcpy_async", ctypes.c_void_p),
        # int stream_create(void **stream, unsigned flags)
        ("stream_create", ctypes.c_void_p),
        # int stream_synchronize(void *stream)
        ("stream_synchronize", ctypes.c_void_p),
        # int stream_destroy(void *stream)
        ("stream_destroy", ctypes.c_void_p),
        # int launch_host_func(void *stream, void (*fn)(void *), void *arg)
        ("launch_host_func", ctypes.c_void_p),
        # int host_register(void *ptr, size_t n, unsigned flags)
        ("host_register", ctypes.c_void_p),
        # int host_unregister(void *ptr)
        ("host_unregister", ctypes.c_void_p),
        ("event_flags", ctypes.c_uint),  # flags for event_create (CUDA: 2, no timing)
        # the runtime's read-only registration flag: the core retries a refused
        # registration without it
        ("host_register_read_only", ctypes.c_uint),
        # int get_device(int *ordinal)
        ("get_device", ctypes.c_void_p),
        # int event_create(void **event, unsigned flags)
        ("event_create", ctypes.c_void_p),
        # int event_record(void *event, void *stream)
        ("event_record", ctypes.c_void_p),
        # int stream_wait_event(void *stream, void *event, unsigned flags)
        ("stream_wait_event", ctypes.c_void_p),
        # int event_synchronize(void *event)
        ("event_synchronize", ctypes.c_void_p),
        # int event_destroy(void *event)
        ("event_destroy", ctypes.c_void_p),
        # the status event_query returns before the stream reaches the record (CUDA, HIP: 600)
        ("not_ready", ctypes.c_int),
        # int event_query(void *event): success once the stream passed the latest record
        ("event_query", ctypes.c_void_p),
    ]

    REQUIRED = (
        "set_device",
        "memcpy_async",
        "stream_create",
        "stream_synchronize",
        "stream_destroy",
        "launch_host_func",
        "host_register",
        "host_unregister",
    )

    #: ordering with the caller's stream by events (optional, all or none)
    EVENTS = ("get_device", "event_create", "event_record", "stream_wait_event", "event_synchronize", "event_destroy")

    def missing(self) -> list[str]:
        """Names of the required entry points left NULL."""
        return [name for name in self.REQUIRED if not getattr(self, name)]

    def missing_events(self) -> list[str]:
        """Names of the :data:`EVENTS` entry points left NULL (all of them: no events)."""
        return [name for name in self.EVENTS if not getattr(self, name)]

    def ordering(self) -> str:
        """How I/O on device memory is ordered with the caller's stream, in words."""
        gone = self.missing_events()
        if not gone:
            return (
                "events: an event recorded on the caller's stream; phoenix's copy streams wait for it "
                "(stream_wait_event), direct I/O waits for it on the host"
            )
        if len(gone) == len(self.EVENTS):
            return (
                "synchronizing: the vendor has no events, so the caller's stream is synchronized "
                "before each I/O call on device memory (correct, but the caller waits for its queued work)"
            )
        return f"synchronizing: the vendor's events are incomplete (missing {', '.join(gone)})"


def _not_implemented(obj, op: str):
    """The error a port's missing operation raises, pointing at where to fill it."""
    try:
        where = inspect.getsourcefile(type(obj)) or "?"
    except TypeError:
        where = "?"
    raise VendorNotImplemented(
        f"vendor {getattr(obj, 'name', '?')!r} does not implement {op}(): "
        f"fill it in {where} (class {type(obj).__name__}; contract in phoenix/vendor.py)"
    )


class VendorRuntime:
    """Base class of a port's ``Runtime``: the userspace half of the vendor contract.

    Subclasses set :attr:`name` and :attr:`p2p_page_size` and implement the
    operations. The constructor may assume :meth:`probe` said usable; it raises
    :class:`~phoenix.errors.VendorUnavailable` otherwise.
    """

    #: vendor name, equal to its directory name (``vendors/<name>/``)
    name: str = ""
    #: P2P page size in bytes; must equal the kernel side's (64 KiB on NVIDIA and MetaX)
    p2p_page_size: int = 65536
    #: True for test doubles (the host vendor, emulated runtimes): reports say so
    is_test_double: bool = False
    #: short description of the runtime the port binds (shown by ``phx info``)
    runtime_description: str = ""

    # -- declared facts and hooks: read by the registry, the settings, ``phx-port`` and the
    # emulator. Every one has a default here, so nothing outside a port guesses at its names.

    #: ``PHX_VENDOR=auto`` probes the vendors of highest priority first (NVIDIA 100, AMD 90,
    #: MetaX 80); 0 means auto never picks this vendor (the ``host`` fallback aside): a new
    #: port stays at 0 until it passes ``phx-port test`` on its hardware
    auto_priority: int = 0
    #: the runtime's flag for registering host memory the device only reads
    #: (``cudaHostRegisterReadOnly`` = 8, ``hipHostRegisterReadOnly`` = 8); 0: the runtime has none
    #: flags host_register passes to the runtime (CUDA-shaped: 1, portable)
    host_register_flags: int = 0
    host_register_read_only_flag: int = 0
    #: symbol prefix of a CUDA-shaped runtime (``cuda``, ``mc``, ``hip``); None: the runtime is
    #: not CUDA-shaped, so no emulated runtime can stand in for it (``phx-port test --emulated``)
    prefix: str | None = None
    #: file names of the runtime library, most preferred first; the first is also the file an
    #: emulated runtime is built as
    library_names: tuple[str, ...] = ()
    #: prefix of a driver API the port calls besides the runtime (NVIDIA: ``cu`` for libcuda);
    #: an emulated runtime built for this port exports it too. None: no driver API
    emulated_driver_prefix: str | None = None
    #: whether the runtime refuses a made-up stream handle with an error; CUDA's handles are
    #: pointers it dereferences, so only test doubles do, and the suite checks it only then
    stream_handles_validated: bool = True

    @classmethod
    def library_env(cls) -> str:
        """The variable naming one exact runtime library to load instead of searching
        (``PHX_<NAME>_LIBRARY``). A port must honour it: it is how an operator picks a
        library, and how ``phx-port test --emulated`` points the port at an emulator."""
        return library_env_var(cls.name or cls.__name__)

    @classmethod
    def emulated_env(cls, emulator) -> dict[str, str | None]:
        """The environment that points this port at ``emulator`` (a
        :class:`phoenix.emulator.Emulator`: ``.library`` the file, ``.root`` its installation,
        ``lib/`` below it). ``None`` as a value unsets that variable. Default:
        :meth:`library_env` set to the emulator's library."""
        return {cls.library_env(): emulator.library}

    @classmethod
    def locate_library(cls) -> tuple[str | None, list[str]]:
        """(the runtime library this port would load, or None; every place looked, in words).

        Must not raise. ``phx-port check`` resolves :meth:`prototype_table` in that library.
        Default: :meth:`library_env` when set, else the first of :attr:`library_names` on
        the loader's path.
        """
        from .shim import find_library

        override = os.environ.get(cls.library_env())
        if override:
            return (override if os.path.exists(override) else None), [f"${cls.library_env()}: {override}"]
        if not cls.library_names:
            return None, ["(the port names no library: library_names)"]
        return find_library(cls.library_names)

    @classmethod
    def prototype_table(cls) -> list:
        """Every :class:`phoenix.shim.Proto` row this port binds (what ``phx-port check``
        resolves against the library). Default: none, nothing to resolve."""
        return []

    # -- discovery ---------------------------------------------------------------

    @classmethod
    def probe(cls) -> Probe:
        """Say whether this vendor can serve on this machine, and if not, precisely why.

        Must not raise and must be cheap enough to run for every vendor on
        ``PHX_VENDOR=auto``: find the runtime library, check there is a driver and
        at least one device, check versions. ``Probe(False, "no libcudart found in
        ...")`` is the expected answer on a machine without the hardware.
        """
        return Probe(False, f"{cls.__name__}.probe() is not implemented")

    def devices(self) -> list[Device]:
        """List the devices: ordinal (0..n-1), name, PCI bus id, memory size in bytes.

        Raises VendorError if the runtime fails; returns at least one device when
        the probe said usable.
        """
        _not_implemented(self, "devices")

    def set_device(self, ordinal: int) -> None:
        """Make ``ordinal`` the calling thread's current device (``cudaSetDevice``).

        Raises VendorError (invalid device) for an ordinal out of range.
        """
        _not_implemented(self, "set_device")

    # -- device memory -----------------------------------------------------------

    def device_alloc(self, size: int, device: int = 0) -> int:
        """Allocate ``size`` bytes of device memory on ``device``; return its address.

        The address is aligned to at least 256 bytes. Raises VendorError for a zero
        size, for a size the device cannot hold (out of memory), or a bad ordinal.
        """
        _not_implemented(self, "device_alloc")

    def device_free(self, ptr: int) -> None:
        """Free device memory returned by :meth:`device_alloc`.

        Raises VendorError for an address that is not the base of a live allocation
        (never allocated, already freed: a double free is an error, not a no-op).
        """
        _not_implemented(self, "device_free")

    # -- host memory -------------------------------------------------------------

    def host_register(self, ptr: int, size: int) -> None:
        """Pin (page-lock) existing host memory so the device can DMA to and from it.

        Raises VendorError for a zero size, a range already registered, or memory
        that cannot be pinned.
        """
        _not_implemented(self, "host_register")

    def host_unregister(self, ptr: int) -> None:
        """Undo :meth:`host_register` of the range starting at ``ptr``.

        Raises VendorError if ``ptr`` is not the base of a registered range.
        """
        _not_implemented(self, "host_unregister")

    def host_alloc_pinned(self, size: int) -> int:
        """Allocate ``size`` bytes of pinned host memory; return its address.

        Raises VendorError for a zero size or when the memory cannot be had.
        """
        _not_implemented(self, "host_alloc_pinned")

    def host_free_pinned(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc_pinned`; a second free raises VendorError."""
        _not_implemented(self, "host_free_pinned")

    # -- copies ------------------------------------------------------------------

    def memcpy(self, dst: int, src: int, size: int, kind: CopyKind) -> None:
        """Copy ``size`` bytes synchronously in direction ``kind``; returns when done.

        Must check that the pointers are of the kind's memory types and raise
        VendorError (invalid value / invalid memcpy direction) otherwise; an
        invalid or freed device pointer is an error, never a stray access.
        ``size == 0`` is a no-op.
        """
        _not_implemented(self, "memcpy")

    def memcpy_async(self, dst: int, src: int, size: int, kind: CopyKind, stream: int) -> None:
        """Queue a copy on ``stream``; it runs after all work queued there before it.

        Argument errors are raised at once (VendorError); the copy itself completes
        by :meth:`stream_synchronize`. The source must stay valid until then.
        """
        _not_implemented(self, "memcpy_async")

    # -- streams -----------------------------------------------------------------

    def stream_create(self, device: int = 0) -> int:
        """Create a stream on ``device`` (non-blocking w.r.t. the default stream).

        Returns a non-zero handle. Raises VendorError on failure or a bad ordinal.
        """
        _not_implemented(self, "stream_create")

    def stream_synchronize(self, stream: int) -> None:
        """Block until all work queued on ``stream`` has finished.

        Raises VendorError for an invalid (e.g. destroyed) stream, or the error of
        work that failed on it.
        """
        _not_implemented(self, "stream_synchronize")

    def stream_destroy(self, stream: int) -> None:
        """Destroy a stream after its queued work completes; a second destroy raises."""
        _not_implemented(self, "stream_destroy")

    def launch_host_func(self, stream: int, fn: int, arg: int) -> None:
        """Queue the C function pointer ``fn(arg)`` on ``stream`` (the LaunchHostFunc primitive).

        ``fn`` runs after all work queued before it has completed, and work queued
        after it does not start until ``fn`` returns. It runs on a runtime thread
        and must not call the runtime. Raises VendorError for a bad stream or NULL fn.
        """
        _not_implemented(self, "launch_host_func")

    # -- pointer queries ---------------------------------------------------------

    def pointer_info(self, ptr: int) -> PointerInfo:
        """Say what ``ptr`` is: device memory (which device), pinned host, or plain host.

        For device memory and pinned or registered host memory, ``base`` and
        ``size`` are those of the allocation or registration containing ``ptr``.
        Plain host memory gives ``MemoryType.HOST`` with base ``ptr`` and size 0.
        A freed device pointer is not device memory any more.
        """
        _not_implemented(self, "pointer_info")

    # -- data path ---------------------------------------------------------------

    def data_path(self) -> DataPathTable:
        """Return the raw C entry points the I/O core calls without the GIL.

        Every REQUIRED field must be a C function of the runtime library (or of
        the port's own compiled code), never a Python callback. The EVENTS group
        (optional, all or none) orders I/O with the caller's stream; without it the
        core synchronizes the caller's stream instead (see :class:`DataPathTable`).
        """
        _not_implemented(self, "data_path")

    def direct_capable(self, ptr: int, size: int) -> tuple[bool, str]:
        """Can the host CPU and the kernel address device memory at ``ptr`` directly?

        True when a plain user address maps the device memory (so O_DIRECT reads
        may land in it): the host vendor's arena today, P2P-mapped memory through
        the kernel module later. Returns (answer, reason).
        """
        return False, f"vendor {self.name!r} has no direct (P2P-mapped) path without the kernel module"

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Release what the runtime object holds (streams it created, pools). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment, with a clear error for a bad value."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse_size(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer or size (e.g. 4, 64K, 16M, 2G)") from None


class SizeTooLarge(ValueError):
    """parse_size: a size past 2**63-1 bytes."""


def parse_size(text: str | int) -> int:
    """Parse ``"16M"``, ``"2G"``, ``"4096"``, ``"64KiB"`` into bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    s = s.replace("_", "")  # 1_000 (as float() took it)
    m = re.fullmatch(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:E([+-]?[0-9]+))?", s)
    if not m or (m.group(1) and abs(int(m.group(1))) > 30):
        raise ValueError(f"bad size {text!r}")  # (an exponent past 30: no size, and 10**N is slow to make)
    value = fractions.Fraction(s) * mult  # exact: no float rounding past 2**53
    if value.denominator != 1:
        raise ValueError(f"bad size {text!r}: not a whole number of bytes")
    if value > I64_MAX:
        raise SizeTooLarge(f"bad size {text!r}: past 2**63-1 bytes")
    return int(value)
