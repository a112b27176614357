"""What `saturate run` says tuning cost (measured) and saved (predicted), and the measured total.

A run predicts the untuned training twice, from two measurements of naive: once before tuning (one short
measurement, cold and under whatever load met it; it sizes the tuning budget), and again from naive's side-by-side
speed (measured in rounds with the other plans). They can differ twofold on a busy machine (2372 s and 1047 s in one
run), so each prediction printed names the measurement it comes from, and the total line says both when they
differ (`untuned_line`).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from saturate.policy import POLICY
from saturate.run.side_by_side import Comparison, same_settings
from saturate.run.sizing import measured_step

ONCE = "naive's one measurement before tuning"
SIDE_BY_SIDE = "naive's side-by-side speed"


def say_costs(console: Console, cmp: Comparison | None, tuning: Any, trained: str, steps: int,
              minutes: float | None) -> dict[str, float | None]:
    """What tuning cost (measured) and what it is predicted to save (from the measured speeds: side by side, or
    naive's one measurement and the plan's tuning trial when there was no side-by-side); the figures. `tuning` is
    flow.py's `Tuning`."""
    if cmp is not None:
        naive, row = cmp.row("naive"), cmp.row(trained)
        naive_step, step = naive.step_s if naive else None, row.step_s if row else None
        source = f"naive's and {trained}'s side-by-side speeds"
    else:
        naive_step = tuning.naive.step_s if tuning.naive is not None and tuning.naive.ok else None
        step = measured_step(tuning.result.search.trials, tuning.plan) if tuning.result else tuning.step_s
        source = "naive's one measurement and the plan's " + ("tuning trial" if tuning.result else "cached speed")
    cost = (f"tuning cost {tuning.seconds:.0f} s" + (" (a cached plan)" if tuning.to_dict()["cached"] else "")
            + (f", measuring side by side {cmp.seconds:.0f} s" if cmp is not None else ", no side-by-side"))
    timing: dict[str, float | None] = {"tuning_s": tuning.seconds, "side_by_side_s": cmp.seconds if cmp else 0.0}
    trained_plan = cmp.row(trained).plan if cmp is not None and cmp.row(trained) else tuning.plan
    naive_plan = cmp.row("naive").plan if cmp is not None and cmp.row("naive") else \
        tuning.naive.plan if tuning.naive is not None else None
    if naive_plan is not None and same_settings([("naive", naive_plan), (trained, trained_plan)]):
        # Two measurements of the same settings differ by noise alone: that is no saving.
        timing.update(predicted_saving_s=0.0)
        console.print(f"{cost}; no saving: {trained} has naive's settings", highlight=False)
    elif not (naive_step and step):
        console.print(f"{cost}; no saving predicted (naive or the trained plan was not measured)", highlight=False)
    elif minutes:
        extra = minutes * 60 / step - minutes * 60 / naive_step
        timing["predicted_extra_steps"] = extra
        console.print(f"{cost}; predicted: {extra:,.0f} more steps in {minutes:g} min than untuned (a prediction "
                      f"from {source})", highlight=False)
    else:
        untuned, tuned = steps * naive_step, steps * step
        timing.update(predicted_untuned_s=untuned, predicted_saving_s=untuned - tuned)
        console.print(f"{cost}; predicted saving over {steps} steps: {untuned - tuned:,.0f} s ({untuned:,.0f} s "
                      f"untuned → {tuned:,.0f} s with {trained}; a prediction from {source})",
                      highlight=False)
    return timing


def untuned_line(timing: dict[str, Any], before_tuning_s: float | None, side_by_side: bool) -> str:
    """The end of the total line: the untuned training's prediction with the measurement it comes from, and the one
    made before tuning from naive's one measurement when that is another figure (`POLICY.payback.untuned_apart` of
    it apart or more); "" when nothing was predicted. `before_tuning_s`: `Tuning.predicted_training_s` when naive
    sized the budget; `side_by_side`: the prediction in `timing` is from the side-by-side (else from naive's one
    measurement)."""
    after = timing.get("predicted_untuned_s")
    if not after:
        return ""
    line = (f"; the untuned training is predicted at {after:.0f} s from {SIDE_BY_SIDE if side_by_side else ONCE} "
            "(a prediction)")
    if side_by_side and before_tuning_s and abs(before_tuning_s - after) >= POLICY.payback.untuned_apart * after:
        line += (f"; {ONCE}, which sized the budget, predicted {before_tuning_s:.0f} s (another measurement: cold, "
                 "under the load of its moment)")
    return line
