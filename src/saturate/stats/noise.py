"""How well a trial's throughput is known: timed windows, their median and spread, and when to stop.

A trial is timed in repeated windows (each a few steps, or batches for a loader trial). Its figure
is the median of the windows' throughputs and its spread the relative half-range of those windows,
`(max - min) / (2 · median)`: the median is known to about ± that share. With five windows or
more the single highest and lowest are left out of the spread first (one burst of load, or one
lucky window, does not decide it).

A trial stops (`WindowRule.done`) when its last `min_windows` windows agree within `target`, or at
the cap on windows or timed seconds. The figure reported is over the windows that decided: the
last `min_windows` when they agreed, every window when the cap was reached. Under contention
(another process busy on our cores or GPU) the caps are raised by `busy_factor`, since a busy
machine needs more windows for the same certainty.

Testing knob, not a setting: `$SATURATE_TESTING_SHORT_TRIALS` (any non-empty value) makes `default_rule()`
cap every trial at 4 windows or 1 timed second (2 when busy). The test suite sets it in the environment of
the `saturate` commands it runs to check a flow (tune, run, under torchrun), whose figures it does not
judge; the figures are still measured, with fewer windows. Nothing in saturate sets it; users should not.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Summary:
    """The throughput of a set of windows: median, relative half-range, and how many windows."""

    median: float
    spread: float  # relative half-range: the median is known to about ± this share
    windows: int


def trimmed(values: list[float]) -> list[float]:
    """The values a spread is taken over: sorted, without the single highest and lowest from five values on."""
    return sorted(values)[1:-1] if len(values) >= 5 else sorted(values)


def summarize(rates: list[float]) -> Summary:
    """Median and relative half-range of window throughputs (trimmed of the extremes from five on)."""
    if not rates:
        raise ValueError("no windows to summarise")
    med = statistics.median(rates)
    kept = trimmed(rates)
    spread = (max(kept) - min(kept)) / (2 * med) if med > 0 and len(kept) > 1 else 0.0
    return Summary(median=med, spread=spread, windows=len(rates))


@dataclass
class WindowRule:
    """When a trial has been timed for long enough (see the module docstring)."""

    target: float = 0.015  # the last windows agree within ± this share (a 3 % range)
    min_windows: int = 3
    max_windows: int = 8
    max_seconds: float = 8.0  # timed seconds, whatever the windows say
    busy_factor: float = 2.0  # caps are raised this much when the machine is busy

    def agreed(self, rates: list[float]) -> bool:
        """The last `min_windows` windows agree within the target."""
        return len(rates) >= self.min_windows and summarize(rates[-self.min_windows:]).spread <= self.target

    def warmed(self, rates: list[float]) -> bool:
        """Whether a fresh run has stopped getting faster: its newest window is not faster than its fastest earlier
        one by more than the target (two windows at least). Not `agreed`: on a busy machine windows may never agree
        within ±1.5 %, and waiting for them could take every window a short run had left (measured:
        bench/results/cpu-2026-11-26g/README.md)."""
        return len(rates) >= 2 and rates[-1] <= max(rates[:-1]) * (1 + self.target)

    def capped(self, rates: list[float], seconds: float, busy: bool = False) -> bool:
        factor = self.busy_factor if busy else 1.0
        return len(rates) >= self.max_windows * factor or seconds >= self.max_seconds * factor

    def done(self, rates: list[float], seconds: float, busy: bool | None,
             read_busy: Callable[[], bool]) -> tuple[bool, bool | None]:
        """(whether the windows are enough, whether the machine is busy): they agree, or the cap is reached —
        raised when busy, which `read_busy()` says once, the first time the normal cap is reached (`busy` None:
        not read yet)."""
        if self.agreed(rates):
            return True, busy
        if busy is None and self.capped(rates, seconds):
            busy = read_busy()
        return self.capped(rates, seconds, bool(busy)), busy

    def result(self, rates: list[float]) -> Summary:
        """The figure over the windows that decided: the agreeing last ones, else all of them."""
        return replace(summarize(rates[-self.min_windows:] if self.agreed(rates) else rates), windows=len(rates))


SHORT_TRIALS_ENV = "SATURATE_TESTING_SHORT_TRIALS"  # the testing knob (module docstring)


def default_rule() -> WindowRule:
    """The rule a trial follows unless given one: `WindowRule()`, or the short one of the testing knob."""
    if os.environ.get(SHORT_TRIALS_ENV):
        return WindowRule(max_windows=4, max_seconds=1.0)
    return WindowRule()


def rate_text(samples_per_s: float | None, spread: float | None, unit: str = " samples/s") -> str:
    """"812.3 ±1.2 % samples/s" (no ± when the spread is unknown: a single window)."""
    if samples_per_s is None:
        return "-"
    digits = 1 if samples_per_s < 1000 else 0
    pm = "" if spread is None else f" ±{100 * spread:.1f} %"
    return f"{samples_per_s:,.{digits}f}{pm}{unit}"
