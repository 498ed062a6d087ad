"""The ``phoenix`` name clash: another distribution (arize-phoenix) that installs ``phoenix/`` too.

A stand-in distribution that owns ``phoenix/`` (a ``*.dist-info`` with a RECORD, and its files:
an ``__init__`` that needs a module absent here, as arize's needs pandas, and a
``phoenix/vendor/`` package that hides our ``vendor.py``) is installed into a temporary
site directory, in both orders:

- *after* ours: its ``__init__`` replaced ours. Only the console-script entry can explain
  (``import phoenix`` runs the stand-in's code, not ours, and fails its own way);
- *before* ours: ours replaced its ``__init__`` but its ``vendor/`` stayed. Both the entry and
  ``import phoenix`` explain, with the same paragraph.

The same two orders with the stand-in in a directory of its own, first or last on PYTHONPATH;
and without the stand-in (or with a distribution that owns no ``phoenix/``) nothing is reported.
Each case runs in a fresh interpreter: the check reads the installed distributions once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import _phx_entry
import phoenix

STAND_IN = "arize-phoenix-stand-in"
STAND_IN_VERSION = "9.9.9"
# ours, as installed here: the directories that hold the `phoenix` package and the entry module
OURS = list(dict.fromkeys([str(Path(phoenix.__file__).parent.parent), str(Path(_phx_entry.__file__).parent)]))

ENTRY = "import sys, _phx_entry; sys.exit(_phx_entry.{func}({argv!r}))"


def write_stand_in(site: Path, name: str = STAND_IN, package: str = "phoenix") -> None:
    """A distribution ``name`` whose files are ``<package>/__init__.py`` and ``<package>/vendor/__init__.py``."""
    files = {
        f"{package}/__init__.py": "import pandas_of_the_stand_in  # its own dependency, absent here (arize: pandas)\n",
        f"{package}/vendor/__init__.py": '"""The stand-in\'s own vendor package."""\n',
    }
    dist_info = f"{name.replace('-', '_')}-{STAND_IN_VERSION}.dist-info"
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {STAND_IN_VERSION}\n"
    files[f"{dist_info}/INSTALLER"] = "pip\n"
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    record = "".join(f"{rel},,\n" for rel in files) + f"{dist_info}/RECORD,,\n"
    (site / dist_info / "RECORD").write_text(record)


def install_ours(site: Path) -> None:
    """Copy our package and entry module into ``site``, over what is there (as pip would)."""
    shutil.copytree(
        Path(phoenix.__file__).parent,
        site / "phoenix",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy2(_phx_entry.__file__, site / "_phx_entry.py")


def python(code: str, path: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_explains(res: subprocess.CompletedProcess, prog: str) -> str:
    """Exit 2, nothing on stdout, and one paragraph that names both distributions and the fix."""
    assert res.returncode == 2, res
    assert res.stdout == "" and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    text = lines[0]
    assert text.startswith(f"{prog}: phoenix-direct-storage"), text
    for needle in (
        f"{STAND_IN} {STAND_IN_VERSION}",
        "cannot share an environment",
        "import package 'phoenix'",
        f"pip uninstall {STAND_IN}",
        "virtual environment",
    ):
        assert needle in text, (needle, text)
    return text.removeprefix(f"{prog}: ")


def assert_import_explains(res: subprocess.CompletedProcess, paragraph: str) -> None:
    assert res.returncode == 1, res
    assert f"ImportError: {paragraph}" in res.stderr, res.stderr
    assert "Probe" not in res.stderr, res.stderr  # not the symptom: the cause


@pytest.fixture
def site(tmp_path):
    (tmp_path / "site").mkdir()
    return tmp_path / "site"


@pytest.mark.parametrize("order", ["stand-in after ours", "stand-in before ours"])
def test_same_site_packages(site, order):
    """Both in one directory, as pip installs them into one site-packages."""
    if order == "stand-in after ours":
        install_ours(site)
        write_stand_in(site)
    else:
        write_stand_in(site)
        install_ours(site)
    path, cwd = [str(site)], site.parent
    check_entry_first = f"import _phx_entry; assert _phx_entry.__file__.startswith({str(site)!r}); "
    paragraph = assert_explains(python(check_entry_first + ENTRY.format(func="phx", argv=["info"]), path, cwd), "phx")
    assert_explains(python(ENTRY.format(func="phx_port", argv=["list"]), path, cwd), "phx-port")
    res = python("import phoenix", path, cwd)
    if order == "stand-in before ours":
        assert_import_explains(res, paragraph)
        # the stand-in reproduces the reported symptom where the check is not run
        bare = python("import sys; sys.modules['_phx_entry'] = None; import phoenix", path, cwd)
        assert "cannot import name" in bare.stderr and "phoenix.vendor" in bare.stderr, bare.stderr
        main = python("import runpy; runpy.run_module('phoenix', run_name='__main__')", path, cwd)  # python -m phoenix
        assert_import_explains(main, paragraph)
    else:  # the stand-in's __init__ is the one that runs: ours cannot speak (the console scripts do)
        assert res.returncode == 1 and "pandas_of_the_stand_in" in res.stderr, res.stderr


@pytest.mark.parametrize("first", [True, False], ids=["stand-in first on the path", "stand-in last on the path"])
def test_separate_directories(tmp_path, site, first):
    """The stand-in in a directory of its own, before or after ours on the import path."""
    write_stand_in(site)
    path = [str(site), *OURS] if first else [*OURS, str(site)]
    paragraph = assert_explains(python(ENTRY.format(func="phx", argv=["info"]), path, tmp_path), "phx")
    res = python("import phoenix", path, tmp_path)
    if first:  # its `phoenix` wins the import
        assert res.returncode == 1 and "pandas_of_the_stand_in" in res.stderr, res.stderr
    else:
        assert_import_explains(res, paragraph)


def test_no_clash_reports_nothing(tmp_path, site):
    """Without the stand-in (and beside a distribution that owns only its own package) all is quiet."""
    write_stand_in(site, name="unrelated-dist", package="unrelated")
    for path in (OURS, [*OURS, str(site)]):
        res = python(ENTRY.format(func="phx", argv=["info"]), path, tmp_path)
        assert res.returncode == 0, res.stderr
        assert "cannot share" not in res.stdout + res.stderr and "WARNING" not in res.stdout, res.stdout
        res = python("import _phx_entry, phoenix; print(_phx_entry.clashes(), 'open' in dir(phoenix))", path, tmp_path)
        assert res.returncode == 0 and res.stdout.split() == ["()", "True"], res


def test_message_names_every_other_distribution():
    text = _phx_entry.clash_message((("arize-phoenix", "11.0.0"), ("other-phoenix", "1.0")))
    assert "arize-phoenix 11.0.0 and other-phoenix 1.0" in text
    assert "pip uninstall arize-phoenix other-phoenix" in text
    assert "pip install --force-reinstall --no-deps phoenix-direct-storage" in text
    assert "\n" not in text
    assert _phx_entry.clash_message(()) is None


def test_dist_info_shapes(tmp_path):
    """Ownership is read from RECORD, else top_level.txt, else the egg-info file list."""
    import importlib.metadata as md

    def dist(files: dict[str, str]) -> md.Distribution:
        d = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        for rel, text in files.items():
            (d / rel).write_text(textwrap.dedent(text))
        return md.PathDistribution(d)

    assert _phx_entry._owns_package(dist({"RECORD": "phoenix/__init__.py,,\nx.py,,\n"}))
    assert _phx_entry._owns_package(dist({"RECORD": 'x.py,,\n"phoenix/a,b.py",,\n'}))
    assert not _phx_entry._owns_package(dist({"RECORD": "phoenixx/__init__.py,,\nsub/phoenix/x.py,,\n"}))
    assert _phx_entry._owns_package(dist({"top_level.txt": "phoenix\n"}))
    assert _phx_entry._owns_package(dist({"SOURCES.txt": "setup.py\nphoenix/__init__.py\n"}))
    assert not _phx_entry._owns_package(dist({"SOURCES.txt": "setup.py\nother/__init__.py\n"}))
    assert _phx_entry._owns_package(dist({"PKG-INFO": "Metadata-Version: 2.1\nName: arize_phoenix\nVersion: 1\n"}))
