/* The registration table: buffers registered for I/O, and the extent check.
 *
 * Core side; lookups are on the submission path, changes are control plane.
 * Registrations never overlap (exact duplicates are reference counted, any other
 * overlap is refused), so they are kept as a sorted array of disjoint [base, end)
 * ranges: a lookup is one binary search under a read lock, fast with the tens of
 * thousands of adjacent 16 MiB registrations LMCache makes of one tensor, and those
 * arrive in address order, so adding them appends (the memmove is empty).
 *
 * The extent rule (phoenix's, like the original's): an I/O extent that starts inside
 * a registration must end inside it; otherwise the request is refused with EFAULT
 * before any byte moves. An extent that starts in no registration is the caller's to
 * check (the Python layer checks it against the buffer object it was given).
 *
 * Beside it, phx_mem_probe: is a raw (pointer, size) host buffer readable memory at all.
 */
#include "io_common.h"
#include "io_fork.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

struct reg {
    uint64_t base, end;
    int32_t mem, device, refs;
};

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct reg *regs;
static size_t nregs, capregs;

/* Index of the first registration with base > addr. */
static size_t upper(uint64_t addr)
{
    size_t lo = 0, hi = nregs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (regs[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int phx_reg_add(uint64_t base, uint64_t size, int mem, int device)
{
    if (!size || base + size < base)
        return -EINVAL;
    uint64_t end = base + size;
    pthread_rwlock_wrlock(&reg_lock);
    size_t i = upper(base); /* regs[i-1].base <= base < regs[i].base */
    int rc;
    if (i > 0 && regs[i - 1].base == base && regs[i - 1].end == end) {
        regs[i - 1].refs++;
        rc = 1;
    } else if ((i > 0 && regs[i - 1].end > base) || (i < nregs && regs[i].base < end)) {
        rc = -EINVAL;
    } else {
        if (nregs == capregs) {
            size_t cap = capregs ? capregs * 2 : 256;
            struct reg *n = realloc(regs, cap * sizeof(*n));
            if (!n) {
                pthread_rwlock_unlock(&reg_lock);
                return -ENOMEM;
            }
            regs = n;
            capregs = cap;
        }
        memmove(&regs[i + 1], &regs[i], (nregs - i) * sizeof(*regs));
        regs[i] = (struct reg){base, end, mem, device, 1};
        nregs++;
        STAT_ADD(registrations, 1);
        rc = 0;
    }
    pthread_rwlock_unlock(&reg_lock);
    return rc;
}

int phx_reg_remove(uint64_t base)
{
    pthread_rwlock_wrlock(&reg_lock);
    size_t i = upper(base);
    int rc;
    if (i == 0 || regs[i - 1].base != base) {
        rc = -ENOENT;
    } else if ((rc = --regs[i - 1].refs) == 0) {
        memmove(&regs[i - 1], &regs[i], (nregs - i) * sizeof(*regs));
        nregs--;
        STAT_ADD(registrations, -1);
    }
    pthread_rwlock_unlock(&reg_lock);
    return rc;
}

int phx_reg_lookup(uint64_t addr, uint64_t size, struct phx_reg_info *out)
{
    pthread_rwlock_rdlock(&reg_lock);
    size_t i = upper(addr);
    int rc = 1;
    if (i > 0 && addr < regs[i - 1].end) {
        struct reg *r = &regs[i - 1];
        rc = (addr + size > r->end || addr + size < addr) ? -EFAULT : 0;
        if (out) {
            out->base = r->base;
            out->size = r->end - r->base;
            out->mem = r->mem;
            out->device = r->device;
            out->refs = r->refs;
            out->reserved = 0;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
    return rc;
}

int phx_reg_clear(void)
{
    pthread_rwlock_wrlock(&reg_lock);
    int n = (int)nregs;
    STAT_ADD(registrations, -(int64_t)nregs);
    nregs = 0;
    free(regs);
    regs = NULL;
    capregs = 0;
    pthread_rwlock_unlock(&reg_lock);
    return n;
}

/* ---- fork (io_fork.c): the table stays, its lock is the child's own -------------------- */

void reg_fork(int phase)
{
    if (phase == IO_FORK_PREPARE)
        pthread_rwlock_wrlock(&reg_lock);
    else if (phase == IO_FORK_PARENT)
        pthread_rwlock_unlock(&reg_lock);
    else
        pthread_rwlock_init(&reg_lock, NULL);
}

/* ---- the memory probe (raw host buffers) ---------------------------------------------- */

int phx_mem_probe(uint64_t addr, uint64_t size)
{
    if (!size)
        return 0;
    if (!addr || addr + size < addr)
        return -EFAULT;
    char b[2];
    struct iovec local[2] = {{&b[0], 1}, {&b[1], 1}};
    struct iovec remote[2] = {{(void *)(uintptr_t)addr, 1}, {(void *)(uintptr_t)(addr + size - 1), 1}};
    ssize_t n = process_vm_readv(getpid(), local, 2, remote, 2, 0);
    if (n == 2)
        return 0;
    if (n < 0 && (errno == ENOSYS || errno == EPERM))
        return -ENOSYS;
    return -EFAULT;
}
