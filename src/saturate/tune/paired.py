"""Two plans timed in alternating windows: a comparison that a busy machine cannot flip.

Two trials taken seconds apart differ by more than either one's windows show: on a busy machine a plan
that one trial reads slower beyond the noise can be faster side by side under the same load, and a climb
that believes the trial stops short (measured: bench/results/cpu-2026-11-23c/README.md).
Whatever the load does, it does to windows a second apart alike. So where a comparison is not
decisive (`SearchState.beats`), both plans are built together and timed in alternating windows,
each pair giving the ratio B ÷ A of two windows side by side, which one first drawn at random
for each pair (`stats.pairs.pair_order`: neither a steady drift nor a load with a period favours
either). The decision rests on the median of those ratios and its distribution-free interval
(stats/pairs.py: `median_interval`, `paired_comparison`, when to stop): faster when the whole
interval is above 1, and by more than the minimum gain. This module builds and times the two plans.

Used on a CPU in one process, for eager plans: a GPU's trials are not sliced with other processes'
the same way, two plans held at once could exceed device memory the candidate was sized against,
and a compiled plan would be compiled again.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from saturate.engine.step import Stepper
from saturate.hardware import synchronize
from saturate.hardware.contention import ContentionMeter
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.stats.noise import SHORT_TRIALS_ENV
from saturate.stats.pairs import MAX_PAIRS, MIN_PAIRS, pair_order, settled
from saturate.tune.process import release
from saturate.tune.trial import Trial, first_line, is_oom

# Under the testing knob (stats/noise.py: flows whose figures no test judges) pairs are one step a window, 3 at least,
# and at most 1 timed second.
SHORT = {"min_pairs": 3, "window_s": 0.0, "cap_s": 1.0}


def predicted_seconds(a: Trial, b: Trial) -> float:
    """What timing `a` and `b` in pairs is predicted to take at the least, from their trials: building and warming
    up each (its trial's time beyond its timed steps), then `MIN_PAIRS` pairs of windows (each at least
    `POLICY.windows.window_s`, and at least one step)."""
    def window(t: Trial) -> float:
        return max(POLICY.windows.window_s, t.step_s or 0.0)

    def setup(t: Trial) -> float:
        return max(0.0, t.seconds - t.steps * (t.step_s or 0.0))

    return setup(a) + setup(b) + MIN_PAIRS * (window(a) + window(b))


@dataclass
class Pairs:
    """What alternating windows measured: each plan's trial (its windows) and the per-pair ratios B ÷ A."""

    a: Trial
    b: Trial
    ratios: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.a.ok and self.b.ok and len(self.ratios) > 1  # one ratio has no spread


@dataclass
class _Side:
    trial: Trial  # the plan's trial in the pairs, filled from its windows
    stepper: Stepper
    batches: Iterator[Any]
    steps: int  # per window
    rates: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def measure_pairs(m: Any, a: Trial, b: Trial, stage: str, *, cap_s: float | None,
                  min_gain: float, one_sided: bool = False) -> Pairs:
    """With `m` a RealMeasurer (measure.py): build `a`'s and `b`'s plans (eager, from the same seed), warm each
    up, then time them in alternating windows (module docstring) until the pairs are `settled` (stats/pairs.py:
    decisive at one of its `CHECKS` — `one_sided`: or `b` cannot be faster —, or `cap_s` timed seconds; at least
    `MIN_PAIRS` pairs), or `MAX_PAIRS`. Each side's steps per window come from its trial's step time (a window of at
    least `POLICY.windows.window_s`). The two trials returned hold each plan's windows, figures and losses."""
    started = time.perf_counter()
    min_pairs, window_s = MIN_PAIRS, max(POLICY.windows.window_s, m.window_s)
    if os.environ.get(SHORT_TRIALS_ENV):
        min_pairs, window_s = SHORT["min_pairs"], SHORT["window_s"]
        cap_s = min(cap_s if cap_s is not None else SHORT["cap_s"], SHORT["cap_s"])
    out = Pairs(Trial(stage=stage, plan=a.plan), Trial(stage=stage, plan=b.plan))
    sides: list[_Side] = []
    meter = ContentionMeter().start()
    try:
        for solo, own in ((a, out.a), (b, out.b)):
            torch.manual_seed(m.seed)  # as every trial: the same weights, so the losses are comparable
            stepper = Stepper(m.workload, solo.plan, m.device, m.workload.optim.lr, notes=[], compile=False,
                              adapt_oom=False, dist=m.dist)
            batches = m._cycled_batches(solo.plan)
            side = _Side(own, stepper, batches, max(1, round(window_s / solo.step_s)) if solo.step_s else 1)
            for _ in range(m.warmup):  # its losses kept, as a trial's are: step for step comparable with them
                m._step(stepper, batches)
                side.losses.append(stepper.take_loss_sum())
            sides.append(side)
            own.peak_memory_bytes = solo.peak_memory_bytes  # its own trial's: with two plans held, not separable
        synchronize(m.device)
        timed, rng = 0.0, random.Random(m.seed)  # seeded: a tune's order of windows is the same run to run
        for _pair in range(MAX_PAIRS):
            for side in pair_order(sides, rng):
                w0 = time.perf_counter()
                for _ in range(side.steps):
                    m._step(side.stepper, side.batches)
                    side.losses.append(side.stepper.take_loss_sum())
                synchronize(m.device)
                took = time.perf_counter() - w0
                timed += took
                side.rates.append(side.steps * side.trial.plan.samples_per_step() / took)
            out.ratios.append(sides[1].rates[-1] / sides[0].rates[-1])
            if settled(out.ratios, min_gain, min_pairs=min_pairs, timed_s=timed, cap_s=cap_s, one_sided=one_sided):
                break
        for side in sides:
            m._summarise(side.trial, side.trial.plan, side.rates)
            side.trial.steps = len(side.losses) - m.warmup  # timed steps
            side.trial.losses = [round(float(v), 5) for v in torch.stack(side.losses).tolist()]
    except Exception as e:
        for t in (out.a, out.b):
            t.status, t.error = ("oom" if is_oom(e) else "failed"), first_line(e)
            t.samples_per_s = t.spread = t.step_s = None
        out.ratios.clear()
    finally:
        sides.clear()
        gc.collect()
        release(m.device)
    seen = meter.stop()
    out.seconds = time.perf_counter() - started
    for t in (out.a, out.b):
        t.busy_cores, t.contended = seen.other_cores, seen.significant()
        t.seconds = out.seconds / 2  # each plan's share: what a trial of it is predicted to take (state.longest)
    return out


class Pairing:
    """What a measurer needs to time two plans in pairs (RealMeasurer inherits it; kept here so that paired.py and
    measure.py do not import each other)."""

    device: torch.device
    dist: Any

    def can_pair(self, a: Plan, b: Plan) -> bool:
        """Whether two plans can be timed in alternating windows here: on a CPU, in one process, both eager."""
        return self.device.type == "cpu" and self.dist.world_size == 1 and a.compile == b.compile == "none"

    def paired(self, a: Trial, b: Trial, stage: str, *, cap_s: float | None, min_gain: float,
               one_sided: bool = False) -> Pairs:
        """`a`'s and `b`'s plans built together and timed in alternating windows (`measure_pairs`)."""
        return measure_pairs(self, a, b, stage, cap_s=cap_s, min_gain=min_gain, one_sided=one_sided)
