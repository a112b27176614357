"""Two plans timed in alternating windows: a comparison that a busy machine cannot flip.

Two trials taken seconds apart differ by more than either one's windows show: on a 2-core machine
with another process keeping one core busy, the tuner's trials read ±13–22 %, and one tune measured
micro-batch 16×2 at −22.9 % against 8×4 and stopped its climb, although 16×2 and 32×1 were 1.1–1.3×
8×4 measured side by side under the same load (bench/trust.py, docs/benchmarks.md, 2026-11-23).
Whatever the load does, it does to windows a second apart alike. So where a comparison is not
decisive (`SearchState.beats`), both plans are built together and timed in alternating windows,
A B | B A | A B …, each pair giving the ratio B ÷ A of two windows side by side (the order
alternates so that a steady drift favours neither). The decision rests on the median of those
ratios and its distribution-free interval (`median_interval`): faster when the whole interval is
above 1, and by more than the minimum gain.

Used on a CPU in one process, for eager plans: a GPU's trials are not sliced with other processes'
the same way, two plans held at once could exceed device memory the candidate was sized against,
and a compiled plan would be compiled again.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from saturate.engine.step import Stepper
from saturate.hardware import synchronize
from saturate.hardware.contention import ContentionMeter
from saturate.plan import Plan
from saturate.stats.noise import SHORT_TRIALS_ENV
from saturate.tune.decide import Comparison
from saturate.tune.process import release
from saturate.tune.trial import Trial, first_line, is_oom

MIN_PAIRS = 6  # the fewest pairs a decision rests on (six pairs all one way: 97 % confidence)
MAX_PAIRS = 24
CONFIDENCE = 0.90  # of the median's interval: each side is wrong at most 5 % of the time
WINDOW_S = 0.5  # each window at least this long: a longer window averages the load's jitter
CHECKS = (6, 9, 12, 16, 20, 24)  # pair counts at which the windows may stop early (few looks: few false stops)
# Under the testing knob (noise.py: flows whose figures no test judges) pairs are one step a window, 3 at least,
# and at most 1 timed second.
SHORT = {"min_pairs": 3, "window_s": 0.0, "cap_s": 1.0}


def median_interval(ratios: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median of `ratios`: the k-th smallest and k-th largest, with k the
    largest for which the interval holds the true median with at least `confidence` (the sign test's order
    statistics; with six values only their range reaches 90 %). Needs at least two values."""
    n = len(ratios)
    if n < 2:
        raise ValueError("an interval for the median needs at least two values")
    s = sorted(ratios)
    k = 1
    while k + 1 <= n // 2:
        below = sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # P(fewer than k + 1 values below the median)
        if 1 - 2 * below < confidence:
            break
        k += 1
    return s[k - 1], s[n - k]


def predicted_seconds(a: Trial, b: Trial) -> float:
    """What timing `a` and `b` in pairs is predicted to take at the least, from their trials: building and warming
    up each (its trial's time beyond its timed steps), then `MIN_PAIRS` pairs of windows (each at least
    `WINDOW_S`, and at least one step)."""
    def window(t: Trial) -> float:
        return max(WINDOW_S, t.step_s or 0.0)

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
        return self.a.ok and self.b.ok and len(self.ratios) >= 2


def paired_comparison(ratios: list[float], min_gain: float) -> Comparison:
    """B against A from the pairs' ratios: the gain is the median's, the noise the distance from the median to the
    end of its interval nearer 1 — so B is `faster` exactly when the whole interval is above 1 and the median gains
    more than `min_gain` (`slower` alike below)."""
    med = statistics.median(ratios)
    low, high = median_interval(ratios)
    return Comparison(gain=med - 1, noise=(med - low) if med >= 1 else (high - med), min_gain=min_gain,
                      note=pairs_text(ratios))


def decisive(ratios: list[float], min_gain: float) -> bool:
    """Whether the pairs so far settle it: faster or slower beyond the interval and `min_gain`, or the whole
    interval within ±`min_gain` (no difference worth a change)."""
    c = paired_comparison(ratios, min_gain)
    low, high = median_interval(ratios)
    return c.faster or c.slower or (low >= 1 - min_gain and high <= 1 + min_gain)


@dataclass
class _Side:
    trial: Trial  # the plan's trial in the pairs, filled from its windows
    stepper: Stepper
    batches: Iterator[Any]
    steps: int  # per window
    rates: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def measure_pairs(m: Any, a: Trial, b: Trial, stage: str, *, cap_s: float | None,
                  min_gain: float) -> Pairs:
    """With `m` a RealMeasurer (measure.py): build `a`'s and `b`'s plans (eager, from the same seed), warm each
    up, then time them in alternating windows (module docstring) until the pairs are decisive at one of `CHECKS`, or
    `cap_s` timed seconds (at least `MIN_PAIRS` pairs), or `MAX_PAIRS`. Each side's steps per window come from its
    trial's step time (a window of at least `WINDOW_S`). The two trials returned hold each plan's windows, figures
    and losses."""
    started = time.perf_counter()
    min_pairs, window_s = MIN_PAIRS, max(WINDOW_S, m.window_s)
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
        timed = 0.0
        for i in range(MAX_PAIRS):
            for side in sides if i % 2 == 0 else sides[::-1]:
                w0 = time.perf_counter()
                for _ in range(side.steps):
                    m._step(side.stepper, side.batches)
                    side.losses.append(side.stepper.take_loss_sum())
                synchronize(m.device)
                took = time.perf_counter() - w0
                timed += took
                side.rates.append(side.steps * side.trial.plan.samples_per_step() / took)
            out.ratios.append(sides[1].rates[-1] / sides[0].rates[-1])
            n = len(out.ratios)
            if n >= min_pairs and ((n in CHECKS and decisive(out.ratios, min_gain))
                                   or (cap_s is not None and timed >= cap_s)):
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


def pairs_text(ratios: list[float]) -> str:
    """"in 9 alternating pairs: faster in 8, median 1.120× (90 % interval 1.040–1.190×)"."""
    low, high = median_interval(ratios)
    wins = sum(r > 1 for r in ratios)
    return (f"in {len(ratios)} alternating pairs: faster in {wins}, median {statistics.median(ratios):.3f}× "
            f"({100 * CONFIDENCE:.0f} % interval {low:.3f}–{high:.3f}×)")


class Pairing:
    """What a measurer needs to time two plans in pairs (RealMeasurer inherits it; kept here so that paired.py and
    measure.py do not import each other)."""

    device: torch.device
    dist: Any

    def can_pair(self, a: Plan, b: Plan) -> bool:
        """Whether two plans can be timed in alternating windows here: on a CPU, in one process, both eager."""
        return self.device.type == "cpu" and self.dist.world_size == 1 and a.compile == b.compile == "none"

    def paired(self, a: Trial, b: Trial, stage: str, *, cap_s: float | None, min_gain: float) -> Pairs:
        """`a`'s and `b`'s plans built together and timed in alternating windows (`measure_pairs`)."""
        return measure_pairs(self, a, b, stage, cap_s=cap_s, min_gain=min_gain)
