"""`saturate tune` and `saturate run`: parsers and thin commands over saturate.tune."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from saturate.cli.args import add_workload_args, source_from_args, source_record, workload_from_args


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("tune", help="find the fastest plan by measurement; writes plan.toml, tune.json, plots")
    add_workload_args(p)
    _add_tuning_args(p)
    p.add_argument("--steps", type=int, help="steps the plan will train for (compile must pay back within them; "
                                             "default: the preset's)")
    p.add_argument("--out", type=Path, help="folder for plan.toml, tune.json and plots (default: runs/tune-…)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("run", help="probe, tune, train with the tuned plan, and show the before/after table")
    p.add_argument("preset_arg", nargs="?", metavar="PRESET", help="same as --preset")
    add_workload_args(p)
    _add_tuning_args(p)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps to train (default: the preset's)")
    length.add_argument("--minutes", type=float, help="train for this long after tuning")
    p.add_argument("--run-dir", type=Path, help="default: runs/<preset>-<time>")
    p.add_argument("--no-progress", action="store_true", help="no progress display while training")
    p.set_defaults(func=cmd_run)


def _add_tuning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=float, metavar="SECONDS", help="tuning time budget (default: none)")
    p.add_argument("--allow-batch-change", action="store_true",
                   help="let the effective batch grow (learning rate rescaled linearly); default: kept exactly")
    p.add_argument("--no-compile", action="store_true", help="do not try torch.compile")


def _console() -> Any:
    """Rich wraps at 80 columns when output is not a terminal; the trial tables need more."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def cmd_tune(args: argparse.Namespace) -> int:
    from saturate.hardware import probe
    from saturate.tune import tune

    hw = probe(measure_peaks=False, device=args.device)
    tune(workload_from_args(args), hw, budget_s=args.budget, planned_steps=args.steps,
         allow_batch_change=args.allow_batch_change, out_dir=args.out, seed=args.seed,
         try_compile=not args.no_compile, console=_console())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from saturate.engine.signals import PREEMPTION_SIGNALS
    from saturate.hardware import probe
    from saturate.tune.run import run

    hw = probe(measure_peaks=True, device=args.device)
    report = run(workload_from_args(args), hw, budget_s=args.budget, steps=args.steps, minutes=args.minutes,
                 run_dir=args.run_dir, allow_batch_change=args.allow_batch_change, seed=args.seed,
                 progress=not args.no_progress, try_compile=not args.no_compile, console=_console(),
                 source=source_record(source_from_args(args)))
    if not report.training.interrupted:
        return 0
    return 75 if report.training.stop_signal in PREEMPTION_SIGNALS else 130
