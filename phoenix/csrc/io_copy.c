/* Device copies of staged chunks and of file-mapping hits, and their stream callbacks.
 *
 * Core side, data path. The worker queues copies on its own stream for the device
 * (worker_stream) and host callbacks after them (launch_host_func); the callbacks run
 * on the vendor's stream thread and only free slots, finish chunks and wake workers:
 * never a vendor call, never Python.
 *
 *   staged reads   the slot -> device copy of each chunk whose file I/O is done; one
 *                  callback per device per worker round (flush_copies) frees the slots
 *                  and finishes the chunks copied in it.
 *   staged writes  the device -> slot copy, then a callback that hands the chunk back
 *                  to its worker (inbox + eventfd), which writes it.
 *   fmap hits      one copy per window piece, one callback for the whole request.
 *
 * Polling (phx_dp_can_poll, io_uring workers): instead of a host callback, the worker
 * records an event after a batch of read copies or a write's copy and queries it between
 * I/Os (poll_copies); its wait in the ring is then bounded (poll_ns). A callback costs
 * the runtime's callback thread tens of microseconds; a record and a few queries, a few.
 * Each wakeup to query costs the worker a ring enter and a timer: for a staged write, whose
 * file write waits for its copy, the worker predicts the copy's end from its bytes and the
 * time per byte the copies took so far (io_copy_est.h) and sleeps until then, not in steps
 * doubled from IO_POLL_NS. Read batches keep the steps (their completions are what a load
 * waits for, and with reads in flight those wake the worker anyway).
 */
#include "io_fmap.h"
#include "io_order.h"
#include "io_sync.h"
#include "io_worker.h"

#include <errno.h>

/* ---- the worker's streams --------------------------------------------------------------- */

void *worker_stream(struct io_worker *w, int dev)
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

/* ---- staged chunks: completion callbacks, copies -------------------------------------------- */

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

/* A batch of staged reads whose copies are done (err: their fate unknown, they fail with EIO). */
static void reads_copied(struct io_chunk *list, int err)
{
    for (struct io_chunk *c = list; c && err; c = c->next) {
        c->err = EIO;
        c->got = 0;
    }
    cb_read_copied_list(list);
}

/* ---- completion by polling ------------------------------------------------------------------ */

void done_init(struct io_worker *w)
{
    w->done_head = w->done_tail = w->done_free = NULL;
    w->done_writes = 0;
    w->est = (struct copy_est){0};
    for (int i = IO_DONE_EVENTS - 1; i >= 0; i--) {
        w->done[i].ev = NULL;
        w->done[i].dev = -1;
        w->done[i].next = w->done_free;
        w->done_free = &w->done[i];
    }
}

void done_fini(struct io_worker *w)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    for (int i = 0; i < IO_DONE_EVENTS; i++) {
        if (w->done[i].ev)
            dp->event_destroy(w->done[i].ev);
        w->done[i].ev = NULL;
        w->done[i].dev = -1;
    }
}

/* Record an event after the copies just queued on `stream` (device dev, the current one)
 * and keep the batch to poll. 0, or -1 (no free entry, or the runtime refused: the caller
 * launches a callback instead). */
static int done_queue(struct io_worker *w, int dev, void *stream, int write, struct io_chunk *chunks,
                      uint64_t bytes, int fenced)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    if (w->cur_dev != dev) /* set_device refused: an event made now would be another device's */
        return -1;
    struct io_done **pp = &w->done_free;
    while (*pp && (*pp)->dev != dev) /* an entry whose event is on dev, else the first */
        pp = &(*pp)->next;
    if (!*pp)
        pp = &w->done_free;
    struct io_done *e = *pp;
    if (!e)
        return -1;
    if (e->dev != dev) {
        if (e->ev)
            dp->event_destroy(e->ev);
        e->ev = NULL;
        e->dev = -1;
        if (dp->event_create(&e->ev, dp->event_flags) != dp->success) {
            e->ev = NULL;
            return -1;
        }
        e->dev = dev;
    }
    if (dp->event_record(e->ev, stream) != dp->success)
        return -1;
    *pp = e->next;
    e->write = write;
    copy_est_queue(&e->b, dev, bytes, io_now_ns(), fenced);
    e->chunks = chunks;
    e->next = NULL;
    if (w->done_tail)
        w->done_tail->next = e;
    else
        w->done_head = e;
    w->done_tail = e;
    w->done_writes += write;
    STAT_ADD(copy_events, 1);
    return 0;
}

int64_t copy_due_ns(struct io_worker *w, int64_t now)
{
    int probing; /* (a probe look is kept like any other here) */
    struct copy_batch *heads[IO_DONE_EVENTS];
    uint64_t devs = 0; /* devices whose first pending batch is in heads */
    int n = 0;
    for (struct io_done *e = w->done_head; e && n < IO_DONE_EVENTS; e = e->next) {
        uint64_t bit = 1ull << e->b.dev;
        if (!(devs & bit)) {
            devs |= bit;
            heads[n++] = &e->b;
        }
    }
    return copy_est_due_heads(&w->est, heads, n, now, &probing);
}

int poll_copies(struct io_worker *w)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    struct io_done **pp = &w->done_head, *prev = NULL;
    int n = 0;
    int64_t now = w->done_head ? io_now_ns() : 0;
    uint64_t devs = 0; /* devices a batch was seen done on by this look */
    while (*pp) {
        struct io_done *e = *pp;
        int q = dp->event_query(e->ev);
        if (q == dp->not_ready) {
            copy_est_missed(&e->b, now);
            prev = e;
            pp = &e->next;
            continue;
        }
        int err = 0;
        if (q != dp->success) { /* the copies' fate is unknown: wait for their stream */
            if (w->cur_dev != e->dev && dp->set_device(e->dev) == dp->success)
                w->cur_dev = e->dev;
            err = dp->stream_synchronize(w->streams[e->dev]) != dp->success;
        }
        uint64_t bit = 1ull << e->b.dev;
        copy_est_seen(&w->est, &e->b, now, !(devs & bit));
        devs |= bit;
        *pp = e->next;
        if (w->done_tail == e)
            w->done_tail = prev;
        struct io_chunk *chunks = e->chunks;
        int write = e->write;
        w->done_writes -= write;
        e->next = w->done_free;
        w->done_free = e;
        if (write) {
            if (err)
                chunk_fail(w, chunks, EIO);
            else
                chunk_issue_subs(w, chunks);
        } else {
            reads_copied(chunks, err);
        }
        n++;
    }
    return n;
}

/* Launch one completion callback per device for the staged reads whose copies this worker
 * queued since the last flush. A host callback per chunk costs the runtime's callback
 * thread ~tens of microseconds each: at 64 KiB random reads it was the bottleneck; here a
 * worker's completions share one. Called as soon as IO_FLUSH_BYTES are queued (large
 * chunks: their slots come back one by one, not after the worker's whole round of reads,
 * which for page-cache reads run inline), and from the worker's loop when flush_due says
 * (io_uring: before it sleeps with nothing in flight, or IO_FLUSH_NS after the oldest). */
void flush_copies(struct io_worker *w)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    w->copied_since_ns = 0;
    for (int d = 0; d < IO_MAX_DEVICES; d++) {
        struct io_chunk *list = w->copied[d];
        if (!list)
            continue;
        int fenced = w->copied_fenced[d];
        w->copied[d] = NULL;
        w->copied_bytes[d] = 0;
        w->copied_fenced[d] = 0;
        void *stream = w->streams[d];
        if (w->cur_dev != d && dp->set_device(d) == dp->success)
            w->cur_dev = d;
        STAT_ADD(copy_flushes, 1);
        /* (0 bytes: a read batch is not predicted, io_copy_est.h) */
        if (w->poll && done_queue(w, d, stream, 0, list, 0, fenced) == 0)
            continue;
        if (dp->launch_host_func(stream, cb_read_copied_list, list) != dp->success)
            reads_copied(list, dp->stream_synchronize(stream) != dp->success);
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
 * stream, or NULL on a vendor error; *fenced: the stream waits for the caller's first. */
static void *queue_dev_copy(struct io_worker *w, struct io_chunk *ch, int to_device, int *fenced)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    void *stream = worker_stream(w, ch->req->device);
    int fo = stream ? fence_order_copy(w, ch->req->device, stream, ch->req->fence) : -EIO;
    if (fo < 0)
        return NULL;
    *fenced = fo;
    char *slot = ch->slot + ch->slot_off;
    int rc = to_device ? dp->memcpy_async(ch->user, slot, ch->got, dp->kind_h2d, stream)
                       : dp->memcpy_async(slot, ch->user, ch->len, dp->kind_d2h, stream);
    return rc == dp->success ? stream : NULL;
}

/* A staged write: queue the copy of the chunk from device memory into its slot; its
 * worker writes the slot once the copy is done (poll_copies, or cb_write_filled through the
 * inbox). (Staged reads queue theirs with queue_dev_copy and share a completion:
 * flush_copies.) Returns 0 when queued, 1 when it completed synchronously
 * (launch_host_func refused: the copy was synchronized here), -EIO on a vendor error. */
int dev_copy_to_slot(struct io_worker *w, struct io_chunk *ch)
{
    const struct phx_dp_table *dp = &w->ctx->dp;
    int fenced = 0;
    void *stream = queue_dev_copy(w, ch, 0, &fenced);
    if (!stream)
        return -EIO;
    if (w->poll && done_queue(w, ch->req->device, stream, 1, ch, w->predict ? ch->len : 0, fenced) == 0)
        return 0; /* poll_copies issues the write */
    if (dp->launch_host_func(stream, cb_write_filled, ch) != dp->success)
        return dp->stream_synchronize(stream) == dp->success ? 1 : -EIO;
    return 0;
}

/* Queue the device copy of a staged read whose file I/O is done; its completion callback
 * is launched with the others of this round by flush_copies (before the worker sleeps). */
void start_read_copy(struct io_worker *w, struct io_chunk *ch)
{
    phx_req *r = ch->req;
    int fenced = 0;
    if (queue_dev_copy(w, ch, 1, &fenced)) {
        if (!w->copied_since_ns)
            w->copied_since_ns = io_now_ns();
        ch->next = w->copied[r->device];
        w->copied[r->device] = ch;
        w->copied_bytes[r->device] += ch->got;
        w->copied_fenced[r->device] |= fenced;
        if (w->copied_bytes[r->device] >= IO_FLUSH_BYTES)
            flush_copies(w);
        return; /* cb_read_copied_list frees the slot and finishes the chunk */
    }
    ch->err = EIO;
    ch->got = 0;
    slot_free(ch);
    chunk_finish(ch);
}

void run_copies(struct io_worker *w)
{
    struct io_chunk *ch = w->copy_head;
    w->copy_head = w->copy_tail = NULL;
    while (ch) {
        struct io_chunk *next = ch->next; /* start_read_copy relinks ch */
        start_read_copy(w, ch);
        ch = next;
    }
}

/* ---- file-mapping hits (planned by io_fmap.c) --------------------------------------------- */

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
void fmap_req_start(struct io_worker *w, struct io_chunk *c0)
{
    phx_req *r = c0->req;
    const struct phx_dp_table *dp = &w->ctx->dp;
    w->owned--;
    w->owned_bytes -= c0->len;
    void *stream = worker_stream(w, r->device);
    int err = stream && fence_order_copy(w, r->device, stream, r->fence) >= 0 ? 0 : EIO;
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
