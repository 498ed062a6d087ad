/* The context (io_ctx.c): workers, the chunk queues, the bounce pool, the file-mapping
 * cache and a copy of the vendor's data-path table.
 *
 * Core side. Created and destroyed on the control plane; every request and stream op
 * holds a reference (ctx_get/put) that destroy waits for.
 */
#ifndef PHX_IO_CTX_H
#define PHX_IO_CTX_H

#include "io_common.h"
#include "io_fmap.h"
#include "io_fork.h"
#include "io_pool.h"

struct io_chunk;
struct io_worker;
struct phx_ctx {
    struct phx_io_config cfg;
    int engine;
    char engine_why[200];
    int has_dp;
    struct phx_dp_table dp;
    int has_events;           /* the data path has events: fences wait on the device */
    pthread_mutex_t fence_mu; /* the free list */
    struct phx_fence *fence_free;
    uint64_t chunk, stage_chunk;
    uint64_t worker_bytes; /* device I/O bytes in flight per io_uring worker; chunks cut at most this */
    struct io_pool pool;
    pthread_mutex_t qmu;
    /* (qmu) the queues, one per priority ([0] normal, [1] background): normal chunks
     * are taken first, a background one after every IO_BG_EVERY normal ones taken while
     * background chunks wait (q_streak counts them) */
    struct io_chunk *q_head[2], *q_tail[2];
    int64_t qlen;             /* (qmu) chunks queued (both) */
    uint32_t q_streak, iq_streak;
    /* (qmu) chunks of stream ops' own requests: taken first, also by workers whose other
     * chunks are parked for bounce slots. Stream ops hold their slots from submission
     * on, and their callbacks block the caller's stream until these run: behind chunks
     * that wait for those very slots they would deadlock. They never need a slot. */
    struct io_chunk *iq_head[2], *iq_tail[2]; /* ... by priority too */
    /* chunks taken from the queues and not finished, by priority, and when the last
     * normal one finished: background chunks are held back while loads run (bg_ok) */
    _Atomic int normal_busy, bg_busy;
    _Atomic int64_t normal_last_ns;
    int nworkers;
    struct io_worker *workers;
    struct io_worker **idle;  /* (qmu) stack of idle workers */
    int nidle;
    _Atomic int stop;
    pthread_mutex_t mu;       /* inflight / destroy */
    pthread_cond_t cv;
    int64_t inflight;         /* requests + stream ops */
    struct io_fmap fmap;
    uint64_t gen;             /* io_fork_gen when made (io_fork.c) */
};

/* Made by the parent of this process before it forked: its threads do not exist here. */
static inline int ctx_forked(const phx_ctx *ctx) { return ctx->gen != io_gen(); }

#pragma GCC visibility push(hidden)
/* Count a request or stream op in (-ESHUTDOWN once stopping) and out (wakes destroy). */
int ctx_get(phx_ctx *ctx);
void ctx_put(phx_ctx *ctx);
/* io_worker.c: queue a list of n chunks (linked by ->next) and wake idle workers for
 * them; `internal`: a stream op's own chunks (ctx->iq_head); `prio`: enum phx_priority
 * (1: the background queue). */
void queue_push(phx_ctx *ctx, struct io_chunk *head, struct io_chunk *tail, int n, int internal, int prio);
/* io_worker.c: start the context's workers for `engine` (0, or -errno with every
 * started worker stopped again and engine_why saying why), and stop the first n. */
int workers_start(phx_ctx *ctx, int engine);
void workers_stop(phx_ctx *ctx, int n);
#pragma GCC visibility pop

#endif
