/* Files of the I/O core: two descriptors per file and their O_DIRECT alignment.
 *
 * Core side, control plane (open, close) with a few data-path helpers (file_get/put,
 * fault injection). A file holds an O_DIRECT descriptor where the file system takes
 * one, for the aligned body of every transfer, and a buffered descriptor for the
 * unaligned head and tail and as the fallback (tmpfs on older kernels refuses
 * O_DIRECT with EINVAL at open; some file systems only at the first I/O, which
 * file_disable_direct handles). Linux keeps the two coherent: a direct read flushes
 * dirty cached pages of its range first, a direct write invalidates them.
 */
#include "io_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* With fd_buf open, add the O_DIRECT descriptor (opened by `reopen`) when wanted. */
static int file_setup_direct(phx_file *f, int direct, int fd_direct, int open_errno)
{
    if (direct == PHX_DIRECT_OFF) {
        snprintf(f->why, sizeof(f->why), "buffered: O_DIRECT not requested (direct=False)");
        return 0;
    }
    if (fd_direct < 0) {
        snprintf(f->why, sizeof(f->why), "buffered: the file system refuses O_DIRECT (%s at open)",
                 strerror(open_errno));
        return direct == PHX_DIRECT_ON ? -open_errno : 0;
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

static int file_finish_open(phx_file *f, int direct, phx_file **out)
{
    struct stat st;
    int have = fstat(f->fd_buf, &st) == 0;
    if (have) {
        f->st_dev = (uint64_t)st.st_dev;
        f->st_ino = (uint64_t)st.st_ino;
        /* direct=ON asks for the disk every time: no page-cache mappings for it */
        f->fmap_ok = S_ISREG(st.st_mode) && direct != PHX_DIRECT_ON && (f->flags & PHX_F_READ);
    }
    if (have && !S_ISREG(st.st_mode) && f->fd_direct >= 0 && !S_ISBLK(st.st_mode)) {
        /* character devices and pipes: no O_DIRECT semantics to rely on */
        close(f->fd_direct);
        f->fd_direct = -1;
        atomic_store(&f->direct_ok, 0);
        snprintf(f->why, sizeof(f->why), "buffered: not a regular file or block device");
    }
    STAT_ADD(files, 1);
    *out = f;
    return 0;
}

int phx_file_open(const char *path, int flags, int perm, int direct, phx_file **out)
{
    if (!path || !out || !(flags & (PHX_F_READ | PHX_F_WRITE)))
        return -EINVAL;
    int acc = (flags & PHX_F_READ) && (flags & PHX_F_WRITE) ? O_RDWR : (flags & PHX_F_WRITE) ? O_WRONLY : O_RDONLY;
    int base = acc | O_CLOEXEC | ((flags & PHX_F_SYNC) ? O_DSYNC : 0);
    int first = base | ((flags & PHX_F_CREATE) ? O_CREAT : 0) | ((flags & PHX_F_TRUNC) ? O_TRUNC : 0) |
                ((flags & PHX_F_EXCL) ? O_EXCL : 0);
    phx_file *f = file_new();
    if (!f)
        return -ENOMEM;
    f->flags = flags;
    f->fd_buf = open(path, first, perm ? perm : 0644);
    if (f->fd_buf < 0) {
        int e = errno;
        file_free(f);
        return -e;
    }
    int fd_direct = -1, open_errno = 0;
    if (direct != PHX_DIRECT_OFF) {
        fd_direct = open(path, base | O_DIRECT);
        open_errno = errno;
    }
    int rc = file_setup_direct(f, direct, fd_direct, open_errno);
    if (rc < 0) {
        close(f->fd_buf);
        file_free(f);
        return rc;
    }
    return file_finish_open(f, direct, out);
}

int phx_file_from_fd(int fd, int direct, phx_file **out)
{
    if (fd < 0 || !out)
        return -EBADF;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -errno;
    phx_file *f = file_new();
    if (!f)
        return -ENOMEM;
    int acc = fl & O_ACCMODE;
    f->flags = (acc == O_RDONLY ? PHX_F_READ : acc == O_WRONLY ? PHX_F_WRITE : PHX_F_READ | PHX_F_WRITE) |
               ((fl & O_DSYNC) ? PHX_F_SYNC : 0);
    char proc[64];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    int base = acc | O_CLOEXEC | (fl & O_DSYNC);
    int fd_direct = -1, open_errno = 0;
    if (fl & O_DIRECT) {
        fd_direct = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        f->fd_buf = open(proc, base);
        if (f->fd_buf < 0 && fd_direct >= 0) {
            /* no /proc: a duplicate whose O_DIRECT flag we clear would clear it on the
             * caller's descriptor too (the flag is per open file description) */
            open_errno = errno;
            close(fd_direct);
            file_free(f);
            return -open_errno;
        }
    } else {
        f->fd_buf = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (direct != PHX_DIRECT_OFF) {
            fd_direct = open(proc, base | O_DIRECT);
            open_errno = errno;
        }
    }
    if (f->fd_buf < 0) {
        int e = errno;
        if (fd_direct >= 0)
            close(fd_direct);
        file_free(f);
        return -e;
    }
    int rc = file_setup_direct(f, direct, fd_direct, open_errno);
    if (rc < 0) {
        close(f->fd_buf);
        file_free(f);
        return rc;
    }
    return file_finish_open(f, direct, out);
}

int file_get(phx_file *f)
{
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
    if (--f->inflight == 0 && f->closing)
        pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

int phx_file_close(phx_file *f)
{
    if (!f)
        return -EBADF;
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
        off_t end = lseek(f->fd_buf, 0, SEEK_END);
        return end < 0 ? -errno : (int64_t)end;
    }
    return (int64_t)st.st_size;
}

void file_disable_direct(phx_file *f, const char *why)
{
    int expect = 1;
    if (atomic_compare_exchange_strong(&f->direct_ok, &expect, 0)) {
        STAT_ADD(direct_fallbacks, 1);
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
    out->known_size = atomic_load(&f->known_size);
    pthread_mutex_lock(&f->mu);
    memcpy(out->why, f->why, sizeof(out->why));
    pthread_mutex_unlock(&f->mu);
    return 0;
}

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
