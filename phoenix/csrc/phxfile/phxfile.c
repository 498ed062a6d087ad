/* libphxfile.so: the frozen phxFile* ABI (phxfile.h) on phoenix's I/O core.
 *
 * Adapter. LMCache's `phx` GDS backend loads this library with ctypes inside a Python
 * process and calls it without calling phxFileDriverOpen first, so every entry point
 * opens the driver lazily. Opening asks Python (phoenix/phxfile.py, through the CPython
 * C API under PyGILState_Ensure) for what only the control plane knows: the vendor
 * selected by PHX_VENDOR, a core context built with that vendor's data-path table, and
 * the core's entry points (the C core phoenix._phxcore already loaded in the process:
 * one registration table, one host-vendor arena). Buffer registration asks Python where
 * the memory lives (host, device, device the CPU can address), every time: nothing is
 * cached, since an allocation freed and made again at the same address (another size,
 * another kind) is seen by no call of this library.
 *
 * The I/O path (phxFileReadAsync / phxFileWriteAsync) never takes the GIL for a
 * registered buffer: a registration lookup (binary search in the core), then
 * phx_stream_io, which queues the transfer on the caller's stream with the vendor's
 * launch_host_func; *bytes_done is bound when the stream gets there. An unregistered
 * buffer is classified through Python (slow path, like cuFile's unregistered buffers).
 *
 * The CPython API is resolved with dlsym at open time: the library has no link-time
 * dependency on libpython, and outside a Python process every call says -ENOSYS.
 *
 * Extent rule: [buf_base + buf_offset, +nbytes) must lie inside the registrations of
 * buf_base: the one that holds it and those that follow it with no gap, of the same
 * kind of memory on the same device (LMCache registers one tensor as adjacent regions;
 * an extent may span them). For an unregistered buf_base the extent must not start
 * inside a registration and run past such a run, and host memory must be mapped.
 * Otherwise -EFAULT at submission, nothing moves: a registration is the only end of a
 * buffer this ABI knows (there is no buffer size), so the memory past it is not taken
 * on trust. nbytes and file_offset + nbytes stay below 2^63 (-EINVAL). A host-memory
 * registration must be mapped when it is made (-EFAULT).
 *
 * Locks and the GIL. The GIL is no ordinary lock: Python code run under it (the driver's
 * open asks phoenix.phxfile, which imports, calls ctypes functions, ...) lets it go and
 * takes it back at any time, so a thread that waits for a C lock while it holds the GIL
 * deadlocks with the holder of that lock waiting for the GIL. Hence the rule: nobody
 * blocks on a lock of this file while holding the GIL. open_lock (serializes open and
 * close, and what they ask Python) is taken with the GIL let go for the wait
 * (open_lock_take), so its order is open_lock, then the GIL; state_lock and regs_lock
 * are taken without the GIL (or without waiting) and held across no GIL
 * acquisition. The I/O path of a registered buffer takes only state_lock (shared), and
 * never the GIL. Calls work from any thread (a Python thread, with or without the GIL, or
 * a thread Python never saw); once the interpreter is finalizing, Python is asked nothing
 * (-ESHUTDOWN where it would have to be).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../phx_io.h"
#include "phxfile.h"

#define PHXFILE_API __attribute__((visibility("default")))

/* ---- what Python hands over (phoenix/phxfile.py: _CoreTable, _Class) ---------------- */

#define PHXFILE_CORE_ABI 1

struct phxfile_core {
    uint32_t abi;  /* PHXFILE_CORE_ABI (set here, checked there) */
    int32_t mode;  /* enum phx_mode for every op (PHX_MODE) */
    uint64_t ctx;  /* phx_ctx *, owned by this library until DriverClose */
    uint64_t file_from_fd, file_close, stream_io, reg_add, reg_remove, reg_lookup, ctx_destroy;
};

struct phxfile_class {
    int32_t mem, device; /* enum phx_mem, device ordinal */
};

typedef int (*file_from_fd_fn)(int, int, phx_file **);
typedef int (*file_close_fn)(phx_file *);
typedef int (*stream_io_fn)(phx_ctx *, const struct phx_io_desc *, void *, int64_t *, phx_sop **);
typedef int (*reg_add_fn)(uint64_t, uint64_t, int, int);
typedef int (*reg_remove_fn)(uint64_t);
typedef int (*reg_lookup_fn)(uint64_t, uint64_t, struct phx_reg_info *);
typedef void (*ctx_destroy_fn)(phx_ctx *);

/* The core's entry points: functions of phoenix._phxcore, which is never unloaded, so
 * once set they stay valid (read without a lock). */
static _Atomic(file_from_fd_fn) c_file_from_fd;
static _Atomic(file_close_fn) c_file_close;
static _Atomic(stream_io_fn) c_stream_io;
static _Atomic(reg_add_fn) c_reg_add;
static _Atomic(reg_remove_fn) c_reg_remove;
static _Atomic(reg_lookup_fn) c_reg_lookup;
static _Atomic(ctx_destroy_fn) c_ctx_destroy;

/* ---- the CPython API, resolved at run time ------------------------------------------ */

typedef struct _object PyObject;
static struct {
    int bound;
    int (*IsInitialized)(void);
    int (*GILEnsure)(void);
    void (*GILRelease)(int);
    void *(*SaveThread)(void);     /* PyEval_SaveThread: let the GIL go, keep the thread state */
    void (*RestoreThread)(void *); /* PyEval_RestoreThread */
    PyObject *(*Import)(const char *);
    PyObject *(*CallMethod)(PyObject *, const char *, const char *, ...);
    long long (*AsLongLong)(PyObject *);
    void (*DecRef)(PyObject *);
    PyObject *(*ErrOccurred)(void);
    void (*ErrPrint)(void);
    int (*IsFinalizing)(void); /* Py_IsFinalizing (3.13+) or _Py_IsFinalizing; may be NULL */
    /* handing KeyboardInterrupt / SystemExit back to the main thread (py_failed); all or none */
    int (*ExceptionMatches)(PyObject *);
    void (*Fetch)(PyObject **, PyObject **, PyObject **);
    void (*Restore)(PyObject *, PyObject *, PyObject *);
    void (*Clear)(void);
    int (*AddPendingCall)(int (*)(void *), void *);
    PyObject **KeyboardInterrupt, **SystemExit; /* the PyExc_* variables */
} py;
static pthread_mutex_t py_bind_lock = PTHREAD_MUTEX_INITIALIZER;

static int py_bind(void)
{
    pthread_mutex_lock(&py_bind_lock);
    if (!py.bound) {
#define SYM(field, name) py.field = (__typeof__(py.field))dlsym(RTLD_DEFAULT, name)
        SYM(IsInitialized, "Py_IsInitialized");
        SYM(GILEnsure, "PyGILState_Ensure");
        SYM(GILRelease, "PyGILState_Release");
        SYM(SaveThread, "PyEval_SaveThread");
        SYM(RestoreThread, "PyEval_RestoreThread");
        SYM(Import, "PyImport_ImportModule");
        SYM(CallMethod, "PyObject_CallMethod");
        SYM(AsLongLong, "PyLong_AsLongLong");
        SYM(DecRef, "Py_DecRef");
        SYM(ErrOccurred, "PyErr_Occurred");
        SYM(ErrPrint, "PyErr_Print");
        SYM(IsFinalizing, "Py_IsFinalizing");
        if (!py.IsFinalizing)
            SYM(IsFinalizing, "_Py_IsFinalizing");
        SYM(ExceptionMatches, "PyErr_ExceptionMatches");
        SYM(Fetch, "PyErr_Fetch");
        SYM(Restore, "PyErr_Restore");
        SYM(Clear, "PyErr_Clear");
        SYM(AddPendingCall, "Py_AddPendingCall");
        SYM(KeyboardInterrupt, "PyExc_KeyboardInterrupt");
        SYM(SystemExit, "PyExc_SystemExit");
        if (!(py.ExceptionMatches && py.Fetch && py.Restore && py.Clear && py.AddPendingCall && py.KeyboardInterrupt &&
              py.SystemExit))
            py.KeyboardInterrupt = NULL; /* not handed back: printed, as any other exception */
#undef SYM
        if (py.IsInitialized && py.GILEnsure && py.GILRelease && py.SaveThread && py.RestoreThread && py.Import &&
            py.CallMethod && py.AsLongLong && py.DecRef && py.ErrOccurred && py.ErrPrint)
            py.bound = 1;
    }
    int ok = py.bound && py.IsInitialized();
    pthread_mutex_unlock(&py_bind_lock);
    if (!ok)
        fprintf(stderr, "libphxfile: no Python interpreter in this process: libphxfile runs inside a Python "
                        "process with the phoenix package installed (it asks phoenix for the vendor)\n");
    return ok;
}

struct raised {
    PyObject *type, *value, *tb;
};

/* A pending call (main thread, GIL held): raise what py_failed handed back. */
static int reraise(void *arg)
{
    struct raised *r = arg;
    py.Restore(r->type, r->value, r->tb);
    free(r);
    return -1;
}

/* Python raised under py_call. KeyboardInterrupt and SystemExit (a signal handler that
 * ran inside the call: Ctrl-C, or one that exits) are the caller's, not this library's:
 * PyErr_Print would exit the process for SystemExit and swallow the interrupt. They are
 * handed back to the main thread (raised there at its next check, once the call has
 * returned) and the call fails with -EINTR. Anything else: its traceback goes to stderr,
 * and `rc`. */
static int py_failed(int rc)
{
    if (py.KeyboardInterrupt &&
        (py.ExceptionMatches(*py.KeyboardInterrupt) || py.ExceptionMatches(*py.SystemExit))) {
        struct raised *r = malloc(sizeof(*r));
        if (r) {
            py.Fetch(&r->type, &r->value, &r->tb);
            if (py.AddPendingCall(reraise, r) == 0)
                return -EINTR;
            py.Restore(r->type, r->value, r->tb);
            free(r);
        }
        py.Clear();
        fprintf(stderr, "libphxfile: a KeyboardInterrupt or SystemExit raised inside a call could not be handed "
                        "back to the main thread: dropped\n");
        return -EINTR;
    }
    py.ErrPrint();
    return rc;
}

/* Call phoenix.phxfile.<fn>(a, b, c) with the GIL held by the caller; its int result
 * (0 or -errno); when Python raised, py_failed's (-EIO, -ENOENT, -EINTR). */
static int py_call(const char *fn, uint64_t a, uint64_t b, uint64_t c)
{
    PyObject *mod = py.Import("phoenix.phxfile");
    if (!mod)
        return py_failed(-ENOENT);
    PyObject *res = py.CallMethod(mod, fn, "KKK", (unsigned long long)a, (unsigned long long)b,
                                  (unsigned long long)c);
    py.DecRef(mod);
    if (!res)
        return py_failed(-EIO);
    long long v = py.AsLongLong(res);
    py.DecRef(res);
    if (py.ErrOccurred())
        return py_failed(-EIO);
    return v > 0 ? 0 : (int)v;
}

/* Python may be asked for nothing once the interpreter is shutting down: a thread that
 * takes the GIL then is stopped (pthread_exit) or blocked for good by CPython. */
static int py_usable(void) { return py.bound && py.IsInitialized() && !(py.IsFinalizing && py.IsFinalizing()); }

/* ---- driver state ------------------------------------------------------------------- */

#define HANDLE_MAGIC 0x70686668u /* "phfh" */

struct handle {
    uint32_t magic;
    int fd;
    phx_file *file;
    struct handle *next;
};

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;      /* open / close: open_lock_take */
static pthread_rwlock_t state_lock = PTHREAD_RWLOCK_INITIALIZER;   /* ctx (to clear it), handles */
static _Atomic int opened;
static phx_ctx *ctx;
static int32_t io_mode;
static struct handle *handles;

/* Registrations made through this ABI (so DriverClose drops those, and only those). */
struct myreg {
    uint64_t base;
    int refs;
};
static pthread_mutex_t regs_lock = PTHREAD_MUTEX_INITIALIZER;
static struct myreg *regs;
static size_t nregs, capregs;

/* fork. The child has one thread: the parent's context (its workers, the stream ops it
 * queued) and handles are not the child's, and a lock some other thread held at the fork
 * stays held for good. The child starts closed, with fresh locks: its first call opens a
 * driver of its own (the parent's context and handles are left alone, not destroyed:
 * that would wait for threads the child does not have; a parent's handle is -EBADF
 * there). regs_lock is held across the fork (never held across a GIL acquisition, so the
 * forking thread, which holds the GIL, gets it): the child keeps a consistent list of the
 * registrations it inherited in the core's table (host memory, and the host vendor's
 * arena: the child's copy of them), which its own DriverClose drops. open_lock is held
 * while Python runs (an open asks phoenix for the vendor), so it is not taken around the
 * fork: only made fresh in the child.
 *
 * regs_lock is held around calls into the core (phx_reg_add, phx_reg_remove), whose own
 * prepare takes the core's registration lock: this prepare must run first, or a thread
 * holding regs_lock would wait for the registration lock the forking thread holds while
 * the forking thread waits for regs_lock. Prepare handlers run last registered first, so
 * it is registered once the core is bound (fork_hold_regs, after the core was loaded),
 * not when this library is: LMCache may load it before anything imports phoenix. */
static void fork_prepare(void) { pthread_mutex_lock(&regs_lock); }

static void fork_parent(void) { pthread_mutex_unlock(&regs_lock); }

static pthread_once_t fork_hold_once = PTHREAD_ONCE_INIT;

static void fork_hold_regs_register(void) { pthread_atfork(fork_prepare, fork_parent, NULL); }

/* (pthread_atfork waits while another thread forks; the prepare handlers that fork runs
 * wait for no lock the caller holds: open_lock and the GIL are taken by none of them) */
static void fork_hold_regs(void) { pthread_once(&fork_hold_once, fork_hold_regs_register); }

static void fork_child(void)
{
    pthread_mutex_init(&regs_lock, NULL);
    pthread_mutex_init(&open_lock, NULL);
    pthread_rwlock_init(&state_lock, NULL);
    pthread_mutex_init(&py_bind_lock, NULL);
    ctx = NULL;
    handles = NULL;
    atomic_store(&opened, 0);
}

__attribute__((constructor)) static void phxfile_init(void) { pthread_atfork(NULL, NULL, fork_child); }

/* Take open_lock; the caller holds the GIL (PyGILState_Ensure). A busy lock is waited for
 * with the GIL let go: its holder may be running Python, which needs the GIL back. */
static void open_lock_take(void)
{
    if (pthread_mutex_trylock(&open_lock) == 0)
        return;
    void *ts = py.SaveThread();
    pthread_mutex_lock(&open_lock);
    py.RestoreThread(ts); /* open_lock, then the GIL */
}

static int ensure_open(void)
{
    if (atomic_load_explicit(&opened, memory_order_acquire))
        return 0;
    if (!py_bind())
        return -ENOSYS;
    if (!py_usable())
        return -ESHUTDOWN; /* the interpreter is finalizing: no vendor to ask */
    int g = py.GILEnsure();
    open_lock_take();
    int rc = 0;
    if (!atomic_load(&opened)) {
        struct phxfile_core c;
        memset(&c, 0, sizeof(c));
        c.abi = PHXFILE_CORE_ABI;
        rc = py_call("_c_open", (uint64_t)(uintptr_t)&c, sizeof(c), 0);
        if (rc == 0 && (!c.ctx || !c.file_from_fd || !c.file_close || !c.stream_io || !c.reg_add ||
                        !c.reg_remove || !c.reg_lookup || !c.ctx_destroy)) {
            if (c.ctx && c.ctx_destroy)
                ((ctx_destroy_fn)(uintptr_t)c.ctx_destroy)((phx_ctx *)(uintptr_t)c.ctx);
            py_call("_c_close", 0, 0, 0);
            rc = -EPROTO;
        } else if (rc != 0 && c.ctx && c.ctx_destroy) {
            /* handed over, then Python raised (a signal handler's exception at its last
             * step): the context is this library's to free */
            ((ctx_destroy_fn)(uintptr_t)c.ctx_destroy)((phx_ctx *)(uintptr_t)c.ctx);
        }
        if (rc == 0) {
            atomic_store(&c_file_from_fd, (file_from_fd_fn)(uintptr_t)c.file_from_fd);
            atomic_store(&c_file_close, (file_close_fn)(uintptr_t)c.file_close);
            atomic_store(&c_stream_io, (stream_io_fn)(uintptr_t)c.stream_io);
            atomic_store(&c_reg_add, (reg_add_fn)(uintptr_t)c.reg_add);
            atomic_store(&c_reg_remove, (reg_remove_fn)(uintptr_t)c.reg_remove);
            atomic_store(&c_reg_lookup, (reg_lookup_fn)(uintptr_t)c.reg_lookup);
            atomic_store(&c_ctx_destroy, (ctx_destroy_fn)(uintptr_t)c.ctx_destroy);
            /* no state_lock (which a thread holding the GIL must not wait for): nobody reads
             * ctx while opened is 0, and open_lock keeps DriverClose out */
            ctx = (phx_ctx *)(uintptr_t)c.ctx;
            io_mode = c.mode;
            fork_hold_regs(); /* the core is loaded now, before any registration: see fork_prepare */
            atomic_store_explicit(&opened, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&open_lock);
    py.GILRelease(g);
    return rc;
}

PHXFILE_API int phxFileDriverOpen(void) { return ensure_open(); }

PHXFILE_API int phxFileDriverClose(void)
{
    if (!atomic_load(&opened))
        return 0; /* idempotent; also "never opened" */
    int use_py = py_usable(), g = 0;
    void *ts = NULL;
    if (use_py) {
        g = py.GILEnsure();
        ts = py.SaveThread(); /* the C part below waits for locks and stream ops: without the GIL */
        pthread_mutex_lock(&open_lock);
    } else if (pthread_mutex_trylock(&open_lock) != 0) {
        return -EBUSY; /* finalizing, and an open or close in progress (or stopped by CPython) */
    }
    int rc = 0, r = 0;
    if (atomic_load(&opened)) {
        pthread_rwlock_wrlock(&state_lock); /* no submission in progress past this point */
        phx_ctx *old_ctx = ctx;
        struct handle *hs = handles;
        ctx = NULL;
        handles = NULL;
        atomic_store(&opened, 0);
        pthread_rwlock_unlock(&state_lock);

        /* drop this library's registrations before a new open can make any */
        pthread_mutex_lock(&regs_lock);
        for (size_t i = 0; i < nregs; i++)
            for (int k = 0; k < regs[i].refs; k++)
                c_reg_remove(regs[i].base);
        free(regs);
        regs = NULL;
        nregs = capregs = 0;
        pthread_mutex_unlock(&regs_lock);

        /* closing waits for the stream ops still queued */
        while (hs) {
            struct handle *next = hs->next;
            int e = c_file_close(hs->file);
            if (e < 0 && rc == 0)
                rc = e;
            hs->magic = 0;
            free(hs);
            hs = next;
        }
        c_ctx_destroy(old_ctx);
        if (use_py) {
            py.RestoreThread(ts); /* open_lock, then the GIL */
            ts = NULL;
            if (py_usable()) /* drop the vendor runtime the driver kept alive (before a new open sets one) */
                r = py_call("_c_close", 0, 0, 0);
        }
    }
    if (ts)
        py.RestoreThread(ts);
    pthread_mutex_unlock(&open_lock);
    if (use_py)
        py.GILRelease(g);
    return rc < 0 ? rc : r;
}

/* ---- buffers ------------------------------------------------------------------------ */

/* Where [addr, addr+len) lives: asked of Python at every call (takes the GIL: call with no
 * lock held). No cache: the vendor allocation holding it may have been freed and made
 * again, smaller or of another kind, since the last call (a stale extent let I/O run past
 * the new allocation). */
static int classify(uint64_t addr, uint64_t len, struct phxfile_class *out)
{
    if (!py_usable())
        return -ESHUTDOWN;
    struct phxfile_class c;
    memset(&c, 0, sizeof(c));
    int g = py.GILEnsure();
    int rc = py_call("_c_classify", addr, len, (uint64_t)(uintptr_t)&c);
    py.GILRelease(g);
    if (rc < 0)
        return rc;
    *out = c;
    return 0;
}

static size_t regs_upper(uint64_t base)
{
    size_t lo = 0, hi = nregs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (regs[mid].base <= base)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Is all of host memory [addr, addr+len) mapped? mincore says ENOMEM for a range with a
 * page that is not; -EFAULT then (an unregistered buffer has no other known end). */
static int host_range_mapped(uint64_t addr, uint64_t len)
{
    unsigned char vec[4096]; /* written by the kernel, never read */
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), end = addr + len;
    for (uint64_t p = addr & ~(pg - 1); p < end;) {
        uint64_t n = end - p < sizeof(vec) * pg ? end - p : sizeof(vec) * pg;
        if (mincore((void *)(uintptr_t)p, n, vec) != 0 && errno == ENOMEM)
            return -EFAULT;
        p += n;
    }
    return 0;
}

PHXFILE_API int phxFileBufRegister(const void *addr, size_t length)
{
    uint64_t base = (uint64_t)(uintptr_t)addr;
    if (!addr || !length || length > (uint64_t)INT64_MAX || base + length < base)
        return -EINVAL;
    int rc = ensure_open();
    if (rc < 0)
        return rc;
    struct phxfile_class c;
    rc = classify(base, length, &c);
    if (rc == 0 && c.mem == PHX_MEM_HOST)
        rc = host_range_mapped(base, length); /* the I/O path trusts a registration: check it once here */
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&regs_lock);
    if (!atomic_load(&opened)) { /* closed meanwhile: its close dropped what it knew of */
        pthread_mutex_unlock(&regs_lock);
        return -ESHUTDOWN;
    }
    rc = c_reg_add(base, length, c.mem, c.device);
    if (rc >= 0) {
        size_t i = regs_upper(base);
        if (i > 0 && regs[i - 1].base == base) {
            regs[i - 1].refs++;
        } else {
            if (nregs == capregs) {
                size_t cap = capregs ? capregs * 2 : 256;
                struct myreg *nr = realloc(regs, cap * sizeof(*nr));
                if (!nr) {
                    c_reg_remove(base);
                    pthread_mutex_unlock(&regs_lock);
                    return -ENOMEM;
                }
                regs = nr;
                capregs = cap;
            }
            memmove(&regs[i + 1], &regs[i], (nregs - i) * sizeof(*regs));
            regs[i] = (struct myreg){base, 1};
            nregs++;
        }
        rc = 0;
    }
    pthread_mutex_unlock(&regs_lock);
    return rc;
}

PHXFILE_API int phxFileBufDeregister(const void *addr)
{
    uint64_t base = (uint64_t)(uintptr_t)addr;
    /* (not "if closed, nothing to do": a registration made while a close ran is the
     * close's or this call's to drop, whatever `opened` says now) */
    pthread_mutex_lock(&regs_lock);
    size_t i = nregs ? regs_upper(base) : 0;
    if (i > 0 && regs[i - 1].base == base) {
        c_reg_remove(base);
        if (--regs[i - 1].refs == 0) {
            memmove(&regs[i - 1], &regs[i], (nregs - i) * sizeof(*regs));
            nregs--;
        }
    } /* an unknown base is tolerated (LMCache's teardown deregisters what it may not have registered) */
    pthread_mutex_unlock(&regs_lock);
    return 0;
}

/* ---- file handles ------------------------------------------------------------------- */

static struct handle *find_handle(void *fh)
{
    for (struct handle *h = handles; h; h = h->next)
        if (h == fh)
            return h->magic == HANDLE_MAGIC ? h : NULL;
    return NULL;
}

PHXFILE_API int phxFileHandleRegister(void **fh, int fd)
{
    if (!fh)
        return -EINVAL;
    *fh = NULL;
    if (fd < 0)
        return -EBADF;
    int rc = ensure_open();
    if (rc < 0)
        return rc;
    struct handle *h = calloc(1, sizeof(*h));
    if (!h)
        return -ENOMEM;
    phx_file *f = NULL;
    rc = c_file_from_fd(fd, PHX_DIRECT_AUTO, &f); /* its own descriptors: the caller keeps and closes its fd */
    if (rc < 0) {
        free(h);
        return rc;
    }
    h->magic = HANDLE_MAGIC;
    h->fd = fd;
    h->file = f;
    pthread_rwlock_wrlock(&state_lock);
    if (!atomic_load(&opened)) { /* closed meanwhile */
        pthread_rwlock_unlock(&state_lock);
        c_file_close(f);
        free(h);
        return -ESHUTDOWN;
    }
    h->next = handles;
    handles = h;
    pthread_rwlock_unlock(&state_lock);
    *fh = h;
    return 0;
}

PHXFILE_API int phxFileHandleDeregister(void *fh)
{
    if (!fh)
        return -EINVAL;
    pthread_rwlock_wrlock(&state_lock);
    struct handle **pp = &handles, *h = NULL;
    for (; *pp; pp = &(*pp)->next) {
        if (*pp == fh) {
            h = *pp;
            *pp = h->next;
            break;
        }
    }
    pthread_rwlock_unlock(&state_lock);
    if (!h)
        return -EBADF;
    int rc = c_file_close(h->file); /* waits for the handle's queued stream ops */
    h->magic = 0;
    free(h);
    return rc < 0 ? rc : 0;
}

/* ---- streams: every submission carries its stream ----------------------------------- */

PHXFILE_API int phxFileStreamRegister(void *stream) { return ensure_open(); }

PHXFILE_API int phxFileStreamDeregister(void *stream) { return 0; }

/* ---- stream-ordered I/O ------------------------------------------------------------- */

static int submit(int op, void *fh, void *buf_base, size_t *nbytes, int64_t *file_offset, int64_t *buf_offset,
                  int64_t *bytes_done, void *stream)
{
    int rc;
    if (!fh || !buf_base || !nbytes || !file_offset || !buf_offset) {
        rc = -EINVAL;
        goto fail;
    }
    if ((rc = ensure_open()) < 0)
        goto fail;
    uint64_t size = *nbytes, base = (uint64_t)(uintptr_t)buf_base;
    int64_t foff = *file_offset, boff = *buf_offset;
    /* byte counts and file ends below 2^63 (off_t, and *bytes_done is signed); the
     * buffer extent wraps around nowhere */
    if (foff < 0 || boff < 0 || size > (uint64_t)INT64_MAX - (uint64_t)foff || base + (uint64_t)boff < base ||
        base + (uint64_t)boff + size < base + (uint64_t)boff) {
        rc = -EINVAL;
        goto fail;
    }
    uint64_t addr = base + (uint64_t)boff;
    struct phx_reg_info info = {0};
    int mem, device;
    if (c_reg_lookup(base, 1, &info) == 0) {
        /* [buf_base, end of the extent) must lie in the run of registrations from buf_base's
         * (the core says 1 for one that runs past it into unregistered memory: refused here) */
        if (c_reg_lookup(base, (uint64_t)boff + size, &info) != 0) {
            rc = -EFAULT;
            goto fail;
        }
        mem = info.mem;
        device = info.device;
    } else {
        info.size = 0;
        rc = c_reg_lookup(addr, size ? size : 1, &info);
        if (rc == 1 && info.size) /* starts in a registration, runs past its run */
            rc = -EFAULT;
        if (rc == -EFAULT)
            goto fail;
        if (rc == 0) {
            mem = info.mem;
            device = info.device;
        } else { /* unregistered: ask the vendor (slow path, takes the GIL) */
            struct phxfile_class c;
            if (!size) {
                c.mem = PHX_MEM_HOST;
                c.device = 0;
            } else if ((rc = classify(addr, size, &c)) < 0 ||
                       (c.mem == PHX_MEM_HOST && (rc = host_range_mapped(addr, size)) < 0)) {
                goto fail;
            }
            mem = c.mem;
            device = c.device;
        }
    }
    pthread_rwlock_rdlock(&state_lock);
    struct handle *h = atomic_load(&opened) ? find_handle(fh) : NULL;
    if (!h) {
        pthread_rwlock_unlock(&state_lock);
        rc = -EBADF;
        goto fail;
    }
    struct phx_io_desc d = {
        .file = h->file,
        .addr = addr,
        .size = size,
        .file_offset = foff,
        .op = op,
        .mem = mem,
        .device = device,
        .mode = io_mode,
    };
    rc = c_stream_io(ctx, &d, stream, bytes_done, NULL);
    pthread_rwlock_unlock(&state_lock);
    if (rc < 0)
        goto fail;
    return 0;
fail:
    if (bytes_done)
        __atomic_store_n(bytes_done, (int64_t)rc, __ATOMIC_RELEASE);
    return rc;
}

PHXFILE_API int phxFileReadAsync(void *fh, void *buf_base, size_t *nbytes, int64_t *file_offset, int64_t *buf_offset,
                                 int64_t *bytes_done, void *stream)
{
    return submit(PHX_OP_READ, fh, buf_base, nbytes, file_offset, buf_offset, bytes_done, stream);
}

PHXFILE_API int phxFileWriteAsync(void *fh, void *buf_base, size_t *nbytes, int64_t *file_offset, int64_t *buf_offset,
                                  int64_t *bytes_done, void *stream)
{
    return submit(PHX_OP_WRITE, fh, buf_base, nbytes, file_offset, buf_offset, bytes_done, stream);
}
