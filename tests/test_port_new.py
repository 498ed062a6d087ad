"""``phx-port new`` and ``phx-port check``: from scaffold to green, tested the way a porter works.

* a CUDA-shaped port with a new name and prefix (``acme``, ``acme*``, ``libacmert.so``),
  generated into a temporary directory, passes ``phx-port test acme --emulated`` without
  a file being edited;
* a blank port fails the suite, and the failures name every unimplemented operation
  with the ``file:line`` to fill; ``phx-port check`` lists the same lines;
* generation changes nothing outside its target directory (the repository's files are
  snapshotted before and after);
* an ``--out`` package, pip-installed (offline, ``--no-deps --no-build-isolation``), is
  found through its ``phoenix.vendors`` entry point.

Nothing is generated inside the repository: ports go to ``--vendors-dir`` / ``--out``
under pytest's temporary directories and are found through ``PHX_VENDOR_PATH``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from phoenix import emulator, portcheck, scaffold

REPO = Path(__file__).resolve().parent.parent
needs_cc = pytest.mark.skipif(emulator.compiler() is None, reason="no C compiler to build an emulator")


def phx_port(*args: str, env_extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed ``phx-port`` (not the source tree on the cwd), PHX_VENDOR left to it."""
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    cmd = (
        [script]
        if script
        else [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]
    )
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **(env_extra or {}))
    env.pop("PHX_VENDOR", None)
    # run outside the repository: nothing a command writes by default (phx-report/) can land in it
    return subprocess.run(
        [*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
    )


@pytest.fixture(scope="module")
def emu_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emulators"))


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    """A --vendors-dir with the CUDA-shaped port `acme` and the blank port `blanky`."""
    d = tmp_path_factory.mktemp("vendors")
    out = phx_port(
        "new",
        "acme",
        "--like",
        "cuda",
        "--prefix",
        "acme",
        "--lib",
        "libacmert.so",
        "--pci-vendor",
        "0x1eac",
        "--vendors-dir",
        str(d),
    )
    assert out.returncode == 0, out.stderr
    out = phx_port("new", "blanky", "--vendors-dir", str(d))
    assert out.returncode == 0, out.stderr
    return d


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, str]]:
    """(mtime, sha256) of every file under root, outside .git, __pycache__ and ``skip``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in (".git", "__pycache__", ".pytest_cache") and not (skip and Path(dirpath, d) == skip)
        ]
        for f in filenames:
            p = Path(dirpath, f)
            try:
                st = p.lstat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and st.st_size < (8 << 20) else ""
            except OSError:
                continue
            out[str(p.relative_to(root))] = (st.st_mtime_ns, digest)
    return out


# -- generation ---------------------------------------------------------------------------


def test_generated_files_import_and_compile(ports):
    for name in ("acme", "blanky"):
        d = ports / name
        assert sorted(p.name for p in d.iterdir()) == ["README.md", "p2p.c", "runtime.py"]
        spec = importlib.util.spec_from_file_location(f"gen_{name}", d / "runtime.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.Runtime.name == name and mod.Runtime.p2p_page_size == 65536
        size, line, _ = portcheck.kernel_page_size(str(d / "p2p.c"))
        assert size == 65536 and line
    acme = (ports / "acme" / "runtime.py").read_text()
    assert 'prefix = "acme"' in acme and 'library_roots = ("ACME_PATH",)' in acme and "PHX_ACME_LIBRARY" in acme
    assert "0x1eac" in (ports / "acme" / "p2p.c").read_text()


def _code_lines(path: Path) -> int:
    spec = importlib.util.spec_from_file_location("count_code_lines", REPO / "tools" / "count_code_lines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.code_lines(path.read_text())


def test_a_cuda_shaped_port_is_a_declaration(ports):
    """At most 60 lines of code (docstrings and comments not counted): the in-tree CUDA-shaped
    ports and what `phx-port new --like cuda` writes; everything else is phoenix.cudalike's."""
    files = [REPO / "vendors" / v / "runtime.py" for v in ("nvidia", "metax", "amd")] + [ports / "acme" / "runtime.py"]
    counts = {str(f): _code_lines(f) for f in files}
    assert all(n <= 60 for n in counts.values()), counts
    acme = ports / "acme" / "runtime.py"
    spec = importlib.util.spec_from_file_location("gen_acme_decl", acme)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    R = mod.Runtime
    assert (R.prefix, R.library_names, R.library_roots, R.default_root) == (
        "acme",
        ("libacmert.so",),
        ("ACME_PATH",),
        "/opt/acme",
    )
    assert R.library_env() == "PHX_ACME_LIBRARY" and R.auto_priority == 0
    assert set(vars(R)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__", "__static_attributes__"} <= {
        "name",
        "prefix",
        "library_names",
        "library_roots",
        "default_root",
        "p2p_page_size",
        "auto_priority",
        "host_register_read_only_flag",
        "runtime_title",
        "runtime_description",
    }, "data only, no code"


def test_operations_come_from_the_contract():
    ops = scaffold.required_operations()
    assert ops == list(portcheck._OPERATIONS), "the fallback list is stale: update portcheck._OPERATIONS"


def test_refusals(ports, tmp_path):
    cases = [
        (["new", "Acme"], "lowercase"),
        (["new", "9x"], "lowercase"),
        (["new", "class"], "keyword"),
        (["new", "auto"], "reserved"),
        (["new", "metax"], "exists already"),
        (["new", "zzz", "--like", "cuda", "--lib", "libz.so"], "needs --prefix"),
        (["new", "zzz", "--like", "cuda", "--prefix", "z"], "needs --lib"),
        (["new", "zzz", "--like", "cuda", "--prefix", "z-", "--lib", "libz.so"], "not a C identifier"),
        (["new", "zzz", "--page-size", "65000"], "power of two"),
        (["new", "zzz", "--page-size", "2048"], "at least 4096"),
        (["new", "zzz", "--pci-vendor", "nvidia"], "0xNNNN"),
        (["new", "acme", "--vendors-dir", str(ports)], "exists already"),
    ]
    env = {"PHX_VENDOR_PATH": str(ports)}
    for args, message in cases:
        out = (
            phx_port(*args, "--vendors-dir", str(tmp_path), env_extra=env)
            if "--vendors-dir" not in args
            else phx_port(*args, env_extra=env)
        )
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
    assert not list(tmp_path.iterdir()), "a refused request writes nothing"


@pytest.mark.parametrize(
    "args, words",
    [
        (["new", "a234567890123456"], ["'a234567890123456'", "16 characters", "at most 15"]),
        (["new", "acmenl\n"], ["'acmenl\\n'", "lowercase"]),
        (["new", "zzz", "--prefix", "z"], ["--prefix 'z'", "--like cuda"]),
        (["new", "zzz", "--pci-vendor", ""], ["--pci-vendor ''", "0xNNNN"]),
        (["new", "zzz", "--out", ""], ["--out is empty"]),
        (["new", "zzz", "--vendors-dir", ""], ["--vendors-dir is empty"]),
        (["new", "zzz", "--like", "cuda", "--prefix", "z\n", "--lib", "libz.so"], ["not a C identifier"]),
        (["new", "zzz", "--like", "cuda", "--prefix", "z", "--lib", "libz.so\n"], ["--lib", "lib<name>.so"]),
        (["check", "a234567890123456", "--dir", "."], ["16 characters", "at most 15"]),
        (["check", "host\n"], ["'host\\n'", "lowercase"]),
        (["check", "host", "--dir", ""], ["--dir is empty"]),
        (["check", "host", "--kdir", ""], ["--kdir is empty"]),
    ],
)
def test_names_paths_and_options_refused_before_any_work(tmp_path, monkeypatch, capsys, args, words):
    """A name the kernel would refuse, a name with a newline, an empty path (else the default, the
    checkout's vendors/), a prefix without --like, an empty --pci-vendor: one line, exit 2, nothing written."""
    from phoenix.cli import port

    vendors = REPO / "vendors"
    before = sorted(os.listdir(vendors)) if vendors.is_dir() else []
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PHX_DEBUG", raising=False)
    if args[0] == "new" and "--vendors-dir" not in args and "--out" not in args:
        args = [*args, "--vendors-dir", str(tmp_path / "v")]
    try:
        rc = port.main(args)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (rc, err)
        assert lines[0].startswith(f"phx-port {args[0]}: "), lines[0]
        for word in words:
            assert word in lines[0], (word, lines[0])
        assert not list(tmp_path.iterdir()), "a refused request writes nothing"
    finally:  # a port the old code wrote into the checkout is taken out again
        for made in set(os.listdir(vendors) if vendors.is_dir() else []) - set(before):
            shutil.rmtree(vendors / made)
            pytest.fail(f"written into the checkout: vendors/{made}")


def test_never_overwrites(tmp_path):
    (tmp_path / "acme2").mkdir()
    (tmp_path / "acme2" / "runtime.py").write_text("# mine\n")
    out = phx_port("new", "acme2", "--vendors-dir", str(tmp_path))
    assert out.returncode == 2 and "never overwrites" in out.stderr
    assert (tmp_path / "acme2" / "runtime.py").read_text() == "# mine\n"


def test_check_unknown_vendor_is_a_usage_error():
    out = phx_port("check", "nosuch")
    assert out.returncode == 2 and "no vendor 'nosuch' found" in out.stderr


def test_help_documents_every_option():
    out = phx_port("new", "--help")
    assert out.returncode == 0
    for opt in ("--like", "--prefix", "--lib", "--pci-vendor", "--page-size", "--out", "--vendors-dir", "--json"):
        assert opt in out.stdout, opt
    out = phx_port("check", "--help")
    assert out.returncode == 0 and "--kdir" in out.stdout and "--dir" in out.stdout


def test_generation_changes_nothing_outside_its_directory(tmp_path):
    target = tmp_path / "vendors"
    before = snapshot(REPO)
    out = phx_port(
        "new", "snapshot_port", "--like", "cuda", "--prefix", "snp", "--lib", "libsnp.so", "--vendors-dir", str(target)
    )
    assert out.returncode == 0, out.stderr
    out = phx_port("new", "snapshot_pkg", "--out", str(tmp_path / "pkg"))
    assert out.returncode == 0, out.stderr
    after = snapshot(REPO)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"phx-port new touched the repository: {changed[:10]}"
    assert sorted(os.listdir(target)) == ["snapshot_port"], "nothing but the port's own directory"
    assert sorted(os.listdir(tmp_path / "pkg")) == ["README.md", "phoenix_vendor_snapshot_pkg", "pyproject.toml"]


# -- from scaffold to green -----------------------------------------------------------------


@needs_cc
def test_cuda_shaped_port_passes_emulated_without_editing(ports, tmp_path, emu_cache):
    before = {p.name: p.read_bytes() for p in (ports / "acme").iterdir()}
    out = phx_port(
        "test",
        "acme",
        "--emulated",
        "-q",
        "--report-dir",
        str(tmp_path),
        env_extra={"PHX_VENDOR_PATH": str(ports), "PHX_EMULATOR_CACHE": emu_cache},
    )
    report = json.loads((tmp_path / "conformance-acme-emulated.json").read_text())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert report["result"] == "pass" and report["totals"]["failed"] == 0
    assert all(c["result"] in ("pass", "skip") for c in report["capabilities"])
    assert {c["capability"] for c in report["capabilities"] if c["result"] == "pass"} >= {
        "discovery",
        "memory",
        "host_registration",
        "copies",
        "streams",
        "host_callback",
        "stream_ordering",
        "pointer_queries",
        "data_path_table",
        "errors",
    }
    assert report["emulated"]["prefix"] == "acme" and report["emulated"]["library_name"] == "libacmert.so"
    assert "PHX_ACME_LIBRARY" in report["emulated"]["via"]
    assert report["is_test_double"]
    assert {p.name: p.read_bytes() for p in (ports / "acme").iterdir()} == before, "no generated file was edited"


def _placeholders(runtime_py: Path) -> dict[str, int]:
    """op -> line of its placeholder, read from the generated file."""
    found = {}
    for n, text in enumerate(runtime_py.read_text().splitlines(), 1):
        m = re.search(r'_fill_me\(self, "(\w+)"\)|return (_scaffold_probe)\(cls', text)
        if m:
            found[m.group(1) or "probe"] = n
    return found


def test_blank_port_fails_naming_each_operation(ports, tmp_path):
    runtime_py = ports / "blanky" / "runtime.py"
    todo = _placeholders(runtime_py)
    assert set(todo) == set(scaffold.required_operations())
    out = phx_port(
        "test",
        "blanky",
        "-q",
        "-k",
        "not 64mib",
        "--report-dir",
        str(tmp_path),
        env_extra={"PHX_VENDOR_PATH": str(ports)},
    )
    assert out.returncode == 1
    report = json.loads((tmp_path / "conformance-blanky.json").read_text())
    assert report["result"] == "fail"
    failed = [t["message"] for t in report["tests"] if t["outcome"] == "failed"]
    assert failed
    # every failure is an unimplemented operation, never a crash or an unrelated error
    assert all("VendorNotImplemented" in m for m in failed), [m for m in failed if "VendorNotImplemented" not in m][:3]
    first = {}  # op -> line, where a test failed on the op itself
    listed = {}  # op -> line, from the "still to fill" list every failure carries
    for m in failed:
        for op, path, line in re.findall(r"does not implement (\w+)\(\): fill it in (\S+?):(\d+)", m):
            assert path == str(runtime_py)
            first[op] = int(line)
        for op, line in re.findall(r"(\w+)\(\) at line (\d+)", m):
            listed[op] = int(line)
    ops = set(scaffold.required_operations())
    assert {**listed, **first} == {op: todo[op] for op in ops}, "each operation named with its line"
    # most are failed by a test of their own; the rest sit behind one of those
    assert len(first) >= len(ops) // 2
    assert {"devices", "device_alloc", "memcpy", "stream_create", "pointer_info", "data_path"} <= set(first)


def test_check_lists_the_same_lines(ports):
    out = phx_port("check", "blanky", "--json", env_extra={"PHX_VENDOR_PATH": str(ports)})
    assert out.returncode == 1
    rep = json.loads(out.stdout)
    todo = _placeholders(ports / "blanky" / "runtime.py")
    ops = {
        re.match(r"(\w+)\(\)", f["message"]).group(1): f["line"]
        for f in rep["findings"]
        if f["topic"] == "operations" and f["level"] == "todo"
    }
    assert ops == todo
    kernel = {f["message"].split()[0] for f in rep["findings"] if f["topic"] == "kernel side"}
    assert kernel == {"pci_vendor", "init", "get_pages", "put_pages"}
    page = [f for f in rep["findings"] if f["topic"] == "page size"]
    assert page and page[0]["level"] == "ok"


def test_check_cuda_shaped_port(ports):
    out = phx_port("check", "acme", "--json", "--kdir", "none", env_extra={"PHX_VENDOR_PATH": str(ports)})
    rep = json.loads(out.stdout)
    by = {}
    for f in rep["findings"]:
        by.setdefault(f["topic"], []).append(f)
    assert [f["level"] for f in by["operations"]] == ["ok"]
    assert by["page size"][0]["level"] == "ok"
    assert by["kernel build"][0]["level"] in ("ok", "skip"), by["kernel build"]
    assert by["prototype table"][0]["level"] == "skip", "no libacmert.so on this machine"
    # the kernel side is a skeleton: its three places to fill (pci_vendor was given)
    assert sorted(f["message"].split()[0] for f in by["kernel side"]) == ["get_pages", "init", "put_pages"]


@needs_cc
def test_check_resolves_the_table_against_a_library(ports, emu_cache):
    emu = emulator.build("acme", "libacmert.so", cache=emu_cache)
    out = phx_port(
        "check",
        "acme",
        "--json",
        "--no-kernel-build",
        env_extra={"PHX_VENDOR_PATH": str(ports), "PHX_ACME_LIBRARY": emu.library},
    )
    rep = json.loads(out.stdout)
    table = [f for f in rep["findings"] if f["topic"] == "prototype table"]
    assert table[0]["level"] == "ok" and emu.library in table[0]["message"]


def test_check_catches_a_page_size_mismatch(ports, tmp_path):
    d = tmp_path / "mism"
    shutil.copytree(ports / "acme", d)
    text = (d / "p2p.c").read_text().replace("SZ_64K", "SZ_2M", 1)
    (d / "p2p.c").write_text(text)
    rep = portcheck.check("acme", directory=str(d), compile_kernel=False)
    bad = [f for f in rep.findings if f.topic == "page size"]
    assert bad and bad[0].level == "error" and "2097152" in bad[0].message and "65536" in bad[0].message
    assert bad[0].path == str(d / "p2p.c") and bad[0].line


def test_check_refuses_a_third_code_file(ports, tmp_path):
    """Two files make a port (DESIGN.md): a third .py, .c or .h in its directory is an error
    naming it; a README, an __init__.py and other files are not."""
    d = tmp_path / "acme"
    shutil.copytree(ports / "acme", d)
    for extra in ("helper.py", "extra.c", "util.h", "__init__.py", "notes.txt"):
        (d / extra).write_bytes(os.urandom(32).hex().encode())
    (d / "sub.py").mkdir()  # a directory, not a file of the port
    rep = portcheck.check("acme", directory=str(d), compile_kernel=False)
    third = [f for f in rep.findings if f.topic == "files" and f.level == "error"]
    assert [f.path for f in third] == [str(d / n) for n in ("extra.c", "helper.py", "util.h")], third
    assert all("a port is two files" in f.message for f in third) and rep.failed
    out = phx_port("check", "acme", "--dir", str(d), "--no-kernel-build")
    assert out.returncode == 1 and f"{d / 'helper.py'}: error: [files]" in out.stdout, out.stdout + out.stderr
    for f in ("extra.c", "helper.py", "util.h"):
        (d / f).unlink()
    rep = portcheck.check("acme", directory=str(d), compile_kernel=False)
    assert [f.level for f in rep.findings if f.topic == "files"] == ["ok"]


def test_check_refuses_a_kdir_that_is_not_a_kernel_tree(ports, tmp_path):
    """--kdir is validated before kernel/ is looked for, so the refusal is the same in a checkout
    and in an installed package (which has no kernel/ and skips the build)."""
    not_tree = tmp_path / "notkernel"
    not_tree.mkdir()
    (not_tree / "Makefile").write_bytes(os.urandom(64))  # a Makefile alone is not a build tree
    env = {"PHX_VENDOR_PATH": str(ports)}
    for kdir, words in ((not_tree, ["not a kernel build tree", "include/"]), (tmp_path / "nosuch", ["does not exist"])):
        out = phx_port("check", "acme", "--kdir", str(kdir), env_extra=env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
        assert lines[0].startswith(f"phx-port check: --kdir {kdir}") and all(w in lines[0] for w in words), lines[0]
    f = portcheck.compile_kernel_file("acme", str(ports / "acme" / "p2p.c"), kdir=str(not_tree))
    assert f.level == "error" and "not a kernel build tree" in f.message, f
    tree = tmp_path / "tree"
    (tree / "include").mkdir(parents=True)
    (tree / "Makefile").write_text("all:\n")
    assert portcheck.kdir_problem(str(tree)) is None and portcheck.kdir_problem("none") is None


def test_check_kernel_build_reports_lines(ports, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(ports / "acme", d)
    lines = (d / "p2p.c").read_text().splitlines()
    i = next(n for n, ln in enumerate(lines) if "return t->n;" in ln)
    lines[i] = "\treturn t->n_pages_misspelled;"
    (d / "p2p.c").write_text("\n".join(lines) + "\n")
    f = portcheck.compile_kernel_file("acme", str(d / "p2p.c"), kdir="none")
    if f.level == "skip":
        pytest.skip(f.message)
    assert f.level == "error" and f"{d / 'p2p.c'}:{i + 1}:" in f.message


def _new_in_process(*argv: str) -> None:
    from phoenix.cli import port

    assert port.main(["new", *argv]) == 0


def _stub_syntax_check(name: str, p2p: Path) -> None:
    """p2p.c against phoenix's stub kernel headers (-Wall -Werror), where kernel/ and gcc are here."""
    f = portcheck.compile_kernel_file(name, str(p2p), kdir="none")
    if f.level != "skip":
        assert f.level == "ok", f.message


def test_kernel_file_names_are_the_ports_own(tmp_path):
    """Every name p2p.c defines is phx_<name>_* (PHX_<NAME>_* for macros): a port named after a
    kernel name (kref: kref_init) or a driver's symbol prefix does not redefine it."""
    _new_in_process("kref", "--vendors-dir", str(tmp_path))
    text = (tmp_path / "kref" / "p2p.c").read_text()
    defined = re.findall(r"^static\b[^(=;\[]*?\b(\w+)\s*[(=;\[]", text, re.M)
    macros = [m for m in re.findall(r"^#define\s+(\w+)", text, re.M) if m != "pr_fmt"]
    assert len(defined) >= 15 and len(macros) >= 3, (defined, macros)
    assert [d for d in defined if not d.startswith("phx_kref_")] == []
    assert [m for m in macros if not m.startswith("PHX_KREF_")] == []
    assert not re.search(r"(?<![\w])kref_(?!p2p_pin_memory)\w*\s*\(", text.replace("phx_kref_", "")), "a kref_* call"
    _stub_syntax_check("kref", tmp_path / "kref" / "p2p.c")


def test_generated_files_keep_the_command_line_inside_their_comments(tmp_path):
    """A path with ``*/``, ``/*``, a newline, backticks, quotes and a backslash, recorded in each
    file's comment or docstring, stays inside it: p2p.c's header comment, runtime.py's docstring,
    pyproject.toml's # line, README.md's code span."""
    import ast
    import shlex

    evil = tmp_path / "a*" / 'n\nl`x"""\\N{/*'
    cases = [
        ("evil", ["--like", "cuda", "--prefix", "ev", "--lib", "libev.so", "--vendors-dir", str(evil)], evil / "evil"),
        ("evilpkg", ["--out", str(evil / "pkg")], evil / "pkg" / "phoenix_vendor_evilpkg"),
    ]
    lines = {}
    for name, argv, where in cases:
        _new_in_process(name, *argv)
        line = lines[name] = scaffold.comment_text("phx-port " + shlex.join(["new", name, *argv]), "toml")
        assert "\n" not in line and "*/" in line and "\\n" in line
        p2p = (where / "p2p.c").read_text()
        header = p2p[p2p.index("/*") : p2p.index("*/")]
        assert "Generated by" in header and "(phoenix " in header, header
        assert scaffold.comment_text(line, "c") in header
        doc = ast.get_docstring(ast.parse((where / "runtime.py").read_text()))
        assert f"Generated by ``{line}``" in doc
        _stub_syntax_check(name, where / "p2p.c")
    (gen,) = [ln for ln in (evil / "evil" / "README.md").read_text().splitlines() if ln.startswith("Generated by")]
    assert gen.startswith(f"Generated by {scaffold.comment_text(lines['evil'], 'md')} (phoenix "), gen
    toml = (evil / "pkg" / "pyproject.toml").read_text().splitlines()
    head = toml[: next(i for i, ln in enumerate(toml) if ln.startswith("[build-system]"))]
    assert all(ln.startswith("#") or not ln.strip() for ln in head), head
    assert lines["evilpkg"] in head[0]
    try:
        import tomllib
    except ImportError:
        return
    assert tomllib.loads("\n".join(toml))["project"]["name"] == "phoenix-vendor-evilpkg"


def test_comment_text():
    c = scaffold.comment_text
    assert c("a*/b/*c*/*/", "c") == "a*\\/b/\\*c*\\/\\*\\/" and "*/" not in c("*/*/**//", "c")
    assert "/*" not in c("*/*/**//", "c") and c("x\ny\tz", "toml") == "x\\ny\\tz"
    assert (
        c('a\\N{"""', "py") == 'a\\\\N{\\"\\"\\"' and eval(f'"""{c(chr(92) + "N" + chr(34) * 3, "py")}"""') == '\\N"""'
    )
    assert c("a`b``c", "md") == "```a`b``c```" and c("`a", "md") == "`` `a ``"


def test_different_page_size_is_written_on_both_sides(tmp_path):
    out = phx_port("new", "bigpage", "--page-size", "2M", "--vendors-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "p2p_page_size = 2097152" in (tmp_path / "bigpage" / "runtime.py").read_text()
    assert portcheck.kernel_page_size(str(tmp_path / "bigpage" / "p2p.c"))[0] == 2097152


# -- out of tree ------------------------------------------------------------------------------


def _can_build_offline() -> str | None:
    """Why an offline ``--no-build-isolation`` install cannot work here (None: it can)."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed: an offline --no-build-isolation install needs it"
    import setuptools

    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {setuptools.__version__} builds wheels only with the `wheel` package, not installed"
    return None


def test_out_package_is_found_through_its_entry_point(tmp_path):
    why = _can_build_offline()
    if why:
        pytest.skip(why)
    pkg = tmp_path / "phoenix-vendor-acmeout"
    out = phx_port("new", "acmeout", "--like", "cuda", "--prefix", "acmeo", "--lib", "libacmeo.so", "--out", str(pkg))
    assert out.returncode == 0, out.stderr
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(pkg),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (target / "phoenix_vendor_acmeout" / "p2p.c").exists(), "the kernel file ships in the package"
    env = {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = phx_port("list", "--json", env_extra=env)
    assert out.returncode == 0, out.stderr
    rows = {r["vendor"]: r for r in json.loads(out.stdout)}
    assert "acmeout" in rows, rows
    assert rows["acmeout"]["source"].startswith("entry point")
    assert rows["acmeout"]["location"] == "phoenix_vendor_acmeout.runtime:Runtime"
    assert "libacmeo.so not found" in rows["acmeout"]["reason"]  # imported and probed, no runtime here
    out = phx_port("check", "acmeout", "--json", "--no-kernel-build", env_extra=env)
    rep = json.loads(out.stdout)
    assert rep["directory"] == str(target / "phoenix_vendor_acmeout")
    assert [f["level"] for f in rep["findings"] if f["topic"] == "operations"] == ["ok"]
