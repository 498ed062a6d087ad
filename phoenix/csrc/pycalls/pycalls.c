/* The Python objects that own a call's C resources: a call that returns or raises owns nothing.
 *
 * Core side, control plane: an extension module of its own (phoenix._phxcalls, CPython C
 * API) beside the C core, which stays plain C used through ctypes and by programs without
 * Python; it calls the core through a table bound at import (bind(), phoenix/_core.py).
 *
 * Python runs signal handlers, and so raises KeyboardInterrupt or a handler's exception,
 * between any two bytecodes of the main thread: inside a `finally`, between a submission
 * and the wait that should follow it. Code written in Python cannot promise
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
 *
 * Files: pycalls.c (this: the module, the core's table, the fork generation, registrations),
 * pycalls_gate.c (Gate, Hold, ctx_open / file_open), pycalls_reqs.c (Export, Requests,
 * guarded), pycalls_stream.c (StreamOp, StreamMethod), pycalls.h (what they share).
 */
#include "pycalls.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>

/* ---- the core's entry points (bound by bind(): the core is loaded with ctypes) ---------- */

/* The C core (phoenix._phxcore) is a plain C library, used by programs without Python too:
 * this module is apart from it and calls it through this table, filled with dlsym from the
 * core already loaded in the process (bind(path), phoenix/_core.py). */
struct pycalls_core core;
int bound;

#define X(name) {#name, (void **)&core.name}
static const struct {
    const char *name;
    void **slot;
} core_symbols[] = {
    X(ctx_create),
    X(ctx_destroy),
    X(fence_record),
    X(fence_release),
    X(file_close),
    X(file_from_fd),
    X(file_open),
    X(reg_add),
    X(reg_remove),
    X(req_done),
    X(req_error_extent),
    X(req_release_all),
    X(req_result),
    X(req_wait),
    X(req_wait_all),
    X(sop_done),
    X(sop_release),
    X(sop_result),
    X(sop_wait),
    X(stream_io),
    X(submit),
};
#undef X

int need_bound(void)
{
    if (bound)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "phoenix._phxcalls: not bound to the C core (phoenix._core.calls())");
    return -1;
}

/* bind(path): the core's entry points, from the library at path (loaded already: ctypes) */
static PyObject *calls_bind(PyObject *mod, PyObject *arg)
{
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h)
        return PyErr_Format(PyExc_ImportError, "phoenix._phxcalls: cannot load the C core %s: %s", path, dlerror());
    for (size_t i = 0; i < sizeof(core_symbols) / sizeof(core_symbols[0]); i++) {
        char sym[64];
        snprintf(sym, sizeof(sym), "phx_%s", core_symbols[i].name);
        void *fn = dlsym(h, sym);
        if (!fn)
            return PyErr_Format(PyExc_ImportError, "phoenix._phxcalls: the C core %s lacks phx_%s", path,
                                core_symbols[i].name);
        *core_symbols[i].slot = fn;
    }
    bound = 1; /* (the handle stays open: the core is never unloaded) */
    Py_RETURN_NONE;
}

/* ---- fork generation ------------------------------------------------------------------ */

static _Atomic unsigned long fork_gen;

void calls_after_fork_child(void)
{
    atomic_fetch_add(&fork_gen, 1);
    pthread_mutex_init(&gate_fresh_mu, NULL);
}

unsigned long gen_now(void) { return atomic_load_explicit(&fork_gen, memory_order_acquire); }

/* ---- registrations: the core's entry and what keeps its memory alive, in one step ------ */

/* reg_keep(kept, buf, addr, nbytes, mem, device) -> phx_reg_add's rc; on success buf is
 * appended to the list kept (phoenix.register's: one per reference) */
static PyObject *calls_reg_keep(PyObject *mod, PyObject *args)
{
    if (need_bound() < 0)
        return NULL;
    PyObject *kept, *buf;
    unsigned long long addr, nbytes;
    int mem, device;
    if (!PyArg_ParseTuple(args, "O!OKKii", &PyList_Type, &kept, &buf, &addr, &nbytes, &mem, &device))
        return NULL;
    int rc = core.reg_add(addr, nbytes, mem, device);
    if (rc >= 0 && PyList_Append(kept, buf) < 0) {
        core.reg_remove(addr);
        return NULL;
    }
    return PyLong_FromLong(rc);
}

/* reg_unkeep(kept, addr) -> phx_reg_remove's rc; one kept buffer let go (also when the core
 * had no entry: nothing is kept pinned for it) */
static PyObject *calls_reg_unkeep(PyObject *mod, PyObject *args)
{
    if (need_bound() < 0)
        return NULL;
    PyObject *kept;
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "O!K", &PyList_Type, &kept, &addr))
        return NULL;
    int rc = core.reg_remove(addr);
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

PyMethodDef regs_functions[] = {
    {"reg_keep", (PyCFunction)calls_reg_keep, METH_VARARGS,
     "reg_keep(kept, buf, addr, nbytes, mem, device) -> rc: register and keep buf, in one step"},
    {"reg_unkeep", (PyCFunction)calls_reg_unkeep, METH_VARARGS,
     "reg_unkeep(kept, addr) -> rc: drop one reference and let one kept buffer go, in one step"},
    {NULL},
};

/* ---- module ----------------------------------------------------------------------------- */

static PyMethodDef calls_functions[] = {
    {"bind", (PyCFunction)calls_bind, METH_O, "bind(path): the C core's entry points, from the library at path"},
    {NULL},
};

static struct PyModuleDef calls_module = {
    PyModuleDef_HEAD_INIT, "_phxcalls",
    "The Python objects that own a call's C resources (phoenix/csrc/pycalls/); bound to the C core "
    "by phoenix._core.calls().",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__phxcalls(void)
{
    PyObject *m = PyModule_Create(&calls_module);
    if (!m)
        return NULL;
    if (pthread_atfork(NULL, NULL, calls_after_fork_child) != 0)
        goto fail;
    PyTypeObject *types[] = {&GateType, &HoldType, &ExportType, &RequestsType, &StreamOpType, &StreamMethodType};
    const char *names[] = {"Gate", "Hold", "Export", "Requests", "StreamOp", "StreamMethod"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0)
            goto fail;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            goto fail;
        }
    }
    PyMethodDef *functions[] = {calls_functions, gate_functions, reqs_functions, regs_functions};
    for (size_t i = 0; i < sizeof(functions) / sizeof(functions[0]); i++)
        if (PyModule_AddFunctions(m, functions[i]) < 0)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
