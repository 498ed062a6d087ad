/* The windows of the file-mapping cache: where they are found, how they go, and the
 * writes that hold them back; the cache's lifetime.
 *
 * Core side, data path (under fmap.mu: submitters, the registrar, stream callbacks)
 * and control plane (init, clear, fini). A window is in the hash from the moment it is
 * queued (PENDING) until it is dropped; once registered (READY) it is also in the LRU
 * list. Dropping unhooks it under the mutex; releasing it (host_unregister, munmap)
 * happens after unlocking, by whoever dropped its last use.
 */
#include "io_ctx.h"
#include "io_file.h"
#include "io_fmap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- the hash and the LRU --------------------------------------------------------------- */

static unsigned hkey(uint64_t dev, uint64_t ino, int64_t off)
{
    uint64_t h = dev * 0x9e3779b97f4a7c15ull ^ ino * 0xc2b2ae3d27d4eb4full ^ (uint64_t)off * 0x165667b19e3779f9ull;
    return (unsigned)((h >> 29) % FMAP_HASH);
}

struct io_fwin *fmap_find_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, int64_t off)
{
    for (struct io_fwin *w = m->hash[hkey(dev, ino, off)]; w; w = w->hnext)
        if (w->dev == dev && w->ino == ino && w->off == off)
            return w;
    return NULL;
}

void fmap_hash_insert_locked(struct io_fmap *m, struct io_fwin *w)
{
    unsigned k = hkey(w->dev, w->ino, w->off);
    w->hnext = m->hash[k];
    m->hash[k] = w;
    w->hashed = 1;
}

void fmap_hash_remove_locked(struct io_fmap *m, struct io_fwin *w)
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

void fmap_lru_front_locked(struct io_fmap *m, struct io_fwin *w)
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
        /* pinned until now: fmap_drop_locked moved its bytes to `draining` */
        pthread_mutex_lock(&ctx->fmap.mu);
        ctx->fmap.draining -= w->len;
        pthread_mutex_unlock(&ctx->fmap.mu);
        STAT_ADD(fmap_windows, -1);
        STAT_ADD(fmap_bytes, -(int64_t)w->len);
    }
    if (w->fd >= 0)
        close(w->fd);
    free(w);
}

void fmap_release_list(phx_ctx *ctx, struct io_fwin *list)
{
    while (list) {
        struct io_fwin *next = list->qnext;
        fwin_release(ctx, list);
        list = next;
    }
}

/* Unhook w from the cache (fmap mu held). READY windows leave the cache's counters now
 * and count as `draining` (still registered: in the budget and in the fmap_windows and
 * fmap_bytes stats) until fwin_release; one still in use is released by its last
 * fmap_unref (through the registrar). Returns w when the caller must
 * release it (after unlocking), else NULL. A PENDING window is only unhooked: the
 * registrar (which owns it while queued or busy with it) sees !hashed and discards it. */
struct io_fwin *fmap_drop_locked(struct io_fmap *m, struct io_fwin *w)
{
    if (w->hashed)
        fmap_hash_remove_locked(m, w);
    if (w->state == FW_READY) {
        lru_remove_locked(w);
        m->windows--;
        m->bytes -= w->len;
        m->draining += w->len;
        return w->refs == 0 ? w : NULL;
    }
    if (w->state == FW_UNREG) {
        m->unregistrable--;
        return w;
    }
    return NULL; /* PENDING */
}

/* ---- the write table: phoenix writes in flight per inode ------------------------------------ */

static unsigned wkey(uint64_t dev, uint64_t ino)
{
    return (unsigned)(((dev * 0x9e3779b97f4a7c15ull) ^ (ino * 0xc2b2ae3d27d4eb4full)) >> 40) % FMAP_WHASH;
}

struct io_fwrite *fmap_wfind_locked(struct io_fmap *m, uint64_t dev, uint64_t ino)
{
    for (struct io_fwrite *e = m->wtab[wkey(dev, ino)]; e; e = e->next)
        if (e->dev == dev && e->ino == ino)
            return e;
    return NULL;
}

/* Forget inodes with no write in flight (only while no registration is in progress:
 * one that started before the write must still see it). */
void fmap_wprune_locked(struct io_fmap *m)
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
int fmap_written_since_locked(struct io_fmap *m, uint64_t dev, uint64_t ino, uint64_t gen0)
{
    struct io_fwrite *e = fmap_wfind_locked(m, dev, ino);
    return e && (e->writes > 0 || e->gen > gen0);
}

int fmap_snapshot_matches(const struct io_fwin *w, const struct stat *st)
{
    return w->fsize == (int64_t)st->st_size && w->mtime_ns == ts_ns(st->st_mtim) && w->ctime_ns == ts_ns(st->st_ctim);
}

/* ---- the cache's lifetime ------------------------------------------------------------------ */

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
    m->readonly = ctx->has_dp ? ctx->dp.host_register_read_only : 0;
    m->mode = ctx->cfg.fmap_mode;
    m->idle_ns = (int64_t)ctx->cfg.fmap_idle_ns;
    m->psi_fd = -1;
    snprintf(m->pressure_how, sizeof(m->pressure_how),
             "from the first window: PSI trigger (/proc/pressure/memory), else MemAvailable");
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

static struct io_fwin *drop_queue_locked(struct io_fmap *m, struct io_fwin *rel)
{
    /* the registrar owns the window it is working on: only the queue */
    while (m->q_head) {
        struct io_fwin *w = m->q_head;
        m->q_head = w->qnext;
        if (w->hashed)
            fmap_hash_remove_locked(m, w);
        m->pending--;
        w->state = FW_UNREG; /* nothing mapped: fwin_release only closes its fd */
        w->qnext = rel;
        rel = w;
    }
    m->q_tail = NULL;
    return rel;
}

/* Unhook every window and the queue (mu held); returns the list to release after
 * unlocking, *count the READY windows dropped. A window being registered (PENDING, not
 * queued) is only unhooked: its registrar discards it. */
struct io_fwin *fmap_drop_all_locked(struct io_fmap *m, int *count)
{
    struct io_fwin *rel = drop_queue_locked(m, NULL);
    int n = 0;
    for (int k = 0; k < FMAP_HASH; k++) {
        while (m->hash[k]) {
            struct io_fwin *w = m->hash[k];
            if (w->state == FW_READY)
                n++;
            struct io_fwin *r = fmap_drop_locked(m, w);
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
    if (count)
        *count = n;
    return rel;
}

/* Drop every window and the registration queue, waiting for a registration in progress;
 * `stop` also makes the registrar exit. Returns how many registered windows were dropped
 * (those in use are released by their last fmap_unref). */
int fmap_clear_all(phx_ctx *ctx, int stop)
{
    struct io_fmap *m = &ctx->fmap;
    int n = 0;
    pthread_mutex_lock(&m->mu);
    struct io_fwin *rel = drop_queue_locked(m, NULL);
    if (stop)
        m->stop = 1;
    m->clearing++; /* the registrar finishes what it does and starts nothing more */
    pthread_cond_broadcast(&m->cv);
    while (m->busy)
        pthread_cond_wait(&m->idle_cv, &m->mu);
    struct io_fwin *more = fmap_drop_all_locked(m, &n);
    m->clearing--;
    pthread_cond_broadcast(&m->cv);
    while (more) {
        struct io_fwin *next = more->qnext;
        more->qnext = rel;
        rel = more;
        more = next;
    }
    pthread_mutex_unlock(&m->mu);
    fmap_release_list(ctx, rel);
    return n;
}

void fmap_fini(phx_ctx *ctx)
{
    struct io_fmap *m = &ctx->fmap;
    fmap_clear_all(ctx, 1);
    if (m->started) {
        pthread_join(m->th, NULL);
        m->started = 0;
    }
    /* windows dropped by the registrar's last release pass are gone; nothing in use:
     * the context has drained its requests */
    fmap_release_list(ctx, m->release);
    m->release = NULL;
    fmap_pressure_close(m);
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

/* ---- writes through the context -------------------------------------------------------------- */

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
    struct io_fwrite *e = fmap_wfind_locked(m, f->st_dev, f->st_ino);
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
            struct io_fwin *w = fmap_find_locked(m, f->st_dev, f->st_ino, idx * (int64_t)W);
            if (!w)
                continue;
            m->invalidations++;
            struct io_fwin *r = fmap_drop_locked(m, w);
            if (r) {
                r->qnext = rel;
                rel = r;
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    /* unregistered here, before the write is queued: an O_DIRECT write must find the
     * page-cache pages unpinned to invalidate them */
    fmap_release_list(ctx, rel);
}

void fmap_write_end(phx_ctx *ctx, phx_file *f)
{
    struct io_fmap *m = &ctx->fmap;
    if (m->mode == PHX_FMAP_OFF || !(f->flags & PHX_F_WRITE))
        return;
    pthread_mutex_lock(&m->mu);
    struct io_fwrite *e = fmap_wfind_locked(m, f->st_dev, f->st_ino);
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
