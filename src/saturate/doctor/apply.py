"""`saturate doctor --apply`: the top fix that is a plan change, applied, and measured the same way.

    applied = diagnose_and_apply(workload, plan, config, hardware)   before, the fix, the new plan, after
    render_applied(applied, console)                                 the predicted gain against the measured one

`plan_fix` picks the highest-ranked fix that changes only the plan and keeps the training the same; `apply_fix`
makes the new plan; both runs are `diagnose()` with the same settings. A speed fix's measured gain is then taken
side by side — the plan before and after in interleaved rounds in this process (run/side_by_side.py, as `saturate
run` compares plans), the median of the per-round ratios with their range — not from the two diagnoses, which
are minutes apart and would read a neighbour's burst as the fix's gain or loss (issue 28). A memory fix's gain is
the ratio of the fix's own metric (`measured_figure`) between the diagnoses: load does not move a peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.doctor.findings import Diagnosis, Fix
from saturate.doctor.report import prediction_text, render
from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.stats.rounds import Ratio
from saturate.workloads.base import Workload

SPEED = ("step_s", "sample_s")  # the metrics a side-by-side measures (same effective batch: the same ratio)


def plan_fix(diagnosis: Diagnosis) -> Fix | None:
    """The highest-ranked fix that is a plan change keeping the training the same."""
    for fix in diagnosis.fixes:
        if fix.changes and fix.same_training:
            return fix
    return None


def apply_fix(plan: Plan, fix: Fix) -> Plan:
    """`plan` with the fix's changes, kept valid (no prefetch or persistence without workers)."""
    changes = dict(fix.changes)
    workers = changes.get("num_workers", plan.num_workers)
    if workers == 0:
        changes.update(prefetch_factor=None, persistent_workers=False)
    try:
        return plan.replace(name=f"{plan.name or 'plan'}+doctor", **changes)
    except (TypeError, SaturateError) as e:
        raise ConfigError(f"the fix {fix.title!r} does not make a valid plan: {e}") from None


@dataclass
class Outcome:
    """Predicted against measured, for the applied fix."""

    fix: Fix
    before: Diagnosis
    after: Diagnosis
    measured_before: float
    measured_after: float
    side_by_side: Ratio | None = None  # after ÷ before samples/s per interleaved round (a speed fix)

    @property
    def diagnoses_gain(self) -> float:
        """The ratio of the two diagnoses' figures (minutes apart)."""
        return self.measured_before / self.measured_after if self.measured_after > 0 else float("nan")

    @property
    def measured_gain(self) -> float:
        """The side-by-side's median ratio where one was measured, else the diagnoses'."""
        return self.side_by_side.median if self.side_by_side is not None else self.diagnoses_gain

    @property
    def predicted_gain(self) -> float | None:
        return self.fix.prediction.gain


def measured_figure(d: Diagnosis, metric: str) -> float | None:
    m = d.measurements
    if metric == "step_s":
        return m.step_s
    if metric == "sample_s":
        return m.step_s / m.samples_per_step if m.samples_per_step else None
    if metric == "host_bytes":
        return None if m.tree_peak is None else float(m.tree_peak)
    if metric == "device_bytes":
        return None if m.device_mem_peak is None else float(m.device_mem_peak)
    raise ValueError(f"unknown metric {metric!r}")


def outcome(fix: Fix, before: Diagnosis, after: Diagnosis, side_by_side: Ratio | None = None) -> Outcome:
    metric = fix.prediction.metric
    a, b = measured_figure(before, metric), measured_figure(after, metric)
    if a is None or b is None:
        raise SaturateError(f"the applied fix's {metric} was not measured in both runs")
    return Outcome(fix, before, after, a, b, side_by_side if metric in SPEED else None)




@dataclass
class Applied:
    """What `--apply` did: the diagnosis before, the fix applied (None: no fix is a plan change), the new plan,
    the diagnosis after and predicted against measured."""

    before: Diagnosis
    fix: Fix | None = None
    plan: Plan | None = None
    after: Diagnosis | None = None
    outcome: Outcome | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.fix is None or self.outcome is None or self.plan is None or self.after is None:
            return {"before": self.before.to_dict(), "applied": None}
        side = self.outcome.side_by_side
        return {"before": self.before.to_dict(), "applied": {"title": self.fix.title, "changes": self.fix.changes},
                "plan": self.plan.to_dict(), "after": self.after.to_dict(),
                "predicted_gain": self.outcome.predicted_gain, "measured_gain": self.outcome.measured_gain,
                "side_by_side": None if side is None else side.to_dict(),
                "diagnoses_gain": self.outcome.diagnoses_gain}


def diagnose_and_apply(workload: Workload, plan: Plan, config: DoctorConfig, hardware: Any = None,
                       before: Diagnosis | None = None, on_apply: Any = None,
                       side_by_side: Callable[[Plan, Plan], Ratio] | None = None) -> Applied:
    """Diagnose `plan` (or take `before`), apply its top plan fix and diagnose the new plan the same way.
    `on_apply(before, fix)` is called before the second run (to show the first diagnosis and what is applied);
    `side_by_side(before, after)` measures a speed fix's gain in interleaved rounds (the caller's: run/side_by_side.py
    `gain_between`, a floor above the doctor)."""
    before = before or diagnose(workload, plan, config, hardware=hardware)
    fix = plan_fix(before)
    if fix is None:
        return Applied(before)
    new_plan = apply_fix(plan, fix)
    if on_apply is not None:
        on_apply(before, fix)
    after = diagnose(workload, new_plan, config, hardware=hardware)
    side = side_by_side(plan, new_plan) if side_by_side is not None and fix.prediction.metric in SPEED else None
    return Applied(before, fix, new_plan, after, outcome(fix, before, after, side))


UNITS = {"step_s": "s/step", "sample_s": "s/sample", "host_bytes": "bytes", "device_bytes": "bytes"}


def render_applied(applied: Applied, console: Any, saved_to: Any = None) -> None:
    """The diagnosis after, then the fix's predicted gain against the measured one, and the new plan."""
    fix, result, plan = applied.fix, applied.outcome, applied.plan
    if fix is None or result is None or plan is None or applied.after is None:
        console.print("--apply: no fix that is a plan change keeping the training the same; nothing to run")
        return
    render(applied.after, console, title="after")
    console.print()
    metric = fix.prediction.metric
    what = "speed-up" if metric in ("step_s", "sample_s") else "memory reduction"
    console.print(f"[bold]{fix.title}[/]")
    console.print(f"  {prediction_text(fix.prediction)}")
    predicted = result.predicted_gain
    side = result.side_by_side
    if side is not None:
        measured_line = (f"  measured side by side ({side.rounds} interleaved rounds): {what} {side.fmt()}"
                         + ("" if side.faster or side.slower else ", within the noise between rounds"))
    else:
        measured_line = (f"  measured: {result.measured_before:.4g} → {result.measured_after:.4g} {UNITS[metric]}, "
                         f"{what} {result.measured_gain:.2f}×")
    if predicted is not None:
        error = result.measured_gain / predicted - 1
        measured_line += f" against {predicted:.2f}× predicted ({100 * error:+.0f} %)"
    console.print(measured_line)
    if side is not None:
        console.print(f"  (the two diagnoses, one after the other: {result.measured_before:.4g} → "
                      f"{result.measured_after:.4g} {UNITS[metric]})")
    if saved_to:
        console.print(f"  plan written to {saved_to}")
    else:
        import tomli_w

        console.print("  the plan (save it with --save-plan FILE):")
        console.print("  " + tomli_w.dumps(plan.to_dict()).replace("\n", "\n  ").rstrip(), markup=False)
