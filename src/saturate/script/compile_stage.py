"""A plain loop's model compiled from outside (`Overrides.compile`, child/loop_compile.py): tried where the training
the script plans could pay a compilation back, kept only when measured faster and when it does.

How long the script trains is read where it keeps it, as its split is (`child/split_source.length`): a name beside
the training DataLoader's batch size, among a configurator script's globals, or among the integer flags it parsed
from its command line with argparse (`--max_train_steps`), that says optimizer steps
(`cfg.max_steps`, nanoGPT's `max_iters`) gives the planned steps; else one that says epochs, times the optimizer
steps one pass over the training loader makes (its batches over the accumulation). With neither, compile is not
tried, and the decision says so: a compilation costs seconds to minutes before its first step, and pays back only
over a length saturate knows.

Tried only where the planned training at the best speed so far is longer than the least a compilation costs
(`POLICY.payback.compile_least_s`). Kept when it is measured faster (the search's judge, paired where the command
allows), trains as written (every trial's check, same_training.py) and pays back: the planned steps times the
time a compiled step saves exceed what compiling cost — the first compiled step (timed in the child from the
compile call to the end of that step) less a compiled step's own time.
"""

from __future__ import annotations

import math
from typing import Any

from saturate.policy import POLICY
from saturate.script.overrides import Overrides
from saturate.stats.comparison import Verdict


def planned_steps(report: dict[str, Any]) -> tuple[int, str] | str:
    """(the optimizer steps the script plans, what they were read from), or why they could not be read."""
    loader = (report.get("loaders") or [{}])[0]
    places = (report.get("configurator"), loader.get("split"), report.get("argparse"))
    length = next((found["length"] for found in places if found and any((found.get("length") or {}).values())), {})
    steps, epochs = length.get("steps") or {}, length.get("epochs") or {}
    if len(steps) == 1:
        (name, value), = steps.items()
        return value, f"{name} = {value}"
    batches = loader.get("batches_per_epoch")
    if not steps and len(epochs) == 1:
        (name, value), = epochs.items()
        if not batches:
            return f"{name} = {value} epochs of a training loader with no length (a stream)"
        accum = max(1, int(round(report["measurements"].get("grad_accum") or 1)))
        per_epoch = math.ceil(batches / accum)
        return value * per_epoch, f"{name} = {value} epochs of {per_epoch} optimizer steps"
    seen = ", ".join(f"{k} = {v}" for k, v in {**steps, **epochs}.items())
    if seen:
        return f"the names that say how long it trains do not give one length: {seen}"
    return "no setting beside its batch size or flag says how long it trains (max_steps, max_iters, epochs)"


def compile_stage(search: Any, report: dict[str, Any], try_compile: bool = True) -> None:
    """The compile trial of a plain loop (module docstring), or why it is not tried (`try_compile` False:
    `--no-compile`); a decision line either way."""
    result = search.result
    model = report.get("model") or {}
    world = int(report.get("world_size") or 1)
    planned = planned_steps(report)
    if not try_compile:
        why = "--no-compile"
    elif not model:
        why = "no model owning the optimizer's parameters was called in the timed steps"
    elif model.get("compiled") or "OptimizedModule" in (model.get("wrapped_in") or []):
        result.decisions.append("compile: the script compiles its model itself")
        return
    elif world > 1:
        why = f"a command of {world} processes: a DDP-wrapped model is compiled with its own graph breaks, untried here"
    elif isinstance(planned, str):
        why = f"{planned}: a compilation pays back only over a length saturate knows"
    elif (bound := _too_small(result, report)) is not None:
        why = bound
    else:
        steps, said = planned
        best = result.best
        least = POLICY.payback.compile_least_s
        if steps * best.step_s < least:
            why = (f"the {steps} planned steps ({said}) take about {steps * best.step_s:.1f} s at the best speed so "
                   f"far, less than the {least:.0f} s a compilation costs at the least")
        else:
            over = search.with_overrides(Overrides(compile="default"))
            # a compilation still running past the planned training at the best speed (and the trial's own steps)
            # cannot pay back: its runs are stopped there, not waited for (a 200-step LSTM loop compiled for minutes)
            limit = ((best.first_step_s or 0.0) + (steps + search.warmup + search.steps + 2) * best.step_s
                     + search.rule.max_seconds)  # and a trial run alone (not paired) times its windows within it
            search.limit = (over, limit)
            try:
                t = search.consider("torch.compile", over, lambda t: pays_back(t, steps, said))
            finally:
                search.limit = None
            stopped = "" if not t.timed_out else (
                f" (stopped at {limit:.0f} s, the {steps} planned steps ({said}) at the best speed plus the trial's "
                "own: a compilation not done by then cannot pay back)")
            result.decisions.append(f"compile: torch.compile {t.outcome}{stopped}")
            return
    result.decisions.append(f"compile: not tried ({why})")


def _too_small(result: Any, report: dict[str, Any]) -> str | None:
    """Why the forward and backward (what a compiled `forward` and its backward run) are too small a share of the
    best run's step for a compilation to gain the minimum gain (tune/bound.py's bound), or None. Their share is the
    as-written run's (`trainer_stages._compute_share`), taken to the best run's step: its seconds stay where the
    loader stages shortened the wait for data."""
    from saturate.script.trainer_stages import _compute_share
    from saturate.tune.bound import most_gained, not_worth

    share, over = _compute_share(report)
    base, best = result.baseline, result.best
    if share is None or best.step_s <= 0:
        return None
    share = min(1.0, share * base.step_s / best.step_s)
    gain = POLICY.gains.min_gain
    if not not_worth(share, gain):
        return None
    taken = "" if best is base else f", taken to the best run's {1000 * best.step_s:.2f} ms step"
    return (f"forward and backward take {100 * share:.1f} % of the step (measured as written{over}{taken}): a "
            f"compiled model can gain at most {100 * most_gained(share):.1f} %, under "
            f"{1 / POLICY.stages.bound_margin:.0%} of the {100 * gain:.0f} % a change must gain")


def pays_back(t: Any, steps: int, said: str) -> str | None:
    """Why a compiled trial `t` (compared with the best so far: `t.gain`, `t.verdict`) does not pay its compilation
    back over the `steps` planned (`said`: where that was read), or None — None too where it was not measured
    faster: the comparison then says why it is not kept."""
    first = (t.compiled or {}).get("compile_step_s")
    if first is None:
        return "its compilation was not timed (no optimizer step ran after it)"
    if t.verdict != Verdict.FASTER.value or not t.gain:
        return None
    cost = max(0.0, first - t.step_s)
    saved = t.step_s * t.gain  # the best so far's step (t.step_s × (1 + gain)) less a compiled one
    if steps * saved <= cost:
        return (f"{100 * t.gain:.1f} % faster a step, but the {steps} planned steps ({said}) would save "
                f"{steps * saved:.1f} s at {1000 * saved:.2f} ms a step, less than the {cost:.1f} s its compilation "
                "cost")
    paid = (f"its {cost:.1f} s compilation paid back after {math.ceil(cost / saved)} of the {steps} planned steps "
            f"({said})")
    t.note = f"{t.note}; {paid}" if t.note else paid
    return None
