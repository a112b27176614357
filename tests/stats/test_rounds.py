"""The interleaved rounds and per-round ratios shared by `saturate run`, `run -- CMD` and the benchmarks."""

from __future__ import annotations

import pytest

from saturate.stats.rounds import Ratio, interleaved, per_round


def test_rounds_alternate_and_reverse():
    assert list(interleaved(["a", "b", "c"], 3)) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                     (2, "a"), (2, "b"), (2, "c")]


def test_ratio_is_the_median_of_per_round_ratios_with_its_range():
    # A burst of load in round 2 halves both: the per-round ratio is unmoved, a ratio of medians would not be.
    tuned, naive = [200.0, 100.0, 210.0], [100.0, 50.0, 95.0]
    r = Ratio.between(tuned, naive)
    assert r is not None and r.rounds == 3
    assert r.median == pytest.approx(2.0) and r.low == pytest.approx(2.0) and r.high == pytest.approx(210 / 95)
    assert r.faster and not r.slower and r.verdict() == "2.00× (2.00–2.21)"


def test_a_range_including_one_is_no_measurable_gain():
    r = Ratio.of([0.97, 1.04, 1.01])
    assert not r.faster and not r.slower
    assert r.verdict() == "no measurable gain (0.97–1.04×)" and r.to_dict()["verdict"] == "within noise"
    slow = Ratio.of([0.45, 0.47, 0.52])
    assert slow.slower and slow.verdict() == "0.47× (0.45–0.52)" and slow.to_dict()["verdict"] == "slower"


def test_missing_rounds_give_no_ratio():
    assert per_round([1.0, None, 3.0], [1.0, 2.0, 0.0]) == [1.0]
    assert Ratio.between([None], [1.0]) is None
    with pytest.raises(ValueError, match="3 rounds against 2"):
        per_round([1.0, 2.0, 3.0], [1.0, 2.0])
