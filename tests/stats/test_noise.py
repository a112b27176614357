"""The statistics of a trial's windows: median ± spread, when to stop (comparisons: test_comparison.py)."""

from __future__ import annotations

import pytest

from saturate.stats.noise import SHORT_TRIALS_ENV, WindowRule, default_rule, rate_text, summarize


def test_summary_is_median_and_half_range_trimmed_from_five_windows():
    s = summarize([100.0, 104.0, 96.0])
    assert s.median == 100.0 and s.spread == pytest.approx(0.04) and s.windows == 3
    # One outlying window (a burst of load) among five moves neither the median nor the spread much.
    s = summarize([100.0, 101.0, 99.0, 100.0, 50.0])
    assert s.median == 100.0 and s.spread == pytest.approx(0.005)  # 99 … 100 once 50 and 101 are left out


def test_a_trial_stops_early_when_its_windows_agree():
    rule = WindowRule(target=0.015, min_windows=3, max_windows=8)
    rates: list[float] = []
    for r in [130.0, 100.0, 101.0, 100.5, 99.0]:  # a slow first window (warm-up), then agreement
        rates.append(r)
        if rule.agreed(rates) or rule.capped(rates, 0.0):
            break
    assert len(rates) == 4
    res = rule.result(rates)
    assert res.windows == 4 and res.median == 100.5 and res.spread < 0.015  # the agreeing windows decide


def test_a_trial_stops_at_the_cap_when_windows_disagree_and_later_on_a_busy_machine():
    rule = WindowRule(target=0.015, min_windows=3, max_windows=8, max_seconds=1e9)
    noisy = [100.0, 80.0, 120.0] * 10

    def windows(busy: bool) -> list[float]:
        rates: list[float] = []
        for r in noisy:
            rates.append(r)
            if rule.agreed(rates) or rule.capped(rates, 0.0, busy):
                break
        return rates

    quiet, busy = windows(False), windows(True)
    assert len(quiet) == 8 and len(busy) == 16
    res = rule.result(quiet)
    assert res.windows == 8 and res.spread > 0.1  # the figure says how uncertain it is
    timed = WindowRule(max_seconds=8.0)  # the time cap, raised alike on a busy machine
    assert timed.capped([100.0], seconds=8.0) and not timed.capped([100.0], seconds=8.0, busy=True)


def test_rate_text_shows_the_spread_when_there_is_one():
    assert rate_text(812.34, 0.012) == "812.3 ±1.2 % samples/s"
    assert rate_text(812.34, None) == "812.3 samples/s"
    assert rate_text(None, None) == "-"


def test_the_testing_knob_caps_trials_short_and_only_when_set(monkeypatch, cpu):
    from saturate.tune.measure import RealMeasurer

    monkeypatch.delenv(SHORT_TRIALS_ENV, raising=False)
    assert default_rule() == WindowRule() == RealMeasurer(None, cpu).rule
    monkeypatch.setenv(SHORT_TRIALS_ENV, "1")
    short = default_rule()
    assert short.capped([100.0] * 4, 0.1) and short.capped([100.0], 1.0) and not short.capped([100.0], 0.9)
    assert not WindowRule().capped([100.0] * 4, 1.0)  # the default still times those windows on
    assert RealMeasurer(None, cpu).rule == short  # what a trial of a `saturate` command under the knob follows


def test_done_reads_the_machine_once_at_the_first_cap_and_raises_it_when_busy():
    from saturate.stats.noise import WindowRule

    rule, reads = WindowRule(max_windows=4, max_seconds=100.0), []

    def read() -> bool:
        reads.append(1)
        return True

    noisy = [1.0, 2.0] * 2
    assert rule.done(noisy[:3], 1.0, None, read) == (False, None) and not reads  # under the cap: not read
    assert rule.done(noisy, 1.0, None, read) == (False, True) and len(reads) == 1  # busy: cap doubled to 8
    assert rule.done(noisy * 2, 2.0, True, read) == (True, True) and len(reads) == 1  # read once only
    assert rule.done([1.0, 1.0, 1.0], 0.5, None, read) == (True, None)  # agreeing windows: never read
