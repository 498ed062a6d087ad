/* A minimal io_uring ring through the raw system calls.
 *
 * Core side, data path (one ring per worker thread, used only by that thread).
 *
 * Why not liburing: a fresh Debian or Ubuntu machine has the kernel's UAPI header
 * <linux/io_uring.h> (linux-libc-dev, pulled in by gcc) but not liburing-dev, and
 * `pip install phoenix` must build with gcc and the Python headers alone. The part of
 * liburing we need (setup, the two ring mmaps, hand out an SQE, publish, enter, walk
 * the CQ) is this file; it uses IORING_OP_READ / IORING_OP_WRITE (Linux 5.6+), which
 * ring_probe() checks with IORING_REGISTER_PROBE before the engine is chosen.
 *
 * Memory ordering: the kernel reads sq_tail and writes cq_tail concurrently; we
 * publish sq_tail with a release store and read cq_tail with an acquire load, as
 * liburing does.
 */
#include "io_ring.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void *arg, size_t argsz)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
}

static int sys_register(int fd, unsigned op, void *arg, unsigned nr)
{
    return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

static int ring_map(struct io_ring *r, struct io_uring_params *p, char *why, size_t why_len)
{
    r->sq_map_size = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    r->cq_map_size = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_size > r->sq_map_size)
            r->sq_map_size = r->cq_map_size;
        r->cq_map_size = r->sq_map_size;
    }
    r->sq_map = mmap(NULL, r->sq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) {
        r->sq_map = NULL;
        snprintf(why, why_len, "mmap of the io_uring SQ ring failed: %s", strerror(errno));
        return -errno;
    }
    if (p->features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) {
            r->cq_map = NULL;
            snprintf(why, why_len, "mmap of the io_uring CQ ring failed: %s", strerror(errno));
            return -errno;
        }
    }
    r->sqes_size = p->sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        r->sqes = NULL;
        snprintf(why, why_len, "mmap of the io_uring SQEs failed: %s", strerror(errno));
        return -errno;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p->sq_off.head);
    r->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    r->sq_flags = (unsigned *)(sq + p->sq_off.flags);
    r->sq_array = (unsigned *)(sq + p->sq_off.array);
    r->cq_head = (unsigned *)(cq + p->cq_off.head);
    r->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    r->sq_entries = p->sq_entries;
    r->cq_entries = p->cq_entries;
    /* identity SQ index array: SQE i sits in slot i */
    for (unsigned i = 0; i < r->sq_entries; i++)
        r->sq_array[i] = i;
    r->sqe_tail = *r->sq_tail;
    r->to_submit = 0;
    return 0;
}

int ring_init(struct io_ring *r, unsigned entries, char *why, size_t why_len)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
    struct io_uring_params p;
    /* SINGLE_ISSUER + DEFER_TASKRUN (6.1+): completions are run in our own
     * io_uring_enter(GETEVENTS) instead of interrupting the worker; the ring is created
     * by the worker thread that alone uses it. Older kernels: plain ring. */
    static const unsigned tries[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, 0};
    int err = 0;
    for (unsigned t = 0; t < sizeof(tries) / sizeof(tries[0]); t++) {
        memset(&p, 0, sizeof(p));
        p.flags = tries[t];
        r->fd = sys_setup(entries, &p);
        if (r->fd >= 0) {
            r->setup_flags = p.flags;
            r->features = p.features;
            break;
        }
        err = errno;
        if (err != EINVAL)
            break;
    }
    if (r->fd < 0) {
        snprintf(why, why_len, "io_uring_setup failed: %s%s", strerror(err),
                 err == EPERM ? " (disabled by kernel.io_uring_disabled or a seccomp filter)"
                 : err == ENOSYS ? " (kernel built without CONFIG_IO_URING, or blocked by seccomp)"
                                 : "");
        return -err;
    }
    int rc = ring_map(r, &p, why, why_len);
    if (rc < 0) {
        ring_exit(r);
        return rc;
    }
    return 0;
}

void ring_exit(struct io_ring *r)
{
    if (r->sqes)
        munmap(r->sqes, r->sqes_size);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_size);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_map_size);
    if (r->fd >= 0)
        close(r->fd);
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

struct io_uring_sqe *ring_get_sqe(struct io_ring *r)
{
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (r->sqe_tail - head >= r->sq_entries)
        return NULL;
    struct io_uring_sqe *sqe = &r->sqes[r->sqe_tail & *r->sq_mask];
    r->sqe_tail++;
    memset(sqe, 0, sizeof(*sqe));
    return sqe;
}

static int enter(struct io_ring *r, unsigned wait_nr, int64_t ns)
{
    unsigned tail = *r->sq_tail;
    if (tail != r->sqe_tail) {
        r->to_submit += r->sqe_tail - tail;
        __atomic_store_n(r->sq_tail, r->sqe_tail, __ATOMIC_RELEASE);
    }
    /* With DEFER_TASKRUN completions are posted only inside GETEVENTS. */
    unsigned flags = (wait_nr || (r->setup_flags & IORING_SETUP_DEFER_TASKRUN)) ? IORING_ENTER_GETEVENTS : 0;
    if (!r->to_submit && !flags)
        return 0;
    int timed = wait_nr && ns > 0;
    struct __kernel_timespec ts;
    struct io_uring_getevents_arg arg;
    if (timed) {
        ts = (struct __kernel_timespec){.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
        memset(&arg, 0, sizeof(arg));
        arg.ts = (uint64_t)(uintptr_t)&ts;
    }
    for (;;) {
        STAT_ADD(uring_enters, 1);
        int ret = timed ? sys_enter(r->fd, r->to_submit, wait_nr, flags | IORING_ENTER_EXT_ARG, &arg, sizeof(arg))
                        : sys_enter(r->fd, r->to_submit, wait_nr, flags, NULL, 0);
        if (ret >= 0) {
            r->to_submit -= (unsigned)ret > r->to_submit ? r->to_submit : (unsigned)ret;
            return ret;
        }
        if (errno == EINTR)
            continue;
        /* EAGAIN / EBUSY: the CQ is full; the caller reaps and comes back. ETIME: waited ns */
        return -errno;
    }
}

int ring_enter(struct io_ring *r, unsigned wait_nr) { return enter(r, wait_nr, 0); }

int ring_enter_timeout(struct io_ring *r, unsigned wait_nr, int64_t ns) { return enter(r, wait_nr, ns); }

int ring_can_time_wait(const struct io_ring *r) { return (r->features & IORING_FEAT_EXT_ARG) != 0; }

/* ---- registered (fixed) buffers --------------------------------------------------------- */

/* A sparse table of n buffer slots (Linux 5.19+), filled one by one with ring_buffer_set:
 * a READ_FIXED / WRITE_FIXED on a registered buffer skips pinning its pages per I/O
 * (the kernel pinned them once), which is most of an O_DIRECT submission's CPU. 0 or
 * -errno (then the ring runs with plain reads and writes). */
int ring_buffers_sparse(struct io_ring *r, unsigned n)
{
#ifdef IORING_RSRC_REGISTER_SPARSE
    struct io_uring_rsrc_register reg;
    memset(&reg, 0, sizeof(reg));
    reg.nr = n;
    reg.flags = IORING_RSRC_REGISTER_SPARSE;
    return sys_register(r->fd, IORING_REGISTER_BUFFERS2, &reg, sizeof(reg)) < 0 ? -errno : 0;
#else
    (void)r;
    (void)n;
    return -ENOSYS;
#endif
}

/* Put [base, base + len) in slot idx of the sparse table. 0 or -errno (ENOMEM: over
 * RLIMIT_MEMLOCK without CAP_IPC_LOCK; EFAULT/EINVAL: a buffer io_uring cannot pin). */
int ring_buffer_set(struct io_ring *r, unsigned idx, void *base, size_t len)
{
#ifdef IORING_RSRC_REGISTER_SPARSE
    struct iovec iov = {.iov_base = base, .iov_len = len};
    struct io_uring_rsrc_update2 up;
    memset(&up, 0, sizeof(up));
    up.offset = idx;
    up.data = (uint64_t)(uintptr_t)&iov;
    up.nr = 1;
    int ret = sys_register(r->fd, IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof(up));
    return ret < 0 ? -errno : ret == 1 ? 0 : -EINVAL;
#else
    (void)r;
    (void)idx;
    (void)base;
    (void)len;
    return -ENOSYS;
#endif
}

struct io_uring_cqe *ring_peek_cqe(struct io_ring *r)
{
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    if (head == tail)
        return NULL;
    return &r->cqes[head & *r->cq_mask];
}

void ring_cqe_seen(struct io_ring *r)
{
    __atomic_store_n(r->cq_head, *r->cq_head + 1, __ATOMIC_RELEASE);
}

int ring_probe(char *why, size_t why_len)
{
    struct io_ring r;
    int rc = ring_init(&r, 4, why, why_len);
    if (rc < 0)
        return rc;
    size_t sz = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *pr = calloc(1, sz);
    if (!pr) {
        ring_exit(&r);
        return -ENOMEM;
    }
    rc = sys_register(r.fd, IORING_REGISTER_PROBE, pr, 256);
    if (rc < 0) {
        /* IORING_REGISTER_PROBE is 5.6+, like IORING_OP_READ: no probe, no engine */
        snprintf(why, why_len, "io_uring works but IORING_REGISTER_PROBE failed (%s): kernel older than 5.6",
                 strerror(errno));
        rc = -ENOTSUP;
    } else if (pr->last_op < IORING_OP_WRITE || !(pr->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
               !(pr->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED)) {
        snprintf(why, why_len, "io_uring lacks IORING_OP_READ/WRITE (kernel older than 5.6)");
        rc = -ENOTSUP;
    } else {
        snprintf(why, why_len, "io_uring_setup works and supports IORING_OP_READ/WRITE%s",
                 (r.setup_flags & IORING_SETUP_DEFER_TASKRUN) ? " (single issuer, deferred task run)" : "");
        rc = 0;
    }
    free(pr);
    ring_exit(&r);
    return rc;
}
