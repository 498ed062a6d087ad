/* Completion flags and clocks (io_sync.c).
 *
 * Core side, data path. A completion flag is a futex word: requests and stream ops
 * each have one; any thread sets it (a worker, a stream callback), any thread waits.
 */
#ifndef PHX_IO_SYNC_H
#define PHX_IO_SYNC_H

#include <time.h>

#include "io_common.h"

/* A completion flag: 0 pending, 2 pending with a waiter asleep on it, 1 set. The setter
 * makes the futex call only when someone sleeps (most requests are waited for after they
 * completed, or by nobody: a system call per request saved on the workers). A flag set
 * before anyone can see it may be stored FLAG_SET directly (no wake owed). */
enum { FLAG_PENDING = 0, FLAG_SET = 1, FLAG_WAITED = 2 };

#pragma GCC visibility push(hidden)
/* Wait until set (-ETIMEDOUT after timeout_ns >= 0); is it set; set it (a futex wake
 * only if a waiter sleeps). */
int io_wait_flag(_Atomic uint32_t *word, int64_t timeout_ns);
int io_flag_is_set(const _Atomic uint32_t *word);
void io_set_flag(_Atomic uint32_t *word);
/* CLOCK_MONOTONIC in nanoseconds. */
int64_t io_now_ns(void);
/* io_now_ns() + timeout_ns (>= 0), saturated at INT64_MAX (no signed overflow). */
int64_t io_deadline_ns(int64_t timeout_ns);
/* The CLOCK_REALTIME time `ns` from now: a deadline for pthread_cond_timedwait (the
 * core's condition variables wait on CLOCK_REALTIME). */
struct timespec io_realtime_in(int64_t ns);
#pragma GCC visibility pop

#endif
