/* Reference transfers for `phx bench`: raw O_DIRECT and the naive loop, in C.
 *
 * Benchmark side, not the data path: built by setup.py as libphxbench.so, a plain shared
 * library of the bench subpackage (phoenix/bench/raw.py loads it with ctypes), never into
 * the core. These are the peers every phoenix figure is divided by, so they must be as
 * good as a careful user would write them, and free of Python overhead:
 *
 *   phxbench_raw      raw O_DIRECT pread/pwrite into host memory, `threads` threads
 *                     each with one request in flight, chunks handed out by an atomic
 *                     counter (sequential) or drawn at random (random reads).
 *   phxbench_raw_shared  (diagnostics) random O_DIRECT reads as phxbench_raw, landing
 *                     round robin in one caller-given region instead of a buffer per thread.
 *   phxbench_naive    the naive staging loop: pread a chunk into host memory, then a
 *                     synchronous copy to the device through the vendor's memcpy_async
 *                     + stream_synchronize, one chunk at a time per thread.
 *
 * Each reports bytes moved and fills an error string on failure. The naive loop copies
 * through the vendor's data-path table (phx_vendor.h), so the library links nothing else.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "phx_vendor.h"

struct rb_job {
    int fd;
    int write;
    int random;
    size_t chunk;
    uint64_t size;      /* bytes of the file region used */
    uint64_t nops;      /* random: number of operations in total */
    uint64_t next;      /* atomic: next chunk index / op count */
    int err;            /* first errno */
    uint64_t moved;     /* atomic */
    char *shared;       /* random reads into one region shared by all threads: op i lands */
    size_t shared_len;  /* at (i % (shared_len / chunk)) * chunk (NULL: a buffer per thread) */
    /* naive staging */
    const struct phx_dp_table *dp;
    char *dev;          /* device buffer of `size` bytes (naive) */
    int device;
};

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    return *s = x;
}

static void *rb_worker(void *arg) {
    struct rb_job *j = arg;
    void *buf = NULL;
    void *stream = NULL;
    /* Huge-page backed (2 MiB aligned, MADV_HUGEPAGE) so that the raw rate measured here
     * is not lowered by scattered 4 KiB pages: a DMA segment per physically contiguous run,
     * and a virtio/NVMe request takes a bounded number of segments. */
    size_t span = (j->chunk + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    if (posix_memalign(&buf, 2u << 20, span)) { __atomic_store_n(&j->err, ENOMEM, __ATOMIC_RELAXED); return NULL; }
    madvise(buf, span, MADV_HUGEPAGE);
    memset(buf, 0x5a, j->chunk);
    if (j->dp) {
        if (j->dp->set_device(j->device) != j->dp->success ||
            j->dp->host_register(buf, j->chunk, j->dp->host_register_flags) != j->dp->success ||
            j->dp->stream_create(&stream, j->dp->stream_flags) != j->dp->success) {
            __atomic_store_n(&j->err, EIO, __ATOMIC_RELAXED);
            free(buf);
            return NULL;
        }
    }
    uint64_t seed = (uint64_t)(uintptr_t)&seed ^ 0x9e3779b97f4a7c15ull;
    uint64_t nchunks = (j->size + j->chunk - 1) / j->chunk;
    for (;;) {
        if (__atomic_load_n(&j->err, __ATOMIC_RELAXED)) break;
        uint64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        uint64_t off;
        size_t n = j->chunk;
        if (j->random) {
            if (i >= j->nops) break;
            off = (xorshift(&seed) % (j->size / j->chunk)) * j->chunk;
        } else {
            if (i >= nchunks) break;
            off = i * j->chunk;
            if (off + n > j->size) n = j->size - off;
        }
        size_t done = 0;
        while (done < n) {
            char *dst = j->shared ? j->shared + (i % (j->shared_len / j->chunk)) * j->chunk : (char *)buf;
            ssize_t r = j->write ? pwrite(j->fd, (char *)buf + done, n - done, off + done)
                                 : pread(j->fd, dst + done, n - done, off + done);
            if (r < 0) { if (errno == EINTR) continue; __atomic_store_n(&j->err, errno, __ATOMIC_RELAXED); break; }
            if (r == 0) { __atomic_store_n(&j->err, ENODATA, __ATOMIC_RELAXED); break; }
            done += (size_t)r;
        }
        if (j->dp && done == n) {
            if (j->dp->memcpy_async(j->dev + (j->random ? 0 : off), buf, n, j->dp->kind_h2d, stream) != j->dp->success ||
                j->dp->stream_synchronize(stream) != j->dp->success) {
                __atomic_store_n(&j->err, EIO, __ATOMIC_RELAXED);
            }
        }
        __atomic_fetch_add(&j->moved, done, __ATOMIC_RELAXED);
    }
    if (j->dp) {
        j->dp->stream_destroy(stream);
        j->dp->host_unregister(buf);
    }
    free(buf);
    return NULL;
}

static int64_t rb_run(struct rb_job *j, int threads, char *err, size_t errlen) {
    if (threads < 1 || threads > 1024 || j->chunk == 0 || j->size == 0 || (j->random && j->size < j->chunk)) {
        snprintf(err, errlen, "bad arguments (threads %d, chunk %zu, size %llu)", threads, j->chunk,
                 (unsigned long long)j->size);
        return -EINVAL;
    }
    pthread_t *tids = calloc((size_t)threads, sizeof(*tids));
    if (!tids) return -ENOMEM;
    int started = 0;
    for (; started < threads; started++)
        if (pthread_create(&tids[started], NULL, rb_worker, j)) break;
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    free(tids);
    if (j->err) {
        snprintf(err, errlen, "%s", strerror(j->err));
        return -j->err;
    }
    return (int64_t)j->moved;
}

/* Raw O_DIRECT (or buffered, odirect=0) transfer between `path` and host memory.
 * Returns bytes moved or a negative errno (message in err). */
int64_t phxbench_raw(const char *path, int write, int random, uint64_t size, size_t chunk, int threads,
                     uint64_t nops, int odirect, char *err, size_t errlen) {
    int fd = open(path, (write ? O_WRONLY : O_RDONLY) | (odirect ? O_DIRECT : 0));
    if (fd < 0) {
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -errno;
    }
    struct rb_job j = {.fd = fd, .write = write, .random = random, .chunk = chunk, .size = size, .nops = nops};
    int64_t r = rb_run(&j, threads, err, errlen);
    if (write && r > 0 && fdatasync(fd) < 0) r = -errno;
    close(fd);
    return r;
}

/* Diagnostics (benchmarks/h200_diag.py rand): random O_DIRECT reads as phxbench_raw, but
 * every thread's reads land round robin in the caller's region `shared` of `shared_len`
 * bytes (touched beforehand, so that no page fault is timed), as a read_many's
 * destinations do: what the destinations' spread costs the disk path. */
int64_t phxbench_raw_shared(const char *path, uint64_t size, size_t chunk, int threads, uint64_t nops,
                            void *shared, size_t shared_len, char *err, size_t errlen) {
    if (chunk == 0 || !shared || shared_len < chunk || (uintptr_t)shared % 4096) {
        snprintf(err, errlen, "bad arguments (chunk %zu, shared %p + %zu)", chunk, shared, shared_len);
        return -EINVAL;
    }
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -errno;
    }
    struct rb_job j = {.fd = fd, .random = 1, .chunk = chunk, .size = size, .nops = nops,
                       .shared = shared, .shared_len = shared_len};
    int64_t r = rb_run(&j, threads, err, errlen);
    close(fd);
    return r;
}

/* The naive staging loop: pread into pinned host memory, synchronous copy to `dev`. */
int64_t phxbench_naive(const struct phx_dp_table *dp, int device, void *dev, const char *path, int random,
                       uint64_t size, size_t chunk, int threads, uint64_t nops, int odirect, char *err,
                       size_t errlen) {
    int fd = open(path, O_RDONLY | (odirect ? O_DIRECT : 0));
    if (fd < 0) {
        snprintf(err, errlen, "open %s: %s", path, strerror(errno));
        return -errno;
    }
    struct rb_job j = {.fd = fd, .random = random, .chunk = chunk, .size = size, .nops = nops,
                       .dp = dp, .dev = dev, .device = device};
    int64_t r = rb_run(&j, threads, err, errlen);
    close(fd);
    return r;
}
