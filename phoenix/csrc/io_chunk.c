/* The chunk state machine: a chunk's file I/O, and the completion of chunks and requests.
 *
 * Core side, data path: run by the chunk's worker (io_worker.c); chunk_finish and the
 * completion it may lead to also run in stream callbacks (io_copy.c). A chunk's path
 * (phx_io.h) is planned at submission (io_plan.c):
 *
 *   CH_USER        file I/O straight into the caller's CPU-addressable memory: the
 *                  aligned body with O_DIRECT, an unaligned head/tail buffered.
 *   CH_STAGED_CPU  CPU-addressable memory whose address is not aligned with the file
 *                  offset as O_DIRECT needs: through a bounce slot, copied by the CPU.
 *   CH_STAGED_DEV  device memory: O_DIRECT into a pinned slot, then memcpy_async on
 *                  the worker's stream for that device; one host callback per worker round
 *                  (flush_copies) frees the slots and completes the chunks copied in it;
 *                  the worker goes on with the next chunk meanwhile (the read of chunk
 *                  i+1 overlaps the copy of chunk i).
 *                  Writes: memcpy_async device -> slot, a host callback hands the chunk
 *                  back to its worker (inbox + eventfd), which writes it.
 *   CH_FMAP        a file-mapping hit: one unit of work (io_copy.c, fmap_req_start).
 *
 * Short transfers are reissued for the rest (falling back to the buffered descriptor
 * when the rest is no longer O_DIRECT-aligned: the tail of a file); a read that returns
 * 0 is EOF; a request's count is the contiguous prefix before its first EOF. An O_DIRECT
 * transfer refused with EINVAL is retried buffered and the file stops using O_DIRECT.
 */
#include "io_file.h"
#include "io_fmap.h"
#include "io_pool.h"
#include "io_sync.h"
#include "io_worker.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- requests: completion ------------------------------------------------------------ */

void req_unref(phx_req *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1)
        free(r);
}

static void req_complete(phx_req *r)
{
    int err = atomic_load(&r->err);
    int64_t eof = atomic_load(&r->eof_at);
    if (err)
        r->result = -err;
    else if (r->op == PHX_OP_READ && eof < r->foff + (int64_t)r->size)
        r->result = eof > r->foff ? eof - r->foff : 0;
    else
        r->result = (int64_t)r->size;
    phx_ctx *ctx = r->ctx;
    phx_file *f = r->file;
    io_done_fn cb = r->on_done;
    void *arg = r->on_done_arg;
    int file_ref = r->file_ref;
    if (r->fmap_write)
        fmap_write_end(ctx, f);
    phx_fence_release(r->fence); /* (no vendor call: may run in a stream callback) */
    r->fence = NULL;
    STAT_ADD(requests, -1); /* before file_put: once close() returns, counters are settled */
    io_set_flag(&r->state);
    if (cb)
        cb(r, arg);
    if (file_ref)
        file_put(f);
    req_unref(r);
    ctx_put(ctx); /* last: the context may go away after this */
}

void chunk_finish(struct io_chunk *ch)
{
    phx_req *r = ch->req;
    if (ch->busy == 1) { /* the time first: a worker that sees no normal chunk busy sees it */
        atomic_store(&r->ctx->normal_last_ns, io_now_ns());
        atomic_fetch_sub(&r->ctx->normal_busy, 1);
    } else if (ch->busy == 2) {
        atomic_fetch_sub(&r->ctx->bg_busy, 1);
    }
    ch->busy = 0;
    if (ch->err) {
        int zero = 0;
        if (atomic_compare_exchange_strong(&r->err, &zero, ch->err)) {
            r->err_off = ch->foff;
            r->err_len = ch->len;
        }
    } else if (r->op == PHX_OP_READ && ch->got < ch->len) {
        int64_t at = ch->foff + (int64_t)ch->got, cur = atomic_load(&r->eof_at);
        while (at < cur && !atomic_compare_exchange_weak(&r->eof_at, &cur, at))
            ;
    }
    if (r->op == PHX_OP_READ)
        STAT_ADD(bytes_read, (int64_t)ch->got);
    else
        STAT_ADD(bytes_written, (int64_t)ch->got);
    if (atomic_fetch_sub_explicit(&r->pending, 1, memory_order_acq_rel) == 1)
        req_complete(r);
}

/* A chunk's bounce slot goes back: to the pool, or (a stream op's own request, which
 * never waits for the pool) to the allocator. */
void slot_free(struct io_chunk *ch)
{
    if (!ch->slot)
        return;
    if (ch->req->internal)
        free(ch->slot);
    else
        pool_free(&ch->req->ctx->pool, ch->slot, ch->slot_bytes);
    ch->slot = NULL;
}

/* ---- chunks: file I/O ---------------------------------------------------------------- */

static void sub_issue(struct io_worker *w, struct io_sub *s);
static void chunk_io_done(struct io_worker *w, struct io_chunk *ch);

/* The ring's registered-buffer index of a bounce slot's [buf, buf + len), or -1 (plain
 * read / write): a pool segment is put in the worker's table on its first I/O; one the
 * kernel refuses (RLIMIT_MEMLOCK without CAP_IPC_LOCK, a segment over 1 GiB) stays out. */
static int fixed_index(struct io_worker *w, const char *buf, uint64_t len)
{
    struct io_pool *p = &w->ctx->pool;
    int i = pool_seg_of(p, buf, len);
    if (i < 0 || (w->fixed_bad >> i) & 1)
        return -1;
    if (!((w->fixed_set >> i) & 1)) {
        if (ring_buffer_set(&w->ring, (unsigned)i, p->segs[i].base, p->segs[i].size) < 0) {
            w->fixed_bad |= 1ull << i;
            return -1;
        }
        w->fixed_set |= 1ull << i;
    }
    STAT_ADD(io_fixed, 1);
    return i;
}

/* A worker's chunk FIFOs (parked for a slot, reaped awaiting their copy): linked by ->next. */
static void chunk_fifo_push(struct io_chunk **head, struct io_chunk **tail, struct io_chunk *ch)
{
    ch->next = NULL;
    if (*tail)
        (*tail)->next = ch;
    else
        *head = ch;
    *tail = ch;
}


static int sub_aligned(phx_file *f, struct io_sub *s)
{
    return !(((uint64_t)s->off + s->done) % f->a_off || (s->len - s->done) % f->a_off ||
             (uintptr_t)(s->buf + s->done) % f->a_mem);
}

void sub_done(struct io_worker *w, struct io_sub *s, int64_t res)
{
    struct io_chunk *ch = s->ch;
    phx_file *f = ch->req->file;
    if (res == -EINTR || res == -EAGAIN) {
        sub_issue(w, s);
        return;
    }
    if (res == -EINVAL && s->direct) {
        /* the file system took O_DIRECT at open but refuses the transfer: try buffered;
         * if that works, the file stops using O_DIRECT (sub_done below) */
        s->direct = 0;
        s->fell_back = 1;
        sub_issue(w, s);
        return;
    }
    if (s->fell_back && res >= 0) {
        s->fell_back = 0;
        file_disable_direct(f, "O_DIRECT transfer refused with EINVAL; using buffered I/O");
    }
    if (res < 0) {
        s->err = (int)-res;
    } else if (res == 0) {
        if (ch->req->op == PHX_OP_WRITE)
            s->err = EIO; /* a write that moves nothing: never loop on it */
        /* read: EOF */
    } else {
        s->done += (uint64_t)res;
        if (s->done < s->len) {
            STAT_ADD(reissues, 1);
            if (s->direct && !sub_aligned(f, s))
                s->direct = 0; /* the rest is no longer aligned (end of file): buffered */
            sub_issue(w, s);
            return;
        }
    }
    s->finished = 1;
    if (--ch->subs_left == 1 && ch->tail_held) {
        /* a write's last piece goes once the others are done (chunk_issue_subs); not after
         * a failed one (the chunk fails with its error; nothing is written past it) */
        ch->tail_held = 0;
        struct io_sub *t = &ch->sub[ch->nsub - 1];
        int failed = 0;
        for (int i = 0; i < ch->nsub - 1; i++)
            failed |= ch->sub[i].err != 0;
        if (!failed) {
            sub_issue(w, t);
            return;
        }
        t->finished = 1;
        ch->subs_left = 0;
    }
    if (ch->subs_left == 0)
        chunk_io_done(w, ch);
}

void sub_run_sync(struct io_worker *w, struct io_sub *s)
{
    struct io_chunk *ch = s->ch;
    phx_file *f = ch->req->file;
    int fd = s->direct ? f->fd_direct : f->fd_buf;
    uint64_t len = s->len - s->done;
    if (len > IO_MAX_CHUNK)
        len = IO_MAX_CHUNK;
    ssize_t n;
    if (ch->req->op == PHX_OP_READ) {
        n = pread(fd, s->buf + s->done, len, s->off + (off_t)s->done);
    } else {
        n = pwrite(fd, s->buf + s->done, len, s->off + (off_t)s->done);
    }
    sub_done(w, s, n < 0 ? -errno : n);
}

static void sub_issue(struct io_worker *w, struct io_sub *s)
{
    /* test hook (phx_file_inject_fault): EINVAL stands for "O_DIRECT refused at the
     * first transfer" and hits only O_DIRECT transfers; other errors hit all */
    int ferr = file_fault(s->ch->req->file, s->off + (int64_t)s->done, s->len - s->done);
    if (ferr && (ferr != EINVAL || s->direct)) {
        sub_done(w, s, -ferr);
        return;
    }
    if (s->direct)
        STAT_ADD(io_direct, 1);
    else
        STAT_ADD(io_buffered, 1);
    if (!w->use_ring) {
        /* threads engine: a FIFO of subs the worker runs right after */
        s->next = NULL;
        if (w->sync_tail)
            w->sync_tail->next = s;
        else
            w->sync_head = s;
        w->sync_tail = s;
        return;
    }
    if (s->cached) {
        /* a read of cached pages is a memory copy: done here by this worker (as the
         * threads engine does), not through the ring, where a buffered read the kernel
         * cannot finish without blocking is handed to its io-wq threads */
        sub_run_sync(w, s);
        return;
    }
    struct io_uring_sqe *sqe = ring_get_sqe(&w->ring);
    if (!sqe) {
        ring_enter(&w->ring, 0);
        sqe = ring_get_sqe(&w->ring);
    }
    if (!sqe) { /* cannot happen with the ring sized for the worker's capacity; be safe */
        sub_run_sync(w, s);
        return;
    }
    struct io_chunk *ch = s->ch;
    phx_file *f = ch->req->file;
    uint64_t len = s->len - s->done;
    if (len > IO_MAX_CHUNK)
        len = IO_MAX_CHUNK;
    int fixed = ch->slot && w->fixed ? fixed_index(w, s->buf + s->done, len) : -1;
    int rd = ch->req->op == PHX_OP_READ;
    sqe->opcode = fixed >= 0 ? (rd ? IORING_OP_READ_FIXED : IORING_OP_WRITE_FIXED) : (rd ? IORING_OP_READ : IORING_OP_WRITE);
    if (fixed >= 0)
        sqe->buf_index = (uint16_t)fixed;
    sqe->fd = s->direct ? f->fd_direct : f->fd_buf;
    sqe->addr = (uint64_t)(uintptr_t)(s->buf + s->done);
    sqe->len = (uint32_t)len;
    sqe->off = (uint64_t)s->off + s->done;
    sqe->user_data = (uint64_t)(uintptr_t)s;
    w->ring_inflight++;
}

/* Copy between a bounce slot and the caller's host memory. Memory of an object the caller
 * holds (owned: PHX_IO_OWNED_MEMORY) is copied with memcpy; a raw pointer's by the kernel
 * (process_vm_writev / readv on this process), so that a page of it that is missing or
 * may not be written is EFAULT here, not a crash of the worker (a raw buffer is probed at
 * submission only at its ends; a registration not at all). memcpy where those calls are
 * refused. */
static int user_copy(char *user, char *slot, uint64_t n, int to_user, int owned)
{
    static _Atomic int refused;
    uint64_t done = 0;
    if (!owned && !atomic_load_explicit(&refused, memory_order_relaxed)) {
        pid_t self = getpid();
        while (done < n) {
            size_t part = n - done > (1ull << 30) ? (size_t)1 << 30 : (size_t)(n - done);
            struct iovec local = {slot + done, part}, remote = {user + done, part};
            ssize_t k = to_user ? process_vm_writev(self, &local, 1, &remote, 1, 0)
                                : process_vm_readv(self, &local, 1, &remote, 1, 0);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0 && (errno == ENOSYS || errno == EPERM)) {
                atomic_store_explicit(&refused, 1, memory_order_relaxed);
                break;
            }
            if (k <= 0)
                return -EFAULT; /* (a short copy stops before the page that faults) */
            done += (uint64_t)k;
        }
    }
    if (done < n) {
        if (to_user)
            memcpy(user + done, slot + done, n - done);
        else
            memcpy(slot + done, user + done, n - done);
    }
    return 0;
}

/* All of a chunk's file I/O is done: copy out of the slot where needed, finish. */
static void chunk_io_done(struct io_worker *w, struct io_chunk *ch)
{
    phx_req *r = ch->req;
    uint64_t got = 0;
    int err = 0;
    for (int i = 0; i < ch->nsub; i++) {
        struct io_sub *s = &ch->sub[i];
        if (s->err && !err)
            err = s->err;
    }
    /* the contiguous prefix: a sub that came up short (EOF) ends it */
    for (int i = 0; i < ch->nsub; i++) {
        got += ch->sub[i].done;
        if (ch->sub[i].done < ch->sub[i].len)
            break;
    }
    ch->got = err ? 0 : got;
    ch->err = err;
    w->owned--;
    w->owned_bytes -= ch->len;
    if (ch->path == CH_STAGED_CPU) {
        if (r->op == PHX_OP_READ && !err && got && user_copy(ch->user, ch->slot + ch->slot_off, got, 1, r->owned_mem) < 0) {
            ch->got = 0;
            ch->err = EFAULT;
        }
    } else if (ch->path == CH_STAGED_DEV && r->op == PHX_OP_READ && !err && got) {
        if (w->in_reap) {
            /* reaped from the ring: its copy is queued after the reap and the admission of
             * the reads that replace this round's (run_copies), which go to the kernel
             * with the round's one enter right after the copies */
            chunk_fifo_push(&w->copy_head, &w->copy_tail, ch);
            return;
        }
        start_read_copy(w, ch);
        return;
    }
    slot_free(ch);
    chunk_finish(ch);
}

void chunk_issue_subs(struct io_worker *w, struct io_chunk *ch)
{
    /* a sub may complete inside sub_issue (injected fault, full ring) and with it the
     * chunk and its request, which may free ch: read nsub first */
    int n = ch->nsub;
    int probe = ch->req->op == PHX_OP_READ;
    ch->subs_left = (uint8_t)n;
    /* a write's pieces (a buffered head, the O_DIRECT body, a buffered tail) would run at
     * once; a tail that grows the file could then set its new end before the body lands,
     * and a reader meanwhile would see the body's range as a hole of zeros. The last piece
     * goes after the others (sub_done), as one pwrite(2) grows a file in order. */
    ch->tail_held = !probe && n > 1;
    if (ch->tail_held)
        n--;
    for (int i = 0; i < n; i++) {
        struct io_sub *s = &ch->sub[i];
        if (probe && s->direct && file_mostly_cached(ch->req->file, s->off, s->len)) {
            s->direct = 0;
            s->cached = 1;
        }
        sub_issue(w, s);
    }
}

void chunk_fail(struct io_worker *w, struct io_chunk *ch, int err)
{
    ch->err = err;
    ch->got = 0;
    w->owned--;
    w->owned_bytes -= ch->len;
    slot_free(ch);
    chunk_finish(ch);
}

static void park(struct io_worker *w, struct io_chunk *ch)
{
    STAT_ADD(pool_waits, 1);
    w->nparked++;
    if (!ch->req->prio && w->parked_head && w->parked_head->req->prio) {
        /* a normal chunk goes before background ones (none normal is parked: admit) */
        ch->next = w->parked_head;
        w->parked_head = ch;
        return;
    }
    chunk_fifo_push(&w->parked_head, &w->parked_tail, ch);
}

/* A read of page-cache data is CPU copies into slots and DMAs out of them; with the whole
 * pool (4 slots of 16 MiB per worker) the DMAs can queue far behind the copies (a long
 * tail, slots cold in the cache when the DMA reads them). Such chunks start only while
 * the pool has less than IO_CACHED_SLOTS 4 MiB slots per worker in use (all requests'
 * slots count); a worker parks until one comes back, as KvikIO's threads wait for their
 * bounce buffer's copy. Fewer slots in flight keep the copies and the DMAs close
 * together: a cached file reads faster with 4 slots per worker than with 16, and never
 * slower where memory bandwidth bounds every staged reader. */
uint64_t slot_cap(const struct io_worker *w, const struct io_chunk *ch)
{
    uint64_t cap = ch->req->cached ? (uint64_t)w->ctx->nworkers * IO_CACHED_SLOTS * IO_CACHED_CHUNK : 0;
    if (ch->req->prio) { /* background: a quarter of the pool stays for normal chunks */
        uint64_t bg = w->ctx->pool.limit - w->ctx->pool.limit / 4;
        if (!cap || bg < cap)
            cap = bg;
    }
    return cap;
}

/* Start a chunk the worker owns (owned already counts it). */
void chunk_start(struct io_worker *w, struct io_chunk *ch)
{
    phx_req *r = ch->req;
    ch->owner = w;
    if (ch->path == CH_FMAP) {
        fmap_req_start(w, ch);
        return;
    }
    if (ch->path != CH_USER && !ch->slot) {
        if (r->internal) { /* never behind the pool (see ctx->iq_head): its own memory */
            void *mem = NULL;
            if (posix_memalign(&mem, IO_MAX_ALIGN, ch->slot_bytes) != 0) {
                chunk_fail(w, ch, ENOMEM);
                return;
            }
            ch->slot = mem;
        } else {
            int never = 0;
            ch->slot = pool_alloc(&w->ctx->pool, ch->slot_bytes, slot_cap(w, ch), w, &never);
            if (!ch->slot) {
                if (never)
                    chunk_fail(w, ch, ENOMEM);
                else
                    park(w, ch);
                return;
            }
        }
    }
    char *base = ch->path == CH_USER ? ch->user : ch->slot;
    for (int i = 0; i < ch->nsub; i++) {
        struct io_sub *s = &ch->sub[i];
        s->buf = base + s->rel;
        s->done = 0;
        s->err = 0;
        s->finished = 0;
        s->fell_back = 0;
    }
    if (r->op == PHX_OP_WRITE && ch->path == CH_STAGED_CPU) {
        if (user_copy(ch->user, ch->slot + ch->slot_off, ch->len, 0, r->owned_mem) < 0) {
            chunk_fail(w, ch, EFAULT);
            return;
        }
    } else if (r->op == PHX_OP_WRITE && ch->path == CH_STAGED_DEV) {
        int rc = dev_copy_to_slot(w, ch);
        if (rc < 0)
            chunk_fail(w, ch, EIO);
        else if (rc == 1)
            chunk_issue_subs(w, ch);
        return; /* queued: the inbox brings it back */
    }
    chunk_issue_subs(w, ch);
}

