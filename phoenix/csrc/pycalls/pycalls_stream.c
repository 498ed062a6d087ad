/* StreamOp and StreamMethod: read_async / write_async planned in Python, queued in C.
 *
 * Core side, control plane (phoenix._phxcalls; pycalls.c says what the module is for). */
#include "pycalls.h"

#include <errno.h>

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


static void sop_collect(StreamOp *s)
{
    if (s->done)
        return;
    s->value = s->gen == gen_now() ? core.sop_result(s->sop) : -ECHILD;
    s->done = 1;
    PyObject *b = s->buf;
    s->buf = NULL;
    drop_kept(b);
    Py_CLEAR(s->engine);
}

static int sop_is_done(StreamOp *s) { return s->done || !s->sop || s->gen != gen_now() || core.sop_done(s->sop); }

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
        rc = core.sop_wait(s->sop, ns);
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
            core.sop_wait(s->sop, -1);
            Py_END_ALLOW_THREADS
        }
        sop_collect(s);
        if (s->gen == gen_now())
            core.sop_release(s->sop);
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

PyTypeObject StreamOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.StreamOp",
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
    if (need_bound() < 0)
        return NULL;
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
        rc = core.stream_io((phx_ctx *)(uintptr_t)ctx, (const struct phx_io_desc *)(uintptr_t)desc,
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

PyTypeObject StreamMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.StreamMethod",
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
