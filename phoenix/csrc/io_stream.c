/* Stream-ordered I/O (read_async / write_async): file I/O queued on the caller's stream.
 *
 * Core side, data path. The caller's thread queues, on the caller's stream, host
 * callbacks (the vendor's launch_host_func) and device copies; the stream runs them in
 * order, so work queued before an op has finished when its I/O starts and work queued
 * after it sees its bytes. Host callbacks here only submit requests to the workers,
 * wait on futexes and free bounce slots: they never call the vendor runtime and never
 * enter Python (the original Phoenix refused this API in its staging mode; here it
 * works in every mode).
 *
 *   direct  (memory the CPU addresses: host memory, vendor direct_capable device
 *           memory) one callback runs the whole request into/out of the caller's
 *           memory through the workers and waits for it.
 *   staged  reads:  [step 0: start reads of chunks 0..s-1 into slots, wait chunk 0]
 *                   [copy slot 0 -> device] [step 1: start chunk s into slot 0 (its
 *                   copy is done: stream order), wait chunk 1] [copy slot 1] ... [finish]
 *           writes: [copy device -> slot 0] [step 0: start the write of chunk 0; wait
 *                   for the write whose slot the next copy refills] ... [finish: wait
 *                   for all writes]
 *           with s slots per op (up to 4) taken from the bounce pool at submission,
 *           all or nothing.
 *
 * The sizes of queued copies are fixed at submission, but a staged read must see the
 * file as the stream finds it (a write queued before it, through any handle, may grow
 * the file). So it is planned up to its full size: the chunks past the file's end at
 * submission (fstat) are speculative, their destination's bytes copied from the device
 * into a save slot before their step, which puts them back in the slot past what the op
 * counts (the contiguous prefix of its chunks); the count is the bytes moved, and the
 * destination past it keeps its bytes. If the file shrinks before the stream gets there,
 * the missing bytes of the other chunks are zeros in the slot; a failed or aborted op
 * copies zeros or the destination's own bytes, never stale slot bytes. A pool too small
 * for two slots clamps the read to the file's end at submission instead.
 */
#include "io_ctx.h"
#include "io_file.h"
#include "io_fmap.h"
#include "io_fork.h"
#include "io_pool.h"
#include "io_order.h"
#include "io_req.h"
#include "io_sync.h"
#include "io_worker.h" /* IO_MAX_DEVICES */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define SOP_MAX_SLOTS 4

struct sop_chunk {
    struct phx_sop *sop;
    int idx;
    int64_t foff;
    uint64_t len;
    char *dev;       /* device address of foff */
    char *slot;      /* where foff lands in its slot */
    char *save;      /* a speculative chunk (past the file's end at submission): its
                      * destination's bytes, copied from the device before its step */
    int started;
    _Atomic uint32_t done;
    int64_t result;
};

struct phx_sop {
    phx_ctx *ctx;
    phx_file *file;
    int op, staged;
    void *stream;
    int64_t *user_bytes_done;
    struct phx_io_desc desc; /* the whole op (direct) */
    _Atomic int refs;
    _Atomic uint32_t state;
    int64_t result;
    _Atomic int aborted;
    int nch, nslots, next_start;
    int short_seen; /* a read step saw a chunk short or failed: later ones count nothing */
    uint64_t slot_bytes, size;
    char *slots[2 * SOP_MAX_SLOTS]; /* nslots read/write slots, then (speculative reads) as many saves */
    int nalloc;                     /* slots taken from the pool */
    _Atomic uint32_t direct_done;
    int64_t direct_result;
    int fmap_write; /* counted by fmap_write_begin (here, not in the callbacks: it may unregister) */
    struct stream_write *listed; /* a write: what blocking calls on its range wait for */
    uint64_t gen;                /* io_fork_gen when queued: a parent's op in a forked child */
    struct sop_chunk ch[];
};

static void sop_unref(phx_sop *s)
{
    if (atomic_fetch_sub(&s->refs, 1) == 1)
        free(s);
}

static void sop_complete(phx_sop *s, int64_t result)
{
    phx_ctx *ctx = s->ctx;
    for (int i = 0; i < s->nalloc; i++) {
        pool_free(&ctx->pool, s->slots[i], s->slot_bytes);
        s->slots[i] = NULL;
    }
    s->result = result;
    if (s->user_bytes_done)
        __atomic_store_n(s->user_bytes_done, result, __ATOMIC_RELEASE);
    phx_file *f = s->file;
    if (s->fmap_write)
        fmap_write_end(ctx, f);
    STAT_ADD(stream_ops, -1);
    io_set_flag(&s->state);
    stream_write_end(s->listed); /* done, its bytes in the file: blocking calls go on */
    file_put(f);
    sop_unref(s);
    ctx_put(ctx);
}

static void sop_chunk_done(phx_req *r, void *arg)
{
    struct sop_chunk *c = arg;
    c->result = r->result;
    io_set_flag(&c->done);
}

static void sop_chunk_start(phx_sop *s, int i)
{
    struct sop_chunk *c = &s->ch[i];
    struct phx_io_desc d = {
        .file = s->file,
        .addr = (uint64_t)(uintptr_t)c->slot,
        .size = c->len,
        .file_offset = c->foff,
        .op = s->op,
        .mem = PHX_MEM_HOST,
        .device = 0,
        .mode = PHX_MODE_AUTO,
        .priority = s->desc.priority,
    };
    c->started = 1;
    if (io_submit_one(s->ctx, &d, 1, sop_chunk_done, c, NULL) < 0) {
        c->result = -ENOMEM;
        io_set_flag(&c->done);
    }
}

/* The op's count: the contiguous prefix of its chunks, or the first error. */
static int64_t sop_tally(phx_sop *s)
{
    int64_t total = 0;
    int short_seen = 0;
    for (int i = 0; i < s->nch; i++) {
        struct sop_chunk *c = &s->ch[i];
        if (c->result < 0)
            return c->result;
        if (!short_seen)
            total += c->result;
        if ((uint64_t)c->result < c->len)
            short_seen = 1;
    }
    return total;
}

/* ---- host callbacks (stream threads: no vendor calls, no Python) ---- */

/* A read chunk's step: start the reads whose slots are free, wait for this chunk's, and
 * make its slot what the copy after this step may put on the device: the bytes read
 * (only those the op counts, for a speculative chunk), then the destination's own bytes
 * (speculative) or zeros (the file shrank since submission, or it failed): never stale
 * slot bytes, an aborted op's included (its chunks not started moved nothing). */
static void hf_read_step(void *arg)
{
    struct sop_chunk *c = arg;
    phx_sop *s = c->sop;
    if (!atomic_load(&s->aborted)) {
        if (c->idx == 0) {
            for (; s->next_start < s->nslots && s->next_start < s->nch; s->next_start++)
                sop_chunk_start(s, s->next_start);
        } else if (s->next_start < s->nch) {
            /* its slot was chunk idx-1's, whose copy to the device has run */
            sop_chunk_start(s, s->next_start++);
        }
    }
    if (c->started)
        io_wait_flag(&c->done, -1);
    uint64_t got = c->result > 0 ? (uint64_t)c->result : 0;
    if (s->short_seen && c->save)
        got = 0; /* past the op's count (sop_tally): the destination keeps its bytes */
    if (c->result < 0 || (uint64_t)c->result < c->len)
        s->short_seen = 1;
    if (got < c->len) {
        if (c->save)
            memcpy(c->slot + got, c->save + got, c->len - got);
        else
            memset(c->slot + got, 0, c->len - got);
    }
}

static void hf_write_step(void *arg)
{
    struct sop_chunk *c = arg;
    phx_sop *s = c->sop;
    if (atomic_load(&s->aborted))
        return;
    sop_chunk_start(s, c->idx);
    /* the next copy refills the slot of chunk idx+1-nslots: its write must be done */
    int reuse = c->idx + 1 - s->nslots;
    if (c->idx + 1 < s->nch && reuse >= 0)
        io_wait_flag(&s->ch[reuse].done, -1);
}

static void hf_finish(void *arg)
{
    phx_sop *s = arg;
    if (atomic_load(&s->aborted))
        return;
    for (int i = 0; i < s->nch; i++)
        if (s->ch[i].started)
            io_wait_flag(&s->ch[i].done, -1);
    sop_complete(s, sop_tally(s));
}

static void sop_direct_done(phx_req *r, void *arg)
{
    phx_sop *s = arg;
    s->direct_result = r->result;
    io_set_flag(&s->direct_done);
}

static void hf_direct(void *arg)
{
    phx_sop *s = arg;
    if (atomic_load(&s->aborted))
        return;
    if (io_submit_one(s->ctx, &s->desc, 1, sop_direct_done, s, NULL) < 0) {
        s->direct_result = -ENOMEM;
        io_set_flag(&s->direct_done);
    }
    io_wait_flag(&s->direct_done, -1);
    sop_complete(s, s->direct_result);
}

/* ---- submission (the caller's thread: vendor calls allowed) ---- */

/* Queueing failed part-way: stop the callbacks already queued, wait for them and for
 * the requests they started, and give everything back. */
static int sop_abort(phx_sop *s, int err)
{
    const struct phx_dp_table *dp = &s->ctx->dp;
    atomic_store(&s->aborted, 1);
    dp->stream_synchronize(s->stream);
    for (int i = 0; i < s->nch; i++)
        if (s->ch[i].started)
            io_wait_flag(&s->ch[i].done, -1);
    /* (hf_direct, if it was queued, returns at once when aborted: nothing started) */
    phx_ctx *ctx = s->ctx;
    for (int i = 0; i < s->nalloc; i++)
        pool_free(&ctx->pool, s->slots[i], s->slot_bytes);
    if (s->fmap_write)
        fmap_write_end(ctx, s->file);
    stream_write_end(s->listed);
    file_put(s->file);
    STAT_ADD(stream_ops, -1);
    free(s);
    ctx_put(ctx);
    return err;
}

static int stream_io(phx_ctx *ctx, const struct phx_io_desc *d, void *stream, int64_t *bytes_done, phx_sop **out)
{
    if (!d->file)
        return -EBADF;
    if ((d->op != PHX_OP_READ && d->op != PHX_OP_WRITE) || d->file_offset < 0 || d->mem < PHX_MEM_HOST ||
        d->mem > PHX_MEM_DEVICE_MAPPED || d->mode < PHX_MODE_AUTO || d->mode > PHX_MODE_DIRECT ||
        d->size > (uint64_t)INT64_MAX - (uint64_t)d->file_offset || d->addr + d->size < d->addr)
        return -EINVAL;
    if (d->size && !d->addr)
        return -EFAULT;
    if (d->mem == PHX_MEM_DEVICE && d->mode == PHX_MODE_DIRECT)
        return -EOPNOTSUPP;
    if (d->size && phx_reg_lookup(d->addr, d->size, NULL) == -EFAULT)
        return -EFAULT;
    const struct phx_dp_table *dp = &ctx->dp;
    phx_file *f = d->file;
    int staged = d->mem == PHX_MEM_DEVICE || (d->mem == PHX_MEM_DEVICE_MAPPED && d->mode == PHX_MODE_STAGED);
    uint64_t size = d->size;
    int direct = atomic_load(&f->direct_ok);
    uint64_t A = direct ? f->align : 4096;
    uint64_t C = align_up(ctx->stage_chunk, A);
    uint64_t q = ctx->pool.limit / pool_round(C + 2 * A);
    int fit = q > INT32_MAX ? INT32_MAX : (int)q; /* slots the pool holds at once */
    /* A staged read runs up to its size, whatever the file's end now (writes queued before
     * it may grow the file): the chunks past that end are speculative (see hf_read_step).
     * A pool too small for a slot and a save clamps it to the end now instead. */
    int64_t known = INT64_MAX;
    int spec = 0;
    if (staged && d->op == PHX_OP_READ && size) {
        if ((known = phx_file_size(f)) < 0)
            return (int)known;
        spec = d->file_offset + (int64_t)size > known;
        if (spec && fit < 2) {
            spec = 0;
            size = d->file_offset >= known ? 0 : (uint64_t)(known - d->file_offset);
        }
    }
    if (!size)
        staged = 0; /* nothing to copy: one callback sets the count */

    /* plan the chunks of a staged op */
    int nch = 0;
    if (staged) {
        uint64_t first = align_down((uint64_t)d->file_offset, C);
        uint64_t last = align_down((uint64_t)d->file_offset + size - 1, C);
        uint64_t n = (last - first) / C + 1;
        if (n > IO_MAX_CHUNKS)
            return -EINVAL; /* (an int count; no such op fits in memory anyway) */
        nch = (int)n;
    }
    phx_sop *s = calloc(1, sizeof(*s) + (size_t)nch * sizeof(struct sop_chunk));
    if (!s)
        return -ENOMEM;
    s->ctx = ctx;
    s->file = f;
    s->op = d->op;
    s->staged = staged;
    s->stream = stream;
    s->user_bytes_done = bytes_done;
    s->desc = *d;
    s->desc.after = NULL; /* stream ordered by construction */
    s->desc.size = size;
    s->size = size;
    s->nch = nch;
    s->gen = io_gen();
    atomic_init(&s->refs, out ? 2 : 1);
    int rc = file_get(f);
    if (rc < 0) {
        free(s);
        return rc;
    }
    if ((rc = ctx_get(ctx)) < 0) {
        file_put(f);
        free(s);
        return rc;
    }
    STAT_ADD(stream_ops, 1);
    if (bytes_done)
        *bytes_done = 0;
    if (d->op == PHX_OP_WRITE && size) {
        file_note_write(f, d->file_offset + (int64_t)size); /* after file_get: see file_put */
        s->fmap_write = 1; /* drops the windows it overlaps, in this (the caller's) thread */
        fmap_write_begin(ctx, f, d->file_offset, size);
        /* a blocking call on its range issued after this one waits for it (phx_submit) */
        if (!(s->listed = stream_write_begin(f, d->file_offset, size)))
            return sop_abort(s, -ENOMEM);
    }

    if (!staged) {
        if (dp->launch_host_func(stream, hf_direct, s) != dp->success)
            return sop_abort(s, -EIO);
    } else {
        s->slot_bytes = C + 2 * A;
        int nslots = nch < SOP_MAX_SLOTS ? nch : SOP_MAX_SLOTS;
        if (spec)
            fit /= 2; /* each slot with its save (one call: all or nothing) */
        if (nslots > fit)
            nslots = fit < 1 ? 1 : fit;
        int nalloc = spec ? 2 * nslots : nslots;
        if ((rc = pool_alloc_many(&ctx->pool, nalloc, s->slot_bytes, s->slots)) < 0)
            return sop_abort(s, rc);
        s->nslots = nslots;
        s->nalloc = nalloc;
        int64_t off = d->file_offset, end = d->file_offset + (int64_t)size;
        for (int i = 0; i < nch; i++) {
            struct sop_chunk *c = &s->ch[i];
            /* in unsigned arithmetic: the next boundary may lie at 2**63 (offsets near the
             * largest one), which int64_t cannot hold */
            uint64_t bound = align_down((uint64_t)off, C) + C;
            int64_t next = bound > (uint64_t)end ? end : (int64_t)bound;
            c->sop = s;
            c->idx = i;
            c->foff = off;
            c->len = (uint64_t)(next - off);
            c->dev = (char *)(uintptr_t)(d->addr + (uint64_t)(off - d->file_offset));
            /* foff lands where O_DIRECT can take it straight into the slot */
            c->slot = s->slots[i % nslots] + (direct ? (uint64_t)off % A : 0);
            /* a speculative chunk's destination bytes go to its slot's save */
            c->save = spec && next > known ? s->slots[nslots + i % nslots] : NULL;
            off = next;
        }
        for (int i = 0; i < nch; i++) {
            struct sop_chunk *c = &s->ch[i];
            if (d->op == PHX_OP_READ) {
                /* (the save is free: the step of the chunk before in its slot ran) */
                if (c->save && dp->memcpy_async(c->save, c->dev, c->len, dp->kind_d2h, stream) != dp->success)
                    return sop_abort(s, -EIO);
                if (dp->launch_host_func(stream, hf_read_step, c) != dp->success)
                    return sop_abort(s, -EIO);
                if (dp->memcpy_async(c->dev, c->slot, c->len, dp->kind_h2d, stream) != dp->success)
                    return sop_abort(s, -EIO);
            } else {
                if (dp->memcpy_async(c->slot, c->dev, c->len, dp->kind_d2h, stream) != dp->success)
                    return sop_abort(s, -EIO);
                if (dp->launch_host_func(stream, hf_write_step, c) != dp->success)
                    return sop_abort(s, -EIO);
            }
        }
        if (dp->launch_host_func(stream, hf_finish, s) != dp->success)
            return sop_abort(s, -EIO);
    }
    if (out)
        *out = s;
    return 0;
}

/* Queue with the buffer's device current: the default stream (0, and the legacy default
 * stream's aliases) is the current device's, and the runtime queues copies and callbacks
 * (and sop_abort synchronizes) on the current device's streams. The caller's device is
 * current again on return, on every path. A runtime without get_device (no events) gives
 * no way to restore it: the op is queued as called. */
int phx_stream_io(phx_ctx *ctx, const struct phx_io_desc *d, void *stream, int64_t *bytes_done, phx_sop **out)
{
    if (!ctx || !d)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    if (!ctx->has_dp)
        return -ENODEV; /* launch_host_func comes from the vendor */
    const struct phx_dp_table *dp = &ctx->dp;
    int want = d->mem == PHX_MEM_HOST ? -1 : d->device, prev;
    if (want >= IO_MAX_DEVICES)
        return -EINVAL;
    int rc = device_switch(dp, want, &prev);
    if (rc < 0)
        return rc;
    rc = stream_io(ctx, d, stream, bytes_done, out);
    device_restore(dp, prev);
    return rc;
}

/* An op the parent of this (forked) process queued and its stream had not run to its end
 * at the fork: nothing runs it here (the stream's work was the parent's). Done, -ECHILD. */
static int sop_orphan(const phx_sop *s)
{
    return s->gen != io_gen() && !io_flag_is_set(&s->state);
}

int phx_sop_done(const phx_sop *s)
{
    return s && (io_flag_is_set(&s->state) || sop_orphan(s));
}

int phx_sop_wait(phx_sop *s, int64_t timeout_ns)
{
    if (!s)
        return -EINVAL;
    if (sop_orphan(s))
        return 0;
    return io_wait_flag(&s->state, timeout_ns);
}

int64_t phx_sop_result(const phx_sop *s)
{
    if (s && sop_orphan(s))
        return -ECHILD;
    if (!phx_sop_done(s))
        return -EBUSY;
    return s->result;
}

void phx_sop_release(phx_sop *s)
{
    if (s)
        sop_unref(s);
}
