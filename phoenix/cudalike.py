"""A vendor runtime over any CUDA-shaped C runtime (``cuda*``, ``mc*``, ``hip*``, ``musa*``, ``phxh*``).

Control plane. Most accelerator runtimes are the CUDA runtime with another symbol
prefix. :class:`CudaLikeRuntime` implements every operation of
:class:`phoenix.vendor.VendorRuntime` over the generated shim of such a runtime, so a
CUDA-shaped port is a small subclass: the prefix, where the library is, a probe, and
whatever differs (pointer-attribute layout, address-range query). Ports whose
runtime is not CUDA-shaped subclass ``VendorRuntime`` directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

from .errors import VendorError, VendorUnavailable
from .shim import Proto, Shim, cuda_shaped_protos, load_shim
from .vendor import (
    DATA_PATH_ABI,
    CopyKind,
    DataPathTable,
    Device,
    MemoryType,
    PointerInfo,
    VendorRuntime,
)


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` (CUDA >= 10): type, device, devicePointer, hostPointer."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        # CUDA 12+ appends reserved words (CUDA 13: long reserved[8], 88 bytes in all) and
        # the runtime writes them: room to spare so no release can overrun the struct
        ("_reserved", ctypes.c_ubyte * 512),
    ]


#: memory-type values of ``cudaMemoryType``
MEM_UNREGISTERED, MEM_HOST, MEM_DEVICE, MEM_MANAGED = 0, 1, 2, 3
#: ``cudaErrorInvalidValue``
INVALID_VALUE = 1
#: ``cudaErrorInvalidMemcpyDirection``
INVALID_MEMCPY_DIRECTION = 21
#: (source is device memory, destination is device memory) of each copy kind
_DEVICE_SIDES = {CopyKind.HOST_TO_HOST: (False, False), CopyKind.HOST_TO_DEVICE: (False, True),
                 CopyKind.DEVICE_TO_HOST: (True, False), CopyKind.DEVICE_TO_DEVICE: (True, True)}
#: ``cudaErrorInvalidResourceHandle``
INVALID_RESOURCE_HANDLE = 400


class CudaLikeRuntime(VendorRuntime):
    """Every contract operation over a CUDA-shaped runtime bound by the shim generator.

    A port sets :attr:`prefix`, implements :meth:`library_path` and :meth:`probe`,
    and may add :meth:`extra_protos` rows and override :meth:`device_name`,
    :meth:`device_memory` and :meth:`address_range` (the three things libcudart
    itself does not answer portably).
    """

    #: symbol prefix of the runtime (``cuda``, ``mc``, ``hip``, ...)
    prefix: str = "cuda"
    #: copy-kind values of the runtime (CUDA's unless a runtime differs)
    copy_kinds = {CopyKind.HOST_TO_HOST: 0, CopyKind.HOST_TO_DEVICE: 1, CopyKind.DEVICE_TO_HOST: 2, CopyKind.DEVICE_TO_DEVICE: 3}
    #: streams do not wait for the default stream (cudaStreamNonBlocking)
    stream_flags = 1
    #: flags of host registration (cudaHostRegisterPortable: usable from every device)
    host_register_flags = 1
    pointer_attributes_type = PointerAttributes

    def __init__(self):
        probe = self.probe()
        if not probe.usable:
            raise VendorUnavailable(f"{self.name}: {probe.reason}")
        self.rt: Shim = self.bind()
        self._lock = threading.Lock()
        self._streams: set[int] = set()  # created here, destroyed by close()
        # destroyed here and not handed out again: refused, since CUDA-shaped handles are
        # pointers and the runtime itself would crash on them
        self._destroyed: set[int] = set()
        self._host_ranges: dict[int, int] = {}  # pinned allocations and registrations made here

    # -- what a port provides ----------------------------------------------------

    def library_path(self) -> str:
        """Path (or loader name) of the runtime library."""
        raise NotImplementedError

    def extra_protos(self) -> list[Proto]:
        """Rows beyond :func:`phoenix.shim.cuda_shaped_protos` this runtime needs."""
        return []

    def bind(self) -> Shim:
        """Load the runtime library through the shim generator."""
        P = self.prefix
        return load_shim(self.name, self.library_path(), cuda_shaped_protos(P) + list(self.extra_protos()),
                         prefix=P, error_name=f"{P}GetErrorName", error_string=f"{P}GetErrorString")

    def device_name(self, ordinal: int) -> str:
        return f"{self.name} device {ordinal}"

    def device_memory(self, ordinal: int) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._on_device(ordinal):
            self.rt.mem_get_info(ctypes.byref(free), ctypes.byref(total))
        return total.value

    def address_range(self, ptr: int) -> tuple[int, int] | None:
        """(base, size) of the allocation or registration containing ``ptr``, or None."""
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
            self.rt.raise_for(f"{self.prefix}{call}", INVALID_VALUE)

    def _refuse_zero(self, call: str, size: int) -> None:
        if size <= 0:  # CUDA's Malloc(0) succeeds with NULL; the contract says zero is an error
            self.rt.raise_for(f"{self.prefix}{call}", INVALID_VALUE)

    def _live_stream(self, call: str, stream: int) -> ctypes.c_void_p:
        if stream in self._destroyed:
            self.rt.raise_for(f"{self.prefix}{call}", INVALID_RESOURCE_HANDLE)
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
        return ptr.value

    def device_free(self, ptr: int) -> None:
        self._refuse_null("Free", ptr)
        self.rt.free(ctypes.c_void_p(ptr))

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
        and copies anyway (a freed or host pointer named as device memory included)."""
        if size <= 0 or self.is_test_double:  # the test-double runtimes check this themselves, strictly
            return
        for ptr, want_device in zip((src, dst), _DEVICE_SIDES[CopyKind(kind)], strict=True):
            info = self.pointer_info(ptr)
            is_device = info.type is MemoryType.DEVICE
            if is_device != want_device:
                self.rt.raise_for(f"{self.prefix}{call}", INVALID_MEMCPY_DIRECTION)
            if is_device and info.size and ptr + size > info.base + info.size:
                self.rt.raise_for(f"{self.prefix}{call}", INVALID_VALUE)

    def memcpy(self, dst: int, src: int, size: int, kind: CopyKind) -> None:
        self._check_copy("Memcpy", dst, src, size, kind)
        self.rt.memcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size), self.copy_kinds[CopyKind(kind)])

    def memcpy_async(self, dst: int, src: int, size: int, kind: CopyKind, stream: int) -> None:
        self._check_copy("MemcpyAsync", dst, src, size, kind)
        self.rt.memcpy_async(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size),
                             self.copy_kinds[CopyKind(kind)], self._live_stream("MemcpyAsync", stream))

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
            self.rt.raise_for(f"{self.prefix}LaunchHostFunc", INVALID_VALUE)
        self.rt.launch_host_func(self._live_stream("LaunchHostFunc", stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))

    # -- pointer queries ---------------------------------------------------------

    def memory_type(self, attrs) -> int:
        """The memory-type field of the runtime's pointer attributes (names differ by release)."""
        return attrs.type

    def pointer_info(self, ptr: int) -> PointerInfo:
        attrs = self.pointer_attributes_type()
        try:
            self.rt.pointer_get_attributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        except VendorError:  # old runtimes refuse pageable memory instead of saying so
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

    #: flags of the events the I/O core records (cudaEventDisableTiming: cheaper records)
    event_flags = 2

    def _event_entries(self) -> dict:
        P, h = self.prefix, self.rt.handle
        names = {"get_device": f"{P}GetDevice", "event_create": f"{P}EventCreateWithFlags",
                 "event_record": f"{P}EventRecord", "stream_wait_event": f"{P}StreamWaitEvent",
                 "event_synchronize": f"{P}EventSynchronize", "event_destroy": f"{P}EventDestroy"}
        if not all(hasattr(h, sym) for sym in names.values()):
            return {}
        return {"event_flags": self.event_flags, **{field: self.rt.address(sym) for field, sym in names.items()}}

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, set()
        for stream in streams:
            with contextlib.suppress(VendorError):  # already destroyed elsewhere
                self.rt.stream_destroy(ctypes.c_void_p(stream))
