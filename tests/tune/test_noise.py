"""Noise-aware trials: when a trial has been timed enough, and decisions that respect the spread."""

from __future__ import annotations

from typing import Any

import pytest
from test_search import FakeMachine, GiB, linear_memory, saturating, settings

from saturate.plan import Plan
from saturate.tune.decide import compare, complexity
from saturate.tune.noise import SHORT_TRIALS_ENV, WindowRule, default_rule, rate_text, summarize
from saturate.tune.search import search
from saturate.tune.trial import Trial


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


def test_comparison_needs_the_gain_to_beat_the_combined_noise_and_the_minimum():
    def t(rate: float, spread: float) -> Trial:
        return Trial(stage="x", plan=Plan(), samples_per_s=rate, spread=spread)

    within = compare(t(102.0, 0.025), t(100.0, 0.025), 0.03)
    assert not within.faster and within.within_noise and "within noise (±5.0 %)" in within.text()
    clear = compare(t(130.0, 0.025), t(100.0, 0.025), 0.03)
    assert clear.faster and "beyond noise" in clear.text()
    exact = compare(t(102.0, 0.0), t(100.0, 0.0), 0.03)  # measured exactly, but too small to be worth it
    assert not exact.faster and "under the 3 %" in exact.text()


def test_a_one_window_trial_has_no_noise_to_be_beyond():
    one = Trial(stage="x", plan=Plan(), samples_per_s=110.0, spread=None)  # a single timed window
    c = compare(one, Trial(stage="x", plan=Plan(), samples_per_s=100.0, spread=0.01), 0.03)
    assert c.faster and not c.noise_known  # the decision still needs the minimum gain
    assert c.text() == "+10.0 % (noise not measured: one window)" and "±" not in c.text()
    small = compare(Trial(stage="x", plan=Plan(), samples_per_s=111.0, spread=0.01), one, 0.03)
    assert "under the 3 %" in small.text() and "one window" in small.text()


def test_simplicity_orders_knobs():
    base = Plan()
    assert complexity(base) == 0
    assert complexity(base.replace(precision="bf16")) < complexity(base.replace(compile="default"))
    assert complexity(base.replace(fused_optimizer=True)) > complexity(base)
    assert complexity(base.replace(precision="fp16")) > complexity(base.replace(precision="bf16"))


def _fused_gain(gain: float, spread: float):
    base = saturating(16)

    def speed(p: Plan) -> float:  # the fake's fused factor replaced by `gain`
        return base(p) / (1.05 if p.fused_optimizer else 1.0) * ((1 + gain) if p.fused_optimizer else 1.0)

    machine = FakeMachine(speed=speed, memory=linear_memory(GiB, 0.1 * GiB), spread=spread)
    return search(machine, Plan(), settings(try_compile=False))


def test_a_small_gain_within_the_noise_is_not_taken():
    result = _fused_gain(0.02, 0.025)
    assert not result.plan.fused_optimizer
    line = next(d for d in result.decisions if d.startswith("fused optimizer"))
    assert "off" in line and "within noise" in line


def test_a_large_gain_is_taken():
    result = _fused_gain(0.30, 0.025)
    assert result.plan.fused_optimizer
    line = next(d for d in result.decisions if d.startswith("fused optimizer"))
    assert line.startswith("fused optimizer: on") and "beyond noise" in line


def test_bf16_within_noise_of_fp32_keeps_fp32():
    def speed(p: Plan) -> float:
        return 100.0 * (1.02 if p.precision == "bf16" else 1.0)

    machine = FakeMachine(speed=speed, memory=linear_memory(GiB, 0.1 * GiB), spread=0.03)
    result = search(machine, Plan(), settings(try_compile=False, supports={"bf16": True}))
    assert result.plan.precision == "fp32"
    line = next(d for d in result.decisions if d.startswith("precision"))
    assert "within noise" in line


def test_noise_stops_the_micro_batch_climb_only_where_no_larger_one_gains_beyond_it():
    def speed(p: Plan) -> float:  # each doubling gains 4 %: beyond 3 % but within ±2.5 % + ±2.5 %
        return 100.0 * 1.04 ** (p.micro_batch.bit_length())

    quiet = search(FakeMachine(speed=speed, memory=linear_memory(GiB, 0.01 * GiB)), Plan(),
                   settings(try_compile=False, supports={}))
    noisy = search(FakeMachine(speed=speed, memory=linear_memory(GiB, 0.01 * GiB), spread=0.025), Plan(),
                   settings(try_compile=False, supports={}))
    # 16 gains within the noise over 8 and is passed over; 32 gains 8.2 % over 8, beyond it; 64 over 32 does not.
    assert quiet.plan.micro_batch == 64 and noisy.plan.micro_batch == 32
    assert "within noise" in next(d for d in noisy.decisions if d.startswith("micro-batch"))
    flat = search(FakeMachine(speed=lambda p: 100.0 * (1.01 if p.micro_batch > 8 else 1.0),
                              memory=linear_memory(GiB, 0.01 * GiB), spread=0.025), Plan(),
                  settings(try_compile=False, supports={}))
    assert flat.plan.micro_batch == 8  # no larger one gains beyond the noise: the probe's stays


def test_a_verification_far_below_its_trial_is_measured_again_and_said_when_it_stays_so():
    def steady(p: Plan, n: int) -> float:
        return saturating(16)(p) * (0.3 if n == 1 else 0.97)  # a burst of load in the first verification

    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), verify_speed=steady)
    result = search(machine, Plan(), settings(try_compile=False))
    verifies = [t for t in result.trials if t.stage == "verify"]
    assert len(verifies) == 2 and "measured again" in verifies[0].verdict
    assert result.chosen is verifies[1] and result.chosen.verdict == "chosen" and not result.warnings

    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB),
                          verify_speed=lambda p, n: saturating(16)(p) * 0.3)
    result = search(machine, Plan(), settings(try_compile=False))
    assert result.chosen.verdict.startswith("chosen, but inconsistent")
    assert result.warnings and "against its own earlier trial" in result.warnings[0]
    assert any(d.startswith("verification: the chosen plan verified at") for d in result.decisions)


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
    from saturate.tune.noise import WindowRule

    rule, reads = WindowRule(max_windows=4, max_seconds=100.0), []

    def read() -> bool:
        reads.append(1)
        return True

    noisy = [1.0, 2.0] * 2
    assert rule.done(noisy[:3], 1.0, None, read) == (False, None) and not reads  # under the cap: not read
    assert rule.done(noisy, 1.0, None, read) == (False, True) and len(reads) == 1  # busy: cap doubled to 8
    assert rule.done(noisy * 2, 2.0, True, read) == (True, True) and len(reads) == 1  # read once only
    assert rule.done([1.0, 1.0, 1.0], 0.5, None, read) == (True, None)  # agreeing windows: never read


def _drifting(first: float, later: float):
    """Samples/s: micro-batch 16 gains 8 % over 8; 8 reads `first` the first time it is measured and `later` after
    (the machine sped up between the two trials, or not)."""
    seen: dict[int, int] = {}

    def speed(p: Plan) -> float:
        seen[p.micro_batch] = seen.get(p.micro_batch, 0) + 1
        if p.micro_batch == 8:
            return first if seen[8] == 1 else later
        return 108.0 if p.micro_batch == 16 else 50.0

    return speed


def test_a_small_gain_is_taken_only_when_it_holds_against_the_incumbent_measured_again():
    def tune(first: float, later: float):
        machine = FakeMachine(speed=_drifting(first, later), memory=linear_memory(GiB, 0.01 * GiB), spread=0.01)
        return search(machine, Plan(), settings(effective_batch=16, try_compile=False, supports={},
                                                fused_available=False)), machine

    drifted, machine = tune(100.0, 110.0)  # 16's +8 % was the machine: 8 measured again reads 110
    assert drifted.plan.micro_batch == 8
    assert [p.micro_batch for p in machine.tried] == [8, 16, 8, 4, 8]  # 8 again right after 16; then 4; verified
    again = drifted.trials[2]
    assert again.plan.micro_batch == 8 and "measured again to confirm 16×1" in again.verdict
    assert "not confirmed" in drifted.trials[1].verdict
    held, _ = tune(100.0, 100.0)  # the gain holds against the second measurement: taken, and said
    assert held.plan.micro_batch == 16
    assert held.trials[2].plan.micro_batch == 8
    assert "16: +8.0 %" in held.trials[2].verdict and "confirmed: +8.0 % against its earlier trial" in \
        held.trials[2].verdict


def test_a_large_gain_is_taken_without_measuring_the_incumbent_again():
    machine = FakeMachine(speed=lambda p: 100.0 * (1.5 if p.micro_batch == 16 else 1.0),
                          memory=linear_memory(GiB, 0.01 * GiB), spread=0.01)
    result = search(machine, Plan(), settings(effective_batch=16, try_compile=False, supports={},
                                              fused_available=False))
    assert result.plan.micro_batch == 16
    assert [p.micro_batch for p in machine.tried] == [8, 16, 16]  # the last: the verification


def test_a_small_gain_the_budget_cannot_confirm_is_not_taken(monkeypatch):
    from saturate.tune.state import SearchState

    real = SearchState.affordable
    monkeypatch.setattr(SearchState, "affordable",
                        lambda self, what, loader=False: not what.startswith("measuring") and real(self, what, loader))
    machine = FakeMachine(speed=_drifting(100.0, 100.0), memory=linear_memory(GiB, 0.01 * GiB), spread=0.01)
    result = search(machine, Plan(), settings(effective_batch=16, try_compile=False, supports={},
                                              fused_available=False))
    assert result.plan.micro_batch == 8
    assert "the budget had no room" in result.trials[1].verdict


def test_a_small_compile_gain_is_confirmed_only_where_the_compilation_could_pay_back():
    def tried_after_compile(planned_steps: int) -> tuple[list[Plan], Any]:
        machine = FakeMachine(speed=lambda p: 100.0 * (1.08 if p.compile != "none" else 1.0),
                              memory=linear_memory(GiB, 0.01 * GiB), spread=0.01)
        result = search(machine, Plan(), settings(effective_batch=8, supports={}, fused_available=False,
                                                  planned_steps=planned_steps))
        i = next(i for i, p in enumerate(machine.tried) if p.compile != "none")
        return machine.tried[i + 1:], result

    long_tried, long_run = tried_after_compile(10_000_000)  # pays back many times: eager measured again first
    assert long_tried[0].compile == "none" and long_run.plan.compile != "none"
    short_tried, short_run = tried_after_compile(3_000)  # 7.4 % of 3,000 steps of 0.08 s: 18 s < 30 s compiling
    assert all(p.compile == "none" for p in short_tried) and short_run.plan.compile == "none"
    assert len(short_tried) == len(long_tried) - 1  # no eager trial spent confirming a gain that cannot pay back
