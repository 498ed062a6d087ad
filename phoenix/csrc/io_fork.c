/* fork(): the core's process-global locks around a fork, and what a child finds.
 *
 * Core side, control plane (the atfork handlers run in the forking thread). phx_io.h
 * ("fork") states the contract; here is how it is kept.
 *
 * Locks. A child has only the thread that forked: a lock some other thread held at the
 * fork would stay held in the child for good, and the state it guards would be half
 * changed. Each process-global lock of the core is taken in `prepare` (so no other
 * thread is inside it when the address space is copied), released in `parent`, and made
 * a fresh lock in `child` (a plain re-init: the child's thread is not the owner the lock
 * recorded). They are, in the order prepare takes them:
 *
 *   reg_lock   io_reg.c          the registration table (kept: its memory is the child's too)
 *   sw_mu      io_swrite.c       stream-ordered writes listed (dropped in the child)
 *   fg_mu      io_fmap_guard.c   the fault guard's table of mappings (kept)
 *   adopt_mu   here              a parent's files taken over by the child (file_fork_adopt)
 *
 * None of them is held while its holder waits for another lock, a condition, a futex or
 * the GIL (their critical sections are a table update, a list update, a sigaction), so
 * prepare, which runs in the forking thread (holding the GIL when Python forks), always
 * gets them: no order among them can deadlock, and the order above is the one kept.
 * libphxfile's lock that is held around calls into the core (regs_lock, held around
 * phx_reg_add) is taken by libphxfile's own prepare, which runs before this one (it is
 * registered after the core is loaded: prepare handlers run last registered first).
 * The locks of a context (its queues, pool, fences, fmap, workers) are not taken: a
 * parent's context is dead in the child (its threads do not exist) and the child touches
 * none of them (below).
 *
 * Objects. The child bumps io_fork_gen; contexts, files, requests and stream ops carry
 * the generation they were made in, so the child recognises the parent's:
 *   a context    its submission calls say -ECHILD; phx_ctx_destroy forgets it (no
 *                waiting, no joining: it leaks);
 *   a request or stream op not done at the fork: done at once for the child, result
 *                -ECHILD (its workers and stream callbacks do not exist here); done ones
 *                keep their results;
 *   a fence      its last release leaks it (its context's free list is the parent's);
 *   a file       taken over at its first use (file_fork_adopt): usable on a new context.
 * The counters of things the child does not have (threads, requests and stream ops in
 * flight) start from zero.
 */
#include "io_file.h"
#include "io_fork.h"

#include <signal.h>

_Atomic uint64_t io_fork_gen;

static pthread_mutex_t adopt_mu = PTHREAD_MUTEX_INITIALIZER;

void file_fork_adopt(phx_file *f)
{
    uint64_t gen = io_gen();
    pthread_mutex_lock(&adopt_mu);
    if (atomic_load_explicit(&f->gen, memory_order_acquire) != gen) {
        /* the parent's threads that held f->mu or counted requests in are gone */
        pthread_mutex_init(&f->mu, NULL);
        pthread_cond_init(&f->cv, NULL);
        f->inflight = 0;
        f->closing = 0;
        atomic_store(&f->known_size, 0);
        atomic_store_explicit(&f->gen, gen, memory_order_release);
    }
    pthread_mutex_unlock(&adopt_mu);
}

int io_thread_create(pthread_t *th, void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    sigfillset(&all);
    /* the signals a thread raises itself: blocked, the kernel would kill the process */
    static const int sync_sigs[] = {SIGBUS, SIGSEGV, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
    for (size_t i = 0; i < sizeof(sync_sigs) / sizeof(sync_sigs[0]); i++)
        sigdelset(&all, sync_sigs[i]);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(th, NULL, fn, arg); /* the new thread inherits the mask */
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

static void fork_prepare(void)
{
    reg_fork(IO_FORK_PREPARE);
    sw_fork(IO_FORK_PREPARE);
    fg_fork(IO_FORK_PREPARE);
    pthread_mutex_lock(&adopt_mu);
}

static void fork_parent(void)
{
    pthread_mutex_unlock(&adopt_mu);
    fg_fork(IO_FORK_PARENT);
    sw_fork(IO_FORK_PARENT);
    reg_fork(IO_FORK_PARENT);
}

static void fork_child(void)
{
    atomic_fetch_add(&io_fork_gen, 1);
    pthread_mutex_init(&adopt_mu, NULL);
    fg_fork(IO_FORK_CHILD);
    sw_fork(IO_FORK_CHILD);
    reg_fork(IO_FORK_CHILD);
    /* none of the parent's threads exists here, and none of its requests or stream ops in
     * flight will ever complete (and count itself out) */
    atomic_store(&io_stats.threads, 0);
    atomic_store(&io_stats.requests, 0);
    atomic_store(&io_stats.stream_ops, 0);
}

__attribute__((constructor)) static void io_fork_init(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }
