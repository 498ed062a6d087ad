/* The host reference runtime: a CUDA-shaped device runtime on host memory.
 *
 * Test side (a vendor runtime's test double, outside the C core): the spec of
 * libphxhostrt.so. A TEST DOUBLE. It is what vendors/host/runtime.py binds (through
 * the same generated ctypes shim a real port uses for libcudart), so the whole stack
 * and the conformance suite run on a CPU-only machine. It is strict, like a real runtime:
 *
 *   - "Device memory" comes from a per-device arena: a large PROT_NONE reservation;
 *     an allocation is made readable/writable, a free makes it PROT_NONE again, so a
 *     stray access to freed device memory faults instead of silently succeeding.
 *     Freed ranges sit in a quarantine before they are reused.
 *   - Pointer queries know device memory (which device, allocation base and size),
 *     pinned host memory (MallocHost) and registered host memory (HostRegister).
 *   - Copies check their kind against the pointers (a host pointer given as the
 *     device side is an error) and check that a device extent lies inside one live
 *     allocation.
 *   - Each stream is an ordered worker thread; LaunchHostFunc queues a plain C call
 *     that runs on that worker in stream order (never Python). Events mark a point of
 *     a stream (EventRecord); StreamWaitEvent holds another stream until it is reached.
 *     Stream handles 1 and 2 (CUDA's cudaStreamLegacy, cudaStreamPerThread) name the
 *     default stream, as 0 does.
 *
 * The symbol prefix is PHXRT_PREFIX (default phxh: phxhMalloc, phxhMemcpyAsync, ...),
 * so the same source builds CUDA-shaped emulators with another prefix for tests
 * (phoenix/emulator.py; tests/emulators/README.md): -DPHXRT_EMULATOR labels the build as
 * an emulator, PHXRT_POINTER_ATTRIBUTES picks the pointer-attribute layout,
 * PHXRT_DRIVER_PREFIX adds a driver API (cu*), PHXRT_VERSION the version it reports.
 * Calls that are not CUDA's (DeviceGetName, DeviceTotalMem, MemGetAddressRange,
 * PhoenixTestDouble) serve the host port; a port of a real runtime must not use them.
 *
 * fork(): the child has its own runtime, with the memory, streams and events it inherited.
 * A stream's worker thread is the parent's (gone in the child): it is started again in
 * the child with the stream's first new work. What the parent had queued and its stream
 * had not run at the fork never runs in the child: copies and host functions are
 * dropped, their allocations let go (Free does not wait for them); the stream's next
 * StreamSynchronize / StreamQuery (or DeviceSynchronize) says LAUNCH_FAILURE once, and an
 * event whose latest record was dropped says LAUNCH_FAILURE from EventQuery,
 * EventSynchronize and StreamWaitEvent (never NOT_READY: nothing will complete it). The
 * default stream, new streams and new records work as in any process.
 *
 * Settings (read at first use): PHX_HOST_DEVICES (number of devices, default 1),
 * PHX_HOST_DEVICE_MEMORY (arena size per device, default 16G; virtual until used).
 */
#ifndef PHX_HOSTRT_H
#define PHX_HOSTRT_H

#include <stddef.h>

#ifndef PHXRT_PREFIX
#define PHXRT_PREFIX phxh
#endif
#define PHXRT_CAT2(a, b) a##b
#define PHXRT_CAT(a, b) PHXRT_CAT2(a, b)
#define RT(name) PHXRT_CAT(PHXRT_PREFIX, name)

/* Error codes: CUDA's numeric values, so code and tests read the same everywhere. */
enum {
    PHXRT_SUCCESS = 0,
    PHXRT_ERR_INVALID_VALUE = 1,
    PHXRT_ERR_MEMORY_ALLOCATION = 2,
    PHXRT_ERR_INITIALIZATION = 3,
    PHXRT_ERR_INVALID_DEVICE_POINTER = 17,
    PHXRT_ERR_INVALID_MEMCPY_DIRECTION = 21,
    PHXRT_ERR_NO_DEVICE = 100,
    PHXRT_ERR_INVALID_DEVICE = 101,
    PHXRT_ERR_INVALID_RESOURCE_HANDLE = 400,
    PHXRT_ERR_NOT_READY = 600,
    PHXRT_ERR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    PHXRT_ERR_HOST_MEMORY_NOT_REGISTERED = 713,
    PHXRT_ERR_LAUNCH_FAILURE = 719, /* work queued before fork() that the child never runs */
    PHXRT_ERR_UNKNOWN = 999,
};

/* Copy kinds (CUDA's values). */
enum { PHXRT_H2H = 0, PHXRT_H2D = 1, PHXRT_D2H = 2, PHXRT_D2D = 3, PHXRT_DEFAULT = 4 };

/* Memory types reported by PointerGetAttributes (CUDA's cudaMemoryType values). */
enum { PHXRT_MEM_UNREGISTERED = 0, PHXRT_MEM_HOST = 1, PHXRT_MEM_DEVICE = 2 };

/* Pointer attributes. The default is cudaPointerAttributes' layout (CUDA >= 11): type,
 * device, devicePointer, hostPointer. Runtimes and releases differ in the memory-type
 * field, so an emulator can be built with another layout (PHXRT_POINTER_ATTRIBUTES) to
 * check that a port reads the one its runtime has:
 *   0  type, device, devicePointer, hostPointer                      (default)
 *   1  memoryType, device, devicePointer, hostPointer, isManaged      (same place, old name)
 *   2  memoryType, type, device, devicePointer, hostPointer, isManaged (CUDA 10: both) */
#ifndef PHXRT_POINTER_ATTRIBUTES
#define PHXRT_POINTER_ATTRIBUTES 0
#endif
typedef struct {
#if PHXRT_POINTER_ATTRIBUTES == 0
    int type;
#elif PHXRT_POINTER_ATTRIBUTES == 1
    int memoryType;
#elif PHXRT_POINTER_ATTRIBUTES == 2
    int memoryType; /* deprecated twin of type, set to the same value */
    int type;
#else
#error "PHXRT_POINTER_ATTRIBUTES must be 0, 1 or 2"
#endif
    int device;
    void *devicePointer;
    void *hostPointer;
#if PHXRT_POINTER_ATTRIBUTES != 0
    int isManaged;
#endif
} phxrtPointerAttributes;

/* Device properties: `name` at offset 0 as in cudaDeviceProp, hipDeviceProp_t and
 * mcDeviceProp_t (the one field a port may read portably), then cudaDeviceProp's next
 * fields, then the emulator's own. Smaller than any real runtime's struct, so a caller
 * that passes its runtime's struct is never overrun. */
typedef struct {
    char name[256];
    unsigned char uuid[16];
    char luid[8];
    unsigned int luidDeviceNodeMask;
    size_t totalGlobalMem;
    int pciBusID;
    int pciDeviceID;
    int pciDomainID;
    int multiProcessorCount;
    int unifiedAddressing;
    int canMapHostMemory;
} phxrtDeviceProp;

/* DeviceGetAttribute: the attributes answered (cudaDeviceAttr values); others are invalid. */
enum {
    PHXRT_ATTR_MULTIPROCESSOR_COUNT = 16,
    PHXRT_ATTR_CAN_MAP_HOST_MEMORY = 19,
    PHXRT_ATTR_PCI_BUS_ID = 33,
    PHXRT_ATTR_PCI_DEVICE_ID = 34,
    PHXRT_ATTR_UNIFIED_ADDRESSING = 41,
    PHXRT_ATTR_PCI_DOMAIN_ID = 50,
};

/* RuntimeGetVersion / DriverGetVersion answer this (CUDA's 1000*major + 10*minor form). */
#ifndef PHXRT_VERSION
#define PHXRT_VERSION 12000
#endif

typedef struct phxrt_event *phxrtEvent_t;

typedef struct phxrt_stream *phxrtStream_t;
typedef void (*phxrtHostFn_t)(void *arg);

int RT(GetDeviceCount)(int *count);
int RT(SetDevice)(int device);                 /* per calling thread, default 0 */
int RT(GetDevice)(int *device);
int RT(DeviceGetPCIBusId)(char *buf, int len, int device); /* "0000:f0:00.0"-style, device-specific */
int RT(DeviceGetName)(char *buf, int len, int device);
int RT(DeviceTotalMem)(size_t *bytes, int device);
int RT(MemGetInfo)(size_t *free_bytes, size_t *total_bytes); /* current device */
int RT(DeviceSynchronize)(void);               /* all streams of the current device */

int RT(Malloc)(void **ptr, size_t size);       /* current device; 0 size -> INVALID_VALUE */
int RT(Free)(void *ptr);                       /* base of a live allocation only; NULL ok */
int RT(MallocHost)(void **ptr, size_t size);
int RT(FreeHost)(void *ptr);
int RT(HostRegister)(void *ptr, size_t size, unsigned flags);
int RT(HostUnregister)(void *ptr);

int RT(Memcpy)(void *dst, const void *src, size_t n, int kind);
int RT(MemcpyAsync)(void *dst, const void *src, size_t n, int kind, phxrtStream_t stream);

int RT(StreamCreateWithFlags)(phxrtStream_t *stream, unsigned flags); /* on the current device */
int RT(StreamSynchronize)(phxrtStream_t stream);
int RT(StreamQuery)(phxrtStream_t stream);     /* SUCCESS when idle, NOT_READY otherwise */
int RT(StreamDestroy)(phxrtStream_t stream);
int RT(LaunchHostFunc)(phxrtStream_t stream, phxrtHostFn_t fn, void *arg);

int RT(PointerGetAttributes)(phxrtPointerAttributes *attr, const void *ptr);
int RT(MemGetAddressRange)(void **base, size_t *size, const void *ptr); /* device or pinned/registered host */

int RT(GetLastError)(void);
const char *RT(GetErrorString)(int error);
const char *RT(GetErrorName)(int error);

/* More of the CUDA-shaped surface (what real ports and the emulators' users call). */
int RT(GetDeviceProperties)(phxrtDeviceProp *prop, int device);
int RT(DeviceGetAttribute)(int *value, int attr, int device);
int RT(RuntimeGetVersion)(int *version);
int RT(DriverGetVersion)(int *version);
int RT(HostGetDevicePointer)(void **device_ptr, void *host_ptr, unsigned flags); /* flags must be 0 */
int RT(Memset)(void *device_ptr, int value, size_t n); /* inside one live allocation */
int RT(EventCreate)(phxrtEvent_t *event);
int RT(EventCreateWithFlags)(phxrtEvent_t *event, unsigned flags);
int RT(EventRecord)(phxrtEvent_t event, phxrtStream_t stream);
int RT(EventQuery)(phxrtEvent_t event);        /* SUCCESS when its last record ran, NOT_READY otherwise */
int RT(EventSynchronize)(phxrtEvent_t event);
int RT(EventDestroy)(phxrtEvent_t event);
int RT(StreamWaitEvent)(phxrtStream_t stream, phxrtEvent_t event, unsigned flags); /* flags must be 0 */

/* Not a CUDA call: the mark of the test double. Says what this library is (the host
 * runtime, or an emulator and its prefix); no real runtime exports a symbol of this
 * name, so a port tells an emulator from the real library by looking for it. */
const char *RT(PhoenixTestDouble)(void);

/* Emulators of a runtime with a separate driver API (CUDA's cu*) also export the few
 * driver calls a port uses, over the same state, when built with
 * -DPHXRT_DRIVER_PREFIX=cu. Error codes are CUresult's: the numbers above, plus
 * NOT_INITIALIZED (3, before Init) and NOT_SUPPORTED (801, an attribute not answered). */
#ifdef PHXRT_DRIVER_PREFIX
#define DRV(name) PHXRT_CAT(PHXRT_DRIVER_PREFIX, name)
/* CUpointer_attribute values answered by DRV(PointerGetAttribute) */
enum {
    PHXRT_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,  /* unsigned: CU_MEMORYTYPE_HOST 1, _DEVICE 2 */
    PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    PHXRT_CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
    PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    PHXRT_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    PHXRT_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
};
int DRV(Init)(unsigned flags);                 /* flags must be 0; every other call needs it first */
int DRV(DriverGetVersion)(int *version);
int DRV(DeviceGetCount)(int *count);
int DRV(DeviceGetName)(char *buf, int len, int device);
int DRV(PointerGetAttribute)(void *data, int attribute, unsigned long long ptr);
int DRV(GetErrorName)(int error, const char **name);
int DRV(GetErrorString)(int error, const char **message);
#endif

#endif
