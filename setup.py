"""Build of the C core (``phoenix._phxcore``) and the package map.

The C core (I/O engines) is plain C11 + pthreads + Linux UAPI headers (io_uring
through raw system calls), so ``pip install .`` needs only gcc and the Python headers.
The library is loaded with ctypes; its tiny module init exists only so that the
package build compiles it and the import system finds it. Test doubles are not in it:
the host reference runtime is its own library (below).

``vendors/`` and ``templates/`` sit at the top of the repository and are mapped into
the package as ``phoenix.vendors`` and ``phoenix.templates``; every vendor directory
is found by listing, so adding a vendor edits nothing here.
"""

import glob
import os
import re

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# libphxfile.so (phoenix/csrc/phxfile/): the frozen phxFile* C ABI that LMCache loads with
# ctypes. A plain shared library, not an extension module: built as one more Extension
# whose file name is exactly phoenix/lib/libphxfile.so (no ABI tag), with a soname and a
# version script that exports the ten phxFile* symbols and nothing else.
PHXFILE = "phoenix.lib.libphxfile"
# libphxbench.so (phoenix/bench/bench_raw.c): the raw O_DIRECT and naive-staging references of
# `phx bench`, a plain shared library of the bench subpackage (loaded with ctypes by
# phoenix/bench/raw.py), so that the core carries no benchmark symbol. Exact name, no PyInit_.
PHXBENCH = "phoenix.bench.libphxbench"
# libphxhostrt.so (phoenix/_testing/hostrt/): the host reference runtime, a TEST DOUBLE
# that vendors/host/runtime.py finds by path and binds like any vendor runtime; built
# beside its sources the same way, so the C core holds no phxh* symbol. The emulator
# builds the same hostrt*.c with other prefixes from the shipped sources.
HOSTRT = "phoenix._testing.hostrt.libphxhostrt"
PLAIN_LIBRARIES = {PHXFILE, PHXBENCH, HOSTRT}  # exact file names lib<name>.so, no ABI tag, no PyInit_


class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        parts = fullname.split(".")
        for lib in PLAIN_LIBRARIES:  # asked with the full name and with the last part
            if parts[-1] == lib.rsplit(".", 1)[-1]:
                return os.path.join(*parts[:-1], parts[-1] + ".so")
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self):  # editable / in-place: phoenix/lib may not exist yet
        self.mkpath(os.path.join(HERE, "phoenix", "lib"))
        super().copy_extensions_to_source()

    def get_export_symbols(self, ext):
        if ext.name in PLAIN_LIBRARIES:
            return []  # no PyInit_: a version script or static helpers say what is exported
        return super().get_export_symbols(ext)


HERE = os.path.dirname(os.path.abspath(__file__))


def _local_headers(sources, include_dirs):
    """Every header the sources include with quotes, followed through headers: the ``depends``
    of an extension, so that a change to any of them rebuilds it (build_ext compares times)."""
    found, todo = set(), [os.path.join(HERE, s) for s in sources]
    while todo:
        path = todo.pop()
        with open(path, encoding="utf-8") as f:
            names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.MULTILINE)
        for name in names:
            for base in [os.path.dirname(path)] + [os.path.join(HERE, d) for d in include_dirs]:
                header = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(header):
                    if header not in found:
                        found.add(header)
                        todo.append(header)
                    break
            else:
                raise FileNotFoundError(f'{path}: #include "{name}" is in none of {include_dirs}')
    return sorted(os.path.relpath(h, HERE) for h in found)


def _extension(name, sources, include_dirs, depends=(), **kwargs):
    return Extension(
        name,
        sources=sources,
        include_dirs=include_dirs,
        depends=_local_headers(sources, include_dirs) + list(depends),
        **kwargs,
    )


def _subdirs(top):
    root = os.path.join(HERE, top)
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith((".", "_")))


packages = find_packages(include=["phoenix", "phoenix.*"])
packages += ["phoenix.vendors"] + [f"phoenix.vendors.{d}" for d in _subdirs("vendors")]
packages += ["phoenix.templates"] + [f"phoenix.templates.{d}" for d in _subdirs("templates")]
package_dir = {"phoenix": "phoenix", "phoenix.vendors": "vendors", "phoenix.templates": "templates"}

setup(
    packages=packages,
    py_modules=["_phx_entry"],  # the console scripts' entry: checks the `phoenix` name clash before importing it
    package_dir=package_dir,
    package_data={
        "phoenix": [
            "py.typed",
            "csrc/*.h",
            "csrc/*.c",
            "csrc/phxfile/*.c",
            "csrc/phxfile/*.h",
            "csrc/phxfile/*.map",
            "csrc/pycalls/*.c",
            "csrc/pycalls/*.h",
        ],
        "phoenix.bench": ["*.c"],
        "phoenix._testing": ["hostrt/*.c", "hostrt/*.h"],  # the emulator builds from these when installed
        "phoenix.vendors": ["*.md"],
        **{f"phoenix.vendors.{d}": ["*.c", "*.h", "*.md", "Kbuild", "Makefile"] for d in _subdirs("vendors")},
        "phoenix.templates": ["*.j2", "*.md"],
        **{f"phoenix.templates.{d}": ["*", "*.j2"] for d in _subdirs("templates")},
    },
    ext_modules=[
        _extension(
            "phoenix._phxcore",
            sources=sorted(glob.glob("phoenix/csrc/*.c")),
            include_dirs=["phoenix/csrc"],
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
        ),
        _extension(
            # the objects that own a call's C resources across asynchronous exceptions (CPython C
            # API): a module apart from the core, which stays plain C (programs without Python
            # load it too); it calls the core through a table bound at import (phoenix/_core.py)
            "phoenix._phxcalls",
            sources=sorted(glob.glob("phoenix/csrc/pycalls/*.c")),
            include_dirs=["phoenix/csrc"],
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread", "-ldl"],
        ),
        _extension(
            PHXBENCH,
            sources=["phoenix/bench/bench_raw.c"],
            include_dirs=["phoenix/csrc"],  # phx_vendor.h: the data-path table the naive loop copies through
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread", "-Wl,-soname,libphxbench.so"],
        ),
        _extension(
            PHXFILE,
            sources=["phoenix/csrc/phxfile/phxfile.c"],
            include_dirs=["phoenix/csrc"],
            depends=["phoenix/csrc/phxfile/phxfile.map"],  # the version script: a change relinks
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-pthread",
                "-fvisibility=hidden",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
            ],
            extra_link_args=[
                "-pthread",
                "-ldl",
                "-Wl,-soname,libphxfile.so",
                "-Wl,--version-script=" + os.path.join(HERE, "phoenix", "csrc", "phxfile", "phxfile.map"),
            ],
        ),
        _extension(
            HOSTRT,
            # hostrt*.c (the runtime, in pieces: hostrt.c says which) and phx_testing.c (test hooks)
            sources=sorted(glob.glob("phoenix/_testing/hostrt/*.c")),
            include_dirs=["phoenix/_testing/hostrt"],
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread", "-Wl,-soname,libphxhostrt.so"],
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
