/* Requests and their chunks: what a request is made of, from planning to completion.
 *
 * Core side, data path. A phx_req is one extent of a file <-> one extent of memory,
 * cut into io_chunks (allocated with it) that the workers run in parallel; it completes
 * when its last chunk does, on whichever thread finishes that chunk (a worker, or the
 * vendor's stream thread running a copy-done callback). An io_chunk is <= chunk_size
 * bytes of a request and has 1-3 io_subs (the file I/Os): an unaligned head and tail
 * go through the buffered descriptor, the aligned body through the O_DIRECT one.
 *
 *   planned    io_plan.c    (req_build: checks, layout, chunks)
 *   submitted  io_submit.c  (counted in the file and the context, queued)
 *   run        io_chunk.c, io_copy.c (by the workers of io_worker.c)
 *   completed  io_chunk.c   (chunk_finish -> req_complete; the flag of io_sync.h)
 */
#ifndef PHX_IO_REQ_H
#define PHX_IO_REQ_H

#include "io_common.h"

/* A chunk's path (phx_io.h, "Paths"; io_chunk.c says how each runs). */
enum { CH_USER = 0, CH_STAGED_CPU = 1, CH_STAGED_DEV = 2, CH_FMAP = 3 };

struct io_chunk;
struct io_worker;
struct io_fwin;
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
    uint8_t tail_held; /* a write's last sub waits for the others (chunk_issue_subs) */
    uint8_t busy;          /* counted in ctx normal_busy (1) or bg_busy (2) until it finishes */
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
    int prio;               /* enum phx_priority: which queue its chunks go to */
    int owned_mem;          /* PHX_IO_OWNED_MEMORY: CPU copies with memcpy (user_copy) */
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
    uint64_t gen;           /* io_fork_gen when submitted: a parent's request in a forked child */
    uint32_t nchunks;
    struct io_chunk chunks[];
};

/* req_build's answer for a request completed at once that nobody holds a handle to */
#define REQ_DONE_NO_HANDLE ((phx_req *)1)

#pragma GCC visibility push(hidden)
/* io_plan.c: build a request, chunks planned, not queued. NULL when out of memory; on a
 * refusal a request already complete with its error (*queued = 0), or
 * REQ_DONE_NO_HANDLE when nobody wants a handle to it. */
phx_req *req_build(struct phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                   int want_handle, int *queued);
/* Complete a request that never ran with err (its flag set, no wake owed). */
void req_fail_now(phx_req *r, int err);
/* io_submit.c: submit one request internally (stream ops): no registration check,
 * on_done called on completion from whichever thread completes it; the caller holds one
 * reference. */
int io_submit_one(struct phx_ctx *ctx, const struct phx_io_desc *d, int internal, io_done_fn on_done, void *arg,
                  phx_req **out);
/* io_chunk.c: drop a reference (the last frees); a chunk is done (the last completes
 * its request: counts, flag, on_done, file and context references). */
void req_unref(phx_req *r);
void chunk_finish(struct io_chunk *ch);
#pragma GCC visibility pop

#endif
