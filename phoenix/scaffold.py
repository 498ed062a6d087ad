"""Scaffolding of a vendor port: what ``phx-port new`` does.

Core side, control plane, porter's side. A port is two files, ``runtime.py`` (userspace: a
:class:`phoenix.vendor.VendorRuntime` subclass named ``Runtime``) and ``p2p.c`` (kernel:
one ``struct phx_p2p_ops``, ``kernel/phx_p2p.h``). :func:`generate` renders them from
the jinja2 templates in ``templates/`` (installed as ``phoenix.templates``):

* ``--like cuda --prefix P --lib LIB``: a declaration, a
  :class:`phoenix.cudalike.CudaLikeRuntime` subclass saying its prefix, library, root
  variable and page size; everything else (library search honouring ``PHX_<NAME>_LIBRARY``
  and ``$<NAME>_PATH``, the probe, the emulator convention) is inherited, so that
  ``phx-port test <name> --emulated`` passes without editing;
* otherwise a blank port: every operation a method with its contract as docstring and a
  ``_fill_me(...)`` line that raises :class:`~phoenix.errors.VendorNotImplemented`
  naming the operation and that line.

The kernel file is a skeleton either way (kernel P2P interfaces are not CUDA-shaped):
it builds and loads, registers as unavailable, and marks each place to fill with
``TODO(phx-port): fill <what>``. ``phx-port check`` (reading a port back) is
:mod:`phoenix.portcheck`.
"""

from __future__ import annotations

import importlib
import inspect
import keyword
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

from . import registry
from .errors import PhxError
from .portcheck import _OPERATIONS, _SIZES, PLACEHOLDERS, TODO_TAG, required_operations, size_text  # noqa: F401
from .vendor import VendorRuntime, library_env_var

#: names a vendor cannot take: PHX_VENDOR's own words, and words that read as something else
RESERVED = frozenset(
    {
        "auto",
        "all",
        "none",
        "default",
        "any",
        "core",
        "kernel",
        "phoenix",
        "phx",
        "vendor",
        "vendors",
        "templates",
        "test",
        "tests",
        "cuda",
        "cudalike",
        "emulated",
        "emulator",
    }
)
# matched with fullmatch: `$` also matches before a trailing newline ("acme\n" is no name)
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LIBNAME = re.compile(r"lib[A-Za-z0-9_.+-]+\.so(\.[0-9.]+)?")
#: the longest vendor name: the kernel core refuses a backend whose name has 16 characters or
#: more (phx_core.c, phx_ops_valid: it names /dev/phx_<name><N> and fills a 16-byte field)
NAME_MAX = 15
#: shapes ``--like`` knows
LIKE = ("cuda",)
#: calls in a generated runtime.py that mark an operation still to fill


class ScaffoldError(PhxError, ValueError):
    """A request ``phx-port new`` refuses (a bad name or option, a target that exists)."""


# -- the contract, read from phoenix.vendor ---------------------------------------------


def _signature(fn) -> str:
    """``(self, size: int, device: int = 0) -> int`` as written in phoenix/vendor.py."""
    sig = inspect.signature(fn)
    parts = []
    for p in sig.parameters.values():
        text = p.name
        if p.annotation is not inspect.Parameter.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    ret = sig.return_annotation
    tail = (
        ""
        if ret is inspect.Signature.empty
        else f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    )
    return f"({', '.join(parts)}){tail}"


def _operations_for_template() -> list[dict]:
    out = []
    for name in required_operations()[1:]:
        fn = vars(VendorRuntime)[name]
        out.append({"name": name, "signature": _signature(fn), "doc": inspect.getdoc(fn) or ""})
    return out


# -- options ------------------------------------------------------------------------------


def validate_name_shape(name: str) -> None:
    """Refuse a vendor name that is not a lowercase identifier of at most :data:`NAME_MAX` characters."""
    if not _NAME.fullmatch(name or ""):
        raise ScaffoldError(
            f"vendor name {name!r}: use a lowercase Python identifier (a-z, 0-9, _; "
            "starting with a letter), e.g. 'acme'"
        )
    if len(name) > NAME_MAX:
        raise ScaffoldError(
            f"vendor name {name!r} has {len(name)} characters: at most {NAME_MAX} (the kernel core "
            f"refuses a longer backend name; it names phx_{name}.ko and /dev/phx_{name}0): choose a shorter one"
        )


def validate_name(name: str, existing: dict | None = None) -> None:
    """Refuse a vendor name that is not a lowercase identifier, is too long, is reserved, or is taken."""
    validate_name_shape(name)
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise ScaffoldError(f"vendor name {name!r} is a Python keyword")
    if name in RESERVED:
        raise ScaffoldError(f"vendor name {name!r} is reserved (reserved: {', '.join(sorted(RESERVED))})")
    existing = registry.discover() if existing is None else existing
    if name in existing:
        entry = existing[name]
        raise ScaffoldError(f"vendor {name!r} exists already ({entry.source}: {entry.location}); choose another name")


def parse_page_size(text) -> int:
    from .vendor import parse_size

    try:
        size = parse_size(text)
    except ValueError:
        raise ScaffoldError(f"--page-size {text!r} is not a size (e.g. 65536, 64K, 2M)") from None
    if size < 4096 or size & (size - 1):
        raise ScaffoldError(
            f"--page-size {text!r}: must be a power of two of at least 4096 (the kernel's "
            "PAGE_SIZE); 65536 on NVIDIA and MetaX"
        )
    return size


def parse_pci_vendor(text) -> int:
    try:
        value = int(str(text), 0)
    except ValueError:
        raise ScaffoldError(f"--pci-vendor {text!r}: give the PCI vendor id as 0xNNNN (lspci -nn)") from None
    if not 0 < value < 0xFFFF:
        raise ScaffoldError(f"--pci-vendor {text!r}: a PCI vendor id is 0x0001..0xfffe")
    return value


def _size_c(size: int) -> str:
    for sym, value in _SIZES.items():
        if value == size and sym != "SZ_1":
            return sym
    return f"{size:#x}UL"


# -- rendering ------------------------------------------------------------------------------


def templates_dir() -> str:
    """The templates: ``phoenix.templates`` (``templates/`` of the repository, in the package)."""
    try:
        mod = importlib.import_module("phoenix.templates")
        for path in getattr(mod, "__path__", []):
            if os.path.exists(os.path.join(path, "runtime.py.j2")):
                return path
    except ImportError:
        pass
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates")
    if os.path.exists(os.path.join(here, "runtime.py.j2")):
        return here
    raise ScaffoldError(
        "phoenix's templates (phoenix.templates: runtime.py.j2, p2p.c.j2) are missing from this installation"
    )


def in_tree_vendors_dir() -> str:
    """``vendors/`` of a phoenix checkout (an editable install); refuses an installed package's."""
    mod = importlib.import_module("phoenix.vendors")
    for path in getattr(mod, "__path__", []):
        top = os.path.dirname(os.path.abspath(path))
        if os.path.basename(path.rstrip(os.sep)) == "vendors" and os.path.exists(os.path.join(top, "setup.py")):
            return os.path.abspath(path)
    raise ScaffoldError(
        "this phoenix is an installed package, not a checkout: write the port elsewhere with "
        "--out DIR (an out-of-tree package) or --vendors-dir DIR (then PHX_VENDOR_PATH=DIR)"
    )


#: where a generated file records the command line that made it: p2p.c's /* */ comment,
#: runtime.py's docstring, pyproject.toml's # comment, README.md's code span
COMMENT_SYNTAX = ("c", "py", "toml", "md")


def comment_text(text: str, syntax: str) -> str:
    """``text`` as one line that cannot end the comment (or string) it is written into: control
    characters (a newline ends a # comment) as their escapes, and per ``syntax`` ``*/`` and ``/*``
    (a C comment), backslashes and quotes (a docstring), or a code span fenced past its backticks."""
    text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    if syntax == "c":  # `*/` first: after it no `*` is followed by `/`, so `/\*` cannot make one
        return text.replace("*/", "*\\/").replace("/*", "/\\*")
    if syntax == "py":
        return text.replace("\\", "\\\\").replace('"', '\\"')
    if syntax == "md":
        fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
        pad = " " if text.startswith("`") or text.endswith("`") else ""
        return f"{fence}{pad}{text}{pad}{fence}"
    if syntax == "toml":
        return text
    raise ValueError(f"comment syntax {syntax!r}: one of {', '.join(COMMENT_SYNTAX)}")


@dataclass
class NewPort:
    """What ``phx-port new`` was asked for."""

    name: str
    like: str | None = None
    prefix: str | None = None
    library: str | None = None
    pci_vendor: int | None = None
    page_size: int = 65536
    out: str | None = None  #: an out-of-tree package directory
    vendors_dir: str | None = None  #: the directory that gets <name>/ (default: this checkout's vendors/)
    command: str = ""

    def validate(self, existing: dict | None = None) -> None:
        validate_name(self.name, existing)
        if self.like is not None and self.like not in LIKE:
            raise ScaffoldError(f"--like {self.like!r}: the shapes known are {', '.join(LIKE)}")
        if self.like:
            if not self.prefix:
                raise ScaffoldError(
                    f"--like {self.like} needs --prefix: the runtime's symbol prefix "
                    "(mc for mcMalloc, hip for hipMalloc)"
                )
            if not self.library:
                raise ScaffoldError(
                    f"--like {self.like} needs --lib: the runtime library's file name (libmcruntime.so, libamdhip64.so)"
                )
        if self.prefix is not None and not self.like:
            raise ScaffoldError(
                f"--prefix {self.prefix!r} is the symbol prefix of a CUDA-shaped runtime: give --like cuda "
                "with it (a blank port, without --like, has no prefix)"
            )
        if self.prefix is not None and not _IDENT.fullmatch(self.prefix):
            raise ScaffoldError(f"--prefix {self.prefix!r} is not a C identifier")
        if self.library is not None and not _LIBNAME.fullmatch(self.library):
            raise ScaffoldError(f"--lib {self.library!r}: give the library's file name, lib<name>.so[.N]")
        for option, path in (("--out", self.out), ("--vendors-dir", self.vendors_dir)):
            if path is not None and not path.strip():
                raise ScaffoldError(f"{option} is empty: give a directory (or leave {option} out)")
        if self.out and self.vendors_dir:
            raise ScaffoldError("give --out (an out-of-tree package) or --vendors-dir, not both")
        parse_page_size(self.page_size)

    def context(self) -> dict:
        from . import __version__

        title = self.name.replace("_", " ").title().replace(" ", "")
        package = bool(self.out)
        module = f"phoenix_vendor_{self.name}"
        library = self.library or f"lib{self.name}.so"
        return {
            "name": self.name,
            "NAME": self.name.upper(),
            "name_pad": " " * (len(self.name) + 2),  # aligns under phx_<name>_get_pages( after 3 tabs
            "title": title,
            "like": self.like,
            "prefix": self.prefix or "",
            "library": library,
            "library_repr": repr(library),
            "library_env": library_env_var(self.name),
            "root_var": f"{self.name.upper()}_PATH",
            "default_root": f"/opt/{self.name}",
            "pci_vendor": self.pci_vendor or 0,
            "pci_vendor_hex": f"{self.pci_vendor or 0:#06x}",
            "page_size": self.page_size,
            "page_size_c": _size_c(self.page_size),
            "page_size_text": size_text(self.page_size),
            "ops": _operations_for_template(),
            "probe_doc": inspect.getdoc(VendorRuntime.probe) or "",
            # the command line, as each file's comment or docstring can hold it (the path options are free text)
            **{
                f"command_{syntax}": comment_text(self.command or f"phx-port new {self.name}", syntax)
                for syntax in COMMENT_SYNTAX
            },
            "phoenix_version": __version__,
            "package": package,
            "module": module,
            "dist": f"phoenix-vendor-{self.name.replace('_', '-')}",
            "vendor_dir": f"{module}/" if package else f"vendors/{self.name}/",
        }


def _environment():
    try:
        import jinja2
    except ImportError:
        raise ScaffoldError("phx-port new needs jinja2: pip install jinja2") from None
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(req: NewPort) -> dict[str, str]:
    """The files of the port, relative to the target directory, rendered in memory."""
    env = _environment()
    ctx = req.context()
    runtime = env.get_template("runtime_cudalike.py.j2" if req.like else "runtime.py.j2").render(ctx)
    files = {
        "runtime.py": runtime,
        "p2p.c": env.get_template("p2p.c.j2").render(ctx),
        "README.md": env.get_template("README.md.j2").render(ctx),
    }
    if req.out:
        mod = ctx["module"]
        files = {f"{mod}/{k}": v for k, v in files.items() if k != "README.md"}
        files[f"{mod}/__init__.py"] = env.get_template("package_init.py.j2").render(ctx)
        files["README.md"] = env.get_template("README.md.j2").render(ctx)
        files["pyproject.toml"] = env.get_template("pyproject.toml.j2").render(ctx)
    for path, text in files.items():  # a template bug must never reach a porter's disk
        if path.endswith(".py"):
            try:
                compile(text, path, "exec")
            except SyntaxError as exc:
                raise ScaffoldError(f"template bug: the rendered {path} does not compile: {exc}") from None
    return files


def target_dir(req: NewPort) -> str:
    if req.out:
        return os.path.abspath(req.out)
    return os.path.join(os.path.abspath(req.vendors_dir or in_tree_vendors_dir()), req.name)


def generate(req: NewPort, existing: dict | None = None) -> tuple[str, list[str]]:
    """Validate, render and write the port; return (target directory, files written).

    Writes nothing outside the target directory, never over an existing file: the
    files go to a fresh sibling directory that is renamed into place only when complete.
    """
    req.validate(existing)
    target = target_dir(req)
    if os.path.lexists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ScaffoldError(
            f"{target} exists already; phx-port new never overwrites: remove it or choose another place"
        )
    files = render(req)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=parent)
    try:
        for rel, text in files.items():
            path = os.path.join(stage, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
        os.chmod(stage, 0o755)
        if os.path.isdir(target):  # an empty directory (mkdir first): take its place
            os.rmdir(target)
        os.rename(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return target, [os.path.join(target, rel) for rel in sorted(files)]
