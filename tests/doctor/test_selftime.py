"""The hooks' own time: each hook body counted once, the script's code taken out; the Profiler reports it per
timed step. Counted on a fake clock (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from toy import Samples, neighbours_ignored, one_thread  # noqa: F401

from saturate import Profiler
from saturate.doctor import selftime


@pytest.fixture
def clock(monkeypatch):
    """selftime's clock stepped by hand: `clock.t` nanoseconds; the process totals start at 0."""

    class Clock:
        t = 0

        def __call__(self) -> int:
            return self.t

    c = Clock()
    for name, value in (("_now", c), ("_ns", 0), ("_calls", 0), ("_inside", False), ("_start", 0)):
        monkeypatch.setattr(selftime, name, value)
    return c


def test_a_hook_body_counts_and_the_script_code_it_calls_does_not(clock):
    def script_code():
        clock.t += 1000  # the user's dataset, torch's own work

    @selftime.own
    def hook():
        clock.t += 10
        selftime.foreign(script_code)
        clock.t += 5
        return "batch"

    assert hook() == "batch"
    assert selftime.mark() == (15, 1)


def test_a_hook_inside_a_hook_is_counted_once_and_one_fired_by_the_script_code_counts(clock):
    @selftime.own
    def inner():
        clock.t += 7

    def script_code():
        clock.t += 100
        inner()  # a forward hook fired by the model the wrapper's script code runs

    @selftime.own
    def outer():
        clock.t += 3
        inner()  # nested: part of outer
        selftime.foreign(script_code)
        clock.t += 2

    outer()
    assert selftime.mark() == (3 + 7 + 7 + 2, 2)  # outer once, the fired inner once; the 100 not ours


def test_an_exception_in_a_hook_still_closes_its_account(clock):
    @selftime.own
    def failing():
        clock.t += 4
        raise StopIteration

    with pytest.raises(StopIteration):
        failing()

    @selftime.own
    def later():
        clock.t += 1

    later()
    assert selftime.mark() == (5, 2)


def test_mark_includes_the_running_body_so_far(clock):
    seen = []

    @selftime.own
    def hook():
        clock.t += 6
        seen.append(selftime.mark())
        clock.t += 1

    hook()
    assert seen == [(6, 1)] and selftime.mark() == (7, 1)


def test_summary_is_per_step_with_its_median_and_range():
    marks = [(0, 0), (2_000, 3), (3_000, 6), (13_000, 9)]  # 2 µs, 1 µs, 10 µs in three steps
    s = selftime.summary(marks, [1e-3, 1e-3, 2e-3])
    assert s["steps"] == 3 and s["calls_per_step"] == 3
    assert s["hook_s"] == pytest.approx(13e-6)
    assert s["per_step_s"] == pytest.approx(2e-6) and s["per_step_range_s"] == pytest.approx([1e-6, 10e-6])
    assert s["share_of_step"] == pytest.approx(2e-3) and s["share_range"] == pytest.approx([1e-3, 5e-3])


@pytest.mark.usefixtures("one_thread", "neighbours_ignored")
def test_the_profiler_reports_its_hooks_own_time_per_timed_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = Profiler(model, opt, warmup=1, count_steps=1, steps=4, report=False)
    batches = prof.data(DataLoader(Samples(), batch_size=8))
    for _ in range(6):
        for _ in range(2):  # accumulation 2
            x, y = next(batches)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        prof.step()
    own = prof.instrumentation
    assert own is not None and own["steps"] == 4
    # per micro-batch: the batch, the forward's begin and end, backward's begin and end; per step: the
    # optimizer's pre and post hooks and step() -> 2 * 5 + 3 bodies, each counted once
    assert own["calls_per_step"] == 13
    assert own["hook_s"] > 0 and own["per_step_range_s"][0] <= own["per_step_s"] <= own["per_step_range_s"][1]
    assert 0 < own["share_of_step"] < 1 and own["sampler_cpu_s"] is not None
