/* The registration table: buffers registered for I/O, and the extent check.
 *
 * Core side; lookups are on the submission path, changes are control plane.
 * Registrations never overlap (exact duplicates are reference counted, any other
 * overlap is refused), so they are kept as a sorted array of disjoint [base, end)
 * ranges: a lookup is one binary search under a read lock, fast with the tens of
 * thousands of adjacent 16 MiB registrations LMCache makes of one tensor, and those
 * arrive in address order, so adding them appends (the memmove is empty).
 *
 * The extent rule. A registration says where memory lives (host, device, device the
 * CPU addresses, and which device): what the vendor's pointer query would say, known
 * without asking. Registrations that follow one another with no gap, of the same kind
 * of memory on the same device, are one run (LMCache registers one tensor as adjacent
 * 16 MiB regions): an extent that starts in a registration and lies in the run from
 * there is registered memory of that kind. One that runs past the run's end into memory
 * no registration holds is not refused here: its start's registration says nothing of
 * the rest, so the caller classifies the extent as it does unregistered memory (the
 * Python layer: inside the buffer it was given, by the vendor's pointer query, which
 * refuses a device extent past its allocation; libphxfile, which knows no buffer but
 * its registrations, refuses it). Refused with EFAULT before any byte moves: an extent
 * that runs from its run into another registration, adjacent but of another kind of
 * memory or device (one request moves one kind of memory), or past unregistered bytes
 * (a gap: registrations with a hole between them are not one buffer). An extent that
 * starts in no registration is the caller's to check.
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

/* 0: [addr, addr+size) lies in the run of adjacent registrations of one kind of memory
 * from the one holding addr; 1: addr is in no registration, or the extent runs past that
 * run into memory no registration holds (then out is written too: the caller's check);
 * -EFAULT: it runs from the run into another registration (another kind of memory or
 * device, adjacent, or past a gap), or wraps. out: the registration holding addr
 * (base, kind, references), its size widened to the end of the run as far as the walk
 * went: the extent's end, or the run's end where the extent runs past it. The walk is
 * as long as the registrations the extent spans. */
int phx_reg_lookup(uint64_t addr, uint64_t size, struct phx_reg_info *out)
{
    pthread_rwlock_rdlock(&reg_lock);
    size_t i = upper(addr);
    int rc = 1;
    if (i > 0 && addr < regs[i - 1].end) {
        size_t k = i - 1, j = k;
        uint64_t end = addr + size;
        if (end < addr) {
            rc = -EFAULT;
        } else {
            while (regs[j].end < end && j + 1 < nregs && regs[j + 1].base == regs[j].end &&
                   regs[j + 1].mem == regs[k].mem && regs[j + 1].device == regs[k].device)
                j++;
            if (end <= regs[j].end)
                rc = 0;
            else if (j + 1 < nregs && regs[j + 1].base < end)
                rc = -EFAULT; /* into another registration: another kind, or past a gap */
            else
                rc = 1; /* past the run into unregistered memory: the caller's to check */
        }
        if (out) {
            out->base = regs[k].base;
            out->size = regs[j].end - regs[k].base;
            out->mem = regs[k].mem;
            out->device = regs[k].device;
            out->refs = regs[k].refs;
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
