/* The I/O core: files <-> host or device memory, without the GIL.
 *
 * Core side. Python (phoenix/io.py) is the control plane: it opens files, classifies
 * buffers and submits requests through this API with ctypes (which releases the GIL
 * for every call). Everything per chunk runs here, on the core's own threads:
 *
 *   context   a worker pool (PHX_IO_ENGINE: one io_uring ring per worker, or workers
 *             doing pread/pwrite), a bounce pool of pinned host memory, and a copy of
 *             the vendor's data-path table (phx_vendor.h; NULL: host memory only).
 *   file      two descriptors on one inode (the path is opened once, the second is
 *             opened through /proc/self/fd): O_DIRECT (when the file system takes it)
 *             and buffered (unaligned heads and tails, and the fallback).
 *   request   one extent of a file <-> one extent of memory, split into chunks that
 *             the workers run in parallel; a batch is many requests in one call.
 *   stream op a request ordered on the caller's stream (read_async / write_async):
 *             host callbacks queued with launch_host_func run the file I/O, device
 *             copies queued between them move the bytes; results bound late.
 *
 * Paths, chosen per request (PHX_MODE; see io_plan.c and io_chunk.c):
 *   user    the file I/O lands in the caller's memory: host memory (pinned, registered
 *           or plain: zero-copy) and device memory the CPU can address (vendor
 *           direct_capable: "direct"). O_DIRECT for the page-aligned body, buffered
 *           I/O for an unaligned head or tail; memory whose address is not aligned the
 *           way its file offset is goes through a bounce slot and a CPU copy.
 *   staged  O_DIRECT into a pinned bounce slot, then memcpy_async to the device on a
 *           per-worker stream (writes: device -> slot, then the write), pipelined.
 *   buffered where O_DIRECT is refused (at open, or EINVAL at the first transfer), for
 *           direct=OFF files, and for reads of ranges already in the page cache.
 *
 * Every call returns 0 (or a count) on success and a negative errno on failure. A forked
 * child gets a core of its own ("fork", at the end); what the parent made answers there
 * at once, with -ECHILD where it cannot serve.
 */
#ifndef PHX_IO_H
#define PHX_IO_H

#include <stddef.h>
#include <stdint.h>

#include "phx_vendor.h"

#define PHX_IO_ABI 1

/* ---- settings --------------------------------------------------------------------- */

enum phx_engine { PHX_ENGINE_AUTO = 0, PHX_ENGINE_IO_URING = 1, PHX_ENGINE_THREADS = 2 };
enum phx_mode { PHX_MODE_AUTO = 0, PHX_MODE_STAGED = 1, PHX_MODE_DIRECT = 2 };

struct phx_io_config {
    uint32_t threads;          /* workers (rings, for io_uring) */
    uint32_t queue_depth;      /* chunks in flight per worker (io_uring) */
    uint64_t chunk_size;       /* bytes per chunk, a multiple of 4096 */
    uint64_t bounce_pool_size; /* most pinned bounce bytes the context may hold */
    int32_t engine;            /* enum phx_engine */
    int32_t fmap_mode;         /* enum phx_fmap_mode: the file-mapping cache (below) */
    uint64_t fmap_budget;      /* most bytes of file mappings registered at once (0: off) */
    uint64_t fmap_window;      /* bytes per mapping window: a multiple of 2 MiB */
    uint32_t fmap_register_flags; /* host_register flags for mappings (the port's portable | read-only) */
    uint32_t flags;            /* PHX_CFG_* */
    uint64_t fmap_idle_ns;     /* a window not read for this long is released (0: never) */
    /* bytes of file I/O from the device (not the page cache) the workers keep in flight
     * together: each worker up to inflight / threads (at least 1 MiB), and a request's
     * chunks are cut no larger than that. 0: 64 MiB per worker, chunks as chunk_size. */
    uint64_t inflight;
};

enum {
    /* The vendor's copies are CPU copies (a test double: the host vendor, emulators): a
     * copy from a file mapping whose file is truncated meanwhile faults (SIGBUS), where a
     * DMA from pinned pages does not; the file-mapping cache then guards its mappings
     * with a SIGBUS handler (io_fmap_guard.c). Never set for hardware. */
    PHX_CFG_CPU_COPIES = 1,
    /* The io_uring workers do not register the bounce pool with their rings: every read
     * and write pins its pages (setting fixed_buffers=off; a comparison, or a kernel that
     * mishandles registered buffers). */
    PHX_CFG_NO_FIXED_BUFFERS = 2,
    /* The io_uring workers learn that their device copies are done from host callbacks,
     * even where the vendor's events can be polled (setting copy_completion=callback). */
    PHX_CFG_CALLBACKS = 4,
    /* Polling workers look at their staged writes' copies in steps doubled from 20 us, not
     * at their predicted ends (setting copy_completion=steps; a comparison). */
    PHX_CFG_POLL_STEPS = 8,
};

enum phx_fmap_mode {
    PHX_FMAP_AUTO = 0, /* a miss is served staged; the window is registered in the background */
    PHX_FMAP_OFF = 1,
    PHX_FMAP_SYNC = 2, /* a miss registers the window in the submitting thread, then hits */
};

/* Can `engine` run here? Returns the engine that would serve (IO_URING or THREADS;
 * AUTO resolves) and writes why into reason; a negative errno when the requested
 * engine cannot run (io_uring refused by the kernel or seccomp). */
int phx_engine_probe(int engine, char *reason, size_t reason_len);

/* ---- context ---------------------------------------------------------------------- */

typedef struct phx_ctx phx_ctx;

/* dp may be NULL (host memory only); it is copied. */
int phx_ctx_create(const struct phx_io_config *cfg, const struct phx_dp_table *dp, phx_ctx **out);
/* The engine serving (enum phx_engine), and why it was chosen. */
int phx_ctx_engine(const phx_ctx *ctx, char *reason, size_t reason_len);
/* The sizes in effect, as the context resolved its settings: the bounce pool (auto
 * sized from threads and chunk), the chunk of staged and bounced transfers (at most
 * the chunk size, and small enough that two slots fit the pool), and the largest slot. */
struct phx_ctx_sizes {
    uint64_t bounce_pool, chunk, staged_chunk, max_slot;
    uint64_t worker_bytes; /* bytes of device I/O one worker keeps in flight (chunks: at most this) */
};
int phx_ctx_sizes(const phx_ctx *ctx, struct phx_ctx_sizes *out);
/* Waits for every request and stream op of the context, stops the workers, frees the
 * bounce pool. (A parent's context in a forked child: forgotten at once, see "fork".) */
void phx_ctx_destroy(phx_ctx *ctx);
/* Allocate and pin the whole bounce pool now (it otherwise grows on first need). Pinning
 * goes through the vendor (host_register), which a runtime may serialize behind busy
 * streams: an application that holds streams with its own callbacks prepares the context
 * before its first stream-ordered I/O. Returns the pool's pinned bytes or a negative errno. */
int64_t phx_ctx_prepare(phx_ctx *ctx);

/* ---- files ------------------------------------------------------------------------ */

typedef struct phx_file phx_file;

enum {
    PHX_F_READ = 1,
    PHX_F_WRITE = 2,
    PHX_F_CREATE = 4,
    PHX_F_TRUNC = 8,
    PHX_F_EXCL = 16,
    PHX_F_SYNC = 32, /* O_DSYNC: every write is durable when it completes */
};
enum { PHX_DIRECT_OFF = 0, PHX_DIRECT_ON = 1, PHX_DIRECT_AUTO = -1 };

/* direct: AUTO uses O_DIRECT where the file system takes it, except for reads of
 * ranges mostly in the page cache already (asked with cachestat(2), Linux 6.5+; it
 * backs off while the answer is no), which are read buffered; ON always uses O_DIRECT
 * and fails (-EINVAL) where the file system refuses it (and for character devices);
 * OFF never uses it. Phoenix moves data at file offsets only: a FIFO, pipe, socket or
 * terminal is refused with -ESPIPE (a FIFO without being opened), a directory with
 * -EISDIR; both functions. */
int phx_file_open(const char *path, int flags, int perm, int direct, phx_file **out);
/* Adopt a descriptor (the caller keeps its own): dup'ed, or opened again through
 * /proc/self/fd where its open file description has O_APPEND (writes would ignore their
 * offsets) or O_DIRECT; -EBADF for an O_PATH descriptor. */
int phx_file_from_fd(int fd, int direct, phx_file **out);
/* Waits for the file's in-flight requests and stream ops, then closes (in a forked child:
 * not for the parent's, see "fork"). */
int phx_file_close(phx_file *f);
int phx_file_fsync(phx_file *f);
int64_t phx_file_size(phx_file *f); /* fstat size, or -errno */

/* 0 when the page-cache probe of direct=AUTO reads (cachestat) works for this file,
 * else -errno (-ENOSYS: kernel older than 6.5; those files read O_DIRECT always). */
int phx_cache_probe_works(phx_file *f);

struct phx_file_info {
    int32_t direct;            /* 1 when O_DIRECT is in use */
    uint32_t dio_offset_align; /* file offset / length alignment of O_DIRECT */
    uint32_t dio_mem_align;    /* memory alignment of O_DIRECT */
    int32_t fd_direct, fd_buffered;
    uint32_t reserved;
    int64_t known_size;        /* largest end of a write in flight through this file  */
    char why[160];             /* why O_DIRECT is or is not used */
};
int phx_file_query(phx_file *f, struct phx_file_info *out);

/* ---- requests --------------------------------------------------------------------- */

enum phx_op { PHX_OP_READ = 0, PHX_OP_WRITE = 1 };
/* A request's priority: workers take normal chunks before background ones (a background
 * chunk still goes after every few normal ones: never starved), background chunks leave a
 * quarter of the bounce pool to normal ones, and while normal chunks are in their I/O at most
 * IO_BG_BUSY background ones are, of IO_BG_CHUNK bytes at most (io_common.h). Loads are
 * normal; offloads that
 * nobody waits for (a KV engine's writes of new KV) are background. */
enum phx_priority { PHX_PRIO_NORMAL = 0, PHX_PRIO_BACKGROUND = 1 };
enum phx_mem {
    PHX_MEM_HOST = 0,          /* host memory: plain, pinned or registered */
    PHX_MEM_DEVICE = 1,        /* device memory only the vendor's copies reach */
    PHX_MEM_DEVICE_MAPPED = 2, /* device memory the CPU and the kernel can address */
};

typedef struct phx_fence phx_fence;

struct phx_io_desc {
    phx_file *file;
    uint64_t addr;        /* buffer address (base + buffer offset) */
    uint64_t size;        /* bytes */
    int64_t file_offset;
    int32_t op;           /* enum phx_op */
    int32_t mem;          /* enum phx_mem */
    int32_t device;       /* device ordinal for device memory */
    int32_t mode;         /* enum phx_mode */
    phx_fence *after;     /* NULL, or: touch the memory only after this point of the
                           * caller's stream (phx_fence_record) */
    int32_t priority;     /* enum phx_priority (0: normal) */
    int32_t flags;        /* PHX_IO_OWNED_MEMORY, or 0 */
};
/* phx_io_desc.flags: the host memory is an object the caller holds (mapped, and writable for
 * a read): the core's CPU copies into and out of it are plain memcpy. Without it (a raw
 * pointer) they go through the kernel's checked copy: a page missing or read-only is EFAULT,
 * not a crash. */
#define PHX_IO_OWNED_MEMORY 1

typedef struct phx_req phx_req;

/* Submit n requests at once. out[i] receives a handle for every request, also for one
 * refused at submission (it completes at once with its error): a failed request fails
 * alone. Returns 0, or -errno when nothing was submitted (out of memory). */
int phx_submit(phx_ctx *ctx, const struct phx_io_desc *descs, uint32_t n, phx_req **out);
/* 0 once complete; -ETIMEDOUT after timeout_ns (< 0: wait forever). */
int phx_req_wait(phx_req *r, int64_t timeout_ns);
int phx_req_done(const phx_req *r);
/* Bytes transferred (short at EOF), or -errno; valid once done (-EBUSY before). */
int64_t phx_req_result(const phx_req *r);
/* The failing extent of a failed request (the chunk that failed first). */
int phx_req_error_extent(const phx_req *r, int64_t *offset, uint64_t *length);
/* Drop the caller's handle; an in-flight request completes and frees itself. */
void phx_req_release(phx_req *r);
/* Batches: wait for all (results[i] as phx_req_result; NULL handles give -ENOMEM),
 * -ETIMEDOUT if timeout_ns >= 0 passes first; release all (NULLs skipped). */
int phx_req_wait_all(phx_req **reqs, uint32_t n, int64_t *results, int64_t timeout_ns);
void phx_req_release_all(phx_req **reqs, uint32_t n);

/* ---- ordering with the caller's stream (io_order.c) ----------------------------------
 *
 * The rule: an I/O call that touches device memory runs after all work queued so far on
 * the caller's stream, and a request's bytes are in place (visible to any work queued
 * after) when it completes. phx_fence_record marks "so far" on the caller's stream; a
 * request whose desc names the fence (desc.after) waits for it where it touches memory:
 *   - its device copies (staged, file mappings): the worker's stream waits for the
 *     fence's event (stream_wait_event) before the copy: the file I/O into bounce
 *     buffers overlaps the caller's work, only the copy waits;
 *   - memory the CPU or the disk writes (host memory, direct-capable device memory):
 *     phx_submit waits for the event on the host before queueing the request.
 * A vendor without events (phx_dp_has_events): phx_fence_record synchronizes the stream
 * itself and returns no fence (*out = NULL): nothing is left to wait for. */

/* Record the point "now" of `stream` (the vendor's handle; 0 its default stream) of
 * `device` (-1: the calling thread's current device). Returns 0 with *out a fence (release it once the requests naming it are
 * submitted: each request holds its own reference) or NULL (nothing to wait for), or a
 * negative errno (-ENODEV: no data path; -EIO: the vendor refused). */
int phx_fence_record(phx_ctx *ctx, int device, void *stream, phx_fence **out);
void phx_fence_release(phx_fence *f);
/* How I/O is ordered with the caller's stream in this context: 1 events, 0 the stream is
 * synchronized at the call (the vendor has no events), -1 no data path (host memory). */
int phx_ctx_ordering(const phx_ctx *ctx);

/* ---- stream-ordered I/O ----------------------------------------------------------- */

typedef struct phx_sop phx_sop;

/* Queue desc on `stream` (the vendor's handle) through launch_host_func: work queued
 * before it has finished when its I/O starts, work queued after it sees its bytes.
 * When the stream reaches its end, *bytes_done (if not NULL) and phx_sop_result hold
 * the byte count or -errno. Submission errors are returned at once. out may be NULL
 * (fire and forget: the op frees itself). Needs the context's data-path table. */
int phx_stream_io(phx_ctx *ctx, const struct phx_io_desc *desc, void *stream, int64_t *bytes_done,
                  phx_sop **out);
int phx_sop_done(const phx_sop *s);
int phx_sop_wait(phx_sop *s, int64_t timeout_ns);
int64_t phx_sop_result(const phx_sop *s);
void phx_sop_release(phx_sop *s);

/* ---- registrations ---------------------------------------------------------------- */

struct phx_reg_info {
    uint64_t base, size;
    int32_t mem, device;
    int32_t refs;
    uint32_t reserved;
};

/* Register [base, base+size): 0 when new, 1 when an exact duplicate (reference counted),
 * -EINVAL for a zero size or an overlap with another registration. */
int phx_reg_add(uint64_t base, uint64_t size, int mem, int device);
/* Drop one reference of the registration starting at base: the references left, or
 * -ENOENT for an unknown base. */
int phx_reg_remove(uint64_t base);
/* Where does [addr, addr+size) stand? 0: inside the run of adjacent registrations of one
 * kind and device that starts with the one holding addr (out: its base, the run's size);
 * 1: not registered, or runs past that run into unregistered memory (out written);
 * -EFAULT: runs into another registration (another kind or device, or past a gap), or wraps. */
int phx_reg_lookup(uint64_t addr, uint64_t size, struct phx_reg_info *out);
/* Drop every registration (driver close); returns how many there were. */
int phx_reg_clear(void);
/* (The table is the process's: a forked child keeps the parent's registrations, its
 * memory being the child's copy.) */

/* ---- the file-mapping registration cache (io_fmap*.c) -----------------------------------
 *
 * Warm reads into device memory: a file range that is in the page cache (or tmpfs) is
 * mmap'd (PROT_READ, MAP_SHARED|MAP_POPULATE: the page-cache pages themselves, no copy)
 * in windows of fmap_window bytes (aligned in file offsets), and each window is
 * host-registered once with the vendor (fmap_register_flags; retried without the data-path
 * table's host_register_read_only bit, then marked unregistrable and never retried). A
 * staged read into device memory whose whole range lies in registered windows is one
 * unit of work: one worker queues one
 * memcpy_async per window piece (<= 256 MiB) on its stream and one host callback that
 * completes the request -- no bounce buffer, no pread, one wakeup, one waiter (about
 * 0.02 CPU s/GB against 0.3 for copying through bounce buffers). Registering costs
 * about 0.09 s/GiB, so windows are cached by (st_dev, st_ino, window), checked against
 * the file's size, mtime and ctime at every lookup, reused across opens (closing a file
 * keeps them), evicted LRU under fmap_budget (only when no request uses them), dropped
 * when a write through this context overlaps them, and released by phx_fmap_clear and
 * phx_ctx_destroy. A miss is read through the staged path; the windows it touched that
 * are resident (cachestat) are queued to one background registrar thread (nice 19),
 * or registered right away in PHX_FMAP_SYNC mode. Not used for files opened direct=ON,
 * for files with an injected fault, or without the vendor's host_register.
 *
 * Coherence: the mapping shares the page cache, so buffered writes by anyone are seen;
 * other writers are caught by the mtime/ctime/size check (timestamps are as fine as the
 * file system's clock: two external writes within one tick of it keep the mtime). */
struct phx_fmap_info {
    int32_t mode;              /* enum phx_fmap_mode in effect (OFF when unusable) */
    uint32_t register_flags;
    uint64_t budget, window;
    int64_t windows, bytes;    /* registered windows and their bytes */
    int64_t pending, unregistrable, in_use; /* queued; refused by the vendor; used by requests */
    int64_t hits, misses, registrations, evictions, invalidations;
    char why[160];             /* why the cache is off, when it is */
    /* (appended) */
    uint64_t idle_ns;          /* the idle timeout in effect (0: never) */
    int64_t pinned;            /* bytes registered now: cached windows and dropped ones a
                                * request still copies from (never above budget) */
    int64_t idle_releases;     /* windows released for being idle */
    int64_t pressure_releases; /* memory-pressure events that released every window */
    char pressure[96];         /* how memory pressure is watched (PSI trigger, MemAvailable) */
};
int phx_fmap_query(phx_ctx *ctx, struct phx_fmap_info *out);
/* Is [offset, offset+length) of f in one registered, current window? 0 and its mapped
 * address (valid until the window is dropped: diagnostics and tests only), -ENOENT, or
 * -ENOSYS when the cache is off. */
int phx_fmap_lookup(phx_ctx *ctx, phx_file *f, int64_t offset, uint64_t length, void **host_addr);
/* Wait until the background registrar has nothing queued (timeout_ns < 0: forever);
 * -ETIMEDOUT first. "The registration happens between agent rounds." */
int phx_fmap_wait(phx_ctx *ctx, int64_t timeout_ns);
/* Drop every window (those in use go when their requests finish) and the queue; waits
 * for a registration in progress. Returns how many windows were dropped. */
int phx_fmap_clear(phx_ctx *ctx);
/* Bounded by default, given back when idle and under pressure: the registrar thread (started
 * with the first window) releases windows not read for fmap_idle_ns, and every window when
 * the kernel reports memory pressure (a PSI trigger on /proc/pressure/memory, "some 150 ms
 * in 2 s"; where that is missing or refused, MemAvailable under 5% of MemTotal, checked
 * each second); after pressure no window is registered for FMAP_PRESSURE_HOLD (io_fmap.h).
 * A window a request is copying from is unregistered when its last user drops it. */

/* Is [addr, addr+size) readable memory of this process? 0, or -EFAULT (unmapped, or
 * PROT_NONE: a freed buffer of the host vendor's arena). Probes the first and the last
 * byte with process_vm_readv, which reports a bad address instead of faulting;
 * -ENOSYS where that call is refused (seccomp). For raw (ptr, nbytes) host buffers. */
int phx_mem_probe(uint64_t addr, uint64_t size);

/* ---- counters --------------------------------------------------------------------- */

/* The counters, defined once: X(name) for each, in the order of struct phx_io_stats (the
 * core's own atomic counters and phx_io_get_stats are made from the same list). */
#define PHX_IO_STATS(X)                                                                     \
    /* live objects: all zero once every file is closed, every buffer deregistered and  */ \
    /* every context destroyed                                                          */ \
    X(contexts) X(threads) X(files) X(requests) X(stream_ops) X(registrations)             \
    X(worker_streams) X(bounce_bytes) X(bounce_in_use)                                     \
    /* cumulative                                                                       */ \
    X(bytes_read) X(bytes_written)                                                         \
    X(chunks_user) X(chunks_staged) X(chunks_staged_cpu)                                   \
    X(io_direct) X(io_buffered) X(reissues) X(direct_fallbacks) X(uring_enters)            \
    /* background chunks held back while normal ones ran (IO_BG_BUSY in their I/O)      */ \
    X(bg_held)                                                                             \
    /* page-cache probes (cachestat) of O_DIRECT reads                                  */ \
    X(cache_hit_bytes) X(cache_misses)                                                     \
    /* file-mapping cache: live windows and bytes registered; requests served or not    */ \
    X(fmap_windows) X(fmap_bytes) X(fmap_hits) X(fmap_misses)                              \
    /* chunks that waited for a bounce slot; completion callbacks of staged reads       */ \
    X(pool_waits) X(copy_flushes)                                                          \
    /* io_uring reads and writes of bounce slots on registered buffers (no pinning)     */ \
    X(io_fixed)                                                                            \
    /* events recorded for staged copies' completions, which workers poll (no callback) */ \
    X(copy_events)

#define PHX_IO_STAT_FIELD(name) int64_t name;
struct phx_io_stats {
    PHX_IO_STATS(PHX_IO_STAT_FIELD)
};
#undef PHX_IO_STAT_FIELD
void phx_io_get_stats(struct phx_io_stats *out);
/* "contexts,threads,...,": the fields of struct phx_io_stats in order (all int64_t) */
const char *phx_io_stats_fields(void);

/* ---- fork ---------------------------------------------------------------------------
 *
 * A process may fork at any moment (threads busy with I/O, stream ops queued,
 * registrations being added). The child has one thread, the one that forked: the
 * parent's workers, registrars and stream callbacks are not there. The contract:
 *
 *   - Nothing of the core hangs the child. Every process-global lock of the core (the
 *     registration table's, the list of stream-ordered writes, the fault guard's table) is
 *     held by the forking thread across fork() (pthread_atfork) and is a fresh lock in the
 *     child: its state is whole, as some thread left it between two changes.
 *   - The child makes a context of its own (phx_ctx_create) and it works as in any
 *     process: files, requests, stream-ordered I/O, registrations, the file-mapping cache.
 *   - A context made by the parent before fork() is dead in the child: phx_submit,
 *     phx_stream_io, phx_fence_record, phx_ctx_prepare and the phx_fmap_* calls on it
 *     return -ECHILD at once ("made by the parent process before fork(); make a new
 *     context"); phx_ctx_destroy returns at once, waiting for and joining nothing (its
 *     memory, bounce pool and vendor streams leak: freeing them would ask the vendor, and
 *     its threads' locks may be held for good); the queries (phx_ctx_engine, sizes,
 *     ordering) still answer.
 *   - A request or stream op of the parent's that was not done at the fork will never be
 *     (what would run it is the parent's): in the child it is done, phx_req_wait /
 *     phx_req_wait_all / phx_sop_wait return at once, its result is -ECHILD (a request's
 *     failing extent: all of it); *bytes_done of such an op stays what it was at the
 *     fork. One done before the fork keeps its result. Releasing either never waits.
 *     phx_fence_release of a parent's fence lets it go without its context.
 *   - A file the parent opened stays usable in the child, for new I/O on the child's
 *     context (its descriptors are the child's too): its count of requests in flight, which
 *     only the parent's would have brought down, starts at zero there, so phx_file_close
 *     waits for none of the parent's requests or stream ops.
 *   - The registration table is kept (the memory it names is the child's copy), and the
 *     stream-ordered writes the parent had queued are forgotten: a blocking call of the
 *     child on their range waits for none of them (nothing runs them in the child), it
 *     sees the file as the fork left it.
 *   - The counters say what the child has: no thread, request or stream op in flight at
 *     first; the parent's contexts count until phx_ctx_destroy forgets them.
 *   - The core's threads block the asynchronous signals (SIGINT, SIGTERM, SIGCHLD, ...),
 *     so that a process-directed signal goes to a thread of the application; the
 *     synchronous ones (SIGBUS, SIGSEGV, ...) stay deliverable.
 * The vendor runtime is the vendor's: a real accelerator runtime may not work in a forked
 * child at all (CUDA refuses to); the host vendor's test double does (hostrt.h says how).
 */

#endif
