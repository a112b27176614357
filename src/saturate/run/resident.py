"""Plans measured again and again without rebuilding them: the side-by-side's measurer (side_by_side.py).

`ResidentMeasurer.verify(plan)` builds a plan once — the model and optimizer (a Stepper), its real
DataLoader, the warm-up steps — and keeps it; every later call times more steps of that same run.
Interleaved rounds then cost one build and one warm-up per plan, not one per round, and no round
times the first steps after a rebuild (the allocator and kernel caches refilling). Each call is
timed in windows (the rule's minimum, or until `window_cap_s` timed seconds): the noise the
side-by-side reports is between rounds, not within one measurement.

Every plan stays in memory until `close()`, as long as the plans held (each one's peak while it
was built and warmed up, and as much again for the next) fit in `POLICY.payback.held_share` of the memory; past
that, those held are dropped and built again when next measured. side_by_side.py uses it off a GPU
(host memory); on a GPU it rebuilds per measurement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from saturate.data.loaders import make_loader
from saturate.engine.step import Stepper
from saturate.hardware import synchronize
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.tune.measure import RealMeasurer
from saturate.tune.process import PeakMemory, release
from saturate.tune.trial import Trial, first_line, is_oom


@dataclass
class _Held:
    stepper: Stepper
    batches: Iterator[Any]
    peak_memory_bytes: int | None  # what building and warming it up added


class ResidentMeasurer(RealMeasurer):
    """RealMeasurer whose `verify` keeps each plan built between calls (module docstring)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._held: dict[str, _Held] = {}

    def verify(self, plan: Plan) -> Trial:
        """More timed steps of `plan`'s own run, built and warmed up at its first call."""
        trial = Trial(stage="verify", plan=plan)
        started = time.perf_counter()
        key = repr(plan.to_dict() | {"name": None, "provenance": None})
        try:
            held = self._held.get(key) or self._build(plan, key)
            trial.peak_memory_bytes = held.peak_memory_bytes
            losses: list[torch.Tensor] = []
            self._timed_windows(trial, plan, held.stepper, held.batches, losses, None)
            trial.losses = [round(float(v), 5) for v in torch.stack(losses).tolist()]
        except Exception as e:
            trial.status = "oom" if is_oom(e) else "failed"
            trial.error = first_line(e)
            self._held.pop(key, None)
            release(self.device)
        trial.seconds = time.perf_counter() - started
        return self._agreed(trial)

    def _build(self, plan: Plan, key: str) -> _Held:
        peaks = [h.peak_memory_bytes or 0 for h in self._held.values()]
        if peaks and sum(peaks) + max(peaks) > POLICY.payback.held_share * self.memory_capacity:
            self.close()  # another plan would not fit beside those held: they are built again when measured
        torch.manual_seed(self.seed)
        pin = plan.pin_memory and self.device.type == "cuda"
        with PeakMemory(self.device) as mem:
            stepper = Stepper(self.workload, plan, self.device, self.workload.optim.lr, notes=[], compile=False,
                              adapt_oom=False, dist=self.dist)
            batches = iter(make_loader(self.workload.train_data, plan, start_step=0, pin_memory=pin,
                                       rank=self.dist.rank, world_size=self.dist.world_size))
            for _ in range(self.warmup):
                self._step(stepper, batches)
                stepper.take_loss_sum()
            synchronize(self.device)
        held = self._held[key] = _Held(stepper, batches, mem.peak)
        return held

    def close(self) -> None:
        """Drop every plan held (its model, optimizer and loader workers) and give the memory back."""
        self._held.clear()
        release(self.device)
