"""The median of paired ratios and its interval: when alternating windows decide, and when they stop."""

from __future__ import annotations

import math
import statistics

import pytest

from saturate.stats.comparison import Verdict
from saturate.stats.pairs import (
    CHECKS,
    MIN_PAIRS,
    T_995,
    decisive,
    ended_comparison,
    median_interval,
    paired_comparison,
    settled,
)


def _coverage(n: int, k: int) -> float:
    """P(the k-th smallest ≤ median ≤ the k-th largest) for n values around a continuous median."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize("n", range(2, 30))
def test_the_median_interval_is_the_narrowest_order_statistics_with_the_confidence(n):
    values = [float(i) for i in range(n, 0, -1)]  # unsorted on purpose
    low, high = median_interval(values, 0.90)
    k = int(low)  # the k-th smallest is k
    assert high == n + 1 - k  # symmetric: the k-th largest
    assert k == 1 or _coverage(n, k) >= 0.90
    assert k == n // 2 or _coverage(n, k + 1) < 0.90  # one further in would not hold the confidence
    assert low <= statistics.median(values) <= high


def test_six_pairs_decide_only_when_all_six_agree():
    assert median_interval([1.1, 1.2, 1.15, 1.3, 1.12, 1.18]) == (1.1, 1.3)  # k = 1: the range
    faster = paired_comparison([1.1, 1.2, 1.15, 1.3, 1.12, 1.18], 0.03)
    assert faster.faster and not faster.slower and "faster in 6" in faster.text()
    one_against = paired_comparison([1.1, 1.2, 1.15, 1.3, 0.98, 1.18], 0.03)
    assert not one_against.faster and not one_against.slower  # the interval reaches below 1
    assert paired_comparison([0.8, 0.85, 0.9, 0.82, 0.88, 0.86], 0.03).slower
    assert not paired_comparison([1.02] * 6, 0.03).faster  # beyond the noise, not beyond the minimum gain


def test_pairs_stop_when_decisive_either_way_or_when_no_difference_is_worth_a_change():
    assert decisive([1.2] * 6, 0.03) and decisive([0.8] * 6, 0.03)
    assert decisive([1.01, 0.99, 1.0, 1.02, 0.98, 1.0], 0.03)  # wholly within ±3 %: nothing worth a change
    assert not decisive([1.2, 0.9, 1.1, 1.3, 0.95, 1.0], 0.03)


# The tuner's fused-optimizer pairs on the peers' GPT-2 job (2026-11-27, bench/results/cpu-2026-11-27e), unfused÷fused.
UNFUSED = [1.058, 0.983, 1.017, 1.074, 0.97, 0.984, 0.941, 1.02, 0.95, 0.97, 1.012, 1.125, 1.018, 0.937, 0.963, 0.934,
           0.947, 0.966, 1.032, 0.945, 1.005, 0.921, 0.973, 1.098]


def test_one_sided_pairs_stop_once_b_cannot_be_shown_worth_a_change():
    # Two-sided, these ran to the 24-pair cap (0.963-1.017x: neither slower beyond 3 % nor wholly within it);
    # asked only whether unfused is faster, they settle at the check of 16 (0.963-1.018x: under 1.03).
    assert [n for n in CHECKS if decisive(UNFUSED[:n], 0.03)] == []
    assert [n for n in CHECKS if decisive(UNFUSED[:n], 0.03, one_sided=True)] == [16, 20, 24]
    assert settled(UNFUSED[:16], 0.03, one_sided=True) and not settled(UNFUSED[:16], 0.03)
    assert not paired_comparison(UNFUSED[:16], 0.03).faster  # what the full 24 pairs decided too
    # An interval reaching past 1 + the minimum gain is no reason to stop: B could still be faster.
    assert not decisive([1.0, 1.05, 0.99, 1.04, 1.02, 1.06], 0.03, one_sided=True)
    assert decisive([1.2] * 6, 0.03, one_sided=True)  # faster settles it as before


def test_the_pairs_decision_is_a_verdict_with_the_pairs_said():
    c = paired_comparison([1.1, 1.2, 1.15, 1.3, 1.12, 1.18], 0.03)
    assert c.verdict is Verdict.FASTER and c.note.startswith("in 6 alternating pairs: faster in 6, median 1.165×")
    assert paired_comparison([1.02] * 6, 0.03).verdict is Verdict.UNDER_MIN_GAIN


def test_pairs_settle_only_at_a_check_or_at_the_cap_and_never_before_the_fewest():
    assert MIN_PAIRS in CHECKS
    assert settled([1.2] * 6, 0.03) and not settled([1.2] * 7, 0.03)  # 7 is no check: no look, no stop
    assert not settled([1.2] * 5, 0.03, cap_s=1.0, timed_s=5.0)  # at the cap, but fewer than the fewest
    noisy = [1.2, 0.9, 1.1, 1.3, 0.95, 1.0]
    assert not settled(noisy, 0.03) and settled(noisy, 0.03, cap_s=1.0, timed_s=1.0)
    assert settled([1.2] * 3, 0.03, min_pairs=3, cap_s=0.0)  # the testing knob's: three pairs, no timed seconds


def test_the_t_quantiles_are_students():
    stats = pytest.importorskip("scipy.stats")
    for df, q in T_995.items():
        assert q == pytest.approx(stats.t.ppf(0.995, df), abs=1e-4)


def test_a_few_pairs_left_by_a_run_that_ended_decide_only_when_tight_and_one_sided():
    assert ended_comparison([1.5, 1.5], 0.03) is None  # too few
    assert ended_comparison([1.5] * MIN_PAIRS, 0.03) is None  # enough for the sign test: not this rule's
    tight = ended_comparison([8.38, 8.27, 8.15, 8.10], 0.03)
    assert tight.faster and tight.gain == pytest.approx(8.225 - 1, rel=0.01)
    assert 0 < tight.noise < 0.6  # the 99 % t interval: 7.9–8.5×
    assert ended_comparison([0.5, 0.52, 0.49], 0.03).slower
    assert not ended_comparison([1.1, 2.9, 1.3, 2.5], 0.03).faster  # scattered: the interval reaches below 1
    assert ended_comparison([3.0, 3.1, 0.99, 3.05, 3.02], 0.03).verdict is Verdict.WITHIN_NOISE  # one pair against
    assert ended_comparison([1.02, 1.021, 1.019], 0.03).verdict is Verdict.UNDER_MIN_GAIN
