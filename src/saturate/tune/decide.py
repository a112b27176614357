"""The tuner's decisions between two plans: the faster beyond the noise, else the incumbent.

Whether a change is faster is stats/comparison.py's (`compare`: beyond both trials' spreads added
and by more than `min_gain`). A change is taken only when it is faster; otherwise the incumbent is
kept, and the decision says "within noise" when the difference is inside the combined noise. The
search starts from the informed plan (tune/start.py), so the incumbent is either what was chosen from
the hardware for a reason, or what a measurement put there: changing it within the noise would be a
change no measurement supports. (From a naive start the incumbent is also the simpler plan, as
`complexity` weighs them.)
The verification of the chosen plan against its own model trial is checked here too.

Simplicity (`complexity`), the weight of a plan's changes from fp32 eager single-process training
with the unfused optimizer, smallest first:

  fp32 (0) < fused optimizer (1) = fp32+TF32 (1) < bf16 (2) < fp16 with a GradScaler (3)
  < activation checkpointing (3) = FSDP (3) < torch.compile (4); CPU offload adds 1.

A plan's complexity is the sum of its changes' weights; between equally simple plans (two
micro-batches, say) the one already kept stays. The micro-batch and the loader are not weighed:
they change no numerics and no code path.
"""

from __future__ import annotations

from collections.abc import Callable

from saturate.plan import Plan
from saturate.stats.comparison import compare
from saturate.stats.noise import rate_text
from saturate.tune.trial import Trial


def complexity(plan: Plan) -> int:
    """How far a plan is from the simplest one (see the module docstring for the ordering)."""
    precision = {"fp32": 1 if plan.tf32 else 0, "bf16": 2, "fp16": 3}.get(plan.precision, 3)
    return (precision + (1 if plan.fused_optimizer else 0) + (3 if plan.activation_checkpointing else 0)
            + (3 if plan.strategy == "fsdp" else 0) + (1 if plan.cpu_offload else 0)
            + (4 if plan.compile != "none" else 0))


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
