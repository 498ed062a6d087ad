/* What every file of the I/O core (phx_io.h) shares: its sizes, its counters, and the
 * rule that keeps its internals out of the library's exports.
 *
 * Core side, data path. The files and their seams (see README.md here):
 *
 *   io_sync     completion flags (futex words) and clocks
 *   io_ctx      the context: create, destroy, references, resolved sizes
 *   io_worker   worker threads: the context's chunk queues, the io_uring and threads
 *               engines' loops, startup and shutdown
 *   io_chunk    the chunk state machine: file I/O (subs), completion of chunks/requests
 *   io_copy     device copies of staged chunks and of file-mapping hits, their callbacks
 *   io_plan     planning: a request's checks, its chunk layout, its chunks
 *   io_submit   the request API (phx_submit, phx_req_*)
 *   io_fmap*    the file-mapping registration cache; io_file, io_pool, io_ring,
 *               io_order, io_reg, io_stream, io_stats: one object each
 *
 * Visibility: the library exports the API of phx_io.h (and the test hook of
 * phx_testing.h) and nothing else. Every internal header declares its functions and
 * variables between `#pragma GCC visibility push(hidden)` and `pop`, after its own
 * #includes (a system header inside the region would hide libc's symbols too).
 */
#ifndef PHX_IO_COMMON_H
#define PHX_IO_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "phx_io.h"

#define IO_POOL_UNIT (64u << 10)        /* bounce pool allocation unit */
#define IO_MAX_ALIGN (64u << 10)        /* larger O_DIRECT alignments: file used buffered */
#define IO_MAX_CHUNK (1ull << 30)       /* one SQE / one pread moves < 4 GiB */
/* Bytes one io_uring worker keeps in flight at most (besides queue_depth chunks) when no
 * context budget is set (phx_io_config.inflight 0): a 16 MiB O_DIRECT read is already
 * dozens of device requests, so four of them per ring keep a disk busy; deeper queues of
 * large chunks only add contention. Small random reads are bounded by queue_depth. */
#define IO_WORKER_BYTES (64ull << 20)
/* A budget's share per worker is at least this (one chunk of it keeps a device busy) */
#define IO_WORKER_MIN_BYTES (1ull << 20)
/* Chunks of a background request are at most this: a load taken while one is in its I/O
 * waits for this much of an offload, not for a whole chunk_size */
#define IO_BG_CHUNK (2ull << 20)
#define IO_FLUSH_BYTES (4ull << 20)     /* staged-read copies queued before their callback is launched */
/* ... or queued this long, while the worker's ring has file I/O in flight (a completion
 * will wake it): each launch_host_func costs the runtime's callback thread tens of
 * microseconds, so under load a callback serves the copies of several completions. With
 * nothing in flight, or slots awaited, the callback is launched before the worker sleeps. */
#define IO_FLUSH_NS (250ll * 1000)
/* A worker polling its copies' events waits in its ring at most this long at a time,
 * doubled after each wait that found none done, up to IO_POLL_MAX_NS (slow copies). */
#define IO_POLL_NS (20ll * 1000)
#define IO_POLL_MAX_NS (320ll * 1000)
/* (a staged write's copy is looked at first at its predicted end: io_copy_est.h) */
#define IO_TIMER_SLACK_NS 1000ul /* a worker's timer slack (prctl PR_SET_TIMERSLACK) */
/* Chunks of one request, at most (its counts are int: r->pending) */
#define IO_MAX_CHUNKS 0x7fffffffull
#define IO_CACHED_CHUNK (4ull << 20)    /* staged chunks of a read from the page cache (at most) */
#define IO_CACHED_SLOTS 4               /* ... and slots of them in use per worker (at most) */
#define IO_BG_EVERY 8                   /* normal chunks taken per background one, at most */
/* While normal chunks are in their I/O, or one finished less than IO_BG_GRACE_NS ago,
 * at most IO_BG_BUSY background chunks are (a load waits behind that much of an offload,
 * not behind the whole pool of them); otherwise they take up to 3/4 of the bounce pool. */
#define IO_BG_BUSY 1
#define IO_BG_GRACE_NS (20ll * 1000 * 1000)

/* ---- counters (phx_io_get_stats, io_stats.c) ---- */
#define IO_COUNTER_FIELD(name) _Atomic int64_t name;
struct io_counters {
    PHX_IO_STATS(IO_COUNTER_FIELD)
};
#undef IO_COUNTER_FIELD

#pragma GCC visibility push(hidden)
extern struct io_counters io_stats;
#pragma GCC visibility pop

#define STAT_ADD(field, v) atomic_fetch_add_explicit(&io_stats.field, (v), memory_order_relaxed)

/* Multiples of a (a > 0, any value: chunk sizes are multiples of 4096, not powers of two). */
static inline uint64_t align_down(uint64_t v, uint64_t a) { return v - v % a; }
static inline uint64_t align_up(uint64_t v, uint64_t a) { return align_down(v + a - 1, a); }

#endif
