"""The house rules of the source tree, checked: no import cycle, statistics on the bottom floor, no decision
that branches on the text of its own explanation, no long module without a reason, the training loop on one
screen. See docs/architecture.md for the map these keep true."""

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


# What saturate.stats may import of saturate: itself and the errors. It is the floor tune/, doctor/ and script/
# stand on, so nothing above it may be pulled back down into it.
STATS_MAY_IMPORT = ("saturate.stats", "saturate.errors")


def imports_from_above(package: str = "saturate", floor: str = "saturate.stats",
                       allowed: tuple[str, ...] = STATS_MAY_IMPORT) -> list[str]:
    """"module -> imported" for each import by a module of `floor` of a module of `package` outside `allowed`
    (every import, as for the cycles: a lazy one still ties the floor to what is above it)."""
    graph = grimp.build_graph(package, cache_dir=None)

    def within(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return sorted(f"{m} -> {i}" for m in graph.modules if within(m, floor)
                  for i in graph.find_modules_directly_imported_by(m)
                  if within(i, package) and not any(within(i, a) for a in allowed))


def test_stats_imports_nothing_of_saturate_but_itself_and_the_errors():
    assert imports_from_above() == []


def test_the_floor_check_finds_an_import_from_above(tmp_path, monkeypatch):
    pkg = tmp_path / "house"
    for sub in ("stats", "tune"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "stats" / "ok.py").write_text("from house import errors\nfrom house.stats import low\n")
    (pkg / "stats" / "low.py").write_text("def f():\n    from house.tune import high  # lazy, still upward\n")
    (pkg / "tune" / "high.py").write_text("from house.stats import ok\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert imports_from_above("house", "house.stats", ("house.stats", "house.errors")) == [
        "house.stats.low -> house.tune.high"]


# The floors of the house, lowest first: a module imports only from its own floor or below (a floor's packages may
# import one another; the cycle test keeps that acyclic module by module). `script.overrides` and `script.boundary`
# are the two modules both sides of a user's command share, so they sit low; the child side (`script.child`, inside
# the user's process) is below the parent side (`script`), which launches and judges it.
LAYERS = (
    ("errors",),
    ("atomic", "stats", "policy", "script.overrides"),
    ("plan", "prior", "provenance", "script.boundary"),
    ("data",),
    ("hardware", "workloads"),
    ("telemetry", "plan_cache"),
    ("engine",),
    ("doctor", "tune"),
    ("run", "script.child", "integrations"),
    ("script",),
    ("saturate", "cli"),  # the package's public API (__init__) and the command line over it
    ("__main__",),
)


def floor_of(module: str, package: str = "saturate") -> str:
    """The entry of LAYERS a module belongs to: `saturate.tune.api` -> "tune", `saturate.script.child.hooks` ->
    "script.child", `saturate` -> "saturate"."""
    parts = module.split(".")[1:]
    if not parts:
        return package
    if parts[0] == "script" and len(parts) > 1 and f"script.{parts[1]}" in {n for floor in LAYERS for n in floor}:
        return f"script.{parts[1]}"
    return parts[0]


def imports_running_up(package: str = "saturate", layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """"module -> imported (floor -> floor)" for each import of a module on a higher floor, and "module (no floor)"
    for a module LAYERS does not place (a new package must be given its floor)."""
    graph = grimp.build_graph(package, cache_dir=None)
    level = {name: i for i, floor in enumerate(layers) for name in floor}
    found = []
    for m in sorted(graph.modules):
        a = floor_of(m, package)
        if a not in level:
            found.append(f"{m} (no floor)")
            continue
        for i in sorted(graph.find_modules_directly_imported_by(m)):
            b = floor_of(i, package)
            if i.split(".")[0] == package and level.get(b, -1) > level[a]:
                found.append(f"{m} -> {i} ({a} -> {b})")
    return found


def test_no_import_runs_back_up_a_floor():
    assert imports_running_up() == []


def test_the_floor_check_finds_an_import_running_up(tmp_path, monkeypatch):
    pkg = tmp_path / "tower"
    for sub in ("low", "high", "loose"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from tower.high import b  # lazy, still up\n")
    (pkg / "high" / "b.py").write_text("from tower.low import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert imports_running_up("tower", (("low",), ("high",), ("tower",))) == [
        "tower.loose (no floor)", "tower.low.a -> tower.high.b (low -> high)"]


# The child side runs inside the user's process; it must not drag in the parent's (which launches commands, tunes,
# prints) nor the flows above it: what it needs of the parent crosses in script/boundary.py and script/overrides.py.
CHILD_MAY_NOT_IMPORT = ("saturate.script", "saturate.tune", "saturate.run", "saturate.cli", "saturate.integrations")
CHILD_SHARES = ("saturate.script.child", "saturate.script.boundary", "saturate.script.overrides")


def test_the_child_side_imports_nothing_of_the_parent_side():
    graph = grimp.build_graph("saturate", cache_dir=None)
    child = [m for m in graph.modules if m.startswith("saturate.script.child")]
    assert len(child) >= 8  # hooks, trainer_hooks, lightning_hooks, patches, found, losses, coupled, trial_windows
    wrong = sorted(f"{m} -> {i}" for m in child for i in graph.find_modules_directly_imported_by(m)
                   if i.startswith(CHILD_MAY_NOT_IMPORT) and not i.startswith(CHILD_SHARES))
    assert wrong == []


def test_the_boundary_and_the_overrides_import_neither_side():
    graph = grimp.build_graph("saturate", cache_dir=None)
    for shared in ("saturate.script.boundary", "saturate.script.overrides"):
        script = [i for i in graph.find_modules_directly_imported_by(shared) if i.startswith("saturate.script")]
        assert set(script) <= {"saturate.script.overrides"}, (shared, script)


def test_no_two_modules_share_a_file_name():
    """A name says one job: `tune/report.py` and `doctor/report.py` would be two places to look (packages'
    `__init__.py` aside)."""
    seen: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(SRC)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


# A decision must be data (an enum, a field), not recovered from the prose that explains it: these names hold
# our own explanations (a trial's outcome, a verdict, a note...), so `"within noise" in short(t)` or
# `row.note.startswith(...)` is a decision read back out of a message. Third-party text (an exception from
# torch, a local variable holding it) is not ours to turn into data and is not flagged.
MESSAGE_NAMES = {"short", "text", "outcome", "verdict", "note", "reason", "why", "message", "status_text"}
MESSAGE_ATTRIBUTES = {"outcome", "verdict", "note", "why", "reason"}
_NORMALISERS = {"lower", "upper", "casefold", "strip", "lstrip", "rstrip"}  # the same text, still ours


def _unwrapped(node: ast.expr) -> ast.expr:
    """`x.lower().strip()` -> `x`: a normalised message is still the message."""
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _NORMALISERS
           and not node.args):
        node = node.func.value
    return node


def _names_a_message(node: ast.expr, attributes: set[str]) -> bool:
    node = _unwrapped(node)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        return name in MESSAGE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in attributes


def _tests_message_text(node: ast.AST) -> bool:
    """A string literal `in`/`not in` a message, or a message attribute's `.startswith`/`.endswith`."""
    if isinstance(node, ast.Compare):
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            if (isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, ast.Constant) and isinstance(left.value, str)
                    and _names_a_message(right, MESSAGE_NAMES)):
                return True
            left = right
        return False
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith") and _names_a_message(node.func.value, MESSAGE_ATTRIBUTES))


def message_text_branches(root: Path = SRC) -> list[str]:
    """"path:line: source" for each test of our own message's text in the modules under `root` (a call or
    attribute named in MESSAGE_NAMES holding a string literal, a MESSAGE_ATTRIBUTES one's start or end)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        hits = sorted((n for n in ast.walk(ast.parse(text)) if _tests_message_text(n)), key=lambda n: n.lineno)
        found += [f"{path.relative_to(root)}:{n.lineno}: {ast.get_source_segment(text, n)}" for n in hits]
    return found


def test_no_decision_branches_on_the_text_of_a_message():
    assert message_text_branches() == []


def test_the_message_text_check_finds_a_planted_branch(tmp_path):
    (tmp_path / "planted.py").write_text(
        "def choose(t, rows, short, text):\n"
        "    if \"within noise\" in short(t):  # flagged: our own explanation, read back\n"
        "        return 1\n"
        "    if \"too slow\" not in t.verdict:  # flagged\n"
        "        return 2\n"
        "    if \"out of memory\" in t.outcome.lower():  # flagged: lower() leaves it our message\n"
        "        return 3\n"
        "    if rows[0].note.startswith(\"the same settings\"):  # flagged\n"
        "        return 4\n"
        "    if \"Timed out\" in text or t.status == \"ok\":  # not flagged: a local holding torch's text, a code\n"
        "        return 5\n"
        "    return \"x\" in t.plan.name or t.label.startswith(\"guide\")  # not flagged: not messages\n")
    assert [line.split(": ", 1)[0] for line in message_text_branches(tmp_path)] == [
        "planted.py:2", "planted.py:4", "planted.py:6", "planted.py:8"]


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


# A threshold the tuners, the doctor or `run` decide with is a named field of the policy (saturate.policy), with its
# reason, or a named constant saying what it is: never a bare number in a comparison. Allowed: 0 and 1 (a sign, an
# emptiness, a count of one), 2 as the divisor of `%` or `//` (parity, halving) and an integer subscript (`v[3]`).
DECIDING = ("tune", "script", "doctor", "run")


def _literals_in_comparisons(tree: ast.AST) -> list[ast.Compare]:
    def allowed(n: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
        up = parents.get(n)
        if isinstance(up, ast.UnaryOp):  # -1, -0.5: the sign goes with the number
            n, up = up, parents.get(up)
        if isinstance(up, ast.Subscript) and up.slice is n:
            return True
        if isinstance(up, ast.BinOp) and up.right is n and isinstance(up.op, (ast.Mod, ast.FloorDiv)):
            return getattr(n, "value", None) == 2
        return getattr(n, "value", None) in (0, 1) or getattr(getattr(n, "operand", None), "value", None) in (0, 1)

    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            numbers = [n for sub in (node.left, *node.comparators) for n in ast.walk(sub)
                       if isinstance(n, ast.Constant) and isinstance(n.value, (int, float))
                       and not isinstance(n.value, bool)]
            if any(not allowed(n, parents) for n in numbers):
                found.append(node)
    return found


def numbers_in_decisions(root: Path = SRC, packages: tuple[str, ...] = DECIDING) -> list[str]:
    """"path:line: source" for each comparison in `packages` under `root` holding a bare number."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            found += [f"{path.relative_to(root)}:{n.lineno}: {ast.get_source_segment(text, n)}"
                      for n in _literals_in_comparisons(ast.parse(text))]
    return found


def test_no_bare_number_decides_in_the_tuners_the_doctor_or_run():
    assert numbers_in_decisions() == []


def test_the_bare_number_check_finds_a_planted_threshold(tmp_path):
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "planted.py").write_text(
        "def f(busy, r, v, n, POLICY):\n"
        "    if busy >= 0.5:  # flagged\n"
        "        return 1\n"
        "    if len(r) < 3 or n > 2 * busy:  # flagged\n"
        "        return 2\n"
        "    if v[3] is None or r % 2 == 0 or n // 2 >= 1 or n != -1:  # allowed\n"
        "        return 3\n"
        "    return busy >= POLICY.load.busy_cores\n")
    assert [line.split(": ", 1)[0] for line in numbers_in_decisions(tmp_path, ("tune",))] == [
        "tune/planted.py:2", "tune/planted.py:4", "tune/planted.py:4"]  # line 4: two comparisons


# One definition per policy concept: the names the drifted twins had (issue 58) are gone from src/, and no module of
# the deciding packages defines a module-level number under a policy field's name (a second copy of a threshold).
RETIRED = ("SAME_LOAD_CORES", "UNEVEN_CORES", "SIGNIFICANT_SHARE", "BUSY_NOTE_CORES", "CONFIRM_BELOW", "AGAIN_BELOW",
           "DRIFT", "MIN_GAIN", "WINDOW_S", "TRIAL_SECONDS", "SIDE_BY_SIDE_ROUNDS", "SAVING_SHARE")


def test_each_policy_concept_is_defined_once():
    import dataclasses

    from saturate.policy import POLICY

    fields = {f.name.upper() for s in dataclasses.fields(POLICY) for f in dataclasses.fields(getattr(POLICY, s.name))}
    twins = []
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "policy":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and (t.id in RETIRED or t.id in fields):
                    twins.append(f"{path.relative_to(SRC)}:{node.lineno}: {t.id}")
    assert twins == []


def _reads_provenance(node: ast.AST) -> bool:
    """A value taken from a plan's provenance: `plan.provenance.get(k)`, `prov[k]`, `str(...)` of either."""
    node = _unwrapped(node)  # type: ignore[arg-type]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        node = _unwrapped(node.args[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        node = node.func.value
    elif isinstance(node, ast.Subscript):
        node = node.value
    else:
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "provenance" or isinstance(n, ast.Name)
               and n.id in ("provenance", "prov") for n in ast.walk(node))


def provenance_text_branches(root: Path = SRC) -> list[str]:
    """"path:line: source" for each test of the text a plan's provenance holds: `x in plan.provenance.get(k)`,
    `.startswith` on one. What a decision needs of a plan's origin is `saturate.provenance.origin`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        for n in ast.walk(ast.parse(text)):
            hit = (isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) and _reads_provenance(right)
                                                      for op, right in zip(n.ops, n.comparators, strict=True))
                   or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and n.func.attr in ("startswith", "endswith") and _reads_provenance(n.func.value))
            if hit:
                found.append(f"{path.relative_to(root)}:{n.lineno}: {ast.get_source_segment(text, n)}")
    return found


def test_no_decision_branches_on_the_text_of_a_provenance():
    assert provenance_text_branches() == []


def test_the_provenance_text_check_finds_a_planted_branch(tmp_path):
    (tmp_path / "planted.py").write_text(
        "def grow(plan, prov, UNMEASURED, origin):\n"
        "    if UNMEASURED not in str(plan.provenance.get('micro_batch', '')):  # flagged\n"
        "        return 1\n"
        "    if str(plan.provenance.get('threads', '')).startswith('the first'):  # flagged\n"
        "        return 2\n"
        "    if 'measured' in prov['precision']:  # flagged\n"
        "        return 3\n"
        "    return 'informed' in plan.provenance or origin(plan.provenance, 'threads')  # not flagged\n")
    assert [line.split(": ", 1)[0] for line in provenance_text_branches(tmp_path)] == [
        "planted.py:2", "planted.py:4", "planted.py:6"]
