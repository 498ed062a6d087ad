/* Files of the I/O core (io_file.c): two descriptors per file, in-flight counting, the
 * page-cache probe of direct=AUTO reads, and the fault-injection state.
 *
 * Core side: opened and closed on the control plane; the data path counts requests in
 * and out (file_get/put) and asks the probe and the fault hook per transfer.
 */
#ifndef PHX_IO_FILE_H
#define PHX_IO_FILE_H

#include "io_common.h"
#include "io_fork.h"

struct phx_file {
    int fd_direct; /* -1 when O_DIRECT is not used */
    int fd_buf;
    int flags;
    _Atomic int direct_ok;      /* cleared when the first O_DIRECT I/O is refused */
    _Atomic int cache_probe;    /* read mostly cached ranges buffered (cachestat) */
    _Atomic int probe_misses;   /* consecutive probes that found nothing cached */
    _Atomic uint32_t probe_tick;
    uint32_t a_off, a_mem;      /* O_DIRECT alignments (file offset/length, memory) */
    uint32_t align;             /* max(a_off, a_mem, page size): the planner's unit */
    _Atomic int64_t known_size; /* largest end of a write in flight (0 when none is) */
    uint64_t st_dev, st_ino;    /* the fmap cache's key (fstat at open) */
    int fmap_ok;                /* a regular file not opened direct=ON: fmap may serve it */
    _Atomic int fmap_cold;      /* consecutive misses whose range was not cached */
    _Atomic uint32_t fmap_tick; /* ... after 8 of them, one miss in 32 probes */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t inflight;           /* requests + stream ops (mu) */
    int closing;                /* (mu) */
    /* test fault injection (phx_file_inject_fault, phx_testing.h) */
    _Atomic int fault_err;
    int64_t fault_off;
    uint64_t fault_len;
    char why[160];
    _Atomic uint64_t gen;       /* the fork generation whose requests mu and inflight count */
};

#pragma GCC visibility push(hidden)
/* Count a request in (-EBADF once closing) and out (wakes close). */
int file_get(phx_file *f);
void file_put(phx_file *f);
void file_note_write(phx_file *f, int64_t end); /* a write to end is in flight */
void file_disable_direct(phx_file *f, const char *why);
/* Stream-ordered writes queued and not done, by inode (io_swrite.c): phx_stream_io lists
 * each write it queues (NULL: out of memory) and unlists it once the write is done or
 * dropped; phx_submit waits on the host for those listed before it that a request of
 * op on [off, off+len) of the same inode depends on. */
struct stream_write;
struct stream_write *stream_write_begin(const phx_file *f, int64_t off, uint64_t len);
void stream_write_end(struct stream_write *w);
void stream_writes_wait(const phx_file *f, int op, int64_t off, uint64_t len);
/* The injected fault's error for a transfer of [off, off+len), or 0. */
int file_fault(phx_file *f, int64_t off, uint64_t len);
/* Pages of [off, off+len) of fd in the page cache (cachestat(2), Linux 6.5+): 0 with
 * *nr_cache set, or -errno (-ENOSYS on older kernels, -EPERM under seccomp). */
int io_cachestat(int fd, int64_t off, uint64_t len, uint64_t *nr_cache);
/* The direct=AUTO page-cache probe: is [off, off+len) of f mostly cached (then read it
 * buffered)? Backs off while the answer is no. */
int file_mostly_cached(phx_file *f, int64_t off, uint64_t len);
#pragma GCC visibility pop

/* Before f->mu is taken: a parent's file is taken over once in a forked child (io_fork.c). */
static inline void file_own(phx_file *f)
{
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != io_gen())
        file_fork_adopt(f);
}

#endif
