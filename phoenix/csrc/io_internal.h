/* Internals of the I/O core (phx_io.h): shared by the io_*.c files only.
 *
 * Core side, data path. Objects and who touches them:
 *
 *   phx_ctx     workers + a FIFO of chunks (ctx->qmu) + the bounce pool.
 *   io_worker   one thread; owns a ring (io_uring engine) or runs pread/pwrite itself
 *               (threads engine); owns one stream per device for staged copies; never
 *               blocks on anything but its ring or its eventfd.
 *   phx_req     one request, cut into io_chunks (allocated with it); completes when
 *               its last chunk does, on whichever thread finishes that chunk (a worker,
 *               or the vendor's stream thread running a copy-done callback).
 *   io_chunk    <= chunk_size bytes of a request; 1-3 io_subs (the file I/Os): an
 *               unaligned head and tail go through the buffered descriptor, the
 *               aligned body through the O_DIRECT one.
 *
 * Stream callbacks (copy done) only touch atomics, the pool's mutex and eventfds:
 * never the vendor runtime, never Python.
 */
#ifndef PHX_IO_INTERNAL_H
#define PHX_IO_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "phx_io.h"

#define IO_MAX_DEVICES 64
#define IO_MAX_SEGS 64
#define IO_POOL_UNIT (64u << 10)        /* bounce pool allocation unit */
#define IO_MAX_ALIGN (64u << 10)        /* larger O_DIRECT alignments: file used buffered */
#define IO_MAX_CHUNK (1ull << 30)       /* one SQE / one pread moves < 4 GiB */
/* Bytes one io_uring worker keeps in flight at most (besides queue_depth chunks): a
 * 16 MiB O_DIRECT read is already dozens of device requests, so four of them per ring
 * keep a disk busy; deeper queues of large chunks only add contention. Small random
 * reads are bounded by queue_depth instead. */
#define IO_WORKER_BYTES (64ull << 20)
#define IO_FLUSH_BYTES (4ull << 20)     /* staged-read copies queued before their callback is launched */
#define IO_CACHED_CHUNK (4ull << 20)    /* staged chunks of a read from the page cache (at most) */
#define IO_CACHED_SLOTS 4               /* ... and slots of them in use per worker (at most) */

/* ---- counters (phx_io_get_stats) ---- */
struct io_counters {
    _Atomic int64_t contexts, threads, files, requests, stream_ops, registrations, worker_streams;
    _Atomic int64_t bounce_bytes, bounce_in_use;
    _Atomic int64_t bytes_read, bytes_written;
    _Atomic int64_t chunks_user, chunks_staged, chunks_staged_cpu;
    _Atomic int64_t io_direct, io_buffered, reissues, direct_fallbacks, uring_enters;
    _Atomic int64_t cache_hit_bytes, cache_misses;
    _Atomic int64_t fmap_windows, fmap_bytes, fmap_hits, fmap_misses;
    _Atomic int64_t pool_waits, copy_flushes;
};
extern struct io_counters io_stats;
#define STAT_ADD(field, v) atomic_fetch_add_explicit(&io_stats.field, (v), memory_order_relaxed)

/* ---- raw io_uring (io_ring.c) ---- */
struct io_ring {
    int fd;
    unsigned sq_entries, cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_size, cq_map_size, sqes_size;
    unsigned sqe_tail;   /* local tail: SQEs handed out, not yet published */
    unsigned to_submit;  /* published, not yet consumed by io_uring_enter */
    unsigned setup_flags;
};
int ring_init(struct io_ring *r, unsigned entries, char *why, size_t why_len);
void ring_exit(struct io_ring *r);
struct io_uring_sqe *ring_get_sqe(struct io_ring *r);
/* Publish the SQEs handed out, submit them, and wait for wait_nr completions. */
int ring_enter(struct io_ring *r, unsigned wait_nr);
struct io_uring_cqe *ring_peek_cqe(struct io_ring *r);
/* SQEs handed out but not published to the kernel yet */
int ring_unsubmitted(const struct io_ring *r);
void ring_cqe_seen(struct io_ring *r);
/* Does the kernel take io_uring here (and IORING_OP_READ/WRITE)? */
int ring_probe(char *why, size_t why_len);

/* ---- files (io_file.c) ---- */
struct phx_file {
    int fd_direct; /* -1 when O_DIRECT is not used */
    int fd_buf;
    int flags;
    _Atomic int direct_ok;      /* cleared when the first O_DIRECT I/O is refused */
    _Atomic int cache_probe;    /* read mostly cached ranges buffered (cachestat) */
    _Atomic int probe_misses;   /* consecutive probes that found nothing cached */
    _Atomic uint32_t probe_tick;
    uint32_t a_off, a_mem;      /* O_DIRECT alignments (file offset/length, memory) */
    uint32_t align;             /* max(a_off, a_mem, page size): the planner's unit */
    _Atomic int64_t known_size; /* largest end of a write in flight (0 when none is) */
    uint64_t st_dev, st_ino;    /* the fmap cache's key (fstat at open) */
    int fmap_ok;                /* a regular file not opened direct=ON: fmap may serve it */
    _Atomic int fmap_cold;      /* consecutive misses whose range was not cached */
    _Atomic uint32_t fmap_tick; /* ... after 8 of them, one miss in 32 probes */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t inflight;           /* requests + stream ops (mu) */
    int closing;                /* (mu) */
    /* test fault injection (phx_file_inject_fault) */
    _Atomic int fault_err;
    int64_t fault_off;
    uint64_t fault_len;
    char why[160];
};
/* Count a request in (-EBADF once closing) and out (wakes close). */
int file_get(phx_file *f);
void file_put(phx_file *f);
void file_note_write(phx_file *f, int64_t end); /* a write to end is in flight */
void file_disable_direct(phx_file *f, const char *why);
int file_fault(phx_file *f, int64_t off, uint64_t len);

/* ---- bounce pool (io_pool.c) ---- */
struct io_worker;
struct io_seg {
    char *base;
    uint64_t size;
    uint32_t nunits, used;
    uint64_t *bits;
    int registered;
};
struct io_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct io_seg segs[IO_MAX_SEGS];
    int nsegs;
    uint64_t limit, seg_size, allocated, in_use;
    const struct phx_dp_table *dp; /* NULL: slots are not host-registered */
    int cond_waiters;              /* threads blocked in pool_alloc_many */
    _Atomic int worker_waiters;    /* workers with a parked chunk */
    struct phx_ctx *ctx;
};
int pool_init(struct io_pool *p, struct phx_ctx *ctx, uint64_t limit, uint64_t max_slot,
              const struct phx_dp_table *dp);
void pool_fini(struct io_pool *p);
/* Non-blocking: NULL when the pool is full, or when `cap` (0: none) bytes of it are in
 * use already; `waiter` (if any) is then woken by the next pool_free. */
void *pool_alloc(struct io_pool *p, uint64_t bytes, uint64_t cap, struct io_worker *waiter);
/* Blocking, all or nothing: n slots of `bytes` each. */
int pool_alloc_many(struct io_pool *p, int n, uint64_t bytes, char **out);
void pool_free(struct io_pool *p, void *ptr, uint64_t bytes);
int64_t pool_prepare(struct io_pool *p);
uint64_t pool_round(uint64_t bytes);

/* ---- requests ---- */
enum { CH_USER = 0, CH_STAGED_CPU = 1, CH_STAGED_DEV = 2, CH_FMAP = 3 };
struct io_chunk;
struct io_sub {
    struct io_chunk *ch;
    struct io_sub *next; /* threads engine: the worker's FIFO of subs to run */
    int64_t off;      /* file offset */
    uint64_t rel;     /* buffer offset from the chunk's base (user address or slot) */
    char *buf;        /* resolved when the chunk starts */
    uint64_t len, done;
    uint8_t direct;   /* on the O_DIRECT descriptor */
    uint8_t finished;
    uint8_t fell_back; /* retried buffered after O_DIRECT said EINVAL */
    uint8_t cached;    /* the page-cache probe found the range cached: a copy, run inline */
    int err;
};
struct io_chunk {
    struct phx_req *req;
    struct io_chunk *next; /* queue / parked / inbox link */
    struct io_worker *owner;
    int64_t foff;
    uint64_t len;
    char *user;            /* caller's address of foff */
    char *slot;            /* bounce slot (staged) */
    uint64_t slot_bytes;
    uint32_t slot_off;     /* where foff lands in the slot */
    uint8_t path, nsub, subs_left;
    int err;
    uint64_t got;
    struct io_fwin *win;   /* CH_FMAP: the registered window this piece copies from */
    struct io_sub sub[3];
};
typedef void (*io_done_fn)(struct phx_req *r, void *arg);
struct phx_req {
    struct phx_ctx *ctx;
    phx_file *file;
    phx_fence *fence;       /* the caller's stream point its memory accesses wait for */
    int op, mem, device, path;
    int file_ref;           /* counted in the file (not for a stream op's own requests) */
    int fmap_write;         /* a write counted by fmap_write_begin */
    int cached;             /* a staged read of page-cache data (fmap probe): slots capped */
    int internal;           /* a stream op's own request: never waits for the bounce pool */
    char *addr;
    int64_t foff;
    uint64_t size;
    _Atomic int refs;
    _Atomic uint32_t state; /* completion flag (io_wait_flag): futex word */
    _Atomic int pending;    /* chunks left */
    _Atomic int err;
    int64_t err_off;
    uint64_t err_len;
    _Atomic int64_t eof_at; /* smallest file offset where a read came up short */
    int64_t result;
    io_done_fn on_done;
    void *on_done_arg;
    uint32_t nchunks;
    struct io_chunk chunks[];
};

/* ---- the file-mapping registration cache (io_fmap.c; phx_io.h says what it is) ---- */
enum { FW_PENDING = 0, FW_READY = 1, FW_UNREG = 2 };
struct io_fwin {
    struct io_fwin *hnext;         /* hash chain (fmap mu) */
    struct io_fwin *lprev, *lnext; /* LRU of READY windows, most recent first */
    struct io_fwin *qnext;         /* registration queue / release list */
    uint64_t dev, ino;
    int64_t off;                   /* file offset of the window (idx * window) */
    uint64_t len;                  /* bytes mapped (the last window ends at the page-rounded size) */
    int64_t fsize, mtime_ns, ctime_ns; /* the file when it was mapped */
    char *addr;                    /* the mapping (READY) */
    int state;                     /* FW_* */
    int hashed;                    /* in the hash (not yet dropped) */
    int refs;                      /* requests copying from it (fmap mu) */
    int device, fd;                /* PENDING: where to register, a dup of the file's fd */
};
#define FMAP_HASH 1024
#define FMAP_WHASH 256
struct io_fwrite {
    struct io_fwrite *next;
    uint64_t dev, ino, gen; /* gen: wgen when the last write started */
    int64_t writes;         /* in flight */
};
#define FMAP_PIECE (256ull << 20)  /* bytes per memcpy_async of a hit */
struct io_fmap {
    pthread_mutex_t mu;
    pthread_cond_t cv;             /* wakes the registrar */
    pthread_cond_t idle_cv;        /* queue drained / registration finished */
    int mode;                      /* enum phx_fmap_mode (OFF when unusable) */
    uint64_t budget, window;
    unsigned flags;
    char why[160];
    struct io_fwin *hash[FMAP_HASH];
    struct io_fwin lru;            /* sentinel */
    struct io_fwin *q_head, *q_tail, *release;
    uint64_t bytes;                /* READY bytes */
    uint64_t reserved;             /* bytes of registrations in progress (counted in the budget) */
    int64_t windows, pending, unregistrable, in_use;
    int64_t hits, misses, registrations, evictions, invalidations;
    int busy, stop, started;
    pthread_t th;
    /* phoenix writes per inode: a window is not registered while one runs or if one
     * started during its registration (an O_DIRECT write cannot invalidate pinned
     * page-cache pages); entries go when idle and no registration is in progress */
    struct io_fwrite *wtab[FMAP_WHASH];
    uint64_t wgen;                 /* writes started */
    int regs_active;               /* registrations in progress */
};
struct phx_ctx;
struct fmap_plan {
    struct io_fwin **wins;
    int nwins;
    int64_t fsize;
    uint32_t nchunks;
    int resident; /* a miss whose range the probe found in the page cache */
};
void fmap_init(struct phx_ctx *ctx);
void fmap_fini(struct phx_ctx *ctx);
/* A staged read into device memory: 1 when every window of its range is registered
 * (refs taken, plan filled), 0 otherwise (a miss: registration queued or done). */
int fmap_plan(struct phx_ctx *ctx, phx_file *f, const struct phx_io_desc *d, struct fmap_plan *p);
/* Lay the plan's pieces out as the request's chunks (one ref each), drop the plan. */
void fmap_fill(struct phx_ctx *ctx, struct fmap_plan *p, struct phx_req *r);
void fmap_plan_drop(struct phx_ctx *ctx, struct fmap_plan *p);
/* Drop a piece's reference; safe in stream callbacks (no vendor call: a dropped window
 * whose last user this was goes to the registrar to be released). */
void fmap_unref(struct phx_ctx *ctx, struct io_fwin *w);
/* A hit's copies are done (stream callback): cut each piece's count to what the file
 * held (a window the fault guard zero-mapped under the copy, a file now shorter), then
 * drop the pieces' references. */
void fmap_req_copied(struct phx_ctx *ctx, struct phx_req *r);
/* A write through this context, before it is queued: count it in flight for its inode
 * and drop the windows it overlaps. fmap_write_end when it completes. */
void fmap_write_begin(struct phx_ctx *ctx, phx_file *f, int64_t off, uint64_t len);
void fmap_write_end(struct phx_ctx *ctx, phx_file *f);

/* ---- ordering with the caller's stream (io_order.c; phx_io.h states the rule) ---- */
struct phx_fence {
    struct phx_ctx *ctx;
    void *event;               /* the vendor's event, created on `device` */
    int device;
    uint64_t id;               /* unique per record: what a worker stream waited for last */
    _Atomic int refs;          /* the caller's, and one per request naming it */
    _Atomic int passed;        /* the host saw the caller's stream pass it (event_synchronize) */
    struct phx_fence *next;    /* the context's free list */
};
struct io_worker;
/* A request's memory is touched by the CPU or the disk: wait on the host (caller's thread). */
int fence_host_wait(phx_fence *f);
/* Before a device copy on the worker's `stream` for device `dev`: make the stream wait for
 * the fence (once per fence and stream). 0, or -EIO when the vendor refused both ways. */
int fence_order_copy(struct io_worker *w, int dev, void *stream, phx_fence *f);
phx_fence *fence_ref(phx_fence *f);
void fence_fini(struct phx_ctx *ctx);

/* ---- workers and context (io_engine.c) ---- */
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
    int cap, owned;          /* chunks this worker may hold / holds in their I/O phase */
    uint64_t bytes_cap, owned_bytes; /* ... and their bytes (io_uring: IO_WORKER_BYTES) */
    struct io_chunk *parked_head, *parked_tail; /* waiting for a bounce slot */
    int nparked;             /* ... how many (owned counts them too) */
    _Atomic int pool_wait;   /* set (pool mu) while a parked chunk waits for a slot */
    int idle;                /* (ctx qmu) registered as wanting work */
    _Atomic(struct io_chunk *) inbox; /* staged writes whose device copy finished */
    struct io_sub *sync_head, *sync_tail; /* threads engine: subs to run */
    void *streams[IO_MAX_DEVICES];
    /* staged reads whose device copy is queued on streams[d] and whose completion
     * callback is not yet launched: one launch_host_func per batch (flush_copies) */
    struct io_chunk *copy_head, *copy_tail; /* reads reaped from the ring, copy not queued yet */
    int in_reap;
    struct io_chunk *copied[IO_MAX_DEVICES];
    uint64_t copied_bytes[IO_MAX_DEVICES]; /* ... their bytes: flushed early past IO_FLUSH_BYTES */
    int cur_dev;
    uint64_t fence_waited[IO_MAX_DEVICES]; /* id of the fence streams[d] last waited for */
    void *start;             /* startup handshake with phx_ctx_create */
};
struct phx_ctx {
    struct phx_io_config cfg;
    int engine;
    char engine_why[200];
    int has_dp;
    struct phx_dp_table dp;
    int has_events;           /* the data path has events: fences wait on the device */
    pthread_mutex_t fence_mu; /* the free list */
    struct phx_fence *fence_free;
    uint64_t chunk, stage_chunk;
    struct io_pool pool;
    pthread_mutex_t qmu;
    struct io_chunk *q_head, *q_tail;
    int64_t qlen;             /* (qmu) chunks queued */
    /* (qmu) chunks of stream ops' own requests: taken first, also by workers whose other
     * chunks are parked for bounce slots. Stream ops hold their slots from submission
     * on, and their callbacks block the caller's stream until these run: behind chunks
     * that wait for those very slots they would deadlock. They never need a slot. */
    struct io_chunk *iq_head, *iq_tail;
    int nworkers;
    struct io_worker *workers;
    struct io_worker **idle;  /* (qmu) stack of idle workers */
    int nidle;
    _Atomic int stop;
    pthread_mutex_t mu;       /* inflight / destroy */
    pthread_cond_t cv;
    int64_t inflight;         /* requests + stream ops */
    struct io_fmap fmap;
};
void worker_wake(struct io_worker *w);
/* Submit one request internally (stream ops): no registration check, on_done called
 * on completion from whichever thread completes it; the caller holds one reference. */
int io_submit_one(phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                  phx_req **out);
int ctx_get(phx_ctx *ctx);
void ctx_put(phx_ctx *ctx);
/* completion flags (futex words, io_engine.c): wait until set (-ETIMEDOUT after
 * timeout_ns >= 0); is it set; set it (a futex wake only if a waiter sleeps). */
int io_wait_flag(_Atomic uint32_t *word, int64_t timeout_ns);
int io_flag_is_set(const _Atomic uint32_t *word);
void io_set_flag(_Atomic uint32_t *word);

/* Multiples of a (a > 0, any value: chunk sizes are multiples of 4096, not powers of two). */
static inline uint64_t align_down(uint64_t v, uint64_t a) { return v - v % a; }
static inline uint64_t align_up(uint64_t v, uint64_t a) { return align_down(v + a - 1, a); }

#endif
