"""Two figures compared, aware of each one's noise: is the candidate faster, slower, or within noise?

Two trials' figures are each known to ± their spread (stats/noise.py), so their ratio is known to about
± the sum of the two spreads (ranges add; the sum is the cautious choice). A change counts only
when its gain exceeds both that combined noise and `min_gain` (a few percent: a smaller gain is not
worth a change even when measured exactly).

The decision is data, `Comparison.verdict` (a `Verdict`); `Comparison.text()` is rendered from it,
so what a decision line says and what the caller decided cannot disagree. Whether the noise was
measured at all (`noise_known`: a one-window trial has no spread, and counts 0) is a field of its
own: with it unknown a gain is still decided, and the text says the noise was not measured.

The tuner (tune/decide.py, tune/state.py), the loader stage and a script's trials
(script/script_trial.py) decide with these; stats/pairs.py builds a Comparison from paired windows.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol


class Measured(Protocol):
    """What a comparison reads of a trial: its figure and that figure's relative spread (None: one window)."""

    samples_per_s: float | None
    spread: float | None


# Rendering only (no decision reads them): a gain of 2x or more, or a noise wider than ±50 %, is said as the ratio
# with its range — "+2040.5 %, beyond noise (±1973.9 %)" (threads=1 under load, 2026-11-29) reads as a precise
# figure with a spread larger than itself, where "21.4× (1.67–41.1×)" says the gain is sure and its size is not
RATIO_GAIN = 1.0
RATIO_NOISE = 0.5


class Verdict(enum.Enum):
    """What a comparison decided about the candidate against the incumbent."""

    FASTER = "faster"  # faster beyond the noise and by more than the minimum gain
    SLOWER = "slower"  # slower beyond the noise and by more than the minimum gain
    WITHIN_NOISE = "within noise"  # the difference is inside the combined noise
    UNDER_MIN_GAIN = "under the minimum gain"  # beyond the noise (or noise unknown), but too small to count


@dataclass(frozen=True)
class Comparison:
    """A candidate against the incumbent: the relative gain and what it must beat."""

    gain: float  # candidate / incumbent - 1
    noise: float  # the two spreads together: the ratio is known to about ± this
    min_gain: float
    noise_known: bool = True  # False when a trial had a single window: no spread measured (noise counts 0)
    note: str = ""  # how the decision was reached beyond the two figures (a confirmation), appended to text()

    @property
    def verdict(self) -> Verdict:
        """The decision. Known noise: within it first, then under `min_gain`, else faster or slower. Unknown
        noise: under `min_gain` first (the only thing the figures alone settle), else faster or slower beyond
        what noise is known, else within it."""
        size = abs(self.gain)
        if self.noise_known and size <= self.noise:
            return Verdict.WITHIN_NOISE
        if size <= self.min_gain:
            return Verdict.UNDER_MIN_GAIN
        if size <= self.noise:  # noise unknown, but one trial's spread already covers the gain
            return Verdict.WITHIN_NOISE
        return Verdict.FASTER if self.gain > 0 else Verdict.SLOWER

    @property
    def faster(self) -> bool:
        """The candidate is faster beyond the noise and by more than `min_gain`."""
        return self.verdict is Verdict.FASTER

    @property
    def slower(self) -> bool:
        """The candidate is slower beyond the noise and by more than `min_gain`."""
        return self.verdict is Verdict.SLOWER

    @property
    def within_noise(self) -> bool:
        """The difference is inside the combined noise, whether or not that noise was measured (a figure test,
        not the verdict: with the noise unknown, a gain inside it may still read as under `min_gain`)."""
        return abs(self.gain) <= self.noise

    def said(self, note: str) -> Comparison:
        """The same comparison, its text followed by `note`."""
        return dataclasses.replace(self, note=note)

    def text(self) -> str:
        """The gain and how it compares with the noise, e.g. "+2.0 %, within noise (±5.0 %)"."""
        return self._figures() + (f"; {self.note}" if self.note else "")

    def _figures(self) -> str:
        head = f"{100 * self.gain:+.1f} %"
        verdict = self.verdict
        under = f"under the {100 * self.min_gain:.0f} % a change must gain"
        if not self.noise_known:  # a one-window trial has no spread: say so rather than "±0.0 %"
            unknown = "noise not measured: one window"
            return f"{head}, {under} ({unknown})" if verdict is Verdict.UNDER_MIN_GAIN else f"{head} ({unknown})"
        noise = f"±{100 * self.noise:.1f} %"
        if verdict is Verdict.WITHIN_NOISE:
            return f"{head}, within noise ({noise})"
        if verdict is Verdict.UNDER_MIN_GAIN:
            return f"{head}, {under} (noise {noise})"
        if self.gain >= RATIO_GAIN or self.noise >= RATIO_NOISE:
            ratio, low, high = 1 + self.gain, max(0.0, 1 + self.gain - self.noise), 1 + self.gain + self.noise
            figure = f"{ratio:.3g}× ({low:.3g}–{high:.3g}×), beyond noise"
            if self.noise < RATIO_NOISE:  # a large gain measured tightly: the range says it, nothing to add
                return figure
            which = "faster" if verdict is Verdict.FASTER else "slower"
            return f"{figure}: {which} for certain, by an amount only that range says"
        return f"{head}, beyond noise ({noise})"


def compare(candidate: Measured, incumbent: Measured, min_gain: float) -> Comparison:
    """How `candidate`'s samples/s compares with `incumbent`'s, given both trials' spreads."""
    if not candidate.samples_per_s or not incumbent.samples_per_s:
        raise ValueError("compare needs two measured trials")
    return Comparison(gain=candidate.samples_per_s / incumbent.samples_per_s - 1,
                      noise=(candidate.spread or 0.0) + (incumbent.spread or 0.0), min_gain=min_gain,
                      noise_known=candidate.spread is not None and incumbent.spread is not None)
