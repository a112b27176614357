"""The tuned settings as a patch `git apply` takes (`tune -- CMD --out DIR` writes `DIR/edit.diff`), for what sits at a
line of the script's own source: the training DataLoader's arguments, its optimizer's `fused=True`, and its split of
the effective batch where one literal in its folder holds it.

- A call's arguments (`DataLoader(...)` at its site, the optimizer's constructor at its): each keyword the tuning
  changes replaces the literal the call gives it, or is added after the call's last argument.
- A split held in a setting (`cfg.batch_size`, `args.grad_accum`, `BATCH`, nanoGPT's `batch_size` global): the one
  integer literal among the `.py` files of the script's folder that gives that name its as-written value — a field's
  default (`batch_size: int = 2`), an assignment (`BATCH = 2`, `cfg.batch_size = 2`), a keyword (`Config(batch_size=
  2)`), or an argparse default (`add_argument("--batch-size", default=2)`). Where none or several do, that setting
  is left out of the patch and said (the line edit names it still).

Precision, compile, threads, TF32 and the environment stay line edits: they change the code's shape, not a value.
Positions come from `ast` (UTF-8 byte columns), so the patch is byte-exact on the files as they are now.
"""

from __future__ import annotations

import ast
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Change:
    """Replace the bytes of `path` from (`line`, `col`) to (`end_line`, `end_col`) (1-based lines, byte columns)."""

    path: Path
    line: int
    col: int
    end_line: int
    end_col: int
    text: str


def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None


def _name(node: ast.AST) -> str:
    return ast.unparse(node).split(".")[-1]


def keyword_changes(path: Path, line: int, suffix: str, kwargs: dict[str, Any]) -> list[Change] | str:
    """`kwargs` set in the innermost call spanning `line` of `path` whose callee's name ends with `suffix`, or why
    not."""
    tree = _tree(path)
    if tree is None:
        return f"{path} could not be parsed"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= line <= (n.end_lineno or n.lineno)
             and _name(n.func).endswith(suffix)]
    if not calls:
        return f"no {suffix}(...) call at {path}:{line}"
    call = max(calls, key=lambda n: (n.lineno, n.col_offset))
    unpacked = any(k.arg is None for k in call.keywords)  # `**kwargs`: a keyword added could be given twice
    if unpacked and any(key not in {k.arg for k in call.keywords} for key in kwargs):
        return f"the {suffix}(...) at {path.name}:{line} takes **keywords, which may already set {', '.join(kwargs)}"
    changes, added = [], []
    for key, value in kwargs.items():
        given = next((k for k in call.keywords if k.arg == key), None)
        if given is None:
            added.append(f"{key}={value!r}")
        else:
            v = given.value
            changes.append(Change(path, v.lineno, v.col_offset, v.end_lineno or v.lineno, v.end_col_offset or 0,
                                  repr(value)))
    if added:
        last = max((*call.args, *call.keywords), key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0), default=None)
        if last is None:  # `f()`: before its closing parenthesis
            at = (call.end_lineno or call.lineno, (call.end_col_offset or 1) - 1)
            text = ", ".join(added)
        else:
            at = (last.end_lineno or last.lineno, last.end_col_offset or 0)
            text = ", " + ", ".join(added)
        changes.append(Change(path, at[0], at[1], at[0], at[1], text))
    return changes


def value_change(folder: Path, name: str, old: int, new: int) -> Change | str:
    """The one integer literal among `folder`'s `.py` files that gives `name` (`cfg.batch_size`: its last part) the
    value `old`, set to `new`; or why not (none, or several: each place named)."""
    attr = name.split(".")[-1]
    found: list[tuple[Path, ast.Constant]] = []
    for path in sorted(folder.glob("*.py")):
        tree = _tree(path)
        for node in ast.walk(tree) if tree is not None else ():
            for value in _values_for(node, attr):
                if isinstance(value, ast.Constant) and type(value.value) is int and value.value == old:
                    found.append((path, value))
    if len(found) != 1:
        places = ", ".join(f"{p.name}:{v.lineno}" for p, v in found)
        return (f"{name}: {len(found)} places in {folder} give it {old}" + (f" ({places})" if places else "")
                + ", so it is not in the patch")
    path, v = found[0]
    return Change(path, v.lineno, v.col_offset, v.end_lineno or v.lineno, v.end_col_offset or 0, str(new))


def _values_for(node: ast.AST, attr: str) -> list[ast.AST]:
    """The value nodes `node` gives a setting named `attr`: an assignment's, a field's default, a keyword's, an
    argparse option's default."""
    if isinstance(node, ast.AnnAssign) and node.value is not None and _target(node.target) == attr:
        return [node.value]
    if isinstance(node, ast.Assign) and any(_target(t) == attr for t in node.targets):
        return [node.value]
    if isinstance(node, ast.Call):
        if _name(node.func) == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            dest = next((k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)),
                        None) or (max(flags, key=len).lstrip("-").replace("-", "_") if flags else None)
            return [k.value for k in node.keywords if k.arg == "default"] if dest == attr else []
        return [k.value for k in node.keywords if k.arg == attr]
    return []


def _target(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def unified(changes: list[Change], root: Path) -> str:
    """The changes as one unified diff, paths relative to `root` (`a/…`, `b/…`: `git apply` or `patch -p1` run in
    `root` takes it); every changed file lies under `root`."""
    out = []
    for path in sorted({c.path for c in changes}):
        before = path.read_bytes().split(b"\n")
        after = list(before)
        for c in sorted((c for c in changes if c.path == path), key=lambda c: (c.line, c.col), reverse=True):
            head, tail = after[c.line - 1][:c.col], after[c.end_line - 1][c.end_col:]
            after[c.line - 1:c.end_line] = [head + c.text.encode() + tail]
        name = path.resolve().relative_to(root.resolve()).as_posix()
        old = [x.decode() + "\n" for x in before]
        new = [x.decode() + "\n" for x in after]
        if before and before[-1] == b"":  # the file ends with a newline: no line after it
            old, new = old[:-1], new[:-1]
        out.extend(difflib.unified_diff(old, new, f"a/{name}", f"b/{name}"))
    return "".join(out)


def _at(site: str | None, root: Path) -> tuple[Path, int] | None:
    """`file.py:LINE` (as the child shows sites: relative to the working folder, or absolute) as a path and line."""
    if not site or ":" not in site:
        return None
    name, _, line = site.rpartition(":")
    path = Path(name) if Path(name).is_absolute() else root / name
    return (path, int(line)) if line.isdigit() and path.is_file() else None


@dataclass(frozen=True)
class Patch:
    """The tuned settings as a unified diff (`text`, "" for none) to apply in `folder` (the working folder, or where
    the changed files are when they lie outside it), and one line for each setting that sits at a line of the
    script's source but could not go in it (`left`)."""

    text: str
    folder: Path
    left: list[str]


def tuned_patch(tuning: Any, root: Path | None = None) -> Patch:
    """The tuning's best overrides as a patch of the script's files (module docstring). `root`: the working folder
    the sites are relative to (default: this process's)."""
    root = root or Path.cwd()
    over = tuning.best.overrides
    changes: list[Change] = []
    left: list[str] = []

    def add(found: list[Change] | Change | str) -> None:
        if isinstance(found, str):
            left.append(found)
        else:
            changes.extend(found if isinstance(found, list) else [found])

    loader = tuning.loaders[0] if tuning.loaders else {}
    train = dict(over.train_loader)
    names = dict(train.get("set") or {})
    split = loader.get("split") or {}
    calls: dict[str, dict[str, Any]] = {}
    if "batch_size" in train and split.get("micro") not in names:  # a literal batch_size= at the loader's call
        calls[train.get("site") or loader.get("site")] = {"batch_size": train["batch_size"]}
    if over.loader:
        site = loader.get("site")
        calls[site] = {**calls.get(site, {}), **over.loader}
    for site, kwargs in calls.items():
        at = _at(site, root)
        add(keyword_changes(*at, "DataLoader", kwargs) if at else f"the DataLoader at {site}: its file not found")
    if names:
        at = _at(train.get("site"), root)
        written = {split.get("micro"): split.get("micro_value"), **(split.get("accum") or {})}
        for name, value in names.items():
            if at is None or written.get(name) is None:
                left.append(f"{name}: where the script keeps it was not read, so it is not in the patch")
            else:
                add(value_change(at[0].parent, name, int(written[name]), int(value)))
    if over.flags:
        left.append(f"on its command line: {' '.join(over.argv())} (flags, not a file's text)")
    if over.optimizer and tuning.optimizer:
        at = _at(tuning.optimizer.get("site"), root)
        cls = tuning.optimizer.get("class") or "Adam"
        add(keyword_changes(*at, cls, dict(over.optimizer)) if at else f"the {cls} at its site: its file not found")
    paths = [c.path.resolve() for c in changes]
    folder = root.resolve()
    if not all(p.is_relative_to(folder) for p in paths):  # the script lies elsewhere: its files' common folder
        folder = Path(os.path.commonpath([p.parent for p in paths]))
    return Patch(unified(changes, folder) if changes else "", folder, left)
