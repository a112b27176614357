"""`saturate sweep`: a grid over workload parameters, each point tuned then trained (see saturate.run.grid_sweep)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from saturate.cli.args import add_workload_args, positive, workload_from_args
from saturate.cli.output import verbosity
from saturate.errors import ConfigError
from saturate.workloads.source import parse_params


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("sweep", help="a grid over workload parameters: each point tuned, then trained; table, "
                                     "plot and JSON; rerun to resume")
    add_workload_args(p)
    p.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                   help="parameters and their values, e.g. --grid hidden=128,256 window=30,60,90 (every "
                        "combination is a point; KEY as for --param)")
    p.add_argument("--steps", type=positive(int, "--steps"),
                   help="optimizer steps per point (default: the workload's)")
    p.add_argument("--budget", type=positive(float, "--budget"), metavar="SECONDS",
                   help="tuning budget per point (default: none)")
    p.add_argument("--no-compile", action="store_true", help="do not try torch.compile when tuning")
    p.add_argument("--allow-batch-change", action="store_true",
                   help="let tuning grow the effective batch (learning rate rescaled linearly)")
    p.add_argument("--out", type=Path, help="the sweep's folder; the same --out resumes it (default: runs/sweep-…)")
    p.add_argument("--no-progress", action="store_true", help="no live progress while training")
    p.add_argument("--wide", action="store_true",
                   help="every column in the results table (precision, workers, the workload's metrics, time); "
                        "by default it fits 80 columns")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from saturate.cli.output import tidy_console
    from saturate.hardware import probe
    from saturate.run.grid_sweep import parse_grid, sweep

    grid = parse_grid(args.grid)
    fixed = parse_params(args.param or [])
    if clash := sorted(set(grid) & set(fixed)):
        raise ConfigError(f"{clash[0]} is both a --param and a --grid key")
    out = args.out or Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    source = {"preset": args.preset, "workload": args.workload, "hf": args.hf, "task": args.task,
              "data": args.data, "params": fixed, "effective_batch": args.effective_batch,
              "tokenizer": args.tokenizer, "text_field": args.text_field}
    hw = probe(measure_peaks=False, device=args.device)
    console = tidy_console(highlight=False)  # the terminal's width (80 when not a terminal)
    result = sweep(lambda params: workload_from_args(args, params), grid, hw, out_dir=out, steps=args.steps,
                   budget_s=args.budget, try_compile=not args.no_compile, allow_batch_change=args.allow_batch_change,
                   seed=args.seed, progress=not args.no_progress and verbosity(args) >= 0, console=console,
                   settings={"source": source}, wide=args.wide)
    if not result["interrupted"]:
        return 0
    from saturate.engine.signals import stop_exit_code

    return stop_exit_code(result.get("stop_signal"))  # a preemption: 75, requeue; Ctrl-C: 130, as `train` exits
