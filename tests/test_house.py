"""House style, checked: source files stay small and say in their first lines which side they are on.

DESIGN.md's rule: files under ``phoenix/`` and ``vendors/`` stay under 800 lines; each Python
module opens with a docstring. A file that grows past the limit is split along a seam.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 800
SOURCES = sorted(
    p
    for d in ("phoenix", "vendors")
    for p in (ROOT / d).rglob("*")
    if p.suffix in (".py", ".c", ".h") and "build" not in p.parts and p.is_file()
)


def test_there_are_sources():
    assert len(SOURCES) > 50, SOURCES[:5]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_files_stay_small(path):
    n = path.read_text(errors="replace").count("\n")
    assert n <= LIMIT, f"{path.relative_to(ROOT)} has {n} lines (limit {LIMIT}): split it along a seam"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix == ".py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_python_modules_open_with_a_docstring(path):
    text = path.read_text()
    if not text.strip():
        return  # an empty package marker has nothing to say
    tree = ast.parse(text)
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 3, f"{path.relative_to(ROOT)} does not say what it is in its first lines"
