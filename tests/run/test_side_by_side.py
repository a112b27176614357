"""`saturate run`'s side-by-side comparison and its choices, against a fake measurer (no timing involved)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from saturate.hardware.contention import Contention
from saturate.hardware.mfu import mfu
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.run import flow as run_module
from saturate.run import side_by_side as compare_module
from saturate.run.side_by_side import compare, runner_up
from saturate.run.table import comparison_table
from saturate.tune.trial import Trial

WORKLOAD = SimpleNamespace(name="w", tokens_per_sample=1, flops_per_sample=None)


class Rounds:
    """verify() gives each plan's samples/s from `speeds[name]`, times `load[i]` for the i-th measurement overall
    (a burst of load on the machine hits whatever runs then)."""

    def __init__(self, speeds: dict[str, float], load: list[float] | None = None) -> None:
        self.speeds, self.load, self.order = speeds, load or [], []
        self.cores = 1

    def verify(self, plan: Plan) -> Trial:
        factor = self.load[len(self.order)] if len(self.order) < len(self.load) else 1.0
        self.order.append(plan.name)
        sps = self.speeds[plan.name] * factor
        return Trial(stage="verify", plan=plan, samples_per_s=sps, step_s=plan.samples_per_step() / sps,
                     peak_memory_bytes=2**20)


class Meter:
    busy = False

    def start(self) -> Meter:
        return self

    def stop(self) -> Contention:
        return Contention(seconds=1.0, usable_cores=2, other_cores=1.0 if self.busy else 0.0, own_cores=1.0)


@pytest.fixture
def meter(monkeypatch):
    Meter.busy = False
    monkeypatch.setattr(compare_module, "ContentionMeter", Meter)
    return Meter


def plans(*names: str) -> list[tuple[str, Plan]]:
    """Plans with different settings (one with the settings of another is measured once: see below)."""
    return [(n, Plan(micro_batch=4, grad_accum=2, num_workers=i, name=n)) for i, n in enumerate(names)]


def measure(speeds, cpu, load=None, console=None):
    m = Rounds(speeds, load)
    return compare(WORKLOAD, cpu, plans(*speeds), measurer=m, console=console), m


def test_rounds_alternate_and_the_ratio_is_the_median_of_per_round_ratios(cpu, meter):
    # A burst of load in the second round halves whatever runs then: naive and tuned alike.
    cmp, m = measure({"naive": 100.0, "runner-up": 150.0, "tuned": 200.0}, cpu, load=[1, 1, 1, .5, .5, .5])
    assert m.order == ["naive", "runner-up", "tuned", "tuned", "runner-up", "naive",
                       "naive", "runner-up", "tuned"] and cmp.rounds == 3
    tuned = cmp.row("tuned")
    assert tuned.rounds == [200.0, 100.0, 200.0] and tuned.samples_per_s == 200.0
    assert tuned.vs_naive.median == pytest.approx(2.0) and tuned.vs_naive.low == pytest.approx(2.0)
    assert tuned.vs_naive.faster and cmp.faster_than("tuned") is None
    assert cmp.to_dict()["contention"]["significant"] is False


def test_a_busy_machine_gets_one_more_round_and_is_said(cpu, meter):
    meter.busy = True
    out = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    cmp, m = measure({"naive": 100.0, "tuned": 200.0}, cpu, console=out)
    assert cmp.rounds == 4 and len(m.order) == 8 and len(cmp.row("naive").rounds) == 4
    assert cmp.contention.significant() and "machine busy" in cmp.contention.line()
    text = out.export_text()
    # Issue 31: the counter read 3/3 then 4/4; the total planned stays fixed and the added round says what it is.
    assert "round 3/3: naive" in text and "4/4" not in text
    assert "round 4 (extra: the machine was busy): naive 100.0 · tuned 200.0 samples/s" in text


def test_a_tuned_plan_slower_than_naive_in_every_round_is_not_trained(cpu, meter):
    cmp, _ = measure({"naive": 100.0, "tuned": 47.0}, cpu)
    trained, lines, notes = run_module.choose_trained(cmp)
    assert trained == "naive"
    assert lines == ["tuned vs naive: 0.47× (0.47–0.47), median of 3 interleaved rounds (range)"]
    assert notes and "slower than naive in every round" in notes[0] and "training with naive instead" in notes[0]


def test_a_cached_plan_beaten_in_every_round_is_replaced_in_the_cache(cpu, meter, tmp_path, monkeypatch):
    from saturate import plan_cache as cache

    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path))
    job = SimpleNamespace(name="w", fingerprint=lambda: "data", optim=SimpleNamespace(effective_batch=8))
    cmp, _ = measure({"naive": 100.0, "tuned": 47.0}, cpu)
    tuned = cmp.row("tuned").plan.replace(provenance={"tuned_at": "then", "verified_samples_per_s": 47.0})
    cache.store(tuned, job, "hw")
    line = run_module.recache(job, SimpleNamespace(fingerprint=lambda: "hw"), 1, tuned, cmp.row("naive"))
    plan, _ = cache.lookup(job, "hw")
    assert plan.num_workers == cmp.row("naive").plan.num_workers != tuned.num_workers  # naive's settings now
    assert plan.provenance["measured_samples_per_s"] == 100.0 and "verified_samples_per_s" not in plan.provenance
    assert plan.provenance["replaced_because"].startswith("naive: trained instead") and "naive's settings" in line


def test_within_noise_is_no_measurable_gain_and_tuned_still_trains(cpu, meter):
    cmp, _ = measure({"naive": 100.0, "tuned": 101.0}, cpu, load=[1, 1, 1, 1.05, 1, 1])  # naive ran fast once
    trained, lines, notes = run_module.choose_trained(cmp)
    assert trained == "tuned" and not notes
    assert lines[0].startswith("tuned vs naive: no measurable gain (") and "too short" not in lines[0]
    cmp.measure_s = 0.6  # measurements sized to a short job: said
    assert run_module.choose_trained(cmp)[1][0].endswith("each measurement was 0.6 s, sized to the job: too short to "
                                                  "resolve a gain this small")
    cmp, _ = measure({"naive": 100.0, "tuned": 150.0}, cpu)
    cmp.measure_s = 0.6  # a gain resolved however briefly measured: nothing to excuse
    assert "too short" not in run_module.choose_trained(cmp)[1][0]


def test_the_before_after_table_fits_80_columns(cpu, meter):
    cmp, _ = measure({"naive": 1234.5, "guide: timeseries-after": 2345.6, "runner-up": 3456.7, "tuned": 4567.8},
                     cpu)
    workload = SimpleNamespace(name="ts-lstm", tokens_per_sample=128)
    for r in cmp.rows:
        r.tokens_per_s, r.utilisation = r.samples_per_s * 128, 0.97
        r.mfu = mfu(r.samples_per_s * 1e6, 1e9, "test peak")
    out = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    out.print(comparison_table(cmp.rows, workload, "host RSS"))
    lines = out.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, "\n".join(lines)
    assert any(re.search(r"tuned .* 3\.70×", line) for line in lines)


def test_the_runner_up_is_the_fastest_plan_not_chosen():
    chosen = Plan(micro_batch=8, grad_accum=1, num_workers=2, prefetch_factor=2, persistent_workers=True)
    trial = lambda plan, sps, stage="micro-batch", status="ok": Trial(stage=stage, plan=plan, samples_per_s=sps,  # noqa: E731
                                                                      status=status)
    trials = [trial(Plan(micro_batch=8), 90.0, "precision"),
              trial(Plan(micro_batch=2, grad_accum=4), 500.0, "memory"),  # one step: not a throughput
              trial(Plan(micro_batch=4, grad_accum=2), 80.0),
              trial(Plan(micro_batch=8, compile="default"), 300.0, "compile"),  # a compilation every round
              trial(Plan(micro_batch=8, grad_accum=1, fused_optimizer=True), 85.0, "fused-optimizer"),
              trial(Plan(micro_batch=16), 0.0, status="oom")]
    second = runner_up(trials, chosen)
    assert (second.micro_batch, second.fused_optimizer, second.num_workers, second.name) == (8, True, 2, "runner-up")
    assert runner_up(trials[:1], Plan(micro_batch=8)) is None  # only the chosen plan's own trial
    assert runner_up(trials, chosen, [trials[4].plan]).micro_batch == 4  # not one of the reference plans


def test_the_tuning_budget_follows_the_training_time():
    budget = run_module.tuning_budget
    assert budget(7.0) is None  # a 20-step job: not tuned at all, not minutes of tuning
    assert budget(99.0) is None  # its 10 % is under the 10 s floor
    assert budget(200.0) == pytest.approx((20.0, 40.0))  # the main job: 10 %, growing by what it saves to 20 %
    assert budget(400.0) == pytest.approx((40.0, 80.0))  # where 20 % meets 60 s + 5 %
    assert budget(1800.0) == pytest.approx((150.0, 150.0))  # half an hour: 60 s + 5 %, not 20 % (360 s)
    assert budget(8000.0) == pytest.approx((460.0, 460.0))
    assert budget(1e6) == (POLICY.payback.budget_ceiling_s, POLICY.payback.budget_ceiling_s)
    # from the informed plan: half the share to begin with, the same cap, and nothing under 15 s (300 s of training)
    assert budget(200.0, informed=True) is None and budget(299.0, informed=True) is None
    assert budget(400.0, informed=True) == pytest.approx((20.0, 80.0))
    assert budget(8000.0, informed=True) == pytest.approx((400.0, 460.0))


def test_a_cached_plan_is_reused_with_no_tuning(tmp_path, cpu, monkeypatch):
    from saturate import plan_cache as cache

    workload = SimpleNamespace(name="w", fingerprint=lambda: {"m": 1}, optim=SimpleNamespace(effective_batch=8))
    plan = Plan(micro_batch=4, grad_accum=2, name="tuned", provenance={"world_size": 1, "tuned_at": "then",
                                                                       "verified_samples_per_s": 80.0})
    cache.store(plan, workload, cpu.fingerprint())
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: pytest.fail("tuned although a plan was cached"))
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    kw = dict(steps=100, minutes=None, allow_batch_change=False, run_dir=tmp_path, seed=0, console=quiet,
              try_compile=True)
    got = run_module._tune(workload, cpu, SimpleNamespace(world_size=1, is_main=True), [], budget_s=None, **kw)
    assert got.result is None and got.seconds == 0.0 and got.plan.micro_batch == 4
    assert got.predicted_training_s == pytest.approx(100 * 8 / 80.0)
    unverified = plan.replace(provenance={"world_size": 1, "measured_samples_per_s": 40.0})  # tuned by `run`
    cache.store(unverified, workload, cpu.fingerprint())
    got = run_module._tune(workload, cpu, SimpleNamespace(world_size=1, is_main=True), [], budget_s=None, **kw)
    assert got.predicted_training_s == pytest.approx(100 * 8 / 40.0)
    budgets = []
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: budgets.append((k["budget_s"], k["verify"]))
                        or SimpleNamespace(plan=plan))
    run_module._tune(workload, cpu, SimpleNamespace(world_size=1, is_main=True), [], budget_s=42.0, **kw)
    assert budgets == [(42.0, False)]  # --budget overrides the cache; the side-by-side measures the plan again
    run_module._tune(workload, cpu, SimpleNamespace(world_size=1, is_main=True), [], budget_s=None,
                     **(kw | {"minutes": 60.0, "try_compile": True, "allow_batch_change": True}))
    assert budgets[-1][0] == pytest.approx(240.0)  # no cache with a batch change: 60 s + 5 % of the hour


def test_a_cached_plan_of_fewer_threads_runs_at_torchs_own_when_the_machine_is_quiet_now(tmp_path, cpu,
                                                                                          monkeypatch):
    from saturate import plan_cache as cache
    from saturate.engine import resume

    workload = SimpleNamespace(name="w", fingerprint=lambda: {"m": 3}, optim=SimpleNamespace(effective_batch=8))
    plan = Plan(micro_batch=8, threads=1, name="tuned",
                provenance={"world_size": 1, "threads": "chosen while other processes kept 1.0 of 2 cores busy"})
    cache.store(plan, workload, cpu.fingerprint())
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: pytest.fail("tuned although a plan was cached"))
    said = []
    console = SimpleNamespace(print=lambda line, *a, **k: said.append(str(line)))
    kw = dict(steps=100, minutes=None, allow_batch_change=False, run_dir=tmp_path, seed=0, console=console,
              try_compile=True)
    for other, threads in ((0.05, None), (1.2, 1)):
        monkeypatch.setattr(resume, "measure_contention", lambda seconds, o=other: Contention(
            seconds=seconds, usable_cores=2, other_cores=o, own_cores=0.0))
        said.clear()
        got = run_module._tune(workload, cpu, SimpleNamespace(world_size=1, is_main=True), [], budget_s=None, **kw)
        assert got.plan.threads == threads
        assert any(("quiet now" if threads is None else "now too, so it stays") in line for line in said)


@dataclasses.dataclass
class Job:  # a workload's fields that matter to _tune (a dataclass: its validation data is left out to predict)
    name: str = "w"
    fingerprint: Any = lambda: {"m": 2}
    optim: Any = dataclasses.field(default_factory=lambda: SimpleNamespace(effective_batch=8))
    micro_batch: int | None = None
    batch_coupled: Any = None
    val_data: Any = "validation"


def test_a_job_too_short_for_one_trial_trains_the_default_plan_untuned(tmp_path, cpu, monkeypatch):
    from saturate.tune.trial import BudgetTooSmall

    workload = Job()
    naive = Plan(micro_batch=8, name="naive")

    class OneNaive:
        def __init__(self, workload, *a, **k) -> None:
            assert workload.val_data is None  # one window of training steps predicts the training

        def verify(self, plan: Plan) -> Trial:
            return Trial(stage="verify", plan=plan, samples_per_s=16.0, step_s=0.5)

    def too_small(*a, **k):
        raise BudgetTooSmall(f"tuning budget {k['budget_s']:g} s is too small: the first trial took 30 s")

    monkeypatch.setattr(run_module, "RealMeasurer", OneNaive)
    monkeypatch.setattr(run_module, "tune", too_small)
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    kw = dict(minutes=None, allow_batch_change=False, run_dir=tmp_path, seed=0, console=quiet, try_compile=True)
    dist = SimpleNamespace(world_size=1, is_main=True)
    got = run_module._tune(workload, cpu, dist, [("naive", naive)], budget_s=None, steps=20, **kw)
    assert got.label == "default" and got.result is None and got.plan.name == "default"
    assert got.budget_s is None and got.predicted_training_s == pytest.approx(10.0)  # 20 steps × 0.5 s: too short
    assert "not tuned" in got.why and "--budget tunes anyway" in got.why
    got = run_module._tune(workload, cpu, dist, [("naive", naive)], budget_s=None, steps=400, **kw)
    assert got.label == "default" and got.budget_s == pytest.approx(20.0)  # tried: no trial fits the 20 s
    assert "does not hold one trial" in got.why
    got = run_module._tune(workload, cpu, dist, [("naive", naive)], budget_s=5.0, steps=20, **kw)
    assert got.label == "default" and "no change measured: tuning budget 5 s is too small" in got.why  # the user's


def test_a_plan_with_the_same_settings_as_another_is_measured_once_and_not_called_a_gain(cpu, meter):
    m = Rounds({"naive": 100.0, "tuned": 100.0})
    same = [("naive", Plan(micro_batch=8, grad_accum=4, name="naive")), ("tuned", Plan(micro_batch=8, grad_accum=4))]
    cmp = compare(WORKLOAD, cpu, same, measurer=m)
    assert m.order == ["naive"] * 3  # the tuned plan is naive's settings: not measured again
    tuned = cmp.row("tuned")
    assert [r.label for r in cmp.rows] == ["naive", "tuned"] and tuned.rounds == cmp.row("naive").rounds
    assert tuned.vs_naive is None and tuned.note == "the same settings as naive: measured once"
    assert tuned.twin == "naive" and cmp.row("naive").twin is None and tuned.to_dict()["twin"] == "naive"
    trained, lines, notes = run_module.choose_trained(cmp)
    assert trained == "tuned" and not notes
    assert lines == ["tuned: the same settings as naive: measured once (nothing to compare)"]
