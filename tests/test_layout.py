"""The house rules of the source tree, checked: no import cycle, no long module without a reason, the
training loop on one screen. See docs/architecture.md for the map these keep true."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import grimp

SRC = Path(__file__).resolve().parents[1] / "src" / "saturate"
MAX_LINES = 400
REASON = "Over 400 lines because"  # what a module longer than MAX_LINES says at the top of its docstring


def import_cycles(package: str = "saturate") -> list[list[str]]:
    """Strongly connected components of more than one module in the package's import graph (every import,
    at module level or inside a function: a lazy import that closes a circle is still a circle)."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for m in sorted(edges):
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle_anywhere_in_src():
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "circle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from circle import b\n")
    (pkg / "b.py").write_text("def f():\n    from circle import a  # lazy, still a circle\n")
    (pkg / "c.py").write_text("from circle import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circle") == [["circle.a", "circle.b"]]


def test_no_module_over_400_lines_without_a_reason_at_its_top():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(SRC)} ({len(text.splitlines())} lines)")
    assert long == []


def test_the_training_loop_fits_on_one_screen():
    from saturate.engine import trainer

    lines, _ = inspect.getsourcelines(trainer._loop)
    assert len(lines) <= 60
