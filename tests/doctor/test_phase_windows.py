"""The doctor's timed windows (doctor.phase_windows) and the ranges they give the rules, on constructed step times."""

from __future__ import annotations

import pytest

from saturate.doctor.findings import Measurements
from saturate.doctor.phase_windows import Windows, per_window, split, window_rates
from saturate.stats.noise import WindowRule


def run(windows: Windows, seconds: list[float], busy: bool = False) -> tuple[int, int]:
    """Feed steps of these durations until the windows say stop: (steps run, times `busy` was asked)."""
    asked = []
    elapsed = 0.0
    for n, s in enumerate(seconds, 1):
        elapsed += s
        if windows.step_done(n, elapsed, lambda n=n: seconds[:n], lambda: asked.append(1) or busy):
            return n, len(asked)
    raise AssertionError("never stopped")


def test_steady_steps_stop_once_three_windows_agree_and_the_minimums_are_met():
    w = Windows(min_steps=4, min_seconds=0.0, window_s=0.2)
    n, asked = run(w, [0.1] * 100)
    assert w.ends == [2, 4, 6] and n == 6  # the first window's 2 steps reach 0.2 s; 3 windows agree
    assert asked == 0  # agreed before any cap: contention never read


def test_the_minimum_steps_keep_agreeing_windows_going():
    w = Windows(min_steps=10, min_seconds=0.0, window_s=0.2)
    assert run(w, [0.1] * 100)[0] == 10


def test_the_minimum_steps_hold_past_the_cap():
    w = Windows(min_steps=12, window_s=0.0, rule=WindowRule(max_windows=4, max_seconds=100.0))
    assert run(w, [0.1, 0.2] * 100)[0] == 12  # 1-step windows that never agree: capped at 4, run to 12


def test_disagreeing_windows_stop_at_the_cap_and_a_busy_machine_doubles_it():
    noisy = [0.1, 0.1, 0.15, 0.15] * 100  # windows of 2 steps alternate 0.2 s and 0.3 s: never agree
    rule = WindowRule(max_windows=4, max_seconds=100.0)
    quiet = Windows(window_s=0.2, rule=rule)
    assert run(quiet, noisy) == (8, 1)  # 4 windows, contention read once
    busy = Windows(window_s=0.2, rule=rule)
    assert run(busy, noisy, busy=True) == (16, 1)  # 8 windows; still read only once


def test_split_cuts_a_fixed_stretch_into_equal_windows():
    assert split(10) == [2, 4, 6, 8, 10]
    assert split(12) == [2, 4, 6, 8, 12]  # the last window takes the remainder
    assert split(3) == [1, 2, 3]
    assert split(1) == [1]
    assert split(0) == []


def test_each_window_gives_its_phase_shares_and_the_rates_their_spread():
    steps = [{"data": 0.01, "forward": 0.09}] * 2 + [{"data": 0.03, "forward": 0.07}] * 2
    shares, spread = per_window(steps, [2, 4])
    assert [round(s["data"], 2) for s in shares] == [0.1, 0.3]
    assert spread == pytest.approx(0.0)  # every step 0.1 s: the rates agree exactly
    assert window_rates([0.1, 0.1, 0.2, 0.2], [2, 4]) == pytest.approx([10.0, 5.0])
    assert per_window(steps, [4])[1] is None  # one window: no spread


def measured(**kw) -> Measurements:
    base = dict(device_type="cpu", device_name="cpu", timing="host", steps=10, step_s=0.1,
                phases={"data": 0.015, "forward": 0.085})
    return Measurements(**{**base, **kw})


def test_a_share_range_is_over_the_windows_trimmed_from_five_on():
    w = [{"data": x, "forward": 1 - x} for x in (0.10, 0.12, 0.14, 0.16, 0.50)]
    m = measured(window_shares=w)
    assert m.share_range("data") == pytest.approx((0.12, 0.16))  # 0.10 and the 0.50 burst left out
    assert m.share_range("data", "forward") == pytest.approx((1.0, 1.0))
    assert measured().share_range("data") == pytest.approx((0.15, 0.15))  # no windows: the one figure


def test_sync_and_idle_ranges():
    assert measured(syncs_per_step=1.0, syncs_each_step=[0.0, 2.0]).syncs_range() == (0.0, 2.0)
    assert measured(syncs_per_step=1.0).syncs_range() == (1.0, 1.0)
    assert measured().syncs_range() is None
    assert measured(window_util=[80.0, 90.0]).idle_range() == pytest.approx((0.1, 0.2))
    assert measured().idle_range() is None  # no utilisation measured
