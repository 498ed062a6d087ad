/* The I/O engine: contexts, workers, requests and chunks.
 *
 * Core side, data path. A request is cut at multiples of the chunk size (in file
 * offsets) into chunks; chunks go to one FIFO per context; workers take them.
 *
 *   io_uring engine  each worker owns a ring and keeps up to queue_depth chunks in
 *                    flight; it fills many SQEs and submits them with one
 *                    io_uring_enter, which is also where it sleeps (an eventfd read
 *                    sits in the ring, so other threads wake it by writing the fd).
 *   threads engine   each worker runs pread/pwrite itself, one chunk at a time (plus
 *                    one staged write whose device copy is running).
 *
 * A chunk's path (phx_io.h) is planned at submission and run by its worker:
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
 *
 * Short transfers are reissued for the rest (falling back to the buffered descriptor
 * when the rest is no longer O_DIRECT-aligned: the tail of a file); a read that returns
 * 0 is EOF; a request's count is the contiguous prefix before its first EOF. An O_DIRECT
 * transfer refused with EINVAL is retried buffered and the file stops using O_DIRECT.
 */
#include "io_internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

struct io_counters io_stats;

/* req_build's answer for a request completed at once that nobody holds a handle to */
#define REQ_DONE_NO_HANDLE ((phx_req *)1)
#define EFD_TAG 1ull /* user_data of the eventfd read in a ring (never a valid io_sub *) */

void phx_io_get_stats(struct phx_io_stats *o)
{
#define S(x) o->x = atomic_load(&io_stats.x)
    S(contexts); S(threads); S(files); S(requests); S(stream_ops); S(registrations); S(worker_streams);
    S(bounce_bytes); S(bounce_in_use); S(bytes_read); S(bytes_written);
    S(chunks_user); S(chunks_staged); S(chunks_staged_cpu);
    S(io_direct); S(io_buffered); S(reissues); S(direct_fallbacks); S(uring_enters);
    S(cache_hit_bytes); S(cache_misses);
    S(fmap_windows); S(fmap_bytes); S(fmap_hits); S(fmap_misses);
    S(pool_waits); S(copy_flushes);
#undef S
}

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

int phx_mem_probe(uint64_t addr, uint64_t size)
{
    if (!size)
        return 0;
    if (!addr || addr + size < addr)
        return -EFAULT;
    char b[2];
    struct iovec local[2] = {{&b[0], 1}, {&b[1], 1}};
    struct iovec remote[2] = {{(void *)(uintptr_t)addr, 1}, {(void *)(uintptr_t)(addr + size - 1), 1}};
    ssize_t n = process_vm_readv(getpid(), local, 2, remote, 2, 0);
    if (n == 2)
        return 0;
    if (n < 0 && (errno == ENOSYS || errno == EPERM))
        return -ENOSYS;
    return -EFAULT;
}

/* ---- futex waits --------------------------------------------------------------------- */

static int futex_wait(_Atomic uint32_t *word, uint32_t val, const struct timespec *rel)
{
    return (int)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, rel, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* A completion flag: 0 pending, 2 pending with a waiter asleep on it, 1 set. The setter
 * makes the futex call only when someone sleeps (most requests are waited for after they
 * completed, or by nobody: a system call per request saved on the workers). */
enum { FLAG_PENDING = 0, FLAG_SET = 1, FLAG_WAITED = 2 };

int io_flag_is_set(const _Atomic uint32_t *word)
{
    return atomic_load_explicit((_Atomic uint32_t *)word, memory_order_acquire) == FLAG_SET;
}

/* Wait until the flag is set. */
int io_wait_flag(_Atomic uint32_t *word, int64_t timeout_ns)
{
    int64_t deadline = timeout_ns >= 0 ? now_ns() + timeout_ns : 0;
    for (;;) {
        uint32_t v = atomic_load_explicit(word, memory_order_acquire);
        if (v == FLAG_SET)
            return 0;
        if (v == FLAG_PENDING &&
            !atomic_compare_exchange_weak_explicit(word, &v, FLAG_WAITED, memory_order_acq_rel, memory_order_acquire))
            continue; /* set (or marked) meanwhile: look again */
        struct timespec rel, *tp = NULL;
        if (timeout_ns >= 0) {
            int64_t left = deadline - now_ns();
            if (left <= 0)
                return -ETIMEDOUT;
            rel.tv_sec = left / 1000000000ll;
            rel.tv_nsec = left % 1000000000ll;
            tp = &rel;
        }
        futex_wait(word, FLAG_WAITED, tp);
    }
}

void io_set_flag(_Atomic uint32_t *word)
{
    if (atomic_exchange_explicit(word, FLAG_SET, memory_order_acq_rel) == FLAG_WAITED)
        futex_wake_all(word);
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

/* ---- workers: wakeups and the shared queue ------------------------------------------- */

void worker_wake(struct io_worker *w)
{
    uint64_t one = 1;
    ssize_t rc = write(w->efd, &one, sizeof(one));
    (void)rc; /* EAGAIN only when the counter is saturated: already awake */
}

static void idle_remove_locked(phx_ctx *ctx, struct io_worker *w)
{
    if (!w->idle)
        return;
    for (int i = 0; i < ctx->nidle; i++) {
        if (ctx->idle[i] == w) {
            ctx->idle[i] = ctx->idle[--ctx->nidle];
            break;
        }
    }
    w->idle = 0;
}

static void queue_push(phx_ctx *ctx, struct io_chunk *head, struct io_chunk *tail, int n, int internal)
{
    if (!head)
        return;
    pthread_mutex_lock(&ctx->qmu);
    struct io_chunk **qh = internal ? &ctx->iq_head : &ctx->q_head, **qt = internal ? &ctx->iq_tail : &ctx->q_tail;
    if (*qt)
        (*qt)->next = head;
    else
        *qh = head;
    *qt = tail;
    if (!internal)
        ctx->qlen += n;
    if (internal && ctx->nidle == 0) {
        /* no idle worker: wake them all, a worker whose chunks are parked takes these */
        for (int i = 0; i < ctx->nworkers; i++)
            worker_wake(&ctx->workers[i]);
    }
    for (; n > 0 && ctx->nidle > 0; n--) {
        struct io_worker *w = ctx->idle[--ctx->nidle];
        w->idle = 0;
        worker_wake(w);
    }
    pthread_mutex_unlock(&ctx->qmu);
}

/* A worker may start another internal chunk: fewer than its capacity are in their I/O
 * (parked chunks hold no ring entry and no slot). */
static int internal_room(const struct io_worker *w)
{
    return w->owned - w->nparked < w->cap;
}

/* Take one chunk of the internal queue, if any. */
static struct io_chunk *internal_take(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    if (!__atomic_load_n(&ctx->iq_head, __ATOMIC_RELAXED))
        return NULL;
    pthread_mutex_lock(&ctx->qmu);
    struct io_chunk *ch = ctx->iq_head;
    if (ch) {
        ctx->iq_head = ch->next;
        if (!ctx->iq_head)
            ctx->iq_tail = NULL;
        ch->next = NULL;
        idle_remove_locked(ctx, w);
    }
    pthread_mutex_unlock(&ctx->qmu);
    return ch;
}

/* Take up to n chunks; the worker is no longer idle if it takes any. */
static struct io_chunk *queue_take(struct io_worker *w, int n)
{
    phx_ctx *ctx = w->ctx;
    if (n <= 0)
        return NULL;
    pthread_mutex_lock(&ctx->qmu);
    /* a fair share, so that the other workers (woken by queue_push) get some: with
     * buffered I/O of cached data the copy runs in the submitting thread */
    int64_t share = (ctx->qlen + ctx->nworkers - 1) / ctx->nworkers;
    if (share < n)
        n = share < 1 ? 1 : (int)share;
    struct io_chunk *head = ctx->q_head, *last = NULL, *c = head;
    int taken = 0;
    uint64_t bytes = w->owned_bytes;
    for (; taken < n && c; taken++) {
        if (bytes && bytes + c->len > w->bytes_cap)
            break; /* enough bytes in flight: leave the rest to the other workers */
        bytes += c->len;
        last = c;
        c = c->next;
    }
    if (last) {
        ctx->qlen -= taken;
        ctx->q_head = c;
        if (!c)
            ctx->q_tail = NULL;
        last->next = NULL;
        idle_remove_locked(ctx, w);
    } else {
        head = NULL;
    }
    pthread_mutex_unlock(&ctx->qmu);
    return head;
}

/* Before sleeping: register as wanting work if this worker can take some. Returns 0
 * when there is queued work it can take right now (do not sleep). */
static int idle_register(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    int can_take = w->owned < w->cap && w->owned_bytes < w->bytes_cap && !w->parked_head;
    pthread_mutex_lock(&ctx->qmu);
    if ((can_take && ctx->q_head) || (ctx->iq_head && internal_room(w))) {
        pthread_mutex_unlock(&ctx->qmu);
        return 0;
    }
    if (can_take && !w->idle) {
        w->idle = 1;
        ctx->idle[ctx->nidle++] = w;
    }
    pthread_mutex_unlock(&ctx->qmu);
    return 1;
}

/* ---- requests: completion ------------------------------------------------------------ */

static void req_unref(phx_req *r)
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

static void chunk_finish(struct io_chunk *ch)
{
    phx_req *r = ch->req;
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

/* ---- chunks: device copies ----------------------------------------------------------- */

static void *worker_stream(struct io_worker *w, int dev)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    if (dev < 0 || dev >= IO_MAX_DEVICES)
        return NULL;
    if (w->cur_dev != dev) {
        if (dp->set_device(dev) != dp->success)
            return NULL;
        w->cur_dev = dev;
    }
    if (!w->streams[dev]) {
        void *s = NULL;
        if (dp->stream_create(&s, dp->stream_flags) != dp->success)
            return NULL;
        w->streams[dev] = s;
        STAT_ADD(worker_streams, 1);
    }
    return w->streams[dev];
}

/* A chunk's bounce slot goes back: to the pool, or (a stream op's own request, which
 * never waits for the pool) to the allocator. */
static void slot_free(struct io_chunk *ch)
{
    if (!ch->slot)
        return;
    if (ch->req->internal)
        free(ch->slot);
    else
        pool_free(&ch->req->ctx->pool, ch->slot, ch->slot_bytes);
    ch->slot = NULL;
}

/* Stream callback: a staged read's device copy is done. No vendor call, no Python. */
static void cb_read_copied(void *arg)
{
    struct io_chunk *ch = arg;
    slot_free(ch);
    chunk_finish(ch);
}

/* Stream callback: the device copies of a batch of staged reads are done (a list linked
 * through ->next, see flush_copies). No vendor call, no Python. */
static void cb_read_copied_list(void *arg)
{
    struct io_chunk *ch = arg;
    while (ch) {
        struct io_chunk *next = ch->next; /* before finishing: the request may be freed */
        cb_read_copied(ch);
        ch = next;
    }
}

/* Launch one completion callback per device for the staged reads whose copies this worker
 * queued since the last flush. A host callback per chunk costs the runtime's callback
 * thread ~tens of microseconds each: at 64 KiB random reads it was the bottleneck; here a
 * worker's completions of one reap share one. Called before the worker sleeps, and as
 * soon as IO_FLUSH_BYTES are queued (large chunks: their slots come back one by one, not
 * after the worker's whole round of reads, which for page-cache reads run inline). */
static void flush_copies(struct io_worker *w)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    for (int d = 0; d < IO_MAX_DEVICES; d++) {
        struct io_chunk *list = w->copied[d];
        if (!list)
            continue;
        w->copied[d] = NULL;
        w->copied_bytes[d] = 0;
        void *stream = w->streams[d];
        if (w->cur_dev != d && dp->set_device(d) == dp->success)
            w->cur_dev = d;
        STAT_ADD(copy_flushes, 1);
        if (dp->launch_host_func(stream, cb_read_copied_list, list) != dp->success) {
            int ok = dp->stream_synchronize(stream) == dp->success;
            for (struct io_chunk *c = list; c; c = c->next)
                if (!ok) {
                    c->err = EIO;
                    c->got = 0;
                }
            cb_read_copied_list(list);
        }
    }
}

/* Stream callback: a staged write's slot is filled; hand the chunk back to its worker. */
static void cb_write_filled(void *arg)
{
    struct io_chunk *ch = arg;
    struct io_worker *w = ch->owner;
    struct io_chunk *old = atomic_load(&w->inbox);
    do {
        ch->next = old;
    } while (!atomic_compare_exchange_weak(&w->inbox, &old, ch));
    worker_wake(w);
}

/* Queue the copy between the chunk's slot and its device memory on the worker's stream
 * for that device (to the device: the bytes read; from it: the whole chunk). Returns the
 * stream, or NULL on a vendor error. */
static void *queue_dev_copy(struct io_worker *w, struct io_chunk *ch, int to_device)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    void *stream = worker_stream(w, ch->req->device);
    if (!stream || fence_order_copy(w, ch->req->device, stream, ch->req->fence) < 0)
        return NULL;
    char *slot = ch->slot + ch->slot_off;
    int rc = to_device ? dp->memcpy_async(ch->user, slot, ch->got, dp->kind_h2d, stream)
                       : dp->memcpy_async(slot, ch->user, ch->len, dp->kind_d2h, stream);
    return rc == dp->success ? stream : NULL;
}

/* A staged write: queue the copy of the chunk from device memory into its slot, then `cb`.
 * (Staged reads queue theirs with queue_dev_copy and share a callback: flush_copies.)
 * Returns 0 when queued, 1 when it completed synchronously (launch_host_func refused:
 * the copy was synchronized here), -EIO on a vendor error. */
static int dev_copy_to_slot(struct io_worker *w, struct io_chunk *ch, phx_host_fn cb)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    void *stream = queue_dev_copy(w, ch, 0);
    if (!stream)
        return -EIO;
    if (dp->launch_host_func(stream, cb, ch) != dp->success)
        return dp->stream_synchronize(stream) == dp->success ? 1 : -EIO;
    return 0;
}

/* ---- chunks: warm reads from registered file mappings (io_fmap.c) ----------------------- */

/* Stream callback: every piece of a hit is on the device. Cuts the pieces' counts to
 * what the file held and drops the window references (fmap_req_copied: no vendor call),
 * and completes the request as one chunk: chunks[0] is rewritten to stand for the whole
 * request (its count: the contiguous prefix before end of file). */
static void cb_fmap_copied(void *arg)
{
    phx_req *r = arg;
    uint64_t got = 0;
    int short_seen = 0;
    fmap_req_copied(r->ctx, r);
    for (uint32_t i = 0; i < r->nchunks; i++) {
        struct io_chunk *ch = &r->chunks[i];
        if (!short_seen)
            got += ch->got;
        if (ch->got < ch->len)
            short_seen = 1;
    }
    struct io_chunk *c0 = &r->chunks[0];
    c0->foff = r->foff;
    c0->len = r->size;
    c0->got = c0->err ? 0 : got;
    chunk_finish(c0);
}

/* A hit is one unit of work (only chunks[0] is queued): one memcpy_async per piece on
 * this worker's stream, then one host callback for the whole request. One wakeup, one
 * waiter, no bounce slot, no file I/O. */
static void fmap_req_start(struct io_worker *w, struct io_chunk *c0)
{
    phx_req *r = c0->req;
    const struct phx_dp_table *dp = &w->ctx->dp;
    w->owned--;
    w->owned_bytes -= c0->len;
    void *stream = worker_stream(w, r->device);
    int err = stream && fence_order_copy(w, r->device, stream, r->fence) == 0 ? 0 : EIO;
    for (uint32_t i = 0; i < r->nchunks && !err; i++) {
        struct io_chunk *ch = &r->chunks[i];
        if (!ch->win || !ch->got)
            continue;
        if (dp->memcpy_async(ch->user, ch->win->addr + (ch->foff - ch->win->off), ch->got, dp->kind_h2d, stream) !=
            dp->success)
            err = EIO;
    }
    if (!err && dp->launch_host_func(stream, cb_fmap_copied, r) == dp->success)
        return;
    if (stream && dp->stream_synchronize(stream) != dp->success)
        err = EIO;
    c0->err = err;
    cb_fmap_copied(r);
}

/* ---- chunks: file I/O ---------------------------------------------------------------- */

static void sub_issue(struct io_worker *w, struct io_sub *s);
static void chunk_io_done(struct io_worker *w, struct io_chunk *ch);
static void start_read_copy(struct io_worker *w, struct io_chunk *ch);

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

static void sub_run_sync(struct io_worker *w, struct io_sub *s);

/* The page-cache probe (direct=None files): an O_DIRECT read of data that is already
 * cached would go to the disk anyway (and flush dirty pages first), so a read whose
 * range is mostly cached is done buffered instead. cachestat(2) (Linux 6.5+) counts the
 * cached pages of a range without touching them or starting readahead (a RWF_NOWAIT
 * read would start readahead on a miss: disk bandwidth stolen from the O_DIRECT reads).
 * The answer only picks the path: both paths read the same bytes. While probes miss,
 * back off: after 8 misses in a row, one read in 32 probes. */
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* the same number on every architecture */
#endif
struct io_cachestat_range {
    uint64_t off, len;
};
struct io_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

static int mostly_cached(phx_file *f, int64_t off, uint64_t len)
{
    if (!atomic_load_explicit(&f->cache_probe, memory_order_relaxed))
        return 0;
    if (atomic_load_explicit(&f->probe_misses, memory_order_relaxed) >= 8 &&
        (atomic_fetch_add_explicit(&f->probe_tick, 1, memory_order_relaxed) & 31) != 0)
        return 0;
    struct io_cachestat_range range = {(uint64_t)off, len};
    struct io_cachestat cs;
    if (syscall(__NR_cachestat, f->fd_buf, &range, &cs, 0) < 0) {
        atomic_store(&f->cache_probe, 0); /* ENOSYS (kernel < 6.5), EPERM (seccomp): stop asking */
        return 0;
    }
    uint64_t pages = (len + 4095) / 4096;
    if (cs.nr_cache * 2 >= pages && cs.nr_cache) {
        atomic_store_explicit(&f->probe_misses, 0, memory_order_relaxed);
        STAT_ADD(cache_hit_bytes, (int64_t)len);
        return 1;
    }
    atomic_fetch_add_explicit(&f->probe_misses, 1, memory_order_relaxed);
    STAT_ADD(cache_misses, 1);
    return 0;
}

int phx_cache_probe_works(phx_file *f)
{
    struct io_cachestat_range range = {0, 4096};
    struct io_cachestat cs;
    return syscall(__NR_cachestat, f->fd_buf, &range, &cs, 0) < 0 ? -errno : 0;
}

static int sub_aligned(phx_file *f, struct io_sub *s)
{
    return !(((uint64_t)s->off + s->done) % f->a_off || (s->len - s->done) % f->a_off ||
             (uintptr_t)(s->buf + s->done) % f->a_mem);
}

static void sub_done(struct io_worker *w, struct io_sub *s, int64_t res)
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
    if (--ch->subs_left == 0)
        chunk_io_done(w, ch);
}

static void sub_run_sync(struct io_worker *w, struct io_sub *s)
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
    sqe->opcode = ch->req->op == PHX_OP_READ ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = s->direct ? f->fd_direct : f->fd_buf;
    sqe->addr = (uint64_t)(uintptr_t)(s->buf + s->done);
    sqe->len = (uint32_t)(len > IO_MAX_CHUNK ? IO_MAX_CHUNK : len);
    sqe->off = (uint64_t)s->off + s->done;
    sqe->user_data = (uint64_t)(uintptr_t)s;
    w->ring_inflight++;
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
        if (r->op == PHX_OP_READ && !err && got)
            memcpy(ch->user, ch->slot + ch->slot_off, got);
    } else if (ch->path == CH_STAGED_DEV && r->op == PHX_OP_READ && !err && got) {
        if (w->in_reap) {
            /* reaped from the ring: its copy is queued after the worker has submitted
             * the reads that replace this round's (run_copies), so that a vendor call
             * per completion does not delay the next reads (random reads) */
            chunk_fifo_push(&w->copy_head, &w->copy_tail, ch);
            return;
        }
        start_read_copy(w, ch);
        return;
    }
    slot_free(ch);
    chunk_finish(ch);
}

/* Queue the device copy of a staged read whose file I/O is done; its completion callback
 * is launched with the others of this round by flush_copies (before the worker sleeps). */
static void start_read_copy(struct io_worker *w, struct io_chunk *ch)
{
    phx_req *r = ch->req;
    if (queue_dev_copy(w, ch, 1)) {
        ch->next = w->copied[r->device];
        w->copied[r->device] = ch;
        w->copied_bytes[r->device] += ch->got;
        if (w->copied_bytes[r->device] >= IO_FLUSH_BYTES)
            flush_copies(w);
        return; /* cb_read_copied_list frees the slot and finishes the chunk */
    }
    ch->err = EIO;
    ch->got = 0;
    slot_free(ch);
    chunk_finish(ch);
}

static void run_copies(struct io_worker *w)
{
    struct io_chunk *ch = w->copy_head;
    w->copy_head = w->copy_tail = NULL;
    while (ch) {
        struct io_chunk *next = ch->next; /* start_read_copy relinks ch */
        start_read_copy(w, ch);
        ch = next;
    }
}

static void chunk_issue_subs(struct io_worker *w, struct io_chunk *ch)
{
    /* a sub may complete inside sub_issue (injected fault, full ring) and with it the
     * chunk and its request, which may free ch: read nsub first */
    int n = ch->nsub;
    int probe = ch->req->op == PHX_OP_READ;
    ch->subs_left = (uint8_t)n;
    for (int i = 0; i < n; i++) {
        struct io_sub *s = &ch->sub[i];
        if (probe && s->direct && mostly_cached(ch->req->file, s->off, s->len)) {
            s->direct = 0;
            s->cached = 1;
        }
        sub_issue(w, s);
    }
}

static void chunk_fail(struct io_worker *w, struct io_chunk *ch, int err)
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
    chunk_fifo_push(&w->parked_head, &w->parked_tail, ch);
}

/* A read of page-cache data is CPU copies into slots and DMAs out of them; with the whole
 * pool (4 slots of 16 MiB per worker) the DMAs can queue far behind the copies (a long
 * tail, slots cold in the cache when the DMA reads them). Such chunks start only while
 * the pool has less than IO_CACHED_SLOTS 4 MiB slots per worker in use (all requests'
 * slots count); a worker parks until one comes back, as KvikIO's threads wait for their
 * bounce buffer's copy. H200 run 6: staged 4 MiB chunks with 4 slots per worker read a
 * cached file at 35-38 GB/s, with 16 per worker at 33-34; run 8 (a host whose memory
 * bandwidth bounded every staged reader): no difference. */
static uint64_t slot_cap(const struct io_worker *w, const struct io_chunk *ch)
{
    return ch->req->cached ? (uint64_t)w->ctx->nworkers * IO_CACHED_SLOTS * IO_CACHED_CHUNK : 0;
}

/* Start a chunk the worker owns (owned already counts it). */
static void chunk_start(struct io_worker *w, struct io_chunk *ch)
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
        } else if (!(ch->slot = pool_alloc(&w->ctx->pool, ch->slot_bytes, slot_cap(w, ch), w))) {
            park(w, ch);
            return;
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
        memcpy(ch->slot + ch->slot_off, ch->user, ch->len);
    } else if (r->op == PHX_OP_WRITE && ch->path == CH_STAGED_DEV) {
        int rc = dev_copy_to_slot(w, ch, cb_write_filled);
        if (rc < 0)
            chunk_fail(w, ch, EIO);
        else if (rc == 1)
            chunk_issue_subs(w, ch);
        return; /* queued: the inbox brings it back */
    }
    chunk_issue_subs(w, ch);
}

static int retry_parked(struct io_worker *w)
{
    int n = 0;
    if (atomic_load_explicit(&w->pool_wait, memory_order_relaxed))
        return 0; /* not woken yet */
    while (w->parked_head) {
        struct io_chunk *ch = w->parked_head;
        ch->slot = pool_alloc(&w->ctx->pool, ch->slot_bytes, slot_cap(w, ch), w);
        if (!ch->slot)
            break;
        w->parked_head = ch->next;
        if (!w->parked_head)
            w->parked_tail = NULL;
        w->nparked--;
        chunk_start(w, ch);
        n++;
    }
    return n;
}

static int drain_inbox(struct io_worker *w)
{
    struct io_chunk *list = atomic_exchange(&w->inbox, NULL), *fifo = NULL;
    if (!list)
        return 0;
    while (list) { /* the inbox is a stack: reverse it */
        struct io_chunk *next = list->next;
        list->next = fifo;
        fifo = list;
        list = next;
    }
    int n = 0;
    while (fifo) {
        struct io_chunk *ch = fifo;
        fifo = ch->next;
        chunk_issue_subs(w, ch);
        n++;
    }
    return n;
}

static int admit(struct io_worker *w, int n)
{
    int k = 0;
    struct io_chunk *ch;
    while (internal_room(w) && (ch = internal_take(w))) {
        w->owned++;
        w->owned_bytes += ch->len;
        chunk_start(w, ch);
        k++;
    }
    if (w->parked_head || atomic_load(&w->ctx->stop))
        return k;
    if (n > w->cap - w->owned)
        n = w->cap - w->owned;
    ch = queue_take(w, n);
    while (ch) {
        struct io_chunk *next = ch->next;
        w->owned++;
        w->owned_bytes += ch->len;
        chunk_start(w, ch);
        ch = next;
        k++;
    }
    return k;
}

static int run_sync(struct io_worker *w)
{
    int n = 0;
    while (w->sync_head) {
        struct io_sub *s = w->sync_head;
        w->sync_head = s->next;
        if (!w->sync_head)
            w->sync_tail = NULL;
        sub_run_sync(w, s);
        n++;
    }
    return n;
}

static void efd_arm(struct io_worker *w)
{
    if (w->efd_armed)
        return;
    struct io_uring_sqe *sqe = ring_get_sqe(&w->ring);
    if (!sqe) {
        ring_enter(&w->ring, 0);
        sqe = ring_get_sqe(&w->ring);
        if (!sqe)
            return;
    }
    sqe->opcode = IORING_OP_READ;
    sqe->fd = w->efd;
    sqe->addr = (uint64_t)(uintptr_t)&w->efd_val;
    sqe->len = sizeof(w->efd_val);
    sqe->off = (uint64_t)-1; /* current position: eventfds have none */
    sqe->user_data = EFD_TAG;
    w->efd_armed = 1;
}

static void reap(struct io_worker *w)
{
    struct io_uring_cqe *cqe;
    w->in_reap = 1;
    while ((cqe = ring_peek_cqe(&w->ring))) {
        uint64_t ud = cqe->user_data;
        int res = cqe->res;
        ring_cqe_seen(&w->ring);
        if (ud == EFD_TAG) {
            w->efd_armed = 0;
            continue;
        }
        w->ring_inflight--;
        sub_done(w, (struct io_sub *)(uintptr_t)ud, res);
    }
    w->in_reap = 0;
}

static void worker_loop_ring(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    for (;;) {
        int progress = drain_inbox(w);
        progress += retry_parked(w);
        if (w->owned_bytes < w->bytes_cap || ctx->iq_head)
            progress += admit(w, w->cap - w->owned);
        if (w->copy_head) {
            /* the new reads go to the kernel first, then the last round's device copies */
            if (ring_unsubmitted(&w->ring))
                ring_enter(&w->ring, 0);
            run_copies(w);
        }
        flush_copies(w);
        if (atomic_load(&ctx->stop) && w->owned == 0 && !w->ring_inflight)
            break;
        unsigned wait = 0;
        if (!atomic_load(&w->inbox) && idle_register(w))
            wait = 1;
        efd_arm(w);
        int rc = ring_enter(&w->ring, wait);
        if (rc == -EBUSY || rc == -EAGAIN) /* completions must be reaped first */
            wait = 0;
        reap(w);
        (void)progress;
    }
}

static void worker_loop_threads(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    for (;;) {
        int progress = drain_inbox(w);
        progress += retry_parked(w);
        progress += run_sync(w);
        /* one chunk at a time, so that idle workers take the next ones */
        if ((w->owned < w->cap || ctx->iq_head) && admit(w, 1)) {
            run_sync(w);
            progress++;
        }
        flush_copies(w);
        if (progress)
            continue;
        if (atomic_load(&ctx->stop) && w->owned == 0)
            break;
        if (!atomic_load(&w->inbox) && idle_register(w)) {
            uint64_t v;
            ssize_t n = read(w->efd, &v, sizeof(v));
            (void)n;
        }
    }
}

static void worker_close_streams(struct io_worker *w)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    for (int d = 0; d < IO_MAX_DEVICES; d++) {
        if (!w->streams[d])
            continue;
        dp->set_device(d);
        dp->stream_synchronize(w->streams[d]);
        dp->stream_destroy(w->streams[d]);
        w->streams[d] = NULL;
        STAT_ADD(worker_streams, -1);
    }
}

struct start_sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started, failed, err;
    char why[200];
};

static void *worker_main(void *arg)
{
    struct io_worker *w = arg;
    phx_ctx *ctx = w->ctx;
    struct start_sync *ss = w->start;
    int rc = 0;
    char why[200] = "";
    pthread_setname_np(pthread_self(), "phx-io"); /* as top, perf and /proc/.../task show it */
    if (w->use_ring) {
        unsigned want = 3u * (unsigned)w->cap + 2, entries = 8;
        while (entries < want)
            entries <<= 1;
        /* the ring is created by the thread that alone uses it (SINGLE_ISSUER) */
        rc = ring_init(&w->ring, entries, why, sizeof(why));
    }
    pthread_mutex_lock(&ss->mu);
    ss->started++;
    if (rc < 0) {
        ss->failed++;
        ss->err = rc;
        memcpy(ss->why, why, sizeof(why));
    }
    pthread_cond_broadcast(&ss->cv);
    pthread_mutex_unlock(&ss->mu);
    if (rc < 0)
        return NULL;
    STAT_ADD(threads, 1);
    if (w->use_ring)
        worker_loop_ring(w);
    else
        worker_loop_threads(w);
    if (ctx->has_dp)
        worker_close_streams(w);
    if (w->use_ring)
        ring_exit(&w->ring);
    STAT_ADD(threads, -1);
    return NULL;
}

static void ctx_stop_workers(phx_ctx *ctx, int n)
{
    atomic_store(&ctx->stop, 1);
    for (int i = 0; i < n; i++)
        worker_wake(&ctx->workers[i]);
    for (int i = 0; i < n; i++)
        pthread_join(ctx->workers[i].th, NULL);
    for (int i = 0; i < ctx->nworkers; i++)
        if (ctx->workers[i].efd >= 0)
            close(ctx->workers[i].efd);
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
    ctx->engine = engine;
    snprintf(ctx->engine_why, sizeof(ctx->engine_why), "%s", engine_why);
    if (dp) {
        ctx->dp = *dp;
        ctx->has_dp = 1;
        ctx->has_events = phx_dp_has_events(dp);
    }
    pthread_mutex_init(&ctx->fence_mu, NULL);
    ctx->chunk = cfg->chunk_size;
    fmap_init(ctx);
    /* bounce pool 0 = auto: four slots per worker (one being read, the others waiting for
     * or in their device copy and its completion callback), so that no worker waits for a
     * slot at the configured concurrency: on the H200 two slots per worker held warm staged
     * reads to ~21 GB/s (a slot lives for the read, the copy and the callback's latency) */
    if (ctx->cfg.bounce_pool_size == 0) {
        uint64_t want = 4ull * cfg->threads * pool_round(cfg->chunk_size + 2 * IO_MAX_ALIGN);
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
    for (int i = 0; i < ctx->nworkers; i++)
        ctx->workers[i].efd = -1;
    struct start_sync ss = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    int started = 0, rc = 0;
    for (int i = 0; i < ctx->nworkers; i++) {
        struct io_worker *w = &ctx->workers[i];
        w->ctx = ctx;
        w->idx = i;
        w->cur_dev = -1;
        w->use_ring = engine == PHX_ENGINE_IO_URING;
        w->cap = w->use_ring ? (int)cfg->queue_depth : 2;
        w->bytes_cap = w->use_ring ? IO_WORKER_BYTES : UINT64_MAX;
        w->efd = eventfd(0, EFD_CLOEXEC);
        if (w->efd < 0) {
            rc = -errno;
            break;
        }
        w->start = &ss;
        if ((rc = -pthread_create(&w->th, NULL, worker_main, w)) < 0)
            break;
        started++;
    }
    pthread_mutex_lock(&ss.mu);
    while (ss.started < started)
        pthread_cond_wait(&ss.cv, &ss.mu);
    pthread_mutex_unlock(&ss.mu);
    if (!rc && ss.failed) {
        rc = ss.err;
        snprintf(ctx->engine_why, sizeof(ctx->engine_why), "%s", ss.why);
    }
    if (rc < 0) {
        ctx_stop_workers(ctx, started);
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
    return 0;
}

int64_t phx_ctx_prepare(phx_ctx *ctx)
{
    if (!ctx)
        return -EINVAL;
    if (!ctx->has_dp)
        return 0; /* no staging without a data path: nothing to pin */
    return pool_prepare(&ctx->pool);
}

void phx_ctx_destroy(phx_ctx *ctx)
{
    if (!ctx)
        return;
    pthread_mutex_lock(&ctx->mu);
    while (ctx->inflight > 0)
        pthread_cond_wait(&ctx->cv, &ctx->mu);
    pthread_mutex_unlock(&ctx->mu);
    ctx_stop_workers(ctx, ctx->nworkers);
    ctx_free(ctx);
    STAT_ADD(contexts, -1);
}

/* ---- requests: planning and submission ------------------------------------------------ */

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

static void req_fail_now(phx_req *r, int err)
{
    r->result = -err;
    r->err = err;
    r->err_off = r->foff;
    r->err_len = r->size;
    atomic_store(&r->state, FLAG_SET); /* before anyone can wait: no wake owed */
}

/* Build a request: chunks planned, not queued. On a refusal returns a request that is
 * already complete with its error (*queued = 0). */
static phx_req *req_build(phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                          int want_handle, int *queued)
{
    *queued = 0;
    int err = 0;
    int staged_dev = d->mem == PHX_MEM_DEVICE || (d->mem == PHX_MEM_DEVICE_MAPPED && d->mode == PHX_MODE_STAGED);
    phx_file *f = d->file;
    if (!f)
        err = EBADF;
    else if (d->op != PHX_OP_READ && d->op != PHX_OP_WRITE)
        err = EINVAL;
    else if (d->mem < PHX_MEM_HOST || d->mem > PHX_MEM_DEVICE_MAPPED || d->mode < PHX_MODE_AUTO ||
             d->mode > PHX_MODE_DIRECT)
        err = EINVAL;
    else if (d->file_offset < 0 || d->size > (uint64_t)INT64_MAX - (uint64_t)d->file_offset ||
             d->addr + d->size < d->addr)
        err = EINVAL;
    else if (d->size && !d->addr)
        err = EFAULT;
    else if (d->mem == PHX_MEM_DEVICE && d->mode == PHX_MODE_DIRECT)
        err = EOPNOTSUPP; /* device memory the CPU cannot address: no direct path */
    else if (staged_dev && !ctx->has_dp)
        err = ENODEV;     /* device memory, but no vendor data path to copy with */
    else if (!internal && d->size && phx_reg_lookup(d->addr, d->size, NULL) == -EFAULT)
        err = EFAULT;     /* runs past the end of its registration: nothing moves */
    else if (d->after && (internal || d->after->ctx != ctx))
        err = EINVAL;     /* a fence of another context */

    uint32_t nchunks = 0;
    int direct = 0, slot_path = staged_dev;
    uint64_t C = ctx->chunk, A = 4096;
    struct fmap_plan fp = {0};
    int fhit = 0;
    if (!err && d->size && d->op == PHX_OP_READ && staged_dev && !internal)
        fhit = fmap_plan(ctx, f, d, &fp);
    if (fhit) {
        nchunks = fp.nchunks;
    } else if (!err && d->size) {
        direct = atomic_load(&f->direct_ok);
        /* O_DIRECT reads and writes whole aligned blocks: one that would end past the
         * largest file offset is refused (EINVAL) where the exact extent is not (a read
         * there is past every file's end: 0); such extents go buffered */
        if (direct && (uint64_t)d->file_offset + d->size > (uint64_t)INT64_MAX - 2 * (uint64_t)f->align)
            direct = 0;
        A = direct ? f->align : 4096;
        if (!staged_dev && direct) {
            /* O_DIRECT into the caller's memory needs the body's address aligned where
             * its file offset is: the same for every chunk of the request */
            uint64_t head = (A - (uint64_t)d->file_offset % A) % A;
            slot_path = head < d->size && d->size - head >= A && (d->addr + head) % f->a_mem != 0;
        }
        if (slot_path)
            C = ctx->stage_chunk;
        /* A read from the page cache is a memory copy into the slot, then a DMA: smaller
         * chunks overlap the two sooner (H200: 4 MiB staged chunks moved 39-43 GB/s from
         * tmpfs, 16 MiB ones 37-39; KvikIO's tasks are 4 MiB too). */
        if (fp.resident && C > IO_CACHED_CHUNK)
            C = IO_CACHED_CHUNK;
        C = align_up(C, A);
        uint64_t first = align_down((uint64_t)d->file_offset, C);
        uint64_t last = align_down((uint64_t)d->file_offset + d->size - 1, C);
        nchunks = (uint32_t)((last - first) / C + 1);
    }
    phx_req *r = calloc(1, sizeof(*r) + (size_t)nchunks * sizeof(struct io_chunk));
    if (!r) {
        if (fhit)
            fmap_plan_drop(ctx, &fp);
        return NULL;
    }
    r->ctx = ctx;
    r->file = f;
    r->op = d->op;
    r->mem = d->mem;
    r->device = d->device;
    r->addr = (char *)(uintptr_t)d->addr;
    r->foff = d->file_offset;
    r->size = d->size;
    r->on_done = on_done;
    r->on_done_arg = arg;
    r->cached = fp.resident && !fhit;
    r->internal = internal;
    atomic_init(&r->refs, want_handle ? 2 : 1);
    atomic_init(&r->eof_at, INT64_MAX);
    if (err || !d->size) {
        if (err)
            req_fail_now(r, err);
        else
            atomic_store(&r->state, FLAG_SET);
        if (on_done)
            on_done(r, arg);
        if (!want_handle) {
            free(r);
            return REQ_DONE_NO_HANDLE;
        }
        atomic_store(&r->refs, 1);
        return r;
    }
    r->nchunks = nchunks;
    r->fence = fence_ref(d->after);
    if (fhit) {
        /* one unit of work: see fmap_req_start */
        atomic_init(&r->pending, 1);
        r->path = CH_FMAP;
        fmap_fill(ctx, &fp, r);
        *queued = 1;
        return r;
    }
    atomic_init(&r->pending, (int)nchunks);
    int path = staged_dev ? CH_STAGED_DEV : slot_path ? CH_STAGED_CPU : CH_USER;
    r->path = path;
    int64_t off = d->file_offset, end = d->file_offset + (int64_t)d->size;
    for (uint32_t i = 0; i < nchunks; i++) {
        struct io_chunk *ch = &r->chunks[i];
        /* in unsigned arithmetic: the next boundary may lie at 2**63 (offsets near the
         * largest one), which int64_t cannot hold */
        uint64_t bound = align_down((uint64_t)off, C) + C;
        int64_t next = bound > (uint64_t)end ? end : (int64_t)bound;
        ch->req = r;
        ch->foff = off;
        ch->len = (uint64_t)(next - off);
        ch->user = r->addr + (off - d->file_offset);
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
        STAT_ADD(chunks_user, nchunks);
    else if (path == CH_STAGED_DEV)
        STAT_ADD(chunks_staged, nchunks);
    else
        STAT_ADD(chunks_staged_cpu, nchunks);
    *queued = 1;
    return r;
}

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
        fmap_write_begin(ctx, r->file, r->foff, r->size);        /* after file_get: a file with nothing in flight forgets its writes' ends */
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
    struct io_chunk *head = NULL, *tail = NULL;
    int nq = 0;
    for (uint32_t i = 0; i < n; i++) {
        int queued;
        phx_req *r = req_build(ctx, &descs[i], 0, NULL, NULL, 1, &queued);
        if (!r) {
            /* out of memory: queue what was built, refuse the rest */
            for (uint32_t j = i; j < n; j++)
                out[j] = NULL;
            queue_push(ctx, head, tail, nq, 0);
            return i ? 0 : -ENOMEM;
        }
        out[i] = r;
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
        for (uint32_t c = 0; c < nqueue; c++) {
            struct io_chunk *ch = &r->chunks[c];
            ch->next = NULL;
            if (tail)
                tail->next = ch;
            else
                head = ch;
            tail = ch;
        }
        nq += (int)nqueue;
    }
    queue_push(ctx, head, tail, nq, 0);
    return 0;
}

int io_submit_one(phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                  phx_req **out)
{
    int queued;
    phx_req *r = req_build(ctx, d, internal, on_done, arg, out != NULL, &queued);
    if (!r)
        return -ENOMEM;
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
    queue_push(ctx, head, tail, (int)nqueue, internal);
    return 0;
}

int phx_req_wait(phx_req *r, int64_t timeout_ns)
{
    if (!r)
        return -EINVAL;
    return io_wait_flag(&r->state, timeout_ns);
}

int phx_req_done(const phx_req *r)
{
    return r && io_flag_is_set(&r->state);
}

int64_t phx_req_result(const phx_req *r)
{
    if (!phx_req_done(r))
        return -EBUSY;
    return r->result;
}

int phx_req_error_extent(const phx_req *r, int64_t *offset, uint64_t *length)
{
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
    int64_t deadline = timeout_ns >= 0 ? now_ns() + timeout_ns : 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!reqs[i]) {
            if (results)
                results[i] = -ENOMEM;
            continue;
        }
        int64_t left = -1;
        if (timeout_ns >= 0 && (left = deadline - now_ns()) < 0)
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
