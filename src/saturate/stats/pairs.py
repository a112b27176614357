"""Two competitors timed in alternating windows: the median of the per-pair ratios, its interval, when to stop.

Each pair of windows a second apart gives a ratio B ÷ A under the same load (tune/paired.py and
script/gated.py time them). Which of the two goes first is drawn at random for each pair (`pair_order`),
not alternated A B | B A: a load that repeats every four windows locks onto a fixed alternation and
favours one side in every pair; a random order leaves only the sign test's own error, with its looks
(measured: bench/results/cpu-2026-11-26g/README.md). The decision rests on the median of those ratios and its
distribution-free interval (`median_interval`, the sign test's order statistics): B is faster when the whole
interval is above 1 and the median gains more than the minimum gain, slower alike below, and there is no
difference worth a change when the whole interval lies within ± the minimum gain (`decisive`).

The pairs stop (`settled`) once they are decisive at one of a few pair counts (`CHECKS`: few looks,
few false stops), or at a cap on timed seconds, never before `min_pairs`. A caller that keeps A unless B is
faster (the tuner) stops as soon as B cannot be (`one_sided`): the interval's upper end within the minimum
gain: a two-sided comparison of a candidate that is no faster can run to the pair cap, where one-sided pairs stop
well before it on the same ratios (measured: bench/results/cpu-2026-11-27f/README.md). The decision is a
`Comparison` (stats/comparison.py), so it reads as every other comparison does.

When a run ends before `MIN_PAIRS` (a script shorter than the windows a decision needs), the sign test cannot
decide: four pairs all one way are 87.5 % sure, not 90 %. Those pairs still hold a result when it is large
against their own scatter: `ended_comparison` takes 3 to 5 pairs, all on one side of 1, and Student's t interval
of the mean log ratio at 99 % (a tighter confidence than the sign test's, since it leans on the ratios being
roughly log-normal): a few pairs that agree on a large gain decide it, a few that scatter do not (measured:
bench/results/cpu-2026-11-26f/README.md).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import TypeVar

from saturate.stats.comparison import Comparison

MIN_PAIRS = 6  # the fewest pairs a decision rests on (six pairs all one way: 97 % confidence)
MAX_PAIRS = 24
CONFIDENCE = 0.90  # of the median's interval: each side is wrong at most 5 % of the time
CHECKS = (6, 9, 12, 16, 20, 24)  # pair counts at which the windows may stop early (few looks: few false stops)
ENDED_PAIRS = 3  # the fewest pairs `ended_comparison` reads
ENDED_CONFIDENCE = 0.99
T_995 = {2: 9.9248, 3: 5.8409, 4: 4.6041}  # Student's t, 0.995 quantile (99 % two-sided), by degrees of freedom


T = TypeVar("T")


def pair_order(sides: Sequence[T], rng: random.Random) -> list[T]:
    """The two sides of one pair of windows in the order they are timed: drawn at random (`rng`), so that no load
    with a period can favour one side pair after pair (see above)."""
    return list(sides) if rng.random() < 0.5 else list(reversed(sides))


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


def paired_comparison(ratios: list[float], min_gain: float) -> Comparison:
    """B against A from the pairs' ratios: the gain is the median's, the noise the distance from the median to the
    end of its interval nearer 1 — so B is `faster` exactly when the whole interval is above 1 and the median gains
    more than `min_gain` (`slower` alike below)."""
    med = statistics.median(ratios)
    low, high = median_interval(ratios)
    return Comparison(gain=med - 1, noise=(med - low) if med >= 1 else (high - med), min_gain=min_gain,
                      note=pairs_text(ratios))


def ended_comparison(ratios: list[float], min_gain: float) -> Comparison | None:
    """B against A from the 3 to 5 pairs a run left when it ended (None outside that range): the gain is the
    geometric mean's, the noise its distance to the end of the 99 % t interval nearer 1; pairs not all on one side
    of 1 are within noise whatever their mean (one pair against is enough to doubt so few)."""
    n = len(ratios)
    if not ENDED_PAIRS <= n < MIN_PAIRS:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = T_995[n - 1] * statistics.stdev(logs) / math.sqrt(n)
    g, low, high = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    noise = (g - low) if g >= 1 else (high - g)
    if not (all(r > 1 for r in ratios) or all(r < 1 for r in ratios)):
        noise = max(noise, abs(g - 1))
    wins = sum(r > 1 for r in ratios)
    note = (f"in {n} alternating pairs (a run ended before {MIN_PAIRS}): faster in {wins}, geometric mean {g:.3f}× "
            f"({100 * ENDED_CONFIDENCE:.0f} % t interval {low:.3f}–{high:.3f}×)")
    return Comparison(gain=g - 1, noise=noise, min_gain=min_gain, note=note)


def decisive(ratios: list[float], min_gain: float, one_sided: bool = False) -> bool:
    """Whether the pairs so far settle it: faster or slower beyond the interval and `min_gain`, or the whole
    interval within ±`min_gain` (no difference worth a change). `one_sided`: the caller asks only whether B is
    faster (it keeps A otherwise), so an interval whose upper end is within 1 + `min_gain` settles it too — B
    cannot be shown worth a change, whatever more pairs would say of how much slower it is."""
    c = paired_comparison(ratios, min_gain)
    low, high = median_interval(ratios)
    return c.faster or c.slower or high <= 1 + min_gain and (one_sided or low >= 1 - min_gain)


def settled(ratios: list[float], min_gain: float, *, min_pairs: int = MIN_PAIRS, timed_s: float = 0.0,
            cap_s: float | None = None, one_sided: bool = False) -> bool:
    """Whether to stop timing pairs: at least `min_pairs`, and either decisive (`one_sided` or not) at one of
    `CHECKS` or `timed_s` at the cap (`cap_s`, None: no cap). `MAX_PAIRS` is the caller's loop bound."""
    n = len(ratios)
    return n >= min_pairs and ((n in CHECKS and decisive(ratios, min_gain, one_sided))
                               or (cap_s is not None and timed_s >= cap_s))


def pairs_text(ratios: list[float]) -> str:
    """"in 9 alternating pairs: faster in 8, median 1.120× (90 % interval 1.040–1.190×)"."""
    low, high = median_interval(ratios)
    wins = sum(r > 1 for r in ratios)
    return (f"in {len(ratios)} alternating pairs: faster in {wins}, median {statistics.median(ratios):.3f}× "
            f"({100 * CONFIDENCE:.0f} % interval {low:.3f}–{high:.3f}×)")
