"""`saturate doctor` and `saturate monitor`: thin commands over saturate.doctor and saturate.telemetry.monitor."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from saturate.cli.args import add_workload_args, positive, workload_from_args
from saturate.cli.output import say, show_machine, show_plan, tidy_console
from saturate.errors import ConfigError
from saturate.policy import POLICY


def add_parsers(sub: Any) -> None:
    """Add `doctor` and `monitor` to the main parser's subcommands."""
    p = sub.add_parser("doctor", help="why is training slow? a short instrumented run, a verdict, ranked fixes",
                       usage="saturate doctor [OPTIONS] [-- CMD …]",
                       description="Diagnose a preset or --workload, or your own training command unchanged: "
                                   "`saturate doctor -- python train.py …` (also python -m, torchrun, accelerate "
                                   "launch). The command runs its first steps with saturate's hooks, then is "
                                   "stopped; nothing in your files is changed.")
    add_workload_args(p)
    p.add_argument("--plan", metavar="FILE|NAME",
                   help="a plan.toml or a reference plan (naive, a6000-after, …); default: the plan `train` would "
                        "run (the tuned plan cached for this workload on this machine, else the seed plan)")
    p.add_argument("--no-tuned", action="store_true", help="ignore the cached tuned plan (with no --plan)")
    p.add_argument("--steps", type=positive(int, "--steps"), default=10, metavar="N",
                   help="optimizer steps timed (default 10; for a preset, more until the timed windows agree, "
                        "and at least 2 s)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first (default 2)")
    p.add_argument("--apply", action="store_true",
                   help="turn the top plan fix into a plan (with -- CMD: the top fix saturate can set from outside), "
                        "measure it against the plan (the command as written), print predicted against measured")
    p.add_argument("--save-plan", type=Path, metavar="FILE", help="with --apply: write the new plan as TOML")
    p.add_argument("--host-memory-budget", type=positive(float, "--host-memory-budget"), metavar="GIB",
                   help="host RAM the job may use (default: what is available when it starts)")
    p.add_argument("--no-scaling", action="store_true", help="skip the batch-scaling probe")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument("--trace-dir", type=Path, metavar="DIR",
                   help="where the trace of a few steps after the measured ones goes, to open in Perfetto (default: "
                        "a new saturate-doctor-* folder in the temporary folder)")
    p.add_argument("--no-trace", action="store_true", help="take no trace")
    first = POLICY.windows.first_step_timeout_s
    p.add_argument("--first-step-timeout", type=positive(float, "--first-step-timeout"), default=first,
                   metavar="S", help="with -- CMD: stop the command if no optimizer step came within S seconds "
                                     f"(default {first:g})")
    p.set_defaults(func=cmd_doctor, script=None)

    p = sub.add_parser("monitor", help="GPUs and host live, with the running saturate job's tokens/s")
    p.add_argument("--once", action="store_true", help="one reading, then exit")
    p.add_argument("--json", action="store_true", help="JSON (one object with --once, else one line per reading)")
    p.add_argument("--interval", type=positive(float, "--interval"), default=1.0, metavar="S",
                   help="seconds between readings (default 1)")
    p.add_argument("--runs", type=Path, default=Path("runs"), metavar="DIR",
                   help="where to look for a running saturate job (default: ./runs)")
    p.add_argument("--wide", action="store_true", help="add the clocks and the memory share (wider than 80 columns)")
    p.set_defaults(func=cmd_monitor)


def cmd_doctor(args: argparse.Namespace) -> int:

    from saturate.doctor.apply import diagnose_and_apply, render_applied
    from saturate.doctor.diagnose import DoctorConfig, diagnose
    from saturate.doctor.report import render
    from saturate.engine.resume import choose_plan
    from saturate.hardware import probe
    from saturate.plan import resolve_plan

    if args.script is not None:
        return _doctor_script(args)
    if args.save_plan and not args.apply:
        raise ConfigError("--save-plan needs --apply")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    budget = None if args.host_memory_budget is None else int(args.host_memory_budget * 1024**3)
    config = DoctorConfig(steps=args.steps, warmup=args.warmup, scaling=not args.no_scaling,
                          host_memory_budget=budget, seed=args.seed, trace=_trace_folder(args))
    plan = resolve_plan(args.plan) if args.plan else None
    hw = probe(measure_peaks=False, device=args.device)
    workload = workload_from_args(args)  # a preset, --workload module:function, --hf, --task sft
    notes: list[str] = []
    given = plan is not None
    plan = choose_plan(plan, None, workload, hw, use_tuned=not args.no_tuned, notes=notes)  # what train would run
    console = tidy_console(args.json, highlight=False)
    which = (f"the plan {args.plan}" if given else "the tuned plan cached for it on this machine"
             if plan.name == "tuned" else "the seed plan (no tuned plan cached; `saturate tune` makes one)")
    for note in notes:
        say(args, console, f"[yellow]note:[/] {note}")
    show_machine(args, hw)
    show_plan(args, plan, f"the plan diagnosed ({which})")
    say(args, console, f"[dim]doctor: {config.warmup} warm-up steps, then {config.steps}+ measured steps of "
                       f"{workload.name} with {which} …[/]")
    before = diagnose(workload, plan, config, hardware=hw)
    if not args.apply:
        if args.json:
            print(json.dumps({**before.to_dict(), "plan_used": which}, indent=2, default=str))
        else:
            render(before, console)
        return 0

    if not args.json:
        render(before, console, title="before")

    def applying(_before: Any, fix: Any) -> None:
        if not args.json:
            console.print(f"\n[bold]applying:[/] {fix.title} — running the new plan the same way …")

    def side_by_side(a: Any, b: Any) -> Any:
        from saturate.engine.live import stage
        from saturate.run.side_by_side import gain_between

        with stage(console, "measuring the plan before and after the fix side by side"):
            return gain_between(workload, hw, a, b, seed=config.seed, min_seconds=max(1.0, config.min_seconds))

    config = dataclasses.replace(config, trace=None)  # the plan before the fix is the one traced
    applied = diagnose_and_apply(workload, plan, config, hw, before=before, on_apply=applying,
                                 side_by_side=side_by_side)
    if args.save_plan and applied.plan is not None:
        applied.plan.save(args.save_plan)
    if args.json:
        print(json.dumps(applied.to_dict(), indent=2, default=str))
    else:
        render_applied(applied, console, saved_to=args.save_plan)
    return 0


def _doctor_script(args: argparse.Namespace) -> int:
    """`saturate doctor -- CMD`: the user's own command, instrumented, stopped after its measured steps."""

    from saturate.script.doctor_script import doctor_command, render_script

    for flag, given in (("--plan", args.plan), ("--save-plan", args.save_plan),
                        ("--workload", args.workload), ("--hf", args.hf)):
        if given:
            raise ConfigError(f"{flag} applies to a preset or --workload, not to a command after --")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    console = tidy_console(args.json, highlight=False)
    say(args, console, f"[dim]doctor: running your command with saturate's hooks: {args.warmup} warm-up steps, "
                       f"then {args.steps} measured steps; then it is stopped …[/]")
    diagnosis, run = doctor_command(args.script, warmup=args.warmup, steps=args.steps,
                                    first_step_timeout=args.first_step_timeout, quiet_stdout=args.json,
                                    trace=_trace_folder(args))
    if not args.json:
        render_script(diagnosis, run, console)
    applied = None
    if args.apply:  # the top fix saturate can set from outside, measured against the script as written
        from saturate.engine.live import stage
        from saturate.script.apply_script import apply_command, render_command_applied

        with stage(console, "measuring the top fix against your command as written, in alternating windows"):
            applied = apply_command(args.script, diagnosis, run.report or {}, warmup=args.warmup, steps=args.steps,
                                    first_step_timeout=args.first_step_timeout, quiet_stdout=args.json)
        if not args.json:
            render_command_applied(applied, console)
    if args.json:
        from saturate.script.doctor_script import trainer_syncs

        report = run.report or {}
        print(json.dumps({**diagnosis.to_dict(), "script": {
            **report, "written": run.written,
            "trainer_syncs": trainer_syncs(diagnosis.measurements, report.get("trainer"))},
            "command": run.command, **({"applied": applied.to_dict()} if applied is not None else {})},
            indent=2, default=str))
    return 0


def _trace_folder(args: argparse.Namespace) -> Path | None:
    """--trace-dir, else a new temporary folder; None with --no-trace (both: refused in one line)."""
    from saturate.script.scratch import doctor_folder

    if args.no_trace:
        if args.trace_dir is not None:
            raise ConfigError("--trace-dir and --no-trace cannot be given together")
        return None
    return doctor_folder(args.trace_dir)


def cmd_monitor(args: argparse.Namespace) -> int:
    from saturate.telemetry.monitor import run_monitor

    return run_monitor(once=args.once, as_json=args.json, interval=args.interval, root=args.runs, wide=args.wide)
