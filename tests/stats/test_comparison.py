"""Comparisons beyond the noise: the decision is a Verdict, and the text is rendered from it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from saturate.stats.comparison import Comparison, Verdict, compare


@dataclass
class Rate:
    """A measured figure as compare reads it (the Measured protocol)."""

    samples_per_s: float | None
    spread: float | None


def test_comparison_needs_the_gain_to_beat_the_combined_noise_and_the_minimum():
    within = compare(Rate(102.0, 0.025), Rate(100.0, 0.025), 0.03)
    assert not within.faster and within.within_noise and "within noise (±5.0 %)" in within.text()
    clear = compare(Rate(130.0, 0.025), Rate(100.0, 0.025), 0.03)
    assert clear.faster and "beyond noise" in clear.text()
    exact = compare(Rate(102.0, 0.0), Rate(100.0, 0.0), 0.03)  # measured exactly, but too small to be worth it
    assert not exact.faster and "under the 3 %" in exact.text()


def test_a_one_window_trial_has_no_noise_to_be_beyond():
    one = Rate(110.0, None)  # a single timed window
    c = compare(one, Rate(100.0, 0.01), 0.03)
    assert c.faster and not c.noise_known  # the decision still needs the minimum gain
    assert c.text() == "+10.0 % (noise not measured: one window)" and "±" not in c.text()
    small = compare(Rate(111.0, 0.01), one, 0.03)
    assert "under the 3 %" in small.text() and "one window" in small.text()


def test_compare_needs_two_measured_figures():
    with pytest.raises(ValueError, match="two measured"):
        compare(Rate(None, None), Rate(100.0, 0.01), 0.03)


@pytest.mark.parametrize(("candidate", "incumbent", "verdict", "text"), [
    (Rate(130.0, 0.025), Rate(100.0, 0.025), Verdict.FASTER, "+30.0 %, beyond noise (±5.0 %)"),
    (Rate(70.0, 0.025), Rate(100.0, 0.025), Verdict.SLOWER, "-30.0 %, beyond noise (±5.0 %)"),
    (Rate(102.0, 0.025), Rate(100.0, 0.025), Verdict.WITHIN_NOISE, "+2.0 %, within noise (±5.0 %)"),
    (Rate(97.0, 0.01), Rate(100.0, 0.01), Verdict.UNDER_MIN_GAIN,
     "-3.0 %, under the 5 % a change must gain (noise ±2.0 %)"),
    # The noise not measured (one window): decided on the minimum gain and whatever spread is known.
    (Rate(110.0, None), Rate(100.0, 0.01), Verdict.FASTER, "+10.0 % (noise not measured: one window)"),
    (Rate(80.0, 0.01), Rate(100.0, None), Verdict.SLOWER, "-20.0 % (noise not measured: one window)"),
    (Rate(103.0, None), Rate(100.0, None), Verdict.UNDER_MIN_GAIN,
     "+3.0 %, under the 5 % a change must gain (noise not measured: one window)"),
    (Rate(110.0, None), Rate(100.0, 0.2), Verdict.WITHIN_NOISE, "+10.0 % (noise not measured: one window)"),
])
def test_each_verdict_is_reached_and_said(candidate, incumbent, verdict, text):
    c = compare(candidate, incumbent, 0.05)
    assert c.verdict is verdict and c.text() == text
    assert c.faster == (verdict is Verdict.FASTER) and c.slower == (verdict is Verdict.SLOWER)
    assert c.said("confirmed").text() == f"{text}; confirmed" and c.said("confirmed").verdict is verdict


def _reference(c: Comparison) -> tuple[bool, bool, str]:
    """faster, slower and the figures' text as computed before the verdict existed: straight from the numbers."""
    faster, slower = c.gain > max(c.noise, c.min_gain), -c.gain > max(c.noise, c.min_gain)
    head = f"{100 * c.gain:+.1f} %"
    if not c.noise_known:
        unknown = "noise not measured: one window"
        if abs(c.gain) <= c.min_gain:
            return faster, slower, f"{head}, under the {100 * c.min_gain:.0f} % a change must gain ({unknown})"
        return faster, slower, f"{head} ({unknown})"
    noise = f"±{100 * c.noise:.1f} %"
    if abs(c.gain) <= c.noise:
        return faster, slower, f"{head}, within noise ({noise})"
    if abs(c.gain) <= c.min_gain:
        return faster, slower, f"{head}, under the {100 * c.min_gain:.0f} % a change must gain (noise {noise})"
    return faster, slower, f"{head}, beyond noise ({noise})"


def test_a_large_gain_or_a_wide_noise_is_said_as_the_ratio_with_its_range():
    # threads = 1 under load (2026-11-29) read "+2040.5 %, beyond noise (±1973.9 %)"
    c = Comparison(gain=20.405, noise=19.739, min_gain=0.03)
    assert c.faster and c.text() == ("21.4× (1.67–41.1×), beyond noise: faster for certain, by an amount only that "
                                     "range says")
    assert Comparison(gain=1.0, noise=0.1, min_gain=0.03).text() == "2× (1.9–2.1×), beyond noise"  # tight: no more
    slower = Comparison(gain=-0.9, noise=0.6, min_gain=0.03)
    assert slower.slower and slower.text().startswith("0.1× (0–0.7×), beyond noise: slower for certain")
    assert Comparison(gain=0.9, noise=0.1, min_gain=0.03).text() == "+90.0 %, beyond noise (±10.0 %)"
    assert Comparison(gain=0.4, noise=0.6, min_gain=0.03).within_noise  # the ratio form only where it decided


def test_the_text_and_the_decision_agree_everywhere():
    gains = [-0.5, -0.2, -0.05, -0.03, -0.02, -0.001, 0.0, 0.001, 0.02, 0.03, 0.05, 0.2, 0.5]
    noises = [0.0, 0.02, 0.03, 0.05, 0.3]
    phrase = {Verdict.WITHIN_NOISE: "within noise", Verdict.UNDER_MIN_GAIN: "under the", Verdict.FASTER: "beyond",
              Verdict.SLOWER: "beyond"}
    seen = set()
    for gain, noise, min_gain, known in itertools.product(gains, noises, [0.0, 0.03, 0.05], [True, False]):
        c = Comparison(gain=gain, noise=noise, min_gain=min_gain, noise_known=known)
        assert (c.faster, c.slower, c.text()) == _reference(c), c
        v = c.verdict
        seen.add(v)
        assert (v is Verdict.FASTER) == (gain > max(noise, min_gain))
        assert (v is Verdict.SLOWER) == (-gain > max(noise, min_gain))
        if known:
            assert phrase[v] in c.text() and (v is Verdict.WITHIN_NOISE) == c.within_noise
        else:  # with the noise unknown only the minimum gain is said
            assert ("under the" in c.text()) == (v is Verdict.UNDER_MIN_GAIN)
    assert seen == set(Verdict)
