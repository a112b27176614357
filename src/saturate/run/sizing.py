"""How much tuning and side-by-side a `saturate run` can pay for (issue 14: tuning must pay for itself).

Every share, floor and length here is a field of `POLICY.payback` (policy/payback_rules.py), with its reason.

`tuning_budget`: the search's first budget and what it may grow to, from the predicted untuned training:
`tuning_share` of it to begin with (`informed_share` from the informed plan), growing by `saving_share` of what the
search finds (`SearchState.earn`) up to `grown_share`, at most `long_base_s` + `long_share` of it and
`budget_ceiling_s`; a job whose first budget is under the floor (`budget_floor_s`, `informed_floor_s`) is not tuned.

The side-by-side (side_by_side.py) may cost `compare_share` of the predicted training in all: building each
plan, its loader's start, its warm-up steps and every timed measurement of every round. Each row's cost
is predicted from what the run measured already: a plan's step time from the tuning's trial of the same
settings (naive's from its one measurement that sized the budget; a plan nothing measured at naive's, or at
the cached plan's speed when no naive was measured), the fixed cost of building a plan from naive's
measurement (its wall time less its steps), a loader's start from the tuning's loader trials.

When every row × `POLICY.windows.side_by_side_rounds` does not fit the share, rows are dropped in this order: the
runner-up, then the guides' plans (naive and the tuned plan always stay); then rounds, never below `least_rounds`
(a ratio with a range). Naive and the tuned plan in those rounds — the least side-by-side, the only before/after
worth printing — may cost more than the share: up to `least_share` of the predicted training, and no more than the
tuned plan is predicted to save (`least_allowance`). Without it the before/after divided the training run by naive's
one measurement before tuning, minutes apart, which an independent side-by-side did not confirm (`least_share`'s
see), so it is no longer printed. When not even that fits, or what is left is one plan's settings (the tuned plan =
naive, the runner-up dropped), there is no side-by-side (`Sizing.skipped` says why) and no ratio. What fits is then
timed for as long as the share allows, `min_measure_s` to `full_measure_s` per measurement; the busy machine's extra
round (side_by_side.py) only when it fits too. With nothing predicted (`--budget` and `--steps`: naive is not
measured) every row is measured for the full length. Every figure here is a prediction, and each row or round
dropped is one line of `Sizing.dropped`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console

from saturate.engine.distributed import DistInfo
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.run.side_by_side import (
    MAX_STEPS,
    MIN_WINDOWS,
    WARMUP,
    Comparison,
    Row,
    compare,
    knobs,
    row_mfu,
    same_settings,
)
from saturate.tune.trial import LoaderTrial, Trial


def tuning_budget(predicted_training_s: float, informed: bool = False) -> tuple[float, float] | None:
    """(The first tuning budget, what it may grow to) for a job whose untuned training is predicted to take
    `predicted_training_s`; None when the job is too short for a search to pay for itself. `informed`: the search
    starts from the informed plan, which the prediction timed (`POLICY.payback.informed_share`)."""
    share, floor = budget_rule(informed)
    p = POLICY.payback
    cap = min(p.grown_share * predicted_training_s, p.long_base_s + p.long_share * predicted_training_s,
              p.budget_ceiling_s)
    first = min(share * predicted_training_s, cap)
    if first < floor:
        return None
    return first, cap


def budget_rule(informed: bool) -> tuple[float, float]:
    """(The first budget's share of the predicted training, the floor under which nothing is tuned)."""
    p = POLICY.payback
    return (p.informed_share, p.informed_floor_s) if informed else (p.tuning_share, p.budget_floor_s)


@dataclass(frozen=True)
class RowCost:
    """What measuring one row side by side is predicted to cost."""

    label: str
    step_s: float  # seconds per optimizer step (0 for a row measured as another: the same settings)
    build_s: float  # building the plan and starting its loader, before the warm-up steps
    source: str  # where step_s comes from, for the record
    measured: bool = True  # False: nothing measured its settings (step_s is the slowest step known)
    twin_of: str | None = None  # the row it has the same settings as (measured as that row: step_s 0)

    def seconds(self, rounds: int, measure_s: float, resident: bool = True) -> float:
        """Predicted wall time over `rounds` measurements of `measure_s` timed seconds each: one build and warm-up
        when the plan stays built between rounds (off a GPU), one per measurement otherwise."""
        if self.step_s <= 0:
            return 0.0
        build = self.build_s + WARMUP * self.step_s
        timed = rounds * timed_s(self.step_s, measure_s)
        return build + timed if resident else rounds * build + timed


def timed_s(step_s: float, measure_s: float) -> float:
    """The timed seconds of one measurement sized to `measure_s` (side_by_side.py's measurer): windows of whole
    steps, each at least half of it, at least `MIN_WINDOWS` of them and `measure_s` in all, at most `MAX_STEPS`."""
    per_window = max(1, math.ceil(measure_s / MIN_WINDOWS / step_s))
    windows = max(MIN_WINDOWS, math.ceil(measure_s / (per_window * step_s)))
    return min(windows * per_window, MAX_STEPS) * step_s


def measured_step(trials: Sequence[Trial], plan: Plan) -> float | None:
    """The step time the tuning measured for `plan`'s settings (its loader aside): the fastest such trial's,
    memory points (one step) left out; None when no trial had them."""
    key = knobs(plan)
    return min((t.step_s for t in trials if t.ok and t.step_s and t.stage != "memory" and knobs(t.plan) == key),
               default=None)


def row_costs(plans: Sequence[tuple[str, Plan]], naive: Trial | None, trials: Sequence[Trial] = (),
              loader_trials: Sequence[LoaderTrial] = (), known: Mapping[str, float] | None = None, *,
              fixed_s: float = 0.0, peak: Callable[[Plan], float | None] | None = None) -> list[RowCost]:
    """Each row's predicted cost (module docstring): `naive` is its one measurement (None when not measured),
    `trials` and `loader_trials` the tuning's, `known` step times from elsewhere by label (the cached plan's);
    without naive's measurement, `fixed_s` is the cost of building a plan (the default plan's first session's) and
    a row nothing measured is the slowest step known scaled by `peak` (a plan's matmul peak: fp32 naive beside a
    bf16 step is that much slower where the step is compute-bound, less where it is not: an upper bound)."""
    known = dict(known or {})
    naive_step = naive.step_s if naive is not None and naive.ok and naive.step_s else None
    # Naive's measurement: building, its warm-up steps and its timed steps; what is left over is the fixed cost.
    warmup = POLICY.payback.naive_warmup
    fixed = (max(0.0, naive.seconds - (naive.steps + warmup) * naive_step) if naive is not None and naive_step
             else fixed_s)
    twins = same_settings(plans)
    found: dict[str, tuple[float | None, str]] = {}
    for label, plan in plans:
        if label == "naive" and naive_step:
            found[label] = naive_step, "naive's measurement"
        elif (step := measured_step(trials, plan)) is not None:
            found[label] = step, "the tuning's trial"
        elif label in known:
            found[label] = known[label], "the cached plan's measured speed"
    slowest_label = max(found, key=lambda k: found[k][0] or 0.0, default=None)
    slowest = (found[slowest_label][0] or 0.0) if slowest_label is not None else 0.0
    out = []
    for label, plan in plans:
        step, source = found.get(label, (slowest, "nothing measured it: at the slowest step known"))
        if label not in found and peak is not None and slowest_label is not None:
            ratio = _peak_ratio(peak, dict(plans)[slowest_label], plan)
            if ratio is not None and ratio > 1:
                step, source = slowest * ratio, (f"nothing measured it: the slowest step known × {ratio:.2g}, its "
                                                 "precision's matmul peak over this plan's (a prediction)")
        measured = label in found
        if label in twins:
            step, source = 0.0, f"measured as {twins[label]}"
        starts = [t.startup_s for t in loader_trials if t.ok and t.startup_s and t.num_workers == plan.num_workers]
        out.append(RowCost(label, step or 0.0, fixed + (max(starts) if plan.num_workers and starts else 0.0),
                           source, measured, twins.get(label)))
    return out


def _peak_ratio(peak: Callable[[Plan], float | None], measured: Plan, other: Plan) -> float | None:
    try:
        a, b = peak(measured), peak(other)
    except Exception:  # a dtype the device cannot multiply: no scaling
        return None
    return a / b if a and b else None


@dataclass
class Sizing:
    """The side-by-side a job can pay for: the rows kept, the rounds, each measurement's timed seconds."""

    labels: list[str]
    rounds: int
    measure_s: float
    busy_round: bool  # the busy machine's extra round fits in the share too
    predicted_s: float  # the side-by-side's predicted wall time (a prediction)
    share_s: float | None  # what it may cost; None when nothing was predicted
    dropped: list[str] = field(default_factory=list)  # one line per row or round dropped
    skipped: str | None = None  # why there is no side-by-side at all
    rows: list[RowCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rows_kept": self.labels, "rounds_planned": self.rounds, "measure_s": round(self.measure_s, 3),
                "busy_round": self.busy_round, "predicted_s": round(self.predicted_s, 1),
                "share_s": None if self.share_s is None else round(self.share_s, 1),
                "dropped": self.dropped, "skipped": self.skipped,
                "row_costs": [{"label": r.label, "step_s": r.step_s, "build_s": round(r.build_s, 3),
                               "source": r.source} for r in self.rows]}


def least_allowance(rows: Sequence[RowCost], predicted_s: float, spent_s: float = 0.0) -> float:
    """What the least side-by-side may cost for a job whose training is predicted at `predicted_s`:
    `POLICY.payback.least_share` of it, and less than the last row's plan (tuned) is predicted to save over naive,
    less `spent_s` of that saving the search has spent already (`SearchState.earn`); 0 when nothing predicts a saving
    (naive or the plan not measured)."""
    naive = next((r for r in rows if r.label == "naive"), None)
    plan = rows[-1] if rows else None
    if naive is None or plan is None or plan is naive or naive.step_s <= 0 or plan.step_s <= 0 \
            or not (naive.measured and plan.measured):
        return 0.0
    saving = predicted_s * (1 - plan.step_s / naive.step_s) - spent_s
    return max(0.0, min(POLICY.payback.least_share * predicted_s, saving))


def size(rows: list[RowCost], share_s: float | None, rounds: int = POLICY.windows.side_by_side_rounds,
         resident: bool = True, least_s: float = 0.0) -> Sizing:
    """What of `rows` × `rounds` fits `share_s` seconds (module docstring); `resident`: plans stay built; `least_s`:
    what naive and the last row in `least_rounds` rounds may cost when that is over the share (`least_allowance`)."""

    def cost(kept: list[RowCost], n: int, m: float) -> float:
        return sum(r.seconds(n, m, resident) for r in kept)

    p = POLICY.payback
    shortest = p.min_measure_s
    kept, dropped, n = list(rows), [], rounds
    if share_s is None:
        return Sizing([r.label for r in kept], n, p.full_measure_s, True, cost(kept, n, p.full_measure_s), None,
                      rows=rows)
    share = f"its {share_s:.1f} s share, {p.compare_share:.0%} of the predicted training"
    order = [r for r in rows if r.label == "runner-up"] + [r for r in reversed(rows) if r.label.startswith("guide")]
    for r in order:
        if cost(kept, n, shortest) <= share_s:
            break
        dropped.append(f"{r.label}: not measured side by side (with it the side-by-side is predicted at "
                       f"{cost(kept, n, shortest):.1f} s, over {share}; a prediction)")
        kept.remove(r)
    if len([r for r in kept if r.step_s > 0]) <= 1:  # what is left has one plan's settings: nothing to compare
        twins = ", ".join(f"{r.label} has {r.twin_of}'s settings" for r in kept if r.twin_of)
        return Sizing([r.label for r in kept], n, shortest, False, 0.0, share_s, dropped,
                      f"no side-by-side: {twins or 'one plan left'}, nothing to compare within {share}", rows)
    while n > p.least_rounds and cost(kept, n, shortest) > share_s:
        dropped.append(f"{n - 1} rounds instead of {n}: {n} are predicted at {cost(kept, n, shortest):.1f} s, "
                       f"over {share} (a prediction)")
        n -= 1
    if cost(kept, n, shortest) > share_s:
        names = " and ".join(r.label for r in kept if r.step_s > 0)
        least = cost(kept, n, shortest)
        if least <= least_s:
            dropped.append(f"{names} in {n} rounds, the least side-by-side, are predicted at {least:.1f} s, over "
                           f"{share}: measured anyway, within {least_s:.1f} s ({p.least_share:.0%} of the predicted "
                           "training, and under the tuned plan's predicted saving; a prediction)")
            return Sizing([r.label for r in kept], n, shortest, False, least, share_s, dropped, rows=rows)
        why = (f"no side-by-side: {names} in {n} rounds are predicted at {least:.1f} s, over {share}, "
               + (f"and over the {least_s:.1f} s allowed beyond it ({p.least_share:.0%} of the predicted training, "
                  "and under the tuned plan's predicted saving)" if least_s > 0
                  else "and no saving predicted for the tuned plan pays for more"))
        return Sizing([r.label for r in kept], n, shortest, False, 0.0, share_s, dropped, why, rows)
    low, high = shortest, p.full_measure_s  # the longest measurement that still fits
    if cost(kept, n, high) <= share_s:
        low = high
    for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if cost(kept, n, mid) <= share_s else (low, mid)
    return Sizing([r.label for r in kept], n, low, cost(kept, n + 1, low) <= share_s, cost(kept, n, low), share_s,
                  dropped, rows=rows)


def measured_once(workload: Any, hw: Any, t: Trial | None, world: int) -> list[Row]:
    """Without a side-by-side: naive's row from `t`, its one measurement before tuning (none when not measured)."""
    if t is None or not t.ok or not t.samples_per_s:
        return []
    sps = t.samples_per_s * world  # a trial's figure is per process
    return [Row("naive", t.plan, sps, sps * workload.tokens_per_sample, t.step_s, t.peak_memory_bytes, None,
                row_mfu(workload, hw, t.plan, sps, world), note="measured once, before tuning (no side-by-side)",
                rounds=[sps])]


def once_verdict(rows: list[Row], trained: str) -> list[str]:
    """The line under the table without a side-by-side: no ratio — naive's one measurement and the training run were
    taken minutes apart, under whatever load each met (module docstring) — but both figures, each as measured."""
    naive, run = rows[0], rows[-1]
    if naive.label != "naive" or not (naive.samples_per_s and run.samples_per_s):
        return ["no before/after: there was no side-by-side and naive was not measured in this run"]
    if same_settings([("naive", naive.plan), ("run", run.plan)]):
        return [f"training run ({trained}): naive's settings, so no before/after"]
    return [f"no before/after ratio: the training run ({trained}) read {run.samples_per_s:,.1f} samples/s and naive, "
            f"measured once before tuning, {naive.samples_per_s:,.1f} — minutes apart, not side by side, so their "
            "ratio would carry whatever the machine's load did in between"]


def side_by_side(workload: Any, hw: Any, dist: DistInfo, tuning: Any, plans: list[tuple[str, Plan]],
                 predicted: float | None, seed: int, console: Console,
                 fixed_s: float | None = 0.0) -> tuple[Comparison | None, Sizing]:
    """tuned_run.py's `plans` measured side by side as far as `POLICY.payback.compare_share` of the `predicted`
    training pays for them (every row or round dropped said in one line), or None when not even naive and the plan in
    `least_rounds` rounds fit.
    `tuning` is tuned_run.py's `Tuning`: naive's one measurement, the search's trials, the cached plan's step time."""
    from saturate.engine.summary import mfu_peak

    search = tuning.result.search if tuning.result else None
    costs = row_costs(plans, tuning.naive, search.trials if search else (), search.loader_trials if search else (),
                      {tuning.label: tuning.step_s} if tuning.step_s else None, fixed_s=fixed_s or 0.0,
                      peak=None if tuning.naive is not None else lambda p: mfu_peak(hw, p)[0])
    sizing = size(costs, POLICY.payback.compare_share * predicted if predicted else None,
                  POLICY.windows.side_by_side_rounds,
                  resident=torch.device(hw.torch_device).type != "cuda",
                  least_s=least_allowance(costs, predicted, tuning.earned_s) if predicted else 0.0)
    for line in sizing.dropped:
        console.print(f"[yellow]note:[/yellow] {line}", highlight=False)
    if sizing.skipped:
        console.print(f"[yellow]{sizing.skipped}; no before/after ratio[/yellow]", highlight=False)
        return None, sizing
    console.print(f"[bold]Before/after[/bold]: measuring each plan side by side in {sizing.rounds} interleaved "
                  "rounds" + (", one more if the machine is busy" if sizing.busy_round else "") + " (same method, "
                  "this process" + (f"; {dist.world_size} processes" if dist.world_size > 1 else "") + ") …")
    kept = [(label, plan) for label, plan in plans if label in sizing.labels]
    return compare(workload, hw, kept, seed=seed, dist=dist, console=console, min_seconds=sizing.measure_s,
                   rounds=sizing.rounds, busy_round=sizing.busy_round), sizing
