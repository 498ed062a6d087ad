/* Module init only: the C core is a plain shared library loaded with ctypes
 * (phoenix/_core.py). Being an extension module lets the package build compile
 * it and lets Python's import system find it, installed or editable. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef phxcore_module = {
    PyModuleDef_HEAD_INIT, "_phxcore",
    "Phoenix C core (loaded through ctypes; see phoenix/_core.py).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__phxcore(void) { return PyModule_Create(&phxcore_module); }
