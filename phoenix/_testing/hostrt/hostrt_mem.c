/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: memory.
 *
 * Test side (a vendor runtime's test double, outside the C core), part of
 * libphxhostrt.so and of every emulator (hostrt.c says what the whole runtime keeps
 * true). This file: the per-device arenas whose freed memory faults (PROT_NONE again,
 * then a FIFO quarantine), the sorted range table of device allocations, pinned
 * allocations and registrations (pins keep a range alive while copies name it),
 * Malloc/Free, MallocHost/FreeHost, HostRegister/HostUnregister, pointer attributes,
 * address ranges and HostGetDevicePointer. Locks: g_mem (hostrt_internal.h).
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

static pthread_cond_t g_unpinned = PTHREAD_COND_INITIALIZER; /* a dying range lost its last pin */

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
struct range *ranges_find(uintptr_t addr)
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

void unpin(struct range *pins[2])
{
    if (!pins[0] && !pins[1])
        return;
    pthread_mutex_lock(&g_mem);
    for (int i = 0; i < 2; i++) {
        if (pins[i] && --pins[i]->pins == 0 && pins[i]->dying)
            pthread_cond_broadcast(&g_unpinned);
        pins[i] = NULL;
    }
    pthread_mutex_unlock(&g_mem);
}

/* fork: the ranges stay (the memory is the child's too); a Free that waited for pins in
 * the parent is gone with its thread (its range stays dying, out of service). */
void mem_fork(int phase)
{
    if (phase == FORK_PREPARE) {
        pthread_mutex_lock(&g_mem);
    } else if (phase == FORK_PARENT) {
        pthread_mutex_unlock(&g_mem);
    } else {
        pthread_mutex_init(&g_mem, NULL);
        pthread_cond_init(&g_unpinned, NULL);
    }
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
