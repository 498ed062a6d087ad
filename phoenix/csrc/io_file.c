/* Files of the I/O core: two descriptors per file and their O_DIRECT alignment.
 *
 * Core side, control plane (open, close) with a few data-path helpers (file_get/put,
 * the page-cache probe of direct=AUTO reads, fault injection). A file holds an O_DIRECT descriptor where the file system takes
 * one, for the aligned body of every transfer, and a buffered descriptor for the
 * unaligned head and tail and as the fallback (tmpfs on older kernels refuses
 * O_DIRECT with EINVAL at open; some file systems only at the first I/O, which
 * file_disable_direct handles). Linux keeps the two coherent: a direct read flushes
 * dirty cached pages of its range first, a direct write invalidates them.
 *
 * A path is opened once; the other descriptor is a second open of the inode that open
 * returned, through /proc/self/fd (reopen_fd). Files without offsets are refused at open
 * (file_check_kind), and so are, for writing, files that take no writes at an offset
 * (file_check_pwrite): phoenix does positioned I/O only.
 */
#include "io_file.h"
#include "phx_testing.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* O_DIRECT alignments: statx(STATX_DIOALIGN) (Linux 6.1+) says them; without it the
 * safe guess is the page size. A file system that answers 0 takes no O_DIRECT. */
static int dio_align(int fd, uint32_t *a_off, uint32_t *a_mem, char *why, size_t why_len)
{
    struct statx sx;
    memset(&sx, 0, sizeof(sx));
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
        if (sx.stx_dio_offset_align == 0 || sx.stx_dio_mem_align == 0) {
            snprintf(why, why_len, "the file system supports no direct I/O on this file (statx DIOALIGN is 0)");
            return -EINVAL;
        }
        *a_off = sx.stx_dio_offset_align;
        *a_mem = sx.stx_dio_mem_align;
        snprintf(why, why_len, "O_DIRECT (statx: offset alignment %u, memory alignment %u)", *a_off, *a_mem);
    } else {
        *a_off = 4096;
        *a_mem = 4096;
        snprintf(why, why_len, "O_DIRECT (alignment unknown to statx, assuming 4096)");
    }
    if (*a_off > IO_MAX_ALIGN || *a_mem > IO_MAX_ALIGN || (*a_off & (*a_off - 1)) || (*a_mem & (*a_mem - 1))) {
        snprintf(why, why_len, "O_DIRECT alignment %u/%u is unusual: buffered I/O", *a_off, *a_mem);
        return -EINVAL;
    }
    return 0;
}

static phx_file *file_new(void)
{
    phx_file *f = calloc(1, sizeof(*f));
    if (!f)
        return NULL;
    f->fd_direct = -1;
    f->fd_buf = -1;
    atomic_init(&f->gen, io_gen());
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    return f;
}

static void file_free(phx_file *f)
{
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f);
}

/* Phoenix moves data at file offsets (pread/pwrite, io_uring reads and writes at an
 * offset): a file without them is refused here, so that no engine ever issues I/O on it
 * (io_uring would read a pipe as a stream, ignoring the offset). A FIFO, a pipe or a
 * socket (ESPIPE), a directory (EISDIR), and a character device whose lseek says ESPIPE
 * (a terminal); a device with offsets (/dev/zero) is served buffered. */
static int file_check_kind(int fd, const struct stat *st)
{
    if (S_ISDIR(st->st_mode))
        return -EISDIR;
    if (S_ISFIFO(st->st_mode) || S_ISSOCK(st->st_mode))
        return -ESPIPE;
    if (!S_ISREG(st->st_mode) && !S_ISBLK(st->st_mode) && lseek(fd, 0, SEEK_CUR) < 0)
        return -ESPIPE; /* (no_llseek says ESPIPE; whatever it says, there are no offsets) */
    return 0;
}

/* A file open for writing must take writes at an offset: some /proc files seek but refuse
 * pwrite (ESPIPE: /proc/<pid>/comm), and an io_uring write ignores the offset there and
 * writes anyway. A write of 0 bytes at offset 0 says which; on a file system it moves
 * nothing and touches no time stamp. Any other answer (a file that refuses an empty
 * write, or takes it) passes: its writes at offsets say the rest. */
static int file_check_pwrite(int fd)
{
    static const char none[1];
    return pwrite(fd, none, 0, 0) < 0 && errno == ESPIPE ? -ESPIPE : 0;
}

/* Clear O_NONBLOCK (set for the open: it never waits) once the file is known to have offsets. */
static int fd_blocking(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0))
        return -errno;
    return 0;
}

/* A second open file description of the inode fd names (O_DIRECT and O_APPEND are per
 * description: set on a dup, they would be set on the original too): through
 * /proc/self/fd, which names the inode itself, whatever happened to the path since. Where
 * /proc is absent, the path (if any) is opened again and kept only if it is still the same
 * inode. -errno when neither works. */
static int reopen_fd(int fd, const char *path, int flags, const struct stat *st)
{
    char proc[64];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    int nfd = open(proc, flags);
    if (nfd >= 0 || errno != ENOENT || !path)
        return nfd >= 0 ? nfd : -errno;
    nfd = open(path, flags | O_NONBLOCK | O_NOCTTY); /* never waits (a path now a FIFO) */
    if (nfd < 0)
        return -errno;
    struct stat now;
    if (fstat(nfd, &now) != 0 || now.st_dev != st->st_dev || now.st_ino != st->st_ino) {
        close(nfd);
        return -ESTALE; /* the path names another file now */
    }
    int fl = fcntl(nfd, F_GETFL);
    if (fl >= 0 && !(flags & O_NONBLOCK))
        fcntl(nfd, F_SETFL, fl & ~O_NONBLOCK);
    return nfd;
}

/* With fd_buf open (and st its fstat), add the O_DIRECT descriptor when wanted: a second
 * open of the same inode (reopen_fd), or `fd_direct` (>= 0: a dup of the caller's O_DIRECT
 * descriptor, owned from here on: kept in f or closed). */
static int file_setup_direct(phx_file *f, int direct, const char *path, int base, const struct stat *st,
                             int fd_direct)
{
    if (fd_direct >= 0 && (direct == PHX_DIRECT_OFF || (!S_ISREG(st->st_mode) && !S_ISBLK(st->st_mode)))) {
        close(fd_direct);
        fd_direct = -1;
    }
    if (direct == PHX_DIRECT_OFF) {
        snprintf(f->why, sizeof(f->why), "buffered: O_DIRECT not requested (direct=False)");
        return 0;
    }
    if (!S_ISREG(st->st_mode) && !S_ISBLK(st->st_mode)) {
        /* character devices: no O_DIRECT semantics to rely on */
        snprintf(f->why, sizeof(f->why), "buffered: not a regular file or block device");
        return direct == PHX_DIRECT_ON ? -EINVAL : 0;
    }
    if (fd_direct < 0) {
        fd_direct = reopen_fd(f->fd_buf, path, base | O_DIRECT, st);
        if (fd_direct < 0) {
            snprintf(f->why, sizeof(f->why), "buffered: %s (%s at open)",
                     fd_direct == -ENOENT && !path ? "no /proc to open an O_DIRECT descriptor of the fd"
                                                   : "the file system refuses O_DIRECT",
                     strerror(-fd_direct));
            return direct == PHX_DIRECT_ON ? fd_direct : 0;
        }
    }
    uint32_t a_off, a_mem;
    if (dio_align(fd_direct, &a_off, &a_mem, f->why, sizeof(f->why)) < 0) {
        close(fd_direct);
        char tmp[sizeof(f->why)];
        memcpy(tmp, f->why, sizeof(tmp));
        snprintf(f->why, sizeof(f->why), "buffered: %.140s", tmp);
        return direct == PHX_DIRECT_ON ? -EINVAL : 0;
    }
    f->fd_direct = fd_direct;
    f->a_off = a_off;
    f->a_mem = a_mem;
    /* The planner splits transfers at page boundaries at least, not at the (often 512
     * byte) O_DIRECT alignment: the page cache works in pages, and a buffered write of an
     * unaligned head sharing a page with a concurrent O_DIRECT write of the body would
     * read the page, race the direct write, and write stale bytes back over it. */
    uint32_t page = (uint32_t)sysconf(_SC_PAGESIZE);
    f->align = a_off > a_mem ? a_off : a_mem;
    if (f->align < page)
        f->align = page;
    f->cache_probe = direct == PHX_DIRECT_AUTO;
    atomic_store(&f->direct_ok, 1);
    return 0;
}

static void file_finish_open(phx_file *f, int direct, const struct stat *st, phx_file **out)
{
    f->st_dev = (uint64_t)st->st_dev;
    f->st_ino = (uint64_t)st->st_ino;
    /* direct=ON asks for the disk every time: no page-cache mappings for it */
    f->fmap_ok = S_ISREG(st->st_mode) && direct != PHX_DIRECT_ON && (f->flags & PHX_F_READ);
    STAT_ADD(files, 1);
    *out = f;
}

static int file_fail(phx_file *f, int rc)
{
    if (f->fd_direct >= 0)
        close(f->fd_direct);
    if (f->fd_buf >= 0)
        close(f->fd_buf);
    file_free(f);
    return rc;
}

/* The path is opened once; the O_DIRECT descriptor is a second open of the inode that
 * open returned (reopen_fd), never of the path again: a FIFO opened twice waits for a
 * writer the second time, and a path renamed in between names another file. */
int phx_file_open(const char *path, int flags, int perm, int direct, phx_file **out)
{
    if (!path || !out || !(flags & (PHX_F_READ | PHX_F_WRITE)))
        return -EINVAL;
    int acc = (flags & PHX_F_READ) && (flags & PHX_F_WRITE) ? O_RDWR : (flags & PHX_F_WRITE) ? O_WRONLY : O_RDONLY;
    int base = acc | O_CLOEXEC | ((flags & PHX_F_SYNC) ? O_DSYNC : 0);
    int first = base | O_NOCTTY | ((flags & PHX_F_CREATE) ? O_CREAT : 0) | ((flags & PHX_F_TRUNC) ? O_TRUNC : 0) |
                ((flags & PHX_F_EXCL) ? O_EXCL : 0);
    /* A FIFO or a socket is refused before it is opened: opening a FIFO waits for the
     * other side (and wakes a writer waiting for a reader, which then writes into a closed
     * pipe). O_EXCL never opens an existing file. A path that became one since is opened
     * O_NONBLOCK, so that the open never waits, and refused by the fstat below; only then
     * is O_NONBLOCK cleared. */
    struct stat st;
    if (!(flags & PHX_F_EXCL) && stat(path, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)))
        return -ESPIPE;
    phx_file *f = file_new();
    if (!f)
        return -ENOMEM;
    f->flags = flags;
    f->fd_buf = open(path, first | O_NONBLOCK, perm ? perm : 0644);
    if (f->fd_buf < 0) {
        /* ENXIO: a FIFO with no reader (opened O_WRONLY | O_NONBLOCK) or a socket; from
         * no file with offsets but a device without its hardware */
        int e = errno;
        if (e == ENXIO && !(stat(path, &st) == 0 && (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))))
            e = ESPIPE;
        return file_fail(f, -e);
    }
    if (fstat(f->fd_buf, &st) != 0)
        return file_fail(f, -errno);
    int rc = file_check_kind(f->fd_buf, &st);
    if (!rc)
        rc = fd_blocking(f->fd_buf);
    if (!rc && (flags & PHX_F_WRITE))
        rc = file_check_pwrite(f->fd_buf);
    if (!rc)
        rc = file_setup_direct(f, direct, path, base, &st, -1);
    if (rc < 0)
        return file_fail(f, rc);
    file_finish_open(f, direct, &st, out);
    return 0;
}

int phx_file_from_fd(int fd, int direct, phx_file **out)
{
    if (fd < 0 || !out)
        return -EBADF;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -errno;
    if (fl & O_PATH)
        return -EBADF; /* a path descriptor moves no data */
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -errno;
    int rc = file_check_kind(fd, &st);
    if (rc < 0)
        return rc;
    phx_file *f = file_new();
    if (!f)
        return -ENOMEM;
    int acc = fl & O_ACCMODE;
    f->flags = (acc == O_RDONLY ? PHX_F_READ : acc == O_WRONLY ? PHX_F_WRITE : PHX_F_READ | PHX_F_WRITE) |
               ((fl & O_DSYNC) ? PHX_F_SYNC : 0);
    int base = acc | O_CLOEXEC | (fl & O_DSYNC);
    int fd_direct = -1;
    /* The buffered descriptor: a new open file description of the inode where the
     * caller's carries a flag ours must not have -- O_DIRECT (phoenix's own, below),
     * O_APPEND (Linux then appends every write, whatever its offset) -- which a dup would
     * share and clearing it would clear for the caller; and for every regular file or
     * block device, whose flags the caller may still change (a later F_SETFL O_APPEND on
     * a shared description would redirect phoenix's writes, O_DIRECT would make its
     * unaligned reads fail). A dup otherwise, and where no new description can be had
     * without O_APPEND or O_DIRECT at stake (no /proc, the inode's permissions changed
     * since the caller's open). */
    int must = (fl & O_DIRECT) || ((fl & O_APPEND) && acc != O_RDONLY);
    int own = must || S_ISREG(st.st_mode) || S_ISBLK(st.st_mode);
    int nfd = own ? reopen_fd(fd, NULL, base | O_NONBLOCK, &st) : -1;
    if (nfd >= 0 && (rc = fd_blocking(nfd)) < 0) {
        close(nfd);
        return file_fail(f, rc);
    }
    if (must) {
        if (nfd < 0) /* no /proc (ENOENT): with O_APPEND no write would land at its offset */
            return file_fail(f, nfd == -ENOENT && !(fl & O_DIRECT) ? -EINVAL : nfd);
        f->fd_buf = nfd;
        if ((fl & O_DIRECT) && direct != PHX_DIRECT_OFF) {
            /* writable: a description of its own too (O_APPEND set now or later), else a dup */
            fd_direct = acc != O_RDONLY ? reopen_fd(fd, NULL, base | O_DIRECT, &st) : -ENOENT;
            if (fd_direct < 0 && !(fl & O_APPEND) && (fd_direct = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
                fd_direct = -errno;
            if (fd_direct < 0)
                return file_fail(f, fd_direct);
        }
    } else if (nfd >= 0) {
        f->fd_buf = nfd;
    } else {
        f->fd_buf = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (f->fd_buf < 0)
            return file_fail(f, -errno);
    }
    if (acc != O_RDONLY && (rc = file_check_pwrite(f->fd_buf)) < 0) {
        if (fd_direct >= 0)
            close(fd_direct);
        return file_fail(f, rc);
    }
    rc = file_setup_direct(f, direct, NULL, base, &st, fd_direct);
    if (rc < 0)
        return file_fail(f, rc);
    file_finish_open(f, direct, &st, out);
    return 0;
}

int file_get(phx_file *f)
{
    file_own(f);
    pthread_mutex_lock(&f->mu);
    int rc = f->closing ? -EBADF : 0;
    if (!rc)
        f->inflight++;
    pthread_mutex_unlock(&f->mu);
    return rc;
}

void file_put(phx_file *f)
{
    /* Under the mutex: once we unlock, close() may free f. */
    pthread_mutex_lock(&f->mu);
    if (--f->inflight == 0) {
        /* every write submitted through f has completed (fstat sees it): forget their
         * ends, or a file truncated since would look longer (phx_file_query) */
        atomic_store(&f->known_size, 0);
        if (f->closing)
            pthread_cond_broadcast(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
}

void file_note_write(phx_file *f, int64_t end)
{
    /* the caller holds a reference (file_get), so file_put cannot reset this under it */
    int64_t cur = atomic_load(&f->known_size);
    while (end > cur && !atomic_compare_exchange_weak(&f->known_size, &cur, end))
        ;
}

int phx_file_close(phx_file *f)
{
    if (!f)
        return -EBADF;
    file_own(f); /* in a forked child: the parent's requests are not waited for */
    pthread_mutex_lock(&f->mu);
    f->closing = 1;
    while (f->inflight > 0)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    int rc = 0;
    if (f->fd_direct >= 0 && close(f->fd_direct) < 0)
        rc = -errno;
    if (f->fd_buf >= 0 && close(f->fd_buf) < 0 && !rc)
        rc = -errno;
    file_free(f);
    STAT_ADD(files, -1);
    return rc;
}

int phx_file_fsync(phx_file *f)
{
    if (!f)
        return -EBADF;
    /* One fsync covers both descriptors: they share the inode. */
    return fsync(f->fd_buf) < 0 ? -errno : 0;
}

int64_t phx_file_size(phx_file *f)
{
    struct stat st;
    if (fstat(f->fd_buf, &st) < 0)
        return -errno;
    if (S_ISBLK(st.st_mode)) {
        /* (not lseek(SEEK_END): fd_buf may share its file offset with the caller's
         * descriptor, phx_file_from_fd's dup) */
        uint64_t bytes;
        return ioctl(f->fd_buf, BLKGETSIZE64, &bytes) < 0 ? -errno : (int64_t)bytes;
    }
    return (int64_t)st.st_size;
}

void file_disable_direct(phx_file *f, const char *why)
{
    int expect = 1;
    if (atomic_compare_exchange_strong(&f->direct_ok, &expect, 0)) {
        STAT_ADD(direct_fallbacks, 1);
        file_own(f);
        pthread_mutex_lock(&f->mu);
        snprintf(f->why, sizeof(f->why), "buffered: %s", why);
        pthread_mutex_unlock(&f->mu);
    }
}

int phx_file_query(phx_file *f, struct phx_file_info *out)
{
    if (!f || !out)
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    out->direct = atomic_load(&f->direct_ok);
    out->dio_offset_align = f->a_off;
    out->dio_mem_align = f->a_mem;
    out->fd_direct = f->fd_direct;
    out->fd_buffered = f->fd_buf;
    file_own(f);
    out->known_size = atomic_load(&f->known_size);
    pthread_mutex_lock(&f->mu);
    memcpy(out->why, f->why, sizeof(out->why));
    pthread_mutex_unlock(&f->mu);
    return 0;
}

/* ---- the page-cache probe (direct=AUTO reads) ------------------------------------------ */

/* An O_DIRECT read of data that is already cached would go to the disk anyway (and flush
 * dirty pages first), so a read whose range is mostly cached is done buffered instead.
 * cachestat(2) (Linux 6.5+) counts the cached pages of a range without touching them or
 * starting readahead (a RWF_NOWAIT read would start readahead on a miss: disk bandwidth
 * stolen from the O_DIRECT reads). The answer only picks the path: both paths read the
 * same bytes. While probes miss, back off: after 8 misses in a row, one read in 32
 * probes. */
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* the same number on every architecture */
#endif
struct io_cachestat_range {
    uint64_t off, len;
};
struct io_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

int io_cachestat(int fd, int64_t off, uint64_t len, uint64_t *nr_cache)
{
    struct io_cachestat_range range = {(uint64_t)off, len};
    struct io_cachestat cs;
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) < 0)
        return -errno;
    *nr_cache = cs.nr_cache;
    return 0;
}

int file_mostly_cached(phx_file *f, int64_t off, uint64_t len)
{
    if (!atomic_load_explicit(&f->cache_probe, memory_order_relaxed))
        return 0;
    if (atomic_load_explicit(&f->probe_misses, memory_order_relaxed) >= 8 &&
        (atomic_fetch_add_explicit(&f->probe_tick, 1, memory_order_relaxed) & 31) != 0)
        return 0;
    uint64_t cached = 0;
    if (io_cachestat(f->fd_buf, off, len, &cached) < 0) {
        atomic_store(&f->cache_probe, 0); /* ENOSYS (kernel < 6.5), EPERM (seccomp): stop asking */
        return 0;
    }
    uint64_t pages = (len + 4095) / 4096;
    if (cached * 2 >= pages && cached) {
        atomic_store_explicit(&f->probe_misses, 0, memory_order_relaxed);
        STAT_ADD(cache_hit_bytes, (int64_t)len);
        return 1;
    }
    atomic_fetch_add_explicit(&f->probe_misses, 1, memory_order_relaxed);
    STAT_ADD(cache_misses, 1);
    return 0;
}

int phx_cache_probe_works(phx_file *f)
{
    uint64_t cached = 0;
    return io_cachestat(f->fd_buf, 0, 4096, &cached);
}

/* ---- fault injection (phx_testing.h) ------------------------------------------------------ */

int phx_file_inject_fault(phx_file *f, int64_t offset, uint64_t length, int err)
{
    if (!f || err < 0)
        return -EINVAL;
    atomic_store(&f->fault_err, 0);
    f->fault_off = offset;
    f->fault_len = length;
    atomic_store(&f->fault_err, err);
    return 0;
}

int file_fault(phx_file *f, int64_t off, uint64_t len)
{
    int err = atomic_load_explicit(&f->fault_err, memory_order_acquire);
    if (!err)
        return 0;
    if (off < f->fault_off + (int64_t)f->fault_len && f->fault_off < off + (int64_t)len)
        return err;
    return 0;
}
