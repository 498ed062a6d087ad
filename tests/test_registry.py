"""Vendor discovery and selection (phoenix/registry.py): found, never listed.

Vendors made up for a test live in a temporary directory put on PHX_VENDOR_PATH;
adding one edits nothing else, which is the point.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phoenix import registry
from phoenix.errors import UnknownVendorError, VendorUnavailable

BROKEN_DIR = Path(__file__).resolve().parent / "broken_vendors"


def phx_port_command() -> list[str]:
    """The installed ``phx-port`` script, else the same entry point without the cwd on sys.path.

    (``python -m`` from a source checkout would import the source tree, not the installed package.)
    """
    script = shutil.which("phx-port", path=os.path.dirname(sys.executable))
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; del sys.path[0]; from phoenix.cli.port import main; sys.exit(main())"]


BOOM = """
    raise RuntimeError("boom: this vendor is broken on purpose")
"""

UNUSABLE = """
    from phoenix.vendor import Probe, VendorRuntime

    class Runtime(VendorRuntime):
        name = "unusable"
        auto_priority = 10  # a candidate for auto: probed, and its reason recorded

        @classmethod
        def probe(cls):
            return Probe(False, "no device node /dev/fake0")
"""

PROBE_RAISES = """
    from phoenix.vendor import VendorRuntime

    class Runtime(VendorRuntime):
        name = "probe_raises"
        auto_priority = 10

        @classmethod
        def probe(cls):
            raise OSError("cannot open /dev/fake1")
"""

FAKE_ACCEL = """
    from phoenix.vendor import Probe, VendorRuntime

    class Runtime(VendorRuntime):
        name = "fakeaccel"
        auto_priority = 10

        @classmethod
        def probe(cls):
            return Probe(True, "one fake accelerator found")
"""

NO_CLASS = """
    RUNTIME = None  # forgot the Runtime class
"""


def make_vendors(root: Path, **vendors: str) -> Path:
    for name, body in vendors.items():
        (root / name).mkdir(parents=True)
        (root / name / "runtime.py").write_text(textwrap.dedent(body))
    return root


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv("PHX_VENDOR_PATH", raising=False)
    monkeypatch.delenv("PHX_VENDOR", raising=False)
    registry.reset()
    yield
    registry.reset()


def in_tree_names() -> list[str]:
    import phoenix.vendors

    names = set()
    for root in phoenix.vendors.__path__:
        for name in os.listdir(root):
            if os.path.exists(os.path.join(root, name, "runtime.py")):
                names.add(name)
    return sorted(names)


# -- discovery -------------------------------------------------------------------------


def test_in_tree_vendors_discovered():
    found = registry.discover()
    expected = in_tree_names()
    assert "host" in expected
    for name in expected:
        assert name in found, f"in-tree vendor {name} not discovered"
        assert found[name].source == "in-tree"
        assert found[name].location == f"phoenix.vendors.{name}.runtime"


def test_host_vendor_loads_and_serves():
    entry = registry.discover()["host"]
    cls = entry.load()
    assert cls is not None, entry.error
    assert cls.name == "host" and entry.is_test_double
    probe = entry.probe()
    assert probe.usable, probe.reason


def test_discovery_is_lazy(tmp_path, monkeypatch):
    """discover() imports nothing: a broken vendor costs nothing until it is asked for."""
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, boom=BOOM)))
    entry = registry.discover()["boom"]
    assert not entry._loaded
    assert entry.error  # now it is loaded, and fails


def test_vendor_path_vendors_discovered(tmp_path, monkeypatch):
    make_vendors(tmp_path / "a", fakeaccel=FAKE_ACCEL)
    make_vendors(tmp_path / "b", unusable=UNUSABLE)
    monkeypatch.setenv(
        "PHX_VENDOR_PATH", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "missing"), str(tmp_path / "b")])
    )
    found = registry.discover()
    assert found["fakeaccel"].source == f"PHX_VENDOR_PATH ({tmp_path / 'a'})"
    assert found["unusable"].source == f"PHX_VENDOR_PATH ({tmp_path / 'b'})"
    assert found["fakeaccel"].load().name == "fakeaccel"
    assert "host" in found


def test_in_tree_vendor_wins_over_vendor_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, host=FAKE_ACCEL)))
    assert registry.discover()["host"].source == "in-tree"


def test_entry_point_vendor(tmp_path, monkeypatch):
    pkg = tmp_path / "phx_ep_vendor"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime.py").write_text(textwrap.dedent(FAKE_ACCEL).replace('"fakeaccel"', '"epaccel"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        importlib.metadata.EntryPoint("epaccel", "phx_ep_vendor.runtime", "phoenix.vendors"),
        importlib.metadata.EntryPoint("epaccel2", "phx_ep_vendor.runtime:Runtime", "phoenix.vendors"),
    ]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        registry.importlib.metadata,
        "entry_points",
        lambda **kw: eps if kw.get("group") == "phoenix.vendors" else real(**kw),
    )
    found = registry.discover()
    for name in ("epaccel", "epaccel2"):
        assert found[name].source.startswith("entry point"), found[name].source
        assert found[name].load() is not None, found[name].error
        assert found[name].load().name == "epaccel"


# -- a vendor that fails to import -------------------------------------------------------


def test_import_error_reported_and_isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, boom=BOOM)))
    found = registry.discover()
    boom = found["boom"]
    assert boom.load() is None
    assert "RuntimeError" in boom.error and "broken on purpose" in boom.error
    assert "runtime.py" in boom.error  # where it failed
    assert not boom.probe().usable and "broken on purpose" in boom.probe().reason
    # the others are untouched
    sel = registry.select("host", found)
    assert sel.name == "host"
    assert registry.get_runtime("host").name == "host"


EXITS = """
    import sys

    sys.exit("no device here")
"""


def test_a_vendor_that_exits_at_import_is_an_import_failure(tmp_path, monkeypatch):
    """sys.exit() in a vendor's module is that vendor's import failure, not the process ending."""
    from phoenix import portcheck

    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, exits=EXITS)))
    found = registry.discover()
    entry = found["exits"]
    assert entry.load() is None
    assert "sys.exit('no device here')" in entry.error, entry.error
    assert entry.error.endswith(f"({tmp_path / 'exits' / 'runtime.py'}:4)"), entry.error
    assert not entry.probe().usable
    with pytest.raises(VendorUnavailable, match="sys.exit"):
        registry.select("exits")
    sel = registry.select("auto", found)  # the others are untouched
    assert "sys.exit" in sel.skipped["exits"]
    rep = portcheck.check("exits", compile_kernel=False)
    (imp,) = [f for f in rep.findings if f.topic == "import"]
    assert imp.level == "error" and "sys.exit('no device here')" in imp.message and imp.line == 4, imp


FAILS_IN_A_LIBRARY = """
    import json

    SETTINGS = json.loads("{not json")
"""

FAILS_IN_A_HELPER = """
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "helper_of_this_vendor.py")
    spec = importlib.util.spec_from_file_location("helper_of_this_vendor", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""


def test_import_failure_names_the_vendors_own_line(tmp_path, monkeypatch):
    """The place of an import failure is the vendor's file and line, not phoenix's importer,
    importlib's or a library's frame."""
    make_vendors(
        tmp_path, inlib=FAILS_IN_A_LIBRARY, syntax="x = 1\ndef (:\n", missing="x = 1\nimport no_such_module_q\n"
    )
    make_vendors(tmp_path, helper=FAILS_IN_A_HELPER)
    (tmp_path / "helper" / "helper_of_this_vendor.py").write_text("x = 1\n\nraise OSError('no /dev/acme0')\n")
    monkeypatch.setenv("PHX_VENDOR_PATH", str(tmp_path))
    found = registry.discover()
    expect = {"inlib": ("runtime.py", 4), "syntax": ("runtime.py", 2), "missing": ("runtime.py", 2)}
    expect["helper"] = ("helper_of_this_vendor.py", 3)
    for name, (file, line) in expect.items():
        error = found[name].error
        assert error.endswith(f"({tmp_path / name / file}:{line})"), (name, error)
        assert "registry.py" not in error and "importlib" not in error, error


def test_selecting_the_broken_vendor_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, boom=BOOM)))
    with pytest.raises(VendorUnavailable, match="broken on purpose"):
        registry.select("boom")


def test_missing_runtime_class_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, noclass=NO_CLASS)))
    entry = registry.discover()["noclass"]
    assert entry.load() is None
    assert "no Runtime class" in entry.error


def test_probe_that_raises_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, probe_raises=PROBE_RAISES)))
    probe = registry.discover()["probe_raises"].probe()
    assert not probe.usable and "OSError" in probe.reason and "/dev/fake1" in probe.reason


def test_phx_port_list_shows_import_error(tmp_path):
    env = dict(os.environ, PHX_VENDOR_PATH=str(make_vendors(tmp_path, boom=BOOM, unusable=UNUSABLE)))
    proc = subprocess.run([*phx_port_command(), "list"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert "import error" in rows["boom"] and "broken on purpose" in rows["boom"]
    assert "no device node /dev/fake0" in rows["unusable"]
    assert "yes" in rows["host"]

    proc = subprocess.run([*phx_port_command(), "list", "--json"], env=env, capture_output=True, text=True, timeout=120)
    listed = {r["vendor"]: r for r in json.loads(proc.stdout)}
    assert listed["boom"]["available"] is False and "broken on purpose" in listed["boom"]["reason"]
    assert listed["host"]["available"] is True and listed["host"]["test_double"] is True


# -- selection ------------------------------------------------------------------------


def test_unknown_vendor_lists_installed(monkeypatch):
    monkeypatch.setenv("PHX_VENDOR", "nosuch")
    with pytest.raises(UnknownVendorError) as info:
        registry.select()
    assert info.value.requested == "nosuch"
    assert "host" in info.value.installed
    assert "host" in str(info.value) and "nosuch" in str(info.value)
    with pytest.raises(UnknownVendorError):
        registry.get_runtime()


def test_auto_falls_back_to_host_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "PHX_VENDOR_PATH", str(make_vendors(tmp_path, boom=BOOM, unusable=UNUSABLE, probe_raises=PROBE_RAISES))
    )
    found = registry.discover()
    real = [n for n in in_tree_names() if n != "host" and found[n].probe().usable]
    if real:
        pytest.skip(f"a real accelerator vendor is usable here ({real}): auto picks it, not host")
    sel = registry.select("auto")
    assert sel.name == "host" and sel.requested == "auto"
    assert "fell back" in sel.reason
    assert set(sel.skipped) == set(found) - {"host"}, "auto must say why it skipped every other vendor"
    assert "broken on purpose" in sel.skipped["boom"]
    assert sel.skipped["unusable"] == "no device node /dev/fake0"
    assert "/dev/fake1" in sel.skipped["probe_raises"]
    for name in in_tree_names():
        if name != "host":
            assert sel.skipped[name], f"no reason recorded for skipping {name}"


HOST_UNUSABLE = """
    from phoenix.vendor import Probe, VendorRuntime

    class Runtime(VendorRuntime):
        name = "host"
        is_test_double = True

        @classmethod
        def probe(cls):
            return Probe(False, "no host device (PHX_HOST_DEVICES=0)")
"""


def test_auto_fails_with_a_reason_where_the_fallback_cannot_serve(tmp_path, monkeypatch):
    """auto with no accelerator vendor usable and a host fallback whose probe says no: select()
    raises VendorUnavailable naming both (it chose host, whose runtime then failed to start)."""
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, unusable=UNUSABLE)))
    found = registry.discover()
    real = [n for n, e in found.items() if n != "host" and e.probe().usable and registry.auto_priority(e) > 0]
    if real:
        pytest.skip(f"a real accelerator vendor is usable here ({real}): auto picks it")
    path = make_vendors(tmp_path / "fallback", host=HOST_UNUSABLE) / "host" / "runtime.py"
    found["host"] = registry.VendorEntry("host", "test", str(path), registry._file_loader("host", str(path)))
    with pytest.raises(VendorUnavailable) as exc:
        registry.select("auto", found)
    msg = str(exc.value)
    assert "PHX_VENDOR=auto" in msg and "the fallback 'host' cannot" in msg, msg
    assert msg.endswith("cannot: no host device (PHX_HOST_DEVICES=0)") and "unusable" in msg, msg


def test_auto_is_the_default(monkeypatch):
    assert registry.select().requested == "auto"


def test_auto_never_picks_a_test_double(monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(BROKEN_DIR))
    sel = registry.select("auto")
    assert sel.skipped["short_copy"].startswith("test double")


def test_auto_prefers_a_usable_accelerator(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_VENDOR_PATH", str(make_vendors(tmp_path, fakeaccel=FAKE_ACCEL, unusable=UNUSABLE)))
    found = registry.discover()
    real = [n for n, e in found.items() if n != "fakeaccel" and e.load() is not None and e.load().auto_priority > 10]
    if any(found[n].probe().usable for n in real):
        pytest.skip("a preferred real vendor is usable here and comes first")
    sel = registry.select("auto")
    assert sel.name == "fakeaccel" and "one fake accelerator found" in sel.reason


def test_select_by_env_and_in_code(monkeypatch):
    monkeypatch.setenv("PHX_VENDOR", "host")
    assert registry.select().name == "host"
    rt = registry.use_vendor("host")
    assert rt.name == "host" and os.environ["PHX_VENDOR"] == "host"
    assert registry.get_runtime() is rt  # one runtime per process while the choice stands
    assert registry.current_selection().name == "host"
