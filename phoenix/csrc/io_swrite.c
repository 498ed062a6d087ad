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
 *
 * What depends on what (sw_depends): a waiter that does not depend on a queued write
 * must not wait for it, since the write's stream may be held for seconds, or for ever
 * where what lets it go waits on the waiting thread. A write depends on a queued write
 * where they overlap. A read does too, and also where it reaches past the file's end at
 * the call and the queued write ends past that end and past the read's start: the write
 * grows the file into the read's range, whose bytes past the old end then read as zeros
 * the count includes. The file's size is asked (fstat) only for a read, and only when
 * a queued write of the same inode that does not overlap it ends past its start.
 */
#include "io_file.h"
#include "io_fork.h"
#include "io_sync.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>

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

/* The file's size for sw_depends: a regular file's st_size; INT64_MAX for anything
 * else (a block device: a write does not grow it, so only overlaps count); 0 where fstat
 * fails (every write ending past the read's start counts: waiting is never wrong). */
static int64_t sw_file_size(const phx_file *f)
{
    struct stat st;
    if (fstat(f->fd_buf, &st) != 0)
        return 0;
    return S_ISREG(st.st_mode) ? (int64_t)st.st_size : INT64_MAX;
}

/* Does a request [off, end) of op depend on write w (same inode, listed before it)? An
 * overlap; for a read also w growing the file into it (size: the file's at the call, -1
 * not asked yet: then *need_size is set where only the size decides). */
static int sw_depends(const struct stream_write *w, int op, int64_t off, int64_t end, int64_t size,
                      int *need_size)
{
    if (w->off < end && w->end > off)
        return 1;
    if (op != PHX_OP_READ || w->end <= off)
        return 0;
    if (size < 0) {
        *need_size = 1;
        return 0;
    }
    return end > size && w->end > size;
}

void stream_writes_wait(const phx_file *f, int op, int64_t off, uint64_t len)
{
    if (!atomic_load(&sw_listed) || !len || off < 0 || len > (uint64_t)(INT64_MAX - off))
        return;
    int64_t end = off + (int64_t)len, size = -1;
    pthread_mutex_lock(&sw_mu);
    uint64_t upto = sw_seq; /* the writes listed before this call */
    for (;;) {
        int need_size = 0;
        struct stream_write *w = sw_head;
        while (w && (w->seq > upto || w->dev != f->st_dev || w->ino != f->st_ino ||
                     !sw_depends(w, op, off, end, size, &need_size)))
            w = w->next;
        if (!w && need_size) {
            /* a listed write may grow the file into the read: the size says. Asked once,
             * without the lock (writes listed meanwhile are past upto; one that grew the
             * file meanwhile is seen grown, and what it grew the read sees) */
            pthread_mutex_unlock(&sw_mu);
            size = sw_file_size(f);
            pthread_mutex_lock(&sw_mu);
            continue;
        }
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
