"""The doctor's timed stretch in windows: how long to time, and each figure per window.

A verdict rests on shares of the step (waiting for data, the device idle, …) compared with
thresholds; one figure over one stretch cannot say whether the next run would land on the same side.
So the timed steps are cut into windows of equal step counts (the first window's length in steps is
whatever reaches `window_s`), and `Windows.step_done` says when to stop: after at least `min_steps`
steps and `min_seconds`, when the last windows' step rates agree (stats.noise's `WindowRule`, the
tuner's own rule) or at the rule's cap, raised when other processes kept the machine busy (read
once, when the windows first failed to agree within the normal cap). `split` cuts a stretch of a
fixed length (a user's loop, where the Profiler times the steps it was asked for) into windows
after the fact. `per_window` turns the steps' phase splits into each window's shares; the rules
compare the whole range of a share over the windows with a threshold (findings.Measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from saturate.stats.noise import WindowRule, summarize


@dataclass
class Windows:
    """When the doctor's timed stretch has run long enough (see the module docstring)."""

    min_steps: int = 1
    min_seconds: float = 0.0
    window_s: float = 0.25
    rule: WindowRule = field(default_factory=WindowRule)
    ends: list[int] = field(default_factory=list)  # timed steps at the end of each window
    busy: bool | None = None  # other processes' use, read once when the windows first failed to agree in time

    def step_done(self, steps: int, elapsed: float, step_seconds: Callable[[], list[float]],
                  busy: Callable[[], bool]) -> bool:
        """Called after each timed step (`steps` so far, `elapsed` seconds since timing began): True to stop.
        `step_seconds()` gives every timed step's seconds (read only at a window's end); `busy()` whether
        other processes kept the machine busy."""
        last = self.ends[-1] if self.ends else 0
        if (elapsed < self.window_s) if not self.ends else (steps - last < self.ends[0]):
            return False
        self.ends.append(steps)
        rates = window_rates(step_seconds(), self.ends)
        if steps < self.min_steps or elapsed < self.min_seconds:  # the minimums hold whatever the windows say
            return False
        done, self.busy = self.rule.done(rates, elapsed, self.busy, busy)
        return done


def split(steps: int, windows: int = 5) -> list[int]:
    """Window ends cutting `steps` timed steps into up to `windows` windows of equal step counts (the last one
    takes the remainder)."""
    n = max(1, min(windows, steps))
    size = steps // n
    return [size * (i + 1) for i in range(n - 1)] + [steps] if steps else []


def _bounds(ends: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True) if b > a]


def window_rates(seconds: list[float], ends: list[int]) -> list[float]:
    """Steps per second of each window, from every timed step's seconds."""
    out = []
    for a, b in _bounds(ends):
        total = sum(seconds[a:b])
        if total > 0:
            out.append((b - a) / total)
    return out


def per_window(per_step: list[dict[str, float]], ends: list[int]) -> tuple[list[dict[str, float]], float | None]:
    """(each window's share of the step by phase, the relative half-range of the windows' step rates; None with
    fewer than two windows)."""
    shares = []
    for a, b in _bounds(ends):
        split_ = {p: sum(s[p] for s in per_step[a:b]) for p in per_step[0]}
        total = sum(split_.values())
        if total > 0:
            shares.append({p: v / total for p, v in split_.items()})
    rates = window_rates([sum(s.values()) for s in per_step], ends)
    return shares, (summarize(rates).spread if len(rates) > 1 else None)
