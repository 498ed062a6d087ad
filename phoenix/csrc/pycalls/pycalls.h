/* phoenix._phxcalls (pycalls*.c): what its files share.
 *
 * Core side, control plane (CPython C API): the core's entry points as bound at import, the
 * fork generation, the Gate (files' and engines' counted entries) and how a kept buffer is
 * let go. Declared hidden: the module exports PyInit__phxcalls only. */
#ifndef PHX_PYCALLS_H
#define PHX_PYCALLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "phx_io.h"

#pragma GCC visibility push(hidden)

/* The C core's entry points (bind(): dlsym from the core ctypes loaded). */
struct pycalls_core {
    int (*ctx_create)(const struct phx_io_config *, const struct phx_dp_table *, phx_ctx **);
    void (*ctx_destroy)(phx_ctx *);
    int (*fence_record)(phx_ctx *, int, void *, phx_fence **);
    void (*fence_release)(phx_fence *);
    int (*file_close)(phx_file *);
    int (*file_from_fd)(int, int, phx_file **);
    int (*file_open)(const char *, int, int, int, phx_file **);
    int (*reg_add)(uint64_t, uint64_t, int, int);
    int (*reg_remove)(uint64_t);
    int (*req_done)(const phx_req *);
    int (*req_error_extent)(const phx_req *, int64_t *, uint64_t *);
    void (*req_release_all)(phx_req **, uint32_t);
    int64_t (*req_result)(const phx_req *);
    int (*req_wait)(phx_req *, int64_t);
    int (*req_wait_all)(phx_req **, uint32_t, int64_t *, int64_t);
    int (*sop_done)(const phx_sop *);
    void (*sop_release)(phx_sop *);
    int64_t (*sop_result)(const phx_sop *);
    int (*sop_wait)(phx_sop *, int64_t);
    int (*stream_io)(phx_ctx *, const struct phx_io_desc *, void *, int64_t *, phx_sop **);
    int (*submit)(phx_ctx *, const struct phx_io_desc *, uint32_t, phx_req **);
};
extern struct pycalls_core core;
extern int bound;
/* 0 once bound; else -1 with RuntimeError set */
int need_bound(void);

/* Bumped in a forked child: objects made before it belong to the parent. */
unsigned long gen_now(void);

enum { GATE_FILE = 1, GATE_CTX = 2 };

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic unsigned long gen;
    int64_t users;
    int closed;    /* no new users */
    int freed;     /* the handle was freed (close ran to its end) */
    int kind;      /* GATE_*: what the handle is */
    void *handle;  /* phx_file * or phx_ctx * (owned), or NULL */
    unsigned long handle_gen;
    int close_rc;
    PyObject *value; /* what __enter__ returns */
    PyObject *what;  /* the ValueError's message once closed */
} Gate;

extern PyTypeObject GateType, HoldType, ExportType, RequestsType, StreamOpType, StreamMethodType;
/* 1 entered, 0 closed */
int gate_try_enter(Gate *g);
void gate_leave(Gate *g);
/* Let go of a kept buffer (phoenix.buffers.Buffer or Export): its export in C, then the
 * reference. No bytecode runs. */
void drop_kept(PyObject *obj);
/* Module functions of each file (added by PyInit__phxcalls). */
extern PyMethodDef gate_functions[], reqs_functions[], regs_functions[];
/* the fork hook of the gates (pthread_atfork, child) and the lock it makes anew */
void calls_after_fork_child(void);
extern pthread_mutex_t gate_fresh_mu;

#pragma GCC visibility pop

#endif
