/* Completion flags (futex words) and clocks.
 *
 * Core side, data path: set by workers and stream callbacks, waited on by the caller's
 * threads (phx_req_wait, phx_sop_wait). No lock: one atomic word per flag, and a futex
 * system call only when a waiter sleeps on it.
 */
#include "io_sync.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

static int futex_wait(_Atomic uint32_t *word, uint32_t val, const struct timespec *rel)
{
    return (int)syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, rel, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

int64_t io_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

int64_t io_deadline_ns(int64_t timeout_ns)
{
    int64_t now = io_now_ns();
    return timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
}

struct timespec io_realtime_in(int64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t nsec = (int64_t)ts.tv_nsec + ns % 1000000000ll;
    ts.tv_sec += (time_t)(ns / 1000000000ll + nsec / 1000000000ll);
    ts.tv_nsec = (long)(nsec % 1000000000ll);
    return ts;
}

int io_flag_is_set(const _Atomic uint32_t *word)
{
    return atomic_load_explicit((_Atomic uint32_t *)word, memory_order_acquire) == FLAG_SET;
}

/* Wait until the flag is set. */
int io_wait_flag(_Atomic uint32_t *word, int64_t timeout_ns)
{
    int64_t deadline = timeout_ns >= 0 ? io_deadline_ns(timeout_ns) : 0;
    for (;;) {
        uint32_t v = atomic_load_explicit(word, memory_order_acquire);
        if (v == FLAG_SET)
            return 0;
        if (v == FLAG_PENDING &&
            !atomic_compare_exchange_weak_explicit(word, &v, FLAG_WAITED, memory_order_acq_rel, memory_order_acquire))
            continue; /* set (or marked) meanwhile: look again */
        struct timespec rel, *tp = NULL;
        if (timeout_ns >= 0) {
            int64_t left = deadline - io_now_ns();
            if (left <= 0)
                return -ETIMEDOUT;
            rel.tv_sec = left / 1000000000ll;
            rel.tv_nsec = left % 1000000000ll;
            tp = &rel;
        }
        futex_wait(word, FLAG_WAITED, tp);
    }
}

void io_set_flag(_Atomic uint32_t *word)
{
    if (atomic_exchange_explicit(word, FLAG_SET, memory_order_acq_rel) == FLAG_WAITED)
        futex_wake_all(word);
}
