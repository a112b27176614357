
"""What a stage can gain at most, from what the trials measured: a stage not worth measuring is not measured.

A setting that changes one phase of the step can save at most that phase's whole time: a step whose optimizer
takes a share `s` of it runs at most 1 / (1 - s) times faster with any other optimizer kernel. The fused optimizer
(one kernel for every parameter instead of a few per group) changes only the optimizer step, so where the
incumbent's optimizer takes under half of the minimum gain (`POLICY.stages.bound_margin`: the share is itself measured,
over a trial's few timed steps) the other setting cannot be kept, and timing it would only spend the budget: a
small model's optimizer step can take a percent or two of its step while the fused stage's pairs take a large part
of the tuning (measured: bench/results/cpu-2026-11-27f/README.md).

`OptimizerClock` measures the share inside the steps a trial times (engine/step.py's phase timer): on a CPU by
the clock around the optimizer step, on a GPU by a pair of CUDA events (read after the trial's own last
synchronisation: no sync is added to the timed steps).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from saturate.policy import POLICY


def most_gained(share: float) -> float:
    """The largest relative speed-up a change confined to a phase taking `share` of the step can give."""
    return share / (1 - share) if share < 1 else float("inf")


def not_worth(share: float | None, min_gain: float) -> bool:
    """Whether a change confined to a phase of `share` (None: not measured) is bounded under `min_gain` with
    `POLICY.stages.bound_margin` to spare."""
    return share is not None and most_gained(share) * POLICY.stages.bound_margin < min_gain


def bound_text(phase: str, share: float, min_gain: float) -> str:
    """"the optimizer step took 0.7 % of the step (measured): another kernel can gain at most 0.7 %, under 50% of the
    3 % a change must gain"."""
    return (f"the {phase} took {100 * share:.1f} % of the step (measured): another kernel can gain at most "
            f"{100 * most_gained(share):.1f} %, under {1 / POLICY.stages.bound_margin:.0%} of the "
            f"{100 * min_gain:.0f} % a change must gain")


class OptimizerClock:
    """A phase timer (engine/step.py's `Timer`) that adds up the optimizer phase's time; `seconds` once the device
    has synchronised after the last step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, phase: str) -> contextlib.AbstractContextManager:
        return self._timed() if phase == "optimizer" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._events.append((begin, end))
            return
        t0 = time.perf_counter()
        yield
        self._host += time.perf_counter() - t0

    @property
    def seconds(self) -> float:
        return self._host + sum(b.elapsed_time(e) for b, e in self._events) / 1000
