/* Request planning: a request's checks, where it goes, and its chunks.
 *
 * Core side, data path (the submitting thread: phx_submit, or a stream op's callback
 * through io_submit_one). req_build runs four named steps:
 *
 *   req_check        refuse what no path can run (bad descriptor, fence of another
 *                    context, an extent past its registration, device memory without
 *                    a data path) before anything is allocated;
 *   req_layout       pick the path and the geometry: a file-mapping hit (io_fmap.c), or
 *                    the chunk size and alignment (O_DIRECT or not, through bounce
 *                    slots or not, smaller chunks for reads from the page cache);
 *   req_alloc        the request with room for its chunks;
 *   req_plan_chunks  cut it at multiples of the chunk size (in file offsets) and split
 *                    each chunk into its file I/Os (plan_subs).
 *
 * A refused or empty request is built too, complete at once (req_done_at_once): a
 * failed request fails alone, with a handle like any other.
 */
#include "io_ctx.h"
#include "io_file.h"
#include "io_fmap.h"
#include "io_order.h"
#include "io_req.h"
#include "io_sync.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* A chunk's file I/Os: with O_DIRECT an unaligned head and tail (buffered) around the
 * aligned body; without, one buffered I/O. rel0: where the chunk's first byte lands from
 * its base (the caller's memory, or its slot). */
static void plan_subs(struct io_chunk *ch, uint64_t rel0, int direct, uint64_t A)
{
    ch->nsub = 0;
    uint64_t head = direct ? (A - (uint64_t)ch->foff % A) % A : ch->len;
    if (head > ch->len)
        head = ch->len;
    uint64_t body = direct ? align_down(ch->len - head, A) : 0;
    uint64_t tail = ch->len - head - body;
    uint64_t at = 0;
    struct {
        uint64_t len;
        int direct;
    } parts[3] = {{head, 0}, {body, 1}, {tail, 0}};
    for (int i = 0; i < 3; i++) {
        if (!parts[i].len)
            continue;
        struct io_sub *s = &ch->sub[ch->nsub++];
        memset(s, 0, sizeof(*s));
        s->ch = ch;
        s->off = ch->foff + (int64_t)at;
        s->rel = rel0 + at;
        s->len = parts[i].len;
        s->direct = (uint8_t)parts[i].direct;
        at += parts[i].len;
    }
}

void req_fail_now(phx_req *r, int err)
{
    r->result = -err;
    r->err = err;
    r->err_off = r->foff;
    r->err_len = r->size;
    atomic_store(&r->state, FLAG_SET); /* before anyone can wait: no wake owed */
}

/* Where a request goes and in what pieces, decided before it is allocated. */
struct req_layout {
    int staged_dev;        /* device memory: through bounce slots and device copies */
    int slot_path;         /* through bounce slots (staged_dev, or memory misaligned for O_DIRECT) */
    int direct;            /* the O_DIRECT descriptor serves the aligned bodies */
    uint64_t C, A;         /* chunk size; alignment unit (the file's O_DIRECT unit, or 4096) */
    uint32_t nchunks;
    int fhit;              /* a file-mapping hit: fp holds its windows */
    struct fmap_plan fp;   /* (a miss: fp.resident says the range is in the page cache) */
};

/* 0, or the errno that refuses the request before anything moves. */
static int req_check(const phx_ctx *ctx, const struct phx_io_desc *d, int internal, int staged_dev)
{
    if (!d->file)
        return EBADF;
    if (d->op != PHX_OP_READ && d->op != PHX_OP_WRITE)
        return EINVAL;
    if (d->priority != PHX_PRIO_NORMAL && d->priority != PHX_PRIO_BACKGROUND)
        return EINVAL;
    if (d->mem < PHX_MEM_HOST || d->mem > PHX_MEM_DEVICE_MAPPED || d->mode < PHX_MODE_AUTO ||
        d->mode > PHX_MODE_DIRECT)
        return EINVAL;
    if (d->file_offset < 0 || d->size > (uint64_t)INT64_MAX - (uint64_t)d->file_offset ||
        d->addr + d->size < d->addr)
        return EINVAL;
    if (d->size && !d->addr)
        return EFAULT;
    if (d->mem == PHX_MEM_DEVICE && d->mode == PHX_MODE_DIRECT)
        return EOPNOTSUPP; /* device memory the CPU cannot address: no direct path */
    if (staged_dev && !ctx->has_dp)
        return ENODEV;     /* device memory, but no vendor data path to copy with */
    if (!internal && d->size && phx_reg_lookup(d->addr, d->size, NULL) == -EFAULT)
        return EFAULT;     /* runs past the end of its registration: nothing moves */
    if (d->after && (internal || d->after->ctx != ctx))
        return EINVAL;     /* a fence of another context */
    return 0;
}

/* The path and geometry of a request that passed req_check and moves bytes: 0, or
 * EINVAL for one of more chunks than a request holds (IO_MAX_CHUNKS). */
static int req_layout(phx_ctx *ctx, const struct phx_io_desc *d, int internal, struct req_layout *L)
{
    phx_file *f = d->file;
    if (d->op == PHX_OP_READ && L->staged_dev && !internal)
        L->fhit = fmap_plan(ctx, f, d, &L->fp);
    if (L->fhit) {
        L->nchunks = L->fp.nchunks;
        return 0;
    }
    L->direct = atomic_load(&f->direct_ok);
    /* O_DIRECT reads and writes whole aligned blocks: one that would end past the
     * largest file offset is refused (EINVAL) where the exact extent is not (a read
     * there is past every file's end: 0); such extents go buffered */
    if (L->direct && (uint64_t)d->file_offset + d->size > (uint64_t)INT64_MAX - 2 * (uint64_t)f->align)
        L->direct = 0;
    L->A = L->direct ? f->align : 4096;
    uint64_t A = L->A, C = L->C;
    if (!L->staged_dev && L->direct) {
        /* O_DIRECT into the caller's memory needs the body's address aligned where
         * its file offset is: the same for every chunk of the request */
        uint64_t head = (A - (uint64_t)d->file_offset % A) % A;
        L->slot_path = head < d->size && d->size - head >= A && (d->addr + head) % f->a_mem != 0;
    }
    if (L->slot_path)
        C = ctx->stage_chunk;
    /* A read from the page cache is a memory copy into the slot, then a DMA: smaller
     * chunks overlap the two sooner (4 MiB staged chunks read a cached file faster than
     * 16 MiB ones; KvikIO's tasks are 4 MiB too). */
    if (L->fp.resident && C > IO_CACHED_CHUNK)
        C = IO_CACHED_CHUNK;
    /* From the device: a chunk is at most one worker's share of the in-flight budget, so
     * that the budget bounds the bytes in flight and every worker can hold a chunk. */
    if (!L->fp.resident && C > ctx->worker_bytes)
        C = ctx->worker_bytes;
    /* Background chunks are small: a load waits for at most one of them (bg_ok). */
    if (d->priority == PHX_PRIO_BACKGROUND && C > IO_BG_CHUNK)
        C = IO_BG_CHUNK;
    C = align_up(C, A);
    uint64_t first = align_down((uint64_t)d->file_offset, C);
    uint64_t last = align_down((uint64_t)d->file_offset + d->size - 1, C);
    L->C = C;
    uint64_t n = (last - first) / C + 1;
    if (n > IO_MAX_CHUNKS) {
        L->nchunks = 0;
        return EINVAL; /* (the counts are 32-bit; no such request fits in memory anyway) */
    }
    L->nchunks = (uint32_t)n;
    return 0;
}

/* The request with room for its chunks, its fields set from the descriptor; NULL when
 * out of memory. */
static phx_req *req_alloc(phx_ctx *ctx, const struct phx_io_desc *d, const struct req_layout *L, int internal,
                          io_done_fn on_done, void *arg, int want_handle)
{
    phx_req *r = calloc(1, sizeof(*r) + (size_t)L->nchunks * sizeof(struct io_chunk));
    if (!r)
        return NULL;
    r->ctx = ctx;
    r->file = d->file;
    r->op = d->op;
    r->mem = d->mem;
    r->device = d->device;
    r->addr = (char *)(uintptr_t)d->addr;
    r->foff = d->file_offset;
    r->size = d->size;
    r->on_done = on_done;
    r->on_done_arg = arg;
    r->cached = L->fp.resident && !L->fhit;
    r->internal = internal;
    r->prio = d->priority == PHX_PRIO_BACKGROUND;
    r->owned_mem = (d->flags & PHX_IO_OWNED_MEMORY) != 0;
    atomic_init(&r->refs, want_handle ? 2 : 1);
    atomic_init(&r->eof_at, INT64_MAX);
    return r;
}

/* A refused (err) or empty request: complete now, never queued. */
static phx_req *req_done_at_once(phx_req *r, int err, int want_handle)
{
    if (err)
        req_fail_now(r, err);
    else
        atomic_store(&r->state, FLAG_SET);
    if (r->on_done)
        r->on_done(r, r->on_done_arg);
    if (!want_handle) {
        free(r);
        return REQ_DONE_NO_HANDLE;
    }
    atomic_store(&r->refs, 1);
    return r;
}

/* Cut the request at multiples of the chunk size (in file offsets): each chunk's path,
 * extent, slot geometry and file I/Os. */
static void req_plan_chunks(phx_req *r, const struct req_layout *L)
{
    uint64_t C = L->C, A = L->A;
    int direct = L->direct;
    int path = L->staged_dev ? CH_STAGED_DEV : L->slot_path ? CH_STAGED_CPU : CH_USER;
    atomic_init(&r->pending, (int)L->nchunks);
    r->path = path;
    int64_t off = r->foff, end = r->foff + (int64_t)r->size;
    for (uint32_t i = 0; i < L->nchunks; i++) {
        struct io_chunk *ch = &r->chunks[i];
        /* in unsigned arithmetic: the next boundary may lie at 2**63 (offsets near the
         * largest one), which int64_t cannot hold */
        uint64_t bound = align_down((uint64_t)off, C) + C;
        int64_t next = bound > (uint64_t)end ? end : (int64_t)bound;
        ch->req = r;
        ch->foff = off;
        ch->len = (uint64_t)(next - off);
        ch->user = r->addr + (off - r->foff);
        ch->path = (uint8_t)path;
        if (path == CH_USER) {
            plan_subs(ch, 0, direct, A);
        } else {
            ch->slot_off = direct ? (uint32_t)((uint64_t)off % A) : 0;
            ch->slot_bytes = direct ? align_up(ch->slot_off + ch->len, A) : ch->len;
            plan_subs(ch, ch->slot_off, direct, A);
        }
        off = next;
    }
    if (path == CH_USER)
        STAT_ADD(chunks_user, L->nchunks);
    else if (path == CH_STAGED_DEV)
        STAT_ADD(chunks_staged, L->nchunks);
    else
        STAT_ADD(chunks_staged_cpu, L->nchunks);
}

phx_req *req_build(phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                   int want_handle, int *queued)
{
    *queued = 0;
    int staged_dev = d->mem == PHX_MEM_DEVICE || (d->mem == PHX_MEM_DEVICE_MAPPED && d->mode == PHX_MODE_STAGED);
    struct req_layout L = {.staged_dev = staged_dev, .slot_path = staged_dev, .C = ctx->chunk, .A = 4096};
    int err = req_check(ctx, d, internal, staged_dev);
    if (!err && d->size)
        err = req_layout(ctx, d, internal, &L);
    phx_req *r = req_alloc(ctx, d, &L, internal, on_done, arg, want_handle);
    if (!r) {
        if (L.fhit)
            fmap_plan_drop(ctx, &L.fp);
        return NULL;
    }
    if (err || !d->size)
        return req_done_at_once(r, err, want_handle);
    r->nchunks = L.nchunks;
    r->fence = fence_ref(d->after);
    if (L.fhit) {
        /* one unit of work: see fmap_req_start (io_copy.c) */
        atomic_init(&r->pending, 1);
        r->path = CH_FMAP;
        fmap_fill(ctx, &L.fp, r);
    } else {
        req_plan_chunks(r, &L);
    }
    *queued = 1;
    return r;
}
