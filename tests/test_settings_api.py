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
import threading
from pathlib import Path

import pytest

import phoenix.settings as ps
from phoenix import registry

PACKAGE = Path(ps.__file__).resolve().parent
#: the README's and the docstrings' names: the derived list must hold them
DOCUMENTED = {"io", "settings", "phxloader", "phxfile", "kmod", "registry", "vendor", "buffers", "streams", "errors"}
SUBMODULES = sorted(
    {m.name for m in pkgutil.iter_modules([str(PACKAGE)]) if not m.name.startswith("_")} | {"vendors", "templates"}
)


def run_python(code: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-c", textwrap.dedent(code)],  # -P: the installed phoenix, not the tree
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(autouse=True)
def clean_settings():
    ps.reset()
    yield
    ps.reset()
    state = getattr(ps, "_state", None)
    assert state is None or all(layer.entered for layer in state.layers), "a test left an override() in force"


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


# ---- override() -------------------------------------------------------------------------------


def test_override_without_with_applies_at_the_call():
    default = ps.get().threads
    ov = ps.override(threads=7)  # as the README writes it
    assert ps.get().threads == 7 and ps.source_of("threads") == "override"
    ov.restore()
    assert ps.get().threads == default
    ps.override(threads=6)  # the object dropped: in force until set(), reset()
    assert ps.get().threads == 6
    ps.set(threads=3)  # the later call wins
    assert ps.get().threads == 3 and ps.source_of("threads") == "set()"
    ps.override(vendor="host", chunk_size="16M")
    ps.reset()
    assert ps.get().threads == default and ps.get().chunk_size == ps.DEFAULTS["chunk_size"]
    assert ps.source_of("vendor") != "override"


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"nosuch": 1}, TypeError, "unknown setting(s) nosuch"),
        ({"threads": -1}, ValueError, "threads=-1 must be between 1 and 1024"),
        ({"chunk_size": "12K+"}, ValueError, "chunk_size='12K+' is not an integer"),
        ({"mode": "fast"}, ValueError, "auto, staged, direct"),
        ({"vendor": ""}, ValueError, "not a vendor name"),
    ],
)
def test_override_checks_its_arguments_at_the_call(kwargs, error, words):
    before = ps._state
    with pytest.raises(error) as exc:
        ps.override(**kwargs)  # no with: it raised before too, only at __enter__
    assert words in str(exc.value) and "phoenix.settings.override" in str(exc.value) or error is TypeError
    assert ps._state == before


def test_with_blocks_nest_and_take_their_values_back():
    ps.set(threads=5)
    with ps.override(threads=9, chunk_size="16M") as inner:
        assert inner.threads == 9
        with ps.override(threads=2):
            assert ps.get().threads == 2
            ps.set(threads=4)  # below the blocks in progress
            assert ps.get().threads == 2
        assert ps.get().threads == 9
    assert ps.get().threads == 4 and ps.get().chunk_size == ps.DEFAULTS["chunk_size"]


def test_a_block_entered_above_a_plain_call_is_undone_to_it():
    ps.override(threads=8)
    with ps.override(threads=4):
        assert ps.get().threads == 4
    assert ps.get().threads == 8
    with ps.override(threads=4):
        ps.override(threads=2)  # a plain call inside a block: it stays after
    assert ps.get().threads == 2


def test_blocks_end_out_of_order_across_threads():
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    seen = {}

    def block(i, threads):
        with ps.override(threads=threads):
            entered[i].set()
            leave[i].wait(10)
            seen[i] = ps.get().threads

    a = threading.Thread(target=block, args=(0, 11))
    a.start()
    entered[0].wait(10)
    b = threading.Thread(target=block, args=(1, 12))
    b.start()
    entered[1].wait(10)
    assert ps.get().threads == 12
    leave[0].set()  # the first block ends first: the second's value holds
    a.join(10)
    assert ps.get().threads == 12 and seen[0] == 12
    leave[1].set()
    b.join(10)
    assert ps.get().threads == ps.DEFAULTS["threads"] and ps.source_of("threads") == "default"


def test_enter_and_exit_by_hand_as_the_callers_do():
    """use_runtime() and the tests' helpers call __enter__/__exit__ themselves."""
    ctx = ps.override(threads=3, mode="staged")
    s = ctx.__enter__()
    assert (s.threads, s.mode) == (3, "staged")
    ps.set(threads=6)  # a block in progress keeps its values
    assert ps.get().threads == 3
    ctx.__exit__(None, None, None)
    ctx.__exit__(None, None, None)  # twice: nothing more
    assert ps.get().threads == 6
    with ctx:  # again, after its block ended
        assert ps.get().threads == 3
        with pytest.raises(RuntimeError, match="in force in a with block already"):
            ctx.__enter__()
    assert ps.get().threads == 6
    leaked = ps.override(threads=2)
    leaked.__enter__()
    del leaked  # a block whose object is gone without an exit is over (as a generator's was)
    assert ps.get().threads == 6


def test_use_runtime_holds_its_vendor_until_the_next_call():
    rt = registry.get_runtime("host")
    registry.use_runtime(rt)
    try:
        ps.set(vendor="nosuch")  # the adopted runtime's block stays above set()
        assert ps.get().vendor == "host" and registry.resolve("host") is rt
    finally:
        registry.use_runtime(None)
    assert ps.get().vendor == "nosuch"


def test_plain_calls_in_a_loop_keep_one_layer_per_setting():
    for n in range(1, 200):
        ps.override(threads=n, chunk_size=4096 * n)
    assert ps.get().threads == 199 and len(ps._state.layers) <= 2


# ---- messages that say the range ------------------------------------------------------------

NUMERIC = sorted(n for n, d in ps.DEFAULTS.items() if isinstance(d, (int, float)) and not isinstance(d, bool)) + [
    "fmap_register_flags"
]


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("text", ["-1", "-64K", "-99999999999999999999999"])
def test_a_negative_number_gets_the_settings_range(monkeypatch, name, text):
    if name in ("fmap_idle", "fmap_register_flags") and text.endswith("K"):
        pytest.skip("seconds and flags take no K")
    var = ps.ENV[name]
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError) as exc:
        ps.get()
    msg = str(exc.value)
    assert msg.startswith(f"environment {var}: {name}=-") and " must be " in msg, msg
    assert "not an integer" not in msg and "not a number" not in msg, msg
    monkeypatch.delenv(var)
    with pytest.raises(ValueError, match=f"{name}=-\\S+ must be "):
        ps.override(**{name: text})


def test_threads_minus_one_says_its_range(monkeypatch):
    monkeypatch.setenv("PHX_THREADS", "-1")
    with pytest.raises(ValueError, match=r"^environment PHX_THREADS: threads=-1 must be between 1 and 1024$"):
        ps.get()


@pytest.mark.parametrize("value", [2.5, True, "2.5", "four", [4]])
def test_what_is_no_whole_number_is_refused_with_its_range(value):
    with pytest.raises(ValueError, match="threads=.* is not an integer.*it must be between 1 and 1024"):
        ps.override(threads=value)


def test_whole_numbers_in_any_spelling_are_taken():
    for value in (8, 8.0, "8", "+8", " 8 "):
        with ps.override(threads=value):
            assert ps.get().threads == 8, value
