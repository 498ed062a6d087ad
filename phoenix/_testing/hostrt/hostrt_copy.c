/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: copies.
 *
 * Test side (a vendor runtime's test double, outside the C core), part of
 * libphxhostrt.so and of every emulator. This file: Memcpy, MemcpyAsync and Memset,
 * and the checks every copy passes first: the kind against the pointers (a host
 * pointer given as the device side is an error), a device extent inside one live
 * allocation, and pins on the ranges a copy names so they outlive it (hostrt_mem.c).
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

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
