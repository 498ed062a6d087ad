/* The bounce pool: pinned host memory for staged transfers.
 *
 * Core side, data path. Segments of host memory (2 MiB aligned, transparent huge
 * pages asked for) are allocated on first need up to the pool's limit
 * (PHX_BOUNCE_POOL_SIZE) and pinned through the vendor table's host_register, so the
 * vendor's copies DMA from them. A slot is a run of 64 KiB units found first-fit in a
 * segment's bitmap: a 16 MiB chunk and a 64 KiB random read each take what they need,
 * so small requests keep many reads in flight.
 *
 * Who calls: workers (pool_alloc, non-blocking: a chunk that finds no room parks and
 * its worker is woken by the next free), stream-op submission (pool_alloc_many,
 * blocking, all or nothing, so two ops never deadlock holding half of what they need),
 * and stream callbacks (pool_free only: no vendor call, so they may).
 * Growing the pool calls host_register: only from workers and submitters.
 */
#include "io_ctx.h"
#include "io_pool.h"
#include "io_worker.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

uint64_t pool_round(uint64_t bytes) { return align_up(bytes ? bytes : 1, IO_POOL_UNIT); }

int pool_init(struct io_pool *p, struct phx_ctx *ctx, uint64_t limit, uint64_t max_slot,
              const struct phx_dp_table *dp)
{
    memset(p, 0, sizeof(*p));
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->ctx = ctx;
    p->dp = dp;
    max_slot = pool_round(max_slot);
    limit = pool_round(limit); /* whole units: a segment rounded up to them must fit it */
    /* a segment is a whole number of the largest slots (~64 MiB), so that no segment
     * wastes the tail a big slot does not fit in */
    uint64_t k = (64ull << 20) / max_slot;
    uint64_t seg = max_slot * (k ? k : 1);
    uint64_t per = align_up((limit + IO_MAX_SEGS - 1) / IO_MAX_SEGS, IO_POOL_UNIT);
    if (seg < per)
        seg = max_slot * ((per + max_slot - 1) / max_slot);
    if (limit < max_slot)
        limit = max_slot; /* one slot always fits */
    if (seg > limit)
        seg = align_up(limit, IO_POOL_UNIT);
    p->seg_size = seg;
    p->limit = limit;
    return 0;
}

void pool_fini(struct io_pool *p)
{
    for (int i = 0; i < p->nsegs; i++) {
        struct io_seg *s = &p->segs[i];
        if (s->registered && p->dp && p->dp->host_unregister)
            p->dp->host_unregister(s->base);
        free(s->base);
        free(s->bits);
        STAT_ADD(bounce_bytes, -(int64_t)s->size);
    }
    STAT_ADD(bounce_in_use, -(int64_t)p->in_use);
    p->nsegs = 0;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

/* First run of n free units in s; -1 if none. */
static int64_t seg_find(struct io_seg *s, uint32_t n)
{
    uint32_t run = 0, start = 0;
    for (uint32_t i = 0; i < s->nunits;) {
        uint64_t w = s->bits[i >> 6];
        if ((i & 63) == 0 && w == ~0ull) { /* a full word: skip it */
            run = 0;
            i += 64;
            continue;
        }
        if ((i & 63) == 0 && w == 0 && i + 64 <= s->nunits) {
            if (!run)
                start = i;
            run += 64;
            i += 64;
            if (run >= n)
                return start;
            continue;
        }
        if (w & (1ull << (i & 63))) {
            run = 0;
        } else {
            if (!run)
                start = i;
            if (++run >= n)
                return start;
        }
        i++;
    }
    return -1;
}

static void seg_mark(struct io_seg *s, uint32_t start, uint32_t n, int set)
{
    for (uint32_t i = start; i < start + n; i++) {
        if (set)
            s->bits[i >> 6] |= 1ull << (i & 63);
        else
            s->bits[i >> 6] &= ~(1ull << (i & 63));
    }
    if (set)
        s->used += n;
    else
        s->used -= n;
}

/* Add a segment (p->mu held; registering takes a while, which is fine: it happens a
 * few times per context). */
static struct io_seg *pool_grow(struct io_pool *p)
{
    if (p->nsegs >= IO_MAX_SEGS || p->allocated + p->seg_size > p->limit)
        return NULL;
    struct io_seg *s = &p->segs[p->nsegs];
    memset(s, 0, sizeof(*s));
    void *mem = NULL;
    if (posix_memalign(&mem, 2u << 20, p->seg_size) != 0)
        return NULL;
    madvise(mem, p->seg_size, MADV_HUGEPAGE);
    s->nunits = (uint32_t)(p->seg_size / IO_POOL_UNIT);
    s->bits = calloc((s->nunits + 63) / 64, sizeof(uint64_t));
    if (!s->bits) {
        free(mem);
        return NULL;
    }
    s->base = mem;
    s->size = p->seg_size;
    if (p->dp && p->dp->host_register) {
        /* Unpinned slots still work (the vendor's copy of pageable memory is slower). */
        s->registered = p->dp->host_register(mem, p->seg_size, p->dp->host_register_flags) == p->dp->success;
    }
    __atomic_store_n(&p->nsegs, p->nsegs + 1, __ATOMIC_RELEASE); /* pool_seg_of reads it unlocked */
    p->allocated += p->seg_size;
    STAT_ADD(bounce_bytes, (int64_t)p->seg_size);
    return s;
}

int pool_seg_of(struct io_pool *p, const char *ptr, uint64_t len)
{
    int n = __atomic_load_n(&p->nsegs, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++) {
        const struct io_seg *s = &p->segs[i];
        if (ptr >= s->base && ptr + len <= s->base + s->size)
            return i;
    }
    return -1;
}

static void *alloc_locked(struct io_pool *p, uint64_t bytes)
{
    uint32_t n = (uint32_t)(pool_round(bytes) / IO_POOL_UNIT);
    for (int i = 0; i < p->nsegs; i++) {
        struct io_seg *s = &p->segs[i];
        if (s->nunits - s->used < n)
            continue;
        int64_t at = seg_find(s, n);
        if (at >= 0) {
            seg_mark(s, (uint32_t)at, n, 1);
            p->in_use += (uint64_t)n * IO_POOL_UNIT;
            return s->base + (uint64_t)at * IO_POOL_UNIT;
        }
    }
    struct io_seg *s = pool_grow(p);
    if (!s || s->nunits < n)
        return NULL;
    seg_mark(s, 0, n, 1);
    p->in_use += (uint64_t)n * IO_POOL_UNIT;
    return s->base;
}

static void wake_locked(struct io_pool *p);

void *pool_alloc(struct io_pool *p, uint64_t bytes, uint64_t cap, struct io_worker *waiter, int *never)
{
    *never = 0;
    pthread_mutex_lock(&p->mu);
    /* under the cap, or nothing in use (a slot larger than the cap still gets through) */
    int room = !cap || !p->in_use || p->in_use + pool_round(bytes) <= cap;
    void *ptr = room ? alloc_locked(p, bytes) : NULL;
    if (!ptr && !p->in_use) {
        /* nothing in use, and the pool could not give it (its memory could not be
         * allocated): no slot will come back to wait for. Those who wait retry and learn
         * it too. */
        *never = 1;
        wake_locked(p);
        pthread_mutex_unlock(&p->mu);
        return NULL;
    }
    if (!ptr && waiter && !waiter->pool_wait) {
        /* registered under the lock, so the next pool_free cannot miss us */
        waiter->pool_wait = 1;
        atomic_fetch_add(&p->worker_waiters, 1);
    }
    pthread_mutex_unlock(&p->mu);
    if (ptr)
        STAT_ADD(bounce_in_use, (int64_t)pool_round(bytes));
    return ptr;
}

/* Give a slot's units back (p->mu held). */
static void free_locked(struct io_pool *p, void *ptr, uint64_t bytes)
{
    uint32_t n = (uint32_t)(pool_round(bytes) / IO_POOL_UNIT);
    for (int i = 0; i < p->nsegs; i++) {
        struct io_seg *s = &p->segs[i];
        if ((char *)ptr >= s->base && (char *)ptr < s->base + s->size) {
            seg_mark(s, (uint32_t)(((char *)ptr - s->base) / IO_POOL_UNIT), n, 0);
            break;
        }
    }
    p->in_use -= (uint64_t)n * IO_POOL_UNIT;
}

/* Units came back (p->mu held): wake every thread and worker that waits for some. Every
 * path that gives units back ends here, so that no waiter sleeps past a free (a worker
 * that parked a chunk retries only once woken). */
static void wake_locked(struct io_pool *p)
{
    if (p->cond_waiters)
        pthread_cond_broadcast(&p->cv);
    if (atomic_load(&p->worker_waiters) > 0) {
        struct phx_ctx *ctx = p->ctx;
        for (int i = 0; i < ctx->nworkers; i++) {
            struct io_worker *w = &ctx->workers[i];
            if (w->pool_wait) {
                w->pool_wait = 0;
                atomic_fetch_sub(&p->worker_waiters, 1);
                worker_wake(w);
            }
        }
    }
}

int pool_alloc_many(struct io_pool *p, int n, uint64_t bytes, char **out)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        int got = 0;
        for (; got < n; got++) {
            out[got] = alloc_locked(p, bytes);
            if (!out[got])
                break;
        }
        if (got == n)
            break;
        /* not all: give back what we took (waking whoever failed meanwhile) and wait */
        for (int i = 0; i < got; i++)
            free_locked(p, out[i], bytes);
        if (got)
            wake_locked(p);
        if (p->in_use == 0) { /* nothing will be freed: the request can never fit */
            pthread_mutex_unlock(&p->mu);
            return -ENOMEM;
        }
        p->cond_waiters++;
        pthread_cond_wait(&p->cv, &p->mu);
        p->cond_waiters--;
    }
    pthread_mutex_unlock(&p->mu);
    STAT_ADD(bounce_in_use, (int64_t)pool_round(bytes) * n);
    return 0;
}

void pool_free(struct io_pool *p, void *ptr, uint64_t bytes)
{
    if (!ptr)
        return;
    pthread_mutex_lock(&p->mu);
    free_locked(p, ptr, bytes);
    wake_locked(p);
    pthread_mutex_unlock(&p->mu);
    STAT_ADD(bounce_in_use, -(int64_t)pool_round(bytes));
}

/* Grow the pool to its limit now (phx_ctx_prepare). */
int64_t pool_prepare(struct io_pool *p)
{
    pthread_mutex_lock(&p->mu);
    while (pool_grow(p))
        ;
    int64_t pinned = 0, total = 0;
    for (int i = 0; i < p->nsegs; i++) {
        total += (int64_t)p->segs[i].size;
        if (p->segs[i].registered)
            pinned += (int64_t)p->segs[i].size;
    }
    pthread_mutex_unlock(&p->mu);
    if (total == 0)
        return -ENOMEM;
    return p->dp ? pinned : total;
}
