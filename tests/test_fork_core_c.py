"""fork() at any moment, the C side alone: the I/O core and the host runtime without Python.

Test side, core (phoenix/csrc/io_fork.c) and the host vendor's runtime (a test double,
phoenix/_testing/hostrt/hostrt_fork.c). A C program (below) loads the libraries the package
built (the core with dlopen: its one Python call, the module init, is never made) and runs,
in the parent, three threads that never stop: blocking writes, reads and gathers of a host
buffer (every byte checked), registrations added and removed below 20,000 others (each
shifts them all under the table's lock, so a fork often lands while it is held), and
stream-ordered writes and reads of device memory plus staged reads (the file-mapping cache
registers windows meanwhile). Before them it holds a stream with a gate and queues behind
it an event, a stream-ordered write and a staged read whose copy waits for that stream.
It forks at random moments; each child (killed by its alarm after 20 s: a hang fails):

* finds the parent's held stream op and request done at once with -ECHILD (the request's
  failing extent: all of it), and the parent's contexts refusing work with -ECHILD;
* makes a context of its own: writes and reads random bytes of host and device memory,
  and stream-ordered on the default stream, every byte checked;
* reads a range of a file that a parent's stream-ordered write (never run here) covers:
  at once, the bytes the file has;
* sees the held stream's dropped work reported once (LAUNCH_FAILURE), the held event
  failed, new work on that stream run, and the device memory the dropped copies named
  freed at once;
* keeps the registration table, closes the parent's files, forgets the parent's contexts
  (no waiting), and ends with no thread, context, request or stream op counted.

The parent's threads and its held work then complete, every byte checked. A prepare
handler that deadlocked would hang the parent: the run's timeout fails it. Before the fix
most children hung at their first request (the registration table's lock), the others at
the read of file c (the parent's listed write), and the held ops were not done.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import phoenix
import phoenix.io
from phoenix._core import core_path
from phoenix._testing import HOST_LIBRARY

CSRC = Path(phoenix.__file__).parent / "csrc"
FORKS = 40
TIMEOUT = 240

PROGRAM = r"""
/* fork() under load, in C: the I/O core and the host runtime as the libraries the package
 * built, loaded without Python (so no Python lock is in the way: this is the C side alone).
 * argv: core.so hostrt.so dir engine forks. Prints the counts and "ok" and exits 0, or
 * says what failed on stderr and exits 1. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "phx_io.h"

#define API(X)                                                                                             \
    X(phx_ctx_create) X(phx_ctx_destroy) X(phx_ctx_prepare) X(phx_file_open) X(phx_file_close) X(phx_submit) \
    X(phx_req_wait) X(phx_req_wait_all) X(phx_req_done) X(phx_req_result) X(phx_req_error_extent)          \
    X(phx_req_release) X(phx_stream_io) X(phx_sop_wait) X(phx_sop_done) X(phx_sop_result) X(phx_sop_release) \
    X(phx_reg_add) X(phx_reg_remove) X(phx_reg_lookup) X(phx_fence_record) X(phx_fence_release)           \
    X(phx_fmap_wait) X(phx_io_get_stats)
#define DECL(name) static __typeof__(&name) c_##name;
API(DECL)
#define C(name) c_##name

/* the host runtime (hostrt.h, prefix phxh): CUDA-shaped */
typedef void (*hostfn)(void *);
static int (*h_malloc)(void **, size_t), (*h_free)(void *), (*h_memcpy)(void *, const void *, size_t, int);
static int (*h_stream_create)(void **, unsigned), (*h_stream_sync)(void *), (*h_stream_destroy)(void *);
static int (*h_launch)(void *, hostfn, void *), (*h_event_create)(void **, unsigned), (*h_event_record)(void *, void *);
static int (*h_event_query)(void *), (*h_event_sync)(void *);
enum { H2D = 1, D2H = 2, LAUNCH_FAILURE = 719 };

static struct phx_dp_table dp;
static const char *dir;
static int engine;
static atomic_int stop, gate, errors;
static atomic_long loops[3];
static int who = -1; /* the child's number; -1: the parent */

#define FAIL(...)                                                                                          \
    do {                                                                                                   \
        fprintf(stderr, who < 0 ? "parent: " : "child %d: ", who);                                         \
        fprintf(stderr, __VA_ARGS__);                                                                      \
        fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                                                 \
        if (who >= 0)                                                                                      \
            exit(1);                                                                                       \
        atomic_fetch_add(&errors, 1);                                                                      \
        atomic_store(&stop, 1);                                                                            \
    } while (0)
#define CHECK(cond, ...)                                                                                   \
    do {                                                                                                   \
        if (!(cond))                                                                                       \
            FAIL(__VA_ARGS__);                                                                             \
    } while (0)

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "no %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void load(const char *core_path, const char *rt_path)
{
    /* lazily: the core's one Python call (its module init) is never made here */
    void *core = dlopen(core_path, RTLD_LAZY | RTLD_LOCAL);
    if (!core) {
        fprintf(stderr, "dlopen %s: %s\n", core_path, dlerror());
        exit(2);
    }
    void *rt = dlopen(rt_path, RTLD_NOW | RTLD_LOCAL);
    if (!rt) {
        fprintf(stderr, "dlopen %s: %s\n", rt_path, dlerror());
        exit(2);
    }
#define LOAD(name) c_##name = (__typeof__(c_##name))sym(core, #name);
    API(LOAD)
#define RT(name) sym(rt, "phxh" name)
    h_malloc = RT("Malloc");
    h_free = RT("Free");
    h_memcpy = RT("Memcpy");
    h_stream_create = RT("StreamCreateWithFlags");
    h_stream_sync = RT("StreamSynchronize");
    h_stream_destroy = RT("StreamDestroy");
    h_launch = RT("LaunchHostFunc");
    h_event_create = RT("EventCreateWithFlags");
    h_event_record = RT("EventRecord");
    h_event_query = RT("EventQuery");
    h_event_sync = RT("EventSynchronize");
    dp = (struct phx_dp_table){
        .abi_version = PHX_DP_ABI, .success = 0, .kind_h2h = 0, .kind_h2d = H2D, .kind_d2h = D2H, .kind_d2d = 3,
        .stream_flags = 1, .set_device = RT("SetDevice"), .memcpy_async = RT("MemcpyAsync"),
        .stream_create = RT("StreamCreateWithFlags"), .stream_synchronize = RT("StreamSynchronize"),
        .stream_destroy = RT("StreamDestroy"), .launch_host_func = RT("LaunchHostFunc"),
        .host_register = RT("HostRegister"), .host_unregister = RT("HostUnregister"), .event_flags = 2,
        .host_register_read_only = 8, .get_device = RT("GetDevice"), .event_create = RT("EventCreateWithFlags"),
        .event_record = RT("EventRecord"), .stream_wait_event = RT("StreamWaitEvent"),
        .event_synchronize = RT("EventSynchronize"), .event_destroy = RT("EventDestroy"), .not_ready = 600,
        .event_query = RT("EventQuery"),
    };
}

static phx_ctx *ctx_new(void)
{
    struct phx_io_config cfg = {
        .threads = 3, .queue_depth = 16, .chunk_size = 256 << 10, .engine = engine, .fmap_mode = PHX_FMAP_AUTO,
        .fmap_budget = 64 << 20, .fmap_window = 2 << 20, .fmap_register_flags = 8, .flags = PHX_CFG_CPU_COPIES,
    };
    phx_ctx *ctx = NULL;
    int rc = C(phx_ctx_create)(&cfg, &dp, &ctx);
    CHECK(rc == 0, "phx_ctx_create: %d", rc);
    return ctx;
}

static phx_file *file_at(const char *name, int flags)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    phx_file *f = NULL;
    int rc = C(phx_file_open)(path, flags, 0644, PHX_DIRECT_AUTO, &f);
    CHECK(rc == 0, "open %s: %d", path, rc);
    return f;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (unsigned char)(seed >> 16);
    }
}

static struct phx_io_desc desc(phx_file *f, void *addr, size_t n, int64_t off, int op, int mem)
{
    return (struct phx_io_desc){.file = f, .addr = (uint64_t)(uintptr_t)addr, .size = n, .file_offset = off,
                                .op = op, .mem = mem};
}

/* One blocking request through ctx: its result. */
static int64_t io(phx_ctx *ctx, struct phx_io_desc d)
{
    phx_req *r = NULL;
    int rc = C(phx_submit)(ctx, &d, 1, &r);
    if (rc < 0)
        return rc;
    C(phx_req_wait)(r, -1);
    int64_t n = C(phx_req_result)(r);
    C(phx_req_release)(r);
    return n;
}

static void *dev_alloc(size_t n)
{
    void *p = NULL;
    int rc = h_malloc(&p, n);
    CHECK(rc == 0, "device alloc: %d", rc);
    return p;
}

static void gate_fn(void *arg)
{
    while (!atomic_load(&gate))
        usleep(200);
}

static void count_fn(void *arg) { atomic_fetch_add((atomic_int *)arg, 1); }

/* ---- the parent's busy threads ---------------------------------------------------------- */

#define SA ((2u << 20) + 123)
#define SB ((1u << 20) + 4097)
static phx_ctx *ctx_busy, *ctx_held;
static phx_file *fa, *fb, *fc, *fk;
static unsigned char *da; /* file a's bytes */

static void *t_io(void *arg)
{
    unsigned char *buf = malloc(SA), *small = malloc(8 * 4096);
    while (!atomic_load(&stop)) {
        CHECK(io(ctx_busy, desc(fa, da, SA, 0, PHX_OP_WRITE, PHX_MEM_HOST)) == SA, "write a");
        memset(buf, 0, SA);
        CHECK(io(ctx_busy, desc(fa, buf, SA, 0, PHX_OP_READ, PHX_MEM_HOST)) == SA && !memcmp(buf, da, SA), "read a");
        struct phx_io_desc ds[8];
        phx_req *rs[8];
        int64_t res[8];
        for (int i = 0; i < 8; i++)
            ds[i] = desc(fa, small + i * 4096, 4096, (int64_t)(i * 257 * 1024 + i), PHX_OP_READ, PHX_MEM_HOST);
        CHECK(C(phx_submit)(ctx_busy, ds, 8, rs) == 0, "submit many");
        C(phx_req_wait_all)(rs, 8, res, -1);
        for (int i = 0; i < 8; i++)
            CHECK(res[i] == 4096 && !memcmp(small + i * 4096, da + ds[i].file_offset, 4096), "read many %d", i);
        for (int i = 0; i < 8; i++)
            C(phx_req_release)(rs[i]);
        atomic_fetch_add(&loops[0], 1);
    }
    free(buf);
    free(small);
    return NULL;
}

#define NPERM 20000
static char *regs_base;

static void *t_reg(void *arg)
{
    /* below the 20,000: each add shifts them all under the table's write lock, which a fork
     * then often finds held (the table holds addresses: nothing here is touched) */
    char *area = regs_base - 128 * 4096;
    while (!atomic_load(&stop)) {
        for (int i = 0; i < 64; i++)
            CHECK(C(phx_reg_add)((uint64_t)(uintptr_t)(area + i * 4096), 4096, PHX_MEM_HOST, 0) == 0, "reg add");
        struct phx_reg_info info;
        CHECK(C(phx_reg_lookup)((uint64_t)(uintptr_t)(regs_base + 4096 * 777), 16, &info) == 0, "lookup");
        for (int i = 0; i < 64; i++)
            CHECK(C(phx_reg_remove)((uint64_t)(uintptr_t)(area + i * 4096)) == 0, "reg remove");
        atomic_fetch_add(&loops[1], 1);
    }
    return NULL;
}

static void *t_stream(void *arg)
{
    void *s = NULL, *d1 = dev_alloc(SB), *d2 = dev_alloc(SB);
    unsigned char *want = malloc(SB), *got = malloc(SB);
    fill(want, SB, 7);
    h_memcpy(d1, want, SB, H2D);
    h_stream_create(&s, 1);
    while (!atomic_load(&stop)) {
        phx_sop *w = NULL, *r = NULL;
        struct phx_io_desc dw = desc(fb, d1, SB, 0, PHX_OP_WRITE, PHX_MEM_DEVICE);
        struct phx_io_desc dr = desc(fb, d2, SB, 0, PHX_OP_READ, PHX_MEM_DEVICE);
        CHECK(C(phx_stream_io)(ctx_busy, &dw, s, NULL, &w) == 0, "stream write");
        CHECK(C(phx_stream_io)(ctx_busy, &dr, s, NULL, &r) == 0, "stream read");
        CHECK(h_stream_sync(s) == 0, "stream sync");
        C(phx_sop_wait)(w, -1);
        C(phx_sop_wait)(r, -1);
        CHECK(C(phx_sop_result)(w) == SB && C(phx_sop_result)(r) == SB, "stream results");
        h_memcpy(got, d2, SB, D2H);
        CHECK(!memcmp(got, want, SB), "stream read bytes");
        C(phx_sop_release)(w);
        C(phx_sop_release)(r);
        /* a blocking staged read too: a miss queues the windows for the registrar */
        CHECK(io(ctx_busy, desc(fb, d2, SB, 0, PHX_OP_READ, PHX_MEM_DEVICE)) == SB, "staged read");
        atomic_fetch_add(&loops[2], 1);
    }
    free(want);
    free(got);
    return NULL;
}

/* ---- the child -------------------------------------------------------------------------- */

static void *sh, *ev_held;
static phx_sop *held_sop;
static phx_req *held_req;
static void *held_dev, *held_src; /* the held read's destination, the held write's source */
#define SC (512u << 10)

static int64_t elapsed_ms(struct timespec t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
}

static void child(int i)
{
    who = i;
    alarm(20); /* a hang is killed by SIGALRM: the parent reports it */
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* the parent's: done at once, -ECHILD; its contexts refuse; nothing waits */
    CHECK(C(phx_sop_done)(held_sop) == 1 && C(phx_sop_wait)(held_sop, -1) == 0, "held op: not done");
    CHECK(C(phx_sop_result)(held_sop) == -ECHILD, "held op: %ld", (long)C(phx_sop_result)(held_sop));
    CHECK(C(phx_req_done)(held_req) == 1 && C(phx_req_wait)(held_req, -1) == 0, "held request: not done");
    CHECK(C(phx_req_result)(held_req) == -ECHILD, "held request: %ld", (long)C(phx_req_result)(held_req));
    int64_t eo = -1;
    uint64_t el = 0;
    CHECK(C(phx_req_error_extent)(held_req, &eo, &el) == 0 && eo == 0 && el == SC, "held request extent");
    struct phx_io_desc d = desc(fa, da, 4096, 0, PHX_OP_READ, PHX_MEM_HOST);
    phx_req *r = NULL;
    phx_sop *s = NULL;
    phx_fence *fe = NULL;
    CHECK(C(phx_submit)(ctx_busy, &d, 1, &r) == -ECHILD, "parent's context submits");
    CHECK(C(phx_stream_io)(ctx_held, &d, NULL, NULL, &s) == -ECHILD, "parent's context queues");
    CHECK(C(phx_fence_record)(ctx_busy, 0, NULL, &fe) == -ECHILD, "parent's context records");
    CHECK(C(phx_ctx_prepare)(ctx_busy) == -ECHILD, "parent's context prepares");
    CHECK(C(phx_fmap_wait)(ctx_busy, -1) == -ECHILD, "parent's context's registrar");

    /* a context of its own: host memory, device memory, stream-ordered on the default stream */
    phx_ctx *ctx = ctx_new();
    char name[64];
    snprintf(name, sizeof(name), "child-%d.bin", i);
    phx_file *f = file_at(name, PHX_F_READ | PHX_F_WRITE | PHX_F_CREATE | PHX_F_TRUNC);
    size_t n = (3u << 20) + 17 * (unsigned)i + 1;
    unsigned char *want = malloc(n), *got = malloc(n);
    fill(want, n, 100 + (unsigned)i);
    CHECK(io(ctx, desc(f, want, n, 0, PHX_OP_WRITE, PHX_MEM_HOST)) == (int64_t)n, "write");
    memset(got, 0, n);
    CHECK(io(ctx, desc(f, got, n, 0, PHX_OP_READ, PHX_MEM_HOST)) == (int64_t)n && !memcmp(got, want, n), "read");
    void *d1 = dev_alloc(n), *d2 = dev_alloc(n);
    h_memcpy(d1, want, n, H2D);
    CHECK(io(ctx, desc(f, d1, n, 0, PHX_OP_WRITE, PHX_MEM_DEVICE)) == (int64_t)n, "write from device");
    CHECK(io(ctx, desc(f, d2, n, 0, PHX_OP_READ, PHX_MEM_DEVICE)) == (int64_t)n, "read into device");
    memset(got, 0, n);
    h_memcpy(got, d2, n, D2H);
    CHECK(!memcmp(got, want, n), "device bytes");
    fill(want, n, 200 + (unsigned)i);
    h_memcpy(d1, want, n, H2D);
    phx_sop *w = NULL;
    struct phx_io_desc dw = desc(f, d1, n, 0, PHX_OP_WRITE, PHX_MEM_DEVICE);
    struct phx_io_desc dr = desc(f, d2, n, 0, PHX_OP_READ, PHX_MEM_DEVICE);
    CHECK(C(phx_stream_io)(ctx, &dw, NULL, NULL, &w) == 0 && C(phx_stream_io)(ctx, &dr, NULL, NULL, &s) == 0,
          "stream-ordered I/O on the default stream");
    CHECK(h_stream_sync(NULL) == 0, "default stream");
    CHECK(C(phx_sop_wait)(w, -1) == 0 && C(phx_sop_result)(w) == (int64_t)n, "stream write");
    CHECK(C(phx_sop_wait)(s, -1) == 0 && C(phx_sop_result)(s) == (int64_t)n, "stream read");
    h_memcpy(got, d2, n, D2H);
    CHECK(!memcmp(got, want, n), "stream-ordered bytes");
    C(phx_sop_release)(w);
    C(phx_sop_release)(s);

    /* file c has a parent's stream-ordered write listed: a blocking read does not wait for
     * it (nothing runs it here), through a new handle or the parent's */
    phx_file *c2 = file_at("c.bin", PHX_F_READ);
    unsigned char *cb = malloc(SC), *ck = malloc(SC);
    fill(ck, SC, 3);
    CHECK(io(ctx, desc(c2, cb, SC, 0, PHX_OP_READ, PHX_MEM_HOST)) == SC && !memcmp(cb, ck, SC), "read c");
    memset(cb, 0, SC);
    CHECK(io(ctx, desc(fc, cb, SC, 0, PHX_OP_READ, PHX_MEM_HOST)) == SC && !memcmp(cb, ck, SC), "read c (parent's)");
    CHECK(C(phx_file_close)(c2) == 0, "close c2");

    /* the host runtime: the held stream's work was dropped (said once), new work runs */
    CHECK(h_event_query(ev_held) == LAUNCH_FAILURE, "held event query");
    CHECK(h_event_sync(ev_held) == LAUNCH_FAILURE, "held event sync");
    CHECK(h_stream_sync(sh) == LAUNCH_FAILURE, "held stream: lost work not said");
    CHECK(h_stream_sync(sh) == 0, "held stream: said twice");
    atomic_int ran = 0;
    CHECK(h_launch(sh, count_fn, &ran) == 0 && h_stream_sync(sh) == 0 && ran == 1, "held stream: new work");
    CHECK(h_stream_destroy(sh) == 0, "destroy held stream");
    /* device memory that the dropped copies named: freed at once (not waiting for them) */
    CHECK(h_free(held_src) == 0 && h_free(held_dev) == 0, "free what dropped copies named");

    /* registrations: the table stays, and changes */
    struct phx_reg_info info;
    CHECK(C(phx_reg_lookup)((uint64_t)(uintptr_t)(regs_base + 4096 * 99), 4096, &info) == 0, "inherited registration");
    CHECK(C(phx_reg_add)((uint64_t)(uintptr_t)want, n, PHX_MEM_HOST, 0) == 0, "reg add");
    CHECK(C(phx_reg_remove)((uint64_t)(uintptr_t)want) == 0, "reg remove");

    /* the parent's files close without waiting; its contexts are forgotten */
    CHECK(C(phx_file_close)(fa) == 0 && C(phx_file_close)(fc) == 0, "close the parent's files");
    C(phx_ctx_destroy)(ctx_busy);
    C(phx_ctx_destroy)(ctx_held);
    CHECK(C(phx_file_close)(f) == 0, "close");
    C(phx_ctx_destroy)(ctx);
    struct phx_io_stats st;
    C(phx_io_get_stats)(&st);
    CHECK(st.threads == 0 && st.contexts == 0 && st.requests == 0 && st.stream_ops == 0,
          "counters: threads %ld contexts %ld requests %ld stream_ops %ld", (long)st.threads, (long)st.contexts,
          (long)st.requests, (long)st.stream_ops);
    CHECK(elapsed_ms(t0) < 15000, "slow: %ld ms", (long)elapsed_ms(t0));
    exit(0);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: core.so hostrt.so dir engine forks\n");
        return 2;
    }
    load(argv[1], argv[2]);
    dir = argv[3];
    engine = atoi(argv[4]);
    int forks = atoi(argv[5]);
    ctx_busy = ctx_new();
    ctx_held = ctx_new();
    int rw = PHX_F_READ | PHX_F_WRITE | PHX_F_CREATE | PHX_F_TRUNC;
    fa = file_at("a.bin", rw);
    fb = file_at("b.bin", rw);
    fc = file_at("c.bin", rw);
    fk = file_at("k.bin", rw);
    da = malloc(SA);
    fill(da, SA, 1);
    unsigned char *ck = malloc(SC);
    fill(ck, SC, 3);
    CHECK(io(ctx_busy, desc(fc, ck, SC, 0, PHX_OP_WRITE, PHX_MEM_HOST)) == SC, "write c");
    fill(ck, SC, 4);
    CHECK(io(ctx_busy, desc(fk, ck, SC, 0, PHX_OP_WRITE, PHX_MEM_HOST)) == SC, "write k");
    regs_base = malloc((size_t)NPERM * 4096); /* (never touched: registrations are addresses) */
    for (int i = 0; i < NPERM; i++)
        CHECK(C(phx_reg_add)((uint64_t)(uintptr_t)(regs_base + (size_t)i * 4096), 4096, PHX_MEM_HOST, 0) == 0, "reg");

    /* held across every fork: a gate on a stream, an event after it, a stream-ordered write
     * of file c behind it, and a staged read of file k whose copy waits for the stream */
    h_stream_create(&sh, 1);
    h_event_create(&ev_held, 2);
    CHECK(h_launch(sh, gate_fn, NULL) == 0 && h_event_record(ev_held, sh) == 0, "held stream");
    held_src = dev_alloc(SC);
    fill(ck, SC, 5);
    h_memcpy(held_src, ck, SC, H2D);
    struct phx_io_desc dw = desc(fc, held_src, SC, 0, PHX_OP_WRITE, PHX_MEM_DEVICE);
    CHECK(C(phx_stream_io)(ctx_held, &dw, sh, NULL, &held_sop) == 0, "held write");
    phx_fence *fence = NULL;
    CHECK(C(phx_fence_record)(ctx_held, 0, sh, &fence) == 0 && fence, "fence");
    held_dev = dev_alloc(SC);
    struct phx_io_desc dk = desc(fk, held_dev, SC, 0, PHX_OP_READ, PHX_MEM_DEVICE);
    dk.after = fence;
    CHECK(C(phx_submit)(ctx_held, &dk, 1, &held_req) == 0, "held read");
    C(phx_fence_release)(fence);

    pthread_t th[3];
    pthread_create(&th[0], NULL, t_io, NULL);
    pthread_create(&th[1], NULL, t_reg, NULL);
    pthread_create(&th[2], NULL, t_stream, NULL);
    usleep(100000);
    srand(42);
    int bad = 0;
    for (int i = 0; i < forks; i++) {
        usleep((useconds_t)(rand() % 20000));
        pid_t pid = fork();
        if (pid == 0)
            child(i);
        int st = 0;
        waitpid(pid, &st, 0); /* (a hung child is killed by its alarm) */
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "parent: child %d: %s %d\n", i, WIFEXITED(st) ? "exit" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            bad++;
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    /* the parent's held work completes, with the right bytes */
    atomic_store(&gate, 1);
    CHECK(h_stream_sync(sh) == 0 && h_event_sync(ev_held) == 0, "held stream, parent");
    CHECK(C(phx_sop_wait)(held_sop, 30000000000ll) == 0 && C(phx_sop_result)(held_sop) == SC, "held write, parent");
    CHECK(C(phx_req_wait)(held_req, 30000000000ll) == 0 && C(phx_req_result)(held_req) == SC, "held read, parent");
    unsigned char *got = malloc(SC);
    h_memcpy(got, held_dev, SC, D2H);
    fill(ck, SC, 4);
    CHECK(!memcmp(got, ck, SC), "held read bytes, parent");
    for (int i = 0; i < 3; i++)
        CHECK(atomic_load(&loops[i]) > 0, "thread %d made no progress", i);
    printf("forks %d bad %d errors %d loops %ld %ld %ld\n", forks, bad, atomic_load(&errors), atomic_load(&loops[0]),
           atomic_load(&loops[1]), atomic_load(&loops[2]));
    if (bad || atomic_load(&errors))
        return 1;
    C(phx_sop_release)(held_sop);
    C(phx_req_release)(held_req);
    CHECK(C(phx_file_close)(fa) == 0 && C(phx_file_close)(fb) == 0, "close");
    C(phx_ctx_destroy)(ctx_busy);
    C(phx_ctx_destroy)(ctx_held);
    puts("ok");
    return 0;
}
"""

ENGINES = {"io_uring": 1, "threads": 2}


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to build the fork program")
    d = tmp_path_factory.mktemp("forkc")
    (d / "fork.c").write_text(PROGRAM)
    exe = d / "fork"
    cmd = [cc, "-O1", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]
    subprocess.run([*cmd, f"-I{CSRC}", "-o", str(exe), str(d / "fork.c"), "-ldl"], check=True)
    return exe


@pytest.mark.parametrize("engine", ENGINES)
def test_children_forked_under_load_work_and_never_wait_for_the_parent(program, engine, tmp_path):
    if engine == "io_uring":
        why = ctypes.create_string_buffer(200)
        if phoenix.io._lib.phx_engine_probe(ENGINES[engine], why, len(why)) < 0:
            pytest.skip(why.value.decode())
    cmd = [str(program), core_path(), HOST_LIBRARY, str(tmp_path), str(ENGINES[engine]), str(FORKS)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung (a fork's prepare handlers, or the parent's threads): {exc.stderr}")
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["ok"], f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
