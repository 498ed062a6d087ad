/* Stream-ordered writes queued and not done, by inode: what a blocking call waits for.
 *
 * Core side, data path. phx_stream_io lists each write it queues (stream_write_begin,
 * the caller's thread) and unlists it once its bytes are in the file or it was dropped
 * (stream_write_end, the stream callback that completes the op: a mutex and a futex
 * wake, no vendor call). phx_submit waits on the host for the writes to the same inode
 * (any handle) listed before it that its request depends on (stream_writes_wait), so a
 * blocking read reads what a write the caller queued before it wrote, and a blocking
 * write lands after it, although the caller's stream has not reached the write yet.
 * The list is short (the writes queued on streams at once); a sequence number keeps a
 * waiter to the writes listed before it began (writes queued later do not hold it).
 */
#include "io_file.h"
#include "io_fork.h"
#include "io_sync.h"

#include <errno.h>
#include <stdlib.h>

struct stream_write {
    uint64_t dev, ino;
    int64_t off, end;
    uint64_t seq;
    _Atomic uint32_t done; /* set by stream_write_end */
    _Atomic int refs;      /* the op's, and one per waiter */
    struct stream_write *prev, *next;
};

static pthread_mutex_t sw_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stream_write *sw_head; /* (sw_mu) */
static uint64_t sw_seq;              /* (sw_mu) the last one given */
static _Atomic int sw_listed;        /* nothing listed: phx_submit takes no lock */

static void sw_unref(struct stream_write *w)
{
    if (atomic_fetch_sub(&w->refs, 1) == 1)
        free(w);
}

struct stream_write *stream_write_begin(const phx_file *f, int64_t off, uint64_t len)
{
    struct stream_write *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->dev = f->st_dev;
    w->ino = f->st_ino;
    w->off = off;
    w->end = off + (int64_t)len;
    atomic_init(&w->refs, 1);
    pthread_mutex_lock(&sw_mu);
    w->seq = ++sw_seq;
    w->next = sw_head;
    if (sw_head)
        sw_head->prev = w;
    sw_head = w;
    atomic_fetch_add(&sw_listed, 1);
    pthread_mutex_unlock(&sw_mu);
    return w;
}

void stream_write_end(struct stream_write *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&sw_mu);
    if (w->prev)
        w->prev->next = w->next;
    else
        sw_head = w->next;
    if (w->next)
        w->next->prev = w->prev;
    atomic_fetch_sub(&sw_listed, 1);
    pthread_mutex_unlock(&sw_mu);
    io_set_flag(&w->done);
    sw_unref(w);
}

/* Does a request [off, end) of op depend on write w? A write: where they overlap. A read:
 * also where w lies past it (w grows the file: the read's range past the old end becomes
 * a hole of zeros that the read now counts). */
static int sw_depends(const struct stream_write *w, int op, int64_t off, int64_t end)
{
    return w->end > off && (op == PHX_OP_READ || w->off < end);
}

void stream_writes_wait(const phx_file *f, int op, int64_t off, uint64_t len)
{
    if (!atomic_load(&sw_listed) || !len || off < 0 || len > (uint64_t)(INT64_MAX - off))
        return;
    int64_t end = off + (int64_t)len;
    pthread_mutex_lock(&sw_mu);
    uint64_t upto = sw_seq; /* the writes listed before this call */
    for (;;) {
        struct stream_write *w = sw_head;
        while (w && (w->seq > upto || w->dev != f->st_dev || w->ino != f->st_ino || !sw_depends(w, op, off, end)))
            w = w->next;
        if (!w)
            break;
        atomic_fetch_add(&w->refs, 1); /* (still listed: the op's reference holds it) */
        pthread_mutex_unlock(&sw_mu);
        io_wait_flag(&w->done, -1);
        sw_unref(w);
        pthread_mutex_lock(&sw_mu);
    }
    pthread_mutex_unlock(&sw_mu);
}

/* fork (io_fork.c): the writes listed are the parent's stream ops', which nothing runs in
 * the child (their callbacks were queued on the parent's streams): dropped, so that no
 * blocking call of the child waits for them. */
void sw_fork(int phase)
{
    if (phase == IO_FORK_PREPARE) {
        pthread_mutex_lock(&sw_mu);
    } else if (phase == IO_FORK_PARENT) {
        pthread_mutex_unlock(&sw_mu);
    } else {
        pthread_mutex_init(&sw_mu, NULL);
        sw_head = NULL;
        atomic_store(&sw_listed, 0);
    }
}
