"""Drive LMCache's own ``phx`` GDS L1 backend against phoenix's libphxfile.so (issue #8, item 2).

What runs, and whose code it is:

* **LMCache's code, unchanged**: the installed ``lmcache`` 0.5.6 wheel's
  ``lmcache/v1/gpu_connector/_gds_backends.py`` (discovery by module name:
  ``available_backends()``, ``create_backend("phx")``, which also calls
  ``validate_environment()``) and ``gds_backends/{__init__,base,_driver,_file,phx}.py``
  (``Backend.open_slab``, ``register_stream``, ``register_buffer``, ``AsyncHandle.write_async
  / read_async``, ``deregister_*``, ``close``, ``close_driver``), plus ``lmcache/logging.py``.
  Their files are checked against the wheel's RECORD hashes and the result is printed.
* **How they are loaded** (``--load``): LMCache's package ``__init__`` chain
  (``lmcache.v1.gpu_connector.__init__`` -> config, gpu connectors, ``lmcache_native``: a
  compiled extension built against LMCache's own torch, and some twenty third-party
  packages) is not what the backend needs and cannot be installed on a machine without
  network. ``--load stub`` (what ``auto`` falls back to) registers three bare *parent package*
  modules, ``lmcache``, ``lmcache.v1`` and ``lmcache.v1.gpu_connector``, whose ``__path__`` is
  the installed wheel's directories and whose ``__init__.py`` is NOT executed; every module
  below them is imported from the wheel's own files by the normal import system.
  ``--load package`` imports ``lmcache.v1.gpu_connector.gds_backends.phx`` normally (all of
  LMCache's ``__init__`` files). ``--load auto`` (default) tries the normal import in a child
  process first and uses it if it works, else ``stub``; the JSON says which and why.
* **This script's code, mirroring LMCache's ``GDSContext``** (``gds_context.py``, which
  needs LMCache's memory management and device ops, so it is not imported): how a GPU
  buffer is registered (``register_stream`` of the current stream, then consecutive regions
  of at most ``_MAX_GDS_REGION`` = 16 MiB, each through the backend's ``register_buffer``),
  how a chunk transfer is split at region boundaries (``transfer_async`` /
  ``_resolve_buffer``: ``buf_base`` = region base, ``buf_offset`` = offset in the region),
  and that Submissions stay alive until the stream is synchronized. The region size and
  alignment are read from the wheel's ``gds_context.py`` (constants ``_MAX_GDS_REGION``,
  ``_GDS_ALIGNMENT``).

The library: LMCache's ``Backend.library()`` loads ``ctypes.util.find_library("phxfile")``
else ``libphxfile.so``; both resolve through the dynamic loader's path, which glibc reads at
process start. If phoenix's library directory (``phoenix.phxfile.library_dir()``) is not on
``LD_LIBRARY_PATH``, this script **re-executes itself once with it prepended** (and says so);
nothing is registered with ldconfig.

Sequence (``--device cuda``, the H200 run): open the slab ``<tmpdir>/lmcache_gds_slab.bin``
in ``--dir`` (O_DIRECT), a uint8 CUDA tensor of ``--size`` filled with random bytes on the
GPU, registered LMCache's way; written in ``--chunk`` chunks on a torch CUDA stream,
synchronized, every Submission's ``bytes_done`` checked; the page cache dropped
(posix_fadvise DONTNEED, and /proc/sys/vm/drop_caches as root); read back into a second
registered tensor poisoned with 0xA5, synchronized, compared on the GPU (``torch.equal``).
GB/s for each write and read repetition. Edge checks on a two-region buffer with an
unregistered guard after it: an extent crossing a region boundary, and one running past the
last registered region, are refused by LMCache's ``_check`` (negative errno -> RuntimeError)
for read and write, and no byte of the buffer, the guard or the slab changes; the same
extent split at the boundary works; deregistering an unknown base is tolerated;
deregister, close the slab, close twice, close the driver. Exit status 1 on any failure.

``--device host`` (CI-sized, no GPU): phoenix's host vendor, whose "device memory" is an
arena of HOST memory (a TEST DOUBLE, not an accelerator); LMCache's ``register_buffer``
wants a ``torch.Tensor`` with ``is_cuda``, so a duck-typed stand-in over arena memory is
passed; CPU torch makes ``validate_environment()`` refuse (no CUDA/ROCm build), which is
recorded and the backend class is then constructed directly.

    PYTHONPATH=/tmp/phx-site:/tmp/site python3 benchmarks/lmcache_phx.py --dir /root --size 4G \\
        --chunk 256M --reps 2 --json $OUT/lmcache-phx.json
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import ctypes.util
import errno
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types

REEXEC_FLAG = "PHX_LMCACHE_PHX_REEXEC"
POISON = 0xA5
LMCACHE_FILES = (  # the files of LMCache's that run here
    "lmcache/logging.py",
    "lmcache/v1/gpu_connector/_gds_backends.py",
    "lmcache/v1/gpu_connector/gds_backends/__init__.py",
    "lmcache/v1/gpu_connector/gds_backends/base.py",
    "lmcache/v1/gpu_connector/gds_backends/_driver.py",
    "lmcache/v1/gpu_connector/gds_backends/_file.py",
    "lmcache/v1/gpu_connector/gds_backends/phx.py",
)
STUB_PARENTS = ("lmcache", "lmcache.v1", "lmcache.v1.gpu_connector")


def log(msg: str) -> None:
    print(f"[lmcache-phx] {msg}", flush=True)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4G, 256M)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


# ---- the loader path -------------------------------------------------------------------------


def ensure_loader_path(args) -> dict:
    """Put phoenix's library directory on LD_LIBRARY_PATH, re-executing once if needed."""
    from phoenix import phxfile

    libdir = phxfile.library_dir()
    phxfile.library_path()  # FileNotFoundError with a hint if it was not built
    on_path = libdir in [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if not on_path:
        if os.environ.get(REEXEC_FLAG):
            raise SystemExit(f"LD_LIBRARY_PATH still lacks {libdir} after re-executing")
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env[REEXEC_FLAG] = libdir
        log(
            f"re-executing with LD_LIBRARY_PATH={libdir} prepended (the dynamic loader reads it at start; "
            "LMCache's find_library('phxfile') / CDLL('libphxfile.so') then resolve phoenix's library)"
        )
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    return {
        "library_path": phxfile.library_path(),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "reexecuted": bool(os.environ.get(REEXEC_FLAG)),
        "find_library_phxfile": ctypes.util.find_library("phxfile"),
        "found_by_loader": phxfile.found_by_loader(),
    }


# ---- loading LMCache's modules ---------------------------------------------------------------


def lmcache_root() -> str:
    """The directory holding the installed ``lmcache`` package, found without importing it."""
    spec = importlib.util.find_spec("lmcache")  # top level: does not execute lmcache/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lmcache is not installed (pip install --no-deps lmcache==0.5.6, or the wheel in .whl/)")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def record_check(root: str) -> dict:
    """Compare the LMCache files that run here with the wheel's RECORD (unchanged code)."""
    dist = [d for d in os.listdir(root) if d.startswith("lmcache-") and d.endswith(".dist-info")]
    out = {"dist_info": dist[0] if dist else None, "files": {}}
    record = {}
    if dist:
        with open(os.path.join(root, dist[0], "RECORD")) as f:
            for line in f:
                parts = line.rstrip("\n").rsplit(",", 2)
                if len(parts) == 3 and parts[1].startswith("sha256="):
                    record[parts[0]] = parts[1][len("sha256=") :]
    for rel in LMCACHE_FILES:
        path = os.path.join(root, rel)
        with open(path, "rb") as f:
            digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
        want = record.get(rel)
        out["files"][rel] = "matches RECORD" if want == digest else ("NOT IN RECORD" if want is None else "DIFFERS")
    out["all_match"] = all(v == "matches RECORD" for v in out["files"].values())
    return out


def install_stub_parents(root: str) -> None:
    """Bare parent packages over the wheel's directories; their __init__.py files are not run."""
    for name in STUB_PARENTS:
        if name in sys.modules:
            continue
        path = os.path.join(root, *name.split("."))
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [path]
        mod = importlib.util.module_from_spec(spec)
        mod.__path__ = [path]
        mod.__phx_stub__ = "parent package only: __init__.py not executed"
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)


def try_package_import(timeout: float) -> tuple[bool, str]:
    code = "import lmcache.v1.gpu_connector.gds_backends.phx, lmcache.v1.gpu_connector._gds_backends"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    if r.returncode == 0:
        return True, "ok"
    lines = [ln for ln in (r.stderr or "").strip().splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"exit status {r.returncode}"


def loaded_modules(root: str) -> dict:
    """Every lmcache module in this process: a stub parent, or the wheel file it was imported from."""
    loaded = {}
    for name in sorted(m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")):
        mod = sys.modules[name]
        loaded[name] = (
            "stub parent"
            if getattr(mod, "__phx_stub__", None)
            else os.path.relpath(getattr(mod, "__file__", "") or "?", root)
        )
    return loaded


def load_lmcache(args) -> tuple[types.ModuleType, dict]:
    root = lmcache_root()
    info: dict = {"root": root, "requested": args.load}
    method = args.load
    if method == "auto":
        ok, why = try_package_import(args.package_import_timeout)
        info["package_import"] = why
        log(
            f"normal import of lmcache.v1.gpu_connector.gds_backends.phx (all of LMCache's __init__ files): "
            f"{'works' if ok else 'fails: ' + why}"
        )
        method = "package" if ok else "stub"
    if method == "stub":
        install_stub_parents(root)
    discovery = importlib.import_module("lmcache.v1.gpu_connector._gds_backends")
    info["method"] = method
    info["how"] = (
        "normal import of the installed lmcache package (all of its __init__ files)"
        if method == "package"
        else "LMCache's own modules, unchanged, imported from the installed wheel under bare parent packages "
        f"{', '.join(STUB_PARENTS)} (their __init__.py not executed: they pull in LMCache's config, GPU "
        "connectors and compiled lmcache_native, none of which the phx backend uses)"
    )
    info["modules"] = loaded_modules(root)
    info["record"] = record_check(root)
    try:
        from importlib.metadata import version

        info["version"] = version("lmcache")
    except Exception as exc:  # noqa: BLE001
        info["version"] = f"? ({exc})"
    # GDSContext's constants, from its own source (not imported)
    consts = {"_MAX_GDS_REGION": 16 << 20, "_GDS_ALIGNMENT": 4096}
    src_path = os.path.join(root, "lmcache/v1/gpu_connector/gds_context.py")
    try:
        src = open(src_path).read()
        for k in consts:
            m = re.search(rf"^{k}\s*=\s*(.+)$", src, re.M)
            if m and re.fullmatch(r"[\d\s*+()<]+", m.group(1).strip()):
                consts[k] = int(eval(m.group(1), {"__builtins__": {}}))  # arithmetic of literals only
        info["gds_context_constants"] = dict(consts, source=os.path.relpath(src_path, root))
    except OSError:
        info["gds_context_constants"] = dict(consts, source="defaults (gds_context.py not found)")
    return discovery, info


# ---- devices: CUDA torch tensors, or the host vendor's arena (a test double) ----------------


class TorchCuda:
    name = "cuda"

    def __init__(self, index: int):
        import torch

        self.torch = torch
        if not torch.cuda.is_available():
            raise SystemExit("torch sees no CUDA device (use --device host for the host test double)")
        self.dev = torch.device("cuda", index)
        torch.cuda.set_device(self.dev)
        self.stream = torch.cuda.Stream(self.dev)
        self.gen = torch.Generator(device=self.dev)

    def describe(self) -> dict:
        t = self.torch
        p = t.cuda.get_device_properties(self.dev)
        return {
            "torch": t.__version__,
            "torch_cuda": t.version.cuda,
            "gpu": p.name,
            "gpu_mem_gib": round(p.total_memory / 2**30, 1),
        }

    def alloc(self, n: int):
        return self.torch.empty(n, dtype=self.torch.uint8, device=self.dev)

    def fill_random(self, t, seed: int) -> None:
        self.gen.manual_seed(seed)
        t.random_(0, 256, generator=self.gen)
        self.torch.cuda.synchronize(self.dev)

    def fill(self, t, value: int) -> None:
        t.fill_(value)
        self.torch.cuda.synchronize(self.dev)

    def slice(self, t, a: int, b: int):
        return t[a:b]

    def equal(self, a, b) -> tuple[bool, int, int]:
        if self.torch.equal(a, b):
            return True, 0, -1
        ne = a != b
        return False, int(ne.sum().item()), int(ne.to(self.torch.uint8).argmax().item())

    def all_value(self, t, value: int) -> bool:
        return bool((t == value).all().item())

    def raw_stream(self) -> int:
        return int(self.stream.cuda_stream)

    def stream_ctx(self):
        return self.torch.cuda.stream(self.stream)

    def sync(self) -> None:
        self.stream.synchronize()

    def free(self, t) -> None:
        del t


class ArenaTensor:
    """The few torch.Tensor members LMCache's phx backend reads (is_cuda, data_ptr, numel,
    element_size), over host-vendor "device memory": a TEST DOUBLE for CPU-only machines."""

    is_cuda = True

    def __init__(self, ptr: int, n: int):
        self.ptr, self.n = ptr, n

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1

    def view(self):
        import numpy as np

        return (
            np.ctypeslib.as_array((ctypes.c_uint8 * self.n).from_address(self.ptr)) if self.n else np.zeros(0, np.uint8)
        )


class HostArena:
    name = "host"

    def __init__(self):
        import phoenix.io as pio
        from phoenix.registry import get_runtime

        self.rt = get_runtime("host")
        pio.use_runtime(self.rt)  # the runtime libphxfile's driver open takes (phoenix.io's, else PHX_VENDOR's)
        self.stream = self.rt.stream_create(0)
        self._allocs = []

    def describe(self) -> dict:
        try:
            import torch

            tv, tc = torch.__version__, torch.version.cuda
        except ImportError:
            tv = tc = None
        return {
            "torch": tv,
            "torch_cuda": tc,
            "gpu": "none: phoenix host vendor (device memory = host arena, a TEST DOUBLE)",
        }

    def alloc(self, n: int):
        ptr = self.rt.device_alloc(n)
        self._allocs.append(ptr)
        return ArenaTensor(ptr, n)

    def fill_random(self, t, seed: int) -> None:
        import numpy as np

        t.view()[:] = np.random.default_rng(seed).integers(0, 256, t.n, dtype=np.uint8)

    def fill(self, t, value: int) -> None:
        t.view()[:] = value

    def slice(self, t, a: int, b: int):
        return ArenaTensor(t.ptr + a, b - a)

    def equal(self, a, b) -> tuple[bool, int, int]:
        import numpy as np

        bad = np.flatnonzero(a.view() != b.view())
        return bad.size == 0, int(bad.size), int(bad[0]) if bad.size else -1

    def all_value(self, t, value: int) -> bool:
        return bool((t.view() == value).all())

    def raw_stream(self) -> int:
        return int(self.stream)

    def stream_ctx(self):
        import contextlib

        return contextlib.nullcontext()

    def sync(self) -> None:
        self.rt.stream_synchronize(self.stream)

    def free(self, t) -> None:
        self.rt.device_free(t.ptr)
        self._allocs.remove(t.ptr)


# ---- LMCache's GDSContext registration and transfer logic (mirrored; see the docstring) ------


class Registry:
    """GDSContext.register_gpu_buffer / deregister_gpu_buffer / transfer_async / _resolve_buffer."""

    def __init__(self, backend, dev, region: int):
        self.backend, self.dev, self.region = backend, dev, region
        self.bases: list[int] = []
        self.sizes: list[int] = []
        self.tensors: list = []
        self.streams: set[int] = set()

    def register(self, buf) -> int:
        import bisect

        raw = self.dev.raw_stream()
        if raw not in self.streams:
            self.backend.register_stream(raw)
            self.streams.add(raw)
        nbytes = buf.numel() * buf.element_size()
        n = 0
        for start in range(0, nbytes, self.region):
            r = self.dev.slice(buf, start, min(start + self.region, nbytes))
            self.backend.register_buffer(r)  # LMCache's Backend.register_buffer -> phxFileBufRegister
            i = bisect.bisect_left(self.bases, r.data_ptr())
            self.bases.insert(i, r.data_ptr())
            self.sizes.insert(i, r.numel())
            self.tensors.insert(i, r)
            n += 1
        return n

    def deregister(self, buf) -> int:
        import bisect

        self.dev.sync()  # no DMA in flight may reference it
        nbytes = buf.numel() * buf.element_size()
        n = 0
        for start in range(0, nbytes, self.region):
            base = buf.data_ptr() + start
            i = bisect.bisect_left(self.bases, base)
            if i >= len(self.bases) or self.bases[i] != base:
                raise ValueError(f"GDS buffer at 0x{base:x} is not registered")
            self.backend.deregister_buffer(self.tensors[i])  # -> phxFileBufDeregister
            del self.bases[i], self.sizes[i], self.tensors[i]
            n += 1
        return n

    def release_streams(self) -> None:
        for raw in list(self.streams):
            self.backend.deregister_stream(raw)
            self.streams.discard(raw)

    def resolve(self, ptr: int) -> tuple[int, int, int]:
        import bisect

        i = bisect.bisect_right(self.bases, ptr) - 1
        if i < 0 or ptr - self.bases[i] >= self.sizes[i]:
            raise ValueError(f"GDS buffer at 0x{ptr:x} is not registered")
        return self.bases[i], ptr - self.bases[i], self.sizes[i]

    def transfer(self, handle, write: bool, buf_ptr: int, nbytes: int, slab_offset: int, subs: list) -> None:
        op = handle.write_async if write else handle.read_async
        pos = 0
        while pos < nbytes:
            base, off, rsize = self.resolve(buf_ptr + pos)
            seg = min(nbytes - pos, rsize - off)
            subs.append(op(base, seg, slab_offset + pos, off, self.dev.raw_stream()))
            pos += seg


# ---- the run ---------------------------------------------------------------------------------


def drop_cache(fd: int, path: str) -> str:
    how = []
    try:
        os.fsync(fd)
    except OSError:
        pass
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        how.append("posix_fadvise(DONTNEED)")
    except OSError as exc:
        how.append(f"posix_fadvise failed ({exc})")
    if os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            how.append("drop_caches=3")
        except OSError as exc:
            how.append(f"drop_caches failed ({exc.strerror})")
    return " + ".join(how)


def expect_refused(fn, what: str) -> dict:
    """LMCache's _check turns a negative phxFile rc into RuntimeError('... rc=-N [...]')."""
    try:
        sub = fn()
    except RuntimeError as exc:
        m = re.search(r"rc=(-?\d+)", str(exc))
        rc = int(m.group(1)) if m else None
        return {
            "what": what,
            "refused": True,
            "rc": rc,
            "errno": errno.errorcode.get(-rc, "?") if rc else None,
            "message": str(exc),
        }
    return {"what": what, "refused": False, "submission": sub}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for how LMCache's backend is loaded and what is mirrored.",
    )
    ap.add_argument(
        "--dir", default="/root", help="local-disk directory for the slab's temporary folder (default /root)"
    )
    ap.add_argument(
        "--size", type=parse_size, default=parse_size("4G"), help="bytes written and read back (default 4G)"
    )
    ap.add_argument(
        "--chunk",
        type=parse_size,
        default=parse_size("256M"),
        help="LMCache chunk (memory object) size per transfer_async (default 256M)",
    )
    ap.add_argument("--reps", type=int, default=2, help="write and read repetitions (every read is verified)")
    ap.add_argument(
        "--device",
        choices=["cuda", "host"],
        default="cuda",
        help="cuda: torch CUDA tensors (the H200 run); host: phoenix's host vendor arena (a TEST DOUBLE)",
    )
    ap.add_argument("--gpu", type=int, default=0, help="CUDA device index")
    ap.add_argument(
        "--load",
        choices=["auto", "stub", "package"],
        default="auto",
        help="how LMCache's modules are loaded (see the docstring; default auto)",
    )
    ap.add_argument("--package-import-timeout", type=float, default=120.0)
    ap.add_argument(
        "--no-direct-io", action="store_true", help="open the slab without O_DIRECT (LMCache's use_direct_io=False)"
    )
    ap.add_argument("--no-cold", action="store_true", help="do not drop the page cache before reads")
    ap.add_argument("--keep", action="store_true", help="keep the slab file")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)

    if args.device == "host":
        os.environ["PHX_VENDOR"] = "host"
    summary: dict = {
        "argv": sys.argv,
        "host": platform.node(),
        "python": platform.python_version(),
        "device_kind": args.device,
        "ok": False,
        "failures": [],
    }
    fails = summary["failures"]

    def fail(msg: str) -> None:
        log("FAIL: " + msg)
        fails.append(msg)

    summary["loader"] = ensure_loader_path(args)
    log(
        f"libphxfile: {summary['loader']['library_path']}; find_library('phxfile') -> "
        f"{summary['loader']['find_library_phxfile']!r}"
    )

    discovery, lm = load_lmcache(args)
    summary["lmcache"] = lm
    log(f"LMCache {lm['version']} at {lm['root']}: loaded by '{lm['method']}': {lm['how']}")
    log(
        "LMCache files that run here vs the wheel's RECORD: "
        + ", ".join(f"{os.path.basename(k)} {v}" for k, v in lm["record"]["files"].items())
    )
    if not lm["record"]["all_match"]:
        fail("LMCache's files differ from the wheel's RECORD")
    region = lm["gds_context_constants"]["_MAX_GDS_REGION"]
    align = lm["gds_context_constants"]["_GDS_ALIGNMENT"]

    import phoenix

    summary["phoenix"] = {
        "version": phoenix.__version__,
        "file": phoenix.__file__,
        "PHX_VENDOR": os.environ.get("PHX_VENDOR"),
        "PHX_MODE": os.environ.get("PHX_MODE"),
    }

    dev = TorchCuda(args.gpu) if args.device == "cuda" else HostArena()
    summary["device"] = dev.describe()
    log(f"device: {summary['device']}")

    # -- LMCache's discovery and environment check
    names = discovery.available_backends()
    summary["available_backends"] = list(names)
    log(f"LMCache available_backends(): {names}")
    if "phx" not in names:
        fail("LMCache does not list a 'phx' backend")
        return finish(summary, args)
    try:
        backend = discovery.create_backend("phx")  # imports gds_backends.phx, constructs, validate_environment()
        summary["validate_environment"] = "passed"
    except ValueError as exc:
        summary["validate_environment"] = f"refused: {exc}"
        if args.device == "cuda":
            fail(f"validate_environment: {exc}")
            return finish(summary, args)
        log(
            f"validate_environment() refused on this torch ({exc}): expected without a CUDA build; "
            "constructing LMCache's Backend class directly for the host test double"
        )
        backend = discovery._load_backend_class("phx")()
    lm["modules"] = loaded_modules(lm["root"])
    log("lmcache modules in this process: " + ", ".join(f"{k} ({v})" for k, v in lm["modules"].items()))
    bmod = sys.modules[type(backend).__module__]
    summary["backend"] = {
        "class": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "file": os.path.relpath(bmod.__file__, lm["root"]),
        "name": backend.name,
    }
    log(
        f"backend: {summary['backend']['class']} ({summary['backend']['file']}), "
        f"validate_environment: {summary['validate_environment']}"
    )

    size = (args.size + align - 1) // align * align
    slab_size = size  # GDSContext.initialize rounds the slab to _GDS_ALIGNMENT
    chunk = max(align, args.chunk // align * align)
    tmpdir = tempfile.mkdtemp(prefix="lmcache-phx-", dir=args.dir)
    handle = None
    reg = Registry(backend, dev, region)
    src = dst = None
    try:
        # -- open the slab (LMCache's FileGDSBackend.open_slab -> phxFileHandleRegister)
        direct = not args.no_direct_io
        try:
            handle = backend.open_slab(tmpdir, slab_size, direct)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                log(f"O_DIRECT refused on {tmpdir} ({exc}); opening with use_direct_io=False")
                direct = False
                handle = backend.open_slab(tmpdir, slab_size, direct)
            else:
                raise
        summary["slab"] = {"path": handle.path, "size": slab_size, "direct_io": direct, "fs": fs_type(tmpdir)}
        summary["library_loaded_by_lmcache"] = getattr(backend._lib, "_name", None)
        log(
            f"slab {handle.path} ({slab_size / 2**30:.2f} GiB, O_DIRECT={direct}, fs {summary['slab']['fs']}); "
            f"LMCache's Backend.library() loaded {summary['library_loaded_by_lmcache']!r}"
        )

        src, dst = dev.alloc(size), dev.alloc(size)
        dev.fill_random(src, 8)
        dev.fill(dst, POISON)
        with dev.stream_ctx():
            t0 = time.perf_counter()
            nreg = reg.register(src) + reg.register(dst)
            treg = time.perf_counter() - t0
        summary["registration"] = {
            "regions": nreg,
            "region_bytes": region,
            "seconds": round(treg, 4),
            "streams": len(reg.streams),
        }
        log(
            f"registered 2 x {size / 2**30:.2f} GiB as {nreg} regions of <= {region >> 20} MiB in {treg * 1e3:.1f} ms "
            "(LMCache's Backend.register_stream + register_buffer per region, in the order of GDSContext."
            "register_gpu_buffer, which this script mirrors: gds_context.py is not imported)"
        )

        def timed_transfer(write: bool, tensor):
            """The whole tensor to (write) or from the slab in `chunk` transfers on the stream,
            synchronized: (seconds, submissions, those whose bytes_done is not their size)."""
            subs: list = []
            t0 = time.perf_counter()
            with dev.stream_ctx():
                for off in range(0, size, chunk):
                    reg.transfer(handle, write, tensor.data_ptr() + off, min(chunk, size - off), off, subs)
                dev.sync()
            secs = time.perf_counter() - t0
            return secs, subs, [(s.size.value, s.bytes_done) for s in subs if s.bytes_done != s.size.value]

        writes, reads = [], []
        for rep in range(args.reps):
            # -- write
            tw, subs, bad = timed_transfer(True, src)
            writes.append(
                {
                    "rep": rep,
                    "seconds": round(tw, 4),
                    "gbps": round(size / tw / 1e9, 3),
                    "submissions": len(subs),
                    "bad_submissions": len(bad),
                }
            )
            log(f"write rep {rep}: {size / tw / 1e9:.2f} GB/s ({len(subs)} submissions, {tw:.3f} s)")
            if bad:
                fail(f"write rep {rep}: {len(bad)} submissions with bytes_done != size, first {bad[0]}")
            # -- cold read into the poisoned tensor
            dev.fill(dst, POISON)
            cache = "warm (not dropped)" if args.no_cold else drop_cache(handle.fd, handle.path)
            tr, subs, bad = timed_transfer(False, dst)
            same, ndiff, first = dev.equal(src, dst)
            reads.append(
                {
                    "rep": rep,
                    "seconds": round(tr, 4),
                    "gbps": round(size / tr / 1e9, 3),
                    "cache": cache,
                    "submissions": len(subs),
                    "bad_submissions": len(bad),
                    "equal": same,
                    "bytes_differ": ndiff,
                    "first_diff": first,
                }
            )
            log(
                f"read  rep {rep}: {size / tr / 1e9:.2f} GB/s ({len(subs)} submissions, {tr:.3f} s, cache: {cache}); "
                f"every byte equal: {same}" + ("" if same else f" ({ndiff} differ, first at {first})")
            )
            if bad:
                fail(f"read rep {rep}: {len(bad)} submissions with bytes_done != size, first {bad[0]}")
            if not same:
                fail(f"read rep {rep}: {ndiff} bytes differ from what was written, first at {first}")
        summary["write"], summary["read"] = writes, reads
        for key, rows in (("write", writes), ("read", reads)):
            g = sorted(r["gbps"] for r in rows)
            summary[f"{key}_gbps_median"] = (
                g[len(g) // 2] if len(g) % 2 else round((g[len(g) // 2 - 1] + g[len(g) // 2]) / 2, 3)
            )
            summary[f"{key}_gbps_best"] = g[-1]

        # -- edge checks
        summary["edges"] = edge_checks(backend, handle, reg, dev, src, region, fail)

        # -- teardown the way GDSContext does
        with dev.stream_ctx():
            nd = reg.deregister(src) + reg.deregister(dst)
            reg.release_streams()
        summary["deregistered_regions"] = nd
        log(f"deregistered {nd} regions and the stream")
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        fail(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            dev.sync()
        except Exception:  # noqa: BLE001
            pass
        for t in (src, dst):
            if t is not None and reg.bases:
                try:
                    reg.deregister(t)
                except Exception:  # noqa: BLE001
                    pass
        if handle is not None:
            try:
                handle.close()
                handle.close()  # repeated closes do nothing (GDSHandle.close contract)
                summary["slab_closed"] = handle.fd == -1
            except Exception as exc:  # noqa: BLE001
                fail(f"slab close: {exc}")
        try:
            backend.close_driver()  # SharedDriver: last owner -> phxFileDriverClose
            backend.close_driver()  # released already: does nothing
            summary["driver_closed"] = True
        except Exception as exc:  # noqa: BLE001
            fail(f"close_driver: {exc}")
        if args.device == "host":
            for t in (src, dst):
                if t is not None:
                    dev.free(t)
        if not args.keep:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return finish(summary, args)


def fs_type(path: str) -> str:
    try:
        best, fs = "", "?"
        with open("/proc/mounts") as f:
            for line in f:
                p = line.split()
                if len(p) > 2 and os.path.realpath(path).startswith(p[1].rstrip("/") + "/") and len(p[1]) > len(best):
                    best, fs = p[1], p[2]
                elif p[1] == "/" and not best:
                    fs = p[2]
        return fs
    except OSError:
        return "?"


def edge_checks(backend, handle, reg, dev, src, region: int, fail) -> dict:
    """A two-region buffer with an unregistered 64 KiB guard after it, poisoned."""
    out: dict = {}
    guard = 64 << 10
    total = 2 * region + guard
    buf = dev.alloc(total)
    dev.fill(buf, POISON)
    body = dev.slice(buf, 0, 2 * region)
    edge_reg = Registry(backend, dev, region)
    edge_reg.streams = reg.streams  # the stream is registered already (process-wide in LMCache)
    fd = os.open(handle.path, os.O_RDONLY)
    try:
        before = os.pread(fd, 3 * 8192, 0)
        with dev.stream_ctx():
            edge_reg.register(body)
            base0, base1 = body.data_ptr(), body.data_ptr() + region
            raw = dev.raw_stream()
            checks = [
                expect_refused(
                    lambda: handle.read_async(base0, 8192, 0, region - 4096, raw),
                    "read: region 0's base, an extent running 4 KiB into region 1",
                ),
                expect_refused(
                    lambda: handle.write_async(base0, 8192, 8192, region - 4096, raw),
                    "write: region 0's base, an extent running 4 KiB into region 1",
                ),
                expect_refused(
                    lambda: handle.read_async(base1, 8192, 0, region - 4096, raw),
                    "read: past the end of the last registered region (into the unregistered guard)",
                ),
                expect_refused(
                    lambda: handle.write_async(base1, 8192, 16384, region - 4096, raw),
                    "write: past the end of the last registered region",
                ),
            ]
            dev.sync()
        for c in checks:
            sub = c.pop("submission", None)
            if not c["refused"]:
                c["bytes_done"] = sub.bytes_done if sub is not None else None
                fail(f"edge: not refused: {c['what']} (bytes_done {c['bytes_done']})")
            log(f"edge: {c['what']}: " + (f"refused, rc={c['rc']} ({c['errno']})" if c["refused"] else "NOT refused"))
        out["refusals"] = checks
        untouched = dev.all_value(buf, POISON)
        slab_same = os.pread(fd, 3 * 8192, 0) == before
        out["buffer_and_guard_untouched"] = untouched
        out["slab_untouched"] = slab_same
        log(f"edge: buffer and guard still all 0x{POISON:X}: {untouched}; slab bytes unchanged: {slab_same}")
        if not untouched:
            fail("edge: a refused transfer changed the buffer or the guard past it")
        if not slab_same:
            fail("edge: a refused write changed the slab")
        # the same extent split at the boundary, LMCache's way (transfer_async splits it)
        subs: list = []
        with dev.stream_ctx():
            edge_reg.transfer(handle, False, base0 + region - 4096, 8192, 0, subs)
            dev.sync()
        split_ok = [s.bytes_done for s in subs] == [4096, 4096]
        same, _, _ = dev.equal(dev.slice(buf, region - 4096, region + 4096), dev.slice(src, 0, 8192))
        guard_ok = dev.all_value(dev.slice(buf, 2 * region, total), POISON)
        out["split_at_boundary"] = {
            "bytes_done": [s.bytes_done for s in subs],
            "data_equal": same,
            "guard_untouched": guard_ok,
        }
        log(
            f"edge: the same extent split at the region boundary: bytes_done {[s.bytes_done for s in subs]}, "
            f"data equal {same}, guard untouched {guard_ok}"
        )
        if not (split_ok and same and guard_ok):
            fail("edge: the split transfer across the region boundary failed")
        # deregistering a base that is not registered is tolerated (LMCache's contract)
        try:
            backend.deregister_buffer(dev.slice(buf, 4096, 8192))
            out["deregister_unknown_base"] = "tolerated"
        except Exception as exc:  # noqa: BLE001
            out["deregister_unknown_base"] = f"raised: {exc}"
            fail(f"edge: deregistering an unknown base raised {exc}")
        log(f"edge: deregister of an unregistered base: {out['deregister_unknown_base']}")
        with dev.stream_ctx():
            out["deregistered_regions"] = edge_reg.deregister(body)
    finally:
        os.close(fd)
        dev.sync()
        if edge_reg.bases:
            try:
                edge_reg.deregister(body)
            except Exception:  # noqa: BLE001
                pass
        if isinstance(dev, HostArena):
            dev.free(buf)
    return out


def finish(summary: dict, args) -> int:
    summary["ok"] = not summary["failures"]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        log(f"summary written to {args.json}")
    if summary.get("write") and summary.get("read"):
        log(
            f"RESULT: write {summary['write_gbps_median']} GB/s (median of {len(summary['write'])}), read "
            f"{summary['read_gbps_median']} GB/s (median, {summary['read'][0]['cache']}); {args.size / 2**20:.0f} MiB "
            f"in {args.chunk / 2**20:.0f} MiB chunks, split at 16 MiB regions"
        )
    log(
        "PASS: LMCache's phx backend round-tripped every byte through libphxfile"
        if summary["ok"]
        else f"FAILED: {len(summary['failures'])} failure(s): " + "; ".join(summary["failures"])
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
