/* The host reference runtime: a strict CUDA-shaped runtime on host memory (a TEST DOUBLE).
 *
 * Test side (a vendor runtime's test double, outside the C core), both planes:
 * vendors/host/runtime.py binds these calls through the generated shim (control plane)
 * and hands the I/O core their raw addresses (data path). hostrt.h is the spec; this
 * file says how. setup.py builds it as its own library, libphxhostrt.so, beside it.
 *
 * Self-contained on purpose (libc + pthreads only, no Python, no other phoenix C
 * file, every helper static), so the same source builds a CUDA-shaped emulator with
 * another prefix: gcc -shared -fPIC -pthread -DPHXRT_PREFIX=mc hostrt.c -o libmcruntime.so
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
 * function or a copy while holding one.
 */
#define _GNU_SOURCE
#include "hostrt.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

#define MAX_DEVICES 16
#define DEFAULT_ARENA (16 * GiB)
#define ARENA_ALIGN (2 * MiB)       /* huge-page aligned, like a real device's VA space */
#define GRANULE (64 * KiB)          /* allocation unit and alignment: the P2P page size */
#define QUARANTINE_FREES 64         /* a freed range is reused only after this many more frees */
#define QUARANTINE_BYTES (1 * GiB)  /* ... or once this many bytes are waiting (the newest always waits) */
#define STREAM_NONBLOCKING 1u
#define HOST_REGISTER_FLAGS 0xFu    /* CUDA's: portable, mapped, I/O memory, read-only */

#define STR2(x) #x
#define STR(x) STR2(x)
#define PREFIX_STR STR(PHXRT_PREFIX)

/* Built as an emulator of another runtime (phoenix/emulator.py passes -DPHXRT_EMULATOR),
 * the library says so in its device names and its test-double mark. */
#ifdef PHXRT_EMULATOR
#define DEVICE_NAME "Phoenix emulated " PREFIX_STR " device (test double)"
#define TEST_DOUBLE_INFO "phoenix emulated runtime (test double): CUDA-shaped, prefix " PREFIX_STR \
    ", host memory as device memory, built from phoenix/_testing/hostrt/hostrt.c"
#else
#define DEVICE_NAME "Phoenix host reference device (test double)"
#define TEST_DOUBLE_INFO "phoenix host reference runtime (test double): CUDA-shaped, prefix " PREFIX_STR \
    ", host memory as device memory"
#endif

/* The memory-type field(s) of the pointer-attribute layout built (hostrt.h). */
#if PHXRT_POINTER_ATTRIBUTES == 0
#define ATTR_SET_TYPE(a, v) ((a)->type = (v))
#elif PHXRT_POINTER_ATTRIBUTES == 1
#define ATTR_SET_TYPE(a, v) ((a)->memoryType = (v))
#else
#define ATTR_SET_TYPE(a, v) ((a)->memoryType = (a)->type = (v))
#endif

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* -- errors --------------------------------------------------------------------- */

static __thread int tls_device;     /* SetDevice is per thread (default 0) */
static __thread int tls_last_error; /* returned and cleared by GetLastError */

/* Every API call returns through here, so GetLastError sees its failures. */
static int report(int code)
{
    if (code != PHXRT_SUCCESS)
        tls_last_error = code;
    return code;
}

struct err_entry {
    int code;
    const char *name, *message;
};

/* The entry for `code` in an error table of n entries, or NULL. */
static const struct err_entry *err_find(const struct err_entry *t, size_t n, int code)
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

struct extent {
    size_t off, len; /* offset into the arena, length */
};

struct stream;

struct device {
    char *arena;
    size_t arena_size;
    size_t used;                 /* bytes of live allocations (granule-rounded) */
    struct extent *free_list;    /* sorted by offset, coalesced */
    size_t nfree, capfree;
    struct extent quarantine[QUARANTINE_FREES]; /* FIFO ring of freed ranges not yet reusable */
    unsigned qhead, qcount;
    size_t qbytes;
    struct stream *default_stream; /* stream 0, created at first use (guarded by g_streams_mu) */
};

static struct {
    int status; /* of initialisation: SUCCESS or INITIALIZATION */
    int ndev;
    struct device dev[MAX_DEVICES];
} g;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_mem = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_unpinned = PTHREAD_COND_INITIALIZER; /* a dying range lost its last pin */

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

static void init_once(void)
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

#define ENSURE_INIT()                                                                              \
    do {                                                                                           \
        pthread_once(&g_once, init_once);                                                          \
        if (g.status != PHXRT_SUCCESS)                                                             \
            return report(g.status);                                                               \
    } while (0)

/* The calling thread's current device, or NULL with *rc set. */
static struct device *current_device(int *rc)
{
    if (g.ndev == 0) {
        *rc = PHXRT_ERR_NO_DEVICE;
        return NULL;
    }
    return &g.dev[tls_device];
}

static int check_ordinal(int device)
{
    if (g.ndev == 0)
        return PHXRT_ERR_NO_DEVICE;
    return (device >= 0 && device < g.ndev) ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_DEVICE;
}

/* Which device's arena holds address p, or -1 (plain host memory). */
static int arena_device(uintptr_t p)
{
    for (int i = 0; i < g.ndev; i++)
        if (p - (uintptr_t)g.dev[i].arena < g.dev[i].arena_size)
            return i;
    return -1;
}

/* Does [p, p+n) touch any arena? (host extents must not) */
static int touches_arena(uintptr_t p, size_t n)
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

/* -- arena allocator (g_mem held) ------------------------------------------------- */

/* First fit over the sorted free list; 0 and *off on success, -1 if nothing fits. */
static int extent_take(struct device *d, size_t len, size_t *off)
{
    for (size_t i = 0; i < d->nfree; i++) {
        struct extent *e = &d->free_list[i];
        if (e->len < len)
            continue;
        *off = e->off;
        e->off += len;
        e->len -= len;
        if (e->len == 0) {
            memmove(e, e + 1, (d->nfree - i - 1) * sizeof *e);
            d->nfree--;
        }
        return 0;
    }
    return -1;
}

/* Return [off, off+len) to the free list, merging with its neighbours. */
static void extent_give(struct device *d, size_t off, size_t len)
{
    size_t lo = 0, hi = d->nfree; /* i = first extent after off */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (d->free_list[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t i = lo;
    struct extent *fl = d->free_list;
    int merge_prev = i > 0 && fl[i - 1].off + fl[i - 1].len == off;
    int merge_next = i < d->nfree && off + len == fl[i].off;
    if (merge_prev && merge_next) {
        fl[i - 1].len += len + fl[i].len;
        memmove(&fl[i], &fl[i + 1], (d->nfree - i - 1) * sizeof *fl);
        d->nfree--;
    } else if (merge_prev) {
        fl[i - 1].len += len;
    } else if (merge_next) {
        fl[i].off = off;
        fl[i].len += len;
    } else {
        if (d->nfree == d->capfree) {
            struct extent *grown = realloc(fl, 2 * d->capfree * sizeof *fl);
            if (!grown)
                return; /* out of host memory: the range is lost to the arena, nothing breaks */
            d->free_list = fl = grown;
            d->capfree *= 2;
        }
        memmove(&fl[i + 1], &fl[i], (d->nfree - i) * sizeof *fl);
        fl[i] = (struct extent){off, len};
        d->nfree++;
    }
}

/* Make the oldest quarantined range reusable; 0 if the quarantine is empty. */
static int quarantine_release(struct device *d)
{
    if (d->qcount == 0)
        return 0;
    struct extent e = d->quarantine[d->qhead];
    d->qhead = (d->qhead + 1) % QUARANTINE_FREES;
    d->qcount--;
    d->qbytes -= e.len;
    extent_give(d, e.off, e.len);
    return 1;
}

static void quarantine_add(struct device *d, size_t off, size_t len)
{
    if (d->qcount == QUARANTINE_FREES)
        quarantine_release(d);
    d->quarantine[(d->qhead + d->qcount) % QUARANTINE_FREES] = (struct extent){off, len};
    d->qcount++;
    d->qbytes += len;
    while (d->qbytes > QUARANTINE_BYTES && d->qcount > 1)
        quarantine_release(d);
}

/* -- ranges: device allocations, pinned allocations, registrations ------------------ */

/* The three kinds never overlap (arenas are apart from host memory, registration refuses
 * overlap), so one sorted array answers every address query in O(log n). */
enum { R_DEVICE = 1, R_PINNED, R_REGISTERED };

struct range {
    uintptr_t base;
    size_t size;     /* what the caller asked for: extents are checked against this */
    size_t span;     /* what it occupies (granule- or page-rounded) */
    int type;
    int device;
    unsigned pins;   /* copies in flight that name this range */
    int dying;       /* being freed: invisible to lookups, waiting for pins to drain */
};

static struct range **g_ranges; /* sorted by base */
static size_t g_nranges, g_capranges;

/* Index of the last range with base <= addr, or -1. */
static ptrdiff_t ranges_floor(uintptr_t addr)
{
    size_t lo = 0, hi = g_nranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_ranges[mid]->base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (ptrdiff_t)lo - 1;
}

/* The live range containing addr, or NULL. */
static struct range *ranges_find(uintptr_t addr)
{
    ptrdiff_t i = ranges_floor(addr);
    if (i < 0)
        return NULL;
    struct range *r = g_ranges[i];
    return (!r->dying && addr - r->base < r->size) ? r : NULL;
}

/* Does [p, p+n) overlap any range (live or dying)? */
static int ranges_overlap(uintptr_t p, size_t n)
{
    ptrdiff_t i = ranges_floor(p + n - 1);
    return i >= 0 && g_ranges[i]->base + g_ranges[i]->span > p;
}

static int ranges_insert(struct range *r)
{
    if (g_nranges == g_capranges) {
        size_t cap = g_capranges ? 2 * g_capranges : 64;
        struct range **grown = realloc(g_ranges, cap * sizeof *grown);
        if (!grown)
            return -1;
        g_ranges = grown;
        g_capranges = cap;
    }
    size_t i = (size_t)(ranges_floor(r->base) + 1);
    memmove(&g_ranges[i + 1], &g_ranges[i], (g_nranges - i) * sizeof *g_ranges);
    g_ranges[i] = r;
    g_nranges++;
    return 0;
}

static void ranges_remove(struct range *r)
{
    size_t i = (size_t)ranges_floor(r->base);
    memmove(&g_ranges[i], &g_ranges[i + 1], (g_nranges - i - 1) * sizeof *g_ranges);
    g_nranges--;
}

/* Take the live range based at ptr of the given type out of service: mark it dying,
 * wait until no queued copy names it, unlink it. g_mem held; NULL if there is none. */
static struct range *ranges_retire(const void *ptr, int type)
{
    struct range *r = ranges_find((uintptr_t)ptr);
    if (!r || r->type != type || r->base != (uintptr_t)ptr)
        return NULL;
    r->dying = 1;
    while (r->pins)
        pthread_cond_wait(&g_unpinned, &g_mem);
    ranges_remove(r);
    return r;
}

static void unpin(struct range *pins[2])
{
    if (!pins[0] && !pins[1])
        return;
    pthread_mutex_lock(&g_mem);
    for (int i = 0; i < 2; i++)
        if (pins[i] && --pins[i]->pins == 0 && pins[i]->dying)
            pthread_cond_broadcast(&g_unpinned);
    pthread_mutex_unlock(&g_mem);
}

/* -- device memory ---------------------------------------------------------------- */

int RT(Malloc)(void **ptr, size_t size)
{
    ENSURE_INIT();
    int rc;
    struct device *d = current_device(&rc);
    if (!d)
        return report(rc);
    if (!ptr || size == 0)
        return report(PHXRT_ERR_INVALID_VALUE);
    if (size > d->arena_size)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    size_t span = round_up(size, GRANULE), off;
    struct range *r = calloc(1, sizeof *r);
    if (!r)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);

    pthread_mutex_lock(&g_mem);
    while (extent_take(d, span, &off) != 0) {
        if (!quarantine_release(d)) { /* quarantine delays reuse; it must not cause OOM */
            pthread_mutex_unlock(&g_mem);
            free(r);
            return report(PHXRT_ERR_MEMORY_ALLOCATION);
        }
    }
    *r = (struct range){.base = (uintptr_t)d->arena + off, .size = size, .span = span,
                        .type = R_DEVICE, .device = (int)(d - g.dev)};
    if (mprotect((void *)r->base, span, PROT_READ | PROT_WRITE) != 0 || ranges_insert(r) != 0) {
        mprotect((void *)r->base, span, PROT_NONE);
        extent_give(d, off, span);
        pthread_mutex_unlock(&g_mem);
        free(r);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    /* Device memory is physically contiguous in large pages on a real accelerator (2 MiB
     * on NVIDIA); ask for transparent huge pages so that the test double's "device memory"
     * behaves alike under O_DIRECT (large DMA segments) whoever touches it first. Advice only. */
    madvise((void *)r->base, span, MADV_HUGEPAGE);
    d->used += span;
    pthread_mutex_unlock(&g_mem);
    *ptr = (void *)r->base;
    return PHXRT_SUCCESS;
}

int RT(Free)(void *ptr)
{
    ENSURE_INIT();
    if (!ptr)
        return PHXRT_SUCCESS;
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_retire(ptr, R_DEVICE);
    if (!r) {
        pthread_mutex_unlock(&g_mem);
        return report(PHXRT_ERR_INVALID_VALUE); /* not the base of a live allocation */
    }
    struct device *d = &g.dev[r->device];
    /* drop the pages (a later reuse reads zeros, not old data), then fault on any access */
    madvise((void *)r->base, r->span, MADV_DONTNEED);
    mprotect((void *)r->base, r->span, PROT_NONE);
    d->used -= r->span;
    quarantine_add(d, r->base - (uintptr_t)d->arena, r->span);
    pthread_mutex_unlock(&g_mem);
    free(r);
    return PHXRT_SUCCESS;
}

/* -- host memory: pinned allocations and registrations ---------------------------- */

/* Enter a pinned allocation or a registration; host ranges must not overlap. */
static int host_range_add(struct range *r)
{
    pthread_mutex_lock(&g_mem);
    int rc = ranges_overlap(r->base, r->span) ? PHXRT_ERR_HOST_MEMORY_ALREADY_REGISTERED
             : ranges_insert(r)              ? PHXRT_ERR_MEMORY_ALLOCATION
                                             : PHXRT_SUCCESS;
    pthread_mutex_unlock(&g_mem);
    return rc;
}

int RT(MallocHost)(void **ptr, size_t size)
{
    ENSURE_INIT();
    if (!ptr || size == 0)
        return report(PHXRT_ERR_INVALID_VALUE);
    size_t span = round_up(size, (size_t)sysconf(_SC_PAGESIZE));
    if (span < size)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    /* Host memory is "pinned" by being known to the runtime; nothing is mlock'ed. */
    void *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct range *r = calloc(1, sizeof *r);
    if (p == MAP_FAILED || !r) {
        if (p != MAP_FAILED)
            munmap(p, span);
        free(r);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    *r = (struct range){.base = (uintptr_t)p, .size = size, .span = span, .type = R_PINNED, .device = tls_device};
    /* fresh pages overlap a registration only if the caller unmapped registered memory
     * without unregistering it: that is refused like any other overlap */
    int rc = host_range_add(r);
    if (rc != PHXRT_SUCCESS) {
        munmap(p, span);
        free(r);
        return report(rc);
    }
    *ptr = p;
    return PHXRT_SUCCESS;
}

int RT(FreeHost)(void *ptr)
{
    ENSURE_INIT();
    if (!ptr)
        return PHXRT_SUCCESS;
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_retire(ptr, R_PINNED);
    pthread_mutex_unlock(&g_mem);
    if (!r)
        return report(PHXRT_ERR_INVALID_VALUE);
    munmap(ptr, r->span);
    free(r);
    return PHXRT_SUCCESS;
}

int RT(HostRegister)(void *ptr, size_t size, unsigned flags)
{
    ENSURE_INIT();
    uintptr_t p = (uintptr_t)ptr;
    if (!ptr || size == 0 || p + size < p || (flags & ~HOST_REGISTER_FLAGS))
        return report(PHXRT_ERR_INVALID_VALUE);
    if (touches_arena(p, size))
        return report(PHXRT_ERR_INVALID_VALUE); /* device memory is not host memory */
    /* Only mapped memory can be pinned: msync fails with ENOMEM on any hole. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = p & ~(page - 1);
    if (msync((void *)first, round_up(p + size - first, page), MS_ASYNC) != 0)
        return report(PHXRT_ERR_INVALID_VALUE);
    struct range *r = calloc(1, sizeof *r);
    if (!r)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    *r = (struct range){.base = p, .size = size, .span = size, .type = R_REGISTERED, .device = tls_device};
    int rc = host_range_add(r);
    if (rc != PHXRT_SUCCESS)
        free(r);
    return report(rc);
}

int RT(HostUnregister)(void *ptr)
{
    ENSURE_INIT();
    if (!ptr)
        return report(PHXRT_ERR_INVALID_VALUE);
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_retire(ptr, R_REGISTERED);
    pthread_mutex_unlock(&g_mem);
    if (!r)
        return report(PHXRT_ERR_HOST_MEMORY_NOT_REGISTERED);
    free(r);
    return PHXRT_SUCCESS;
}

/* -- pointer queries --------------------------------------------------------------- */

int RT(PointerGetAttributes)(phxrtPointerAttributes *attr, const void *ptr)
{
    ENSURE_INIT();
    if (!attr)
        return report(PHXRT_ERR_INVALID_VALUE);
    /* CUDA's answer for memory the runtime does not know (freed device memory included) */
    *attr = (phxrtPointerAttributes){.device = -2};
    ATTR_SET_TYPE(attr, PHXRT_MEM_UNREGISTERED);
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find((uintptr_t)ptr);
    if (r) {
        attr->device = r->device;
        attr->devicePointer = (void *)ptr;
        if (r->type == R_DEVICE) {
            ATTR_SET_TYPE(attr, PHXRT_MEM_DEVICE);
        } else {
            ATTR_SET_TYPE(attr, PHXRT_MEM_HOST); /* mapped host memory: same address on both sides */
            attr->hostPointer = (void *)ptr;
        }
    }
    pthread_mutex_unlock(&g_mem);
    return PHXRT_SUCCESS;
}

int RT(MemGetAddressRange)(void **base, size_t *size, const void *ptr)
{
    ENSURE_INIT();
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find((uintptr_t)ptr);
    if (r) {
        if (base)
            *base = (void *)r->base;
        if (size)
            *size = r->size;
    }
    pthread_mutex_unlock(&g_mem);
    return r ? PHXRT_SUCCESS : report(PHXRT_ERR_INVALID_VALUE);
}

/* -- copies ------------------------------------------------------------------------ */

/* One side of a copy. A device side must lie inside one live allocation; a host side
 * must not touch any arena. The range holding the side (if any) goes to *pin. */
static int copy_side(uintptr_t p, size_t n, int on_device, struct range **pin)
{
    struct range *r;
    if (on_device) {
        if (arena_device(p) < 0)
            return PHXRT_ERR_INVALID_MEMCPY_DIRECTION; /* host memory given as device memory */
        r = ranges_find(p);
        if (!r || r->type != R_DEVICE || n > r->size - (p - r->base))
            return PHXRT_ERR_INVALID_VALUE; /* freed, never allocated, or runs past the end */
    } else {
        if (touches_arena(p, n))
            return PHXRT_ERR_INVALID_MEMCPY_DIRECTION; /* device memory given as host memory */
        r = ranges_find(p); /* pinned/registered memory is kept alive too */
    }
    *pin = r;
    return PHXRT_SUCCESS;
}

/* Check a copy against the memory it names and pin the ranges it touches, so they stay
 * alive until the copy ran (unpin after). n > 0. g_mem held. */
static int copy_prepare(void *dst, const void *src, size_t n, int kind, struct range *pins[2])
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    pins[0] = pins[1] = NULL;
    if (kind == PHXRT_DEFAULT) /* infer from the pointers, as unified addressing does */
        kind = (arena_device(s) >= 0 ? PHXRT_D2H : 0) | (arena_device(d) >= 0 ? PHXRT_H2D : 0);
    if (kind < PHXRT_H2H || kind > PHXRT_D2D)
        return PHXRT_ERR_INVALID_MEMCPY_DIRECTION;
    if (!dst || !src || d + n < d || s + n < s)
        return PHXRT_ERR_INVALID_VALUE;
    /* CUDA's kinds are bit sets: bit 0 (H2D) = dst on the device, bit 1 (D2H) = src on it */
    int rc = copy_side(d, n, kind & PHXRT_H2D, &pins[0]);
    if (rc == PHXRT_SUCCESS)
        rc = copy_side(s, n, kind & PHXRT_D2H, &pins[1]);
    if (rc != PHXRT_SUCCESS) {
        pins[0] = pins[1] = NULL;
        return rc;
    }
    for (int i = 0; i < 2; i++)
        if (pins[i])
            pins[i]->pins++;
    return PHXRT_SUCCESS;
}

/* -- streams ----------------------------------------------------------------------- */

struct op {
    struct op *next;
    phxrtHostFn_t fn; /* a host function, or NULL for a copy */
    void *arg;
    void *dst;
    const void *src;
    size_t n;
    struct range *pins[2];
};

struct stream {
    uint64_t id;    /* the handle; 0 for a device's default stream */
    int device;
    unsigned refs;  /* registry + callers inside the API (g_streams_mu) */
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    struct op *head, *tail; /* FIFO queue */
    struct op *spare;       /* recycled nodes: no malloc per op in steady state */
    int busy;               /* the worker is running an op */
    int closing;            /* destroy began: refuse new work */
    int stop;               /* the worker exits once the queue is empty */
    pthread_t worker;
};

static pthread_mutex_t g_streams_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stream **g_streams; /* live created streams, sorted by id (ids only grow) */
static size_t g_nstreams, g_capstreams;
/* Created streams' and events' handles start here: 0 is the default stream, and 1 and 2
 * are CUDA's cudaStreamLegacy and cudaStreamPerThread, which name the default stream
 * here too (one default stream per device: no per-thread ones). */
#define HANDLE_BASE 16
static uint64_t g_next_stream_id = HANDLE_BASE;

static void *stream_worker(void *arg)
{
    struct stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->work, &s->mu);
        struct op *o = s->head;
        if (!o)
            break; /* stop requested and the queue drained */
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);

        if (o->fn)
            o->fn(o->arg);
        else
            memmove(o->dst, o->src, o->n);
        unpin(o->pins);

        pthread_mutex_lock(&s->mu);
        o->next = s->spare;
        s->spare = o;
        s->busy = 0;
        if (!s->head)
            pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void stream_free(struct stream *s)
{
    for (struct op *o = s->spare, *next; o; o = next) {
        next = o->next;
        free(o);
    }
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->idle);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static struct stream *stream_new(int device)
{
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->device = device;
    s->refs = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->idle, NULL);
    /* The worker blocks asynchronous signals: they belong to the application's threads.
     * Not the synchronous ones: a fault the worker itself raises (SIGBUS: a copy from a
     * file mapping whose file was truncated) must reach the process's handler (phoenix's
     * file-mapping fault guard, faulthandler); blocked, the kernel kills the process. */
    sigset_t all, old;
    sigfillset(&all);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&s->worker, NULL, stream_worker, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        stream_free(s);
        return NULL;
    }
    return s;
}

/* Index of the created stream with this id in the registry, or -1. g_streams_mu held. */
static ptrdiff_t registry_find(uint64_t id)
{
    size_t lo = 0, hi = g_nstreams;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_streams[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < g_nstreams && g_streams[lo]->id == id) ? (ptrdiff_t)lo : -1;
}

/* Resolve a handle to a stream and hold a reference; 0 (and its aliases 1 and 2) is the
 * current device's default stream (created at first use, never destroyed). Release with
 * stream_release. */
static int stream_acquire(phxrtStream_t handle, struct stream **out)
{
    uint64_t id = (uintptr_t)handle;
    int rc = PHXRT_SUCCESS;
    pthread_mutex_lock(&g_streams_mu);
    if (id <= 2) {
        struct device *d = current_device(&rc);
        if (d && !d->default_stream && !(d->default_stream = stream_new(tls_device)))
            rc = PHXRT_ERR_MEMORY_ALLOCATION;
        *out = d ? d->default_stream : NULL;
    } else {
        ptrdiff_t i = registry_find(id);
        if (i >= 0) {
            *out = g_streams[i];
            (*out)->refs++;
        } else {
            rc = PHXRT_ERR_INVALID_RESOURCE_HANDLE; /* never created, or destroyed */
        }
    }
    pthread_mutex_unlock(&g_streams_mu);
    return rc;
}

static void stream_release(struct stream *s)
{
    if (s->id == 0)
        return; /* default streams live as long as the process */
    pthread_mutex_lock(&g_streams_mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&g_streams_mu);
    if (last)
        stream_free(s);
}

static void stream_wait_idle(struct stream *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Refuse new work, let queued work complete (as CUDA does), and join the worker. */
static void stream_stop(struct stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    while (s->head || s->busy)
        pthread_cond_wait(&s->idle, &s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->worker, NULL);
}

static int stream_push(struct stream *s, const struct op *op)
{
    pthread_mutex_lock(&s->mu);
    if (s->closing) {
        pthread_mutex_unlock(&s->mu);
        return PHXRT_ERR_INVALID_RESOURCE_HANDLE;
    }
    struct op *o = s->spare;
    if (o) {
        s->spare = o->next;
    } else if (!(o = malloc(sizeof *o))) {
        pthread_mutex_unlock(&s->mu);
        return PHXRT_ERR_MEMORY_ALLOCATION;
    }
    *o = *op;
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    return PHXRT_SUCCESS;
}

int RT(StreamCreateWithFlags)(phxrtStream_t *stream, unsigned flags)
{
    ENSURE_INIT();
    int rc;
    if (!current_device(&rc))
        return report(rc);
    if (!stream || (flags & ~STREAM_NONBLOCKING))
        return report(PHXRT_ERR_INVALID_VALUE);
    struct stream *s = stream_new(tls_device);
    if (!s)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    pthread_mutex_lock(&g_streams_mu);
    if (g_nstreams == g_capstreams) {
        size_t cap = g_capstreams ? 2 * g_capstreams : 16;
        struct stream **grown = realloc(g_streams, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_streams_mu);
            stream_stop(s);
            stream_free(s);
            return report(PHXRT_ERR_MEMORY_ALLOCATION);
        }
        g_streams = grown;
        g_capstreams = cap;
    }
    s->id = g_next_stream_id++; /* handles are ids, never reused: a stale one is detected */
    g_streams[g_nstreams++] = s;
    pthread_mutex_unlock(&g_streams_mu);
    *stream = (phxrtStream_t)(uintptr_t)s->id;
    return PHXRT_SUCCESS;
}

int RT(StreamDestroy)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s = NULL;
    pthread_mutex_lock(&g_streams_mu);
    ptrdiff_t i = stream ? registry_find((uintptr_t)stream) : -1;
    if (i >= 0) { /* unlink: later lookups fail; this call now owns the registry's reference */
        s = g_streams[i];
        memmove(&g_streams[i], &g_streams[i + 1], (g_nstreams - (size_t)i - 1) * sizeof *g_streams);
        g_nstreams--;
    }
    pthread_mutex_unlock(&g_streams_mu);
    if (!s)
        return report(PHXRT_ERR_INVALID_RESOURCE_HANDLE);
    stream_stop(s);
    stream_release(s);
    return PHXRT_SUCCESS;
}

int RT(StreamSynchronize)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    stream_wait_idle(s);
    stream_release(s);
    return PHXRT_SUCCESS;
}

int RT(StreamQuery)(phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&s->mu);
    int idle = !s->head && !s->busy;
    pthread_mutex_unlock(&s->mu);
    stream_release(s);
    return idle ? PHXRT_SUCCESS : PHXRT_ERR_NOT_READY; /* not an error: not recorded */
}

int RT(LaunchHostFunc)(phxrtStream_t stream, phxrtHostFn_t fn, void *arg)
{
    ENSURE_INIT();
    if (!fn)
        return report(PHXRT_ERR_INVALID_VALUE);
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    rc = stream_push(s, &(struct op){.fn = fn, .arg = arg});
    stream_release(s);
    return report(rc);
}

int RT(MemcpyAsync)(void *dst, const void *src, size_t n, int kind, phxrtStream_t stream)
{
    ENSURE_INIT();
    struct stream *s;
    int rc = stream_acquire(stream, &s);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    struct op op = {.dst = dst, .src = src, .n = n};
    if (n) { /* argument errors are reported now, at enqueue time */
        pthread_mutex_lock(&g_mem);
        rc = copy_prepare(dst, src, n, kind, op.pins);
        pthread_mutex_unlock(&g_mem);
        if (rc == PHXRT_SUCCESS && (rc = stream_push(s, &op)) != PHXRT_SUCCESS)
            unpin(op.pins);
    }
    stream_release(s);
    return report(rc);
}

int RT(Memcpy)(void *dst, const void *src, size_t n, int kind)
{
    ENSURE_INIT();
    if (n == 0)
        return PHXRT_SUCCESS;
    /* Ordered after work on the default stream, as cudaMemcpy is; runs in the caller. */
    struct device *d = g.ndev ? &g.dev[tls_device] : NULL;
    pthread_mutex_lock(&g_streams_mu);
    struct stream *dflt = d ? d->default_stream : NULL;
    pthread_mutex_unlock(&g_streams_mu);
    if (dflt)
        stream_wait_idle(dflt);

    struct range *pins[2];
    pthread_mutex_lock(&g_mem);
    int rc = copy_prepare(dst, src, n, kind, pins);
    pthread_mutex_unlock(&g_mem);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    memmove(dst, src, n);
    unpin(pins);
    return PHXRT_SUCCESS;
}

int RT(DeviceSynchronize)(void)
{
    ENSURE_INIT();
    int rc;
    struct device *d = current_device(&rc);
    if (!d)
        return report(rc);
    /* Hold a reference to each stream of the device, then wait for each outside the lock. */
    pthread_mutex_lock(&g_streams_mu);
    struct stream **held = malloc((g_nstreams + 1) * sizeof *held);
    size_t n = 0;
    if (held) {
        if (d->default_stream)
            held[n++] = d->default_stream;
        for (size_t i = 0; i < g_nstreams; i++)
            if (g_streams[i]->device == tls_device) {
                g_streams[i]->refs++;
                held[n++] = g_streams[i];
            }
    }
    pthread_mutex_unlock(&g_streams_mu);
    if (!held)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    for (size_t i = 0; i < n; i++) {
        stream_wait_idle(held[i]);
        stream_release(held[i]);
    }
    free(held);
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

int RT(HostGetDevicePointer)(void **device_ptr, void *host_ptr, unsigned flags)
{
    ENSURE_INIT();
    if (!device_ptr || !host_ptr || flags)
        return report(PHXRT_ERR_INVALID_VALUE);
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find((uintptr_t)host_ptr);
    int mapped = r && r->type != R_DEVICE;
    pthread_mutex_unlock(&g_mem);
    if (!mapped)
        return report(PHXRT_ERR_INVALID_VALUE); /* only pinned or registered host memory is mapped */
    *device_ptr = host_ptr; /* unified addressing: the same address on both sides */
    return PHXRT_SUCCESS;
}

int RT(Memset)(void *device_ptr, int value, size_t n)
{
    ENSURE_INIT();
    if (n == 0)
        return PHXRT_SUCCESS;
    /* Ordered after work on the default stream, as cudaMemset is; runs in the caller. */
    struct device *d = g.ndev ? &g.dev[tls_device] : NULL;
    pthread_mutex_lock(&g_streams_mu);
    struct stream *dflt = d ? d->default_stream : NULL;
    pthread_mutex_unlock(&g_streams_mu);
    if (dflt)
        stream_wait_idle(dflt);

    uintptr_t p = (uintptr_t)device_ptr;
    struct range *pins[2] = {NULL, NULL};
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find(p);
    int ok = r && r->type == R_DEVICE && n <= r->size - (p - r->base);
    if (ok)
        (pins[0] = r)->pins++;
    pthread_mutex_unlock(&g_mem);
    if (!ok)
        return report(PHXRT_ERR_INVALID_VALUE); /* not device memory, freed, or runs past the end */
    memset(device_ptr, value, n);
    unpin(pins);
    return PHXRT_SUCCESS;
}

/* -- events ---------------------------------------------------------------------------
 *
 * An event is an id (like a stream handle, so a destroyed one is recognised) naming its
 * latest record: Record queues a marker op on the stream that marks that record done
 * when the worker reaches it. Query, Synchronize and StreamWaitEvent look at the latest
 * record at the time of the call, as CUDA's do (a later Record does not change what an
 * earlier wait waits for; an event never recorded is complete). StreamWaitEvent queues
 * an op that holds the waiting stream until the record is done. Queued markers and waits
 * hold references, so Destroy with work in flight is safe (CUDA allows it). Locks:
 * g_events_mu guards the registry and the events' reference counts, each event's mu its
 * records (and their reference counts); never nested. */

struct event_record {
    unsigned refs; /* the event while it is the latest, the queued marker, waiters (ev->mu) */
    int done;
};

struct event {
    uint64_t id;
    unsigned refs;
    pthread_mutex_t mu;
    pthread_cond_t done;
    struct event_record *last; /* the latest record (NULL: never recorded) */
};

/* A queued marker or wait: the event (one reference) and the record it is about. */
struct event_op {
    struct event *ev;
    struct event_record *rec;
};

static pthread_mutex_t g_events_mu = PTHREAD_MUTEX_INITIALIZER;
static struct event **g_events; /* live events, sorted by id (ids only grow) */
static size_t g_nevents, g_capevents;
static uint64_t g_next_event_id = HANDLE_BASE;

static ptrdiff_t event_find(uint64_t id) /* g_events_mu held */
{
    size_t lo = 0, hi = g_nevents;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_events[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < g_nevents && g_events[lo]->id == id) ? (ptrdiff_t)lo : -1;
}

static int event_acquire(phxrtEvent_t handle, struct event **out)
{
    pthread_mutex_lock(&g_events_mu);
    ptrdiff_t i = handle ? event_find((uintptr_t)handle) : -1;
    if (i >= 0) {
        *out = g_events[i];
        (*out)->refs++;
    }
    pthread_mutex_unlock(&g_events_mu);
    return i >= 0 ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_RESOURCE_HANDLE;
}

static void record_unref(struct event_record *r) /* the event's mu held (or its last reference) */
{
    if (r && --r->refs == 0)
        free(r);
}

static void event_release(struct event *ev)
{
    pthread_mutex_lock(&g_events_mu);
    int last = --ev->refs == 0;
    pthread_mutex_unlock(&g_events_mu);
    if (last) {
        record_unref(ev->last);
        pthread_cond_destroy(&ev->done);
        pthread_mutex_destroy(&ev->mu);
        free(ev);
    }
}

/* The marker op: runs on the stream's worker once all earlier work on it finished. */
static void event_fire(void *arg)
{
    struct event_op *op = arg;
    struct event *ev = op->ev;
    pthread_mutex_lock(&ev->mu);
    op->rec->done = 1;
    record_unref(op->rec);
    pthread_cond_broadcast(&ev->done);
    pthread_mutex_unlock(&ev->mu);
    free(op);
    event_release(ev);
}

/* The wait op: holds the waiting stream until the record it was queued for is done. */
static void event_wait_op(void *arg)
{
    struct event_op *op = arg;
    struct event *ev = op->ev;
    pthread_mutex_lock(&ev->mu);
    while (!op->rec->done)
        pthread_cond_wait(&ev->done, &ev->mu);
    record_unref(op->rec);
    pthread_mutex_unlock(&ev->mu);
    free(op);
    event_release(ev);
}

/* The latest record of ev with a reference for the caller, or NULL (never recorded). */
static struct event_record *event_latest(struct event *ev)
{
    pthread_mutex_lock(&ev->mu);
    struct event_record *r = ev->last;
    if (r)
        r->refs++;
    pthread_mutex_unlock(&ev->mu);
    return r;
}

int RT(EventCreateWithFlags)(phxrtEvent_t *event, unsigned flags)
{
    ENSURE_INIT();
    if (!event || (flags & ~0xFu)) /* CUDA's: blocking sync, disable timing, interprocess, ... */
        return report(PHXRT_ERR_INVALID_VALUE);
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev)
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    ev->refs = 1;
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->done, NULL);
    pthread_mutex_lock(&g_events_mu);
    if (g_nevents == g_capevents) {
        size_t cap = g_capevents ? 2 * g_capevents : 16;
        struct event **grown = realloc(g_events, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g_events_mu);
            event_release(ev);
            return report(PHXRT_ERR_MEMORY_ALLOCATION);
        }
        g_events = grown;
        g_capevents = cap;
    }
    ev->id = g_next_event_id++;
    g_events[g_nevents++] = ev;
    pthread_mutex_unlock(&g_events_mu);
    *event = (phxrtEvent_t)(uintptr_t)ev->id;
    return PHXRT_SUCCESS;
}

int RT(EventCreate)(phxrtEvent_t *event)
{
    return RT(EventCreateWithFlags)(event, 0);
}

int RT(EventRecord)(phxrtEvent_t event, phxrtStream_t stream)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    struct stream *s;
    if ((rc = stream_acquire(stream, &s)) != PHXRT_SUCCESS) {
        event_release(ev);
        return report(rc);
    }
    struct event_op *op = malloc(sizeof *op);
    struct event_record *r = calloc(1, sizeof *r);
    if (!op || !r) {
        free(op);
        free(r);
        stream_release(s);
        event_release(ev);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    r->refs = 2; /* the event (as its latest record) and the marker */
    op->ev = ev; /* the reference taken above now belongs to the marker */
    op->rec = r;
    pthread_mutex_lock(&ev->mu);
    record_unref(ev->last);
    ev->last = r;
    pthread_mutex_unlock(&ev->mu);
    rc = stream_push(s, &(struct op){.fn = event_fire, .arg = op});
    stream_release(s);
    if (rc != PHXRT_SUCCESS) { /* never queued: complete it here, so waiters do not hang */
        event_fire(op);
        return report(rc);
    }
    return PHXRT_SUCCESS;
}

int RT(StreamWaitEvent)(phxrtStream_t stream, phxrtEvent_t event, unsigned flags)
{
    ENSURE_INIT();
    if (flags)
        return report(PHXRT_ERR_INVALID_VALUE); /* CUDA's only flag waits on external events */
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    struct stream *s;
    if ((rc = stream_acquire(stream, &s)) != PHXRT_SUCCESS) {
        event_release(ev);
        return report(rc);
    }
    struct event_record *r = event_latest(ev);
    if (!r) { /* never recorded: nothing to wait for */
        stream_release(s);
        event_release(ev);
        return PHXRT_SUCCESS;
    }
    struct event_op *op = malloc(sizeof *op);
    if (!op) {
        pthread_mutex_lock(&ev->mu);
        record_unref(r);
        pthread_mutex_unlock(&ev->mu);
        stream_release(s);
        event_release(ev);
        return report(PHXRT_ERR_MEMORY_ALLOCATION);
    }
    op->ev = ev; /* the references taken above now belong to the wait op */
    op->rec = r;
    rc = stream_push(s, &(struct op){.fn = event_wait_op, .arg = op});
    stream_release(s);
    if (rc != PHXRT_SUCCESS) {
        pthread_mutex_lock(&ev->mu);
        record_unref(r);
        pthread_mutex_unlock(&ev->mu);
        free(op);
        event_release(ev);
        return report(rc);
    }
    return PHXRT_SUCCESS;
}

int RT(EventQuery)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&ev->mu);
    int done = !ev->last || ev->last->done;
    pthread_mutex_unlock(&ev->mu);
    event_release(ev);
    return done ? PHXRT_SUCCESS : PHXRT_ERR_NOT_READY; /* not an error: not recorded */
}

int RT(EventSynchronize)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev;
    int rc = event_acquire(event, &ev);
    if (rc != PHXRT_SUCCESS)
        return report(rc);
    pthread_mutex_lock(&ev->mu);
    struct event_record *r = ev->last; /* the latest record before this call */
    if (r) {
        r->refs++;
        while (!r->done)
            pthread_cond_wait(&ev->done, &ev->mu);
        record_unref(r);
    }
    pthread_mutex_unlock(&ev->mu);
    event_release(ev);
    return PHXRT_SUCCESS;
}

int RT(EventDestroy)(phxrtEvent_t event)
{
    ENSURE_INIT();
    struct event *ev = NULL;
    pthread_mutex_lock(&g_events_mu);
    ptrdiff_t i = event ? event_find((uintptr_t)event) : -1;
    if (i >= 0) { /* unlink; queued markers and waits keep their references */
        ev = g_events[i];
        memmove(&g_events[i], &g_events[i + 1], (g_nevents - (size_t)i - 1) * sizeof *g_events);
        g_nevents--;
    }
    pthread_mutex_unlock(&g_events_mu);
    if (!ev)
        return report(PHXRT_ERR_INVALID_RESOURCE_HANDLE);
    event_release(ev);
    return PHXRT_SUCCESS;
}

/* -- the driver API of emulators built with PHXRT_DRIVER_PREFIX (cu*) ------------------- */

#ifdef PHXRT_DRIVER_PREFIX
#define DRIVER_STR STR(PHXRT_DRIVER_PREFIX)
enum { CU_NOT_INITIALIZED = 3, CU_NOT_SUPPORTED = 801, CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };

static int g_driver_initialized;

static const struct err_entry g_cu_errors[] = {
    {PHXRT_SUCCESS, "CUDA_SUCCESS", "no error"},
    {PHXRT_ERR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CU_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error (" DRIVER_STR "Init was not called)"},
    {PHXRT_ERR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {PHXRT_ERR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CU_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported (by the emulated driver)"},
};

#define ENSURE_DRIVER()                                                                            \
    do {                                                                                           \
        if (!__atomic_load_n(&g_driver_initialized, __ATOMIC_ACQUIRE))                             \
            return CU_NOT_INITIALIZED;                                                             \
    } while (0)

int DRV(Init)(unsigned flags)
{
    if (flags)
        return PHXRT_ERR_INVALID_VALUE;
    pthread_once(&g_once, init_once);
    if (g.status != PHXRT_SUCCESS)
        return g.status;
    __atomic_store_n(&g_driver_initialized, 1, __ATOMIC_RELEASE);
    return PHXRT_SUCCESS;
}

int DRV(DriverGetVersion)(int *version)
{
    if (!version)
        return PHXRT_ERR_INVALID_VALUE;
    *version = PHXRT_VERSION; /* answered before Init, as the real one is */
    return PHXRT_SUCCESS;
}

int DRV(DeviceGetCount)(int *count)
{
    ENSURE_DRIVER();
    if (!count)
        return PHXRT_ERR_INVALID_VALUE;
    *count = g.ndev;
    return PHXRT_SUCCESS;
}

int DRV(DeviceGetName)(char *buf, int len, int device)
{
    ENSURE_DRIVER();
    if (device < 0 || device >= g.ndev)
        return PHXRT_ERR_INVALID_DEVICE;
    if (!buf || len <= 0)
        return PHXRT_ERR_INVALID_VALUE;
    snprintf(buf, (size_t)len, "%s", DEVICE_NAME); /* truncates, as cuDeviceGetName does */
    return PHXRT_SUCCESS;
}

int DRV(PointerGetAttribute)(void *data, int attribute, unsigned long long ptr)
{
    ENSURE_DRIVER();
    if (!data)
        return PHXRT_ERR_INVALID_VALUE;
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find((uintptr_t)ptr);
    struct range copy = r ? *r : (struct range){0};
    pthread_mutex_unlock(&g_mem);
    if (!r)
        return PHXRT_ERR_INVALID_VALUE; /* memory the driver does not know: cuPointerGetAttribute's answer */
    switch (attribute) {
    case PHXRT_CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = copy.type == R_DEVICE ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case PHXRT_CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (attribute == PHXRT_CU_POINTER_ATTRIBUTE_HOST_POINTER && copy.type == R_DEVICE)
            return PHXRT_ERR_INVALID_VALUE;
        *(unsigned long long *)data = ptr;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = copy.device;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(unsigned long long *)data = copy.base;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = copy.size;
        break;
    default:
        return CU_NOT_SUPPORTED;
    }
    return PHXRT_SUCCESS;
}

int DRV(GetErrorName)(int error, const char **name)
{
    if (!name)
        return PHXRT_ERR_INVALID_VALUE;
    const struct err_entry *e = err_find(g_cu_errors, sizeof g_cu_errors / sizeof g_cu_errors[0], error);
    *name = e ? e->name : NULL;
    return e ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_VALUE;
}

int DRV(GetErrorString)(int error, const char **message)
{
    if (!message)
        return PHXRT_ERR_INVALID_VALUE;
    const struct err_entry *e = err_find(g_cu_errors, sizeof g_cu_errors / sizeof g_cu_errors[0], error);
    *message = e ? e->message : NULL;
    return e ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_VALUE;
}
#endif /* PHXRT_DRIVER_PREFIX */
