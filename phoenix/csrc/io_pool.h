/* The bounce pool (io_pool.c): pinned host memory for staged transfers.
 *
 * Core side, data path: workers and stream-op submitters take slots, stream callbacks
 * give them back (pool_free: no vendor call).
 */
#ifndef PHX_IO_POOL_H
#define PHX_IO_POOL_H

#include "io_common.h"

#define IO_MAX_SEGS 64

struct io_worker;
struct phx_ctx;
struct io_seg {
    char *base;
    uint64_t size;
    uint32_t nunits, used;
    uint64_t *bits;
    int registered;
};
struct io_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct io_seg segs[IO_MAX_SEGS];
    int nsegs;
    uint64_t limit, seg_size, allocated, in_use;
    const struct phx_dp_table *dp; /* NULL: slots are not host-registered */
    int cond_waiters;              /* threads blocked in pool_alloc_many */
    _Atomic int worker_waiters;    /* workers with a parked chunk */
    struct phx_ctx *ctx;
};

#pragma GCC visibility push(hidden)
int pool_init(struct io_pool *p, struct phx_ctx *ctx, uint64_t limit, uint64_t max_slot,
              const struct phx_dp_table *dp);
void pool_fini(struct io_pool *p);
/* Non-blocking: NULL when the pool is full, or when `cap` (0: none) bytes of it are in
 * use already; `waiter` (if any) is then woken by the next pool_free. *never: NULL and
 * nothing is in use (the pool's memory could not be allocated): no free will come, the
 * caller fails with ENOMEM instead of waiting. */
void *pool_alloc(struct io_pool *p, uint64_t bytes, uint64_t cap, struct io_worker *waiter, int *never);
/* Blocking, all or nothing: n slots of `bytes` each. */
int pool_alloc_many(struct io_pool *p, int n, uint64_t bytes, char **out);
void pool_free(struct io_pool *p, void *ptr, uint64_t bytes);
int64_t pool_prepare(struct io_pool *p);
uint64_t pool_round(uint64_t bytes);
/* The segment holding [ptr, ptr + len) (its index), or -1: not a pool slot. Lock-free
 * (segments are only ever added, never moved or freed while the pool lives). */
int pool_seg_of(struct io_pool *p, const char *ptr, uint64_t len);
#pragma GCC visibility pop

#endif
