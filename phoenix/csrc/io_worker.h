/* A worker: one thread of a context that runs chunks (io_worker.c drives it).
 *
 * Core side, data path. It owns a ring (io_uring engine) or runs pread/pwrite itself
 * (threads engine), owns one stream per device for staged copies, and never blocks on
 * anything but its ring or its eventfd. The chunk state machine it runs is io_chunk.c
 * (file I/O) and io_copy.c (device copies); stream callbacks (copy done) only touch
 * atomics, the pool's mutex and eventfds: never the vendor runtime, never Python.
 */
#ifndef PHX_IO_WORKER_H
#define PHX_IO_WORKER_H

#include "io_common.h"
#include "io_copy_est.h"
#include "io_ctx.h"
#include "io_req.h"
#include "io_ring.h"

#define IO_MAX_DEVICES 64
_Static_assert(IO_MAX_DEVICES == IO_COPY_EST_DEVICES, "a worker's copy_est tracks every device");
#define IO_DONE_EVENTS 32 /* copy-completion events a worker polls at once (more: callbacks) */

/* A batch of device copies whose completion the worker polls (event_query): staged reads
 * (a list: their slots are freed and chunks finished) or one staged write (its file
 * write is issued). */
struct io_done {
    void *ev;
    int dev;       /* where ev was created (-1: none yet) */
    int write;
    struct copy_batch b; /* its bytes, device, times: its end is predicted (copy_due_ns) */
    struct io_chunk *chunks;
    struct io_done *next;
};

struct io_worker {
    struct phx_ctx *ctx;
    int idx;
    pthread_t th;
    int efd;                 /* wakeup eventfd */
    uint64_t efd_val;
    int efd_armed;
    int use_ring;
    struct io_ring ring;
    unsigned ring_inflight;  /* SQEs in the kernel (not counting the eventfd read) */
    unsigned ring_room;      /* SQEs the ring can hold */
    /* registered buffers (io_uring): the bounce pool's segments, slot i = segment i, put
     * in the ring's table on first use (READ_FIXED / WRITE_FIXED: no page pinning per
     * I/O). fixed: the table exists; fixed_set / fixed_bad: segments in it / refused. */
    int fixed;
    uint64_t fixed_set, fixed_bad;
    int cap, owned;          /* chunks this worker may hold / holds in their I/O phase */
    uint64_t bytes_cap, owned_bytes; /* ... and their bytes (io_uring: IO_WORKER_BYTES) */
    struct io_chunk *parked_head, *parked_tail; /* waiting for a bounce slot */
    int nparked;             /* ... how many (owned counts them too) */
    _Atomic int pool_wait;   /* set (pool mu) while a parked chunk waits for a slot */
    int idle;                /* (ctx qmu) registered as wanting work */
    int64_t look_ns;         /* > 0: background chunks wait, held back: sleep at most this long */
    int timer_armed;         /* io_uring: a timeout SQE for look_ns is in the ring */
    struct __kernel_timespec timer_ts;
    _Atomic(struct io_chunk *) inbox; /* staged writes whose device copy finished */
    struct io_sub *sync_head, *sync_tail; /* threads engine: subs to run */
    void *streams[IO_MAX_DEVICES];
    /* staged reads whose device copy is queued on streams[d] and whose completion
     * callback is not yet launched: one launch_host_func per batch (flush_copies) */
    struct io_chunk *copy_head, *copy_tail; /* reads reaped from the ring, copy not queued yet */
    int in_reap;
    struct io_chunk *copied[IO_MAX_DEVICES];
    uint64_t copied_bytes[IO_MAX_DEVICES]; /* ... their bytes: flushed early past IO_FLUSH_BYTES */
    unsigned char copied_fenced[IO_MAX_DEVICES]; /* ... one waits for the caller's stream too */
    int64_t copied_since_ns;  /* when the oldest of them was queued (0: none) */
    int cur_dev;
    /* copies' completions by polling (phx_dp_can_poll, a ring that waits with a timeout):
     * pending batches in order, and free entries (their events kept for reuse) */
    int poll;
    int64_t poll_ns; /* the next wait's bound while batches are polled */
    int done_writes; /* ... of which writes (their file I/O waits for the poll) */
    struct copy_est est; /* what its looks taught of its copies' speed (io_copy_est.h) */
    int predict;         /* writes' copies predicted (0: copy_completion=steps) */
    struct io_done done[IO_DONE_EVENTS];
    struct io_done *done_head, *done_tail, *done_free;
    uint64_t fence_waited[IO_MAX_DEVICES]; /* id of the fence streams[d] last waited for */
    void *start;             /* startup handshake with workers_start */
};

#pragma GCC visibility push(hidden)
/* io_worker.c: wake the worker (its eventfd); safe from any thread, stream callbacks too. */
void worker_wake(struct io_worker *w);

/* io_chunk.c: the chunk state machine, run by the chunk's worker. */
/* Start a chunk the worker owns (owned already counts it): takes its slot (or parks
 * it), queues a staged write's device copy, or issues its file I/O. */
void chunk_start(struct io_worker *w, struct io_chunk *ch);
/* Issue the chunk's file I/O (its slot holds what a write writes). */
void chunk_issue_subs(struct io_worker *w, struct io_chunk *ch);
/* A sub's transfer returned res (bytes or -errno): reissue the rest, fall back, finish. */
void sub_done(struct io_worker *w, struct io_sub *s, int64_t res);
/* Run a sub's transfer with pread/pwrite on this thread. */
void sub_run_sync(struct io_worker *w, struct io_sub *s);
/* The pool bytes in use past which this chunk waits for a slot (0: no cap). */
uint64_t slot_cap(const struct io_worker *w, const struct io_chunk *ch);
/* A chunk's bounce slot goes back (to the pool, or to the allocator). */
void slot_free(struct io_chunk *ch);
/* A chunk the worker owns fails with err (its slot freed, the chunk finished). */
void chunk_fail(struct io_worker *w, struct io_chunk *ch, int err);

/* io_copy.c: device copies, by the worker on its streams. */
/* Queue the device copy of a staged read whose file I/O is done (callback batched). */
void start_read_copy(struct io_worker *w, struct io_chunk *ch);
/* Queue the copies of the reads reaped this round (after the next reads are admitted). */
void run_copies(struct io_worker *w);
/* Launch one completion callback per device for the copies queued since the last flush
 * (or, polling, record one event per device). */
void flush_copies(struct io_worker *w);
/* Polling: finish the batches whose copies are done; how many. */
int poll_copies(struct io_worker *w);
/* Polling: how long the worker may sleep before it looks at its pending batches again
 * (the earliest predicted end of each device's first one; 0: none predicted, poll_ns
 * decides). It may plan a probe look (io_copy_est.h). */
int64_t copy_due_ns(struct io_worker *w, int64_t now);
/* Polling: set up the worker's entries (at its start) / destroy their events (at its end). */
void done_init(struct io_worker *w);
void done_fini(struct io_worker *w);
/* A staged write: queue the device -> slot copy; the worker writes the slot once it is
 * done. 0 queued, 1 done synchronously, -EIO on a vendor error. */
int dev_copy_to_slot(struct io_worker *w, struct io_chunk *ch);
/* A file-mapping hit: one copy per piece, one callback for the request. */
void fmap_req_start(struct io_worker *w, struct io_chunk *c0);
/* The worker's stream for device dev (made on first use), or NULL. */
void *worker_stream(struct io_worker *w, int dev);
#pragma GCC visibility pop

#endif
