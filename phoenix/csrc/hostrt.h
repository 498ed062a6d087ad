/* The host reference runtime: a CUDA-shaped device runtime on host memory.
 *
 * A TEST DOUBLE. It is what vendors/host/runtime.py binds (through the same
 * generated ctypes shim a real port uses for libcudart), so the whole stack and the
 * conformance suite run on a CPU-only machine. It is strict, like a real runtime:
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
 *     that runs on that worker in stream order (never Python).
 *
 * The symbol prefix is PHXRT_PREFIX (default phxh: phxhMalloc, phxhMemcpyAsync, ...),
 * so the same source builds CUDA-shaped emulators with another prefix for tests.
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
    PHXRT_ERR_UNKNOWN = 999,
};

/* Copy kinds (CUDA's values). */
enum { PHXRT_H2H = 0, PHXRT_H2D = 1, PHXRT_D2H = 2, PHXRT_D2D = 3, PHXRT_DEFAULT = 4 };

/* Memory types reported by PointerGetAttributes (CUDA's cudaMemoryType values). */
enum { PHXRT_MEM_UNREGISTERED = 0, PHXRT_MEM_HOST = 1, PHXRT_MEM_DEVICE = 2 };

/* cudaPointerAttributes' layout: type, device, devicePointer, hostPointer. */
typedef struct {
    int type;
    int device;
    void *devicePointer;
    void *hostPointer;
} phxrtPointerAttributes;

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

#endif
