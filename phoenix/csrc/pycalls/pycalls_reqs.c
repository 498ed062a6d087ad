/* Requests and guarded(): a call's requests, fences and buffers; Export: a buffer export released in C.
 *
 * Core side, control plane (phoenix._phxcalls; pycalls.c says what the module is for). */
#include "pycalls.h"

#include <errno.h>

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

PyTypeObject ExportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.Export",
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
void drop_kept(PyObject *obj)
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
    core.req_wait_all(g->h, (uint32_t)g->n, NULL, -1);
    Py_END_ALLOW_THREADS
}

static void reqs_release_fences(Requests *g)
{
    for (Py_ssize_t i = 0; i < g->nf; i++)
        if (g->fences[i] && reqs_live(g))
            core.fence_release(g->fences[i]);
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
        core.req_release_all(g->h, (uint32_t)g->n);
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
    rc = core.submit((phx_ctx *)(uintptr_t)ctx, (const struct phx_io_desc *)(uintptr_t)descs, (uint32_t)count, out);
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
    return PyBool_FromLong(!g->h[i] || !reqs_live(g) || core.req_done(g->h[i]));
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
        rc = core.req_wait(r, ns);
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
    if (!reqs_live(g) && !core.req_done(r))
        return PyLong_FromLong(-ECHILD);
    return PyLong_FromLongLong(core.req_result(r));
}

/* error_extent(i) -> (offset, length) of the failed chunk, or None */
static PyObject *reqs_error_extent(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    int64_t off = 0;
    uint64_t len = 0;
    if (!g->h[i] || core.req_error_extent(g->h[i], &off, &len) < 0)
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
            res[i] = !r ? -ENOMEM : core.req_done(r) ? core.req_result(r) : -ECHILD;
        }
        return PyLong_FromLong(0);
    }
    Py_BEGIN_ALLOW_THREADS
    core.req_wait_all(g->h + start, (uint32_t)count, res, -1);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(0);
}

/* collect(i): request i is done: let its buffer go (no-op while it runs) */
static PyObject *reqs_collect(Requests *g, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if ((i == -1 && PyErr_Occurred()) || reqs_index(g, i) < 0)
        return NULL;
    if (g->h[i] && reqs_live(g) && !core.req_done(g->h[i]))
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
    rc = core.fence_record((phx_ctx *)(uintptr_t)ctx, device, (void *)(uintptr_t)stream, &out);
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

PyTypeObject RequestsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phoenix._phxcalls.Requests",
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
    if (need_bound() < 0)
        return NULL;
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

PyMethodDef reqs_functions[] = {
    {"guarded", (PyCFunction)(void (*)(void))calls_guarded, METH_VARARGS | METH_KEYWORDS,
     "guarded(fn, *args, **kw): fn(requests, *args, **kw); on an exception every request of the group "
     "is waited for and its buffers released before it propagates."},
    {NULL},
};
