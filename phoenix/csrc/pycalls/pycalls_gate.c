/* Gate and Hold: a file's or an engine's users, counted and left in C; the handle owned.
 *
 * Core side, control plane (phoenix._phxcalls; pycalls.c says what the module is for). */
#include "pycalls.h"

#include <errno.h>

/* ---- Gate ----------------------------------------------------------------------------- */

/* Serializes the reset of a parent's gates in a child (made anew there: calls_after_fork_child). */
pthread_mutex_t gate_fresh_mu = PTHREAD_MUTEX_INITIALIZER;

/* A gate made before fork(), first used in the child: nobody is inside it there. */
static void gate_fresh(Gate *g)
{
    unsigned long now = gen_now();
    if (atomic_load_explicit(&g->gen, memory_order_acquire) == now)
        return;
    pthread_mutex_lock(&gate_fresh_mu);
    if (atomic_load(&g->gen) != now) {
        pthread_mutex_init(&g->mu, NULL);
        pthread_cond_init(&g->cv, NULL);
        g->users = 0;
        atomic_store(&g->gen, now);
    }
    pthread_mutex_unlock(&gate_fresh_mu);
}

/* 1 entered, 0 closed. */
int gate_try_enter(Gate *g)
{
    gate_fresh(g);
    pthread_mutex_lock(&g->mu);
    int ok = !g->closed;
    if (ok)
        g->users++;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

void gate_leave(Gate *g)
{
    gate_fresh(g);
    pthread_mutex_lock(&g->mu);
    if (g->users > 0 && --g->users == 0)
        pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static PyObject *gate_enter_py(Gate *self, PyObject *unused)
{
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
        rc = core.file_close((phx_file *)h);
    else if (g->kind == GATE_CTX && g->handle_gen == gen_now())
        core.ctx_destroy((phx_ctx *)h);
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

PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A counted entry owning a C file or context, closed once, in C (made by ctx_open / file_open).",
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
    .tp_members = gate_members,
};

/* A Gate owning a handle just made (value: the handle's address): the only way one is made. */
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
        core.file_close(handle);
    else
        core.ctx_destroy(handle);
    return NULL;
}

/* ctx_open(cfg_addr, dp_addr, what) -> Gate (value: the phx_ctx address), or -errno */
static PyObject *calls_ctx_open(PyObject *mod, PyObject *args)
{
    if (need_bound() < 0)
        return NULL;
    unsigned long long cfg, dp;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "KKU", &cfg, &dp, &what))
        return NULL;
    phx_ctx *ctx = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = core.ctx_create((const struct phx_io_config *)(uintptr_t)cfg, (const struct phx_dp_table *)(uintptr_t)dp,
                        &ctx);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !ctx)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_CTX, ctx, what);
}

/* file_open(path, flags, perm, direct, what) -> Gate (value: the phx_file address), or -errno */
static PyObject *calls_file_open(PyObject *mod, PyObject *args)
{
    if (need_bound() < 0)
        return NULL;
    const char *path;
    int flags, perm, direct;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "yiiiU", &path, &flags, &perm, &direct, &what))
        return NULL;
    phx_file *f = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = core.file_open(path, flags, perm, direct, &f);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !f)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_FILE, f, what);
}

/* file_from_fd(fd, direct, what) -> Gate, or -errno */
static PyObject *calls_file_from_fd(PyObject *mod, PyObject *args)
{
    if (need_bound() < 0)
        return NULL;
    int fd, direct;
    PyObject *what;
    if (!PyArg_ParseTuple(args, "iiU", &fd, &direct, &what))
        return NULL;
    phx_file *f = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = core.file_from_fd(fd, direct, &f);
    Py_END_ALLOW_THREADS
    if (rc < 0 || !f)
        return PyLong_FromLong(rc < 0 ? rc : -ENOMEM);
    return gate_owning(GATE_FILE, f, what);
}

PyMethodDef gate_functions[] = {
    {"ctx_open", (PyCFunction)calls_ctx_open, METH_VARARGS, "ctx_open(cfg_addr, dp_addr, what) -> Gate or -errno"},
    {"file_open", (PyCFunction)calls_file_open, METH_VARARGS,
     "file_open(path, flags, perm, direct, what) -> Gate or -errno"},
    {"file_from_fd", (PyCFunction)calls_file_from_fd, METH_VARARGS, "file_from_fd(fd, direct, what) -> Gate or -errno"},
    {NULL},
};

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

PyTypeObject HoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.Hold",
    .tp_basicsize = sizeof(Hold),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hold(pick, arg): `with` enters the Gate of (gate, value) = pick(arg) and gives value (picks again while it is closing).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hold_init,
    .tp_dealloc = (destructor)hold_dealloc,
    .tp_methods = hold_methods,
};

