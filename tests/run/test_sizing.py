"""`saturate run`'s side-by-side sized to its share of the predicted training (issue 14): rows and rounds dropped
in the stated order, or no side-by-side at all; run() in-process with a fake tuning, measurer and training (no
timing involved)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from test_side_by_side import Meter

from saturate.engine.summary import RunResult
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.run import flow as run_module
from saturate.run import side_by_side as compare_module
from saturate.run import sizing
from saturate.tune.trial import LoaderTrial, Trial

NAIVE_STEP, TUNED_STEP, SECOND_STEP = 0.5, 0.25, 0.4  # seconds per optimizer step, as the fake tuning measured


def test_a_measurement_times_whole_steps_in_at_least_two_windows():
    assert sizing.timed_s(0.5, 0.5) == pytest.approx(1.0)  # one step per window, two windows
    assert sizing.timed_s(0.1, 3.0) == pytest.approx(3.0)  # 15 steps a window, two windows
    assert sizing.timed_s(0.01, 3.0) == pytest.approx(0.4)  # the measurer stops at MAX_STEPS


def rows(*costs: tuple[str, float]) -> list[sizing.RowCost]:
    return [sizing.RowCost(label, step, 1.0, "test") for label, step in costs]


FOUR = rows(("naive", 0.5), ("guide: g", 0.5), ("runner-up", 0.4), ("tuned", 0.25))  # 5 + 5 + 4.2 + 3 s


def test_rows_then_rounds_are_dropped_in_the_stated_order_each_said():
    everything = sizing.size(FOUR, 100.0)
    assert everything.labels == ["naive", "guide: g", "runner-up", "tuned"] and not everything.dropped
    assert everything.rounds == 3 and everything.measure_s == POLICY.payback.full_measure_s and everything.busy_round
    assert everything.predicted_s <= 100.0
    without_second = sizing.size(FOUR, 13.0)
    assert without_second.labels == ["naive", "guide: g", "tuned"] and len(without_second.dropped) == 1
    assert without_second.dropped[0] == ("runner-up: not measured side by side (with it the side-by-side "
                                         "is predicted at 17.2 s, over its 13.0 s share, 5% of the predicted "
                                         "training; a prediction)")
    two = sizing.size(FOUR, 7.0)  # naive + tuned × 3 rounds is 8 s: 2 rounds (6.5 s)
    assert two.labels == ["naive", "tuned"] and two.rounds == 2 and not two.busy_round
    assert [line.split(" (")[0] for line in two.dropped] == [
        "runner-up: not measured side by side", "guide: g: not measured side by side", "2 rounds instead of 3: 3 are "
        "predicted at 8.0 s, over its 7.0 s share, 5% of the predicted training"]
    assert two.predicted_s <= 7.0 and two.skipped is None
    none = sizing.size(FOUR, 6.0)
    assert none.skipped == ("no side-by-side: naive and tuned in 2 rounds are predicted at 6.5 s, over its 6.0 s "
                            "share, 5% of the predicted training, and no saving predicted for the tuned plan pays for "
                            "more")
    assert sizing.size(FOUR, None).labels == everything.labels  # nothing predicted: every row, in full
    twin = [sizing.RowCost("tuned", 0.0, 0.0, "measured as naive", twin_of="naive")]
    alone = sizing.size([FOUR[0], FOUR[2], *twin], 5.0)  # the runner-up dropped: naive alone, twice, says nothing
    assert alone.skipped == ("no side-by-side: tuned has naive's settings, nothing to compare within its 5.0 s share, "
                             "5% of the predicted training") and alone.dropped[0].startswith("runner-up: not measured")
    assert sizing.size([FOUR[0], FOUR[2], *twin], 100.0).labels == ["naive", "runner-up", "tuned"]


def test_each_measurement_is_as_long_as_the_share_allows_and_a_busy_round_only_when_it_fits():
    roomy = sizing.size(rows(("naive", 0.1), ("tuned", 0.1)), 8.0)
    assert POLICY.payback.min_measure_s < roomy.measure_s < POLICY.payback.full_measure_s
    assert 7.0 <= roomy.predicted_s <= 8.0 and not roomy.busy_round  # whole steps: up to 0.8 s short
    spare = sizing.size(rows(("naive", 0.1), ("tuned", 0.1)), 100.0)
    assert spare.measure_s == POLICY.payback.full_measure_s and spare.busy_round


def test_a_gpu_rebuilds_each_plan_every_round():
    row = sizing.RowCost("naive", 0.5, 1.0, "test")
    assert row.seconds(3, 0.5, resident=True) == pytest.approx(2.0 + 3 * 1.0)
    assert row.seconds(3, 0.5, resident=False) == pytest.approx(3 * (2.0 + 1.0))
    assert sizing.RowCost("tuned", 0.0, 1.0, "measured as naive").seconds(3, 0.5) == 0.0


def test_row_costs_come_from_naive_s_measurement_and_the_tuning_s_trials():
    naive, tuned = Plan(micro_batch=8, name="naive"), Plan(micro_batch=8, precision="bf16", num_workers=2)
    once = Trial(stage="verify", plan=naive, step_s=0.5, samples_per_s=16.0, steps=2, seconds=4.5)  # + 3 warm-up
    trials = [Trial(stage="precision", plan=tuned.replace(num_workers=0), step_s=0.3, samples_per_s=27.0),
              Trial(stage="memory", plan=tuned, step_s=0.1, samples_per_s=80.0)]  # one step: not a throughput
    loaders = [LoaderTrial(num_workers=2, prefetch_factor=2, pin_memory=False, startup_s=0.7)]
    got = {r.label: r for r in sizing.row_costs([("naive", naive), ("guide: g", Plan(micro_batch=4, grad_accum=2)),
                                                  ("tuned", tuned), ("twin", naive.replace(name="x"))],
                                                 once, trials, loaders)}
    assert got["naive"].step_s == 0.5 and got["naive"].build_s == pytest.approx(2.0)  # 4.5 s less 5 steps
    assert got["tuned"].step_s == 0.3 and got["tuned"].build_s == pytest.approx(2.7)  # its loader's start too
    assert got["guide: g"].step_s == 0.5 and "nothing measured it" in got["guide: g"].source
    assert not got["guide: g"].measured and got["tuned"].measured
    assert got["twin"].step_s == 0.0 and got["twin"].source == "measured as naive" and got["twin"].twin_of == "naive"
    cached = sizing.row_costs([("naive", naive), ("tuned", tuned)], None, known={"tuned": 0.2})
    assert [r.step_s for r in cached] == [0.2, 0.2]  # no naive measured: at the slowest step known


def test_without_naive_measured_its_row_is_the_slowest_step_scaled_by_the_matmul_peaks_and_builds_cost_too():
    naive, tuned = Plan(micro_batch=8, name="naive"), Plan(micro_batch=8, precision="bf16")
    trials = [Trial(stage="micro-batch", plan=tuned, step_s=0.4, samples_per_s=20.0)]
    peaks = {"fp32": 200e9, "bf16": 400e9}
    got = {r.label: r for r in sizing.row_costs([("naive", naive), ("tuned", tuned)], None, trials, fixed_s=1.5,
                                                 peak=lambda p: peaks[p.precision])}
    assert got["naive"].step_s == pytest.approx(0.8) and "× 2" in got["naive"].source and not got["naive"].measured
    assert got["tuned"].step_s == 0.4 and got["naive"].build_s == got["tuned"].build_s == 1.5
    slower = {"fp32": 500e9, "bf16": 400e9}  # no native bf16: fp32 is not predicted faster than what was measured
    assert sizing.row_costs([("naive", naive), ("tuned", tuned)], None, trials,
                            peak=lambda p: slower[p.precision])[0].step_s == 0.4


# --- run() in-process --------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    name: str = "w"
    tokens_per_sample: int = 1
    flops_per_sample: Any = None
    guide_plans: tuple[str, ...] = ("timeseries-after",)
    optim: Any = dataclasses.field(default_factory=lambda: SimpleNamespace(effective_batch=8, steps=10))
    val_data: Any = None
    micro_batch: int | None = None
    batch_coupled: Any = None


class Speeds:
    """A fake side-by-side measurer: each plan's samples/s by its name."""

    cores = 1

    def __init__(self) -> None:
        self.measured: list[str] = []

    def verify(self, plan: Plan) -> Trial:
        self.measured.append(plan.name)
        sps = {"naive": 16.0, "runner-up": 20.0, "tuned": 32.0}.get(plan.name, 18.0)
        return Trial(stage="verify", plan=plan, samples_per_s=sps, step_s=8 / sps, peak_memory_bytes=2**20)


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    """run() with a fake tuning (naive measured once at NAIVE_STEP s/step, the tuned plan and a runner-up in its
    trials), a fake side-by-side measurer and a fake training; returns a function of the job's steps."""
    Meter.busy = False
    monkeypatch.setattr(compare_module, "ContentionMeter", Meter)
    measurer = Speeds()
    real_compare = compare_module.compare
    monkeypatch.setattr(sizing, "compare", lambda *a, **k: real_compare(*a, **(k | {"measurer": measurer})))

    def fake_tune(workload, hw, dist, refs, *, steps, **kw):
        once = 1.0 + (2 + POLICY.payback.naive_warmup) * NAIVE_STEP  # a 1 s build, its warm-up and 2 timed steps
        naive = Trial(stage="verify", plan=dict(refs)["naive"], samples_per_s=16.0, step_s=NAIVE_STEP, steps=2,
                      seconds=once)
        tuned = naive.plan.replace(name="tuned") if options["tuned_is_naive"] else \
            Plan(micro_batch=8, precision="bf16", name="tuned")
        trials = [Trial(stage="precision", plan=tuned, samples_per_s=32.0, step_s=TUNED_STEP),
                  Trial(stage="micro-batch", plan=Plan(micro_batch=4, grad_accum=2, precision="bf16"),
                        samples_per_s=20.0, step_s=SECOND_STEP)]
        result = SimpleNamespace(search=SimpleNamespace(trials=trials, loader_trials=[]), plots=[],
                                 plan_path=tmp_path / "plan.toml")
        return run_module.Tuning(tuned, result, 5.0, 20.0, "test budget", steps * NAIVE_STEP, naive=naive,
                                 naive_s=once)

    def fake_train(workload, plan, config, hardware, on_stopped=None):
        config.run_dir.mkdir(parents=True, exist_ok=True)
        (config.run_dir / "summary.json").write_text("{}")
        return RunResult(config.run_dir, plan, config.steps, config.steps, config.steps * TUNED_STEP, 30.0, 30.0,
                         None, "", None, "host RSS", 2.0, None, None, None, False, False, finished=True)

    monkeypatch.setattr(run_module, "_tune", fake_tune)
    monkeypatch.setattr(run_module, "train", fake_train)
    # Of the side-by-side after tuning: the default plan's first steps, which decide whether to tune, are not run
    # here (tests/run/test_first_steps.py); as for a cached plan, run() goes to _tune at once.
    monkeypatch.setattr(run_module, "cache_holds", lambda *a: True)

    options = {"tuned_is_naive": False}

    def go(steps: int, cpu: Any, tuned_is_naive: bool = False) -> tuple[run_module.RunReport, str, dict[str, Any],
                                                                       list[str]]:
        options["tuned_is_naive"] = tuned_is_naive  # the search found nothing: its trial still read faster (noise)
        measurer.measured.clear()
        out = Console(record=True, width=400, file=open("/dev/null", "w"))  # noqa: SIM115
        run_dir = tmp_path / f"run{steps}"
        report = run_module.run(Job(), cpu, steps=steps, run_dir=run_dir, progress=False, console=out)
        return report, out.export_text(), json.loads((Path(run_dir) / "comparison.json").read_text()), \
            list(measurer.measured)
    return go


def test_a_short_job_drops_the_runner_up_and_the_guide_and_says_so(fake_run, cpu):
    # 400 steps at naive's 0.5 s: 200 s predicted, a 10 s share. Naive + guide (5 s each at the least), runner-up
    # (4.2 s) and tuned (3 s) do not fit; naive and tuned in 3 rounds (8 s) do.
    report, text, result, measured = fake_run(400, cpu)
    assert set(measured) == {"naive", "tuned"} and len(measured) == 6
    assert "runner-up: not measured side by side" in text
    assert "guide: timeseries-after: not measured side by side" in text
    assert [r["label"] for r in result["rows"]] == ["naive", "tuned", "training run"]
    assert len(result["sizing"]["dropped"]) == 2 and result["sizing"]["rows_kept"] == ["naive", "tuned"]
    assert result["side_by_side"]["rounds"] == 3 and result["reason"] is None
    assert result["timing"]["predicted_side_by_side_s"] <= result["timing"]["side_by_side_share_s"] == 10.0
    assert "tuned vs naive: 2.00× (2.00–2.00), median of 3 interleaved rounds" in text


def test_a_long_job_keeps_every_row(fake_run, cpu):
    report, text, result, measured = fake_run(4000, cpu)  # 2000 s predicted: a 100 s share
    assert [r["label"] for r in result["rows"]] == ["naive", "guide: timeseries-after", "runner-up", "tuned",
                                                    "training run"]
    assert not result["sizing"]["dropped"] and "not measured side by side" not in text
    assert result["sizing"]["measure_s"] == POLICY.payback.full_measure_s and len(measured) == 12


def test_naive_and_the_tuned_plan_in_two_rounds_may_cost_more_than_the_share(fake_run, cpu):
    # 100 steps at naive's 0.5 s: 50 s predicted, a 2.5 s share. Naive and tuned in 2 rounds (6.5 s) are over it but
    # within 15 % of the training (7.5 s) and under the tuned plan's predicted saving (25 s): measured anyway.
    report, text, result, measured = fake_run(100, cpu)
    assert sorted(measured) == ["naive", "naive", "tuned", "tuned"] and report.comparison is not None
    assert result["side_by_side"]["rounds"] == 2 and result["reason"] is None
    assert ("naive and tuned in 2 rounds, the least side-by-side, are predicted at 6.5 s, over its 2.5 s share, 5% of "
            "the predicted training: measured anyway, within 7.5 s") in text
    assert "tuned vs naive: 2.00× (2.00–2.00), median of 2 interleaved rounds" in text


def test_a_job_too_short_for_a_side_by_side_skips_it_says_why_and_prints_no_ratio(fake_run, cpu):
    report, text, result, measured = fake_run(60, cpu)  # 30 s predicted: 6.5 s is over 15 % of it (4.5 s)
    assert measured == [] and report.comparison is None
    assert result["side_by_side"] is None and result["reason"] == (
        "no side-by-side: naive and tuned in 2 rounds are predicted at 6.5 s, over its 1.5 s share, 5% of the "
        "predicted training, and over the 4.5 s allowed beyond it (15% of the predicted training, and under the tuned "
        "plan's predicted saving)")
    assert "no before/after ratio" in text
    assert [r["label"] for r in result["rows"]] == ["naive", "training run"]
    assert result["rows"][0]["note"] == "measured once, before tuning (no side-by-side)"
    assert result["verdicts"] == ["no before/after ratio: the training run (tuned) read 30.0 samples/s and naive, "
                                  "measured once before tuning, 16.0 — minutes apart, not side by side, so their "
                                  "ratio would carry whatever the machine's load did in between"]
    table = text.split("before and after, measured in this run")[1].split("no before/after ratio")[0]
    assert [line.split()[-1] for line in table.splitlines() if line.startswith(("naive", "training run"))] == ["-", "-"]
    assert result["timing"]["side_by_side_s"] == 0.0 and result["trained"] == "tuned"
    assert ("no side-by-side; predicted saving over 60 steps: 15 s (30 s untuned → 15 s with tuned; a prediction "
            "from naive's one measurement and the plan's tuning trial)") in text  # 0.5 s against the trial's 0.25 s


def test_a_tuned_plan_with_naive_s_settings_predicts_no_saving_from_two_readings_of_them(fake_run, cpu):
    report, text, result, measured = fake_run(60, cpu, tuned_is_naive=True)
    assert measured == [] and result["side_by_side"] is None and "tuned has naive's settings" in result["reason"]
    assert "tuning cost 5 s, no side-by-side; no saving: tuned has naive's settings" in text
    assert "predicted saving" not in text and result["timing"]["predicted_saving_s"] == 0.0


def test_the_least_side_by_side_is_not_bought_beyond_the_predicted_saving():
    naive, tuned = sizing.RowCost("naive", 0.5, 1.0, "naive's measurement"), sizing.RowCost("tuned", 0.45, 1.0, "t")
    assert sizing.least_allowance([naive, tuned], 100.0) == pytest.approx(10.0)  # saves 10 %: under 15 %
    assert sizing.least_allowance([naive, sizing.RowCost("tuned", 0.2, 1.0, "t")], 100.0) == pytest.approx(15.0)
    assert sizing.least_allowance([naive, sizing.RowCost("tuned", 0.6, 1.0, "t")], 100.0) == 0.0  # slower: nothing
    # what the search already spent of the saving (beyond its first budget) is not spent again
    assert sizing.least_allowance([naive, tuned], 100.0, spent_s=4.0) == pytest.approx(6.0)
    assert sizing.least_allowance([naive, tuned], 100.0, spent_s=12.0) == 0.0
    guessed = sizing.RowCost("tuned", 0.2, 1.0, "nothing measured it", measured=False)  # a guess predicts no saving
    assert sizing.least_allowance([naive, guessed], 100.0) == 0.0
    unmeasured = sizing.RowCost("naive", 0.5, 1.0, "nothing measured it", measured=False)
    assert sizing.least_allowance([unmeasured, tuned], 100.0) == 0.0
    assert sizing.size([naive, tuned], 5.0, least_s=8.0).skipped is None  # 2 rounds: 7.7 s
    assert sizing.size([naive, tuned], 5.0, least_s=7.0).skipped.startswith("no side-by-side")


def test_naive_s_measurement_that_sized_the_budget_counts_against_it(tmp_path, cpu, monkeypatch):
    clock = [100.0]

    class TimedNaive:  # naive measured once: 3 s on the fake clock, 0.5 s a step
        def __init__(self, *a, **k) -> None:
            pass

        def verify(self, plan: Plan) -> Trial:
            clock[0] += 3.0
            return Trial(stage="verify", plan=plan, samples_per_s=16.0, step_s=0.5, steps=2, seconds=3.0)

    budgets = []
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(run_module, "RealMeasurer", TimedNaive)
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: budgets.append((k["budget_s"], k["budget_cap_s"])) or
                        SimpleNamespace(plan=Plan(name="tuned"), search=SimpleNamespace(budget_s=k["budget_cap_s"])))
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    got = run_module._tune(Job(), cpu, SimpleNamespace(world_size=1, is_main=True),
                           [("naive", Plan(micro_batch=8, name="naive"))], budget_s=None, steps=400, minutes=None,
                           allow_batch_change=True, run_dir=tmp_path, seed=0, console=quiet, try_compile=True)
    # 10 % of 200 s, growing to 20 % by what the search saves, both less naive's 3 s; the search grew it to the cap
    assert budgets == [(pytest.approx(17.0), pytest.approx(37.0))] and got.budget_s == pytest.approx(40.0)
    assert got.naive.step_s == 0.5 and got.naive_s == pytest.approx(3.0) and "measurement included" in got.why


def test_a_budget_that_naive_s_measurement_used_up_trains_the_default_plan(tmp_path, cpu, monkeypatch):
    # Issue 31's --steps 20 on a busy machine: naive took 38.8 s of a 17 s budget, and tune() was called with -21.9 s
    # ("budget must be > 0 seconds"). The job is not tuned instead, and the line says why.
    clock = [100.0]

    class SlowNaive:
        def __init__(self, *a, **k) -> None:
            pass

        def verify(self, plan: Plan) -> Trial:
            clock[0] += 38.8
            return Trial(stage="verify", plan=plan, samples_per_s=8 / 8.47, step_s=8.47, steps=1, seconds=38.8)

    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(run_module, "RealMeasurer", SlowNaive)
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: pytest.fail(f"tuned with {k['budget_s']:g} s"))
    quiet = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    got = run_module._tune(Job(), cpu, SimpleNamespace(world_size=1, is_main=True),
                           [("naive", Plan(micro_batch=8, name="naive"))], budget_s=None, steps=20, minutes=None,
                           allow_batch_change=True, run_dir=tmp_path, seed=0, console=quiet, try_compile=True)
    assert got.label == "default" and got.result is None and got.budget_s == pytest.approx(16.94)
    assert got.why.startswith("not tuned: the untuned training is predicted at 169 s")
    assert "measuring naive to predict it took 39 s of the 17 s (10 %) tuning may" in " ".join(got.why.split())


def test_without_a_side_by_side_a_run_of_naive_s_settings_is_not_called_a_gain():
    naive = Plan(micro_batch=8, name="naive")
    row = lambda label, plan, sps: sizing.Row(label, plan, sps, sps, 8 / sps, None, None, None)  # noqa: E731
    same = sizing.once_verdict([row("naive", naive, 16.0), row("training run", naive.replace(name="default"), 12.0)],
                               "default")
    assert same == ["training run (default): naive's settings, so no before/after"]
    assert sizing.once_verdict([row("training run", naive, 12.0)], "tuned") == [
        "no before/after: there was no side-by-side and naive was not measured in this run"]
