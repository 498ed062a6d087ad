/* Workers: the context's chunk queues and the threads that drive the engines.
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
 * Priorities: each queue is a pair, normal and background (enum phx_priority). Workers
 * take normal chunks first; while background chunks wait, one of them is taken after
 * every IO_BG_EVERY normal ones (never starved). A worker whose parked chunks (waiting
 * for bounce slots) are background still takes normal chunks: background chunks leave
 * a quarter of the pool to them (slot_cap), so a load never waits behind a queue of
 * offloads. While normal chunks are in their I/O, or one finished less than
 * IO_BG_GRACE_NS ago, at most IO_BG_BUSY background chunks are (bg_ok): a load meets
 * that many, not the pool's worth already in flight.
 *
 * What a worker does with a chunk is io_chunk.c (file I/O) and io_copy.c (device
 * copies); here: taking chunks, sleeping, waking, starting and stopping.
 */
#include "io_fork.h"
#include "io_pool.h"
#include "io_sync.h"
#include "io_worker.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define EFD_TAG 1ull /* user_data of the eventfd read in a ring (never a valid io_sub *) */
#define TIMER_TAG 2ull /* ... of the timeout that wakes a worker holding background chunks back */

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

void queue_push(phx_ctx *ctx, struct io_chunk *head, struct io_chunk *tail, int n, int internal, int prio)
{
    if (!head)
        return;
    pthread_mutex_lock(&ctx->qmu);
    int p = prio ? 1 : 0;
    struct io_chunk **qh = internal ? &ctx->iq_head[p] : &ctx->q_head[p];
    struct io_chunk **qt = internal ? &ctx->iq_tail[p] : &ctx->q_tail[p];
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

/* Which queue of a pair the next chunk comes from (qmu): normal, unless background
 * chunks wait and IO_BG_EVERY normal ones were taken since the last of them; -1: both
 * empty. `normal_only`: a worker whose parked chunks are background. */
static int next_queue(struct io_chunk *const heads[2], uint32_t streak, int normal_only, int bg)
{
    int b = heads[1] && !normal_only && bg;
    if (heads[0] && (!b || streak < IO_BG_EVERY))
        return 0;
    return b ? 1 : -1;
}

/* Background chunks may be taken now: fewer than IO_BG_BUSY are in their I/O, or no
 * normal chunk is and none finished in the last IO_BG_GRACE_NS. Else 0, and *look_ns
 * (where given) says when to look again: a sleeping worker wakes then (the chunks that
 * lift the hold may finish on a stream callback's thread, which wakes nobody). */
static int bg_ok(phx_ctx *ctx, int64_t *look_ns)
{
    if (atomic_load(&ctx->bg_busy) < IO_BG_BUSY)
        return 1;
    int64_t quiet = IO_BG_GRACE_NS;
    if (!atomic_load(&ctx->normal_busy)) {
        quiet = io_now_ns() - atomic_load(&ctx->normal_last_ns);
        if (quiet >= IO_BG_GRACE_NS)
            return 1;
        quiet = IO_BG_GRACE_NS - quiet;
    }
    if (look_ns)
        *look_ns = quiet;
    return 0;
}

/* bg_ok for queue_take (qmu): a background chunk that waits and is held back is counted. */
static int held(phx_ctx *ctx)
{
    if (!ctx->q_head[1])
        return 1;
    if (bg_ok(ctx, NULL))
        return 1;
    STAT_ADD(bg_held, 1);
    return 0;
}

/* Count a chunk just taken from a queue of priority p as busy until chunk_finish. */
static void take_busy(phx_ctx *ctx, struct io_chunk *ch, int p)
{
    ch->busy = p ? 2 : 1;
    atomic_fetch_add(p ? &ctx->bg_busy : &ctx->normal_busy, 1);
}

/* Take the head of queue p of a pair (qmu), counting the streak of normal chunks. */
static struct io_chunk *pop_queue(struct io_chunk *heads[2], struct io_chunk *tails[2], uint32_t *streak, int p)
{
    struct io_chunk *ch = heads[p];
    if (p)
        *streak = 0;
    else if (heads[1])
        (*streak)++;
    heads[p] = ch->next;
    if (!heads[p])
        tails[p] = NULL;
    ch->next = NULL;
    return ch;
}

static int internal_queued(const phx_ctx *ctx)
{
    return __atomic_load_n(&ctx->iq_head[0], __ATOMIC_RELAXED) || __atomic_load_n(&ctx->iq_head[1], __ATOMIC_RELAXED);
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
    if (!internal_queued(ctx))
        return NULL;
    pthread_mutex_lock(&ctx->qmu);
    struct io_chunk *ch = NULL;
    int p = next_queue(ctx->iq_head, ctx->iq_streak, 0, !ctx->iq_head[1] || bg_ok(ctx, NULL));
    if (p >= 0) {
        ch = pop_queue(ctx->iq_head, ctx->iq_tail, &ctx->iq_streak, p);
        take_busy(ctx, ch, p);
        idle_remove_locked(ctx, w);
    }
    pthread_mutex_unlock(&ctx->qmu);
    return ch;
}

/* Take up to n chunks (normal ones first; only normal ones if `normal_only`); the worker
 * is no longer idle if it takes any. */
static struct io_chunk *queue_take(struct io_worker *w, int n, int normal_only)
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
    struct io_chunk *head = NULL, *last = NULL;
    int taken = 0, p;
    uint64_t bytes = w->owned_bytes;
    for (; taken < n && (p = next_queue(ctx->q_head, ctx->q_streak, normal_only, held(ctx))) >= 0; taken++) {
        struct io_chunk *c = ctx->q_head[p];
        if (bytes && bytes + c->len > w->bytes_cap)
            break; /* enough bytes in flight: leave the rest to the other workers */
        bytes += c->len;
        c = pop_queue(ctx->q_head, ctx->q_tail, &ctx->q_streak, p);
        take_busy(ctx, c, p);
        if (last)
            last->next = c;
        else
            head = c;
        last = c;
    }
    if (taken) {
        ctx->qlen -= taken;
        idle_remove_locked(ctx, w);
    }
    pthread_mutex_unlock(&ctx->qmu);
    return head;
}

/* Before sleeping: register as wanting work if this worker can take some. Returns 0
 * when there is queued work it can take right now (do not sleep). */
static int idle_register(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    /* parked chunks: only normal ones may still be taken, and only past background ones */
    int normal_only = w->parked_head != NULL;
    int can_take = w->owned < w->cap && w->owned_bytes < w->bytes_cap && (!normal_only || w->parked_head->req->prio);
    pthread_mutex_lock(&ctx->qmu);
    w->look_ns = 0;
    int queued = ctx->q_head[0] || (!normal_only && ctx->q_head[1] && bg_ok(ctx, &w->look_ns));
    int iqueued = ctx->iq_head[0] || (ctx->iq_head[1] && bg_ok(ctx, &w->look_ns));
    if ((can_take && queued) || (iqueued && internal_room(w))) {
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

/* ---- the worker's loop ------------------------------------------------------------------ */

static int retry_parked(struct io_worker *w)
{
    int n = 0;
    if (atomic_load_explicit(&w->pool_wait, memory_order_relaxed))
        return 0; /* not woken yet */
    while (w->parked_head) {
        struct io_chunk *ch = w->parked_head;
        int never = 0;
        ch->slot = pool_alloc(&w->ctx->pool, ch->slot_bytes, slot_cap(w, ch), w, &never);
        if (!ch->slot && !never)
            break;
        w->parked_head = ch->next;
        if (!w->parked_head)
            w->parked_tail = NULL;
        w->nparked--;
        if (never)
            chunk_fail(w, ch, ENOMEM); /* no slot will ever come back to wait for */
        else
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
    if (atomic_load(&w->ctx->stop))
        return k;
    /* parked chunks: no more chunks, but normal ones past background ones */
    int normal_only = w->parked_head != NULL;
    if (normal_only && !w->parked_head->req->prio)
        return k;
    if (n > w->cap - w->owned)
        n = w->cap - w->owned;
    ch = queue_take(w, n, normal_only);
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

/* A timeout in the ring: the worker's sleep ends after look_ns (background chunks held
 * back may be taken then). One at a time; a shorter look waits for the one armed. */
static void timer_arm(struct io_worker *w)
{
    if (w->timer_armed || w->look_ns <= 0)
        return;
    struct io_uring_sqe *sqe = ring_get_sqe(&w->ring);
    if (!sqe)
        return;
    w->timer_ts.tv_sec = w->look_ns / 1000000000;
    w->timer_ts.tv_nsec = w->look_ns % 1000000000;
    sqe->opcode = IORING_OP_TIMEOUT;
    sqe->fd = -1;
    sqe->addr = (uint64_t)(uintptr_t)&w->timer_ts;
    sqe->len = 1;
    sqe->off = 0; /* no completion count: a pure timer */
    sqe->user_data = TIMER_TAG;
    w->timer_armed = 1;
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
        if (ud == TIMER_TAG) {
            w->timer_armed = 0;
            continue;
        }
        w->ring_inflight--;
        sub_done(w, (struct io_sub *)(uintptr_t)ud, res);
    }
    w->in_reap = 0;
}

/* Does anyone wait for a bounce slot (this worker's parked chunks, other workers, callers)?
 * Then copies whose completion frees slots are not left waiting. */
static int slots_awaited(struct io_worker *w)
{
    struct io_pool *p = &w->ctx->pool;
    return w->nparked || atomic_load(&p->worker_waiters) || __atomic_load_n(&p->cond_waiters, __ATOMIC_RELAXED);
}

/* Launch the pending copies' callback now (io_uring loop)? Yes when nothing the worker has
 * in the kernel would wake it, when bounce slots are awaited (the callback frees them), on
 * stop, or IO_FLUSH_NS after the oldest copy was queued; else *wait_ns is how long it may
 * still wait (the worker's sleep ends by then). */
static int flush_due(struct io_worker *w, int64_t *wait_ns)
{
    *wait_ns = 0;
    if (!w->copied_since_ns)
        return 0;
    if (!w->ring_inflight || atomic_load(&w->ctx->stop) || slots_awaited(w))
        return 1;
    int64_t left = IO_FLUSH_NS - (io_now_ns() - w->copied_since_ns);
    if (left <= 0)
        return 1;
    *wait_ns = left;
    return 0;
}

/* The bound of a polling worker's wait (0: none): with file I/O in flight, only reads'
 * copies pending (reads are not predicted: io_copy_est.h) and no one waiting for bounce
 * slots (their completion frees some), IO_POLL_MAX_NS, a backstop: the file I/O's
 * completions wake the worker (fewer wakeups of many workers, which a device served by the
 * CPU feels); else until the pending batches' earliest predicted end (copy_due_ns), then
 * poll_ns. */
static int64_t poll_bound(struct io_worker *w)
{
    if (!w->done_head)
        return 0;
    if (w->ring_inflight && !w->done_writes && !slots_awaited(w))
        return IO_POLL_MAX_NS;
    int64_t due = copy_due_ns(w, io_now_ns());
    return due ? due : w->poll_ns;
}

static void worker_loop_ring(struct io_worker *w)
{
    phx_ctx *ctx = w->ctx;
    int timed_out = 0; /* the last wait ended by its poll_ns bound, not by a completion */
    for (;;) {
        int progress = 0;
        if (w->done_head) {
            int done = poll_copies(w);
            if (done)
                w->poll_ns = IO_POLL_NS;
            else if (timed_out && (w->poll_ns *= 2) > IO_POLL_MAX_NS)
                w->poll_ns = IO_POLL_MAX_NS;
            progress += done;
        }
        progress += drain_inbox(w);
        progress += retry_parked(w);
        if (w->owned_bytes < w->bytes_cap || internal_queued(ctx))
            progress += admit(w, w->cap - w->owned);
        if (w->copy_head) /* the new reads go to the kernel with the next enter, after these */
            run_copies(w);
        int64_t flush_wait;
        if (flush_due(w, &flush_wait))
            flush_copies(w);
        if (atomic_load(&ctx->stop) && w->owned == 0 && !w->ring_inflight && !w->copied_since_ns && !w->done_head)
            break;
        unsigned wait = 0;
        if (!atomic_load(&w->inbox) && idle_register(w))
            wait = 1;
        if (flush_wait > 0 && (w->look_ns <= 0 || flush_wait < w->look_ns))
            w->look_ns = flush_wait; /* the pending copies' callback is due then */
        efd_arm(w);
        if (wait)
            timer_arm(w);
        /* copies being polled: wake up to query them (poll_bound) */
        int64_t bound = wait ? poll_bound(w) : 0;
        int rc = bound ? ring_enter_timeout(&w->ring, wait, bound) : ring_enter(&w->ring, wait);
        timed_out = rc == -ETIME && bound == w->poll_ns; /* a backstop's timeout does not slow polling */
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
        if ((w->owned < w->cap || internal_queued(ctx)) && admit(w, 1)) {
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
            if (w->look_ns > 0) { /* background chunks held back: look again then */
                struct pollfd pfd = {.fd = w->efd, .events = POLLIN};
                if (poll(&pfd, 1, (int)(w->look_ns / 1000000) + 1) <= 0)
                    continue;
            }
            ssize_t n = read(w->efd, &v, sizeof(v));
            (void)n;
        }
    }
}

/* ---- starting and stopping ---------------------------------------------------------------- */

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
    /* its timed waits end when asked, not up to the default 50 us later: a polling worker
     * looks at its copies at their predicted ends (io_copy_est.h) */
    prctl(PR_SET_TIMERSLACK, IO_TIMER_SLACK_NS, 0, 0, 0);
    if (w->use_ring) {
        unsigned want = 3u * (unsigned)w->cap + 2, entries = 8;
        while (entries < want)
            entries <<= 1;
        /* the ring is created by the thread that alone uses it (SINGLE_ISSUER) */
        rc = ring_init(&w->ring, entries, why, sizeof(why));
        /* registered buffers: a table for the pool's segments, filled on first use */
        if (rc == 0 && !(ctx->cfg.flags & PHX_CFG_NO_FIXED_BUFFERS))
            w->fixed = ring_buffers_sparse(&w->ring, IO_MAX_SEGS) == 0;
        /* copies' completions by polling events, where the vendor and the ring allow */
        w->poll = rc == 0 && ctx->has_dp && phx_dp_can_poll(&ctx->dp) && ring_can_time_wait(&w->ring) &&
                  !(ctx->cfg.flags & PHX_CFG_CALLBACKS);
        w->poll_ns = IO_POLL_NS;
        w->predict = !(ctx->cfg.flags & PHX_CFG_POLL_STEPS);
        done_init(w);
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
    if (ctx->has_dp) {
        worker_close_streams(w);
        if (w->poll)
            done_fini(w);
    }
    if (w->use_ring)
        ring_exit(&w->ring);
    STAT_ADD(threads, -1);
    return NULL;
}

void workers_stop(phx_ctx *ctx, int n)
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

int workers_start(phx_ctx *ctx, int engine)
{
    const struct phx_io_config *cfg = &ctx->cfg;
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
        w->bytes_cap = w->use_ring ? ctx->worker_bytes : UINT64_MAX;
        w->efd = eventfd(0, EFD_CLOEXEC);
        if (w->efd < 0) {
            rc = -errno;
            break;
        }
        w->start = &ss;
        if ((rc = -io_thread_create(&w->th, worker_main, w)) < 0) /* asynchronous signals blocked */
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
    if (rc < 0)
        workers_stop(ctx, started);
    return rc;
}
