"""Settings and the registry under a signal handler and after fork(); a vendor import that
a handler's exit interrupts; an explicitly named vendor that cannot serve.

Test side. Python runs a signal handler in the main thread between two bytecodes of what it
interrupted, phoenix's own locked sections included; each body runs in a child interpreter
with a timeout, so that a deadlock fails its test instead of hanging the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phoenix import registry

BOUND_S = 30  # a deadlock runs into it; the bodies take a few seconds


def run_python(code: str, env: dict | None = None, timeout: float = BOUND_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-P", "-c", textwrap.dedent(code)],  # -P: the installed phoenix, not the tree
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PHX_VENDOR": "host", **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"no end within {timeout} s (a deadlock): {exc.stdout!r} {exc.stderr!r}")


def make_vendor(root: Path, name: str, body: str) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "runtime.py").write_text(textwrap.dedent(body))
    return root


RUNTIME = """
    from phoenix.vendor import Probe, VendorRuntime

    class Runtime(VendorRuntime):
        name = "{name}"
        auto_priority = 0

        @classmethod
        def probe(cls):
            return Probe({usable}, "{reason}")
"""

# ---- a handler that re-enters settings and the registry -------------------------------------


def test_a_signal_handler_may_use_settings_and_the_registry_mid_change():
    """SIGALRM 200 us after the last one's handler ended; the handler reads, overrides, sets
    and resolves while the main thread does the same: no deadlock, each sees its own block's
    values, and neither loses the other's set()."""
    p = run_python("""
        import signal, time
        import phoenix.settings as ps
        from phoenix import registry

        calls = [0]

        def handler(signum, frame):
            calls[0] += 1
            assert ps.get().vendor == "host"
            with ps.override(threads=3):
                assert ps.get().threads == 3, ps.get().threads
                assert registry.resolve("host").name == "host"
                assert ps.effective("threads") == 3 and ps.source_of("threads") == "override"
            ps.set(fmap_idle=calls[0])  # a change of its own that must survive the main thread's
            registry.current_selection()
            if not stop:
                signal.setitimer(signal.ITIMER_REAL, 0.0002)  # one at a time: handlers never nest

        stop = False
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.0002)
        end, loops = time.monotonic() + 3, 0
        while time.monotonic() < end:
            loops += 1
            with ps.override(threads=5, chunk_size="1M"):
                assert ps.get().threads == 5, ps.get().threads
                assert registry.resolve("host").name == "host"
            ps.set(chunk_size=4096 * (1 + loops % 64))
            if loops % 50 == 0:
                registry.reset()  # the next resolve makes a runtime (under the lock) again
                ps.override(queue_depth=1 + loops % 64)  # a plain call: stays
        stop = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        s = ps.get()
        assert calls[0] > 100, calls
        assert s.fmap_idle == calls[0], (s.fmap_idle, calls)  # the handler's last set() is there
        assert s.chunk_size == 4096 * (1 + loops % 64) and s.threads == ps.DEFAULTS["threads"], s
        assert all(not layer.entered for layer in ps._state.layers), ps._state
        print(calls[0], loops)
    """)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_fork_child_is_not_stuck_on_a_lock_another_thread_held():
    """Children forked while a thread held the settings' and the registry's locks (and while
    two others changed both) read and change settings and resolve vendors, and exit 0."""
    p = run_python("""
        import os, signal, threading, time, traceback
        import phoenix.settings as ps
        from phoenix import registry

        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                with ps.override(threads=7):
                    registry.resolve("host")
                ps.set(threads=6)
                ps.reset()

        held, release = threading.Event(), threading.Event()

        def holder():
            with ps._lock, registry._lock:
                held.set()
                release.wait()

        workers = [threading.Thread(target=hammer) for _ in range(2)]
        for t in workers:
            t.start()
        t = threading.Thread(target=holder)
        t.start()
        held.wait()
        failed = []
        for i in range(20):
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)  # stuck: SIGALRM ends the child
                try:
                    ps.get()
                    with ps.override(threads=2):
                        assert ps.get().threads == 2
                    ps.set(chunk_size="1M")
                    assert registry.resolve("host").name == "host"
                    try:
                        registry.resolve("nosuch")  # the lock, and a full discovery
                    except LookupError:
                        pass
                    registry.use_runtime(None)
                    os._exit(0)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                failed.append(os.waitstatus_to_exitcode(status))
        release.set()
        stop.set()
        for w in workers + [t]:
            w.join()
        assert not failed, failed
    """)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- an exit while a vendor's module imports ------------------------------------------------

SLEEPY = """
    import os
    import time

    time.sleep(float(os.environ.get("SLEEPY_S", "0")))  # a slow import (a driver's library)

    from phoenix.vendor import Probe, VendorRuntime


    class Runtime(VendorRuntime):
        name = "sleepy"
        auto_priority = 0

        @classmethod
        def probe(cls):
            return Probe(True, "fine")
"""

HANDLERS = {
    "function": "handler = lambda signum, frame: sys.exit(7)",
    "partial": "import functools\nhandler = functools.partial(lambda code, s, f: sys.exit(code), 7)",
    "method": "class App:\n    def on_term(self, s, f):\n        sys.exit(7)\nhandler = App().on_term",
    "object": "class OnTerm:\n    def __call__(self, s, f):\n        raise SystemExit(7)\nhandler = OnTerm()",
}


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_a_handlers_exit_during_a_vendor_import_ends_the_process(tmp_path, kind):
    root = make_vendor(tmp_path, "sleepy", SLEEPY)
    p = run_python(
        f"""
        import signal, sys
        from phoenix import registry

        {textwrap.indent(HANDLERS[kind], " " * 8).lstrip()}
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        entry = registry.discover()["sleepy"]
        entry.load()
        print("kept running:", entry.error)
        """,
        env={"PHX_VENDOR_PATH": str(root), "SLEEPY_S": "20"},
    )
    assert p.returncode == 7, p.stdout + p.stderr
    assert "kept running" not in p.stdout


@pytest.mark.parametrize("exc", ["SystemExit(7)", "KeyboardInterrupt()"])
def test_after_an_interrupted_vendor_import_the_next_load_imports_again(tmp_path, exc):
    root = make_vendor(tmp_path, "sleepy", SLEEPY)
    p = run_python(
        f"""
        import os, signal, sys
        from phoenix import registry

        def handler(signum, frame):
            raise {exc}

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        found = registry.discover()
        try:
            found["sleepy"].load()
            sys.exit("the handler's exception was swallowed: " + str(found["sleepy"].error))
        except {exc.split("(")[0]}:
            pass
        os.environ["SLEEPY_S"] = "0"
        assert found["sleepy"].load() is not None, found["sleepy"].error
        assert found["sleepy"].error is None
        assert registry.select("sleepy", found).name == "sleepy"
        """,
        env={"PHX_VENDOR_PATH": str(root), "SLEEPY_S": "20"},
    )
    assert p.returncode == 0, p.stdout + p.stderr


EXITS = """
    import sys

    sys.exit(3)
"""

EXITS_IN_A_LIBRARY = """
    import argparse

    argparse.ArgumentParser(prog="acme").parse_args(["--no-such-flag"])
"""


def test_a_vendor_that_exits_at_import_stays_a_broken_vendor(tmp_path):
    """Its own sys.exit(3), or a library's it called (argparse), with a signal handler of
    the program's installed: reported with the vendor's place; the process goes on."""
    root = make_vendor(tmp_path, "exits", EXITS)
    make_vendor(root, "argexit", EXITS_IN_A_LIBRARY)
    p = run_python(
        """
        import signal, sys
        from phoenix import registry

        signal.signal(signal.SIGALRM, lambda signum, frame: sys.exit(7))
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(8))
        found = registry.discover()
        for name in ("exits", "argexit"):
            assert found[name].load() is None
            print(name, found[name].error)
        print("kept running")
        """,
        env={"PHX_VENDOR_PATH": str(root)},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert lines["exits"] == f"import failed: it called sys.exit(3) at import ({root / 'exits' / 'runtime.py'}:4)"
    assert lines["argexit"].startswith("import failed: it called sys.exit(2) at import"), lines
    assert lines["argexit"].endswith(f"({root / 'argexit' / 'runtime.py'}:4)"), lines
    assert "kept running" in p.stdout


# ---- an explicitly named vendor that cannot serve -------------------------------------------

READ = """
    import os, sys
    import phoenix.io as pio
    from phoenix import settings

    path = sys.argv[1] if len(sys.argv) > 1 else os.environ["DATA"]
    data = open(path, "rb").read()
    buf = bytearray(b"\\xa5" * (len(data) + 4096))
    try:
        with {scope}:
            with pio.open(path, "r") as f:
                n = f.read(memoryview(buf)[:len(data)], len(data), 0)
    except Exception as exc:
        print(f"{{type(exc).__name__}}: {{exc}}")
        sys.exit(3)
    assert n == len(data) and bytes(buf[:n]) == data, n
    assert buf[n:] == b"\\xa5" * 4096  # past the extent: untouched
    print("read", n)
"""


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 * 4096 + 123))
    return path


@pytest.mark.parametrize(
    "scope,env,words",
    [
        ("open(os.devnull)", {"PHX_VENDOR": "unusable"}, ["PHX_VENDOR=unusable", "no device node /dev/fake0", "auto"]),
        (
            "settings.override(vendor='unusable')",
            {"PHX_VENDOR": "auto"},
            ["vendor='unusable' (override)", "no device node /dev/fake0"],
        ),
        ("open(os.devnull)", {"PHX_VENDOR": "nosuch"}, ["unknown vendor 'nosuch'", "installed vendors", "unusable"]),
        (
            "open(os.devnull)",
            {"PHX_VENDOR": "host", "PHX_HOST_DEVICES": "0"},
            ["PHX_VENDOR=host", "PHX_HOST_DEVICES=0", "set the vendor to auto to"],
        ),
    ],
)
def test_host_memory_io_with_a_named_vendor_that_cannot_serve_says_why(tmp_path, data, scope, env, words):
    """Before, the first I/O swallowed the registry's reason and went on with no vendor:
    PHX_VENDOR=nvidia on a machine without CUDA was ignored without a word."""
    root = make_vendor(
        tmp_path / "v", "unusable", RUNTIME.format(name="unusable", usable=False, reason="no device node /dev/fake0")
    )
    p = run_python(READ.format(scope=scope), env={"PHX_VENDOR_PATH": str(root), "DATA": str(data), **env})
    assert p.returncode == 3, p.stdout + p.stderr
    (line,) = p.stdout.splitlines()
    assert line.startswith(("VendorUnavailable: ", "UnknownVendorError: ")), line
    for word in words:
        assert word in line, (word, line)


def test_host_memory_io_with_auto_needs_no_vendor(tmp_path, data):
    """auto, no accelerator, and not even the host fallback can serve: host memory is still
    read in place, every byte."""
    if any(n != "host" and e.probe().usable and registry.auto_priority(e) > 0 for n, e in registry.discover().items()):
        pytest.skip("an accelerator vendor is usable here: auto picks it")
    p = run_python(
        READ.format(scope="open(os.devnull)"), env={"PHX_VENDOR": "auto", "PHX_HOST_DEVICES": "0", "DATA": str(data)}
    )
    assert p.returncode == 0 and p.stdout.strip() == f"read {data.stat().st_size}", p.stdout + p.stderr
