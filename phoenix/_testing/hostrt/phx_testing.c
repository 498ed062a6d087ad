/* Test hooks of the host test-double library: the stream host callback (phx_testing.h).
 *
 * Test side, data path: runs on a stream's worker (or a real runtime's callback
 * thread), so it never touches Python or the accelerator runtime. Linked into
 * libphxhostrt.so beside hostrt.c, never into the C core or an emulator.
 */
#define _GNU_SOURCE
#include "phx_testing.h"

#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void phx_testing_hostfn(void *arg)
{
    struct phx_testing_hostfn *t = arg;
    int64_t res;
    if (t->kind == 2) { /* a gate: hold the stream until *(int64_t *)src != 0 */
        volatile int64_t *gate = (volatile int64_t *)(uintptr_t)t->src;
        struct timespec ts = {0, 200000};
        while (!__atomic_load_n(gate, __ATOMIC_ACQUIRE))
            nanosleep(&ts, NULL);
        res = 0;
    } else if (t->kind == 3) { /* hold the stream for size microseconds */
        struct timespec ts = {(time_t)(t->size / 1000000), (long)(t->size % 1000000) * 1000};
        nanosleep(&ts, NULL);
        res = 0;
    } else if (t->kind == 0) {
        memcpy((void *)(uintptr_t)t->dst, (const void *)(uintptr_t)t->src, t->size);
        res = (int64_t)t->size;
    } else {
        ssize_t n = pread(t->fd, (void *)(uintptr_t)t->dst, t->size, t->offset);
        res = n < 0 ? -errno : n;
    }
    t->result = res;
    t->seq = t->counter ? __atomic_fetch_add(t->counter, 1, __ATOMIC_SEQ_CST) : 0;
}
