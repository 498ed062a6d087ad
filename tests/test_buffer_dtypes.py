"""Buffers whose items are not plain bytes are refused (host vendor).

An object array holds PyObject pointers: a read writes file bytes over them (the process
crashes once they are used or freed) and a write puts addresses in the file. Every way
into :func:`phoenix.buffers.adapt` refuses such a buffer with a TypeError naming its
dtype or format before any byte moves: NumPy object arrays and dtypes with object fields
(``hasobject``: structured, nested, subarrays, StringDType), ``__array_interface__`` and
``__cuda_array_interface__`` objects whose type string or descr says objects, buffer
protocol objects of format 'O' (a memoryview of an object array, ctypes py_object
arrays), for read, write, read_many, batch, read_async and register. Plain dtypes
(structured ones included) still move every byte. Run in a subprocess: before the fix a
read crashed the process, which must fail this test rather than end the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import ctypes, sys
import numpy as np
import phoenix.io as pio
from phoenix.registry import get_runtime

path = sys.argv[1]
rt = get_runtime("host")
pio.use_runtime(rt)
data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
data.tofile(path)


class AI:
    def __init__(self, base, typestr, n, descr=None):
        self._base = base  # keeps the memory alive
        self.__array_interface__ = {"data": (base.ctypes.data, False), "shape": (n,), "typestr": typestr, "version": 3}
        if descr is not None:
            self.__array_interface__["descr"] = descr


class CAI:
    def __init__(self, ptr, typestr, n):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": typestr, "version": 3}


objs = np.array([object(), "x", 3, None], dtype=object)
rec = np.zeros(4, [("a", "<i8"), ("b", "O")])
rec["b"] = [object(), "y", 4, None]
cases = [  # (name, object, what the message must name)
    ("object array", objs, "object"),
    ("object slice", objs[1:3], "object"),
    ("0-d object array", np.array("z", dtype=object), "object"),
    ("structured with an object field", rec, "('b', 'O')"),
    ("nested object field", np.zeros(2, [("a", "<i8"), ("b", [("c", "O")])]), "('c', 'O')"),
    ("object subarray", np.zeros(2, [("a", "<i4"), ("b", "O", (2,))]), "'O'"),
    ("memoryview of an object array", memoryview(objs), "'O'"),
    ("memoryview of a structured object array", memoryview(rec), "O:b:"),
    ("ctypes py_object array", (ctypes.py_object * 4)(*[object()] * 4), "O"),
    ("__array_interface__ of objects", AI(objs, "|O8", 4), "|O8"),
    ("__array_interface__ with an object field", AI(rec, "|V16", 4, [("a", "<i8"), ("b", "|O")]), "|O"),
    ("__array_interface__ of an unknown type", AI(objs, "StringDType()", 4), "StringDType()"),
]
try:
    from numpy.dtypes import StringDType

    cases.append(("StringDType array", np.array(["abc", "de" * 20], dtype=StringDType()), "StringDType"))
except ImportError:
    pass
dev = rt.device_alloc(1 << 16)
cases.append(("__cuda_array_interface__ of objects", CAI(dev, "|O8", 64), "|O8"))
stream = rt.stream_create(0)



def batch_one(f, o):
    (r,) = pio.batch([(f, o, 8, 0, 0, "read")])
    if isinstance(r, BaseException):  # (a batch hands each request's error back)
        raise r
    return r


with pio.open(path, "r+") as f:
    ops = {
        "read": lambda o: f.read(o),
        "write": lambda o: f.write(o),
        "read_many": lambda o: f.read_many(o, [0], [8]),
        "write_many": lambda o: f.write_many(o, [0], [8]),
        "batch": lambda o: batch_one(f, o),
        "read_async": lambda o: f.read_async(o, 8, 0, 0, stream).result(),
        "register": lambda o: pio.register(o),
    }
    for name, obj, named in cases:
        for op, fn in ops.items():
            print(f"{name} / {op}: ", end="", flush=True)
            try:
                got = fn(obj)
            except TypeError as exc:
                ok = named in str(exc) and "\n" not in str(exc)
                print(("REFUSED " if ok else "BADMSG ") + str(exc), flush=True)
            except Exception as exc:
                print(f"OTHER {type(exc).__name__}: {exc}", flush=True)
            else:
                print(f"ACCEPTED {got!r}", flush=True)
    # what was refused is intact (the crash comes when these objects are used or freed)
    assert objs[1] == "x" and objs[2] == 3 and objs[3] is None, objs
    assert list(rec["b"][1:]) == ["y", 4, None], rec
    # plain dtypes, structured ones included, still move every byte
    for dt in ("<f8", [("a", "<i8"), ("b", "<f4"), ("c", "S3")], "<U3", "<M8[ns]", "V7", [("O", "<u2")]):
        a = np.zeros(64, dt)
        n = a.nbytes
        assert f.read(a) == n, dt
        assert bytes(a.view(np.uint8)) == data[:n].tobytes(), dt
        m = memoryview(bytearray(n))
        assert f.read(m) == n and bytes(m) == data[:n].tobytes(), dt
    print("PLAIN OK", flush=True)
del objs, rec, cases
import gc

gc.collect()
rt.stream_synchronize(stream)
rt.stream_destroy(stream)
rt.device_free(dev)
pio.shutdown()
print("DONE", flush=True)
"""


def test_buffers_of_objects_are_refused_with_a_type_error(tmp_path):
    env = dict(os.environ, PHX_VENDOR="host")
    p = subprocess.run(
        [sys.executable, "-P", "-c", SCRIPT, str(tmp_path / "dtypes.bin")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"the process ended with {p.returncode} (a negative number: killed by that signal)\n{out}"
    lines = [line for line in p.stdout.splitlines() if " / " in line]
    bad = [line for line in lines if ": REFUSED " not in line]
    assert not bad, "not refused with a TypeError naming the dtype:\n" + "\n".join(bad)
    assert len(lines) >= 13 * 7, out
    assert "PLAIN OK" in p.stdout and "DONE" in p.stdout, out
