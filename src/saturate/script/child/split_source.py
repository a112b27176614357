"""Where a hand-written loop keeps its split of the effective batch, found as its training DataLoader is made, and the
split changed there for a trial — without editing a file.

At each `DataLoader(...)` call in the user's code, the call's own source (parsed once per file) says what its
`batch_size=` is: an attribute of an object (`cfg.batch_size`, `args.batch_size`: a config dataclass, an argparse
namespace), a module-level name (`BATCH_SIZE`), or a literal. The accumulation is looked for beside it: the same
object's integer attributes (or, where it has none, the module's integer globals) whose names say accumulation
(`grad_accum`, `gradient_accumulation_steps`, `ACCUM_STEPS`); the parent keeps the one whose value is the backward
passes the run made per optimizer step (`script/loop_split.py`). A function's local variable is named but not
tunable: it cannot be changed from outside while the function runs.

A loop with no DataLoader — nanoGPT's, batches from a `get_batch()` — keeps its split in its module's globals,
which it lets its command line override through `exec(open('configurator.py').read())` (`--batch_size=32`):
`configurator()` names them, as they stand at the first optimizer step, and a trial appends the flags
(`Overrides.flags`, `--name=value`) to the script's `sys.argv` as torch is imported, before its configurator reads
it; `flags_set` says, at the first optimizer step, whether the globals took them.

A script that parses its command line with argparse (a `HfArgumentParser` too) may hold its split in flags
(`--per_device_train_batch_size 1 --gradient_accumulation_steps 8`): `parsed()` names the integer flags it parsed
from `sys.argv` whose names say batch or accumulation, and a trial appends `--flag=value` the same way — the last
of a flag wins in argparse — so a split read before the DataLoader is made (an `Accelerator(
gradient_accumulation_steps=...)`) changes too; `flags_set` then reads the values the parser gave.

For a trial (`Overrides.train_loader["set"]`), the names are set to their new values in the caller's frame just
before the DataLoader is made — an attribute on its object, a global in its module — and the loader gets the new
micro-batch. The script reads its accumulation where it reads it; the child's checks (samples per optimizer step,
the fingerprint, the first losses: script/same_training.py) say whether the change reached it.
"""

from __future__ import annotations

import ast
import linecache
import math
import re
import sys
from typing import Any

from saturate.script.overrides import SET_NAME

ACCUM = re.compile(r"accum", re.IGNORECASE)  # a name that says gradient accumulation
BATCH = re.compile(r"batch", re.IGNORECASE)  # a global that may hold the micro-batch
# nanoGPT's `exec(open('configurator.py').read())`: `--name=value` on the command line sets the script's globals
CONFIGURATOR = re.compile(r"exec\(\s*open\(\s*['\"][^'\"]*configurator[^'\"]*\.py['\"]")
# names that say how long the script trains (a compile's pay-back, script/compile_stage.py): optimizer steps, epochs
STEPS = re.compile(r"^(max_|num_|total_|train_|n_)*(steps|iters|iterations)$", re.IGNORECASE)
EPOCHS = re.compile(r"^(max_|num_|total_|train_|n_)*epochs$", re.IGNORECASE)
_trees: dict[str, ast.Module | None] = {}
OPTIONS: dict[str, str] = {}  # an argparse dest -> its command-line flag, as the script's parsers defined them
PARSED: dict[str, Any] = {}  # a command-line flag (without its dashes) -> the value the script's parser gave it


def install(patches: Any) -> None:
    """Note each argparse flag's dest as the script parses its command line (so that a split held in an
    argparse namespace is handed over as its flags)."""
    import argparse

    parse = argparse.ArgumentParser.parse_known_args

    def parse_known_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        longest = {}
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is not None and flag.startswith("--"):
                OPTIONS.setdefault(action.dest, flag)
                longest[action.dest] = flag[2:]
        result = parse(parser, *args, **kwargs)
        if (args[0] if args else kwargs.get("args")) is None:  # the command line itself, not a list of its own
            namespace = result[0] if isinstance(result, tuple) else result
            PARSED.update({flag: getattr(namespace, dest) for dest, flag in longest.items()
                           if hasattr(namespace, dest)})
        return result

    patches.replace(argparse.ArgumentParser, "parse_known_args", parse_known_args)


def user_frame(site: str | None) -> Any:
    """The frame of the user's code at `site` (`file.py:LINE`, as `found.caller_site` gives it), or None."""
    from saturate.script.child.found import shown_path

    if site is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if f"{shown_path(frame.f_code.co_filename)}:{frame.f_lineno}" == site:
            return frame
        frame = frame.f_back
    return None


def find(frame: Any) -> dict[str, Any] | None:
    """What the DataLoader call running in `frame` takes as its batch size, and the accumulation candidates beside
    it: {"micro": "cfg.batch_size" | "BATCH" | None (a literal), "micro_value": N, "accum": {name: value},
    "locals": {name: value}, "flags": {name: "--flag"} (an argparse namespace's), "length": {"steps": {name: value},
    "epochs": {name: value}} (how long it trains, named beside the batch size)} — or None when the call's source
    cannot be read."""
    call = _call_at(frame.f_code.co_filename, frame.f_lineno)
    if call is None:
        return None
    node = next((k.value for k in call.keywords if k.arg == "batch_size"), call.args[1] if len(call.args) > 1 else None)
    expr = ast.unparse(node) if node is not None else None
    micro = expr if expr is not None and SET_NAME.match(expr) else None
    accum: dict[str, int] = {}
    beside: dict[str, Any] = {}  # the batch size's object's attributes, by their names as the script writes them
    if micro is not None and "." in micro:
        owner = _resolve(frame, micro.split(".")[0])
        beside = {f"{micro.split('.')[0]}.{name}": value for name, value in _attributes(owner).items()}
        for name, value in beside.items():
            if ACCUM.search(name.split(".")[1]) and _is_int(value):
                accum[name] = value
    for name, value in frame.f_globals.items() if not accum else ():  # the batch size's own object first
        if ACCUM.search(name) and _is_int(value):
            accum[name] = value
    local = {name: value for name, value in frame.f_locals.items() if ACCUM.search(name) and _is_int(value)
             and frame.f_locals is not frame.f_globals}
    flags = {}
    if micro is not None and "." in micro and type(_resolve(frame, micro.split(".")[0])).__name__ == "Namespace":
        flags = {name: OPTIONS[name.split(".")[1]] for name in (micro, *accum) if "." in name
                 and name.split(".")[1] in OPTIONS}
    return {"micro": micro, "micro_value": _value(frame, micro), "accum": accum, "locals": local, "flags": flags,
            "length": _length_of(beside) or length(frame.f_globals)}


def apply(frame: Any, changes: dict[str, int]) -> dict[str, str]:
    """Set each name of `changes` in `frame` (an attribute of a local or global object, or a global); what became
    of each: "set", or why not."""
    done = {}
    for name, value in changes.items():
        head, _, attr = name.partition(".")
        try:
            if attr:
                setattr(_resolve(frame, head), attr, value)
            elif head in frame.f_globals and (head not in frame.f_locals or frame.f_locals is frame.f_globals):
                frame.f_globals[head] = value
            else:
                raise LookupError("a function's local variable, which cannot be changed from outside")
            done[name] = "set"
        except (LookupError, AttributeError, TypeError) as e:
            done[name] = f"not set ({e})"
    return done


def configurator() -> dict[str, Any] | None:
    """The integer globals of a script whose command line sets them through a nanoGPT-style configurator, as they
    stand now: {"micro": {name: value} (names that say batch), "accum": {name: value}} — or None (no such
    script)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not CONFIGURATOR.search("".join(linecache.getlines(path))):
        return None
    ints = {k: v for k, v in vars(main).items() if not k.startswith("_") and _is_int(v)}
    return {"micro": {k: v for k, v in ints.items() if BATCH.search(k) and not ACCUM.search(k)},
            "accum": {k: v for k, v in ints.items() if ACCUM.search(k)}, "length": length(ints)}


def parsed() -> dict[str, Any] | None:
    """The integer flags the script parsed from its command line with argparse: {"micro": {flag: value} (names that
    say batch), "accum": {flag: value}, "length": {"steps": {"--flag": value}, "epochs": …}} — or None (no argparse
    parse of `sys.argv`, or none of these)."""
    ints = {flag: v for flag, v in PARSED.items() if _is_int(v)}
    said = length({flag.replace("-", "_"): v for flag, v in ints.items()})
    found = {"micro": {k: v for k, v in ints.items() if BATCH.search(k) and not ACCUM.search(k)},
             "accum": {k: v for k, v in ints.items() if ACCUM.search(k)},
             "length": {kind: {f"--{k}": v for k, v in ints.items() if k.replace("-", "_") in names}
                        for kind, names in said.items()}}
    return found if found["micro"] or found["accum"] or any(found["length"].values()) else None


def length(names: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Of `names` (name -> value), the integers whose names say how long the script trains: {"steps": {name: value}
    (max_steps, max_iters, num_iterations, …), "epochs": {name: value} (epochs, num_epochs, …)}."""
    last = {name: name.rsplit(".", 1)[-1] for name in names}
    return {kind: {name: v for name, v in names.items() if pattern.match(last[name]) and _is_int(v)}
            for kind, pattern in (("steps", STEPS), ("epochs", EPOCHS))}


def _length_of(names: dict[str, Any]) -> dict[str, dict[str, int]] | None:
    """`length(names)`, or None where it names nothing."""
    found = length(names)
    return found if any(found.values()) else None


def flags_set(asked: dict[str, int], rows: int | None, backwards: int) -> dict[str, str]:
    """Whether the script's globals hold the values its configurator was given (`Overrides.flags`, a split): "set",
    or what they hold instead; and whether the first step's micro-batches (`rows` each, `backwards` of them) make
    the effective batch the flags multiply to."""
    held = vars(sys.modules["__main__"]) if "__main__" in sys.modules else {}
    held = {**held, **PARSED} if any(k in PARSED for k in asked) else held  # argparse's flags, or the globals
    done = {k: "set" if held.get(k) == v else f"not set (the script holds {held.get(k)!r} at its first optimizer "
            f"step, not the --{k}={v} appended to its command line)" for k, v in asked.items()}
    effective = math.prod(asked.values())
    done["the effective batch"] = "set" if rows is not None and rows * backwards == effective else (
        f"not set (its first step ran {backwards} micro-batches of {rows}, not {effective} samples)")
    return done


def _call_at(filename: str, line: int) -> ast.Call | None:
    """The innermost `...DataLoader(...)` call spanning `line` of `filename`'s source."""
    if filename not in _trees:
        try:
            _trees[filename] = ast.parse("".join(linecache.getlines(filename)))
        except (OSError, SyntaxError, ValueError):
            _trees[filename] = None
    tree = _trees[filename]
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= line <= (n.end_lineno or n.lineno)
             and ast.unparse(n.func).split(".")[-1].endswith("DataLoader")]
    return max(calls, key=lambda n: n.lineno, default=None)


def _resolve(frame: Any, name: str) -> Any:
    if name in frame.f_locals:
        return frame.f_locals[name]
    if name in frame.f_globals:
        return frame.f_globals[name]
    raise LookupError(f"{name} is not defined where the DataLoader is made")


def _value(frame: Any, expr: str | None) -> int | None:
    if expr is None:
        return None
    head, _, attr = expr.partition(".")
    try:
        value = _resolve(frame, head)
        value = getattr(value, attr) if attr else value
    except (LookupError, AttributeError):
        return None
    return value if _is_int(value) else None


def _attributes(owner: Any) -> dict[str, Any]:
    try:
        return dict(vars(owner))
    except TypeError:  # __slots__
        return {n: getattr(owner, n) for n in getattr(owner, "__slots__", ()) if hasattr(owner, n)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
