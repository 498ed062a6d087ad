"""Static checks of a vendor port: what ``phx-port check`` does.

Core side, control plane, porter's side. :func:`check` reads a port back: both files,
every operation implemented (found by introspection, the placeholder calls by AST), the
page size equal on both sides, the kernel file compiled (kbuild against installed headers
through ``kernel/Makefile``, else a syntax check against stub headers), and the prototype
table (:meth:`~phoenix.vendor.VendorRuntime.prototype_table`) resolved against the runtime
library (:meth:`~phoenix.vendor.VendorRuntime.locate_library`) when it is installed. Every
finding points at ``file:line``. The contract is read from :mod:`phoenix.vendor`, so it
never goes stale; the markers of a generated port are defined here, once.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from . import registry
from .vendor import VendorRuntime

#: calls in a generated runtime.py that mark an operation still to fill
PLACEHOLDERS = ("_fill_me", "_scaffold_probe")
#: the comment that marks a place to fill in a generated file (both sides)
TODO_TAG = "TODO(phx-port)"
_TODO = re.compile(re.escape(TODO_TAG) + r":?\s*fill\s+(\w+)")
_SIZES = {
    f"SZ_{n}{u}": n << s
    for u, s in (("", 0), ("K", 10), ("M", 20), ("G", 30))
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
}


# -- the contract, read from phoenix.vendor ---------------------------------------------


def required_operations() -> list[str]:
    """The operations every port implements: ``probe`` and each method of VendorRuntime that,
    left out, raises VendorNotImplemented (read from the class, so it never goes stale)."""
    ops = ["probe"]
    for name, fn in vars(VendorRuntime).items():
        if inspect.isfunction(fn) and not name.startswith("_"):
            try:
                if "_not_implemented(" in inspect.getsource(fn):
                    ops.append(name)
            except (OSError, TypeError):  # no source (a zipped install): the list below
                return list(_OPERATIONS)
    return ops


#: the operations as of DATA_PATH_ABI 1, for an installation without phoenix/vendor.py's source
_OPERATIONS = (
    "probe",
    "devices",
    "set_device",
    "device_alloc",
    "device_free",
    "host_register",
    "host_unregister",
    "host_alloc_pinned",
    "host_free_pinned",
    "memcpy",
    "memcpy_async",
    "stream_create",
    "stream_synchronize",
    "stream_destroy",
    "launch_host_func",
    "pointer_info",
    "data_path",
)


def size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} bytes"


# -- check ------------------------------------------------------------------------------------


@dataclass
class Finding:
    level: str  #: ok | error | todo | skip | note
    topic: str
    message: str
    path: str | None = None
    line: int | None = None

    @property
    def where(self) -> str:
        if not self.path:
            return ""
        return f"{self.path}:{self.line}" if self.line else self.path

    def format(self) -> str:
        word = {"ok": "ok", "error": "error", "todo": "not implemented", "skip": "skipped", "note": "note"}[self.level]
        where = self.where
        return f"{where}: {word}: [{self.topic}] {self.message}" if where else f"{word}: [{self.topic}] {self.message}"


@dataclass
class CheckReport:
    name: str
    directory: str | None
    findings: list[Finding] = field(default_factory=list)

    def add(self, *args, **kwargs) -> Finding:
        f = Finding(*args, **kwargs)
        self.findings.append(f)
        return f

    @property
    def failed(self) -> bool:
        return any(f.level in ("error", "todo") for f in self.findings)

    def as_dict(self) -> dict:
        return {
            "vendor": self.name,
            "directory": self.directory,
            "result": "fail" if self.failed else "pass",
            "findings": [asdict(f) for f in self.findings],
        }


def locate(name: str, directory: str | None = None) -> tuple[str | None, str]:
    """The directory holding a vendor's runtime.py (and p2p.c), and where it was found."""
    if directory:
        return os.path.abspath(directory), "--dir"
    entry = registry.discover().get(name)
    if entry is None:
        return None, "not found"
    loc = entry.location
    if loc.endswith(".py") and os.path.exists(loc):
        return os.path.dirname(os.path.abspath(loc)), entry.source
    modname = loc.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, f"{entry.source}: module {modname} not found"
    return os.path.dirname(os.path.abspath(spec.origin)), entry.source


#: the code files a port's directory may hold: its two files and a package's __init__.py
PORT_FILES = ("runtime.py", "p2p.c", "__init__.py")


def third_files(directory: str) -> list[str]:
    """The .py, .c and .h files in a port's directory besides :data:`PORT_FILES` (the two-file
    rule: a third is code outside the contract, which no check and no kernel build sees)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(
        n
        for n in names
        if n.endswith((".py", ".c", ".h")) and n not in PORT_FILES and os.path.isfile(os.path.join(directory, n))
    )


def _load_runtime_class(name: str, path: str):
    modname = f"phoenix_check_{name}.runtime"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    cls = getattr(mod, "Runtime", None)
    if not (isinstance(cls, type) and issubclass(cls, VendorRuntime)):
        raise TypeError(f"{path} has no class Runtime derived from phoenix.vendor.VendorRuntime")
    return mod, cls


def _placeholder_line(fn) -> int | None:
    """The line of a placeholder call (``_fill_me``) in a function's body, or None."""
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if callee in PLACEHOLDERS:
                return start + node.lineno - 1
    return None


def _check_operations(rep: CheckReport, cls, runtime_path: str) -> None:
    missing = 0
    ops = required_operations()
    for op in ops:
        owner = next((k for k in cls.__mro__ if op in vars(k)), None)
        attr = vars(owner)[op] if owner else None
        fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        if owner is VendorRuntime or owner is None:
            try:
                line = inspect.getsourcelines(cls)[1]
            except (OSError, TypeError):
                line = None
            rep.add(
                "todo",
                "operations",
                f"{op}() is not implemented: add it to class {cls.__name__} "
                f"(contract: phoenix/vendor.py, VendorRuntime.{op})",
                runtime_path,
                line,
            )
            missing += 1
            continue
        line = _placeholder_line(fn)
        if line is not None:
            try:
                where = inspect.getsourcefile(fn) or runtime_path
            except TypeError:
                where = runtime_path
            rep.add(
                "todo",
                "operations",
                f"{op}() is not implemented yet: fill it here (its contract is its docstring)",
                where,
                line,
            )
            missing += 1
    if not missing:
        inherited = [
            op
            for op in ops
            if op not in vars(cls)
            and not any(op in vars(k) for k in cls.__mro__[1:-1] if k.__module__ == cls.__module__)
        ]
        via = f" ({len(inherited)} inherited from {cls.__mro__[1].__name__})" if inherited else ""
        rep.add("ok", "operations", f"all {len(ops)} operations implemented{via}")


def _class_attr_line(path: str, attr: str) -> int | None:
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Runtime":
            for stmt in node.body:
                targets = (
                    stmt.targets
                    if isinstance(stmt, ast.Assign)
                    else [stmt.target]
                    if isinstance(stmt, ast.AnnAssign)
                    else []
                )
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    return stmt.lineno
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == attr:
                    return stmt.lineno
            return node.lineno
    return None


def _c_value(expr: str, defines: dict[str, str], depth: int = 0) -> int | None:
    """The value of a C constant expression of literals, SZ_* and the file's own #defines."""
    if depth > 8:
        return None
    expr = re.sub(r"/\*.*?\*/", " ", expr).strip()

    def word(m):
        w = m.group(0)
        if w in _SIZES:
            return str(_SIZES[w])
        if w in defines:
            v = _c_value(defines[w], defines, depth + 1)
            return str(v) if v is not None else w
        if w == "PAGE_SIZE":
            return "4096"
        return w

    expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b", lambda m: str(int(m.group(1), 0)), expr)
    expr = re.sub(r"\b[A-Za-z_]\w*\b", word, expr)
    if not re.fullmatch(r"[\d\s()+\-*/<>|&]*", expr) or not expr.strip():
        return None
    try:
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}, {}))  # digits and operators only
    except Exception:
        return None


def kernel_page_size(path: str) -> tuple[int | None, int | None, str]:
    """(page size, line of ``.page_size =``, the expression) read from a p2p.c."""
    text = open(path, errors="replace").read()
    defines = {}
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+([^\n]+)$", text, re.M):
        defines[m.group(1)] = m.group(2)
    m = re.search(r"\.page_size\s*=\s*([^,}\n]+)", text)
    if not m:
        return None, None, ""
    line = text.count("\n", 0, m.start()) + 1
    return _c_value(m.group(1), defines), line, m.group(1).strip()


def kernel_todos(path: str) -> list[tuple[str, int]]:
    out = []
    with open(path, errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            m = _TODO.search(line)
            if m:
                out.append((m.group(1), i))
    return out


def kernel_source_dir() -> str | None:
    """``kernel/`` of a phoenix checkout (its Makefile and phx_p2p.h), or None."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cand = os.environ.get("PHX_KERNEL_SRC") or os.path.join(here, "kernel")
    return cand if os.path.exists(os.path.join(cand, "phx_p2p.h")) else None


def kdir_problem(kdir: str | None) -> str | None:
    """Why ``--kdir`` is no kernel build tree to compile against (None: it is one, or not given,
    or ``none``): kbuild runs ``make -C KDIR``, which needs its Makefile and its include/."""
    if kdir is None or kdir == "none":
        return None
    if not kdir.strip():
        return "--kdir is empty: give a kernel build tree, or 'none'"
    if not os.path.isdir(kdir):
        return f"--kdir {kdir} does not exist (or is no directory)"
    lacks = [
        f for f, ok in (("Makefile", os.path.isfile), ("include/", os.path.isdir)) if not ok(os.path.join(kdir, f))
    ]
    if lacks:
        return (
            f"--kdir {kdir} is not a kernel build tree (no {' and no '.join(lacks)}): give "
            f"/lib/modules/$(uname -r)/build or /usr/src/linux-headers-<version>, or 'none' for a syntax check"
        )
    return None


def kernel_headers(kdir: str | None = None) -> str | None:
    """The kernel build tree to compile against: ``--kdir``, the running kernel's, or the newest Debian headers."""
    if kdir:
        return kdir if kdir != "none" and os.path.isdir(kdir) else None
    import glob

    run = f"/lib/modules/{os.uname().release}/build"
    if os.path.isdir(run):
        return run
    found = sorted(glob.glob("/usr/src/linux-headers-*-amd64"))
    return found[-1] if found else None


def _map_paths(text: str, mapping: dict[str, str]) -> str:
    for src, dst in mapping.items():
        text = text.replace(src, dst)
    return text


def compile_kernel_file(name: str, p2p: str, kdir: str | None = None, timeout: float = 300) -> Finding:
    """Build ``p2p.c`` as ``phx_<name>.ko`` with the core (kbuild, -Werror), or syntax-check it."""
    problem = kdir_problem(kdir)  # first: the caller's mistake is one wherever phoenix is installed
    if problem:
        return Finding("error", "kernel build", problem, p2p)
    src = kernel_source_dir()
    if src is None:
        return Finding(
            "skip",
            "kernel build",
            "kernel/ (phx_p2p.h, Makefile) is not part of this installation: "
            "run phx-port check from a phoenix checkout to compile p2p.c",
            p2p,
        )
    headers = kernel_headers(kdir)
    with tempfile.TemporaryDirectory(prefix="phx-check-") as tmp:
        if headers and shutil.which("make"):
            root = os.path.join(tmp, "root")
            build = os.path.join(tmp, "build")
            os.makedirs(os.path.join(root, "vendors", name))
            os.symlink(os.path.abspath(p2p), os.path.join(root, "vendors", name, "p2p.c"))
            cmd = ["make", "-s", "-C", src, f"ROOT={root}", f"BUILD={build}", f"KDIR={headers}", "modules"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return Finding("error", "kernel build", f"the kernel build ran past {timeout:g} s", p2p)
            out = _map_paths(
                proc.stdout + proc.stderr,
                {os.path.join(build, f"phx_{name}.c"): os.path.abspath(p2p), f"phx_{name}.c": os.path.abspath(p2p)},
            )
            if proc.returncode != 0:
                return Finding(
                    "error",
                    "kernel build",
                    f"p2p.c does not build against {headers} (-Werror):\n" + _compiler_lines(out),
                    p2p,
                )
            return Finding("ok", "kernel build", f"phx_{name}.ko builds against {headers} with -Werror", p2p)
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if not cc:
            return Finding("skip", "kernel build", "no kernel headers and no C compiler: p2p.c was not compiled", p2p)
        stubs = os.path.join(tmp, "stubs")
        _write_stubs(stubs, p2p)
        shutil.copy(os.path.join(src, "phx_p2p.h"), os.path.join(stubs, "phx_p2p.h"))
        cmd = [
            cc,
            "-fsyntax-only",
            "-std=gnu11",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
            "-Wno-implicit-function-declaration",
            "-I",
            stubs,
            os.path.abspath(p2p),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        why = "no kernel headers found (install linux-headers, or pass --kdir)" if kdir != "none" else "--kdir none"
        if proc.returncode != 0:
            return Finding(
                "error",
                "kernel build",
                f"p2p.c fails a syntax check against phoenix's stub kernel headers "
                f"({why}); a kernel name the stubs lack may also show here:\n" + _compiler_lines(proc.stderr),
                p2p,
            )
        return Finding(
            "ok",
            "kernel build",
            f"syntax check passed against stub kernel headers ({why}); the real build needs the headers",
            p2p,
        )


def _compiler_lines(out: str, limit: int = 20) -> str:
    keep = [
        ln for ln in out.splitlines() if re.search(r"(error|warning):|Error \d|^\S+:\d+:", ln)
    ] or out.strip().splitlines()
    return "\n".join("    " + ln for ln in keep[:limit])


#: what a backend's file uses of the kernel, declared for a syntax check without headers
_KSTUB = r"""
/* phoenix's stub kernel headers: a syntax check of a vendor's p2p.c without a kernel tree */
#ifndef PHX_KSTUB_H
#define PHX_KSTUB_H
#include <stddef.h>
#include <stdbool.h>
#include <string.h>
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long long u64;
typedef signed char s8; typedef short s16; typedef int s32; typedef long long s64;
typedef u64 dma_addr_t; typedef u64 phys_addr_t; typedef u64 resource_size_t; typedef unsigned gfp_t;
#define __init
#define __exit
#define __user
#define __iomem
#define __must_check
#define EXPORT_SYMBOL(x)
#define EXPORT_SYMBOL_GPL(x)
#define MODULE_LICENSE(x)
#define MODULE_DESCRIPTION(x)
#define MODULE_AUTHOR(x)
#define MODULE_DEVICE_TABLE(a, b)
#define MODULE_PARM_DESC(a, b)
#define module_param(a, b, c)
#define module_param_cb(a, b, c, d)
#define module_init(f) int init_module(void) { return f(); }
#define module_exit(f) void cleanup_module(void) { f(); }
struct module; extern struct module __this_module;
#define THIS_MODULE (&__this_module)
#define symbol_get(x) ((typeof(&x))(__phx_symbol_get(#x)))
#define symbol_put(x) __phx_symbol_put(#x)
void *__phx_symbol_get(const char *); void __phx_symbol_put(const char *);
#define EPERM 1
#define ENOENT 2
#define EIO 5
#define ENXIO 6
#define E2BIG 7
#define EAGAIN 11
#define ENOMEM 12
#define EFAULT 14
#define EBUSY 16
#define EEXIST 17
#define ENODEV 19
#define EINVAL 22
#define ENOSPC 28
#define ERANGE 34
#define ENOSYS 38
#define EOVERFLOW 75
#define EOPNOTSUPP 95
#define ETIMEDOUT 110
#define GFP_KERNEL 0u
#define GFP_ATOMIC 1u
#define PAGE_SHIFT 12
#define PAGE_SIZE (1UL << PAGE_SHIFT)
#define SZ_4K 0x1000
#define SZ_8K 0x2000
#define SZ_16K 0x4000
#define SZ_32K 0x8000
#define SZ_64K 0x10000
#define SZ_128K 0x20000
#define SZ_256K 0x40000
#define SZ_512K 0x80000
#define SZ_1M 0x100000
#define SZ_2M 0x200000
#define SZ_4M 0x400000
#define SZ_1G 0x40000000
#define IS_ALIGNED(x, a) (((x) & ((typeof(x))(a) - 1)) == 0)
#define ALIGN(x, a) (((x) + (a) - 1) & ~((typeof(x))(a) - 1))
#define DIV_ROUND_UP(n, d) (((n) + (d) - 1) / (d))
#define BIT(n) (1UL << (n))
#define min(a, b) ((a) < (b) ? (a) : (b))
#define max(a, b) ((a) > (b) ? (a) : (b))
#define container_of(p, T, m) ((T *)((char *)(p) - offsetof(T, m)))
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define likely(x) (x)
#define unlikely(x) (x)
#define READ_ONCE(x) (x)
#define WRITE_ONCE(x, v) ((x) = (v))
#define WARN_ON(x) (x)
#define WARN_ON_ONCE(x) (x)
#define BUG_ON(x) ((void)(x))
static inline bool is_power_of_2(unsigned long n) { return n && !(n & (n - 1)); }
int printk(const char *fmt, ...);
#ifndef pr_fmt
#define pr_fmt(fmt) fmt
#endif
#define pr_err(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
#define pr_warn(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
#define pr_info(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
#define pr_debug(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
#define pr_info_ratelimited(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
#define pr_err_ratelimited(fmt, ...) printk(pr_fmt(fmt), ##__VA_ARGS__)
void *kmalloc(size_t, gfp_t); void *kzalloc(size_t, gfp_t); void *kcalloc(size_t, size_t, gfp_t);
void *kvmalloc(size_t, gfp_t); void *kvzalloc(size_t, gfp_t); void *kvcalloc(size_t, size_t, gfp_t);
void *kmalloc_array(size_t, size_t, gfp_t); void *kvmalloc_array(size_t, size_t, gfp_t);
void kfree(const void *); void kvfree(const void *);
struct list_head { struct list_head *next, *prev; };
#define LIST_HEAD(n) struct list_head n = { &(n), &(n) }
void INIT_LIST_HEAD(struct list_head *); void list_add(struct list_head *, struct list_head *);
void list_add_tail(struct list_head *, struct list_head *); void list_del(struct list_head *);
void list_del_init(struct list_head *); int list_empty(const struct list_head *);
#define list_for_each_entry(pos, head, member) \
    for (pos = container_of((head)->next, typeof(*pos), member); &pos->member != (head); \
         pos = container_of(pos->member.next, typeof(*pos), member))
#define list_for_each_entry_safe(pos, n, head, member) \
    for (pos = container_of((head)->next, typeof(*pos), member), \
         n = container_of(pos->member.next, typeof(*pos), member); &pos->member != (head); \
         pos = n, n = container_of(n->member.next, typeof(*n), member))
typedef struct { int v; } spinlock_t;
struct mutex { int v; };
struct kref { int v; };
struct completion { int v; };
struct rw_semaphore { int v; };
#define DEFINE_MUTEX(n) struct mutex n
#define DEFINE_SPINLOCK(n) spinlock_t n
void spin_lock_init(spinlock_t *); void spin_lock(spinlock_t *); void spin_unlock(spinlock_t *);
#define spin_lock_irqsave(l, f) ((void)(f), spin_lock(l))
#define spin_unlock_irqrestore(l, f) ((void)(f), spin_unlock(l))
void mutex_init(struct mutex *); void mutex_lock(struct mutex *); void mutex_unlock(struct mutex *);
void kref_init(struct kref *); void kref_get(struct kref *); int kref_put(struct kref *, void (*)(struct kref *));
void init_completion(struct completion *); void complete(struct completion *);
void wait_for_completion(struct completion *);
unsigned long wait_for_completion_timeout(struct completion *, unsigned long);
unsigned long msecs_to_jiffies(unsigned int); bool in_task(void); void might_sleep(void);
struct device { int v; };
struct resource { resource_size_t start, end; unsigned long flags; };
struct pci_dev { unsigned short vendor, device; unsigned int class; struct device dev; struct resource resource[6]; };
struct pci_device_id { u32 vendor, device, subvendor, subdevice, class, class_mask; unsigned long driver_data; };
struct pci_driver { const char *name; const struct pci_device_id *id_table;
    int (*probe)(struct pci_dev *, const struct pci_device_id *); void (*remove)(struct pci_dev *);
    struct { bool suppress_bind_attrs; } driver; };
#define PCI_ANY_ID (~0u)
#define PCI_VENDOR_ID_NVIDIA 0x10de
#define PCI_VENDOR_ID_AMD 0x1022
#define PCI_VENDOR_ID_ATI 0x1002
#define PCI_VENDOR_ID_INTEL 0x8086
#define PCI_VENDOR_ID_REDHAT_QUMRANET 0x1af4
#define PCI_BASE_CLASS_DISPLAY 0x03
#define PCI_DEVICE(v, d) .vendor = (v), .device = (d), .subvendor = PCI_ANY_ID, .subdevice = PCI_ANY_ID
#define IORESOURCE_MEM 0x200
struct pci_dev *pci_get_device(unsigned int, unsigned int, struct pci_dev *);
struct pci_dev *pci_dev_get(struct pci_dev *); void pci_dev_put(struct pci_dev *);
resource_size_t pci_resource_len(struct pci_dev *, int); resource_size_t pci_resource_start(struct pci_dev *, int);
unsigned long pci_resource_flags(struct pci_dev *, int); u64 pci_bus_address(struct pci_dev *, int);
int pci_enable_device_mem(struct pci_dev *); void pci_disable_device(struct pci_dev *);
int pci_request_region(struct pci_dev *, int, const char *); void pci_release_region(struct pci_dev *, int);
int pci_register_driver(struct pci_driver *); void pci_unregister_driver(struct pci_driver *);
const char *pci_name(const struct pci_dev *);
#define dev_info(d, fmt, ...) printk(fmt, ##__VA_ARGS__)
#define dev_err(d, fmt, ...) printk(fmt, ##__VA_ARGS__)
#define dev_warn(d, fmt, ...) printk(fmt, ##__VA_ARGS__)
struct scatterlist { u64 dma_address; unsigned int dma_length; };
struct sg_table { struct scatterlist *sgl; unsigned int nents, orig_nents; };
#define sg_dma_address(sg) ((sg)->dma_address)
#define sg_dma_len(sg) ((sg)->dma_length)
struct scatterlist *sg_next(struct scatterlist *);
#define for_each_sgtable_dma_sg(sgt, sg, i) for ((i) = 0, (sg) = (sgt)->sgl; (i) < (sgt)->nents; (i)++, (sg) = sg_next(sg))
struct kernel_param;
struct kernel_param_ops { int (*set)(const char *, const struct kernel_param *);
    int (*get)(char *, const struct kernel_param *); };
bool sysfs_streq(const char *, const char *); int kstrtou64(const char *, unsigned int, u64 *);
#endif
"""


def _write_stubs(stubs: str, p2p: str) -> None:
    """The stub header, and every <linux/...> / <asm/...> header the file includes as a pointer to it."""
    os.makedirs(stubs, exist_ok=True)
    with open(os.path.join(stubs, "phx_kstub.h"), "w") as fh:
        fh.write(_KSTUB)
    text = open(p2p, errors="replace").read()
    for inc in set(re.findall(r"#\s*include\s*<([\w/.-]+)>", text)) | {"linux/types.h"}:
        path = os.path.join(stubs, inc)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write('#include "phx_kstub.h"\n')


def _protos_of(cls) -> tuple[list, str]:
    """The prototype table a port binds (its declared hook), and where it is declared:
    ``prefix`` for a CUDA-shaped port (the table follows from it), else ``prototype_table``."""
    try:
        rows = list(cls.prototype_table())
    except Exception:  # a broken hook is reported as an empty table, the check goes on
        rows = []
    return rows, ("prefix" if "prefix" in vars(cls) and isinstance(cls.prefix, str) else "prototype_table")


def _library_of(cls) -> tuple[str | None, list[str]]:
    try:
        return cls.locate_library()
    except Exception as exc:  # the hook must not raise; say so if it does
        return None, [f"locate_library() raised {type(exc).__name__}: {exc}"]


def check(name: str, directory: str | None = None, kdir: str | None = None, compile_kernel: bool = True) -> CheckReport:
    """Every static check of a port; the findings point at ``file:line``."""
    where, source = locate(name, directory)
    rep = CheckReport(name, where)
    if where is None:
        found = "" if source == "not found" else f" ({source})"
        rep.add(
            "error",
            "files",
            f"no vendor {name!r} found{found}: looked in-tree (vendors/<name>/), in the "
            "phoenix.vendors entry points and PHX_VENDOR_PATH; or give --dir DIR",
        )
        return rep
    runtime_py, p2p_c = os.path.join(where, "runtime.py"), os.path.join(where, "p2p.c")
    have_rt, have_k = os.path.exists(runtime_py), os.path.exists(p2p_c)
    if have_rt and have_k:
        rep.add("ok", "files", f"runtime.py and p2p.c present ({source})", where)
    if not have_rt:
        rep.add("error", "files", "runtime.py is missing (the userspace side: class Runtime)", runtime_py)
    if not have_k:
        rep.add(
            "error",
            "files",
            "p2p.c is missing (the kernel side: struct phx_p2p_ops); render one with "
            "`phx-port new <name> --out /tmp/x` and copy its p2p.c",
            p2p_c,
        )

    for extra in third_files(where):
        rep.add(
            "error",
            "files",
            f"{extra}: a port is two files, runtime.py and p2p.c (an __init__.py, a README beside them); "
            "move this code into the one of its side",
            os.path.join(where, extra),
        )

    cls = None
    if have_rt:
        try:
            _, cls = _load_runtime_class(name, runtime_py)
        except (Exception, SystemExit) as exc:  # sys.exit() at import is the port's failure, not ours
            import traceback

            tb = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == runtime_py]
            what = (
                f"it called sys.exit({exc.code!r}) at import"
                if isinstance(exc, SystemExit)
                else f"{type(exc).__name__}: {exc}"
            )
            rep.add(
                "error",
                "import",
                f"runtime.py does not import: {what}",
                runtime_py,
                tb[-1].lineno if tb else getattr(exc, "lineno", None),
            )
    if cls is not None:
        if cls.name != name:
            rep.add(
                "error",
                "name",
                f"Runtime.name is {cls.name!r}, not {name!r} (it must equal the vendor's name)",
                runtime_py,
                _class_attr_line(runtime_py, "name"),
            )
        _check_operations(rep, cls, runtime_py)

    # page size, both sides
    rt_size = getattr(cls, "p2p_page_size", None) if cls is not None else None
    rt_line = _class_attr_line(runtime_py, "p2p_page_size") if have_rt else None
    if have_k:
        k_size, k_line, expr = kernel_page_size(p2p_c)
        if k_size is None:
            rep.add(
                "error",
                "page size",
                f"cannot read .page_size in p2p.c ({expr or 'no .page_size = ...'}): "
                "use a literal, SZ_64K or a #define of one",
                p2p_c,
                k_line,
            )
        elif rt_size is not None:
            if k_size != rt_size:
                rep.add(
                    "error",
                    "page size",
                    f"p2p.c's .page_size is {k_size} ({expr}) but runtime.py's "
                    f"p2p_page_size is {rt_size} ({runtime_py}:{rt_line}): make them equal",
                    p2p_c,
                    k_line,
                )
            elif k_size & (k_size - 1) or k_size < 4096:
                rep.add("error", "page size", f"{k_size} is not a power of two of at least 4096", p2p_c, k_line)
            else:
                rep.add(
                    "ok",
                    "page size",
                    f"{size_text(k_size)} on both sides (runtime.py:{rt_line}, p2p.c:{k_line})",
                    p2p_c,
                    k_line,
                )
        for what, line in kernel_todos(p2p_c):
            rep.add("todo", "kernel side", f"{what} is not filled in yet (see the comment there)", p2p_c, line)
        if compile_kernel:
            rep.findings.append(compile_kernel_file(name, p2p_c, kdir))

    # the prototype table against the library, when the library is present
    if cls is not None:
        rows, table = _protos_of(cls)
        line = _class_attr_line(runtime_py, table)
        if not rows:
            rep.add(
                "note",
                "prototype table",
                "the port has no prototype table to resolve (prototype_table() is empty)",
                runtime_py,
                line,
            )
        else:
            path, looked = _library_of(cls)
            if path is None:
                rep.add(
                    "skip",
                    "prototype table",
                    f"{len(rows)} rows not resolved: the runtime library is not "
                    f"installed here (looked: {'; '.join(looked[:6])})",
                    runtime_py,
                    line,
                )
            else:
                try:
                    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                except OSError as exc:
                    rep.add("error", "prototype table", f"{path} does not load: {exc}", runtime_py, line)
                else:
                    missing = [p.symbol for p in rows if not p.optional and not hasattr(lib, p.symbol)]
                    absent = [p.symbol for p in rows if p.optional and not hasattr(lib, p.symbol)]
                    if missing:
                        rep.add(
                            "error",
                            "prototype table",
                            f"{path} lacks {len(missing)} required symbol(s): {', '.join(missing)}",
                            runtime_py,
                            line,
                        )
                    else:
                        extra = f" ({len(absent)} optional absent: {', '.join(absent)})" if absent else ""
                        rep.add(
                            "ok", "prototype table", f"all {len(rows)} rows resolve in {path}{extra}", runtime_py, line
                        )
    return rep
