"""The tuner's comparisons, aware of each trial's noise: is a change faster, or within noise?

Two trials' figures are each known to ± their spread (noise.py), so their ratio is known to about
± the sum of the two spreads (ranges add; the sum is the cautious choice). A change is taken only
when its gain exceeds both that combined noise and `min_gain` (a few percent: a smaller gain is not
worth a change even when measured exactly). Otherwise the simpler of the two plans is kept, and
the decision says "within noise" when the difference is inside the combined noise.

Simplicity (`complexity`), the weight of a plan's changes from fp32 eager single-process training
with the unfused optimizer, smallest first:

  fp32 (0) < fused optimizer (1) = fp32+TF32 (1) < bf16 (2) < fp16 with a GradScaler (3)
  < activation checkpointing (3) = FSDP (3) < torch.compile (4); CPU offload adds 1.

A plan's complexity is the sum of its changes' weights; between equally simple plans (two
micro-batches, say) the one already kept stays. The micro-batch and the loader are not weighed:
they change no numerics and no code path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from saturate.plan import Plan
from saturate.stats.noise import rate_text
from saturate.tune.trial import Trial


class Measured(Protocol):
    samples_per_s: float | None
    spread: float | None


@dataclass(frozen=True)
class Comparison:
    """A candidate against the incumbent: the relative gain and what it must beat."""

    gain: float  # candidate / incumbent - 1
    noise: float  # the two spreads together: the ratio is known to about ± this
    min_gain: float
    noise_known: bool = True  # False when a trial had a single window: no spread measured (noise counts 0)
    note: str = ""  # how the decision was reached beyond the two figures (a confirmation), appended to text()

    @property
    def faster(self) -> bool:
        """The candidate is faster beyond the noise and by at least `min_gain`."""
        return self.gain > max(self.noise, self.min_gain)

    @property
    def slower(self) -> bool:
        """The candidate is slower beyond the noise and by at least `min_gain`."""
        return -self.gain > max(self.noise, self.min_gain)

    @property
    def within_noise(self) -> bool:
        return abs(self.gain) <= self.noise

    def said(self, note: str) -> Comparison:
        """The same comparison, its text followed by `note`."""
        return dataclasses.replace(self, note=note)

    def text(self) -> str:
        """The gain and how it compares with the noise, e.g. "+2.0 %, within noise (±5.0 %)"."""
        return self._figures() + (f"; {self.note}" if self.note else "")

    def _figures(self) -> str:
        head = f"{100 * self.gain:+.1f} %"
        if not self.noise_known:  # a one-window trial has no spread: say so rather than "±0.0 %"
            unknown = "noise not measured: one window"
            if abs(self.gain) <= self.min_gain:
                return f"{head}, under the {100 * self.min_gain:.0f} % a change must gain ({unknown})"
            return f"{head} ({unknown})"
        noise = f"±{100 * self.noise:.1f} %"
        if self.within_noise:
            return f"{head}, within noise ({noise})"
        if abs(self.gain) <= self.min_gain:
            return f"{head}, under the {100 * self.min_gain:.0f} % a change must gain (noise {noise})"
        return f"{head}, beyond noise ({noise})"


def compare(candidate: Measured, incumbent: Measured, min_gain: float) -> Comparison:
    """How `candidate`'s samples/s compares with `incumbent`'s, given both trials' spreads."""
    if not candidate.samples_per_s or not incumbent.samples_per_s:
        raise ValueError("compare needs two measured trials")
    return Comparison(gain=candidate.samples_per_s / incumbent.samples_per_s - 1,
                      noise=(candidate.spread or 0.0) + (incumbent.spread or 0.0), min_gain=min_gain,
                      noise_known=candidate.spread is not None and incumbent.spread is not None)


def complexity(plan: Plan) -> int:
    """How far a plan is from the simplest one (see the module docstring for the ordering)."""
    precision = {"fp32": 1 if plan.tf32 else 0, "bf16": 2, "fp16": 3}.get(plan.precision, 3)
    return (precision + (1 if plan.fused_optimizer else 0) + (3 if plan.activation_checkpointing else 0)
            + (3 if plan.strategy == "fsdp" else 0) + (1 if plan.cpu_offload else 0)
            + (4 if plan.compile != "none" else 0))


def keep_candidate(candidate: Trial, incumbent: Trial, min_gain: float) -> tuple[bool, Comparison]:
    """Whether the candidate replaces the incumbent: faster beyond the noise, or as fast and simpler."""
    c = compare(candidate, incumbent, min_gain)
    if c.faster:
        return True, c
    if c.slower:
        return False, c
    return complexity(candidate.plan) < complexity(incumbent.plan), c


def check_verification(chosen: Trial, model: Trial, tolerance: float,
                       again: Callable[[Plan], Trial | None]) -> tuple[Trial, str | None]:
    """The verification against the chosen plan's own model trial: (the trial to keep, a warning or None).

    The verification also reads the real loader, so it may be a little slower (`tolerance`, or the two
    trials' noise if larger); not 40 % slower. Far below, it is measured again (`again`, None when the
    budget has no room); still far below, it stays the chosen plan's figure and the warning says so.
    """
    if chosen.plan.micro_batch != model.plan.micro_batch or not (chosen.samples_per_s and model.samples_per_s):
        chosen.verdict = "chosen"  # backed off after an OOM: no earlier trial of this plan to agree with
        return chosen, None
    c = compare(chosen, model, 0.0)
    for attempt in (1, 2):
        if c.gain >= -max(tolerance, c.noise):
            chosen.verdict = "chosen"
            return chosen, None
        t = again(chosen.plan) if attempt == 1 else None
        if t is None or not t.ok:
            break
        chosen.verdict = (f"{c.text()} vs its model trial ({rate_text(model.samples_per_s, model.spread)}): "
                          "measured again")
        chosen, c = t, compare(t, model, 0.0)
    chosen.verdict = f"chosen, but inconsistent: {c.text()} vs its model trial"
    return chosen, (f"the chosen plan verified at {rate_text(chosen.samples_per_s, chosen.spread)}, {c.text()} "
                    f"against its own earlier trial ({rate_text(model.samples_per_s, model.spread)}), beyond the "
                    f"{100 * tolerance:.0f} % a real loader may cost: the machine was likely busier during one of "
                    "them; its figures are uncertain")
