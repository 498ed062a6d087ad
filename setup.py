"""Build of the C core (``phoenix._phxcore``) and the package map.

The C core (I/O engines, host reference runtime) is plain C11 + pthreads + Linux
UAPI headers (io_uring through raw system calls), so ``pip install .`` needs only
gcc and the Python headers. The library is loaded with ctypes; its tiny module init
exists only so that the package build compiles it and the import system finds it.

``vendors/`` and ``templates/`` sit at the top of the repository and are mapped into
the package as ``phoenix.vendors`` and ``phoenix.templates``; every vendor directory
is found by listing, so adding a vendor edits nothing here.
"""

import glob
import os

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _subdirs(top):
    root = os.path.join(HERE, top)
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith((".", "_")))


packages = find_packages(include=["phoenix", "phoenix.*"])
packages += ["phoenix.vendors"] + [f"phoenix.vendors.{d}" for d in _subdirs("vendors")]
packages += ["phoenix.templates"] + [f"phoenix.templates.{d}" for d in _subdirs("templates")]
package_dir = {"phoenix": "phoenix", "phoenix.vendors": "vendors", "phoenix.templates": "templates"}

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "phoenix": ["csrc/*.h", "csrc/*.c"],
        "phoenix.vendors": ["*.md"],
        **{f"phoenix.vendors.{d}": ["*.c", "*.h", "*.md", "Kbuild", "Makefile"] for d in _subdirs("vendors")},
        "phoenix.templates": ["*.j2", "*.md"],
        **{f"phoenix.templates.{d}": ["*", "*.j2"] for d in _subdirs("templates")},
    },
    ext_modules=[
        Extension(
            "phoenix._phxcore",
            sources=sorted(glob.glob("phoenix/csrc/*.c")),
            include_dirs=["phoenix/csrc"],
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
        )
    ],
)
