/* The file-mapping registration cache, request side: warm reads into device memory as
 * one DMA, and the cache's control plane.
 *
 * Core side, data path (submitters, stream callbacks) and control plane (phx_fmap_*).
 * What the cache is and what must stay true: phx_io.h ("the file-mapping registration
 * cache"); its files: io_fmap.h. Who calls what here:
 *
 *   submitters  fmap_plan (lookup; on a miss queue, or in SYNC mode do, the
 *               registration), fmap_fill, fmap_plan_drop (io_plan.c).
 *   workers     nothing here: a hit is run by io_copy.c (fmap_req_start).
 *   callbacks   fmap_unref, fmap_req_copied: the mutex, a condition variable and an
 *               fstat, never the vendor.
 */
#include "io_ctx.h"
#include "io_file.h"
#include "io_fmap.h"
#include "io_req.h"
#include "io_sync.h"
#include "phx_testing.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- residency ------------------------------------------------------------------------------ */

/* Is [off, off+len) of fd mostly (7/8) in the page cache? Where cachestat is refused
 * (Linux < 6.5, seccomp) the answer is yes: the window was just read, so it is cached
 * unless the read was O_DIRECT, and then MAP_POPULATE reads it once in the background. */
int fmap_resident(int fd, int64_t off, uint64_t len)
{
    uint64_t cached;
    if (io_cachestat(fd, off, len, &cached) < 0)
        return 1;
    uint64_t pages = (len + 4095) / 4096;
    return cached * 8 >= pages * 7;
}

/* fmap_resident() on the submit path: cachestat walks the page cache's index page by page
 * (milliseconds per GiB on tmpfs), which for a first read of several GiB is a large part
 * of its time. A large range is judged from 8 evenly spread 1 MiB samples (all must
 * be resident); the registrar checks the whole window before it maps it. */
#define FMAP_SAMPLE (1ull << 20)
static int resident_sampled(int fd, int64_t off, uint64_t len)
{
    if (len <= 32 * FMAP_SAMPLE)
        return fmap_resident(fd, off, len);
    uint64_t step = (len - FMAP_SAMPLE) / 7;
    for (int i = 0; i < 8; i++)
        if (!fmap_resident(fd, off + (int64_t)(step * (uint64_t)i), FMAP_SAMPLE))
            return 0;
    return 1;
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
        struct io_fwrite *e = fmap_wfind_locked(m, f->st_dev, f->st_ino);
        /* (after memory pressure no window is registered for a while: FMAP_PRESSURE_HOLD_NS) */
        int have = fmap_find_locked(m, f->st_dev, f->st_ino, off) != NULL || (e && e->writes > 0) ||
                   (m->hold_until_ns && io_now_ns() < m->hold_until_ns) || m->pending >= FMAP_PENDING_MAX;
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
        if (fmap_find_locked(m, w->dev, w->ino, w->off) || m->stop || m->pending >= FMAP_PENDING_MAX) {
            pthread_mutex_unlock(&m->mu);
            close(w->fd);
            free(w);
            continue;
        }
        fmap_hash_insert_locked(m, w);
        m->pending++;
        if (!sync) {
            if (m->q_tail)
                m->q_tail->qnext = w;
            else
                m->q_head = w;
            m->q_tail = w;
            fmap_registrar_start_locked(ctx);
            pthread_cond_signal(&m->cv);
        }
        pthread_mutex_unlock(&m->mu);
        if (sync)
            fmap_register_window(ctx, w);
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
    if (last - first + 1 > (int64_t)IO_MAX_CHUNKS)
        return 0; /* more windows than an int counts: the staged path */
    int n = (int)(last - first + 1);
    struct io_fwin *stack[8], **wins = n <= 8 ? stack : malloc((size_t)n * sizeof(*wins));
    if (!wins)
        return 0;
    for (int attempt = 0;; attempt++) {
        int all = 1;
        struct io_fwin *rel = NULL;
        pthread_mutex_lock(&m->mu);
        for (int i = 0; i < n; i++) {
            struct io_fwin *w = fmap_find_locked(m, f->st_dev, f->st_ino, (first + i) * (int64_t)W);
            if (w && w->state != FW_PENDING && (!fmap_snapshot_matches(w, &st) || fg_valid_end(w) != INT64_MAX)) {
                m->invalidations++;
                struct io_fwin *r = fmap_drop_locked(m, w); /* the file changed (or shrank under a copy): drop */
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
            int64_t now = io_now_ns();
            for (int i = 0; i < n; i++) {
                if (wins[i]->refs++ == 0)
                    m->in_use++;
                wins[i]->last_use_ns = now;
                fmap_lru_front_locked(m, wins[i]);
            }
            m->hits++;
        }
        pthread_mutex_unlock(&m->mu);
        fmap_release_list(ctx, rel);
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
        w->last_use_ns = io_now_ns(); /* idle from the end of its last copy */
        if (!w->hashed) { /* dropped while in use: the registrar releases it */
            w->qnext = m->release;
            m->release = w;
            fmap_registrar_start_locked(ctx);
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

/* ---- control plane -------------------------------------------------------------------------- */
/* (a parent's context in a forked child: -ECHILD; a thread the child does not have may hold
 * its mutex, and its registrar is gone) */

int phx_fmap_query(phx_ctx *ctx, struct phx_fmap_info *o)
{
    if (!ctx || !o)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
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
    o->idle_ns = (uint64_t)m->idle_ns;
    o->pinned = (int64_t)(m->bytes + m->draining);
    o->idle_releases = m->idle_releases;
    o->pressure_releases = m->pressure_releases;
    snprintf(o->pressure, sizeof(o->pressure), "%s", m->mode == PHX_FMAP_OFF ? "" : m->pressure_how);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

int phx_fmap_simulate_pressure(phx_ctx *ctx)
{
    if (!ctx)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    struct io_fmap *m = &ctx->fmap;
    if (m->mode == PHX_FMAP_OFF)
        return 0;
    pthread_mutex_lock(&m->mu);
    m->pressure_sim = 1;
    fmap_registrar_start_locked(ctx);
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->mu);
    return 0;
}

int phx_fmap_lookup(phx_ctx *ctx, phx_file *f, int64_t offset, uint64_t length, void **host_addr)
{
    if (host_addr)
        *host_addr = NULL;
    if (!ctx || !f || offset < 0)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
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
    struct io_fwin *w = fmap_find_locked(m, f->st_dev, f->st_ino, off0);
    if (w && w->state == FW_READY && fmap_snapshot_matches(w, &st) && fg_valid_end(w) == INT64_MAX &&
        offset + (int64_t)length <= w->off + (int64_t)w->len) {
        if (host_addr)
            *host_addr = w->addr + (offset - w->off);
        rc = 0;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

int phx_fmap_wait(phx_ctx *ctx, int64_t timeout_ns)
{
    if (!ctx)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    struct io_fmap *m = &ctx->fmap;
    int64_t deadline = timeout_ns >= 0 ? io_deadline_ns(timeout_ns) : 0;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    while (m->q_head || m->busy || m->release) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&m->idle_cv, &m->mu);
            continue;
        }
        /* the condition variable waits on CLOCK_REALTIME: wait in short steps */
        int64_t left = deadline - io_now_ns();
        if (left <= 0) {
            rc = -ETIMEDOUT;
            break;
        }
        if (left > 10000000)
            left = 10000000;
        struct timespec ts = io_realtime_in(left);
        pthread_cond_timedwait(&m->idle_cv, &m->mu, &ts);
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

int phx_fmap_clear(phx_ctx *ctx)
{
    if (!ctx)
        return -EINVAL;
    if (ctx_forked(ctx))
        return -ECHILD;
    return fmap_clear_all(ctx, 0);
}
