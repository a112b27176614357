"""`saturate run`: probe, tune (or reuse the cached plan), measure naive / the guide's plan / the runner-up /
tuned side by side, train with the fastest, compare.

The comparison rows are measured in this process by the same method, in interleaved rounds (side_by_side.py), so
their ratios are fair on a busy machine; the last row is the training run itself. Tuning must pay for itself: unless
`--budget` is given, the plan cached for this workload and hardware is reused with no tuning, or else the tuning
budget is a share of the training time predicted for the untuned job (the default plan's first steps, else naive
measured once), within a floor and a ceiling; the tuning runs no verification trial (the side-by-side measures the
plan again, through its real loader). The side-by-side's measurements are timed for `compare_share` of the predicted
training in all — building each plan, warm-ups, every row and round (sizing.py predicts each row's cost from the
tuning's trials and naive's one measurement) —, dropping the runner-up, then the guide's plan, then rounds (never
below 2) where they do not fit, one line each; naive and the tuned plan in 2 rounds may cost more, within what
sizing.py's `least_allowance` allows. When not even that fits there is no side-by-side (comparison.json:
`side_by_side: null` and the `reason`) and no before/after ratio: the training run and naive's one measurement,
minutes apart, are shown as measured, not divided. The output says what tuning cost (measured), what it is predicted
to save (labelled), and the measured total. A tuned (or cached) plan measured slower than another plan in every
round is not trained, and that faster plan replaces it in the cache, so the next run of the job does not reuse a
plan found slower here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.text import Text

from saturate.atomic import atomic_write_bytes
from saturate.engine.console import say_stopped, tidy_console
from saturate.engine.distributed import DistInfo, broadcast_object, init_distributed, teardown_distributed
from saturate.engine.live import stage
from saturate.engine.trainer import RunConfig, RunResult, train
from saturate.errors import ConfigError, file_not_folder
from saturate.plan import Plan, informed_choices, reference_plan
from saturate.policy import POLICY
from saturate.run.cached import cache_holds, cached_plan, recache  # noqa: F401 - recache: tests
from saturate.run.costs import say_costs, untuned_line
from saturate.run.first_steps import FirstSteps, train_first
from saturate.run.informed import informed_plan
from saturate.run.side_by_side import (  # noqa: F401 - Row, compare: the side-by-side's API, kept importable here
    Comparison,
    Row,
    at_effective_batch,
    choose_trained,
    compare,
    row_mfu,
    runner_up,
    same_settings,
)
from saturate.run.sizing import (  # noqa: F401 - the budget's constants, kept importable here
    Sizing,
    budget_rule,
    measured_once,
    measured_step,
    once_verdict,
    side_by_side,
    tuning_budget,
)
from saturate.run.table import comparison_table, same_peak
from saturate.stats.noise import WindowRule
from saturate.tune.api import TuneResult, no_empty_folders, tune
from saturate.tune.measure import RealMeasurer
from saturate.tune.trial import BudgetTooSmall, Trial
from saturate.workloads.base import Workload

# The guide whose "after" plan applies, by device kind (shared/GUIDES.md): the A6000 guide for one
# NVIDIA GPU, the ROCm guide for AMD. On a CPU no guide applies.
GUIDE_AFTER = {"cuda": "a6000-after", "rocm": "rocm-after"}


@dataclass
class Tuning:
    """Where the plan compared and trained came from, and what that cost."""

    plan: Plan
    result: TuneResult | None  # None: the cached plan was reused
    seconds: float  # measured: the search and the one naive measurement that sized its budget
    budget_s: float | None
    why: str  # one line: the budget and how it was chosen, or the cached plan used
    # The training time predicted before the comparison (a prediction): untuned when the budget followed it; at
    # the cached plan's verified speed when that was reused. It sizes the side-by-side measurements.
    predicted_training_s: float | None = None
    label: str = "tuned"  # "default" when the job was too short for one trial to pay for itself
    naive: Trial | None = None  # naive's one measurement that sized the budget (None: not measured)
    naive_s: float = 0.0  # measured: its wall time (part of `seconds`)
    step_s: float | None = None  # the cached plan's step time when it was measured (its provenance)
    earned_s: float = 0.0  # measured: what the search spent beyond its first budget, out of what it found

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "budget_s": self.budget_s, "why": self.why, "label": self.label,
                "cached": self.result is None and self.label == "tuned",
                "predicted_training_s": self.predicted_training_s,
                "chosen_from_hardware": informed_choices(self.plan) if self.label == "default" else None}



@dataclass
class RunReport:
    rows: list[Row]
    tuned: TuneResult | None  # None when the cached plan was reused
    training: RunResult
    run_dir: Path
    notes: list[str] = field(default_factory=list)
    comparison: Comparison | None = None
    trained: str = "tuned"  # the label of the plan trained (the fastest measured)
    tuning: Tuning | None = None
    timing: dict[str, float | None] = field(default_factory=dict)  # seconds measured, and predictions (predicted_…)


@dataclass
class _Trained:
    """What run() reports of the plan it chose and trained: the tuning, the side-by-side, the training."""

    tuning: Tuning
    cmp: Comparison | None
    sizing: Sizing
    trained: str  # the label of the plan trained
    verdicts: list[str]  # the lines under the table
    notes: list[str]  # said before training
    timing: dict[str, float | None]
    training: RunResult
    training_started: float  # time.monotonic() when the training run started


def reference_plans(workload: Workload, device_type: str, world_size: int = 1) -> list[tuple[str, Plan]]:
    """The plans the tuned one is compared with, at the workload's effective batch over `world_size`
    processes (DDP when there are several, as the guides ran them)."""
    e = workload.optim.effective_batch // world_size
    out = [("naive", at_effective_batch(reference_plan("naive"), e))]
    # A workload from one of the guides (the time-series job, GPT-2 through Transformers) compares with that
    # guide's plans; otherwise the guide for this kind of device.
    guides = list(workload.guide_plans) or ([GUIDE_AFTER[device_type]] if device_type in GUIDE_AFTER else [])
    for guide in guides:
        out.append((f"guide: {guide}", at_effective_batch(reference_plan(guide), e)))
    strategy = "ddp" if world_size > 1 else "single"
    return [(label, p.replace(strategy=strategy)) for label, p in out if p is not None]


def run(workload: Workload, hardware: Any = None, *, budget_s: float | None = None, steps: int | None = None,
        minutes: float | None = None, run_dir: Path | None = None, allow_batch_change: bool = False,
        seed: int = 0, progress: bool = True, console: Console | None = None,
        try_compile: bool = True, source: dict[str, Any] | None = None,
        allow_micro_batch_change: bool = False) -> RunReport:
    from saturate.hardware import probe

    started = time.monotonic()
    hw = hardware or probe(measure_peaks=False)  # MFU's peak: measured by the training for its precision
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dist = init_distributed(torch.device(hw.torch_device).type)  # under torchrun: every rank, together
    console = console or tidy_console()
    if not dist.is_main:
        console = Console(quiet=True)  # rank 0 reports and writes
    chosen, problem = broadcast_object(_choose_run_dir(run_dir, workload) if dist.is_main else None)
    if problem:
        raise ConfigError(problem)
    run_dir = Path(chosen)
    refs = reference_plans(workload, hw.device_type, dist.world_size)
    tuning_started = time.monotonic()  # before it: probing, the process group, the run folder
    n_steps = steps or workload.optim.steps
    config = RunConfig(steps=steps, minutes=minutes, run_dir=run_dir, seed=seed, device=hw.torch_device,
                       progress=progress, source=source)  # source: so `train --resume --run-dir` alone continues
    with no_empty_folders(run_dir):  # a run that fails before writing anything leaves no folder
        first = None
        if budget_s is None and minutes is None and not allow_batch_change and not broadcast_object(
                cache_holds(workload, hw, dist.world_size, try_compile) if dist.is_main else None):
            first = train_first(workload, hw, dist, n_steps, config, console)  # first_steps.py
        if first is not None and not first.paused:  # the whole job (too short to tune), or stopped by a signal
            done, first = _untuned_first(first, setup_s=tuning_started - started, started=tuning_started), None
        else:
            done = _tuned(workload, hw, dist, refs, first, config, budget_s=budget_s, minutes=minutes,
                          allow_batch_change=allow_batch_change, seed=seed, console=console, try_compile=try_compile,
                          allow_micro_batch_change=allow_micro_batch_change, started=started,
                          tuning_started=tuning_started)
    tuning, cmp, training, trained, timing = done.tuning, done.cmp, done.training, done.trained, done.timing
    session_from = first.result.steps if first is not None else 0  # the steps trained before this session
    rows = list(cmp.rows) if cmp is not None else measured_once(workload, hw, tuning.naive, dist.world_size)
    report = RunReport(rows=rows, tuned=tuning.result, training=training, run_dir=run_dir,
                       notes=list(done.notes), comparison=cmp, trained=trained, tuning=tuning, timing=timing)
    report.timing.update(training_s=time.monotonic() - done.training_started + timing.get("first_steps_s", 0.0),
                         training_steps_s=training.train_seconds,
                         total_s=time.monotonic() - started)
    report.rows.append(Row("training run", training.plan, training.samples_per_s, training.tokens_per_s,
                           training.train_seconds / (training.steps - session_from) if training.steps > session_from
                           else None,
                           training.peak_memory_bytes, None,
                           row_mfu(workload, hw, training.plan, training.samples_per_s, dist.world_size),
                           note=f"{report.trained}, {training.steps} steps" + (
                               f" (the first {first.result.steps} with the default plan, while the job was predicted)"
                               if first is not None else "") + (f", validation loss {training.val_loss:.3f}"
                                                               if training.val_loss is not None else "")))
    same_peak(report.rows, workload, hw, dist.world_size)  # one MFU denominator for every row (table.py)
    if cmp is not None and cmp.contention is not None and cmp.contention.significant():  # the top of the output
        console.print(f"[yellow]{cmp.contention.line()}[/yellow] — absolute figures are low; the ratios, measured "
                      f"in {cmp.rounds} interleaved rounds, are fair", highlight=False)
    console.print(comparison_table(report.rows, workload, training.memory_kind, side_by_side=cmp is not None))
    verdicts = done.verdicts if cmp is not None or done.verdicts else once_verdict(report.rows, trained)
    for line in verdicts:
        console.print(line, highlight=False, markup=False)
    report.notes += [f"{r.label}: {r.mfu.text()}" for r in report.rows if r.mfu and r.mfu.exceeds_peak]
    for n in report.notes[len(done.notes):]:  # those about the plan trained were said before training
        console.print(Text.assemble(("note:", "yellow"), f" {n}"))  # a peak's source may hold "[/proc/…]"
    t = report.timing
    console.print(f"measured total: {t['total_s']:.0f} s (tuning {tuning.seconds:.0f} s, side by side "
                  f"{t['side_by_side_s']:.0f} s, training {t['training_s']:.0f} s with validation and checkpoints)"
                  + untuned_line(t, tuning.predicted_training_s if tuning.naive is not None else None, cmp is not None),
                  highlight=False)
    if dist.is_main:
        atomic_write_bytes(run_dir / "comparison.json", (json.dumps(
            {"workload": workload.name, "hardware": hw.to_dict(), "processes": dist.world_size,
             "rows": [r.to_dict() for r in report.rows], **(cmp.to_dict() if cmp else {}),
             "side_by_side": cmp.to_dict() if cmp else None, "reason": done.sizing.skipped,
             "sizing": done.sizing.to_dict(),
             "verdicts": verdicts, "trained": report.trained, "tuning": tuning.to_dict(), "timing": report.timing,
             "plots": [str(p) for p in tuning.result.plots] if tuning.result else [],
             "tuned_plan": str(tuning.result.plan_path) if tuning.result else None}, indent=2, default=str)
            + "\n").encode())
    plots = ", ".join(str(p) for p in tuning.result.plots) if tuning.result else ""
    console.print(f"run folder: {run_dir}  (" + (f"tuned plan {tuning.result.plan_path}; plots: {plots or 'none'}; "
                  if tuning.result else "cached plan; " if tuning.label == "tuned" else "the default plan, untuned; ")
                  + f"comparison {run_dir / 'comparison.json'})")
    if made_group:
        teardown_distributed()
    return report


def _tuned(workload: Workload, hw: Any, dist: DistInfo, refs: list[tuple[str, Plan]], first: FirstSteps | None,
           config: RunConfig, *, budget_s: float | None, minutes: float | None, allow_batch_change: bool, seed: int,
           console: Console, try_compile: bool, allow_micro_batch_change: bool, started: float,
           tuning_started: float) -> _Trained:
    """Tune (or reuse the cached plan), measure side by side, train the fastest — from `first`'s checkpoint when the
    default plan's first steps paused to be tuned (first_steps.py)."""
    run_dir, n_steps = Path(config.run_dir), config.steps or workload.optim.steps  # type: ignore[arg-type]
    tuning = _tune(workload, hw, dist, refs, budget_s=budget_s, steps=n_steps,
                   minutes=minutes, allow_batch_change=allow_batch_change, run_dir=run_dir, seed=seed,
                   console=console, try_compile=try_compile,
                   allow_micro_batch_change=allow_micro_batch_change,
                   first_steps=first if first is not None and first.step_s else None)
    plans = list(refs)
    second = runner_up(tuning.result.search.trials, tuning.plan, [p for _, p in refs]) if tuning.result else None
    if second is not None:
        plans.append(("runner-up", second))
    plans.append((tuning.label, tuning.plan))
    predicted = tuning.predicted_training_s or (minutes * 60 if minutes else None)
    cmp, sizing = side_by_side(workload, hw, dist, tuning, plans, predicted, seed, console, first and first.build_s)
    trained, verdicts, notes = choose_trained(cmp, tuning.label) if cmp is not None else (tuning.label, [], [])
    if cmp is not None and dist.is_main and trained != tuning.label and tuning.label == "tuned":
        notes.append(recache(workload, hw, dist.world_size, tuning.plan, cmp.row(trained)))
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}", highlight=False)
    timing = say_costs(console, cmp, tuning, trained, n_steps, minutes)
    timing.update(setup_s=tuning_started - started, naive_measure_s=tuning.naive_s,
                  predicted_side_by_side_s=sizing.predicted_s, side_by_side_share_s=sizing.share_s)
    training_started = time.monotonic()
    first_s = first.seconds if first is not None else 0.0  # the paused session: training, not tuning
    timing.update(first_steps_s=first_s, before_training_s=training_started - tuning_started - first_s
                  - tuning.seconds - timing["side_by_side_s"])
    training = train(workload, cmp.row(trained).plan if cmp else tuning.plan,  # type: ignore[union-attr]
                     dataclasses.replace(config, resume=first is not None), hardware=hw, on_stopped=say_stopped)
    return _Trained(tuning, cmp, sizing, trained, verdicts, notes, timing, training, training_started)


def _untuned_first(first: FirstSteps, setup_s: float, started: float) -> _Trained:
    """What the report needs of a job the default plan trained whole (first_steps.py): nothing tuned, nothing
    measured side by side (naive was not measured: the job could not pay for it)."""
    tuning = Tuning(first.result.plan, None, 0.0, None, first.why, first.predicted_s, label="default")
    why = ("no side-by-side: the job is too short to pay for measuring naive beside the default plan"
           if first.step_s is not None else "no side-by-side: " + first.why.removeprefix("not tuned: "))
    sizing = Sizing([], 0, 0.0, False, 0.0, None, skipped=why)
    timing: dict[str, float | None] = {"tuning_s": 0.0, "side_by_side_s": 0.0, "setup_s": setup_s,
                                       "predicted_training_s": first.predicted_s, "before_training_s": 0.0}
    return _Trained(tuning, None, sizing, "default", [f"no before/after: {why.removeprefix('no side-by-side: ')}"],
                    [], timing, first.result, started)


def _tune(workload: Workload, hw: Any, dist: DistInfo, refs: list[tuple[str, Plan]], *, budget_s: float | None,
          steps: int, minutes: float | None, allow_batch_change: bool, run_dir: Path, seed: int, console: Console,
          try_compile: bool, allow_micro_batch_change: bool = False, first_steps: FirstSteps | None = None) -> Tuning:
    """The plan to compare and train: the cached one (no `--budget`), else tuned within `--budget` or a budget
    that follows the predicted untuned training time: the default plan's first steps', else naive's, measured here."""
    if budget_s is None and not allow_batch_change:
        notes: list[str] = []
        cached = broadcast_object(cached_plan(workload, hw, dist.world_size, try_compile, notes) if dist.is_main
                                  else None)
        if cached is not None:
            why = (f"using the plan tuned for {workload.name} on this machine "
                   f"({cached.provenance.get('tuned_at', 'date unknown')}): no tuning; --budget tunes again")
            console.print(why)
            for note in notes:
                console.print(f"[yellow]note:[/] {note}")
            verified = (cached.provenance.get("verified_samples_per_s")
                        or cached.provenance.get("measured_samples_per_s"))
            step = cached.samples_per_step(dist.world_size) / verified if verified else None
            predicted = minutes * 60 if minutes else steps * step if step else None
            return Tuning(cached, None, 0.0, None, why, predicted_training_s=predicted, step_s=step)
    started = time.monotonic()
    predicted, naive, naive_s, measurer = None, None, 0.0, None
    why = f"--budget {budget_s:g} s" if budget_s is not None else ""
    if budget_s is None:
        if minutes:
            predicted, source = minutes * 60, f"--minutes {minutes:g}"
        elif first_steps is not None and first_steps.predicted_s:  # what trains untuned: the default plan, timed
            predicted = first_steps.predicted_s
            source = f"{steps} steps at the default plan's {first_steps.step_s:.3g} s/step, timed over its first steps"
        else:
            # One window (a step or a few) after the warm-up, no validation pass: a rough figure sizes the budget.
            # POLICY.payback.naive_warmup steps first: the process's first steps are cold (its reason says how much).
            measurer = RealMeasurer(dataclasses.replace(workload, val_data=None), hw, seed=seed, min_steps=1,
                                    warmup=POLICY.payback.naive_warmup, min_seconds=0.0,
                                    rule=WindowRule(min_windows=1), dist=dist)
            with stage(console, f"measuring naive once, to size the tuning budget for {steps} steps"):
                naive = measurer.verify(dict(refs)["naive"])
            naive_s = time.monotonic() - started
            predicted = steps * naive.step_s if naive.ok and naive.step_s else None
            source = (f"{steps} steps at naive's {naive.step_s:.3g} s/step, measured once" if predicted
                      else f"naive could not be measured ({naive.error})")
        share, floor = budget_rule(informed := bool(first_steps and first_steps.predicted_s and not minutes))
        pay = POLICY.payback
        budgets = tuning_budget(predicted, informed) if predicted else (pay.budget_ceiling_s, pay.budget_ceiling_s)
        if budgets is None:
            return _untuned(workload, hw, dist, started, predicted, naive, naive_s, measurer, console, (
                f"not tuned: the untuned training is predicted at {predicted:.0f} s ({source}); "
                f"{share:.0%} of it is under the {floor:.0f} s a search needs to pay for itself, so "
                "the default plan is compared and trained (--budget tunes anyway)"))
        budget_s, cap_s = budgets
        if budget_s - naive_s < floor:  # sizing the budget spent it (a slow first step, a busy machine)
            return _untuned(workload, hw, dist, started, predicted, naive, naive_s, measurer, console, (
                f"not tuned: the untuned training is predicted at {predicted:.0f} s ({source}); measuring naive "
                f"to predict it took {naive_s:.0f} s of the {budget_s:.0f} s ({100 * share:.0f} %) tuning may cost, "
                f"leaving under the {floor:.0f} s a search needs, so the default plan is compared and trained "
                "(--budget tunes anyway)"), budget_s)
        most = f"{pay.long_base_s:.0f} s + {pay.long_share:.0%}"
        grows = (f"; it grows by half of what the search saves, up to {cap_s:.0f} s ({pay.grown_share:.0%}, at most "
                 f"{most} and {pay.budget_ceiling_s:.0f} s)" if cap_s > budget_s
                 else f" (at most {most} of it and {pay.budget_ceiling_s:.0f} s)")
        why = (f"tuning budget {budget_s:.0f} s: {100 * budget_s / predicted:.0f} % of the untuned training, "
               f"predicted at {predicted:.0f} s ({source})"
               + (f", naive's {naive_s:.1f} s measurement included" if naive_s else "") + grows
               if predicted else f"tuning budget {budget_s:.0f} s ({source})") + "; --budget sets another"
        console.print(why)
    else:
        cap_s = budget_s
    try:
        # No verification trial: the side-by-side measures the plan again, through its real loader. The naive
        # measurement that sized the budget is part of the tuning's cost: the search gets what it left.
        result = tune(workload, hw, budget_s=budget_s - naive_s, planned_steps=steps,
                      allow_batch_change=allow_batch_change, out_dir=run_dir / "tune", seed=seed, console=console,
                      try_compile=try_compile, allow_micro_batch_change=allow_micro_batch_change, verify=False,
                      budget_cap_s=cap_s - naive_s if cap_s > budget_s else None, training_s=predicted, keep=False)
    except BudgetTooSmall as e:  # nothing compared: no change measured, the informed plan as when too short
        return _untuned(workload, hw, dist, started, predicted, naive, naive_s, measurer, console, (
            f"not tuned: the {budget_s:.0f} s this job can pay for does not hold one trial ({e}); the default "
            "plan is compared and trained instead (--budget tunes anyway)" if predicted else
            f"not tuned, no change measured: {e}; the default plan is compared and trained instead"), budget_s)
    seconds, earned = time.monotonic() - started, 0.0
    if cap_s > budget_s and result.search.budget_s is not None and result.search.budget_s > budget_s - naive_s:
        earned = max(0.0, seconds - budget_s)  # the side-by-side's allowance beyond its share comes after this
        budget_s = result.search.budget_s + naive_s
    return Tuning(result.plan, result, seconds, budget_s, why, predicted, naive=naive, naive_s=naive_s,
                  earned_s=earned)


def _untuned(workload: Workload, hw: Any, dist: DistInfo, started: float, predicted: float | None,
             naive: Trial | None, naive_s: float, measurer: Any, console: Console, why: str,
             budget_s: float | None = None) -> Tuning:
    """The default plan (chosen from the hardware, sized and guarded by naive's measurement: informed.py), untuned,
    and the lines that say why and what it chose."""
    console.print(f"[yellow]{why}[/yellow]", highlight=False)
    plan = informed_plan(workload, hw, dist.world_size, naive, measurer, console)
    return Tuning(plan.replace(name="default"), None, time.monotonic() - started, budget_s, why, predicted,
                  label="default", naive=naive, naive_s=naive_s)


def _choose_run_dir(run_dir: Path | None, workload: Workload) -> tuple[str, str | None]:
    """The run folder, and why it cannot be used (None when it can)."""
    path = Path(run_dir) if run_dir else Path("runs") / f"{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return str(path), file_not_folder(path, "run folder", "--run-dir", empty=True)


