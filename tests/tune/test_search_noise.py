"""The search under noise: a gain counts only beyond both trials' spreads, else the simpler plan is kept."""

from __future__ import annotations

from typing import Any

from test_search import FakeMachine, GiB, linear_memory, saturating, settings

from saturate.plan import Plan
from saturate.tune.decide import complexity
from saturate.tune.search import search


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
