/* The host reference runtime (a TEST DOUBLE): what its source files share. Private.
 *
 * Test side (a vendor runtime's test double, outside the C core): the shared part of
 * the pieces that make up libphxhostrt.so and every emulator built from the same
 * sources (phoenix/emulator.py): hostrt.c (errors, devices, settings, properties),
 * hostrt_mem.c (the arenas, pinned and registered host memory, pointer queries),
 * hostrt_copy.c (Memcpy, MemcpyAsync, Memset and their checks), hostrt_stream.c
 * (streams as worker threads, LaunchHostFunc, DeviceSynchronize), hostrt_event.c
 * (events, StreamWaitEvent), hostrt_driver.c (the cu* driver API of emulators) and
 * hostrt_fork.c (the locks around fork(), what a child finds).
 * hostrt.h is the spec; this header is not part of it.
 *
 * Everything declared here is PHXRT_HIDDEN: a library built from these sources exports
 * only hostrt.h's RT()/DRV() calls, as the single source did with its static helpers,
 * and two of them in one process (libphxhostrt.so beside an emulator) never bind to
 * each other's internals. Each .c defines _GNU_SOURCE and includes this header first.
 */
#ifndef PHX_HOSTRT_INTERNAL_H
#define PHX_HOSTRT_INTERNAL_H

#include "hostrt.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

#define MAX_DEVICES 16
#define DEFAULT_ARENA (16 * GiB)
#define ARENA_ALIGN (2 * MiB)       /* huge-page aligned, like a real device's VA space */
#define GRANULE (64 * KiB)          /* allocation unit and alignment: the P2P page size */
#define QUARANTINE_FREES 64         /* a freed range is reused only after this many more frees */
#define QUARANTINE_BYTES (1 * GiB)  /* ... or once this many bytes are waiting (the newest always waits) */
#define STREAM_NONBLOCKING 1u
#define HOST_REGISTER_FLAGS 0xFu    /* CUDA's: portable, mapped, I/O memory, read-only */

#define STR2(x) #x
#define STR(x) STR2(x)
#define PREFIX_STR STR(PHXRT_PREFIX)

/* Built as an emulator of another runtime (phoenix/emulator.py passes -DPHXRT_EMULATOR),
 * the library says so in its device names and its test-double mark. */
#ifdef PHXRT_EMULATOR
#define DEVICE_NAME "Phoenix emulated " PREFIX_STR " device (test double)"
#define TEST_DOUBLE_INFO "phoenix emulated runtime (test double): CUDA-shaped, prefix " PREFIX_STR \
    ", host memory as device memory, built from phoenix/_testing/hostrt/hostrt.c"
#else
#define DEVICE_NAME "Phoenix host reference device (test double)"
#define TEST_DOUBLE_INFO "phoenix host reference runtime (test double): CUDA-shaped, prefix " PREFIX_STR \
    ", host memory as device memory"
#endif

/* The memory-type field(s) of the pointer-attribute layout built (hostrt.h). */
#if PHXRT_POINTER_ATTRIBUTES == 0
#define ATTR_SET_TYPE(a, v) ((a)->type = (v))
#elif PHXRT_POINTER_ATTRIBUTES == 1
#define ATTR_SET_TYPE(a, v) ((a)->memoryType = (v))
#else
#define ATTR_SET_TYPE(a, v) ((a)->memoryType = (a)->type = (v))
#endif

#define PHXRT_HIDDEN __attribute__((visibility("hidden")))

static inline size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* -- errors (hostrt.c) ----------------------------------------------------------- */

PHXRT_HIDDEN extern __thread int tls_device; /* SetDevice is per thread (default 0) */

/* Every API call returns through here, so GetLastError sees its failures. */
PHXRT_HIDDEN int report(int code);

struct err_entry {
    int code;
    const char *name, *message;
};

/* The entry for `code` in an error table of n entries, or NULL. */
PHXRT_HIDDEN const struct err_entry *err_find(const struct err_entry *t, size_t n, int code);

/* -- devices, arenas and settings (hostrt.c) --------------------------------------- */

struct extent {
    size_t off, len; /* offset into the arena, length */
};

struct stream;

struct device {
    char *arena;
    size_t arena_size;
    size_t used;                 /* bytes of live allocations (granule-rounded) */
    struct extent *free_list;    /* sorted by offset, coalesced */
    size_t nfree, capfree;
    struct extent quarantine[QUARANTINE_FREES]; /* FIFO ring of freed ranges not yet reusable */
    unsigned qhead, qcount;
    size_t qbytes;
    struct stream *default_stream; /* stream 0, created at first use (guarded by g_streams_mu) */
};

struct runtime_state {
    int status; /* of initialisation: SUCCESS or INITIALIZATION */
    int ndev;
    struct device dev[MAX_DEVICES];
};

PHXRT_HIDDEN extern struct runtime_state g;
PHXRT_HIDDEN extern pthread_once_t g_once;
PHXRT_HIDDEN extern pthread_mutex_t g_mem; /* the ranges, the arenas' allocators, the pins */

PHXRT_HIDDEN void init_once(void);

#define ENSURE_INIT()                                                                              \
    do {                                                                                           \
        pthread_once(&g_once, init_once);                                                          \
        if (g.status != PHXRT_SUCCESS)                                                             \
            return report(g.status);                                                               \
    } while (0)

/* The calling thread's current device, or NULL with *rc set. */
PHXRT_HIDDEN struct device *current_device(int *rc);
PHXRT_HIDDEN int check_ordinal(int device);
/* Which device's arena holds address p, or -1 (plain host memory). */
PHXRT_HIDDEN int arena_device(uintptr_t p);
/* Does [p, p+n) touch any arena? (host extents must not) */
PHXRT_HIDDEN int touches_arena(uintptr_t p, size_t n);

/* -- ranges: device allocations, pinned allocations, registrations (hostrt_mem.c) -- */

/* The three kinds never overlap (arenas are apart from host memory, registration refuses
 * overlap), so one sorted array answers every address query in O(log n). */
enum { R_DEVICE = 1, R_PINNED, R_REGISTERED };

struct range {
    uintptr_t base;
    size_t size;     /* what the caller asked for: extents are checked against this */
    size_t span;     /* what it occupies (granule- or page-rounded) */
    int type;
    int device;
    unsigned pins;   /* copies in flight that name this range */
    int dying;       /* being freed: invisible to lookups, waiting for pins to drain */
};

/* The live range containing addr, or NULL. g_mem held. */
PHXRT_HIDDEN struct range *ranges_find(uintptr_t addr);
/* Drop a finished copy's pins (takes g_mem; clears pins[] under it, so a fork finds them
 * either still held or dropped); wakes a Free waiting for them. */
PHXRT_HIDDEN void unpin(struct range *pins[2]);

/* -- streams (hostrt_stream.c) ----------------------------------------------------- */

/* Created streams' and events' handles start here: 0 is the default stream, and 1 and 2
 * are CUDA's cudaStreamLegacy and cudaStreamPerThread, which name the default stream
 * here too (one default stream per device: no per-thread ones). */
#define HANDLE_BASE 16

struct op {
    struct op *next;
    phxrtHostFn_t fn; /* a host function, or NULL for a copy */
    void *arg;
    void *dst;
    const void *src;
    size_t n;
    struct range *pins[2];
    int ran;          /* set by the worker once it ran (a fork then does not count it lost) */
};

PHXRT_HIDDEN extern pthread_mutex_t g_streams_mu; /* the stream registry, refs, default streams */

/* Resolve a handle to a stream and hold a reference (stream_release it). */
PHXRT_HIDDEN int stream_acquire(phxrtStream_t handle, struct stream **out);
PHXRT_HIDDEN void stream_release(struct stream *s);
PHXRT_HIDDEN void stream_wait_idle(struct stream *s);
PHXRT_HIDDEN int stream_push(struct stream *s, const struct op *op);

/* -- fork (hostrt_fork.c) ----------------------------------------------------------- */

/* Bumped in the child of every fork, before the child has a second thread. */
PHXRT_HIDDEN extern uint64_t g_fork_gen;
enum { FORK_PREPARE = 0, FORK_PARENT = 1, FORK_CHILD = 2 };
/* Each file's part of a fork: PREPARE takes its locks, PARENT releases them, CHILD makes
 * them fresh (the parent's threads that held or waited on them are gone) and drops what
 * only those threads would have finished. streams: g_streams_mu, then each stream's mu;
 * events: g_events_mu, then each event's mu; mem: g_mem. */
PHXRT_HIDDEN void streams_fork(int phase);
PHXRT_HIDDEN void events_fork(int phase);
PHXRT_HIDDEN void mem_fork(int phase);

#endif /* PHX_HOSTRT_INTERNAL_H */
