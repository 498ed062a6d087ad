/* The context: its lifecycle, references, resolved sizes and engine.
 *
 * Core side, control plane (create, destroy, prepare, queries) with the data path's
 * references (ctx_get/put: every request and stream op holds one, destroy waits for
 * them). A context is a worker pool (io_worker.c) for one engine, a bounce pool
 * (io_pool.c), the file-mapping cache (io_fmap*.c), the fences' free list (io_order.c)
 * and a copy of the vendor's data-path table.
 */
#include "io_ctx.h"
#include "io_order.h"
#include "io_ring.h"
#include "io_worker.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int phx_engine_probe(int engine, char *why, size_t why_len)
{
    char rwhy[200] = "";
    if (engine == PHX_ENGINE_THREADS) {
        snprintf(why, why_len, "threads: pread/pwrite worker threads (PHX_IO_ENGINE=threads)");
        return PHX_ENGINE_THREADS;
    }
    if (engine != PHX_ENGINE_AUTO && engine != PHX_ENGINE_IO_URING) {
        snprintf(why, why_len, "unknown engine %d", engine);
        return -EINVAL;
    }
    int rc = ring_probe(rwhy, sizeof(rwhy));
    if (engine == PHX_ENGINE_IO_URING) {
        snprintf(why, why_len, "%s%s", rc < 0 ? "io_uring unavailable: " : "io_uring: ", rwhy);
        return rc < 0 ? rc : PHX_ENGINE_IO_URING;
    }
    if (rc == 0) {
        snprintf(why, why_len, "io_uring: %s", rwhy);
        return PHX_ENGINE_IO_URING;
    }
    snprintf(why, why_len, "threads: io_uring unavailable (%s)", rwhy);
    return PHX_ENGINE_THREADS;
}

/* ---- context references ---------------------------------------------------------------- */

int ctx_get(phx_ctx *ctx)
{
    pthread_mutex_lock(&ctx->mu);
    int rc = atomic_load(&ctx->stop) ? -ESHUTDOWN : 0;
    if (!rc)
        ctx->inflight++;
    pthread_mutex_unlock(&ctx->mu);
    return rc;
}

void ctx_put(phx_ctx *ctx)
{
    pthread_mutex_lock(&ctx->mu);
    if (--ctx->inflight == 0)
        pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
}

static void ctx_free(phx_ctx *ctx)
{
    fmap_fini(ctx); /* after the workers: no request is left to use a window */
    fence_fini(ctx);
    pool_fini(&ctx->pool);
    pthread_mutex_destroy(&ctx->qmu);
    pthread_mutex_destroy(&ctx->mu);
    pthread_cond_destroy(&ctx->cv);
    free(ctx->workers);
    free(ctx->idle);
    free(ctx);
}

static int ctx_create_engine(const struct phx_io_config *cfg, const struct phx_dp_table *dp, int engine,
                             const char *engine_why, phx_ctx **out)
{
    phx_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return -ENOMEM;
    ctx->cfg = *cfg;
    ctx->gen = io_gen();
    ctx->engine = engine;
    snprintf(ctx->engine_why, sizeof(ctx->engine_why), "%s", engine_why);
    if (dp) {
        ctx->dp = *dp;
        ctx->has_dp = 1;
        ctx->has_events = phx_dp_has_events(dp);
    }
    pthread_mutex_init(&ctx->fence_mu, NULL);
    ctx->chunk = cfg->chunk_size;
    ctx->worker_bytes = IO_WORKER_BYTES;
    if (cfg->inflight) {
        /* the budget split over the workers, in 64 KiB units (a pool slot's) */
        uint64_t share = align_down(cfg->inflight / cfg->threads, IO_POOL_UNIT);
        ctx->worker_bytes = share < IO_WORKER_MIN_BYTES ? IO_WORKER_MIN_BYTES : share;
    }
    fmap_init(ctx);
    /* bounce pool 0 = auto: four slots of a device chunk per worker (one being read, the
     * others waiting for or in their device copy and its completion callback), so that no
     * worker waits for a slot at the configured concurrency: two slots per worker throttled
     * warm staged reads (a slot lives for the read, the copy and the callback's latency) */
    if (ctx->cfg.bounce_pool_size == 0) {
        uint64_t c = cfg->chunk_size < ctx->worker_bytes ? cfg->chunk_size : ctx->worker_bytes;
        uint64_t want = 4ull * cfg->threads * pool_round(c + 2 * IO_MAX_ALIGN);
        want = want < (256ull << 20) ? (256ull << 20) : want > (4ull << 30) ? (4ull << 30) : want;
        ctx->cfg.bounce_pool_size = align_up(want, IO_POOL_UNIT);
    }
    cfg = &ctx->cfg;
    /* staged chunks: at least two slots fit in the pool, so the pipeline can overlap */
    uint64_t half = align_down(cfg->bounce_pool_size / 2, IO_POOL_UNIT);
    if (half > 2 * IO_MAX_ALIGN)
        half -= 2 * IO_MAX_ALIGN;
    ctx->stage_chunk = cfg->chunk_size < half ? cfg->chunk_size : align_down(half, 4096);
    if (ctx->stage_chunk < IO_POOL_UNIT)
        ctx->stage_chunk = IO_POOL_UNIT;
    /* the largest slot: a staged chunk aligned up to the file's alignment, plus where its
     * file offset lands in it (< one alignment), plus a stream op's margin */
    pool_init(&ctx->pool, ctx, cfg->bounce_pool_size, ctx->stage_chunk + 3 * IO_MAX_ALIGN, ctx->has_dp ? &ctx->dp : NULL);
    pthread_mutex_init(&ctx->qmu, NULL);
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);
    ctx->nworkers = (int)cfg->threads;
    ctx->workers = calloc((size_t)ctx->nworkers, sizeof(*ctx->workers));
    ctx->idle = calloc((size_t)ctx->nworkers, sizeof(*ctx->idle));
    if (!ctx->workers || !ctx->idle) {
        ctx_free(ctx);
        return -ENOMEM;
    }
    int rc = workers_start(ctx, engine);
    if (rc < 0) {
        ctx_free(ctx);
        return rc;
    }
    STAT_ADD(contexts, 1);
    *out = ctx;
    return 0;
}

int phx_ctx_create(const struct phx_io_config *cfg, const struct phx_dp_table *dp, phx_ctx **out)
{
    if (!cfg || !out)
        return -EINVAL;
    if (cfg->threads < 1 || cfg->threads > 1024 || cfg->queue_depth < 1 || cfg->queue_depth > 4096 ||
        cfg->chunk_size < 4096 || cfg->chunk_size % 4096 || cfg->chunk_size > IO_MAX_CHUNK)
        return -EINVAL;
    if (dp) {
        if (dp->abi_version != PHX_DP_ABI || !dp->set_device || !dp->memcpy_async || !dp->stream_create ||
            !dp->stream_synchronize || !dp->stream_destroy || !dp->launch_host_func)
            return -EINVAL;
    }
    char why[200];
    int engine = phx_engine_probe(cfg->engine, why, sizeof(why));
    if (engine < 0)
        return engine;
    int rc = ctx_create_engine(cfg, dp, engine, why, out);
    if (rc < 0 && engine == PHX_ENGINE_IO_URING && cfg->engine == PHX_ENGINE_AUTO) {
        char why2[200];
        snprintf(why2, sizeof(why2), "threads: io_uring rings could not be set up (%s)", strerror(-rc));
        rc = ctx_create_engine(cfg, dp, PHX_ENGINE_THREADS, why2, out);
    }
    return rc;
}

int phx_ctx_engine(const phx_ctx *ctx, char *why, size_t why_len)
{
    if (why && why_len)
        snprintf(why, why_len, "%s", ctx->engine_why);
    return ctx->engine;
}

int phx_ctx_sizes(const phx_ctx *ctx, struct phx_ctx_sizes *out)
{
    if (!ctx || !out)
        return -EINVAL;
    out->bounce_pool = ctx->pool.limit;
    out->chunk = ctx->chunk;
    out->staged_chunk = ctx->stage_chunk;
    out->max_slot = pool_round(ctx->stage_chunk + 3 * IO_MAX_ALIGN);
    out->worker_bytes = ctx->worker_bytes;
    return 0;
}

int64_t phx_ctx_prepare(phx_ctx *ctx)
{
    if (!ctx)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    if (!ctx->has_dp)
        return 0; /* no staging without a data path: nothing to pin */
    return pool_prepare(&ctx->pool);
}

/* A parent's context in a forked child: its workers and registrar do not exist (nothing to
 * wait for or join) and its locks may have been held by them. It is forgotten, not freed:
 * its memory, bounce pool and vendor streams leak; the counters let it go. */
static void ctx_forget(phx_ctx *ctx)
{
    int64_t streams = 0;
    for (int i = 0; i < ctx->nworkers; i++)
        for (int d = 0; d < IO_MAX_DEVICES; d++)
            streams += ctx->workers[i].streams[d] != NULL;
    int64_t bytes = 0;
    for (int i = 0; i < ctx->pool.nsegs; i++)
        bytes += (int64_t)ctx->pool.segs[i].size;
    STAT_ADD(worker_streams, -streams);
    STAT_ADD(bounce_bytes, -bytes);
    STAT_ADD(bounce_in_use, -(int64_t)ctx->pool.in_use);
    STAT_ADD(contexts, -1);
}

void phx_ctx_destroy(phx_ctx *ctx)
{
    if (!ctx)
        return;
    if (ctx_forked(ctx)) {
        ctx_forget(ctx);
        return;
    }
    pthread_mutex_lock(&ctx->mu);
    while (ctx->inflight > 0)
        pthread_cond_wait(&ctx->cv, &ctx->mu);
    pthread_mutex_unlock(&ctx->mu);
    workers_stop(ctx, ctx->nworkers);
    ctx_free(ctx);
    STAT_ADD(contexts, -1);
}
