"""The side-by-side's measurers on the CPU with real steps: plans kept between rounds, timed seconds capped."""

from __future__ import annotations

import dataclasses

import pytest

from saturate.plan import Plan
from saturate.run import resident
from saturate.run.resident import ResidentMeasurer
from saturate.stats.noise import WindowRule
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload


@pytest.fixture
def workload(small_corpus):
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=2)


@pytest.mark.slow
def test_a_plan_is_built_and_warmed_up_once_then_each_call_times_more_of_its_run(workload, cpu, monkeypatch):
    built = []
    real = resident.Stepper
    monkeypatch.setattr(resident, "Stepper", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    m = ResidentMeasurer(workload, cpu, window_s=0.0, min_steps=1, rule=WindowRule(min_windows=2))
    m.window_cap_s = 0.0  # the minimum windows only
    a, b = Plan(micro_batch=2, grad_accum=2, name="a"), Plan(micro_batch=1, grad_accum=4, name="b")
    first, other, again = m.verify(a), m.verify(b), m.verify(a.replace(name="a again"))
    assert first.ok and other.ok and again.ok and all(t.samples_per_s for t in (first, other, again))
    assert [p.micro_batch for p in built] == [2, 1]  # `a` measured twice, built once
    assert first.windows == again.windows == 2 and first.losses != again.losses  # the same run, further on
    m.close()
    assert m.verify(a).ok and len(built) == 3  # closed: built again


def test_a_failed_plan_is_said_and_not_kept(workload, cpu):
    def fails(model, batch):
        raise RuntimeError("the loss cannot be computed")

    m = ResidentMeasurer(dataclasses.replace(workload, loss_fn=fails), cpu, window_s=0.0, min_steps=1,
                         rule=WindowRule(min_windows=2))
    t = m.verify(Plan(micro_batch=2, grad_accum=2))
    assert t.status == "failed" and "the loss cannot be computed" in t.error and t.samples_per_s is None
    assert not m._held


def test_the_window_cap_ends_a_trial_after_its_minimum_windows(workload, cpu):
    m = RealMeasurer(workload, cpu, window_s=0.0, min_steps=1, rule=WindowRule(target=0.0, max_windows=50,
                                                                               max_seconds=600))
    m.window_cap_s = 0.0  # windows never agree within 0 %: only the cap ends the trial
    t = m.model_trial(Plan(micro_batch=2, grad_accum=2), "x")
    assert t.ok and t.windows == 3


@pytest.mark.slow
def test_plans_that_would_not_fit_together_are_built_again(workload, cpu, monkeypatch):
    built = []
    real = resident.Stepper
    monkeypatch.setattr(resident, "Stepper", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    m = ResidentMeasurer(workload, cpu, window_s=0.0, min_steps=1, rule=WindowRule(min_windows=2))
    m.window_cap_s = 0.0
    a, b = Plan(micro_batch=2, grad_accum=2, name="a"), Plan(micro_batch=1, grad_accum=4, name="b")
    assert m.verify(a).ok
    m.memory_capacity = -1  # nothing more fits beside `a`: it is dropped before `b` is built
    assert m.verify(b).ok and m.verify(a).ok
    assert [p.micro_batch for p in built] == [2, 1, 2]
