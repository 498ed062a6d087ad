/* Module init: the C core is a plain shared library loaded with ctypes (phoenix/_core.py);
 * being an extension module lets the package build compile it and Python's import system
 * find it, installed or editable. The module itself carries the few objects that must own
 * C resources across asynchronous exceptions (py_calls.c). */
#include "py_calls.h"

static struct PyModuleDef phxcore_module = {
    PyModuleDef_HEAD_INIT, "_phxcore",
    "Phoenix C core (loaded through ctypes; see phoenix/_core.py), and the objects that own a call's C "
    "resources (py_calls.c).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__phxcore(void)
{
    PyObject *m = PyModule_Create(&phxcore_module);
    if (m && py_calls_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
