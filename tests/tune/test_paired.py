"""Comparisons that separate trials could not settle, decided by both plans timed in alternating windows."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from test_search import FakeMachine, GiB, linear_memory, settings

from saturate.plan import Plan
from saturate.stats.noise import SHORT_TRIALS_ENV
from saturate.tune import paired
from saturate.tune.measure import RealMeasurer
from saturate.tune.paired import Pairs
from saturate.tune.search import search
from saturate.tune.state import SearchState
from saturate.tune.trial import Trial
from saturate.workloads import build_workload


class PairingMachine(FakeMachine):
    """A CPU whose separate trials read each plan at `solo(plan, n)` (the n-th trial of that micro-batch) with
    `spread`, while in alternating windows each plan reads `side_by_side(plan)`, the ratio jittered by ±`jitter`
    from pair to pair."""

    def __init__(self, *, solo: Callable[[Plan, int], float], side_by_side: Callable[[Plan], float],
                 jitter: float = 0.0, spread: float = 0.11, **kw) -> None:
        super().__init__(speed=lambda p: 0.0, memory=linear_memory(GiB, 0.01 * GiB), device_type="cpu",
                         spread=spread, **kw)
        self.solo, self.side_by_side, self.jitter = solo, side_by_side, jitter
        self.seen: dict[int, int] = {}
        self.pairs: list[tuple[int, int]] = []
        self.one_sided: list[bool] = []  # each pairing asked only whether the candidate is faster

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        self.seen[plan.micro_batch] = self.seen.get(plan.micro_batch, 0) + 1
        self.speed = lambda p: self.solo(p, self.seen[p.micro_batch])
        return super().model_trial(plan, stage, **kw)

    def can_pair(self, a: Plan, b: Plan) -> bool:
        return a.compile == b.compile == "none"

    def paired(self, a: Trial, b: Trial, stage: str, *, cap_s: float | None, min_gain: float,
               one_sided: bool = False) -> Pairs:
        self.pairs.append((a.plan.micro_batch, b.plan.micro_batch))
        self.one_sided.append(one_sided)
        out = Pairs(Trial(stage=stage, plan=a.plan), Trial(stage=stage, plan=b.plan))
        ra, rb = self.side_by_side(a.plan), self.side_by_side(b.plan)
        out.ratios = [rb / ra * (1 + self.jitter * (-1) ** i) for i in range(6)]
        for t, rate in ((out.a, ra), (out.b, rb)):
            t.samples_per_s, t.spread, t.step_s, t.steps = rate, 0.05, t.plan.samples_per_step() / rate, 6
            t.losses = [5.0, 4.5, 4.2, 4.0]
        return out


def _rates(true: dict[int, float]) -> Callable[[Plan], float]:
    return lambda p: true[p.micro_batch]


def _tune(machine: FakeMachine):
    return search(machine, Plan(), settings(effective_batch=32, try_compile=False, supports={},
                                            fused_available=False))


def test_a_loss_within_twice_the_noise_is_timed_in_pairs_and_the_climb_goes_on():
    # Loaded, as bench/trust.py saw it: 16×2 read 22.9 % below 8×4 alone (±11 % each), yet is 1.15× side by side.
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 92.0, 32: 104.0}

    def solo(p: Plan, n: int) -> float:
        return 80.0 if p.micro_batch == 8 else 61.7 if p.micro_batch == 16 else true[p.micro_batch]

    machine = PairingMachine(solo=solo, side_by_side=_rates(true), jitter=0.05)
    result = _tune(machine)
    assert machine.pairs[0] == (8, 16)  # 16's −22.9 % is within twice the noise: timed again with 8, in pairs
    assert result.plan.micro_batch == 32  # the pairs said 1.15×: the climb went on to 32
    paired_trials = [t for t in result.trials if t.paired]
    assert paired_trials and all(t.stage == "micro-batch" for t in paired_trials[:2])
    line = next(d for d in result.decisions if d.startswith("micro-batch"))
    assert "32" in line
    first = next(t for t in result.trials if t.plan.micro_batch == 16 and not t.paired)
    assert "not decisive, timed again with it in alternating windows" in first.verdict
    assert "alternating pairs: faster in 6" in paired_trials[0].verdict  # the incumbent's: what beat it, and how

    # Where the measurer cannot pair (a GPU, several processes): the separate trials' reading stops the climb.
    no_pairs = FakeMachine(speed=lambda p: solo(p, 1), memory=linear_memory(GiB, 0.01 * GiB), device_type="cpu",
                           spread=0.11)
    assert _tune(no_pairs).plan.micro_batch == 8


def test_a_decisive_loss_is_not_timed_in_pairs():
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 50.0, 32: 40.0}
    machine = PairingMachine(solo=lambda p, n: true[p.micro_batch], side_by_side=_rates(true), spread=0.01)
    result = _tune(machine)
    assert (8, 16) not in machine.pairs and result.plan.micro_batch == 8


def test_a_small_gain_is_confirmed_in_pairs_not_by_measuring_again_and_pairs_can_refuse_it():
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 86.4, 32: 80.0}  # 16: +8 % alone
    refused = PairingMachine(solo=lambda p, n: true[p.micro_batch], side_by_side=lambda p: 80.0, jitter=0.04,
                             spread=0.01)
    result = _tune(refused)
    assert refused.pairs[0] == (8, 16) and result.plan.micro_batch == 8
    assert [p.micro_batch for p in refused.tried].count(8) == 2  # the probe and the verification: no re-measure
    held = PairingMachine(solo=lambda p, n: true[p.micro_batch], side_by_side=_rates(true), spread=0.01)
    assert _tune(held).plan.micro_batch == 16


class LoadedMachine(PairingMachine):
    """A PairingMachine whose separate trials of micro-batch 8 ran while another process kept a core busy."""

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        t.contended, t.busy_cores = plan.micro_batch == 8, 1.0 if plan.micro_batch == 8 else 0.0
        return t


def test_a_gain_read_while_the_machine_was_busy_is_timed_in_pairs_however_large():
    # 8×4's trial ran in a burst: 16×2 read 2.5× alone, with tight windows — decisive by its figures; side by side
    # the two are the same speed. On a busy machine the pairs decide, and find no gain.
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 80.0, 32: 78.0}
    machine = LoadedMachine(solo=lambda p, n: 32.0 if p.micro_batch == 8 else true[p.micro_batch],
                            side_by_side=_rates(true), jitter=0.02, spread=0.01)
    result = _tune(machine)
    assert machine.pairs[0] == (8, 16) and result.plan.micro_batch == 8
    first = next(t for t in result.trials if t.plan.micro_batch == 16 and not t.paired)
    assert "busy during one of them, timed again with it in alternating windows" in first.verdict
    quiet = PairingMachine(solo=lambda p, n: 32.0 if p.micro_batch == 8 else true[p.micro_batch],
                           side_by_side=_rates(true), jitter=0.02, spread=0.01)
    assert _tune(quiet).plan.micro_batch != 8 and (8, 16) not in quiet.pairs  # quiet, the same figures decide alone


@pytest.mark.slow
def test_real_steps_in_alternating_windows(small_corpus, cpu, monkeypatch):
    monkeypatch.setenv(SHORT_TRIALS_ENV, "1")  # one step a window, three pairs at least, a 1-s cap
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=2)
    m = RealMeasurer(workload, cpu, window_s=0.0, min_steps=1)
    a, b = (m.model_trial(Plan(micro_batch=mb, grad_accum=4 // mb), "x") for mb in (2, 4))
    assert m.can_pair(a.plan, b.plan) and not m.can_pair(a.plan, b.plan.replace(compile="default"))
    out = m.paired(a, b, "micro-batch", cap_s=0.0, min_gain=0.03)
    assert out.ok and len(out.ratios) == paired.SHORT["min_pairs"]
    for t, solo in ((out.a, a), (out.b, b)):
        assert t.plan == solo.plan and t.windows == len(out.ratios) and t.steps >= len(out.ratios)
        assert len(t.losses) == t.steps + m.warmup and all(math.isfinite(v) for v in t.losses) and t.samples_per_s > 0
        assert t.losses[:2] == pytest.approx(solo.losses[:2], rel=1e-4)  # step for step a trial's: same start
    assert out.ratios == pytest.approx([rb / ra for ra, rb in zip(out.a.window_samples_per_s,
                                                                    out.b.window_samples_per_s, strict=True)])


@pytest.mark.slow
def test_a_failure_in_alternating_windows_is_said_and_leaves_nothing(small_corpus, cpu, monkeypatch):
    import dataclasses

    monkeypatch.setenv(SHORT_TRIALS_ENV, "1")
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=2)
    m = RealMeasurer(workload, cpu, window_s=0.0, min_steps=1)
    a = m.model_trial(Plan(micro_batch=2, grad_accum=2), "x")

    def fails(model, batch):
        raise RuntimeError("the loss cannot be computed")

    m.workload = dataclasses.replace(workload, loss_fn=fails)
    out = m.paired(a, a, "x", cap_s=None, min_gain=0.03)
    assert not out.ok and out.a.status == out.b.status == "failed" and "cannot be computed" in out.b.error
    assert out.a.samples_per_s is None and not out.ratios


def test_a_lower_precision_within_the_noise_is_timed_in_pairs_not_dropped_as_the_less_simple():
    # Loaded: bf16 read +34.7 % against fp32 alone, within the trials' ±36.9 %; side by side it is 1.35×.
    def solo(p: Plan, n: int) -> float:
        return 15.7 if p.precision == "bf16" else 11.6

    machine = PairingMachine(solo=solo, side_by_side=lambda p: 15.7 if p.precision == "bf16" else 11.6,
                             jitter=0.1, spread=0.185)
    result = search(machine, Plan(), settings(effective_batch=8, try_compile=False, supports={"bf16": True},
                                              fused_available=False))
    assert machine.pairs and result.plan.precision == "bf16"
    line = next(d for d in result.decisions if d.startswith("precision"))
    assert "alternating pairs" in line and "1.35× fp32" in line
    no_pairs = FakeMachine(speed=lambda p: solo(p, 1), memory=linear_memory(GiB, 0.01 * GiB), device_type="cpu",
                           spread=0.185)
    kept = search(no_pairs, Plan(), settings(effective_batch=8, try_compile=False, supports={"bf16": True},
                                             fused_available=False))
    assert kept.plan.precision == "fp32"  # within the noise and less simple: kept out, as before


class SteadyMachine(PairingMachine):
    """A PairingMachine whose every separate trial ran while other processes kept `load(n)` cores busy, n the
    trial's number from 1."""

    def __init__(self, load: Callable[[int], float], **kw) -> None:
        super().__init__(**kw)
        self.load, self.n = load, 0

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        self.n += 1
        t.busy_cores = self.load(self.n)
        t.contended = t.busy_cores >= 0.5
        return t

    def paired(self, a: Trial, b: Trial, stage: str, **kw) -> Pairs:
        out = super().paired(a, b, stage, **kw)
        self.n += 1
        for t in (out.a, out.b):
            t.busy_cores = self.load(self.n)
            t.contended = t.busy_cores >= 0.5
        return out


def test_trials_under_the_same_load_decide_alone_and_under_uneven_loads_the_reason_is_said(monkeypatch):
    # A steady neighbour loads every trial alike (1.0 of 2 cores in each): a decisive gain read in separate trials
    # is taken as on a quiet machine, without pairs - the steady check of issue 28 left one thread's +401 % over
    # torch's two unconfirmed for want of the pairs' budget. A load that moved between the two trials is not alike.
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 120.0, 32: 120.0}  # 16: +50 % alone and side by side
    steady = SteadyMachine(lambda n: 1.0, solo=lambda p, n: true[p.micro_batch], side_by_side=_rates(true),
                           spread=0.01, cores=2)
    result = _tune(steady)
    assert result.plan.micro_batch == 16 and (8, 16) not in steady.pairs
    said = [t.verdict for t in result.trials if "16" in t.verdict]
    assert any("+50.0 %" in v and "both trials under the same load (1.0 and 1.0 of 2 cores busy)" in v for v in said)

    real = SearchState.affordable  # no room for pairs: what stops the uneven comparison is said
    monkeypatch.setattr(SearchState, "affordable",
                        lambda self, what, loader=False, need=None: not what.startswith("timing")
                        and real(self, what, loader, need))
    uneven = SteadyMachine(lambda n: 1.0 if n == 1 else 0.6, solo=lambda p, n: true[p.micro_batch],
                           side_by_side=_rates(true), spread=0.01, cores=2)
    moved = _tune(uneven)
    assert moved.plan.micro_batch == 8 and not uneven.pairs
    first = next(t for t in moved.trials if t.plan.micro_batch == 16)
    assert ("not confirmed: other processes kept the machine busy, unevenly (0.6 and 1.0 of 2 cores during the two "
            "trials), and two trials under different loads decide nothing alone") in first.verdict
    assert "a gain under 15 %" not in first.verdict and "the budget had no room" in first.verdict


def test_pairs_the_budget_cannot_hold_are_not_started():
    a = Trial(stage="x", plan=Plan(micro_batch=8, grad_accum=4), step_s=2.0, steps=3, seconds=8.0)
    b = Trial(stage="x", plan=Plan(micro_batch=16, grad_accum=2), step_s=0.1, steps=30, seconds=4.0)
    assert paired.predicted_seconds(a, b) == pytest.approx(2.0 + 1.0 + 6 * (2.0 + 0.5))
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 86.4, 32: 80.0}  # 16: +8 % alone
    machine = PairingMachine(solo=lambda p, n: true[p.micro_batch], side_by_side=_rates(true), spread=0.01,
                             trial_seconds=20.0)
    result = search(machine, Plan(), settings(effective_batch=32, try_compile=False, supports={},
                                              fused_available=False, budget_s=60.0))
    assert not machine.pairs and result.plan.micro_batch == 8  # a small gain it could not confirm: not taken
    assert any("alternating windows" in s and "the budget had" in s for s in result.skipped)


def test_the_budget_grows_by_the_gain_the_pairs_measured_not_the_separate_trials():
    # 16×2 read +12 % alone against 8×4's first trial (not decisive at ±11 %), +5 % in pairs: the search may spend
    # half of a 5 % saving over the 1,000-s training (24 s), not half of 12 % (54 s).
    true = {1: 40.0, 2: 60.0, 4: 75.0, 8: 80.0, 16: 84.0, 32: 80.0}
    machine = PairingMachine(solo=lambda p, n: 89.6 if p.micro_batch == 16 else true[p.micro_batch],
                             side_by_side=_rates(true))
    result = search(machine, Plan(), settings(effective_batch=32, try_compile=False, supports={},
                                              fused_available=False, budget_s=30, budget_cap_s=200,
                                              training_s=1000, verify=False))
    assert machine.pairs[0] == (8, 16) and result.plan.micro_batch == 16 and all(machine.one_sided)
    grew = next(d for d in result.decisions if d.startswith("budget:"))
    assert grew.startswith("budget: 30 -> 54 s: 16×2 fp32 measured +5.0% over the first trial (the comparisons that "
                           "kept its changes), 48 s saved over the 1000 s training"), grew
