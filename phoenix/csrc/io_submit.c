/* The request API: submission, waiting, results, release.
 *
 * Core side, data path (the caller's threads; io_submit_one also from stream callbacks).
 * phx_submit first waits for the stream-ordered writes queued before it that its range
 * depends on (io_swrite.c). A built request (io_plan.c) is counted in its file and its
 * context (req_enter), waits on the host for its fence where the CPU or the disk touches
 * its memory, and is queued for the workers (queue_push); a refusal at that point
 * completes it with the error (req_refused): a failed request fails alone. Handles are
 * reference counted: the caller's and the engine's; the last release frees (req_unref,
 * io_chunk.c).
 */
#include "io_ctx.h"
#include "io_file.h"
#include "io_fmap.h"
#include "io_fork.h"
#include "io_order.h"
#include "io_req.h"
#include "io_sync.h"

#include <errno.h>

/* Count a built request in (file and context); on refusal complete it with the error. */
static int req_enter(phx_ctx *ctx, phx_req *r, int internal)
{
    /* a stream op's requests ride on the op's own file reference: close() waits for
     * the op, and the op's requests must not be refused meanwhile */
    int rc = internal ? 0 : file_get(r->file);
    if (rc < 0)
        return rc;
    r->file_ref = !internal;
    rc = ctx_get(ctx);
    if (rc < 0) {
        if (!internal)
            file_put(r->file);
        r->file_ref = 0;
        return rc;
    }
    STAT_ADD(requests, 1);
    if (r->op == PHX_OP_WRITE && r->size && !internal) {
        /* (a stream op's own writes are counted by the op, in the caller's thread:
         * they are submitted from stream callbacks, where no vendor call may run) */
        r->fmap_write = 1; /* before the write is queued: see fmap_write_begin */
        fmap_write_begin(ctx, r->file, r->foff, r->size);
        /* after file_get: a file with nothing in flight forgets its writes' ends */
        file_note_write(r->file, r->foff + (int64_t)r->size);
    }
    return 0;
}

static void req_refused(phx_req *r, int err)
{
    phx_fence_release(r->fence);
    r->fence = NULL;
    if (r->path == CH_FMAP) { /* a hit refused at entry: give its windows back */
        for (uint32_t i = 0; i < r->nchunks; i++) {
            if (r->chunks[i].win) {
                fmap_unref(r->ctx, r->chunks[i].win);
                r->chunks[i].win = NULL;
            }
        }
    }
    req_fail_now(r, -err);
    if (r->on_done)
        r->on_done(r, r->on_done_arg);
    req_unref(r); /* the engine's reference */
}

int phx_submit(phx_ctx *ctx, const struct phx_io_desc *descs, uint32_t n, phx_req **out)
{
    if (!ctx || (n && (!descs || !out)))
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    struct io_chunk *head[2] = {NULL, NULL}, *tail[2] = {NULL, NULL}; /* by priority */
    int nq[2] = {0, 0};
    for (uint32_t i = 0; i < n; i++) {
        /* stream-ordered writes the caller queued before this call on the same range of
         * the file (any handle) that their streams have not run yet: wait on the host, so
         * a read sees their bytes and a write lands after them */
        if (descs[i].file)
            stream_writes_wait(descs[i].file, descs[i].op, descs[i].file_offset, descs[i].size);
        int queued;
        phx_req *r = req_build(ctx, &descs[i], 0, NULL, NULL, 1, &queued);
        if (!r) {
            /* out of memory: queue what was built, refuse the rest */
            for (uint32_t j = i; j < n; j++)
                out[j] = NULL;
            queue_push(ctx, head[0], tail[0], nq[0], 0, 0);
            queue_push(ctx, head[1], tail[1], nq[1], 0, 1);
            return i ? 0 : -ENOMEM;
        }
        out[i] = r;
        r->gen = io_gen();
        if (!queued)
            continue;
        /* memory the CPU or the disk touches: the caller's stream must have passed the
         * fence before any of it is queued (device copies wait on the device instead) */
        int rc = 0;
        if (r->fence && (r->path == CH_USER || r->path == CH_STAGED_CPU))
            rc = fence_host_wait(r->fence);
        if (rc == 0)
            rc = req_enter(ctx, r, 0);
        if (rc < 0) {
            req_refused(r, rc);
            continue;
        }
        uint32_t nqueue = r->path == CH_FMAP ? 1 : r->nchunks;
        int p = r->prio;
        for (uint32_t c = 0; c < nqueue; c++) {
            struct io_chunk *ch = &r->chunks[c];
            ch->next = NULL;
            if (tail[p])
                tail[p]->next = ch;
            else
                head[p] = ch;
            tail[p] = ch;
        }
        nq[p] += (int)nqueue;
    }
    queue_push(ctx, head[0], tail[0], nq[0], 0, 0);
    queue_push(ctx, head[1], tail[1], nq[1], 0, 1);
    return 0;
}

int io_submit_one(phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                  phx_req **out)
{
    int queued;
    phx_req *r = req_build(ctx, d, internal, on_done, arg, out != NULL, &queued);
    if (!r)
        return -ENOMEM;
    if (r != REQ_DONE_NO_HANDLE)
        r->gen = io_gen();
    if (out)
        *out = r;
    if (!queued)
        return 0;
    int rc = req_enter(ctx, r, internal);
    if (rc < 0) {
        req_refused(r, rc);
        return 0;
    }
    uint32_t nqueue = r->path == CH_FMAP ? 1 : r->nchunks;
    struct io_chunk *head = &r->chunks[0], *tail = head;
    for (uint32_t c = 0; c < nqueue; c++) {
        r->chunks[c].next = c + 1 < nqueue ? &r->chunks[c + 1] : NULL;
        tail = &r->chunks[c];
    }
    queue_push(ctx, head, tail, (int)nqueue, internal, r->prio);
    return 0;
}

/* A request the parent of this (forked) process submitted and that was not done at the
 * fork: the workers that would run it do not exist here. It counts as done, with -ECHILD. */
static int req_orphan(const phx_req *r)
{
    return r->gen != io_gen() && !io_flag_is_set(&r->state);
}

int phx_req_wait(phx_req *r, int64_t timeout_ns)
{
    if (!r)
        return -EINVAL;
    if (req_orphan(r))
        return 0;
    return io_wait_flag(&r->state, timeout_ns);
}

int phx_req_done(const phx_req *r)
{
    return r && (io_flag_is_set(&r->state) || req_orphan(r));
}

int64_t phx_req_result(const phx_req *r)
{
    if (r && req_orphan(r))
        return -ECHILD;
    if (!phx_req_done(r))
        return -EBUSY;
    return r->result;
}

int phx_req_error_extent(const phx_req *r, int64_t *offset, uint64_t *length)
{
    if (r && req_orphan(r)) { /* the whole request failed */
        if (offset)
            *offset = r->foff;
        if (length)
            *length = r->size;
        return 0;
    }
    if (!phx_req_done(r) || r->result >= 0)
        return -ENOENT;
    if (offset)
        *offset = r->err_off;
    if (length)
        *length = r->err_len;
    return 0;
}

void phx_req_release(phx_req *r)
{
    if (r)
        req_unref(r);
}

int phx_req_wait_all(phx_req **reqs, uint32_t n, int64_t *results, int64_t timeout_ns)
{
    int64_t deadline = timeout_ns >= 0 ? io_deadline_ns(timeout_ns) : 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!reqs[i]) {
            if (results)
                results[i] = -ENOMEM;
            continue;
        }
        if (req_orphan(reqs[i])) {
            if (results)
                results[i] = -ECHILD;
            continue;
        }
        int64_t left = -1;
        if (timeout_ns >= 0 && (left = deadline - io_now_ns()) < 0)
            left = 0;
        if (io_wait_flag(&reqs[i]->state, left) < 0)
            return -ETIMEDOUT;
        if (results)
            results[i] = reqs[i]->result;
    }
    return 0;
}

void phx_req_release_all(phx_req **reqs, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (reqs[i])
            req_unref(reqs[i]);
}
