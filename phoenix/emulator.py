"""Emulated CUDA-shaped runtimes for CI: the host runtime's C source built as another vendor's library.

Test side, control plane. Every library built here is a TEST DOUBLE, and says so:
its devices are named "Phoenix emulated <prefix> device (test double)", it exports
``<prefix>PhoenixTestDouble()`` (a symbol no real runtime has, so a port can tell),
its directory holds ``EMULATED-RUNTIME.txt``, and ``phx-port test --emulated`` marks
the report "emulated runtime (test double)".

There is one emulator source: ``phoenix/_testing/hostrt/hostrt*.c`` (``hostrt.c`` and
its pieces, :func:`source_files`), the strict host
runtime the host vendor binds as ``libphxhostrt.so`` (device memory that faults when
freed, streams as ordered worker threads, CUDA's error numbers, strict copy kinds).
Built with another symbol prefix and library name (``mc`` as ``libmcruntime.so``,
``cuda`` as a ``libcudart.so`` stand-in, ``hip``, any other), it lets a port's shim run
the conformance suite before hardware exists. The source ships in the package, so this works from an installed wheel.

How a vendor is pointed at an emulator: through the facts and hooks its Runtime class
declares (:class:`phoenix.vendor.VendorRuntime` documents each): ``prefix`` and
``library_names`` (the first is the emulator's file name), ``emulated_driver_prefix``
(``"cu"`` also builds a driver API: ``cuInit``, ``cuPointerGetAttribute``, ...), and
``emulated_env(emulator)``, the environment that points the port at it (by default
``PHX_<NAME>_LIBRARY``; MetaX: ``MACA_PATH``; ``None`` unsets a variable).

By hand::

    python -m phoenix.emulator --prefix mc --library libmcruntime.so   # prints the library's path
    python -m phoenix.emulator --vendor metax                          # the same, plus the environment

Built libraries are cached under ``$PHX_EMULATOR_CACHE`` (default
``~/.cache/phoenix/emulators``), one directory per source and options, so a second
build is free. Needs a C compiler (``$CC``, gcc, cc or clang).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from .errors import PhxError
from .vendor import EMULATED_LABEL as LABEL  # what every emulator is called, everywhere it shows

#: pointer-attribute layouts the emulator can be built with (hostrt.h PHXRT_POINTER_ATTRIBUTES)
POINTER_LAYOUTS = {"type": 0, "memoryType": 1, "both": 2}
MARKER_FILE = "EMULATED-RUNTIME.txt"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: `$` would let a trailing newline through
_LIBNAME = re.compile(r"lib[A-Za-z0-9_.+-]+\.so(\.[0-9.]+)?")


class EmulatorError(PhxError):
    """An emulator cannot be built (no compiler, a compile error) or a vendor cannot be emulated."""


@dataclass(frozen=True)
class Emulator:
    """A built emulator: ``root/lib/<library_name>``, a test double of a CUDA-shaped runtime."""

    prefix: str
    library_name: str
    root: str  #: the emulated installation's top (``lib/`` below it), usable as e.g. MACA_PATH
    library: str  #: absolute path of the built library
    source: str  #: the C source it was built from
    pointer_layout: str
    driver_prefix: str | None
    label: str = LABEL

    def describe(self) -> dict:
        return asdict(self)


def source_path() -> str:
    """The emulator's main C source: the host runtime shipped in the package (``phoenix/_testing/hostrt/hostrt.c``)."""
    # a path, not an import: importing phoenix._testing would load its test hooks
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_testing", "hostrt", "hostrt.c")


def source_files() -> list[str]:
    """Every C source an emulator is built from: ``hostrt.c`` and its pieces (``hostrt_*.c``).

    Not ``phx_testing.c``: those are test hooks of ``libphxhostrt.so`` only.
    """
    return sorted(glob.glob(os.path.join(os.path.dirname(source_path()), "hostrt*.c")))


def _hashed_files() -> list[str]:
    """What a build depends on: the sources and the headers beside them (``hostrt*.h``)."""
    return source_files() + sorted(glob.glob(os.path.join(os.path.dirname(source_path()), "hostrt*.h")))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def cache_dir() -> str:
    """Where built emulators live (``$PHX_EMULATOR_CACHE``, else the user's cache, else /tmp)."""
    explicit = os.environ.get("PHX_EMULATOR_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "phoenix", "emulators")
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"phoenix-emulators-{os.getuid()}")


def build(
    prefix: str,
    library_name: str,
    *,
    pointer_layout: str = "type",
    driver_prefix: str | None = None,
    version: int | None = None,
    cache: str | None = None,
    cc: str | None = None,
) -> Emulator:
    """Build (or reuse) the emulator with symbol ``prefix`` as ``library_name``; return it.

    ``pointer_layout`` picks the pointer-attribute struct (``type``: CUDA >= 11;
    ``memoryType``: the same place under its older name; ``both``: CUDA 10's
    deprecated ``memoryType`` followed by ``type``). ``driver_prefix`` (``cu``) adds
    the driver calls a port may use. Raises :class:`EmulatorError` with the compiler's
    output when the build fails.
    """
    if not _IDENT.fullmatch(prefix or ""):
        raise EmulatorError(f"emulator prefix {prefix!r} is not a C identifier")
    if not _LIBNAME.fullmatch(library_name or ""):
        raise EmulatorError(f"emulator library name {library_name!r} is not of the form lib<name>.so[.N]")
    if pointer_layout not in POINTER_LAYOUTS:
        raise EmulatorError(f"pointer layout {pointer_layout!r}: choose one of {', '.join(POINTER_LAYOUTS)}")
    if driver_prefix is not None and not _IDENT.fullmatch(driver_prefix):
        raise EmulatorError(f"driver prefix {driver_prefix!r} is not a C identifier")
    cc = cc or compiler()
    if not cc:
        raise EmulatorError("no C compiler to build the emulated runtime: install gcc, or set CC")
    src = source_path()
    if not os.path.exists(src):
        raise EmulatorError(f"the emulator's source {src} is missing from this installation")

    flags = [
        "-shared",
        "-fPIC",
        "-O2",
        "-std=gnu11",
        "-pthread",
        "-Wall",
        # calls inside the emulator bind to itself, never to a same-named real runtime
        # already loaded into the process with RTLD_GLOBAL (torch's libcudart, say)
        "-Wl,-Bsymbolic",
        "-DPHXRT_EMULATOR",
        f"-DPHXRT_PREFIX={prefix}",
        f"-DPHXRT_POINTER_ATTRIBUTES={POINTER_LAYOUTS[pointer_layout]}",
    ]
    if driver_prefix:
        flags.append(f"-DPHXRT_DRIVER_PREFIX={driver_prefix}")
    if version is not None:
        flags.append(f"-DPHXRT_VERSION={int(version)}")
    sources = source_files()
    digest = hashlib.sha256()
    for path in _hashed_files():  # a change to any piece or header is another build
        with open(path, "rb") as fh:
            digest.update(os.path.basename(path).encode() + b"\0" + fh.read())
    digest.update(json.dumps([cc, flags, library_name]).encode())
    root = os.path.join(cache or cache_dir(), f"{prefix}-{digest.hexdigest()[:16]}")
    libdir = os.path.join(root, "lib")
    library = os.path.join(libdir, library_name)
    emu = Emulator(prefix, library_name, root, library, src, pointer_layout, driver_prefix)
    if os.path.exists(library):
        return emu

    os.makedirs(libdir, exist_ok=True)
    # build beside the target and rename: concurrent builds of the same emulator are safe
    fd, tmp = tempfile.mkstemp(prefix=f".{library_name}.", suffix=".tmp", dir=libdir)
    os.close(fd)
    cmd = [cc, *flags, "-I", os.path.dirname(src), *sources, "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulatorError(
                f"building the {LABEL} {library_name} failed ({' '.join(cmd)}):\n"
                f"{(proc.stderr or proc.stdout).strip()[-3000:]}"
            )
        with open(os.path.join(root, MARKER_FILE), "w") as fh:
            fh.write(
                f"{LABEL}\n\nNot a vendor runtime. {library_name} here is phoenix's host runtime\n"
                f"({', '.join(os.path.basename(p) for p in sources)} in {os.path.dirname(src)})\n"
                f"built with symbol prefix {prefix!r}: device memory is host memory.\n\n"
                f"build: {' '.join(cmd[:-1])} {library}\n"
            )
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return emu


def emulator_info(library: ctypes.CDLL, prefix: str) -> str | None:
    """What a loaded runtime library says it is, if it is phoenix's test double; None for a real one.

    Ports call this on the library they loaded: an emulator exports
    ``<prefix>PhoenixTestDouble()``, no real runtime does. (Not named ``test_*``, so a
    test module may import it.)
    """
    fn = getattr(library, f"{prefix}PhoenixTestDouble", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    raw = fn()
    return raw.decode(errors="replace") if raw else LABEL


# -- vendors ------------------------------------------------------------------------


def vendor_spec(cls) -> dict:
    """What to build for a vendor's Runtime class: prefix, library name, driver prefix.

    Raises :class:`EmulatorError` saying why when the vendor cannot be emulated.
    """
    name = cls.name or cls.__name__
    if cls.is_test_double:
        raise EmulatorError(
            f"vendor {name!r} is itself a test double; --emulated emulates the runtime library of a real vendor's port"
        )
    prefix = cls.prefix
    names = list(cls.library_names)
    library = names[0] if names else None
    if not isinstance(prefix, str) or not prefix:
        raise EmulatorError(
            f"vendor {name!r} does not bind a CUDA-shaped runtime (its Runtime class has "
            "no symbol `prefix`), so there is no emulator for it"
        )
    if not library:
        raise EmulatorError(
            f"vendor {name!r} does not name its runtime library: set `library_names = "
            f'("lib....so",)` on its Runtime class'
        )
    return {"prefix": prefix, "library_name": os.path.basename(library), "driver_prefix": cls.emulated_driver_prefix}


def vendor_env(cls, emu: Emulator) -> dict[str, str | None]:
    """The environment that points a vendor at ``emu`` (``None``: unset that variable)."""
    return dict(cls.emulated_env(emu))


def for_vendor(cls, **options) -> tuple[Emulator, dict[str, str | None]]:
    """Build the emulator a vendor's Runtime class asks for; return it and the environment to use it."""
    spec = vendor_spec(cls)
    spec.update(options)
    emu = build(spec.pop("prefix"), spec.pop("library_name"), **spec)
    return emu, vendor_env(cls, emu)


def apply_env(env: dict, changes: dict[str, str | None]) -> dict:
    """``env`` with ``changes`` applied (``None`` removes a variable); returns ``env``."""
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m phoenix.emulator", description=f"Build a CUDA-shaped {LABEL} and print its path."
    )
    parser.add_argument("--vendor", help="build what this vendor's Runtime class asks for, and print its environment")
    parser.add_argument("--prefix", help="symbol prefix (mc, cuda, hip, ...)")
    parser.add_argument("--library", help="library file name (libmcruntime.so, libcudart.so, ...)")
    parser.add_argument("--driver-prefix", help="also export a driver API with this prefix (cu)")
    parser.add_argument("--pointer-layout", choices=list(POINTER_LAYOUTS), default=None)
    args = parser.parse_args(argv)
    options = {k: v for k, v in (("driver_prefix", args.driver_prefix), ("pointer_layout", args.pointer_layout)) if v}
    try:
        if args.vendor:
            from . import registry

            entry = registry.discover().get(args.vendor)
            cls = entry.load() if entry else None
            if cls is None:
                parser.error(f"no importable vendor {args.vendor!r}")
            emu, env = for_vendor(cls, **options)
            print(emu.library)
            for key, value in env.items():
                print(f"unset {key}" if value is None else f"export {key}={value}")
            return 0
        if not (args.prefix and args.library):
            parser.error("give --vendor, or --prefix and --library")
        print(build(args.prefix, args.library, **options).library)
        return 0
    except EmulatorError as exc:
        print(f"phoenix.emulator: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
