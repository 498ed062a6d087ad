/* Ordering with the caller's stream: fences (phx_io.h states the rule).
 *
 * Core side, data path. A fence is one vendor event recorded on the caller's stream in
 * the caller's thread, shared by the requests of one call (each holds a reference).
 * Where a request touches its memory it waits for the fence:
 *   device copies   the worker's stream waits for the event (stream_wait_event), once
 *                   per fence and worker stream: the file I/O into bounce slots runs
 *                   meanwhile, only the copies wait for the caller's work;
 *   CPU or disk     phx_submit waits for the event on the host before queueing
 *                   (event_synchronize, once per fence).
 * Events are reused: a fence whose last reference goes returns to the context's free
 * list with its event (no vendor call: that may happen in a stream callback) and is
 * recorded again by a later call; they are destroyed with the context.
 */
#include "io_ctx.h"
#include "io_order.h"
#include "io_worker.h"

#include <errno.h>
#include <stdlib.h>

static _Atomic uint64_t fence_ids;

/* A free fence of `device`, or a new one whose event is created on the current device
 * (the caller made it `device`). NULL: out of memory or the vendor refused. */
static phx_fence *fence_get(phx_ctx *ctx, int device)
{
    pthread_mutex_lock(&ctx->fence_mu);
    phx_fence **pp = &ctx->fence_free, *f;
    while ((f = *pp) && f->device != device)
        pp = &f->next;
    if (f)
        *pp = f->next;
    pthread_mutex_unlock(&ctx->fence_mu);
    if (f)
        return f;
    const struct phx_dp_table *dp = &ctx->dp;
    f = calloc(1, sizeof(*f));
    if (!f)
        return NULL;
    if (dp->event_create(&f->event, dp->event_flags) != dp->success) {
        free(f);
        return NULL;
    }
    f->ctx = ctx;
    f->device = device;
    return f;
}

int phx_ctx_ordering(const phx_ctx *ctx)
{
    return !ctx || !ctx->has_dp ? -1 : ctx->has_events;
}

int phx_fence_record(phx_ctx *ctx, int device, void *stream, phx_fence **out)
{
    if (!ctx || !out || device < -1 || device >= IO_MAX_DEVICES)
        return -EINVAL;
    *out = NULL;
    if (ctx_forked(ctx))
        return -ECHILD;
    if (!ctx->has_dp)
        return -ENODEV;
    const struct phx_dp_table *dp = &ctx->dp;
    int prev = -1, rc = 0;
    if (device < 0) { /* the current device's stream: nothing to switch */
        if (!dp->get_device || dp->get_device(&device) != dp->success || device < 0)
            device = 0;
    } else if ((rc = device_switch(dp, device, &prev)) < 0) {
        return rc;
    }
    if (!ctx->has_events) {
        /* no events: the caller's work so far is done before anything is submitted */
        if (dp->stream_synchronize(stream) != dp->success)
            rc = -EIO;
    } else if ((rc = ctx_get(ctx)) == 0) {
        phx_fence *f = fence_get(ctx, device);
        if (!f) {
            rc = -ENOMEM;
        } else if (dp->event_record(f->event, stream) != dp->success) {
            rc = -EIO;
            pthread_mutex_lock(&ctx->fence_mu);
            f->next = ctx->fence_free;
            ctx->fence_free = f;
            pthread_mutex_unlock(&ctx->fence_mu);
        } else {
            f->id = atomic_fetch_add(&fence_ids, 1) + 1;
            atomic_store(&f->refs, 1);
            atomic_store(&f->passed, 0);
            *out = f;
        }
        if (rc < 0)
            ctx_put(ctx);
    }
    device_restore(dp, prev);
    return rc;
}

int device_switch(const struct phx_dp_table *dp, int device, int *prev)
{
    int cur = -1;
    *prev = -1;
    if (device < 0 || !dp->get_device || dp->get_device(&cur) != dp->success || cur < 0 || cur == device)
        return 0;
    if (dp->set_device(device) != dp->success)
        return -EIO;
    *prev = cur;
    return 0;
}

void device_restore(const struct phx_dp_table *dp, int prev)
{
    if (prev >= 0)
        dp->set_device(prev);
}

phx_fence *fence_ref(phx_fence *f)
{
    if (f)
        atomic_fetch_add(&f->refs, 1);
    return f;
}

void phx_fence_release(phx_fence *f)
{
    if (!f || atomic_fetch_sub(&f->refs, 1) != 1)
        return;
    phx_ctx *ctx = f->ctx;
    if (ctx_forked(ctx))
        return; /* a parent's, in a forked child: its context's locks may be held for good */
    pthread_mutex_lock(&ctx->fence_mu);
    f->next = ctx->fence_free;
    ctx->fence_free = f;
    pthread_mutex_unlock(&ctx->fence_mu);
    ctx_put(ctx); /* last: the context may go away after this */
}

int fence_host_wait(phx_fence *f)
{
    if (!f || atomic_load(&f->passed))
        return 0;
    const struct phx_dp_table *dp = &f->ctx->dp;
    if (dp->event_synchronize(f->event) != dp->success)
        return -EIO;
    atomic_store(&f->passed, 1);
    return 0;
}

int fence_order_copy(struct io_worker *w, int dev, void *stream, phx_fence *f)
{
    if (!f || atomic_load_explicit(&f->passed, memory_order_acquire) || w->fence_waited[dev] == f->id)
        return 0;
    const struct phx_dp_table *dp = &w->ctx->dp;
    int queued = 1;
    if (dp->stream_wait_event(stream, f->event, 0) != dp->success) {
        if (dp->event_synchronize(f->event) != dp->success)
            return -EIO;
        atomic_store(&f->passed, 1);
        queued = 0;
    }
    w->fence_waited[dev] = f->id;
    return queued;
}

/* Every fence is back on the free list (each holds the context): destroy the events. */
void fence_fini(phx_ctx *ctx)
{
    const struct phx_dp_table *dp = &ctx->dp;
    phx_fence *f = ctx->fence_free;
    ctx->fence_free = NULL;
    while (f) {
        phx_fence *next = f->next;
        dp->event_destroy(f->event);
        free(f);
        f = next;
    }
    pthread_mutex_destroy(&ctx->fence_mu);
}
