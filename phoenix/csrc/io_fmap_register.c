/* Mapping and registering file windows: the registrar thread of the file-mapping cache.
 *
 * Core side, data path off the request path: one thread per context, started on first
 * need, nice 19, maps and registers queued windows one at a time and releases dropped
 * windows (host_unregister + munmap) whose last user was a stream callback. In
 * PHX_FMAP_SYNC mode the submitting thread registers its misses itself.
 *
 * The registration flags are the caller's (phx_io_config.fmap_register_flags); a refusal
 * is retried without the read-only bit the vendor's data-path table names
 * (host_register_read_only), then the window is marked unregistrable.
 */
#include "io_ctx.h"
#include "io_fmap.h"
#include "io_fork.h"
#include "io_sync.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static __thread int in_registrar; /* this thread is a registrar */

/* ---- registration (registrar thread, or the submitter in SYNC mode) ------------------- */

/* Evict least recently used windows nobody uses until len more bytes fit (mu held);
 * returns them, to be released after unlocking. The budget counts every registered byte:
 * cached windows, dropped ones still in use (draining) and registrations in progress. */
static struct io_fwin *make_room_locked(struct io_fmap *m, uint64_t len, uint64_t *freed)
{
    struct io_fwin *evicted = NULL, *v = m->lru.lprev;
    *freed = 0; /* evicted bytes: the caller releases them before it registers */
    while (m->bytes + m->draining - *freed + m->reserved + len > m->budget && v != &m->lru) {
        struct io_fwin *prev = v->lprev;
        if (v->refs == 0) {
            *freed += v->len;
            fmap_drop_locked(m, v);
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
void fmap_register_window(phx_ctx *ctx, struct io_fwin *w)
{
    struct io_fmap *m = &ctx->fmap;
    const struct phx_dp_table *dp = &ctx->dp;
    int ok = 0, refused = 0;
    char *addr = NULL;
    struct io_fwin *evicted = NULL, *discard = NULL;
    uint64_t freed = 0;
    pthread_mutex_lock(&m->mu);
    uint64_t gen0 = m->wgen;
    int writing = fmap_written_since_locked(m, w->dev, w->ino, gen0);
    m->regs_active++;
    /* room first (the budget holds while registering): least recently used windows go,
     * skipping those in use */
    int room = 0;
    /* (the submitter judged residency from samples; MAP_POPULATE of pages that are not
     * cached would read them from the disk, beside the application's reads) */
    int check = !writing && w->hashed;
    pthread_mutex_unlock(&m->mu);
    int cached = check && fmap_resident(w->fd, w->off, w->len);
    pthread_mutex_lock(&m->mu);
    if (check && cached && w->hashed) {
        evicted = make_room_locked(m, w->len, &freed);
        room = m->bytes + m->draining - freed + m->reserved + w->len <= m->budget;
        if (room)
            m->reserved += w->len;
    }
    pthread_mutex_unlock(&m->mu);
    fmap_release_list(ctx, evicted);
    evicted = NULL;
    /* the file must still be the one snapshotted: a window of a file that shrank since
     * would map pages past its end (a vendor pinning them refuses: not "unregistrable") */
    struct stat st;
    int same = fstat(w->fd, &st) == 0 && fmap_snapshot_matches(w, &st);
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
            if (rc != dp->success && (m->flags & m->readonly)) /* a runtime without read-only */
                rc = dp->host_register(addr, w->len, m->flags & ~m->readonly);
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
        same = fstat(w->fd, &st) == 0 && fmap_snapshot_matches(w, &st);
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
    if (ok && fmap_written_since_locked(m, w->dev, w->ino, gen0))
        ok = 0;
    if (m->regs_active == 0)
        fmap_wprune_locked(m);
    if (!w->hashed) {
        discard = w; /* dropped while we worked */
    } else if (!ok && refused) {
        w->state = FW_UNREG;
        m->unregistrable++;
    } else if (!ok) {
        fmap_hash_remove_locked(m, w);
        discard = w;
    } else {
        evicted = make_room_locked(m, w->len, &freed);
        if (m->bytes + m->draining - freed + m->reserved + w->len > m->budget) {
            fmap_hash_remove_locked(m, w);
            discard = w;
        } else {
            w->addr = addr;
            addr = NULL;
            w->state = FW_READY;
            fmap_lru_front_locked(m, w);
            w->last_use_ns = io_now_ns();
            m->windows++;
            m->bytes += w->len;
            m->registrations++;
            /* the registrar releases it when idle or under pressure (SYNC mode: it may not
             * run yet) */
            fmap_registrar_start_locked(ctx);
            pthread_cond_signal(&m->cv);
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
    fmap_release_list(ctx, evicted);
}

/* Before each registration or release the registrar waits, up to FMAP_IDLE_WAIT_NS, for the
 * context to have no request or stream op in flight. Two reasons, both measured on hardware:
 * page-locking (host_register/unregister) competes with a first warm read for the memory
 * bus and the page tables (the first read ran at a third of the staged rate beside it), and
 * it can take a driver lock that other runtime calls of the application then wait for while
 * a stream is busy. Registering "between rounds", when the context is idle, avoids both; the
 * cap keeps a context that is never idle from never registering. */
#define FMAP_IDLE_WAIT_NS (2000000000ll)

/* Idle means idle for FMAP_QUIET_NS in a row: a miss queues its windows while its own
 * request is still being built, before it counts as in flight, and the registrar woke to
 * an "idle" context and page-locked a 1 GiB window beside that first read, which slowed
 * it measurably. */
#define FMAP_QUIET_NS (10000000ll)

static void wait_ctx_idle(phx_ctx *ctx)
{
    struct timespec dl = io_realtime_in(FMAP_IDLE_WAIT_NS);
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

/* ---- release: idle windows, and every window under memory pressure ------------------- */

void fmap_housekeeping(phx_ctx *ctx, int64_t now)
{
    struct io_fmap *m = &ctx->fmap;
    pthread_mutex_lock(&m->mu);
    int sim = m->pressure_sim;
    m->pressure_sim = 0;
    pthread_mutex_unlock(&m->mu);
    int pressure = fmap_pressure_check(m) || sim; /* (reads /proc: not under mu) */
    struct io_fwin *rel = NULL;
    pthread_mutex_lock(&m->mu);
    if (pressure) {
        int n = 0;
        rel = fmap_drop_all_locked(m, &n);
        m->pressure_releases++;
        m->hold_until_ns = now + FMAP_PRESSURE_HOLD_NS;
    } else if (m->idle_ns > 0) {
        for (struct io_fwin *v = m->lru.lprev; v != &m->lru;) {
            struct io_fwin *prev = v->lprev;
            if (v->refs == 0 && now - v->last_use_ns >= m->idle_ns) {
                fmap_drop_locked(m, v);
                v->qnext = rel;
                rel = v;
                m->idle_releases++;
            }
            v = prev;
        }
    }
    pthread_mutex_unlock(&m->mu);
    /* under pressure at once; idle windows too (nobody read them for idle_ns) */
    fmap_release_list(ctx, rel);
}

/* The housekeeping period: a quarter of the idle timeout, between 10 ms and 1 s. */
static int64_t tick_ns(const struct io_fmap *m)
{
    int64_t t = m->idle_ns > 0 ? m->idle_ns / 4 : FMAP_TICK_MAX_NS;
    if (t > FMAP_TICK_MAX_NS)
        t = FMAP_TICK_MAX_NS;
    if (t < 10000000ll)
        t = 10000000ll;
    return t;
}

static void *registrar_main(void *arg)
{
    pthread_setname_np(pthread_self(), "phx-fmap");
    phx_ctx *ctx = arg;
    struct io_fmap *m = &ctx->fmap;
    /* low priority: the first read runs meanwhile on the workers */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    in_registrar = 1;
    int64_t next_tick = io_now_ns() + tick_ns(m);
    pthread_mutex_lock(&m->mu);
    for (;;) {
        /* housekeeping while anything is registered (or a test signals pressure) */
        if (!m->stop && (m->pressure_sim || ((m->windows > 0 || m->draining > 0) && io_now_ns() >= next_tick))) {
            pthread_mutex_unlock(&m->mu);
            int64_t now = io_now_ns();
            fmap_housekeeping(ctx, now);
            next_tick = now + tick_ns(m);
            pthread_mutex_lock(&m->mu);
            continue;
        }
        if (m->release) {
            struct io_fwin *list = m->release;
            m->release = NULL;
            pthread_mutex_unlock(&m->mu);
            wait_ctx_idle(ctx);
            fmap_release_list(ctx, list);
            pthread_mutex_lock(&m->mu);
            continue;
        }
        if (m->stop)
            break;
        if (m->clearing) { /* fmap_clear_all waits for it to start nothing */
            pthread_cond_broadcast(&m->idle_cv);
            pthread_cond_wait(&m->cv, &m->mu);
            continue;
        }
        struct io_fwin *w = m->q_head;
        if (!w) {
            pthread_cond_broadcast(&m->idle_cv);
            if (m->windows > 0 || m->draining > 0) {
                int64_t left = next_tick - io_now_ns();
                if (left > 0) {
                    struct timespec ts = io_realtime_in(left);
                    pthread_cond_timedwait(&m->cv, &m->mu, &ts);
                }
            } else {
                pthread_cond_wait(&m->cv, &m->mu);
                next_tick = io_now_ns() + tick_ns(m);
            }
            continue;
        }
        m->q_head = w->qnext;
        if (!m->q_head)
            m->q_tail = NULL;
        w->qnext = NULL;
        if (!w->hashed) { /* dropped while queued (a write, an invalidation): gone now, not
                           * after waiting for the context to be idle */
            m->pending--;
            w->state = FW_UNREG; /* nothing mapped: its release only closes its fd */
            pthread_mutex_unlock(&m->mu);
            fmap_release_list(ctx, w);
            pthread_mutex_lock(&m->mu);
            continue;
        }
        m->busy = 1;
        pthread_mutex_unlock(&m->mu);
        wait_ctx_idle(ctx);
        fmap_register_window(ctx, w);
        pthread_mutex_lock(&m->mu);
        m->busy = 0;
    }
    pthread_cond_broadcast(&m->idle_cv);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* Start the registrar (fmap mu held). */
void fmap_registrar_start_locked(phx_ctx *ctx)
{
    struct io_fmap *m = &ctx->fmap;
    if (m->started)
        return;
    if (io_thread_create(&m->th, registrar_main, ctx) == 0) { /* asynchronous signals blocked */
        m->started = 1; /* (not in the threads counter: that counts the workers) */
    }
}
