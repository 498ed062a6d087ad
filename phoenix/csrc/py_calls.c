/* The Python objects that own a call's C resources: a call that returns or raises owns nothing.
 *
 * Core side, control plane (CPython C API; the rest of the core is plain C used through
 * ctypes). Python runs signal handlers, and so raises KeyboardInterrupt or a handler's
 * exception, between any two bytecodes of the main thread: inside a `finally`, between
 * a submission and the wait that should follow it. Code written in Python cannot promise
 * that it waits for the requests it submitted before such an exception leaves it. These
 * objects can, because no bytecode runs inside them:
 *
 *   Gate      a counted entry (a file's or an engine's users): `with gate:` enters and
 *             leaves in C (CPython calls a C __exit__ once a C __enter__ has returned),
 *             close() waits for the users without the GIL, then frees the handle it owns
 *             (phx_file_close or phx_ctx_destroy) exactly once; dealloc closes an unused one.
 *   Hold      `with Hold(pick, arg) as value:` enters the gate of (gate, value) = pick(arg),
 *             picking again while the one picked is closed (an engine shut down meanwhile);
 *             pick() returning None holds nothing (and gives None).
 *             ctx_open / file_open / file_from_fd make the handle and its Gate in one call.
 *   Requests  the requests (phx_req handles), fences and buffers of one call: submitted
 *             from Python through it, waited for in C. guarded(fn, ...) runs fn(group,
 *             ...) and, if fn raises, waits for every request the group submitted, then
 *             lets the buffers go, before the exception propagates. A group outlives the
 *             call only through the futures it returned; its dealloc waits and releases.
 *   StreamOp  the base of phoenix's StreamIO: one stream-ordered op and its buffer.
 *             StreamMethod is read_async / write_async: Python plans the op (checks,
 *             resolution: may raise, nothing queued), then C enters the file's and the
 *             engine's gates, queues it and builds the StreamIO, and returns it to the
 *             caller: no bytecode of phoenix's runs between the op being queued and the
 *             caller holding it.
 *   Export    a buffer-protocol export (Py_buffer) released in C (release() or dealloc).
 *   reg_keep / reg_unkeep  a registration and the buffer kept alive for it, in one step.
 *
 * After fork() the parent's gates are reset in the child on first use (the threads that
 * held them do not exist there), and a parent's requests are never waited for in the child.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "phx_io.h"
#include "py_calls.h"

/* ---- fork generation ------------------------------------------------------------------ */

static _Atomic unsigned long fork_gen;
static pthread_mutex_t fresh_mu = PTHREAD_MUTEX_INITIALIZER;

static void calls_after_fork_child(void)
{
    atomic_fetch_add(&fork_gen, 1);
    pthread_mutex_init(&fresh_mu, NULL);
}

static unsigned long gen_now(void) { return atomic_load_explicit(&fork_gen, memory_order_acquire); }

/* ---- Gate ----------------------------------------------------------------------------- */

enum { GATE_PLAIN = 0, GATE_FILE = 1, GATE_CTX = 2 };

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

static PyTypeObject GateType;

/* A gate made before fork(), first used in the child: nobody is inside it there. */
static void gate_fresh(Gate *g)
{
    unsigned long now = gen_now();
    if (atomic_load_explicit(&g->gen, memory_order_acquire) == now)
        return;
    pthread_mutex_lock(&fresh_mu);
    if (atomic_load(&g->gen) != now) {
        pthread_mutex_init(&g->mu, NULL);
        pthread_cond_init(&g->cv, NULL);
        g->users = 0;
        atomic_store(&g->gen, now);
    }
    pthread_mutex_unlock(&fresh_mu);
}

static int gate_init(Gate *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"value", "what", "kind", "handle", NULL};
    PyObject *value = Py_None, *what = NULL;
    int kind = GATE_PLAIN;
    unsigned long long handle = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OUiK", names, &value, &what, &kind, &handle))
        return -1;
    if (kind < GATE_PLAIN || kind > GATE_CTX) {
        PyErr_SetString(PyExc_ValueError, "Gate: kind must be 0, 1 or 2");
        return -1;
    }
    if (self->value) {
        PyErr_SetString(PyExc_RuntimeError, "Gate: already initialized");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    atomic_store(&self->gen, gen_now());
    self->handle_gen = gen_now();
    self->kind = kind;
    self->handle = (void *)(uintptr_t)handle;
    Py_INCREF(value);
    self->value = value;
    if (!what)
        what = PyUnicode_FromString("closed");
    else
        Py_INCREF(what);
    self->what = what;
    return 0;
}

/* 1 entered, 0 closed. */
static int gate_try_enter(Gate *g)
{
    gate_fresh(g);
    pthread_mutex_lock(&g->mu);
    int ok = !g->closed;
    if (ok)
        g->users++;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

static void gate_leave(Gate *g)
{
    gate_fresh(g);
    pthread_mutex_lock(&g->mu);
    if (g->users > 0 && --g->users == 0)
        pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static PyObject *gate_enter_py(Gate *self, PyObject *unused)
{
    if (!self->value) {
        PyErr_SetString(PyExc_RuntimeError, "Gate: not initialized");
        return NULL;
    }
    if (!gate_try_enter(self)) {
        PyErr_SetObject(PyExc_ValueError, self->what);
        return NULL;
    }
    Py_INCREF(self->value);
    return self->value;
}

static PyObject *gate_exit_py(Gate *self, PyObject *args)
{
    gate_leave(self);
    Py_RETURN_FALSE;
}

/* Free the handle (once): the file's descriptors, the context's workers. A parent's
 * context is not destroyed in a child: its threads are not there to join. */
static int gate_free_handle(Gate *g)
{
    int rc = 0;
    void *h = g->handle;
    g->handle = NULL;
    if (!h)
        return 0;
    if (g->kind == GATE_FILE)
        rc = phx_file_close((phx_file *)h);
    else if (g->kind == GATE_CTX && g->handle_gen == gen_now())
        phx_ctx_destroy((phx_ctx *)h);
    return rc;
}

/* Close: no new users; wait (without the GIL) for those inside; free the handle.
 * Returns 1 for the call that freed it, 0 for the others (they wait for it too). */
static int gate_close(Gate *g, int *rc_out)
{
    gate_fresh(g);
    int first;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g->mu);
    first = !g->closed;
    g->closed = 1;
    while (g->users > 0)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    if (first) {
        g->close_rc = gate_free_handle(g);
        pthread_mutex_lock(&g->mu);
        g->freed = 1;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
    } else {
        pthread_mutex_lock(&g->mu);
        while (!g->freed)
            pthread_cond_wait(&g->cv, &g->mu);
        pthread_mutex_unlock(&g->mu);
    }
    Py_END_ALLOW_THREADS
    if (rc_out)
        *rc_out = g->close_rc;
    return first;
}

static PyObject *gate_close_py(Gate *self, PyObject *unused)
{
    int rc;
    int first = gate_close(self, &rc);
    return Py_BuildValue("(Oi)", first ? Py_True : Py_False, first ? rc : 0);
}

/* detach_into(addr): hand the handle to C code that owns it from now on (stored at addr, a
 * uint64_t), in one step: the gate no longer frees it. */
static PyObject *gate_detach_into(Gate *self, PyObject *arg)
{
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (!addr || !self->handle || self->users) {
        PyErr_SetString(PyExc_ValueError, "detach_into: nothing to hand over (or in use)");
        return NULL;
    }
    *(uint64_t *)(uintptr_t)addr = (uint64_t)(uintptr_t)self->handle;
    self->handle = NULL;
    self->closed = self->freed = 1;
    Py_RETURN_NONE;
}

static PyObject *gate_users(Gate *self, void *c)
{
    gate_fresh(self);
    pthread_mutex_lock(&self->mu);
    int64_t n = self->users;
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromLongLong(n);
}

static PyObject *gate_closed(Gate *self, void *c)
{
    gate_fresh(self);
    pthread_mutex_lock(&self->mu);
    int closed = self->closed;
    pthread_mutex_unlock(&self->mu);
    return PyBool_FromLong(closed);
}

static PyObject *gate_inherited(Gate *self, void *c)
{
    return PyBool_FromLong(self->handle_gen != gen_now());
}

static void gate_dealloc(Gate *self)
{
    /* users left only where threads are gone (interpreter exit): leave the handle */
    if (self->value) {
        gate_fresh(self);
        if (self->users == 0 && !self->freed) {
            self->closed = 1;
            Py_BEGIN_ALLOW_THREADS
            gate_free_handle(self); /* (a context joins its workers: not under the GIL) */
            Py_END_ALLOW_THREADS
            self->freed = 1;
        }
    }
    Py_XDECREF(self->value);
    Py_XDECREF(self->what);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef gate_methods[] = {
    {"__enter__", (PyCFunction)gate_enter_py, METH_NOARGS, "Enter (ValueError once closed); returns the value."},
    {"__exit__", (PyCFunction)gate_exit_py, METH_VARARGS, "Leave."},
    {"close", (PyCFunction)gate_close_py, METH_NOARGS,
     "Close: no new users, wait for those inside, free the handle once. Returns (first, rc)."},
    {"detach_into", (PyCFunction)gate_detach_into, METH_O, "detach_into(addr): store the handle at addr, forget it"},
    {NULL},
};

static PyGetSetDef gate_getset[] = {
    {"users", (getter)gate_users, NULL, "threads inside", NULL},
    {"closed", (getter)gate_closed, NULL, "closed to new users", NULL},
    {"inherited", (getter)gate_inherited, NULL, "made by the parent process before fork()", NULL},
    {NULL},
};

static PyMemberDef gate_members[] = {
    {"value", T_OBJECT, offsetof(Gate, value), READONLY, "what entering returns"},
    {NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gate(value=None, what='closed', kind=0, handle=0): counted entry, closed once, in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
    .tp_members = gate_members,
};

/* A Gate owning a handle just made (value: the handle's address). */
static PyObject *gate_owning(int kind, void *handle, PyObject *what)
{
    PyObject *value = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)handle);
    if (!value)
        goto fail;
    Gate *g = PyObject_New(Gate, &GateType);
    if (!g) {
        Py_DECREF(value);
        goto fail;
    }
    g->value = NULL;
    g->what = NULL;
    g->users = 0;
    g->closed = g->freed = 0;
    g->close_rc = 0;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    atomic_store(&g->gen, gen_now());
    g->handle_gen = gen_now();
    g->kind = kind;
    g->handle = handle;
    g->value = value;
    Py_INCREF(what);
    g->what = what;
    return (PyObject *)g;
fail:
    if (kind == GATE_FILE)
        phx_file_close(handle);
    else
        phx_ctx_destroy(handle);
    return NULL;
}

/* ctx_open(cfg_addr, dp_addr, what) -> Gate (value: the phx_ctx address), or -errno */
static PyObject *calls_ctx_open(PyObject *mod, PyObject *args)
{
    unsigned long long cfg, dp;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "KKU", &cfg, &dp, &what))
        return NULL;
    phx_ctx *ctx = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = phx_ctx_create((const struct phx_io_config *)(uintptr_t)cfg, (const struct phx_dp_table *)(uintptr_t)dp,
                        &ctx);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !ctx)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_CTX, ctx, what);
}

/* file_open(path, flags, perm, direct, what) -> Gate (value: the phx_file address), or -errno */
static PyObject *calls_file_open(PyObject *mod, PyObject *args)
{
    const char *path;
    int flags, perm, direct;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "yiiiU", &path, &flags, &perm, &direct, &what))
        return NULL;
    phx_file *f = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = phx_file_open(path, flags, perm, direct, &f);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !f)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_FILE, f, what);
}

/* file_from_fd(fd, direct, what) -> Gate, or -errno */
static PyObject *calls_file_from_fd(PyObject *mod, PyObject *args)
{
    int fd, direct;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "iiU", &fd, &direct, &what))
        return NULL;
    phx_file *f = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = phx_file_from_fd(fd, direct, &f);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !f)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_FILE, f, what);
}

/* ---- Hold ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *pick, *arg;
    Gate *held;
} Hold;

static int hold_init(Hold *self, PyObject *args, PyObject *kw)
{
    PyObject *pick, *arg = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &pick, &arg))
        return -1;
    Py_INCREF(pick);
    Py_XSETREF(self->pick, pick);
    Py_INCREF(arg);
    Py_XSETREF(self->arg, arg);
    return 0;
}

static PyObject *hold_enter(Hold *self, PyObject *unused)
{
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Hold: already entered");
        return NULL;
    }
    for (int tries = 0; tries < 1000; tries++) {
        PyObject *picked = PyObject_CallOneArg(self->pick, self->arg);
        if (!picked)
            return NULL;
        if (picked == Py_None)
            return picked; /* nothing to hold */
        if (!PyTuple_Check(picked) || PyTuple_GET_SIZE(picked) != 2 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(picked, 0), &GateType)) {
            Py_DECREF(picked);
            PyErr_SetString(PyExc_TypeError, "Hold: the picker must return (Gate, value)");
            return NULL;
        }
        Gate *g = (Gate *)PyTuple_GET_ITEM(picked, 0);
        if (gate_try_enter(g)) {
            Py_INCREF(g);
            self->held = g;
            PyObject *value = PyTuple_GET_ITEM(picked, 1);
            Py_INCREF(value);
            Py_DECREF(picked);
            return value;
        }
        Py_DECREF(picked); /* closed meanwhile: pick again */
    }
    PyErr_SetString(PyExc_RuntimeError, "phoenix: every engine picked was closing (shutdown() in a loop?)");
    return NULL;
}

static PyObject *hold_exit(Hold *self, PyObject *args)
{
    Gate *g = self->held;
    self->held = NULL;
    if (g) {
        gate_leave(g);
        Py_DECREF(g);
    }
    Py_RETURN_FALSE;
}

static void hold_dealloc(Hold *self)
{
    if (self->held) { /* (entered and never left: only if __exit__ was bypassed) */
        gate_leave(self->held);
        Py_DECREF(self->held);
    }
    Py_XDECREF(self->pick);
    Py_XDECREF(self->arg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef hold_methods[] = {
    {"__enter__", (PyCFunction)hold_enter, METH_NOARGS, "Enter the gate pick(arg) returns; its value."},
    {"__exit__", (PyCFunction)hold_exit, METH_VARARGS, "Leave it."},
    {NULL},
};

static PyTypeObject HoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.Hold",
    .tp_basicsize = sizeof(Hold),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hold(pick, arg): `with` enters the Gate of (gate, value) = pick(arg) and gives value (picks again while it is closing).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hold_init,
    .tp_dealloc = (destructor)hold_dealloc,
    .tp_methods = hold_methods,
};

/* ---- Export --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
} Export;

static int export_init(Export *self, PyObject *args, PyObject *kw)
{
    PyObject *obj;
    int writable = 0;
    if (!PyArg_ParseTuple(args, "O|p", &obj, &writable))
        return -1;
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Export: already holds a buffer");
        return -1;
    }
    /* C-contiguous (PyBUF_ND without strides); PyBUF_FORMAT: the caller refuses formats whose
     * items are not plain bytes */
    if (PyObject_GetBuffer(obj, &self->view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_ND | PyBUF_FORMAT) < 0)
        return -1;
    self->held = 1;
    return 0;
}

static void export_release_now(Export *self)
{
    if (self->held) {
        self->held = 0;
        PyBuffer_Release(&self->view);
    }
}

static PyObject *export_release(Export *self, PyObject *unused)
{
    export_release_now(self);
    Py_RETURN_NONE;
}

static PyObject *export_get(Export *self, void *which)
{
    if (!self->held)
        return PyErr_Format(PyExc_ValueError, "Export: released");
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->view.buf);
    case 1:
        return PyLong_FromSsize_t(self->view.len);
    case 2:
        return PyBool_FromLong(self->view.readonly);
    default:
        return PyUnicode_FromString(self->view.format ? self->view.format : "B");
    }
}

static void export_dealloc(Export *self)
{
    export_release_now(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef export_methods[] = {
    {"release", (PyCFunction)export_release, METH_NOARGS, "Release the export (idempotent)."},
    {NULL},
};

static PyGetSetDef export_getset[] = {
    {"addr", (getter)export_get, NULL, "the buffer's address", (void *)0},
    {"nbytes", (getter)export_get, NULL, "its length in bytes", (void *)1},
    {"readonly", (getter)export_get, NULL, "read-only", (void *)2},
    {"format", (getter)export_get, NULL, "its struct format", (void *)3},
    {NULL},
};

static PyTypeObject ExportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.Export",
    .tp_basicsize = sizeof(Export),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Export(obj, writable=False): a C-contiguous buffer export, released in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)export_init,
    .tp_dealloc = (destructor)export_dealloc,
    .tp_methods = export_methods,
    .tp_getset = export_getset,
};

/* Let go of a buffer phoenix adapted (phoenix.buffers.Buffer): its export first, in C,
 * then the object (the rest it keeps goes with it). No bytecode runs. */
static void drop_kept(PyObject *obj)
{
    if (!obj)
        return;
    if (PyObject_TypeCheck(obj, &ExportType)) {
        export_release_now((Export *)obj);
    } else {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *view = PyObject_GetAttrString(obj, "_view");
        if (view && PyObject_TypeCheck(view, &ExportType))
            export_release_now((Export *)view);
        Py_XDECREF(view);
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(obj);
}

/* ---- Requests --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    phx_req **h;     /* handles, NULL: none (refused in Python, or out of memory) */
    PyObject **kept; /* per request: released once it is done */
    Py_ssize_t n, cap;
    PyObject *kept_all; /* list: released once all are done */
    phx_fence **fences;
    Py_ssize_t nf, capf;
    PyObject *gates; /* list of the Gates entered for the submission (files) */
    unsigned long gen;
    int finished;
} Requests;

static PyTypeObject RequestsType;

static int reqs_grow(Requests *g, Py_ssize_t need)
{
    if (need <= g->cap)
        return 0;
    Py_ssize_t cap = g->cap ? g->cap : 16;
    while (cap < need)
        cap *= 2;
    phx_req **h = PyMem_Realloc(g->h, (size_t)cap * sizeof(*h));
    if (!h)
        goto nomem;
    g->h = h;
    PyObject **k = PyMem_Realloc(g->kept, (size_t)cap * sizeof(*k));
    if (!k)
        goto nomem;
    g->kept = k;
    for (Py_ssize_t i = g->cap; i < cap; i++) {
        g->h[i] = NULL;
        g->kept[i] = NULL;
    }
    g->cap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static Requests *reqs_new(void)
{
    Requests *g = PyObject_New(Requests, &RequestsType);
    if (!g)
        return NULL;
    g->h = NULL;
    g->kept = NULL;
    g->n = g->cap = 0;
    g->kept_all = NULL;
    g->fences = NULL;
    g->nf = g->capf = 0;
    g->gates = NULL;
    g->gen = gen_now();
    g->finished = 0;
    return g;
}

static int reqs_live(Requests *g) { return g->gen == gen_now(); }

/* Wait for every request (no GIL). A parent's requests are not waited for in a child. */
static void reqs_wait_all(Requests *g)
{
    if (!g->n || !reqs_live(g))
        return;
    Py_BEGIN_ALLOW_THREADS
    phx_req_wait_all(g->h, (uint32_t)g->n, NULL, -1);
    Py_END_ALLOW_THREADS
}

static void reqs_release_fences(Requests *g)
{
    for (Py_ssize_t i = 0; i < g->nf; i++)
        if (g->fences[i] && reqs_live(g))
            phx_fence_release(g->fences[i]);
    g->nf = 0;
}

/* The submission is over: leave the gates it entered (the core counts its requests in
 * the files itself). */
static void reqs_leave_gates(Requests *g)
{
    PyObject *gates = g->gates;
    g->gates = NULL;
    if (!gates)
        return;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gates); i++)
        gate_leave((Gate *)PyList_GET_ITEM(gates, i));
    Py_DECREF(gates);
}

/* Every request done: let the buffers go, and the fences. */
static void reqs_finish(Requests *g)
{
    reqs_wait_all(g);
    reqs_leave_gates(g);
    reqs_release_fences(g);
    for (Py_ssize_t i = 0; i < g->cap; i++) {
        PyObject *k = g->kept ? g->kept[i] : NULL;
        if (k) {
            g->kept[i] = NULL;
            drop_kept(k);
        }
    }
    PyObject *all = g->kept_all;
    g->kept_all = NULL;
    if (all) {
        Py_ssize_t m = PyList_GET_SIZE(all);
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *k = PyList_GET_ITEM(all, i);
            Py_INCREF(k);
            drop_kept(k);
        }
        Py_DECREF(all);
    }
    g->finished = 1;
}

static void reqs_dealloc(Requests *g)
{
    reqs_finish(g);
    if (reqs_live(g))
        phx_req_release_all(g->h, (uint32_t)g->n);
    PyMem_Free(g->h);
    PyMem_Free(g->kept);
    PyMem_Free(g->fences);
    PyObject_Free(g);
}

static int reqs_index(Requests *g, Py_ssize_t i)
{
    if (i < 0 || i >= g->n) {
        PyErr_Format(PyExc_IndexError, "request %zd of %zd", i, g->n);
        return -1;
    }
    return 0;
}

/* submit(ctx, descs_addr, count) -> rc: phx_submit into the next `count` slots (the
 * first is `count` before the call). On a refusal (out of memory) the slots stay empty. */
static PyObject *reqs_submit(Requests *g, PyObject *args)
{
    unsigned long long ctx, descs;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "KKn", &ctx, &descs, &count))
        return NULL;
    if (count < 0 || count > UINT32_MAX || (count && (!ctx || !descs))) {
        PyErr_SetString(PyExc_ValueError, "submit: bad arguments");
        return NULL;
    }
    if (g->finished) {
        PyErr_SetString(PyExc_RuntimeError, "submit: the group is finished");
        return NULL;
    }
    if (reqs_grow(g, g->n + count) < 0)
        return NULL;
    int rc = 0;
    phx_req **out = g->h + g->n;
    Py_BEGIN_ALLOW_THREADS
    rc = phx_submit((phx_ctx *)(uintptr_t)ctx, (const struct phx_io_desc *)(uintptr_t)descs, (uint32_t)count, out);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        for (Py_ssize_t i = 0; i < count; i++)
            out[i] = NULL;
    g->n += count;
    return PyLong_FromLong(rc);
}

static PyObject *reqs_keep(Requests *g, PyObject *args)
{
    Py_ssize_t i;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "nO", &i, &obj))
        return NULL;
    if (i < 0) {
        PyErr_SetString(PyExc_IndexError, "keep: negative index");
        return NULL;
    }
    if (reqs_grow(g, i + 1) < 0)
        return NULL;
    if (obj == Py_None)
        Py_RETURN_NONE;
    Py_INCREF(obj);
    PyObject *old = g->kept[i];
    g->kept[i] = obj;
    if (old)
        drop_kept(old);
    Py_RETURN_NONE;
}

static PyObject *reqs_keep_all(Requests *g, PyObject *obj)
{
    if (obj == Py_None)
        Py_RETURN_NONE;
    if (!g->kept_all && !(g->kept_all = PyList_New(0)))
        return NULL;
    if (PyList_Append(g->kept_all, obj) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *reqs_handle(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)g->h[i]);
}

static PyObject *reqs_done(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    return PyBool_FromLong(!g->h[i] || !reqs_live(g) || phx_req_done(g->h[i]));
}

/* wait(i, timeout_ns) -> 0, or -ETIMEDOUT */
static PyObject *reqs_wait(Requests *g, PyObject *args)
{
    Py_ssize_t i;
    long long ns = -1;
    if (!PyArg_ParseTuple(args, "n|L", &i, &ns) || reqs_index(g, i) < 0)
        return NULL;
    phx_req *r = g->h[i];
    int rc = 0;
    if (r && reqs_live(g)) {
        Py_BEGIN_ALLOW_THREADS
        rc = phx_req_wait(r, ns);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(rc);
}

/* result(i) -> bytes moved or -errno (-ENOMEM: no handle; -ECHILD: the parent's) */
static PyObject *reqs_result(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    phx_req *r = g->h[i];
    if (!r)
        return PyLong_FromLong(-ENOMEM);
    if (!reqs_live(g) && !phx_req_done(r))
        return PyLong_FromLong(-ECHILD);
    return PyLong_FromLongLong(phx_req_result(r));
}

/* error_extent(i) -> (offset, length) of the failed chunk, or None */
static PyObject *reqs_error_extent(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    int64_t off = 0;
    uint64_t len = 0;
    if (!g->h[i] || phx_req_error_extent(g->h[i], &off, &len) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(LK)", (long long)off, (unsigned long long)len);
}

/* wait_all(results_addr, start, count) -> 0: waits (no GIL) and writes results[0:count]
 * (as phx_req_result; -ENOMEM for an empty slot) */
static PyObject *reqs_wait_all_py(Requests *g, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "Knn", &addr, &start, &count))
        return NULL;
    if (start < 0 || count < 0 || start + count > g->n || (count && !addr)) {
        PyErr_SetString(PyExc_IndexError, "wait_all: slice outside the group");
        return NULL;
    }
    int64_t *res = (int64_t *)(uintptr_t)addr;
    if (!reqs_live(g)) {
        for (Py_ssize_t i = 0; i < count; i++) {
            phx_req *r = g->h[start + i];
            res[i] = !r ? -ENOMEM : phx_req_done(r) ? phx_req_result(r) : -ECHILD;
        }
        return PyLong_FromLong(0);
    }
    Py_BEGIN_ALLOW_THREADS
    phx_req_wait_all(g->h + start, (uint32_t)count, res, -1);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(0);
}

/* collect(i): request i is done: let its buffer go (no-op while it runs) */
static PyObject *reqs_collect(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    if (g->h[i] && reqs_live(g) && !phx_req_done(g->h[i]))
        Py_RETURN_FALSE;
    PyObject *k = g->kept[i];
    g->kept[i] = NULL;
    if (k)
        drop_kept(k);
    Py_RETURN_TRUE;
}

static PyObject *reqs_finish_py(Requests *g, PyObject *unused)
{
    reqs_finish(g);
    Py_RETURN_NONE;
}

/* fence(ctx, device, stream) -> (rc, fence address or 0): the caller's stream point,
 * released with the group (after the requests naming it were submitted) */
static PyObject *reqs_fence(Requests *g, PyObject *args)
{
    unsigned long long ctx, stream;
    int device;
    if (!PyArg_ParseTuple(args, "KiK", &ctx, &device, &stream))
        return NULL;
    if (g->nf == g->capf) {
        Py_ssize_t cap = g->capf ? 2 * g->capf : 4;
        phx_fence **f = PyMem_Realloc(g->fences, (size_t)cap * sizeof(*f));
        if (!f)
            return PyErr_NoMemory();
        g->fences = f;
        g->capf = cap;
    }
    phx_fence *out = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = phx_fence_record((phx_ctx *)(uintptr_t)ctx, device, (void *)(uintptr_t)stream, &out);
    Py_END_ALLOW_THREADS
    if (rc == 0 && out)
        g->fences[g->nf++] = out;
    return Py_BuildValue("(iK)", rc, (unsigned long long)(uintptr_t)out);
}

/* enter(gate) -> gate.value: held until the submission is over (the end of guarded()) */
static PyObject *reqs_enter(Requests *g, PyObject *gate)
{
    if (!PyObject_TypeCheck(gate, &GateType)) {
        PyErr_SetString(PyExc_TypeError, "enter: a Gate expected");
        return NULL;
    }
    if (!g->gates && !(g->gates = PyList_New(0)))
        return NULL;
    if (PyList_Append(g->gates, gate) < 0) /* (before entering: leaving never fails) */
        return NULL;
    if (!gate_try_enter((Gate *)gate)) {
        Py_ssize_t last = PyList_GET_SIZE(g->gates) - 1;
        PySequence_DelItem(g->gates, last);
        PyErr_SetObject(PyExc_ValueError, ((Gate *)gate)->what);
        return NULL;
    }
    Py_INCREF(((Gate *)gate)->value);
    return ((Gate *)gate)->value;
}

static PyObject *reqs_count(Requests *g, void *c) { return PyLong_FromSsize_t(g->n); }

static PyMethodDef reqs_methods[] = {
    {"submit", (PyCFunction)reqs_submit, METH_VARARGS, "submit(ctx, descs_addr, count) -> rc"},
    {"keep", (PyCFunction)reqs_keep, METH_VARARGS, "keep(i, buffer): released once request i is done"},
    {"keep_all", (PyCFunction)reqs_keep_all, METH_O, "keep_all(buffer): released once every request is done"},
    {"handle", (PyCFunction)reqs_handle, METH_O, "handle(i) -> the phx_req address (0: none)"},
    {"done", (PyCFunction)reqs_done, METH_O, "done(i) -> bool"},
    {"wait", (PyCFunction)reqs_wait, METH_VARARGS, "wait(i, timeout_ns=-1) -> 0 or -ETIMEDOUT (no GIL)"},
    {"result", (PyCFunction)reqs_result, METH_O, "result(i) -> bytes or -errno"},
    {"error_extent", (PyCFunction)reqs_error_extent, METH_O, "error_extent(i) -> (offset, length) or None"},
    {"wait_all", (PyCFunction)reqs_wait_all_py, METH_VARARGS, "wait_all(results_addr, start, count) (no GIL)"},
    {"collect", (PyCFunction)reqs_collect, METH_O, "collect(i): let request i's buffer go once it is done"},
    {"finish", (PyCFunction)reqs_finish_py, METH_NOARGS, "wait for all (no GIL), let buffers and fences go"},
    {"fence", (PyCFunction)reqs_fence, METH_VARARGS, "fence(ctx, device, stream) -> (rc, fence)"},
    {"enter", (PyCFunction)reqs_enter, METH_O, "enter(gate) -> its value, held until the submission is over"},
    {NULL},
};

static PyGetSetDef reqs_getset[] = {
    {"count", (getter)reqs_count, NULL, "requests submitted (slots used)", NULL},
    {NULL},
};

static PyTypeObject RequestsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.Requests",
    .tp_basicsize = sizeof(Requests),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The requests, fences and buffers of one call (made by guarded()).",
    .tp_dealloc = (destructor)reqs_dealloc,
    .tp_methods = reqs_methods,
    .tp_getset = reqs_getset,
};

/* guarded(fn, *args, **kw): fn(group, *args, **kw); if it raises, every request of the
 * group is waited for and its buffers let go before the exception propagates. */
static PyObject *calls_guarded(PyObject *mod, PyObject *args, PyObject *kw)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "guarded(fn, *args)");
        return NULL;
    }
    Requests *g = reqs_new();
    if (!g)
        return NULL;
    PyObject *callargs = PyTuple_New(n);
    if (!callargs) {
        Py_DECREF(g);
        return NULL;
    }
    Py_INCREF(g);
    PyTuple_SET_ITEM(callargs, 0, (PyObject *)g);
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        Py_INCREF(a);
        PyTuple_SET_ITEM(callargs, i, a);
    }
    PyObject *res = PyObject_Call(PyTuple_GET_ITEM(args, 0), callargs, kw);
    Py_DECREF(callargs);
    if (!res) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        reqs_finish(g);
        PyErr_Restore(et, ev, tb);
    } else {
        reqs_leave_gates(g);
        reqs_release_fences(g); /* (every request naming them was submitted) */
    }
    Py_DECREF(g);
    return res;
}

/* ---- StreamOp ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    phx_sop *sop;
    PyObject *buf; /* kept until the op is done */
    PyObject *engine, *file, *what;
    long long offset, size, value;
    int done;
    unsigned long gen;
    PyObject *weaklist;
} StreamOp;

static PyTypeObject StreamOpType;

static void sop_collect(StreamOp *s)
{
    if (s->done)
        return;
    s->value = s->gen == gen_now() ? phx_sop_result(s->sop) : -ECHILD;
    s->done = 1;
    PyObject *b = s->buf;
    s->buf = NULL;
    drop_kept(b);
    Py_CLEAR(s->engine);
}

static int sop_is_done(StreamOp *s) { return s->done || !s->sop || s->gen != gen_now() || phx_sop_done(s->sop); }

static PyObject *streamop_poll(StreamOp *s, PyObject *unused)
{
    if (!s->sop)
        Py_RETURN_FALSE;
    if (!s->done && sop_is_done(s))
        sop_collect(s);
    return PyBool_FromLong(s->done);
}

/* _wait(timeout_ns) -> True once done (no GIL while waiting) */
static PyObject *streamop_wait(StreamOp *s, PyObject *args)
{
    long long ns = -1;
    if (!PyArg_ParseTuple(args, "|L", &ns))
        return NULL;
    if (!s->sop)
        Py_RETURN_FALSE;
    if (!s->done && !sop_is_done(s)) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = phx_sop_wait(s->sop, ns);
        Py_END_ALLOW_THREADS
        if (rc != 0)
            Py_RETURN_FALSE;
    }
    sop_collect(s);
    Py_RETURN_TRUE;
}

static void streamop_dealloc(StreamOp *s)
{
    PyObject_GC_UnTrack(s);
    if (s->weaklist)
        PyObject_ClearWeakRefs((PyObject *)s);
    if (s->sop) {
        if (!sop_is_done(s)) { /* the buffer must outlive the op */
            Py_BEGIN_ALLOW_THREADS
            phx_sop_wait(s->sop, -1);
            Py_END_ALLOW_THREADS
        }
        sop_collect(s);
        if (s->gen == gen_now())
            phx_sop_release(s->sop);
        s->sop = NULL;
    }
    Py_CLEAR(s->buf);
    Py_CLEAR(s->engine);
    Py_CLEAR(s->file);
    Py_CLEAR(s->what);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int streamop_traverse(StreamOp *s, visitproc visit, void *arg)
{
    Py_VISIT(s->engine);
    Py_VISIT(s->file);
    Py_VISIT(s->what);
    return 0; /* (buf: never cleared by the collector while the op may run) */
}

static int streamop_clear(StreamOp *s)
{
    Py_CLEAR(s->file);
    Py_CLEAR(s->what);
    if (s->done)
        Py_CLEAR(s->engine);
    return 0;
}

static PyObject *streamop_value(StreamOp *s, void *c)
{
    if (!s->done)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(s->value);
}

static PyMethodDef streamop_methods[] = {
    {"_poll", (PyCFunction)streamop_poll, METH_NOARGS, "True once done (collects the result)"},
    {"_wait", (PyCFunction)streamop_wait, METH_VARARGS, "_wait(timeout_ns=-1) -> True once done"},
    {NULL},
};

static PyMemberDef streamop_members[] = {
    {"_file", T_OBJECT, offsetof(StreamOp, file), READONLY, NULL},
    {"_what", T_OBJECT, offsetof(StreamOp, what), READONLY, NULL},
    {"_offset", T_LONGLONG, offsetof(StreamOp, offset), READONLY, NULL},
    {"_size", T_LONGLONG, offsetof(StreamOp, size), READONLY, NULL},
    {"_done", T_INT, offsetof(StreamOp, done), READONLY, NULL},
    {NULL},
};

static PyObject *streamop_sop(StreamOp *s, void *c)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)s->sop);
}

static PyGetSetDef streamop_getset[] = {
    {"_value", (getter)streamop_value, NULL, "the count or -errno once done, else None", NULL},
    {"_sop", (getter)streamop_sop, NULL, "the phx_sop address", NULL},
    {NULL},
};

static PyObject *streamop_new(PyTypeObject *t, PyObject *a, PyObject *k)
{
    PyErr_SetString(PyExc_TypeError, "stream ops are made by read_async / write_async");
    return NULL;
}

static PyTypeObject StreamOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.StreamOp",
    .tp_basicsize = sizeof(StreamOp),
    .tp_weaklistoffset = offsetof(StreamOp, weaklist),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One stream-ordered op (the base of phoenix.io.StreamIO).",
    .tp_new = streamop_new,
    .tp_dealloc = (destructor)streamop_dealloc,
    .tp_traverse = (traverseproc)streamop_traverse,
    .tp_clear = (inquiry)streamop_clear,
    .tp_methods = streamop_methods,
    .tp_members = streamop_members,
    .tp_getset = streamop_getset,
};

/* ---- StreamMethod: read_async / write_async ------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *plan, *refused;
    PyObject *dict;
} StreamMethod;

static int smethod_init(StreamMethod *self, PyObject *args, PyObject *kw)
{
    PyObject *plan, *refused;
    if (!PyArg_ParseTuple(args, "OO", &plan, &refused))
        return -1;
    Py_INCREF(plan);
    Py_XSETREF(self->plan, plan);
    Py_INCREF(refused);
    Py_XSETREF(self->refused, refused);
    return 0;
}

/* The plan: (file_gate, engine_gate, ctx, desc_addr, desc, stream, cls, ops, buf, what,
 * file, offset, size, engine); planned again if the engine is closing meanwhile. Returns
 * the op; a refusal of the core (nothing queued) is refused(rc, file, offset, size, what)'s,
 * which raises. */
static PyObject *smethod_call(StreamMethod *self, PyObject *args, PyObject *kw)
{
    for (int tries = 0; tries < 100; tries++) {
        PyObject *p = PyObject_Call(self->plan, args, kw);
        if (!p)
            return NULL;
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 14) {
            Py_DECREF(p);
            PyErr_SetString(PyExc_SystemError, "stream plan: a 14-tuple expected");
            return NULL;
        }
        Gate *fg = (Gate *)PyTuple_GET_ITEM(p, 0), *eg = (Gate *)PyTuple_GET_ITEM(p, 1);
        PyTypeObject *cls = (PyTypeObject *)PyTuple_GET_ITEM(p, 6);
        PyObject *ops = PyTuple_GET_ITEM(p, 7);
        unsigned long long ctx = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 2));
        unsigned long long desc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 3));
        unsigned long long stream = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(p, 5));
        long long offset = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 11));
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 12));
        if (PyErr_Occurred() || !PyObject_TypeCheck(fg, &GateType) || !PyObject_TypeCheck(eg, &GateType) ||
            !PyType_Check(cls) || !PyType_IsSubtype(cls, &StreamOpType) || !PySet_Check(ops)) {
            Py_DECREF(p);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_SystemError, "stream plan: bad items");
            return NULL;
        }
        /* Everything that can fail in Python is done: from here on, C only. */
        StreamOp *op = (StreamOp *)cls->tp_alloc(cls, 0);
        if (!op) {
            Py_DECREF(p);
            return NULL;
        }
        if (!gate_try_enter(eg)) {
            Py_DECREF(op);
            Py_DECREF(p);
            continue; /* the engine is closing: plan again on the current one */
        }
        if (!gate_try_enter(fg)) {
            gate_leave(eg);
            Py_DECREF(op);
            PyErr_SetObject(PyExc_ValueError, fg->what);
            Py_DECREF(p);
            return NULL;
        }
        phx_sop *sop = NULL;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = phx_stream_io((phx_ctx *)(uintptr_t)ctx, (const struct phx_io_desc *)(uintptr_t)desc,
                           (void *)(uintptr_t)stream, NULL, &sop);
        Py_END_ALLOW_THREADS
        gate_leave(fg);
        gate_leave(eg);
        if (rc < 0) { /* nothing was queued: refused(rc, file, offset, size, what) raises */
            Py_DECREF(op);
            PyObject *err = PyObject_CallFunction(self->refused, "iOOOO", rc, PyTuple_GET_ITEM(p, 10),
                                                  PyTuple_GET_ITEM(p, 11), PyTuple_GET_ITEM(p, 12),
                                                  PyTuple_GET_ITEM(p, 9));
            Py_DECREF(p);
            return err;
        }
        op->sop = sop;
        op->gen = gen_now();
        op->buf = PyTuple_GET_ITEM(p, 8);
        Py_INCREF(op->buf);
        op->what = PyTuple_GET_ITEM(p, 9);
        Py_INCREF(op->what);
        op->file = PyTuple_GET_ITEM(p, 10);
        Py_INCREF(op->file);
        op->engine = PyTuple_GET_ITEM(p, 13);
        Py_INCREF(op->engine);
        op->offset = offset;
        op->size = size;
        /* kept alive until done, also when the caller drops it (its buffer with it) */
        if (PySet_Add(ops, (PyObject *)op) < 0)
            PyErr_Clear(); /* (out of memory: the caller's reference is the only one) */
        Py_DECREF(p);
        return (PyObject *)op;
    }
    PyErr_SetString(PyExc_RuntimeError, "phoenix: every engine planned on was closing (shutdown() in a loop?)");
    return NULL;
}

static PyObject *smethod_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (!obj || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static void smethod_dealloc(StreamMethod *self)
{
    Py_XDECREF(self->plan);
    Py_XDECREF(self->refused);
    Py_XDECREF(self->dict);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyGetSetDef smethod_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject StreamMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcore.StreamMethod",
    .tp_basicsize = sizeof(StreamMethod),
    .tp_dictoffset = offsetof(StreamMethod, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "StreamMethod(plan, refused): a method that plans a stream op in Python and queues it in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)smethod_init,
    .tp_dealloc = (destructor)smethod_dealloc,
    .tp_call = (ternaryfunc)smethod_call,
    .tp_descr_get = smethod_get,
    .tp_getset = smethod_getset,
};

/* ---- registrations: the core's entry and what keeps its memory alive, in one step ------ */

/* reg_keep(kept, buf, addr, nbytes, mem, device) -> phx_reg_add's rc; on success buf is
 * appended to the list kept (phoenix.register's: one per reference) */
static PyObject *calls_reg_keep(PyObject *mod, PyObject *args)
{
    PyObject *kept, *buf;
    unsigned long long addr, nbytes;
    int mem, device;
    if (!PyArg_ParseTuple(args, "O!OKKii", &PyList_Type, &kept, &buf, &addr, &nbytes, &mem, &device))
        return NULL;
    int rc = phx_reg_add(addr, nbytes, mem, device);
    if (rc >= 0 && PyList_Append(kept, buf) < 0) {
        phx_reg_remove(addr);
        return NULL;
    }
    return PyLong_FromLong(rc);
}

/* reg_unkeep(kept, addr) -> phx_reg_remove's rc; one kept buffer let go (also when the core
 * had no entry: nothing is kept pinned for it) */
static PyObject *calls_reg_unkeep(PyObject *mod, PyObject *args)
{
    PyObject *kept;
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "O!K", &PyList_Type, &kept, &addr))
        return NULL;
    int rc = phx_reg_remove(addr);
    Py_ssize_t n = PyList_GET_SIZE(kept);
    if (n > 0) {
        PyObject *last = PyList_GET_ITEM(kept, n - 1);
        Py_INCREF(last);
        if (PyList_SetSlice(kept, n - 1, n, NULL) < 0) {
            Py_DECREF(last);
            return NULL;
        }
        drop_kept(last);
    }
    return PyLong_FromLong(rc);
}

/* ---- module ----------------------------------------------------------------------------- */

static PyMethodDef calls_functions[] = {
    {"ctx_open", (PyCFunction)calls_ctx_open, METH_VARARGS, "ctx_open(cfg_addr, dp_addr, what) -> Gate or -errno"},
    {"file_open", (PyCFunction)calls_file_open, METH_VARARGS,
     "file_open(path, flags, perm, direct, what) -> Gate or -errno"},
    {"file_from_fd", (PyCFunction)calls_file_from_fd, METH_VARARGS, "file_from_fd(fd, direct, what) -> Gate or -errno"},
    {"reg_keep", (PyCFunction)calls_reg_keep, METH_VARARGS,
     "reg_keep(kept, buf, addr, nbytes, mem, device) -> rc: register and keep buf, in one step"},
    {"reg_unkeep", (PyCFunction)calls_reg_unkeep, METH_VARARGS,
     "reg_unkeep(kept, addr) -> rc: drop one reference and let one kept buffer go, in one step"},
    {"guarded", (PyCFunction)(void (*)(void))calls_guarded, METH_VARARGS | METH_KEYWORDS,
     "guarded(fn, *args, **kw): fn(requests, *args, **kw); on an exception every request of the group "
     "is waited for and its buffers released before it propagates."},
    {NULL},
};

int py_calls_init(PyObject *m)
{
    static int atfork_done;
    if (!atfork_done) {
        if (pthread_atfork(NULL, NULL, calls_after_fork_child) != 0)
            return -1;
        atfork_done = 1;
    }
    PyTypeObject *types[] = {&GateType, &HoldType, &ExportType, &RequestsType, &StreamOpType, &StreamMethodType};
    const char *names[] = {"Gate", "Hold", "Export", "Requests", "StreamOp", "StreamMethod"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0)
            return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    if (PyModule_AddFunctions(m, calls_functions) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "GATE_PLAIN", GATE_PLAIN) < 0 || PyModule_AddIntConstant(m, "GATE_FILE", GATE_FILE) < 0 ||
        PyModule_AddIntConstant(m, "GATE_CTX", GATE_CTX) < 0)
        return -1;
    return 0;
}
