/* The file-mapping registration cache (phx_io.h says what it is and what must stay true).
 *
 * Core side, data path with a control-plane face (phx_fmap_*). Its files:
 *
 *   io_fmap.c           requests: plan a hit or a miss, lay a hit out as chunks, drop
 *                       references (stream callbacks), and the control plane
 *   io_fmap_index.c     the windows: hash, LRU, drop and release, the per-inode table of
 *                       writes in flight, the cache's lifetime (init, clear, fini)
 *   io_fmap_register.c  mapping and registering windows: the registrar thread, which also
 *                       releases idle windows and every window under memory pressure
 *   io_fmap_pressure.c  watching memory pressure (PSI trigger, else MemAvailable)
 *   io_fmap_guard.c     the fault guard: a copy from a truncated mapping reads zeros
 *
 * Windows live in a hash by (st_dev, st_ino, window index) and, once registered, in an
 * LRU list; all state changes under fmap.mu. Vendor calls and mmap/munmap never run
 * under the mutex: windows to release are unhooked first, released after unlocking.
 */
#ifndef PHX_IO_FMAP_H
#define PHX_IO_FMAP_H

#include <sys/stat.h>
#include <time.h>

#include "io_common.h"

struct phx_ctx;

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
    int64_t last_use_ns;           /* io_now_ns of the last hit or release by a request (mu) */
};
#define FMAP_HASH 1024
#define FMAP_WHASH 256
struct io_fwrite {
    struct io_fwrite *next;
    uint64_t dev, ino, gen; /* gen: wgen when the last write started */
    int64_t writes;         /* in flight */
};
#define FMAP_PIECE (256ull << 20)  /* bytes per memcpy_async of a hit */
/* windows queued or being registered, at most (each holds a descriptor): a miss past it
 * is read as any miss, not queued (reads faster than the registrar, or writes that keep
 * dropping queued windows, do not pile them up) */
#define FMAP_PENDING_MAX 64
struct io_fmap {
    pthread_mutex_t mu;
    pthread_cond_t cv;             /* wakes the registrar */
    pthread_cond_t idle_cv;        /* queue drained / registration finished */
    int mode;                      /* enum phx_fmap_mode (OFF when unusable) */
    uint64_t budget, window;
    unsigned flags;                /* host_register flags (phx_io_config.fmap_register_flags) */
    unsigned readonly;             /* their read-only bit, dropped on a refusal (the data-path
                                    * table's host_register_read_only; 0: no retry) */
    char why[160];
    struct io_fwin *hash[FMAP_HASH];
    struct io_fwin lru;            /* sentinel */
    struct io_fwin *q_head, *q_tail, *release;
    uint64_t bytes;                /* READY bytes */
    uint64_t reserved;             /* bytes of registrations in progress (counted in the budget) */
    int64_t windows, pending, unregistrable, in_use;
    int64_t hits, misses, registrations, evictions, invalidations;
    int busy, stop, started;
    int clearing;                  /* fmap_clear_all in progress: the registrar starts nothing */
    pthread_t th;
    /* phoenix writes per inode: a window is not registered while one runs or if one
     * started during its registration (an O_DIRECT write cannot invalidate pinned
     * page-cache pages); entries go when idle and no registration is in progress */
    struct io_fwrite *wtab[FMAP_WHASH];
    uint64_t wgen;                 /* writes started */
    int regs_active;               /* registrations in progress */
    /* release: idle windows and, under memory pressure, all of them (the registrar) */
    uint64_t draining;             /* bytes of dropped windows still registered (a request
                                    * copies from them): counted in the budget until released */
    int64_t idle_ns;               /* 0: never */
    int64_t idle_releases, pressure_releases;
    int64_t hold_until_ns;         /* after pressure: register nothing before this */
    int pressure_sim;              /* a test's simulated pressure signal (phx_fmap_simulate_pressure) */
    int psi_fd;                    /* the PSI trigger (registrar thread), -1: none */
    int psi_tried;
    char pressure_how[96];
};
#define FMAP_PRESSURE_HOLD_NS (5000000000ll) /* no registration this long after pressure */
#define FMAP_TICK_MAX_NS (1000000000ll)      /* the registrar's housekeeping period, at most */
struct fmap_plan {
    struct io_fwin **wins;
    int nwins;
    int64_t fsize;
    uint32_t nchunks;
    int resident; /* a miss whose range the probe found in the page cache */
};

static inline int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000ll + t.tv_nsec; }

#pragma GCC visibility push(hidden)
/* ---- what the rest of the core calls ---- */
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

/* ---- between the cache's own files (mu: called with fmap.mu held) ---- */
/* io_fmap_index.c */
struct io_fwin *fmap_find_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, int64_t off);
void fmap_hash_insert_locked(struct io_fmap *m, struct io_fwin *w);
void fmap_hash_remove_locked(struct io_fmap *m, struct io_fwin *w);
void fmap_lru_front_locked(struct io_fmap *m, struct io_fwin *w);
struct io_fwin *fmap_drop_locked(struct io_fmap *m, struct io_fwin *w);
void fmap_release_list(struct phx_ctx *ctx, struct io_fwin *list);
struct io_fwrite *fmap_wfind_locked(struct io_fmap *m, uint64_t dev, uint64_t ino);
void fmap_wprune_locked(struct io_fmap *m);
int fmap_written_since_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, uint64_t gen0);
int fmap_snapshot_matches(const struct io_fwin *w, const struct stat *st);
int fmap_clear_all(struct phx_ctx *ctx, int stop);
/* io_fmap_register.c */
void fmap_register_window(struct phx_ctx *ctx, struct io_fwin *w);
void fmap_registrar_start_locked(struct phx_ctx *ctx);
/* Release windows not read for idle_ns and, under memory pressure, every window (not under
 * mu; the registrar thread). */
void fmap_housekeeping(struct phx_ctx *ctx, int64_t now);
/* Drop every READY window and the registration queue (mu held); returns the windows to release. */
struct io_fwin *fmap_drop_all_locked(struct io_fmap *m, int *count);
/* io_fmap_pressure.c: 1 when the system is under memory pressure (PSI trigger fired, or
 * MemAvailable < 5% of MemTotal); opens the trigger on first call (registrar thread). */
int fmap_pressure_check(struct io_fmap *m);
void fmap_pressure_close(struct io_fmap *m);
/* io_fmap.c */
int fmap_resident(int fd, int64_t off, uint64_t len);
/* io_fmap_guard.c */
void fg_ensure(void);
int fg_add(char *addr, uint64_t len);
void fg_remove(char *addr);
int64_t fg_valid_end(const struct io_fwin *w);
#pragma GCC visibility pop

#endif
