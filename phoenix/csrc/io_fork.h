/* fork(): what a child process finds of the core (io_fork.c; phx_io.h states the contract).
 *
 * Core side, control plane. The child of a fork has one thread, the one that forked: the
 * workers, registrars and stream callbacks of the parent are gone, and a lock that one of
 * them held at the fork would stay held for good. So the process-global locks are taken
 * around the fork (pthread_atfork), and every object the parent made is stamped with the
 * fork generation it was made in: a child (its generation bumped) recognises a parent's
 * context, request, stream op or fence and never waits for it.
 */
#ifndef PHX_IO_FORK_H
#define PHX_IO_FORK_H

#include "io_common.h"

struct phx_ctx;

#pragma GCC visibility push(hidden)
/* Bumped in the child of every fork (before any other thread of the child exists). */
extern _Atomic uint64_t io_fork_gen;
/* A phase of a fork, for the hooks of the files that hold process-global state. */
enum { IO_FORK_PREPARE = 0, IO_FORK_PARENT = 1, IO_FORK_CHILD = 2 };
/* PREPARE takes the file's global lock (the forking thread then holds it), PARENT
 * releases it, CHILD makes it a fresh lock and drops what only the parent's threads
 * would ever finish. io_reg.c (the registration table), io_swrite.c (stream-ordered
 * writes listed), io_fmap_guard.c (the fault guard's table). */
void reg_fork(int phase);
void sw_fork(int phase);
void fg_fork(int phase);
/* A parent's phx_file used in the child: its lock (a parent's thread may have held it) is
 * made fresh and its in-flight count, which only the parent's requests would have brought
 * down, is reset; once per file and generation (file_own does the check). */
void file_fork_adopt(phx_file *f);
/* Start a thread of the core with the asynchronous signals blocked in it (SIGINT,
 * SIGTERM, SIGCHLD, ...: a process-directed signal goes to a thread that does not block
 * it, which should be one of the application's, Python's main thread for a handler
 * written in Python); the synchronous ones a thread raises itself (SIGBUS of a copy from
 * a truncated mapping: the fault guard; SIGSEGV, ...) stay deliverable. */
int io_thread_create(pthread_t *th, void *(*fn)(void *), void *arg);
#pragma GCC visibility pop

static inline uint64_t io_gen(void) { return atomic_load_explicit(&io_fork_gen, memory_order_relaxed); }

#endif
