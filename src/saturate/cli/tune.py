"""`saturate tune` and `saturate run`: parsers and thin commands over saturate.tune."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from saturate.cli.args import add_workload_args, positive, source_from_args, source_record, workload_from_args
from saturate.cli.output import (
    json_document,
    run_result_dict,
    show_machine,
    show_plan,
    tidy_console,
    tune_result_dict,
    verbosity,
)
from saturate.errors import ConfigError
from saturate.policy import POLICY


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("tune", help="find the fastest plan by measurement; writes plan.toml, tune.json, plots")
    add_workload_args(p)
    _add_tuning_args(p)
    p.add_argument("--steps", type=positive(int, "--steps"),
                   help="steps the plan will train for (compile must pay back within them; default: the preset's)")
    p.add_argument("--out", type=Path, help="folder for plan.toml, tune.json and plots (default: runs/tune-…); "
                                           "with -- CMD: overrides.json and tune.json")
    p.add_argument("--wide", action="store_true", help="tables with every figure, wider than 80 columns "
                                                       "(default: they fit 80; tune.json always has everything)")
    _add_script_args(p)
    p.set_defaults(func=cmd_tune, script=None)

    p = sub.add_parser("run", help="probe, tune, train with the tuned plan, and show the before/after table")
    p.add_argument("preset_arg", nargs="?", metavar="PRESET", help="same as --preset")
    add_workload_args(p)
    _add_tuning_args(p)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive(int, "--steps"),
                        help="optimizer steps to train (default: the preset's)")
    length.add_argument("--minutes", type=positive(float, "--minutes"), help="train for this long after tuning")
    p.add_argument("--run-dir", type=Path, help="default: runs/<preset>-<time>; with -- CMD: where the tuning's "
                                                "overrides.json, tune.json and edit.diff go (default: nowhere — the "
                                                "working folder is left as a plain run leaves it)")
    p.add_argument("--no-progress", action="store_true", help="no progress display while training")
    _add_script_args(p)
    p.add_argument("--overrides", type=Path, metavar="FILE",
                   help="with -- CMD: apply the settings of a `saturate tune -- CMD` (its overrides.json) instead of "
                        "tuning again")
    p.set_defaults(func=cmd_run, script=None)


def _add_tuning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=positive(float, "--budget"), metavar="SECONDS",
                   help="tuning time budget (default: none)")
    p.add_argument("--allow-batch-change", action="store_true",
                   help="let the effective batch grow (learning rate rescaled linearly); default: kept exactly")
    p.add_argument("--allow-micro-batch-change", action="store_true",
                   help="search the micro-batch even when the model has batch-coupled layers (BatchNorm), which "
                        "changes the maths; default: kept")
    p.add_argument("--no-compile", action="store_true", help="do not try torch.compile")


def _add_script_args(p: argparse.ArgumentParser) -> None:
    """Options for a user's own command after `--` (`saturate tune -- python train.py …`)."""
    p.add_argument("--trial-steps", type=positive(int, "--trial-steps"), default=10, metavar="N",
                   help="with -- CMD: optimizer steps split into phases per trial, after 2 warm-up steps; then the "
                        "script's steps are timed in windows until they agree (default 10)")
    w = POLICY.windows
    p.add_argument("--trial-seconds", type=positive(float, "--trial-seconds"), default=w.trial_seconds, metavar="S",
                   help="with -- CMD: the most a tuning trial's timed windows last, doubled on a busy machine "
                        f"(default {w.trial_seconds:g})")
    p.add_argument("--first-step-timeout", type=positive(float, "--first-step-timeout"),
                   default=w.first_step_timeout_s, metavar="S",
                   help=f"with -- CMD: stop a trial if no optimizer step came within S seconds (default "
                        f"{w.first_step_timeout_s:g})")
    p.add_argument("--json", action="store_true",
                   help="the result (plan, figures, paths) as one JSON document on stdout; the rest on stderr")


def _console(wide: bool = False) -> Any:
    """The tables fit 80 columns, the width rich uses off a terminal; `--wide` ones get 160 there."""
    import sys

    return tidy_console() if sys.stdout.isatty() or not wide else tidy_console(width=160)


def _quiet_console() -> Any:
    from rich.console import Console

    return Console(quiet=True)


def cmd_tune(args: argparse.Namespace) -> int:
    from saturate.hardware import probe

    if args.script is not None:
        return _tune_script(args)

    from saturate.tune import tune

    with json_document(args) as emit:
        hw = probe(measure_peaks=False, device=args.device)
        show_machine(args, hw)
        quiet = verbosity(args) < 0  # -q: the trials unprinted, the result in one line
        result = tune(workload_from_args(args), hw, budget_s=args.budget, planned_steps=args.steps,
                      allow_batch_change=args.allow_batch_change, out_dir=args.out, seed=args.seed,
                      try_compile=not args.no_compile, console=_quiet_console() if quiet else _console(args.wide),
                      wide=args.wide, allow_micro_batch_change=args.allow_micro_batch_change)
        if quiet:
            print(f"{'kept' if result.kept else 'tuned'} plan: {result.plan_path} {result.plan!r} "
                  f"(evidence: {result.json_path})" + (f": {result.kept}" if result.kept else ""))
        show_plan(args, result.plan, "the kept plan" if result.kept else "the tuned plan")
        emit(tune_result_dict(result))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from saturate.engine.live import silenced, stage
    from saturate.engine.signals import stop_exit_code
    from saturate.hardware import probe
    from saturate.run.flow import run

    if args.script is not None:
        return _run_script(args)
    if args.overrides:
        raise ConfigError("--overrides applies to a command after --")

    with json_document(args) as emit, silenced(verbosity(args) < 0):  # -q: no live lines either
        console = _console(getattr(args, "wide", False))
        # The matmul peaks only give MFU its denominator: the training measures its own precision's when it starts
        # (once per machine, then stored: engine/summary.mfu_peak), not every precision's before anything (~1 s
        # each on a 2-core CPU, paid by a job's first run on a machine); -v shows them all, so measures them all.
        everything = verbosity(args) > 0
        with stage(console, "probing the machine" + (" (matmul peaks: measured once per machine)" if everything
                                                     else "")):
            hw = probe(measure_peaks=everything, device=args.device)
        show_machine(args, hw)
        with stage(console, "preparing the workload (the corpus and its token cache)"):
            workload = workload_from_args(args)
        report = run(workload, hw, budget_s=args.budget, steps=args.steps, minutes=args.minutes,
                     run_dir=args.run_dir, allow_batch_change=args.allow_batch_change, seed=args.seed,
                     progress=not args.no_progress and verbosity(args) >= 0, try_compile=not args.no_compile,
                     console=console, source=source_record(source_from_args(args)),
                     allow_micro_batch_change=args.allow_micro_batch_change)
        emit({"run_dir": str(report.run_dir), "rows": [r.to_dict() for r in report.rows],
              **(report.comparison.to_dict() if report.comparison else {}), "trained": report.trained,
              "tuning": report.tuning.to_dict() if report.tuning else None, "timing": report.timing,
              "tuned": tune_result_dict(report.tuned) if report.tuned else None,
              "training": run_result_dict(report.training), "notes": report.notes})
    if not report.training.interrupted:
        return 0
    return stop_exit_code(report.training.stop_signal)


def _refuse_preset_flags(args: argparse.Namespace) -> None:
    for flag, given in (("--workload", args.workload), ("--hf", args.hf), ("--budget", args.budget),
                        ("--allow-batch-change", args.allow_batch_change), ("--wide", getattr(args, "wide", False))):
        if given:
            raise ConfigError(f"{flag} applies to a preset or --workload, not to a command after --")


def _trial_options(args: argparse.Namespace) -> Any:
    from saturate.script.script_trial import TrialOptions

    return TrialOptions(steps=args.trial_steps, seconds=args.trial_seconds,
                        first_step_timeout=args.first_step_timeout, quiet_stdout=args.json,
                        try_compile=not args.no_compile)


def _tune_script(args: argparse.Namespace) -> int:
    """`saturate tune -- CMD`: settings the script takes from outside, found by measurement (saturate.script)."""
    import json
    import time

    from saturate.script.progress import tune_with_progress
    from saturate.script.tuning import render, write

    _refuse_preset_flags(args)
    console = tidy_console(args.json, highlight=False)
    tuning = tune_with_progress(args.script, _trial_options(args), console,
                                allow_micro_batch_change=args.allow_micro_batch_change)
    written = write(tuning, args.out or Path("runs") / f"tune-script-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.json:
        print(json.dumps({**tuning.to_dict(), "overrides_file": str(written)}, indent=2, default=str))
    else:
        render(tuning, console, written)
    return 0


def _run_script(args: argparse.Namespace) -> int:
    """`saturate run -- CMD`: tune (or --overrides), as written vs tuned side by side, then the full run; the
    tuning's settings and edit written to --run-dir."""
    import json

    from saturate.script.overrides import Overrides
    from saturate.script.run_script import render, run_script
    from saturate.script.tuning import PATCH, write

    _refuse_preset_flags(args)
    console = tidy_console(args.json, highlight=False)
    overrides = Overrides.read(args.overrides) if args.overrides else None
    report = run_script(args.script, _trial_options(args), console, overrides=overrides,
                        overrides_file=str(args.overrides) if args.overrides else None,
                        allow_micro_batch_change=args.allow_micro_batch_change)
    written = None
    tuned = report.tuning is not None and report.tuning.best is not report.tuning.baseline
    if tuned and args.run_dir is not None:
        written = write(report.tuning, args.run_dir)
    if args.json:
        print(json.dumps({**report.to_dict(), "overrides_file": written and str(written)}, indent=2, default=str))
        return 0 if report.full.returncode == 0 else 2
    render(report, console)
    if written is not None:
        patch = f"; the edit as a patch: {written.parent / PATCH}" if (written.parent / PATCH).is_file() else ""
        console.print(f"the tuned settings: {written} (`saturate run --overrides {written} -- CMD` applies them "
                      f"again){patch}")
    elif tuned:
        console.print("(--run-dir DIR writes the tuned settings there, and the edit as a patch)")
    return 0 if report.full.returncode == 0 else 2
