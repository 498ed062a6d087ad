/* The Python objects that own a call's C resources (py_calls.c), added to the module.
 *
 * Core side, control plane (CPython C API). */
#ifndef PHX_PY_CALLS_H
#define PHX_PY_CALLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#pragma GCC visibility push(hidden)
/* Add Gate, Hold, Export, Requests, StreamOp, StreamMethod and guarded() to the module. */
int py_calls_init(PyObject *module);
#pragma GCC visibility pop

#endif
