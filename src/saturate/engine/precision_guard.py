"""A lower precision chosen from the hardware, checked inside training (issue 30: fast from the first step).

The default plan turns on bf16 where the hardware runs it natively, without measuring it first. Its guard is
taken from the training itself rather than from a separate short run: before each of the first
`POLICY.job.guard_steps` optimizer steps, one micro-batch (the run's first: the samples its first step trains
on) goes through the model twice at the weights of that moment, under no_grad and in eval mode (no dropout) — in
the plan's precision and in fp32. Their losses must agree within `POLICY.job.loss_tolerance` of the loss's
scale (the larger of fp32's loss there and its first: `loss_drift`, the tuner's check too); when they do not, the
run goes on in fp32 from the next step, the plan (plan.toml, the checkpoints') saying so. When they do, the plan's
provenance records the figure.

Why losses at the same weights and not two short runs' curves (the tuner's check, and this guard before): the
difference between them is the precision's error and nothing else — two runs drift apart by their updates too —,
and it costs two forwards of one micro-batch per checked step (an fp32 forward is ~1/3 of an fp32 step) instead of
a second build and warm-up. What it does not see is an error only the backward makes (fp16 gradients underflowing
without a scaler: GradScaler is used for fp16; a non-finite loss or state stops the run as before).

Every rank checks the same samples at the same (replicated or gathered) weights, so they decide alike without a
collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from saturate.engine.precision import Precision
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.provenance import Origin, mark, origin


def needs_guard(plan: Plan) -> bool:
    """Whether `plan` runs a lower precision chosen from the hardware and not yet checked (by this guard or a
    measurement): the default plan's bf16, not a tuned plan's or one the user wrote."""
    return (plan.precision != "fp32" and bool((plan.provenance or {}).get("informed"))
            and origin(plan.provenance, "precision") is Origin.HARDWARE)


def loss_drift(losses: list[float], reference: list[float]) -> float:
    """Largest per-step difference between two loss curves, as a share of the loss's scale.

    The scale at a step is the larger of the reference's loss there and its first loss: early on
    this is the relative difference, and once the loss has fallen near zero (a ResNet at ~0.1 from
    2.3) a difference of 0.04 counts as 0.04 / 2.3 = 1.7 %, not as 40 % of a tiny number — both
    runs learned the same thing. A lower precision that diverges (its loss stops falling or grows)
    differs by a large share of the first loss and is still caught; a non-finite loss is infinite.
    """
    n = min(len(losses), len(reference))
    if n == 0:
        return float("inf")
    if not all(math.isfinite(x) for x in losses[:n]):
        return float("inf")
    first = abs(reference[0])
    return max(abs(a - b) / max(abs(b), first, 1e-8) for a, b in zip(losses[:n], reference[:n], strict=True))


class PrecisionGuard:
    """The checks of one run: `check` before each of the first steps, then `verdict` once."""

    def __init__(self, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 steps: int = POLICY.job.guard_steps, tolerance: float = POLICY.job.loss_tolerance) -> None:
        self.batch, self.loss_fn, self.steps, self.tolerance = batch, loss_fn, steps, tolerance
        self.low: list[float] = []
        self.fp32: list[float] = []

    def due(self) -> bool:
        return len(self.low) < self.steps

    @torch.no_grad()
    def check(self, model: nn.Module, precision: Precision) -> None:
        """Both losses of the guard's micro-batch at `model`'s weights now (one host sync each)."""
        was_training = model.training
        model.eval()
        try:
            with precision.autocast():
                self.low.append(float(self.loss_fn(model, self.batch).float()))
            self.fp32.append(float(self.loss_fn(model, self.batch).float()))
        finally:
            model.train(was_training)

    def verdict(self, plan: Plan) -> tuple[Plan, str]:
        """The plan to go on with (fp32 when the lower precision drifted) and the line that says why."""
        d, n = loss_drift(self.low, self.fp32), len(self.low)
        prov = dict(plan.provenance or {})
        if d <= self.tolerance:
            mark(prov, "precision", Origin.MEASURED, f"{prov.get('precision', plan.precision)}; at the weights of "
                 f"its first {n} steps its loss was within {100 * d:.2f} % of fp32's (measured, the guard)")
            return plan.replace(provenance=prov), (
                f"guard: {plan.precision}'s loss within {100 * d:.2f} % of fp32's at the weights of the first {n} "
                "steps (measured)")
        said = "not finite" if math.isinf(d) else f"{100 * d:.1f} % from fp32's"
        mark(prov, "precision", Origin.MEASURED, f"fp32: {plan.precision}'s loss was {said} at the weights of its "
             f"first {n} steps (> {100 * self.tolerance:.0f} %; measured, the guard)")
        return plan.replace(precision="fp32", provenance=prov), (
            f"guard: {plan.precision} rejected, its loss was {said} at the weights of the first {n} steps "
            f"(> {100 * self.tolerance:.0f} %, measured); fp32 from step {n}")
