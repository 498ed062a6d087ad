/* The host reference runtime: a strict CUDA-shaped runtime on host memory (a TEST DOUBLE).
 * This file: errors, devices, initialisation and settings, device properties.
 *
 * Test side (a vendor runtime's test double, outside the C core), both planes:
 * vendors/host/runtime.py binds these calls through the generated shim (control plane)
 * and hands the I/O core their raw addresses (data path). hostrt.h is the spec; this
 * file and its siblings say how: hostrt_mem.c (device and host memory, pointer
 * queries), hostrt_copy.c (copies and memset), hostrt_stream.c (streams),
 * hostrt_event.c (events), hostrt_driver.c (the cu* driver API of emulators), sharing
 * hostrt_internal.h. setup.py builds them as their own library, libphxhostrt.so.
 *
 * Self-contained on purpose (libc + pthreads only, no Python, no other phoenix C
 * file, every helper static or hidden), so the same sources build a CUDA-shaped
 * emulator with another prefix:
 *   gcc -shared -fPIC -pthread -DPHXRT_PREFIX=mc hostrt*.c -o libmcruntime.so
 *
 * What must stay true:
 *   - Device memory faults on stray access: an arena is reserved PROT_NONE, an
 *     allocation is made read/write, a free drops the pages and makes them PROT_NONE
 *     again, and freed ranges wait in a FIFO quarantine before they are reused.
 *   - Nothing the caller passes is trusted: a bad pointer, extent, kind or handle is an
 *     error code, never a crash and never a stray write. Stream handles are ids, not
 *     addresses, so a destroyed stream is recognised, not dereferenced.
 *   - A copy queued on a stream keeps the allocations it names alive: Free/FreeHost/
 *     HostUnregister of a range with queued copies waits for them (cudaFree's implicit
 *     synchronisation, narrowed to the range), so a copy never lands in freed memory.
 *   - Streams are FIFO worker threads; a host function runs on the worker in stream
 *     order and never touches Python.
 *
 * Locks, never nested (so no lock order to get wrong): g_mem guards the ranges, the
 * arenas' allocators and the pins; g_streams_mu guards the stream registry, reference
 * counts and default streams; each stream's mu guards its queue. Nothing runs a host
 * function or a copy while holding one. Only fork takes them together (hostrt_fork.c).
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

/* -- errors --------------------------------------------------------------------- */

__thread int tls_device;            /* SetDevice is per thread (default 0) */
static __thread int tls_last_error; /* returned and cleared by GetLastError */

/* Every API call returns through here, so GetLastError sees its failures. */
int report(int code)
{
    if (code != PHXRT_SUCCESS)
        tls_last_error = code;
    return code;
}

/* The entry for `code` in an error table of n entries, or NULL. */
const struct err_entry *err_find(const struct err_entry *t, size_t n, int code)
{
    for (size_t i = 0; i < n; i++)
        if (t[i].code == code)
            return &t[i];
    return NULL;
}

static const struct err_entry g_errors[] = {
    {PHXRT_SUCCESS, PREFIX_STR "Success", "no error"},
    {PHXRT_ERR_INVALID_VALUE, PREFIX_STR "ErrorInvalidValue", "invalid argument"},
    {PHXRT_ERR_MEMORY_ALLOCATION, PREFIX_STR "ErrorMemoryAllocation", "out of memory"},
    {PHXRT_ERR_INITIALIZATION, PREFIX_STR "ErrorInitializationError",
     "initialization error (check PHX_HOST_DEVICES and PHX_HOST_DEVICE_MEMORY)"},
    {PHXRT_ERR_INVALID_DEVICE_POINTER, PREFIX_STR "ErrorInvalidDevicePointer", "invalid device pointer"},
    {PHXRT_ERR_INVALID_MEMCPY_DIRECTION, PREFIX_STR "ErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {PHXRT_ERR_NO_DEVICE, PREFIX_STR "ErrorNoDevice", "no device is detected (PHX_HOST_DEVICES=0)"},
    {PHXRT_ERR_INVALID_DEVICE, PREFIX_STR "ErrorInvalidDevice", "invalid device ordinal"},
    {PHXRT_ERR_INVALID_RESOURCE_HANDLE, PREFIX_STR "ErrorInvalidResourceHandle", "invalid resource handle"},
    {PHXRT_ERR_NOT_READY, PREFIX_STR "ErrorNotReady", "device not ready"},
    {PHXRT_ERR_HOST_MEMORY_ALREADY_REGISTERED, PREFIX_STR "ErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {PHXRT_ERR_HOST_MEMORY_NOT_REGISTERED, PREFIX_STR "ErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {PHXRT_ERR_LAUNCH_FAILURE, PREFIX_STR "ErrorLaunchFailure",
     "unspecified launch failure: work queued before fork() never runs in the child process"},
    {PHXRT_ERR_UNKNOWN, PREFIX_STR "ErrorUnknown", "unknown error"},
};

const char *RT(GetErrorName)(int error)
{
    const struct err_entry *e = err_find(g_errors, sizeof g_errors / sizeof g_errors[0], error);
    return e ? e->name : "unrecognized error code";
}

const char *RT(GetErrorString)(int error)
{
    const struct err_entry *e = err_find(g_errors, sizeof g_errors / sizeof g_errors[0], error);
    return e ? e->message : "unrecognized error code";
}

int RT(GetLastError)(void)
{
    int e = tls_last_error;
    tls_last_error = PHXRT_SUCCESS;
    return e;
}

/* -- devices, arenas and settings ------------------------------------------------- */

struct runtime_state g;

pthread_once_t g_once = PTHREAD_ONCE_INIT;
pthread_mutex_t g_mem = PTHREAD_MUTEX_INITIALIZER;

/* "16G", "512M", "64KiB", "4096" -> bytes; -1 if malformed. */
static int parse_size(const char *s, size_t *out)
{
    if (*s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return -1;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    }
    if (shift) {
        end++;
        if (*end == 'i' || *end == 'I')
            end++;
    }
    if (*end == 'b' || *end == 'B')
        end++;
    if (*end || v > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)v << shift;
    return 0;
}

static int setting(const char *name, size_t dflt, size_t *out)
{
    const char *v = getenv(name);
    *out = dflt;
    return (v && *v) ? parse_size(v, out) : 0;
}

/* A PROT_NONE reservation aligned to ARENA_ALIGN: no memory is committed until used. */
static char *map_arena(size_t size)
{
    size_t len = size + ARENA_ALIGN;
    char *raw = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *base = (char *)round_up((uintptr_t)raw, ARENA_ALIGN);
    size_t head = (size_t)(base - raw), tail = len - head - size;
    if (head)
        munmap(raw, head);
    if (tail)
        munmap(base + size, tail);
    return base;
}

void init_once(void)
{
    size_t ndev, arena;
    if (setting("PHX_HOST_DEVICES", 1, &ndev) || ndev > MAX_DEVICES ||
        setting("PHX_HOST_DEVICE_MEMORY", DEFAULT_ARENA, &arena) || arena == 0 || arena > ((size_t)1 << 46)) {
        g.status = PHXRT_ERR_INITIALIZATION;
        return;
    }
    arena = round_up(arena, ARENA_ALIGN);
    for (size_t i = 0; i < ndev; i++) {
        struct device *d = &g.dev[i];
        d->arena = map_arena(arena);
        d->free_list = malloc(sizeof *d->free_list);
        if (!d->arena || !d->free_list) {
            for (size_t j = 0; j <= i; j++) {
                if (g.dev[j].arena)
                    munmap(g.dev[j].arena, arena);
                free(g.dev[j].free_list);
            }
            memset(g.dev, 0, sizeof g.dev);
            g.status = PHXRT_ERR_INITIALIZATION;
            return;
        }
        d->arena_size = arena;
        d->free_list[0] = (struct extent){0, arena};
        d->nfree = d->capfree = 1;
    }
    g.ndev = (int)ndev;
}

/* The calling thread's current device, or NULL with *rc set. */
struct device *current_device(int *rc)
{
    if (g.ndev == 0) {
        *rc = PHXRT_ERR_NO_DEVICE;
        return NULL;
    }
    return &g.dev[tls_device];
}

int check_ordinal(int device)
{
    if (g.ndev == 0)
        return PHXRT_ERR_NO_DEVICE;
    return (device >= 0 && device < g.ndev) ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_DEVICE;
}

/* Which device's arena holds address p, or -1 (plain host memory). */
int arena_device(uintptr_t p)
{
    for (int i = 0; i < g.ndev; i++)
        if (p - (uintptr_t)g.dev[i].arena < g.dev[i].arena_size)
            return i;
    return -1;
}

/* Does [p, p+n) touch any arena? (host extents must not) */
int touches_arena(uintptr_t p, size_t n)
{
    for (int i = 0; i < g.ndev; i++) {
        uintptr_t a = (uintptr_t)g.dev[i].arena;
        if (p < a + g.dev[i].arena_size && p + n > a)
            return 1;
    }
    return 0;
}

int RT(GetDeviceCount)(int *count)
{
    ENSURE_INIT();
    if (!count)
        return report(PHXRT_ERR_INVALID_VALUE);
    *count = g.ndev;
    return report(g.ndev ? PHXRT_SUCCESS : PHXRT_ERR_NO_DEVICE);
}

int RT(SetDevice)(int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc == PHXRT_SUCCESS)
        tls_device = device;
    return report(rc);
}

int RT(GetDevice)(int *device)
{
    ENSURE_INIT();
    if (!device)
        return report(PHXRT_ERR_INVALID_VALUE);
    *device = tls_device;
    return PHXRT_SUCCESS;
}

/* Copy a device's string property into the caller's buffer, which must hold all of it. */
static int device_string(char *buf, int len, const char *text)
{
    if (!buf || len <= 0 || snprintf(buf, (size_t)len, "%s", text) >= len)
        return report(PHXRT_ERR_INVALID_VALUE);
    return PHXRT_SUCCESS;
}

int RT(DeviceGetPCIBusId)(char *buf, int len, int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    /* Bus 0xf0 is unlikely to hold real hardware; one function per device. */
    char id[32];
    snprintf(id, sizeof id, "0000:f0:%02x.0", (unsigned)device);
    return device_string(buf, len, id);
}

int RT(DeviceGetName)(char *buf, int len, int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    return device_string(buf, len, DEVICE_NAME);
}

int RT(DeviceTotalMem)(size_t *bytes, int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    if (!bytes)
        return report(PHXRT_ERR_INVALID_VALUE);
    *bytes = g.dev[device].arena_size;
    return PHXRT_SUCCESS;
}

int RT(MemGetInfo)(size_t *free_bytes, size_t *total_bytes)
{
    ENSURE_INIT();
    int rc;
    struct device *d = current_device(&rc);
    if (!d)
        return report(rc);
    if (!free_bytes || !total_bytes)
        return report(PHXRT_ERR_INVALID_VALUE);
    pthread_mutex_lock(&g_mem);
    /* quarantined ranges count as free: an allocation that needs them drains the quarantine */
    *free_bytes = d->arena_size - d->used;
    pthread_mutex_unlock(&g_mem);
    *total_bytes = d->arena_size;
    return PHXRT_SUCCESS;
}

/* -- more of the CUDA-shaped surface ------------------------------------------------ */

const char *RT(PhoenixTestDouble)(void)
{
    return TEST_DOUBLE_INFO;
}

int RT(GetDeviceProperties)(phxrtDeviceProp *prop, int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    if (!prop)
        return report(PHXRT_ERR_INVALID_VALUE);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "%s", DEVICE_NAME);
    prop->uuid[0] = 0xf0; /* distinct per device, recognisably not real hardware */
    prop->uuid[15] = (unsigned char)device;
    prop->totalGlobalMem = g.dev[device].arena_size;
    prop->pciBusID = 0xf0; /* as DeviceGetPCIBusId: 0000:f0:<device>.0 */
    prop->pciDeviceID = device;
    prop->pciDomainID = 0;
    prop->multiProcessorCount = 1;
    prop->unifiedAddressing = 1;
    prop->canMapHostMemory = 1;
    return PHXRT_SUCCESS;
}

int RT(DeviceGetAttribute)(int *value, int attr, int device)
{
    ENSURE_INIT();
    int rc = check_ordinal(device);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    if (!value)
        return report(PHXRT_ERR_INVALID_VALUE);
    switch (attr) {
    case PHXRT_ATTR_MULTIPROCESSOR_COUNT: *value = 1; break;
    case PHXRT_ATTR_CAN_MAP_HOST_MEMORY: *value = 1; break;
    case PHXRT_ATTR_PCI_BUS_ID: *value = 0xf0; break;
    case PHXRT_ATTR_PCI_DEVICE_ID: *value = device; break;
    case PHXRT_ATTR_UNIFIED_ADDRESSING: *value = 1; break;
    case PHXRT_ATTR_PCI_DOMAIN_ID: *value = 0; break;
    default: return report(PHXRT_ERR_INVALID_VALUE); /* not emulated: refused, never made up */
    }
    return PHXRT_SUCCESS;
}

int RT(RuntimeGetVersion)(int *version)
{
    if (!version)
        return report(PHXRT_ERR_INVALID_VALUE);
    *version = PHXRT_VERSION;
    return PHXRT_SUCCESS;
}

int RT(DriverGetVersion)(int *version)
{
    if (!version)
        return report(PHXRT_ERR_INVALID_VALUE);
    *version = PHXRT_VERSION;
    return PHXRT_SUCCESS;
}
