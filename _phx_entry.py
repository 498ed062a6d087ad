"""Entry of the console scripts ``phx`` and ``phx-port``, and the ``phoenix`` name-clash check.

A top-level module of the distribution ``phoenix-direct-storage``, outside the ``phoenix``
package on purpose. Another distribution, ``arize-phoenix``, installs an import package named
``phoenix`` too, into the same site-packages: installed after this one, its ``__init__`` wins
and ``import phoenix`` runs its code (``ModuleNotFoundError: pandas``); installed before, its
``phoenix/vendor/`` package hides our ``phoenix/vendor.py``. Neither failure says why. So the
console scripts ask the installed distributions (``importlib.metadata``) who else owns files
under ``phoenix/`` BEFORE importing ``phoenix``, and say so in one paragraph (exit 2);
``phoenix/__init__`` runs the same check and raises ``ImportError`` with the same text.

Stdlib only, and nothing here imports ``phoenix`` before the check has passed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import sys

DIST_NAME = "phoenix-direct-storage"
PACKAGE = "phoenix"
#: distributions known to install an import package ``phoenix``, reported even where their
#: file list cannot be read
KNOWN_CLASHES = ("arize-phoenix",)

_RECORD_LINE = re.compile(rf'^"?{PACKAGE}/', re.MULTILINE)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _owns_package(dist: importlib.metadata.Distribution) -> bool:
    """Whether ``dist`` installs files under ``phoenix/``: its RECORD, else its egg-info file lists."""
    record = dist.read_text("RECORD")
    if record is not None:  # a wheel install: one text search, no parsing of every path
        return _RECORD_LINE.search(record) is not None
    top = dist.read_text("top_level.txt")
    if top is not None and PACKAGE in top.split():
        return True
    files = dist.files
    if files is None:  # no file list at all: known by its name only (parses the metadata)
        return _normalize(dist.metadata.get("Name") or "") in KNOWN_CLASHES
    return any(f.parts[:1] == (PACKAGE,) for f in files)


@functools.lru_cache(maxsize=1)
def clashes() -> tuple[tuple[str, str], ...]:
    """``(name, version)`` of every other installed distribution that owns files under ``phoenix/``.

    Once per process (cached), and cheap: one text search in each distribution's RECORD; only
    the owners' metadata is parsed (ours among them).
    """
    found: dict[str, tuple[str, str]] = {}
    ours = _normalize(DIST_NAME)
    for dist in importlib.metadata.distributions():
        try:
            if not _owns_package(dist):
                continue
            name = dist.metadata.get("Name") or ""
        except (OSError, ValueError):  # an unreadable or broken dist-info: not ours to judge
            continue
        key = _normalize(name)
        if key and key != ours and key not in found:
            found[key] = (name, dist.version or "?")
    return tuple(found[k] for k in sorted(found))


def clash_message(found: tuple[tuple[str, str], ...] | None = None) -> str | None:
    """The one paragraph that explains a clash and how to fix it, or ``None`` when there is none."""
    found = clashes() if found is None else found
    if not found:
        return None
    try:
        ours = f"{DIST_NAME} {importlib.metadata.version(DIST_NAME)}"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        ours = DIST_NAME
    others = " and ".join(f"{name} {version}" for name, version in found)
    names = " ".join(name for name, _ in found)
    return (
        f"{ours} and {others} cannot share an environment: both install the import package "
        f"'{PACKAGE}', so their files overwrite or hide each other's and 'import {PACKAGE}' gets a mix "
        f"of the two (or the other one). Fix it by removing the other one and then reinstalling "
        f"this one, since the uninstall also deletes the files the two share: "
        f"'pip uninstall {names}' then 'pip install --force-reinstall --no-deps {DIST_NAME}' "
        f"(or the path you installed it from); or keep each in a virtual environment of its own "
        f"('python -m venv <dir>')."
    )


def _run(prog: str, module: str, argv: list[str] | None) -> int:
    message = clash_message()
    if message:
        print(f"{prog}: {message}", file=sys.stderr)
        return 2
    return importlib.import_module(module).main(argv)


def phx(argv: list[str] | None = None) -> int:
    """``phx``: the clash check, then :func:`phoenix.cli.phx.main`."""
    return _run("phx", "phoenix.cli.phx", argv)


def phx_port(argv: list[str] | None = None) -> int:
    """``phx-port``: the clash check, then :func:`phoenix.cli.port.main`."""
    return _run("phx-port", "phoenix.cli.port", argv)
