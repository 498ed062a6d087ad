"""What the tools say when something is missing: ``python -m phoenix.phxfile`` (its exit status,
the installation it looked in, the vendors from discovery) and every unusable vendor's reason
(what to install or set, as each port's library setting)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from phoenix import phxfile, registry


def _phxfile(env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    # isolated, from a neutral directory: a checkout's source tree must not shadow the installation
    return subprocess.run(
        [sys.executable, "-I", "-m", "phoenix.phxfile"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        timeout=120,
    )


def test_phxfile_exit_status_says_whether_the_loader_finds_it():
    p = _phxfile({"LD_LIBRARY_PATH": phxfile.library_dir()})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "found by the loader" in p.stdout
    p = _phxfile({"LD_LIBRARY_PATH": ""})
    if "found by the loader" in p.stdout:
        pytest.skip("libphxfile is registered system-wide here (ldconfig)")
    assert p.returncode == 1, p.stdout
    assert f"export LD_LIBRARY_PATH={phxfile.library_dir()}" in p.stdout


def test_phxfile_not_built_exits_1_naming_the_installation(tmp_path, monkeypatch, capsys):
    """The library missing (another interpreter's phoenix, a source tree never built): exit 1,
    and the interpreter and package it looked in, with the venv's interpreter as the way."""
    monkeypatch.setattr(phxfile, "library_dir", lambda: str(tmp_path))
    assert phxfile.main() == 1
    out = capsys.readouterr().out
    assert "is not built" in out and sys.executable in out
    assert os.path.dirname(os.path.abspath(phxfile.__file__)) in out
    assert "-I -m phoenix.phxfile" in out


def test_phxfile_names_every_vendor_found():
    out = _phxfile({"LD_LIBRARY_PATH": phxfile.library_dir()}).stdout
    for name in registry.discover():
        assert name in out.split("PHX_VENDOR's (", 1)[1].split(")", 1)[0], (name, out)


def test_every_unusable_vendors_reason_says_what_to_install_or_set():
    """amd, metax and nvidia say "install X or set PHX_<NAME>_LIBRARY"; nvidia's driver-side
    reasons said neither."""
    checked = 0
    for name, entry in registry.discover().items():
        if name == "host" or entry.source != "in-tree" or entry.load() is None:
            continue
        probe = entry.probe()
        if probe.usable:
            continue
        checked += 1
        assert f"PHX_{name.upper()}_LIBRARY" in probe.reason, (name, probe.reason)
        assert "nstall" in probe.reason or "update" in probe.reason, (name, probe.reason)
    if not checked:
        pytest.skip("every in-tree vendor is usable here")


def test_nvidia_without_a_driver_says_what_to_do(monkeypatch):
    """The driver library missing or failing to initialize: what to install or set."""
    import ctypes

    from phoenix.vendors.nvidia.runtime import Runtime

    details = {"emulated": False, "library": "/usr/local/cuda/lib64/libcudart.so"}
    real = ctypes.CDLL

    def no_driver(name, *a, **k):
        if name == Runtime.driver_library:
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *a, **k)

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    why = Runtime._check_driver(None, details)
    assert "libcuda.so.1" in why and "Install the NVIDIA driver" in why and "PHX_NVIDIA_LIBRARY" in why
    old = Runtime.check_runtime(None, {**details, "runtime_version": 9000, "driver_version": 12000})
    assert "PHX_NVIDIA_LIBRARY" in old and "install CUDA 10" in old
    new = Runtime.check_runtime(None, {**details, "runtime_version": 13000, "driver_version": 12000})
    assert "update the NVIDIA driver" in new and "PHX_NVIDIA_LIBRARY" in new
