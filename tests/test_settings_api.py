"""The package's documented calls work as written: submodules reachable from ``import phoenix``,
``settings.override()`` with and without ``with``, settings errors that say the range.

Test side. Each submodule is looked up in a fresh interpreter (one that imported nothing
of phoenix's but the package), so that no other test's import makes it pass.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phoenix.settings as ps

PACKAGE = Path(ps.__file__).resolve().parent
#: the README's and the docstrings' names: the derived list must hold them
DOCUMENTED = {"io", "settings", "phxloader", "phxfile", "kmod", "registry", "vendor", "buffers", "streams", "errors"}
SUBMODULES = sorted(
    {m.name for m in pkgutil.iter_modules([str(PACKAGE)]) if not m.name.startswith("_")} | {"vendors", "templates"}
)


def run_python(code: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---- submodules after `import phoenix` ------------------------------------------------------


def test_the_derived_list_holds_the_documented_names():
    assert DOCUMENTED <= set(SUBMODULES), DOCUMENTED - set(SUBMODULES)


@pytest.mark.parametrize("name", SUBMODULES)
def test_a_submodule_is_an_attribute_after_import_phoenix(name):
    p = run_python(f"""
        import sys
        import phoenix
        assert {name!r} in dir(phoenix) or {name!r} in ("vendors", "templates"), dir(phoenix)
        module = getattr(phoenix, {name!r})
        assert module is sys.modules["phoenix.{name}"], module
    """)
    assert p.returncode == 0, p.stderr


def test_the_readmes_calls_work_after_import_phoenix_alone():
    """README: an engine calls ``phoenix.io.prepare()`` first; ``stats()``, ``fmap_clear()``."""
    p = run_python("""
        import sys
        import phoenix
        assert "phoenix.io" not in sys.modules  # still lazy: the C core loads at first use
        phoenix.io.prepare()
        assert "fmap_windows" in phoenix.io.stats()
        phoenix.io.fmap_clear()
        phoenix.io.shutdown()
        with phoenix.settings.override(threads=4):
            assert phoenix.settings.get().threads == 4
        assert phoenix.kmod.status() is not None
    """)
    assert p.returncode == 0, p.stderr


def test_what_is_no_module_is_no_attribute():
    p = run_python("""
        import phoenix
        for name in ("csrc", "lib", "nosuch", "_phxcore", "__main__", "not-a-name"):
            assert not hasattr(phoenix, name), name
        try:
            phoenix.nosuch
        except AttributeError as exc:
            assert str(exc) == "module 'phoenix' has no attribute 'nosuch'", exc
    """)
    assert p.returncode == 0, p.stderr


def test_where_the_core_cannot_load_the_rest_still_works():
    """The submodules that need no C core (settings, kmod, registry) stay reachable; phoenix.io
    says why it cannot load, rather than 'no attribute'."""
    p = run_python("""
        import sys
        import phoenix._core as core

        def not_built():
            raise ImportError("phoenix's C core (phoenix._phxcore) is not built")

        core.core_path = not_built
        import phoenix
        phoenix.settings.get()
        phoenix.kmod.status()
        phoenix.registry.discover()
        try:
            phoenix.io.stats()
        except AttributeError as exc:
            sys.exit(f"AttributeError: {exc}")
        except Exception as exc:
            assert "not built" in str(exc), exc
        from phoenix.cli.phx import main
        sys.exit(main(["info"]) not in (0, 1))
    """)
    assert p.returncode == 0, p.stdout + p.stderr
