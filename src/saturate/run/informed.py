"""The plan `saturate run` trains when a job is too short to tune: the informed starting plan, guarded.

`plan.default_plan` chooses from the hardware alone (native bf16, TF32, the fused optimizer, the loader). Here,
where naive was measured once to size the tuning budget, that measurement adds two things before training:

- the micro-batch: naive's measured peak memory, in proportion to the micro-batch, predicts the largest that
  fits within `POLICY.job.headroom` (the tuner's upper-bound rule, `engine.grow.largest_proportional`: peak =
  fixed + per sample, both ≥ 0), so the informed plan takes the largest divisor of the per-process batch within it
  — on a GPU; on a CPU memory only lowers the rule's 8, or 16 in bf16 for short samples (`plan.default_plan`);
- the guard, one short measurement of the informed plan on the same samples from the same weights (the same
  measurer as naive's): a lower precision is kept only when its first losses are within
  `POLICY.job.loss_tolerance` of fp32's (`search.loss_drift`, the tuner's check), and a larger micro-batch with
  it only when its first steps ran within the memory limit. What the guard measured is said in the plan's
  provenance beside what was chosen from the hardware; a plan that fails its guard entirely falls back to naive's
  settings.

The guard runs only for a lower precision (its losses need checking; its memory is checked on the way): a larger
micro-batch alone is not measured, since the proportional bound is an upper bound on its memory — the tuner's
memory stage runs no trial either when every candidate fits by it — and on a GPU an out-of-memory step halves the
micro-batch while training. On a job this short a measurement costs a share of the training.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from saturate.engine.grow import largest_proportional
from saturate.engine.live import stage
from saturate.plan import Plan, informed_summary
from saturate.policy import POLICY
from saturate.provenance import Origin, mark, origin
from saturate.tune.start import loss_drift
from saturate.tune.state import gib
from saturate.tune.trial import Trial
from saturate.workloads.base import Workload
from saturate.workloads.coupling import workload_default_plan


def informed_plan(workload: Workload, hw: Any, world_size: int, naive: Trial | None, measurer: Any = None,
                  console: Console | None = None) -> Plan:
    """The default plan for a job not tuned, sized and guarded by naive's one measurement where there is one
    (`measurer`: the one that measured it, a `RealMeasurer`); said on `console`: its settings, labelled, and what
    the guard found."""
    plan, lines = _guarded(workload, hw, world_size, naive, measurer, console)
    if console is not None:
        console.print(f"the default plan: {informed_summary(plan)}" if plan.provenance.get("informed") else
                      "the default plan: naive's settings", highlight=False)
        for line in lines:
            console.print(f"  {line}", highlight=False)
    return plan


def _guarded(workload: Workload, hw: Any, world_size: int, naive: Trial | None,
             measurer: Any, console: Console | None = None) -> tuple[Plan, list[str]]:
    measured = naive is not None and naive.ok and measurer is not None
    cap, limit = None, None
    if measured and naive.peak_memory_bytes and getattr(measurer, "memory_capacity", None) is not None:  # type: ignore[union-attr]
        headroom = POLICY.job.headroom
        limit = int(measurer.memory_capacity * headroom)
        m0, peak = naive.plan.micro_batch, naive.peak_memory_bytes  # type: ignore[union-attr]
        cap = (largest_proportional(peak, m0, limit),
               f"naive's measured peak, {gib(peak)} {measurer.memory_kind} at micro-batch {m0}, in proportion to the "
               f"micro-batch within {gib(limit)} ({100 * headroom:.0f} % of what is free): a prediction")
    plan, _ = workload_default_plan(workload, hw, world_size, memory_cap=cap)
    if not measured:
        return plan, []
    lower = plan.precision != "fp32"
    larger = plan.micro_batch > naive.plan.micro_batch  # type: ignore[union-attr]
    if not lower:  # the micro-batch alone: the proportional bound is an upper bound, trusted as the tuner trusts it
        return plan, []
    with stage(console, "measuring the default plan once (its losses and memory checked)"):
        guard = measurer.verify(plan)
    prov, lines = dict(plan.provenance), []
    too_big = guard.status == "oom" or (larger and limit is not None and guard.peak_memory_bytes is not None
                                        and guard.peak_memory_bytes > limit)
    if too_big and larger:
        rule, _ = workload_default_plan(workload, hw, world_size)
        peak = "ran out of memory" if guard.status == "oom" else f"peaked at {gib(guard.peak_memory_bytes)}"
        mark(prov, "micro_batch", origin(rule.provenance, "micro_batch") or Origin.MEASURED,
             f"{rule.provenance['micro_batch']}; the predicted {plan.micro_batch} {peak} in its first steps "
             "(measured, the guard)")
        lines.append(f"guard: micro-batch {plan.micro_batch} {peak} in its first steps (measured); "
                     f"{rule.micro_batch} × {rule.grad_accum} instead")
        plan = plan.replace(micro_batch=rule.micro_batch, grad_accum=rule.grad_accum)
    elif not guard.ok:
        lines.append(f"guard: the plan chosen from the hardware failed in its first steps ({guard.error}); "
                     "naive's settings instead")
        return naive.plan.replace(name="default", provenance={  # type: ignore[union-attr]
            "guard": f"the plan chosen from the hardware failed in its first steps: {guard.error} (measured)"}), lines
    elif larger and guard.peak_memory_bytes is not None:
        prov["micro_batch"] += f"; its first steps peaked at {gib(guard.peak_memory_bytes)} (measured, the guard)"
    if lower and guard.ok:
        drift = loss_drift(guard.losses, naive.losses) if naive.losses else None  # type: ignore[union-attr]
        steps = min(len(guard.losses), len(naive.losses))  # type: ignore[union-attr]
        if drift is None:
            prov["precision"] += "; not checked against fp32's losses (none recorded)"
        elif drift > POLICY.job.loss_tolerance:
            tolerance = 100 * POLICY.job.loss_tolerance
            mark(prov, "precision", Origin.MEASURED, f"fp32: {plan.precision}'s first {steps} losses differed from "
                 f"fp32's by up to {100 * drift:.1f} % (> {tolerance:.0f} %; measured, the guard)")
            lines.append(f"guard: {plan.precision} rejected, its first {steps} losses differ from fp32's by up to "
                         f"{100 * drift:.1f} % (measured); fp32 instead")
            plan = plan.replace(precision="fp32")
        else:
            mark(prov, "precision", Origin.MEASURED, prov["precision"] + f"; its first {steps} losses are within "
                 f"{100 * drift:.2f} % of fp32's (measured, the guard)")
            lines.append(f"guard: {plan.precision}'s first {steps} losses within {100 * drift:.2f} % of fp32's "
                         "(measured)")
    return plan.replace(provenance=prov), lines
