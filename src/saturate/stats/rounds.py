"""Interleaved rounds, and the ratio between two competitors measured in them.

Competitors measured one after another on a busy machine are not compared fairly: a burst of load
hits whoever runs during it. Measured in rounds instead (A B C, then C B A, …), each round gives
a ratio of two figures taken minutes apart at most, under the same load; the ratio reported is the
median of the per-round ratios, and their range is the noise. A range that includes 1.0 is no
measurable difference. `saturate run` (run/flow.py), `saturate run -- CMD` (script/run_script.py)
and the benchmarks (bench/_harness.py) share these.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def interleaved(names: Sequence[K], rounds: int) -> Iterator[tuple[int, K]]:
    """(round, name) for every competitor in every round; odd rounds run in reverse order.

    A, B | B, A | A, B ... keeps the competitors side by side, and the reversal stops a slow drift
    of the machine (thermal, another job starting) from always favouring whoever runs first.
    """
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            yield r, name


def per_round(top: Sequence[float | None], bottom: Sequence[float | None]) -> list[float]:
    """Round by round, top ÷ bottom; a round where either figure is missing (a failed measurement) or the
    bottom is zero gives no ratio."""
    if len(top) != len(bottom):
        raise ValueError(f"{len(top)} rounds against {len(bottom)}")
    return [a / b for a, b in zip(top, bottom, strict=True) if a is not None and b]


@dataclass(frozen=True)
class Ratio:
    """The median of per-round ratios, with their range (the noise between rounds)."""

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Ratio | None:
        """None when no round gave a ratio."""
        if not ratios:
            return None
        return cls(statistics.median(ratios), min(ratios), max(ratios), len(ratios))

    @classmethod
    def between(cls, top: Sequence[float | None], bottom: Sequence[float | None]) -> Ratio | None:
        return cls.of(per_round(top, bottom))

    @property
    def faster(self) -> bool:
        """Faster in every round: the gain is beyond the noise."""
        return self.low > 1.0

    @property
    def slower(self) -> bool:
        """Slower in every round."""
        return self.high < 1.0

    def fmt(self) -> str:
        """'2.31× (2.05–2.48)'."""
        return f"{self.median:.2f}× ({self.low:.2f}–{self.high:.2f})"

    def verdict(self) -> str:
        """The ratio with its range, or "no measurable gain" when the range includes 1.0."""
        if self.faster or self.slower:
            return self.fmt()
        return f"no measurable gain ({self.low:.2f}–{self.high:.2f}×)"

    def to_dict(self) -> dict[str, float | int | str]:
        return {"median": self.median, "min": self.low, "max": self.high, "rounds": self.rounds,
                "verdict": "faster" if self.faster else "slower" if self.slower else "within noise"}
