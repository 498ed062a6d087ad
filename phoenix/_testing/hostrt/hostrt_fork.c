/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: fork().
 *
 * Test side (a vendor runtime's test double, outside the C core), part of
 * libphxhostrt.so and of every emulator. This file: the atfork handlers (hostrt.h says
 * what a child finds). A child has only the thread that forked, so a lock another thread
 * held at the fork would stay held there, and the stream workers are gone. prepare takes
 * every lock of the runtime that a call can reach, in one order: g_streams_mu, each
 * stream's mu, g_events_mu, each event's mu, g_mem. No thread holds one of them while it
 * waits for another (they are never nested but here; a stream's worker runs its copies
 * and host functions with none held, and a condition wait lets its lock go), so prepare
 * always gets them. parent lets them go; child makes them fresh, bumps the fork
 * generation and drops what only the parent's threads would have finished (the queued
 * work of the streams, hostrt_stream.c; the events' records, hostrt_event.c).
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

uint64_t g_fork_gen;

static void fork_prepare(void)
{
    streams_fork(FORK_PREPARE);
    events_fork(FORK_PREPARE);
    mem_fork(FORK_PREPARE);
}

static void fork_parent(void)
{
    mem_fork(FORK_PARENT);
    events_fork(FORK_PARENT);
    streams_fork(FORK_PARENT);
}

static void fork_child(void)
{
    g_fork_gen++;
    mem_fork(FORK_CHILD); /* first: dropping the streams' work unpins ranges (g_mem) */
    events_fork(FORK_CHILD);
    streams_fork(FORK_CHILD);
}

__attribute__((constructor)) static void hostrt_fork_init(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }
