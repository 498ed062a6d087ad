/* The file-mapping registration cache: warm reads into device memory as one DMA.
 *
 * Core side. What it is and what must stay true: phx_io.h ("the file-mapping
 * registration cache"). Who calls what:
 *
 *   submitters  fmap_plan (lookup; on a miss queue, or in SYNC mode do, the
 *               registration), fmap_write_invalidate; control plane: phx_fmap_*.
 *   workers     nothing here: a hit is run by io_engine.c (fmap_chunk_start).
 *   callbacks   fmap_unref, fmap_req_copied: the mutex, a condition variable and an
 *               fstat, never the vendor.
 *   registrar   one thread per context, started on first need, nice 19: maps and
 *               registers queued windows one at a time, and releases dropped windows
 *               (host_unregister + munmap) whose last user was a stream callback.
 *   SIGBUS      the fault guard's handler (any thread that copies from a mapping).
 *
 * Windows live in a hash by (st_dev, st_ino, window index) and, once registered, in an
 * LRU list; all state changes under fmap.mu. Vendor calls and mmap/munmap never run
 * under the mutex: windows to release are unhooked first, released after unlocking.
 * Every mapped window is also listed, process-wide, with the fault guard (below).
 */
#include "io_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FW_READONLY_FLAG 8u /* cudaHostRegisterReadOnly: retried without it */

static __thread int in_registrar; /* this thread is a registrar */

#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct fm_cachestat_range {
    uint64_t off, len;
};
struct fm_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

static int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000ll + t.tv_nsec; }

/* ---- the fault guard: a copy from a mapping never kills the process --------------------
 *
 * A page of a mapping past the end of its file raises SIGBUS when the CPU touches it: a
 * file truncated (by anyone) while a copy from its window runs -- a CPU copy, as the host
 * vendor's stream workers and the emulators make (a DMA from the pinned pages does not
 * fault, it reads the pages the truncation dropped). Every mapped window is listed here,
 * and a SIGBUS handler (installed with the first window, in front of whatever handler was
 * there) maps anonymous zero pages over the window from the faulting page to its end and
 * returns: the copy goes on and reads zeros. The window is marked poisoned: fmap_plan and
 * phx_fmap_lookup drop it, and a request that copied from it counts only the bytes before
 * the poisoned page less one page (the page holding the file's new end reads zeros past
 * it): fmap_req_copied. A fault elsewhere is not ours: the handler steps aside (restores
 * the previous action) and the access repeats into it. Async-signal-safe: the handler
 * reads atomics and calls mmap and sigaction. Only contexts whose vendor copies with the
 * CPU (PHX_CFG_CPU_COPIES: test doubles) list windows and install the handler: hardware
 * copies are DMAs, and an application's own SIGBUS handling is left alone there. */
#define FG_SLOTS 65536u /* mapped windows at most (128 GiB of 2 MiB windows); more are not registered */
struct fg_slot {
    _Atomic uintptr_t lo, hi;  /* the mapping [lo, hi); lo 0: free */
    _Atomic uintptr_t poison;  /* lowest page zero-mapped by the handler; 0: none */
};
static _Atomic(struct fg_slot *) fg_tab;     /* FG_SLOTS, made once, never freed */
static pthread_mutex_t fg_mu = PTHREAD_MUTEX_INITIALIZER; /* slot writers; installing */
static _Atomic int64_t fg_poisoned;          /* live poisoned slots: 0 skips every check */
static _Atomic int fg_stepped;               /* stepped aside for a fault not ours */
static struct sigaction fg_prev;             /* the action before ours */
static uintptr_t fg_page;

static unsigned fg_hash(uintptr_t a) { return (unsigned)(((uint64_t)a * 0x9e3779b97f4a7c15ull) >> 48) % FG_SLOTS; }

static void fg_handler(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    struct fg_slot *t = atomic_load_explicit(&fg_tab, memory_order_acquire);
    if (si && si->si_code > 0 && t && !atomic_load(&fg_stepped)) { /* a fault, not a kill() */
        uintptr_t a = (uintptr_t)si->si_addr;
        for (unsigned i = 0; i < FG_SLOTS; i++) {
            uintptr_t lo = atomic_load_explicit(&t[i].lo, memory_order_acquire);
            if (!lo || a < lo || a >= atomic_load_explicit(&t[i].hi, memory_order_acquire))
                continue;
            uintptr_t page = a & ~(fg_page - 1), hi = atomic_load(&t[i].hi);
            if (mmap((void *)page, hi - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
                MAP_FAILED)
                break;
            uintptr_t cur = atomic_load(&t[i].poison);
            while ((!cur || page < cur) && !atomic_compare_exchange_weak(&t[i].poison, &cur, page))
                ;
            if (!cur)
                atomic_fetch_add(&fg_poisoned, 1);
            return;
        }
    }
    /* not ours: the previous action takes it (the faulting access repeats into it, a
     * kill() is sent again); once only, so that two handlers that each took the other
     * for the previous one cannot pass a fault back and forth */
    if (atomic_exchange(&fg_stepped, 1)) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
    } else {
        sigaction(sig, &fg_prev, NULL);
    }
    if (!si || si->si_code <= 0)
        raise(sig);
}

/* Ours in front (fg_mu held): again whenever another handler took SIGBUS since (Python's
 * faulthandler.enable()); that one becomes the previous. */
static void fg_install_locked(void)
{
    struct sigaction cur, sa;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == fg_handler)
        return;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = fg_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    fg_prev = cur;
    atomic_store(&fg_stepped, 0);
    sigaction(SIGBUS, &sa, NULL);
}

/* Before a hit copies: the handler is still ours. */
static void fg_ensure(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == fg_handler)
        return;
    pthread_mutex_lock(&fg_mu);
    fg_install_locked();
    pthread_mutex_unlock(&fg_mu);
}

/* List a mapping (before any copy can read it); -ENOSPC when the table is full. */
static int fg_add(char *addr, uint64_t len)
{
    pthread_mutex_lock(&fg_mu);
    struct fg_slot *t = atomic_load(&fg_tab);
    if (!t) {
        void *p = mmap(NULL, FG_SLOTS * sizeof(*t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            pthread_mutex_unlock(&fg_mu);
            return -ENOMEM;
        }
        fg_page = (uintptr_t)sysconf(_SC_PAGESIZE);
        t = p;
        atomic_store_explicit(&fg_tab, t, memory_order_release);
    }
    fg_install_locked();
    int rc = -ENOSPC;
    for (unsigned k = 0, i = fg_hash((uintptr_t)addr); k < FG_SLOTS; k++, i = (i + 1) % FG_SLOTS) {
        if (atomic_load(&t[i].lo))
            continue;
        atomic_store(&t[i].poison, 0);
        atomic_store(&t[i].hi, (uintptr_t)addr + len);
        atomic_store_explicit(&t[i].lo, (uintptr_t)addr, memory_order_release);
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&fg_mu);
    return rc;
}

/* The slot of a listed mapping (probing from its hash: fg_add put it at the first free
 * slot from there, and it stays until fg_remove). */
static struct fg_slot *fg_find(const char *addr)
{
    struct fg_slot *t = atomic_load_explicit(&fg_tab, memory_order_acquire);
    for (unsigned k = 0, i = fg_hash((uintptr_t)addr); t && k < FG_SLOTS; k++, i = (i + 1) % FG_SLOTS)
        if (atomic_load_explicit(&t[i].lo, memory_order_acquire) == (uintptr_t)addr)
            return &t[i];
    return NULL;
}

/* Unlist a mapping, before it is unmapped (the handler must never map over an address
 * that may be reused). */
static void fg_remove(char *addr)
{
    pthread_mutex_lock(&fg_mu);
    struct fg_slot *sl = fg_find(addr);
    if (sl) {
        atomic_store(&sl->lo, 0);
        atomic_store(&sl->hi, 0);
        if (atomic_exchange(&sl->poison, 0))
            atomic_fetch_sub(&fg_poisoned, 1);
    }
    pthread_mutex_unlock(&fg_mu);
}

/* The file offset from which bytes copied from a READY window may not be the file's (the
 * handler zero-mapped them; one page early: see above), or INT64_MAX. */
static int64_t fg_valid_end(const struct io_fwin *w)
{
    if (!atomic_load_explicit(&fg_poisoned, memory_order_acquire) || !w->addr)
        return INT64_MAX;
    struct fg_slot *sl = fg_find(w->addr);
    uintptr_t p = sl ? atomic_load(&sl->poison) : 0;
    if (!p)
        return INT64_MAX;
    /* (a page before the window when p is its first: that page, the previous window's
     * last, may be the one holding the file's new end) */
    return w->off + (int64_t)(p - (uintptr_t)w->addr) - (int64_t)fg_page;
}

static unsigned hkey(uint64_t dev, uint64_t ino, int64_t off)
{
    uint64_t h = dev * 0x9e3779b97f4a7c15ull ^ ino * 0xc2b2ae3d27d4eb4full ^ (uint64_t)off * 0x165667b19e3779f9ull;
    return (unsigned)((h >> 29) % FMAP_HASH);
}

static struct io_fwin *find_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, int64_t off)
{
    for (struct io_fwin *w = m->hash[hkey(dev, ino, off)]; w; w = w->hnext)
        if (w->dev == dev && w->ino == ino && w->off == off)
            return w;
    return NULL;
}

static void hash_insert_locked(struct io_fmap *m, struct io_fwin *w)
{
    unsigned k = hkey(w->dev, w->ino, w->off);
    w->hnext = m->hash[k];
    m->hash[k] = w;
    w->hashed = 1;
}

static void hash_remove_locked(struct io_fmap *m, struct io_fwin *w)
{
    struct io_fwin **pp = &m->hash[hkey(w->dev, w->ino, w->off)];
    for (; *pp; pp = &(*pp)->hnext) {
        if (*pp == w) {
            *pp = w->hnext;
            break;
        }
    }
    w->hnext = NULL;
    w->hashed = 0;
}

static void lru_remove_locked(struct io_fwin *w)
{
    if (!w->lprev)
        return;
    w->lprev->lnext = w->lnext;
    w->lnext->lprev = w->lprev;
    w->lprev = w->lnext = NULL;
}

static void lru_front_locked(struct io_fmap *m, struct io_fwin *w)
{
    lru_remove_locked(w);
    w->lnext = m->lru.lnext;
    w->lprev = &m->lru;
    m->lru.lnext->lprev = w;
    m->lru.lnext = w;
}

/* Release a window nobody can reach any more: unregister, unmap, free. No mutex held. */
static void fwin_release(phx_ctx *ctx, struct io_fwin *w)
{
    if (w->state == FW_READY && w->addr) {
        if (ctx->dp.host_unregister)
            ctx->dp.host_unregister(w->addr);
        fg_remove(w->addr);
        munmap(w->addr, w->len);
    }
    if (w->fd >= 0)
        close(w->fd);
    free(w);
}

static void release_list(phx_ctx *ctx, struct io_fwin *list)
{
    while (list) {
        struct io_fwin *next = list->qnext;
        fwin_release(ctx, list);
        list = next;
    }
}

/* Unhook w from the cache (fmap mu held). READY windows leave the counters now; one
 * still in use is released by its last fmap_unref. Returns w when the caller must
 * release it (after unlocking), else NULL. A PENDING window is only unhooked: the
 * registrar (which owns it while queued or busy with it) sees !hashed and discards it. */
static struct io_fwin *drop_locked(struct io_fmap *m, struct io_fwin *w)
{
    if (w->hashed)
        hash_remove_locked(m, w);
    if (w->state == FW_READY) {
        lru_remove_locked(w);
        m->windows--;
        m->bytes -= w->len;
        STAT_ADD(fmap_windows, -1);
        STAT_ADD(fmap_bytes, -(int64_t)w->len);
        return w->refs == 0 ? w : NULL;
    }
    if (w->state == FW_UNREG) {
        m->unregistrable--;
        return w;
    }
    return NULL; /* PENDING */
}

static unsigned wkey(uint64_t dev, uint64_t ino)
{
    return (unsigned)(((dev * 0x9e3779b97f4a7c15ull) ^ (ino * 0xc2b2ae3d27d4eb4full)) >> 40) % FMAP_WHASH;
}

static struct io_fwrite *wfind_locked(struct io_fmap *m, uint64_t dev, uint64_t ino)
{
    for (struct io_fwrite *e = m->wtab[wkey(dev, ino)]; e; e = e->next)
        if (e->dev == dev && e->ino == ino)
            return e;
    return NULL;
}

/* Forget inodes with no write in flight (only while no registration is in progress:
 * one that started before the write must still see it). */
static void wprune_locked(struct io_fmap *m)
{
    for (int k = 0; k < FMAP_WHASH; k++) {
        struct io_fwrite **pp = &m->wtab[k];
        while (*pp) {
            struct io_fwrite *x = *pp;
            if (x->writes == 0) {
                *pp = x->next;
                free(x);
            } else {
                pp = &x->next;
            }
        }
    }
}

/* Has a phoenix write of the inode run since gen0 (or is one running)? */
static int written_since_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, uint64_t gen0)
{
    struct io_fwrite *e = wfind_locked(m, dev, ino);
    return e && (e->writes > 0 || e->gen > gen0);
}

static int snapshot_matches(const struct io_fwin *w, const struct stat *st)
{
    return w->fsize == (int64_t)st->st_size && w->mtime_ns == ts_ns(st->st_mtim) && w->ctime_ns == ts_ns(st->st_ctim);
}

/* Is [off, off+len) of fd mostly (7/8) in the page cache? Where cachestat is refused
 * (Linux < 6.5, seccomp) the answer is yes: the window was just read, so it is cached
 * unless the read was O_DIRECT, and then MAP_POPULATE reads it once in the background. */
static int resident(int fd, int64_t off, uint64_t len)
{
    struct fm_cachestat_range range = {(uint64_t)off, len};
    struct fm_cachestat cs;
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) < 0)
        return 1;
    uint64_t pages = (len + 4095) / 4096;
    return cs.nr_cache * 8 >= pages * 7;
}

/* resident() on the submit path: cachestat walks the page cache's index page by page
 * (~9 ms per GiB on the H200 VM's tmpfs), which for an 8 GiB first read cost more than a
 * third of its time. A large range is judged from 8 evenly spread 1 MiB samples (all must
 * be resident); the registrar checks the whole window before it maps it. */
#define FMAP_SAMPLE (1ull << 20)
static int resident_sampled(int fd, int64_t off, uint64_t len)
{
    if (len <= 32 * FMAP_SAMPLE)
        return resident(fd, off, len);
    uint64_t step = (len - FMAP_SAMPLE) / 7;
    for (int i = 0; i < 8; i++)
        if (!resident(fd, off + (int64_t)(step * (uint64_t)i), FMAP_SAMPLE))
            return 0;
    return 1;
}

/* ---- registration (registrar thread, or the submitter in SYNC mode) ------------------- */

/* Evict least recently used windows nobody uses until len more bytes fit (mu held);
 * returns them, to be released after unlocking. */
static struct io_fwin *make_room_locked(struct io_fmap *m, uint64_t len)
{
    struct io_fwin *evicted = NULL, *v = m->lru.lprev;
    while (m->bytes + m->reserved + len > m->budget && v != &m->lru) {
        struct io_fwin *prev = v->lprev;
        if (v->refs == 0) {
            drop_locked(m, v);
            v->qnext = evicted;
            evicted = v;
            m->evictions++;
        }
        v = prev;
    }
    return evicted;
}

/* Map and register w (PENDING, owned by the caller, not under mu), then publish it.
 * Outcomes: READY in the cache; UNREG (the vendor refused it: never retried); or
 * discarded (dropped meanwhile, a write raced it, the file changed, or no room). */
static void fwin_register(phx_ctx *ctx, struct io_fwin *w)
{
    struct io_fmap *m = &ctx->fmap;
    const struct phx_dp_table *dp = &ctx->dp;
    int ok = 0, refused = 0;
    char *addr = NULL;
    struct io_fwin *evicted = NULL, *discard = NULL;
    pthread_mutex_lock(&m->mu);
    uint64_t gen0 = m->wgen;
    int writing = written_since_locked(m, w->dev, w->ino, gen0);
    m->regs_active++;
    /* room first (the budget holds while registering): least recently used windows go,
     * skipping those in use */
    int room = 0;
    /* (the submitter judged residency from samples; MAP_POPULATE of pages that are not
     * cached would read them from the disk, beside the application's reads) */
    int check = !writing && w->hashed;
    pthread_mutex_unlock(&m->mu);
    int cached = check && resident(w->fd, w->off, w->len);
    pthread_mutex_lock(&m->mu);
    if (check && cached && w->hashed) {
        evicted = make_room_locked(m, w->len);
        room = m->bytes + m->reserved + w->len <= m->budget;
        if (room)
            m->reserved += w->len;
    }
    pthread_mutex_unlock(&m->mu);
    release_list(ctx, evicted);
    evicted = NULL;
    /* the file must still be the one snapshotted: a window of a file that shrank since
     * would map pages past its end (a vendor pinning them refuses: not "unregistrable") */
    struct stat st;
    int same = fstat(w->fd, &st) == 0 && snapshot_matches(w, &st);
    if (room && same) {
        void *p = mmap(NULL, w->len, PROT_READ, MAP_SHARED | MAP_POPULATE, w->fd, w->off);
        if (p == MAP_FAILED) {
            refused = 1;
        } else {
            addr = p;
            /* the registrar's own thread takes the request's device; a submitter (SYNC)
             * keeps its current device (the flags' "portable" covers every device) */
            if (w->device >= 0 && in_registrar)
                dp->set_device(w->device);
            int rc = dp->host_register(addr, w->len, m->flags);
            if (rc != dp->success && (m->flags & FW_READONLY_FLAG))
                rc = dp->host_register(addr, w->len, m->flags & ~FW_READONLY_FLAG);
            if (rc != dp->success) {
                refused = 1;
                munmap(addr, w->len);
                addr = NULL;
            } else {
                ok = 1;
            }
        }
        /* still the same file, and no phoenix write may have run meanwhile (checked
         * below: an O_DIRECT write cannot invalidate pinned page-cache pages) */
        same = fstat(w->fd, &st) == 0 && snapshot_matches(w, &st);
        if (!same)
            ok = refused = 0;
        /* listed for the fault guard before any copy can read it */
        if (ok && (ctx->cfg.flags & PHX_CFG_CPU_COPIES) && fg_add(addr, w->len) < 0) {
            ok = 0;
            dp->host_unregister(addr);
            munmap(addr, w->len);
            addr = NULL;
        }
    }
    close(w->fd);
    w->fd = -1;
    pthread_mutex_lock(&m->mu);
    m->pending--;
    m->regs_active--;
    if (room)
        m->reserved -= w->len;
    if (ok && written_since_locked(m, w->dev, w->ino, gen0))
        ok = 0;
    if (m->regs_active == 0)
        wprune_locked(m);
    if (!w->hashed) {
        discard = w; /* dropped while we worked */
    } else if (!ok && refused) {
        w->state = FW_UNREG;
        m->unregistrable++;
    } else if (!ok) {
        hash_remove_locked(m, w);
        discard = w;
    } else {
        evicted = make_room_locked(m, w->len);
        if (m->bytes + m->reserved + w->len > m->budget) {
            hash_remove_locked(m, w);
            discard = w;
        } else {
            w->addr = addr;
            addr = NULL;
            w->state = FW_READY;
            lru_front_locked(m, w);
            m->windows++;
            m->bytes += w->len;
            m->registrations++;
            STAT_ADD(fmap_windows, 1);
            STAT_ADD(fmap_bytes, (int64_t)w->len);
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (addr) {
        dp->host_unregister(addr);
        fg_remove(addr);
        munmap(addr, w->len);
    }
    if (discard)
        free(discard);
    release_list(ctx, evicted);
}

/* Before each registration or release the registrar waits, up to FMAP_IDLE_WAIT_NS, for the
 * context to have no request or stream op in flight. Two reasons, both measured on CUDA:
 * page-locking (cudaHostRegister/Unregister) competes with a first warm read for the memory
 * bus and the page tables (the first read ran at a third of the staged rate beside it), and
 * it can take a driver lock that other runtime calls of the application then wait for while
 * a stream is busy. Registering "between rounds", when the context is idle, avoids both; the
 * cap keeps a context that is never idle from never registering. */
#define FMAP_IDLE_WAIT_NS (2000000000ll)

/* The CLOCK_REALTIME time `ns` from now: a deadline for pthread_cond_timedwait (the
 * condition variables here wait on CLOCK_REALTIME). */
static struct timespec realtime_in(int64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t nsec = (int64_t)ts.tv_nsec + ns % 1000000000ll;
    ts.tv_sec += (time_t)(ns / 1000000000ll + nsec / 1000000000ll);
    ts.tv_nsec = (long)(nsec % 1000000000ll);
    return ts;
}

/* Idle means idle for FMAP_QUIET_NS in a row: a miss queues its windows while its own
 * request is still being built, before it counts as in flight, and the registrar woke to
 * an "idle" context and page-locked a 1 GiB window beside that first read (on the H200 it
 * cost the first warm read ~13 %). */
#define FMAP_QUIET_NS (10000000ll)

static void wait_ctx_idle(phx_ctx *ctx)
{
    struct timespec dl = realtime_in(FMAP_IDLE_WAIT_NS);
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        int timed_out = 0;
        while (ctx->inflight > 0 && !atomic_load(&ctx->stop))
            if (pthread_cond_timedwait(&ctx->cv, &ctx->mu, &dl) == ETIMEDOUT) {
                timed_out = 1;
                break;
            }
        if (timed_out || atomic_load(&ctx->stop))
            break;
        pthread_mutex_unlock(&ctx->mu);
        struct timespec q = {0, FMAP_QUIET_NS};
        nanosleep(&q, NULL);
        pthread_mutex_lock(&ctx->mu);
        if (ctx->inflight == 0)
            break; /* quiet */
    }
    pthread_mutex_unlock(&ctx->mu);
}

static void *registrar_main(void *arg)
{
    pthread_setname_np(pthread_self(), "phx-fmap");
    phx_ctx *ctx = arg;
    struct io_fmap *m = &ctx->fmap;
    /* low priority: the first read runs meanwhile on the workers */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    in_registrar = 1;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        if (m->release) {
            struct io_fwin *list = m->release;
            m->release = NULL;
            pthread_mutex_unlock(&m->mu);
            wait_ctx_idle(ctx);
            release_list(ctx, list);
            pthread_mutex_lock(&m->mu);
            continue;
        }
        if (m->stop)
            break;
        struct io_fwin *w = m->q_head;
        if (!w) {
            pthread_cond_broadcast(&m->idle_cv);
            pthread_cond_wait(&m->cv, &m->mu);
            continue;
        }
        m->q_head = w->qnext;
        if (!m->q_head)
            m->q_tail = NULL;
        w->qnext = NULL;
        m->busy = 1;
        pthread_mutex_unlock(&m->mu);
        wait_ctx_idle(ctx);
        fwin_register(ctx, w);
        pthread_mutex_lock(&m->mu);
        m->busy = 0;
    }
    pthread_cond_broadcast(&m->idle_cv);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* Start the registrar (fmap mu held). */
static void registrar_start_locked(phx_ctx *ctx)
{
    struct io_fmap *m = &ctx->fmap;
    if (m->started)
        return;
    if (pthread_create(&m->th, NULL, registrar_main, ctx) == 0) {
        m->started = 1; /* (not in the threads counter: that counts the workers) */
    }
}

/* ---- context ---------------------------------------------------------------------------- */

void fmap_init(phx_ctx *ctx)
{
    struct io_fmap *m = &ctx->fmap;
    memset(m, 0, sizeof(*m));
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    pthread_cond_init(&m->idle_cv, NULL);
    m->lru.lnext = m->lru.lprev = &m->lru;
    m->budget = ctx->cfg.fmap_budget;
    m->window = ctx->cfg.fmap_window;
    m->flags = ctx->cfg.fmap_register_flags;
    m->mode = ctx->cfg.fmap_mode;
    if (m->mode == PHX_FMAP_OFF)
        snprintf(m->why, sizeof(m->why), "off (PHX_FMAP_MODE=off)");
    else if (!m->budget)
        snprintf(m->why, sizeof(m->why), "off (PHX_FMAP_CACHE=0)");
    else if (!ctx->has_dp || !ctx->dp.host_register || !ctx->dp.host_unregister)
        snprintf(m->why, sizeof(m->why), "off: the vendor's data path has no host_register/host_unregister");
    else if (m->window < (2u << 20) || m->window % (2u << 20))
        snprintf(m->why, sizeof(m->why), "off: PHX_FMAP_WINDOW=%llu is not a multiple of 2 MiB",
                 (unsigned long long)m->window);
    else if (m->mode != PHX_FMAP_AUTO && m->mode != PHX_FMAP_SYNC)
        snprintf(m->why, sizeof(m->why), "off: unknown mode %d", m->mode);
    else
        m->why[0] = 0;
    if (m->why[0])
        m->mode = PHX_FMAP_OFF;
}

static int clear_locked_and_release(phx_ctx *ctx, int stop)
{
    struct io_fmap *m = &ctx->fmap;
    struct io_fwin *rel = NULL;
    int n = 0;
    pthread_mutex_lock(&m->mu);
    /* the queue first (the registrar owns the window it is working on) */
    while (m->q_head) {
        struct io_fwin *w = m->q_head;
        m->q_head = w->qnext;
        if (w->hashed)
            hash_remove_locked(m, w);
        m->pending--;
        w->state = FW_UNREG; /* nothing mapped: fwin_release only closes its fd */
        w->qnext = rel;
        rel = w;
    }
    m->q_tail = NULL;
    if (stop)
        m->stop = 1;
    pthread_cond_broadcast(&m->cv);
    while (m->busy)
        pthread_cond_wait(&m->idle_cv, &m->mu);
    for (int k = 0; k < FMAP_HASH; k++) {
        while (m->hash[k]) {
            struct io_fwin *w = m->hash[k];
            if (w->state == FW_READY)
                n++;
            struct io_fwin *r = drop_locked(m, w);
            if (r) {
                r->qnext = rel;
                rel = r;
            }
        }
    }
    while (m->release) {
        struct io_fwin *w = m->release;
        m->release = w->qnext;
        w->qnext = rel;
        rel = w;
    }
    pthread_mutex_unlock(&m->mu);
    release_list(ctx, rel);
    return n;
}

void fmap_fini(phx_ctx *ctx)
{
    struct io_fmap *m = &ctx->fmap;
    clear_locked_and_release(ctx, 1);
    if (m->started) {
        pthread_join(m->th, NULL);
        m->started = 0;
    }
    /* windows dropped by the registrar's last release pass are gone; nothing in use:
     * the context has drained its requests */
    release_list(ctx, m->release);
    m->release = NULL;
    for (int k = 0; k < FMAP_WHASH; k++) {
        while (m->wtab[k]) {
            struct io_fwrite *e = m->wtab[k];
            m->wtab[k] = e->next;
            free(e);
        }
    }
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    pthread_cond_destroy(&m->idle_cv);
}

/* ---- requests ------------------------------------------------------------------------------ */

/* Queue or (SYNC) register the missing windows of [first, last] that are resident. */
static void fill_misses(phx_ctx *ctx, phx_file *f, const struct stat *st, int64_t first, int64_t last, int device,
                        int sync)
{
    struct io_fmap *m = &ctx->fmap;
    uint64_t W = m->window;
    int64_t span_end = (int64_t)align_up((uint64_t)st->st_size, 4096);
    for (int64_t idx = first; idx <= last; idx++) {
        int64_t off = idx * (int64_t)W;
        pthread_mutex_lock(&m->mu);
        struct io_fwrite *e = wfind_locked(m, f->st_dev, f->st_ino);
        int have = find_locked(m, f->st_dev, f->st_ino, off) != NULL || (e && e->writes > 0);
        pthread_mutex_unlock(&m->mu);
        if (have)
            continue;
        uint64_t len = (uint64_t)(span_end - off) < W ? (uint64_t)(span_end - off) : W;
        if (len > m->budget || !resident_sampled(f->fd_buf, off, len))
            continue;
        struct io_fwin *w = calloc(1, sizeof(*w));
        if (!w)
            return;
        w->dev = f->st_dev;
        w->ino = f->st_ino;
        w->off = off;
        w->len = len;
        w->fsize = (int64_t)st->st_size;
        w->mtime_ns = ts_ns(st->st_mtim);
        w->ctime_ns = ts_ns(st->st_ctim);
        w->device = device;
        w->state = FW_PENDING;
        w->fd = fcntl(f->fd_buf, F_DUPFD_CLOEXEC, 0);
        if (w->fd < 0) {
            free(w);
            return;
        }
        pthread_mutex_lock(&m->mu);
        if (find_locked(m, w->dev, w->ino, w->off) || m->stop) {
            pthread_mutex_unlock(&m->mu);
            close(w->fd);
            free(w);
            continue;
        }
        hash_insert_locked(m, w);
        m->pending++;
        if (!sync) {
            if (m->q_tail)
                m->q_tail->qnext = w;
            else
                m->q_head = w;
            m->q_tail = w;
            registrar_start_locked(ctx);
            pthread_cond_signal(&m->cv);
        }
        pthread_mutex_unlock(&m->mu);
        if (sync)
            fwin_register(ctx, w);
    }
}

/* Is the request's own range cached (a cheap probe: only its pages)? Cold reads (the
 * disk benchmarks, random reads) stop asking after 8 misses in a row, then ask for one
 * miss in 32, as the O_DIRECT page-cache probe does. */
static int probe_request(phx_file *f, int64_t off, uint64_t len)
{
    if (atomic_load_explicit(&f->fmap_cold, memory_order_relaxed) >= 8 &&
        (atomic_fetch_add_explicit(&f->fmap_tick, 1, memory_order_relaxed) & 31) != 0)
        return 0;
    if (resident_sampled(f->fd_buf, off, len)) {
        atomic_store_explicit(&f->fmap_cold, 0, memory_order_relaxed);
        return 1;
    }
    atomic_fetch_add_explicit(&f->fmap_cold, 1, memory_order_relaxed);
    return 0;
}

int fmap_plan(phx_ctx *ctx, phx_file *f, const struct phx_io_desc *d, struct fmap_plan *p)
{
    struct io_fmap *m = &ctx->fmap;
    memset(p, 0, sizeof(*p));
    if (m->mode == PHX_FMAP_OFF || !f->fmap_ok || atomic_load_explicit(&f->fault_err, memory_order_relaxed))
        return 0;
    struct stat st;
    if (fstat(f->fd_buf, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_dev != f->st_dev ||
        (uint64_t)st.st_ino != f->st_ino)
        return 0;
    int64_t end = d->file_offset + (int64_t)d->size;
    int64_t eff = end < (int64_t)st.st_size ? end : (int64_t)st.st_size;
    if (d->file_offset >= eff)
        return 0; /* all past the end of the file: the staged path says so */
    uint64_t W = m->window;
    int64_t first = d->file_offset / (int64_t)W, last = (eff - 1) / (int64_t)W;
    int n = (int)(last - first + 1);
    struct io_fwin *stack[8], **wins = n <= 8 ? stack : malloc((size_t)n * sizeof(*wins));
    if (!wins)
        return 0;
    for (int attempt = 0;; attempt++) {
        int all = 1;
        struct io_fwin *rel = NULL;
        pthread_mutex_lock(&m->mu);
        for (int i = 0; i < n; i++) {
            struct io_fwin *w = find_locked(m, f->st_dev, f->st_ino, (first + i) * (int64_t)W);
            if (w && w->state != FW_PENDING && (!snapshot_matches(w, &st) || fg_valid_end(w) != INT64_MAX)) {
                m->invalidations++;
                struct io_fwin *r = drop_locked(m, w); /* the file changed (or shrank under a copy): drop */
                if (r) {
                    r->qnext = rel;
                    rel = r;
                }
                w = NULL;
            }
            wins[i] = w;
            if (!w || w->state != FW_READY)
                all = 0;
        }
        if (all) {
            for (int i = 0; i < n; i++) {
                if (wins[i]->refs++ == 0)
                    m->in_use++;
                lru_front_locked(m, wins[i]);
            }
            m->hits++;
        }
        pthread_mutex_unlock(&m->mu);
        release_list(ctx, rel);
        if (all) {
            if (wins == stack) {
                wins = malloc((size_t)n * sizeof(*wins));
                if (!wins) {
                    for (int i = 0; i < n; i++)
                        fmap_unref(ctx, stack[i]);
                    pthread_mutex_lock(&m->mu);
                    m->hits--;
                    pthread_mutex_unlock(&m->mu);
                    return 0;
                }
                memcpy(wins, stack, (size_t)n * sizeof(*wins));
            }
            STAT_ADD(fmap_hits, 1);
            if (ctx->cfg.flags & PHX_CFG_CPU_COPIES)
                fg_ensure(); /* the (CPU) copies about to run are guarded */
            p->wins = wins;
            p->nwins = n;
            p->fsize = (int64_t)st.st_size;
            /* pieces: per window, FMAP_PIECE bytes at most */
            uint32_t nch = 0;
            for (int i = 0; i < n; i++) {
                int64_t a = wins[i]->off > d->file_offset ? wins[i]->off : d->file_offset;
                int64_t b = wins[i]->off + (int64_t)wins[i]->len < eff ? wins[i]->off + (int64_t)wins[i]->len : eff;
                nch += (uint32_t)(((uint64_t)(b - a) + FMAP_PIECE - 1) / FMAP_PIECE);
            }
            if (end > eff)
                nch++; /* past the end of the file: a piece that copies nothing */
            p->nchunks = nch;
            return 1;
        }
        if (attempt == 0 && probe_request(f, d->file_offset, (uint64_t)(eff - d->file_offset))) {
            p->resident = 1;
            fill_misses(ctx, f, &st, first, last, d->device, m->mode == PHX_FMAP_SYNC);
        }
        if (attempt > 0 || m->mode != PHX_FMAP_SYNC)
            break;
    }
    if (wins != stack)
        free(wins);
    pthread_mutex_lock(&m->mu);
    m->misses++;
    pthread_mutex_unlock(&m->mu);
    STAT_ADD(fmap_misses, 1);
    return 0;
}

void fmap_fill(phx_ctx *ctx, struct fmap_plan *p, phx_req *r)
{
    struct io_fmap *m = &ctx->fmap;
    int64_t end = r->foff + (int64_t)r->size;
    int64_t eff = end < p->fsize ? end : p->fsize;
    uint32_t c = 0;
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < p->nwins; i++) {
        struct io_fwin *w = p->wins[i];
        int64_t a = w->off > r->foff ? w->off : r->foff;
        int64_t b = w->off + (int64_t)w->len < eff ? w->off + (int64_t)w->len : eff;
        while (a < b) {
            int64_t nb = b - a > (int64_t)FMAP_PIECE ? a + (int64_t)FMAP_PIECE : b;
            struct io_chunk *ch = &r->chunks[c++];
            ch->req = r;
            ch->foff = a;
            ch->len = (uint64_t)(nb - a);
            ch->got = ch->len;
            ch->user = r->addr + (a - r->foff);
            ch->path = CH_FMAP;
            ch->win = w;
            w->refs++;
            a = nb;
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (end > eff) {
        struct io_chunk *ch = &r->chunks[c++];
        ch->req = r;
        ch->foff = eff;
        ch->len = (uint64_t)(end - eff);
        ch->got = 0;
        ch->user = r->addr + (eff - r->foff);
        ch->path = CH_FMAP;
    }
    fmap_plan_drop(ctx, p); /* the plan's own references */
}

void fmap_plan_drop(phx_ctx *ctx, struct fmap_plan *p)
{
    for (int i = 0; i < p->nwins; i++)
        fmap_unref(ctx, p->wins[i]);
    free(p->wins);
    p->wins = NULL;
    p->nwins = 0;
}

void fmap_unref(phx_ctx *ctx, struct io_fwin *w)
{
    struct io_fmap *m = &ctx->fmap;
    pthread_mutex_lock(&m->mu);
    if (--w->refs == 0) {
        m->in_use--;
        if (!w->hashed) { /* dropped while in use: the registrar releases it */
            w->qnext = m->release;
            m->release = w;
            registrar_start_locked(ctx);
            pthread_cond_signal(&m->cv);
        }
    }
    pthread_mutex_unlock(&m->mu);
}

/* A hit's copies have run (stream callback: no vendor call). A piece counts only bytes
 * the file held: the count stops where the fault guard zero-mapped a window under the
 * copy (less a page: fg_valid_end) and at the file's size now (a file cut short under a
 * DMA from pinned pages reads the dropped pages: bytes it held when the read began, but
 * past its end now). Then the pieces' window references go. Called by cb_fmap_copied
 * before it sums the pieces' counts. */
void fmap_req_copied(phx_ctx *ctx, phx_req *r)
{
    int64_t valid = INT64_MAX;
    int any = 0;
    for (uint32_t i = 0; i < r->nchunks; i++) {
        const struct io_chunk *ch = &r->chunks[i];
        if (!ch->win)
            continue;
        any = 1;
        int64_t v = fg_valid_end(ch->win);
        if (v < valid)
            valid = v;
    }
    struct stat st;
    if (any && fstat(r->file->fd_buf, &st) == 0 && (int64_t)st.st_size < valid)
        valid = (int64_t)st.st_size;
    for (uint32_t i = 0; i < r->nchunks; i++) {
        struct io_chunk *ch = &r->chunks[i];
        if (ch->foff + (int64_t)ch->got > valid)
            ch->got = valid > ch->foff ? (uint64_t)(valid - ch->foff) : 0;
        if (ch->win) {
            fmap_unref(ctx, ch->win);
            ch->win = NULL;
        }
    }
}

/* A write through a file not open for writing fails (EBADF) and changes nothing: it
 * neither drops windows nor holds registrations back (fmap_write_end skips it alike). */
void fmap_write_begin(phx_ctx *ctx, phx_file *f, int64_t off, uint64_t len)
{
    struct io_fmap *m = &ctx->fmap;
    if (m->mode == PHX_FMAP_OFF || !(f->flags & PHX_F_WRITE))
        return;
    uint64_t W = m->window;
    int64_t first = off / (int64_t)W, last = (off + (int64_t)(len ? len : 1) - 1) / (int64_t)W;
    struct io_fwin *rel = NULL;
    pthread_mutex_lock(&m->mu);
    struct io_fwrite *e = wfind_locked(m, f->st_dev, f->st_ino);
    if (!e && (e = calloc(1, sizeof(*e)))) {
        unsigned k = wkey(f->st_dev, f->st_ino);
        e->dev = f->st_dev;
        e->ino = f->st_ino;
        e->next = m->wtab[k];
        m->wtab[k] = e;
    }
    m->wgen++;
    if (e) {
        e->writes++;
        e->gen = m->wgen;
    }
    if (m->windows + m->pending + m->unregistrable > 0) {
        for (int64_t idx = first; idx <= last; idx++) {
            struct io_fwin *w = find_locked(m, f->st_dev, f->st_ino, idx * (int64_t)W);
            if (!w)
                continue;
            m->invalidations++;
            struct io_fwin *r = drop_locked(m, w);
            if (r) {
                r->qnext = rel;
                rel = r;
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    /* unregistered here, before the write is queued: an O_DIRECT write must find the
     * page-cache pages unpinned to invalidate them */
    release_list(ctx, rel);
}

void fmap_write_end(phx_ctx *ctx, phx_file *f)
{
    struct io_fmap *m = &ctx->fmap;
    if (m->mode == PHX_FMAP_OFF || !(f->flags & PHX_F_WRITE))
        return;
    pthread_mutex_lock(&m->mu);
    struct io_fwrite *e = wfind_locked(m, f->st_dev, f->st_ino);
    if (e && e->writes > 0)
        e->writes--;
    if (m->regs_active == 0) {
        /* nobody needs the history: forget idle inodes of this bucket */
        struct io_fwrite **pp = &m->wtab[wkey(f->st_dev, f->st_ino)];
        while (*pp) {
            struct io_fwrite *x = *pp;
            if (x->writes == 0) {
                *pp = x->next;
                free(x);
            } else {
                pp = &x->next;
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
}

/* ---- control plane -------------------------------------------------------------------------- */

int phx_fmap_query(phx_ctx *ctx, struct phx_fmap_info *o)
{
    if (!ctx || !o)
        return -EINVAL;
    struct io_fmap *m = &ctx->fmap;
    memset(o, 0, sizeof(*o));
    pthread_mutex_lock(&m->mu);
    o->mode = m->mode;
    o->register_flags = m->flags;
    o->budget = m->budget;
    o->window = m->window;
    o->windows = m->windows;
    o->bytes = (int64_t)m->bytes;
    o->pending = m->pending;
    o->unregistrable = m->unregistrable;
    o->in_use = m->in_use;
    o->hits = m->hits;
    o->misses = m->misses;
    o->registrations = m->registrations;
    o->evictions = m->evictions;
    o->invalidations = m->invalidations;
    snprintf(o->why, sizeof(o->why), "%s", m->why);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

int phx_fmap_lookup(phx_ctx *ctx, phx_file *f, int64_t offset, uint64_t length, void **host_addr)
{
    if (host_addr)
        *host_addr = NULL;
    if (!ctx || !f || offset < 0)
        return -EINVAL;
    struct io_fmap *m = &ctx->fmap;
    if (m->mode == PHX_FMAP_OFF)
        return -ENOSYS;
    struct stat st;
    if (fstat(f->fd_buf, &st) != 0)
        return -errno;
    uint64_t W = m->window;
    int64_t off0 = offset / (int64_t)W * (int64_t)W;
    int rc = -ENOENT;
    pthread_mutex_lock(&m->mu);
    struct io_fwin *w = find_locked(m, f->st_dev, f->st_ino, off0);
    if (w && w->state == FW_READY && snapshot_matches(w, &st) && fg_valid_end(w) == INT64_MAX &&
        offset + (int64_t)length <= w->off + (int64_t)w->len) {
        if (host_addr)
            *host_addr = w->addr + (offset - w->off);
        rc = 0;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

int phx_fmap_wait(phx_ctx *ctx, int64_t timeout_ns)
{
    if (!ctx)
        return -EINVAL;
    struct io_fmap *m = &ctx->fmap;
    int64_t deadline = timeout_ns >= 0 ? mono_ns() + timeout_ns : 0;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    while (m->q_head || m->busy || m->release) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&m->idle_cv, &m->mu);
            continue;
        }
        /* the condition variable waits on CLOCK_REALTIME: wait in short steps */
        int64_t left = deadline - mono_ns();
        if (left <= 0) {
            rc = -ETIMEDOUT;
            break;
        }
        if (left > 10000000)
            left = 10000000;
        struct timespec ts = realtime_in(left);
        pthread_cond_timedwait(&m->idle_cv, &m->mu, &ts);
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

int phx_fmap_clear(phx_ctx *ctx)
{
    if (!ctx)
        return -EINVAL;
    return clear_locked_and_release(ctx, 0);
}
