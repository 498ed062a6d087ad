/* The fault guard of the file-mapping cache: a copy from a mapping never kills the process.
 *
 * Core side, data path (any thread that copies from a mapping, through the SIGBUS
 * handler; the cache's registrar lists and unlists mappings).
 *
 * A page of a mapping past the end of its file raises SIGBUS when the CPU touches it: a
 * file truncated (by anyone) while a copy from its window runs -- a CPU copy, as the host
 * vendor's stream workers and the emulators make (a DMA from the pinned pages does not
 * fault, it reads the pages the truncation dropped). Every mapped window is listed here,
 * and a SIGBUS handler (installed with the first window, in front of whatever handler was
 * there) maps anonymous zero pages over the window from the faulting page to its end and
 * returns: the copy goes on and reads zeros. The window is marked poisoned: fmap_plan and
 * phx_fmap_lookup drop it, and a request that copied from it counts only the bytes before
 * the poisoned page less one page (the page holding the file's new end reads zeros past
 * it): fmap_req_copied. A fault elsewhere is not ours: the handler steps aside (restores
 * the previous action) and the access repeats into it. Async-signal-safe: the handler
 * reads atomics and calls mmap and sigaction. Only contexts whose vendor copies with the
 * CPU (PHX_CFG_CPU_COPIES: test doubles) list windows and install the handler: hardware
 * copies are DMAs, and an application's own SIGBUS handling is left alone there. */
#include "io_fmap.h"
#include "io_fork.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FG_SLOTS 65536u /* mapped windows at most (128 GiB of 2 MiB windows); more are not registered */
struct fg_slot {
    _Atomic uintptr_t lo, hi;  /* the mapping [lo, hi); lo 0: free */
    _Atomic uintptr_t poison;  /* lowest page zero-mapped by the handler; 0: none */
};
static _Atomic(struct fg_slot *) fg_tab;     /* FG_SLOTS, made once, never freed */
static pthread_mutex_t fg_mu = PTHREAD_MUTEX_INITIALIZER; /* slot writers; installing */
static _Atomic int64_t fg_poisoned;          /* live poisoned slots: 0 skips every check */
static _Atomic int fg_stepped;               /* stepped aside for a fault not ours */
static struct sigaction fg_prev;             /* the action before ours */
static uintptr_t fg_page;

static unsigned fg_hash(uintptr_t a) { return (unsigned)(((uint64_t)a * 0x9e3779b97f4a7c15ull) >> 48) % FG_SLOTS; }

static void fg_handler(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    struct fg_slot *t = atomic_load_explicit(&fg_tab, memory_order_acquire);
    if (si && si->si_code > 0 && t && !atomic_load(&fg_stepped)) { /* a fault, not a kill() */
        uintptr_t a = (uintptr_t)si->si_addr;
        for (unsigned i = 0; i < FG_SLOTS; i++) {
            uintptr_t lo = atomic_load_explicit(&t[i].lo, memory_order_acquire);
            if (!lo || a < lo || a >= atomic_load_explicit(&t[i].hi, memory_order_acquire))
                continue;
            uintptr_t page = a & ~(fg_page - 1), hi = atomic_load(&t[i].hi);
            /* poisoned before the zero pages are mapped: another thread copying from this
             * window that reads them (no fault) finds its count cut when it looks */
            uintptr_t cur = atomic_load(&t[i].poison);
            while ((!cur || page < cur) && !atomic_compare_exchange_weak(&t[i].poison, &cur, page))
                ;
            if (!cur)
                atomic_fetch_add(&fg_poisoned, 1);
            if (mmap((void *)page, hi - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
                MAP_FAILED)
                break; /* the fault stands: the previous action takes it */
            return;
        }
    }
    /* not ours: the previous action takes it (the faulting access repeats into it, a
     * kill() is sent again); once only, so that two handlers that each took the other
     * for the previous one cannot pass a fault back and forth */
    if (atomic_exchange(&fg_stepped, 1)) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
    } else {
        sigaction(sig, &fg_prev, NULL);
    }
    if (!si || si->si_code <= 0)
        raise(sig);
}

/* Ours in front (fg_mu held): again whenever another handler took SIGBUS since (Python's
 * faulthandler.enable()); that one becomes the previous. */
static void fg_install_locked(void)
{
    struct sigaction cur, sa;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == fg_handler)
        return;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = fg_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    fg_prev = cur;
    atomic_store(&fg_stepped, 0);
    sigaction(SIGBUS, &sa, NULL);
}

/* Before a hit copies: the handler is still ours. */
void fg_ensure(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == fg_handler)
        return;
    pthread_mutex_lock(&fg_mu);
    fg_install_locked();
    pthread_mutex_unlock(&fg_mu);
}

/* List a mapping (before any copy can read it); -ENOSPC when the table is full. */
int fg_add(char *addr, uint64_t len)
{
    pthread_mutex_lock(&fg_mu);
    struct fg_slot *t = atomic_load(&fg_tab);
    if (!t) {
        void *p = mmap(NULL, FG_SLOTS * sizeof(*t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            pthread_mutex_unlock(&fg_mu);
            return -ENOMEM;
        }
        fg_page = (uintptr_t)sysconf(_SC_PAGESIZE);
        t = p;
        atomic_store_explicit(&fg_tab, t, memory_order_release);
    }
    fg_install_locked();
    int rc = -ENOSPC;
    for (unsigned k = 0, i = fg_hash((uintptr_t)addr); k < FG_SLOTS; k++, i = (i + 1) % FG_SLOTS) {
        if (atomic_load(&t[i].lo))
            continue;
        atomic_store(&t[i].poison, 0);
        atomic_store(&t[i].hi, (uintptr_t)addr + len);
        atomic_store_explicit(&t[i].lo, (uintptr_t)addr, memory_order_release);
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&fg_mu);
    return rc;
}

/* The slot of a listed mapping (probing from its hash: fg_add put it at the first free
 * slot from there, and it stays until fg_remove). */
static struct fg_slot *fg_find(const char *addr)
{
    struct fg_slot *t = atomic_load_explicit(&fg_tab, memory_order_acquire);
    for (unsigned k = 0, i = fg_hash((uintptr_t)addr); t && k < FG_SLOTS; k++, i = (i + 1) % FG_SLOTS)
        if (atomic_load_explicit(&t[i].lo, memory_order_acquire) == (uintptr_t)addr)
            return &t[i];
    return NULL;
}

/* Unlist a mapping, before it is unmapped (the handler must never map over an address
 * that may be reused). */
void fg_remove(char *addr)
{
    pthread_mutex_lock(&fg_mu);
    struct fg_slot *sl = fg_find(addr);
    if (sl) {
        atomic_store(&sl->lo, 0);
        atomic_store(&sl->hi, 0);
        if (atomic_exchange(&sl->poison, 0))
            atomic_fetch_sub(&fg_poisoned, 1);
    }
    pthread_mutex_unlock(&fg_mu);
}

/* The file offset from which bytes copied from a READY window may not be the file's (the
 * handler zero-mapped them; one page early: see above), or INT64_MAX. */
int64_t fg_valid_end(const struct io_fwin *w)
{
    if (!atomic_load_explicit(&fg_poisoned, memory_order_acquire) || !w->addr)
        return INT64_MAX;
    struct fg_slot *sl = fg_find(w->addr);
    uintptr_t p = sl ? atomic_load(&sl->poison) : 0;
    if (!p)
        return INT64_MAX;
    /* (a page before the window when p is its first: that page, the previous window's
     * last, may be the one holding the file's new end) */
    return w->off + (int64_t)(p - (uintptr_t)w->addr) - (int64_t)fg_page;
}

/* fork (io_fork.c): the mappings listed stay mapped in the child (and listed), the handler
 * installed; the lock is the child's own. */
void fg_fork(int phase)
{
    if (phase == IO_FORK_PREPARE)
        pthread_mutex_lock(&fg_mu);
    else if (phase == IO_FORK_PARENT)
        pthread_mutex_unlock(&fg_mu);
    else
        pthread_mutex_init(&fg_mu, NULL);
}
