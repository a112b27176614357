"""The informed plan's micro-batch on a GPU, grown from its own first steps' memory (issue 30).

`plan.default_plan` takes up to 16 on a GPU when no memory was measured: it cannot know what fits. On a large GPU 16
can leave most of the memory unused, where a larger micro-batch runs faster (measured:
bench/results/gpu-2026-11-27-h200/README.md) — a run that trains the informed plan (`train` without a plan, a `run`
too short to tune) left that on the table. So after `POLICY.job.grow_after` steps (the second is the first with the
optimizer's state allocated, so the peak holds it), the measured peak in proportion to the micro-batch predicts the
largest that fits within `POLICY.job.headroom` of the device's memory (the tuner's bound, `largest_proportional`: an
upper bound on the memory, peak = fixed + per sample, both ≥ 0), and the micro-batch grows to the largest multiple
of the loader's batch within it that divides the step — the same samples per step, several loader batches joined per
forward (engine/step.py `Stepper.grow`). The guard is the one every GPU step has: an out-of-memory step halves it
and retries the same samples.

Only where the micro-batch was chosen without any memory measured (the rule's "no memory was measured"), on one
CUDA/ROCm process, eager (a compiled model would compile again for the new shape), before any OOM; said in a note
and in plan.toml, labelled a prediction.
"""

from __future__ import annotations

from typing import Any

import torch

from saturate.data.loaders import eval_loader, make_loader
from saturate.engine.distributed import stuck_after_s
from saturate.engine.step import join_batches
from saturate.errors import ConfigError
from saturate.policy import POLICY
from saturate.provenance import Origin, mark, origin


def largest_proportional(peak: int, micro: int, limit: int) -> int:
    """The largest micro-batch whose memory, in proportion to the micro-batch from `peak` bytes measured at
    `micro`, stays within `limit`: an upper bound on the memory (peak = fixed + per sample, both ≥ 0), so what
    it allows fits (a prediction); 0 when not even one sample does. The informed plan (run/informed.py) is
    sized by it too, and `grow_micro_batch` here."""
    return limit * micro // peak if peak > 0 else 2**31


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(Peak bytes allocated so far, bytes this process may use: free + allocated) on a CUDA/ROCm device; None
    elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(torch.cuda.max_memory_allocated(device)), int(free + torch.cuda.memory_allocated(device))


def grow_micro_batch(t: Any) -> None:
    """Grow the micro-batch of `t` (a trainer.Training) when its plan's was chosen without memory (module
    docstring); a note says what was measured and predicted."""
    plan, stepper = t.plan, t.stepper
    if (t.world != 1 or stepper.strategy != "single" or plan.compile != "none" or stepper.adaptations
            or stepper.micro_batch != stepper.plan.micro_batch
            or origin(plan.provenance, "micro_batch") is not Origin.NO_MEMORY):
        return
    memory = device_memory(t.device)
    if memory is None:
        return
    peak, capacity = memory
    m0, per_step = stepper.plan.micro_batch, stepper.plan.micro_batch * stepper.plan.grad_accum
    headroom = POLICY.job.headroom
    limit = int(headroom * capacity)
    bound = largest_proportional(peak, m0, limit)
    fits = [d for d in range(2 * m0, min(bound, per_step) + 1, m0) if per_step % d == 0]
    if not fits:
        return
    try:  # the loader's batches must join (a tensor, or tuples/lists/dicts of them)
        first = next(iter(make_loader(t.workload.train_data, stepper.plan.replace(num_workers=0), start_step=t.step,
                                      pin_memory=False)))
        join_batches([first, first])
    except ConfigError as e:
        t.notes.append(f"step {t.step}: the micro-batch stays {m0} ({e})")
        return
    stepper.grow(fits[-1])
    gib = 2**30
    why = (f"{m0}'s first {POLICY.job.grow_after} steps peaked at {peak / gib:.2f} GiB (measured); in proportion "
           f"to the micro-batch, {fits[-1]} stays within {limit / gib:.2f} GiB ({100 * headroom:.0f} % of the device's "
           f"{capacity / gib:.2f} GiB): a prediction; an out-of-memory step halves it")
    grown = stepper.current_plan()
    t.plan = grown.replace(provenance=mark(dict(plan.provenance), "micro_batch", Origin.PREDICTED,
                                           f"{grown.micro_batch} × {grown.grad_accum}: {why}"))
    t.save_plan()
    if t.val_loader is not None:  # validation at the larger micro-batch too
        t.val_loader = eval_loader(t.workload.val_data, t.plan, t.pin, stuck_after_s())
    line = f"step {t.step}: micro-batch {m0} × {stepper.plan.grad_accum} → {grown.micro_batch} × " \
           f"{grown.grad_accum} (same samples per step): {why}"
    t.notes.append(line)
    t.console.note(line)
