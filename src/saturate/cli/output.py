"""What every verb shares about output: -q/-v/--debug (before or after the verb), `--json` documents,
and consoles that fit the terminal.

    add_common_flags(parser, top)   --debug, -q/--quiet, -v/--verbose on the main parser and each verb
    verbosity(args)                 -1 quiet (results and errors only), 0 normal, 1 verbose
    console(args)                   a rich Console for the human output: stderr under --json, silent under -q
    json_document(args)             with --json, stdout holds one JSON document and nothing else
    run_result_dict, tune_result_dict   what `train`, `tune` and `run` put in that document

Under `--json` everything a verb would print for people goes to stderr (rich consoles, progress,
notes, a library's stray print), and the verb's result is the one document on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO


def add_common_flags(p: argparse.ArgumentParser, top: bool) -> None:
    """On a verb, the flags' default is SUPPRESS, so `saturate -q train` is not undone by train's default."""
    keep = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors", **keep)
    p.add_argument("-q", "--quiet", action="store_true", help="only results and errors", **keep)
    p.add_argument("-v", "--verbose", action="store_true", help="more detail (the plan in full, the machine)",
                   **keep)


def verbosity(args: argparse.Namespace) -> int:
    return -1 if getattr(args, "quiet", False) else 1 if getattr(args, "verbose", False) else 0


from saturate.engine.console import tidy_console  # noqa: E402 - re-exported: the verbs' consoles


def console(args: argparse.Namespace, **kw: Any) -> Any:
    """The console for a verb's human output: the terminal's width (80 columns when not a terminal, rich's
    default), on stderr under --json."""
    return tidy_console(bool(getattr(args, "json", False)), highlight=False, **kw)


def show_machine(args: argparse.Namespace, hw: Any) -> None:
    """-v: what probe() found, before the work starts."""
    if verbosity(args) > 0:
        from saturate.hardware import render_hardware

        render_hardware(hw, console(args))


def show_plan(args: argparse.Namespace, plan: Any, what: str) -> None:
    """-v: a plan in full, as TOML (`what` says which: "the plan trained", …)."""
    if verbosity(args) > 0:
        import tomli_w

        text = tomli_w.dumps({k: v for k, v in plan.to_dict().items() if k != "provenance"})
        console(args).print(f"{what}:\n{text}", markup=False)


def say(args: argparse.Namespace, out: Any, text: str) -> None:
    """A progress or context line: shown unless -q."""
    if verbosity(args) >= 0:
        out.print(text)


@contextlib.contextmanager
def json_document(args: argparse.Namespace) -> Iterator[Any]:
    """`with json_document(args) as emit:` … `emit(result_dict)`. Under --json, sys.stdout is stderr
    inside the block (so no human line can reach stdout) and `emit` writes the document to the real
    stdout; without --json, `emit` does nothing."""
    real: TextIO = sys.stdout
    document: list[dict[str, Any]] = []
    if not getattr(args, "json", False):
        yield lambda data: None
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield document.append
    if document:
        real.write(json.dumps(document[-1], indent=2, default=str) + "\n")
        real.flush()


def run_result_dict(result: Any) -> dict[str, Any]:
    """A training run's result for `--json`: the plan, the measured figures, the files."""
    import dataclasses

    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return {**out, "plan": result.plan.to_dict(), "run_dir": str(result.run_dir),
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
            "weights": str(result.weights) if result.weights else None}


def tune_result_dict(result: Any) -> dict[str, Any]:
    """A tuning's result for `--json`: the plan, the trials and decisions (as in tune.json), the files."""
    from saturate.tune.evidence import result_dict

    found = result_dict(result.search) if result.search is not None else {"changed": False, "why": result.kept}
    return {**found, "plan": result.plan.to_dict(), "plan_path": str(result.plan_path),
            "json_path": str(result.json_path), "out_dir": str(result.out_dir),
            "plots": [str(p) for p in result.plots],
            "cached_path": str(result.cached_path) if result.cached_path else None, "notes": result.notes}
