"""`saturate run` with nothing cached and no --budget trains the default plan at once (issue 30): its first steps
predict the job; too short to tune, it trains on with nothing measured before it; long enough, it pauses, the job
is tuned, and training goes on from its checkpoint with the plan found."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.run import first_steps, job_window
from saturate.run import flow as run_module
from saturate.run.sizing import Sizing
from saturate.workloads import build_workload

QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115


def fake_meter(busy):
    """A ContentionMeter whose every window reads as `busy()` says."""

    class Meter:
        def start(self):
            return self

        def stop(self):
            return type("Seen", (), {"significant": lambda self: busy()})()

    return Meter


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Other processes' load as a quiet machine reads (the suite's own subprocesses and a busy CI host would have
    the job timed again: `POLICY.job.size_tries`); the tests of that patch their own."""
    monkeypatch.setattr(job_window, "ContentionMeter", fake_meter(lambda: False))


def test_the_timed_window_counts_every_step_in_it_whatever_windows_the_loop_closes_inside():
    """Logs or a validation inside the timed steps close windows of their own: the job's figure is the sum over
    them, and the watch asks for its window's end, not for theirs."""
    from saturate.engine.trainer import Window
    from saturate.run.job_window import JobWindows

    decided = []
    watch = JobWindows(lambda step, per_step: decided.append((step, per_step)) or "pause")
    start = watch.first(0)
    end = start + POLICY.job.size_steps
    assert start == POLICY.job.size_after
    assert watch.closed(Window(start, start, 99.0, 100)) == (end, None)  # the cold steps before: not counted
    assert watch.closed(Window(start + 1, 1, 4.0, 100)) == (end, None)  # a log window inside: counted, no answer
    assert watch.closed(Window(end, end - start - 1, 1.0 * (end - start - 1), 100)) == (None, "pause")
    assert decided == [(end, (4.0 + end - start - 1) / (end - start))]


def tiny(corpus):
    return build_workload("gpt-tiny", data=[str(corpus)], effective_batch=8, warmup_steps=2, n_layer=1, n_embd=32,
                          n_head=2, seq_len=32)


def test_a_short_job_trains_the_default_plan_from_its_first_step_with_nothing_measured_before(
        tmp_path, small_corpus, cpu, monkeypatch):
    monkeypatch.setattr(run_module, "RealMeasurer", lambda *a, **k: pytest.fail("measured before training"))
    monkeypatch.setattr(run_module, "tune", lambda *a, **k: pytest.fail("tuned a job too short to pay for it"))
    report = run_module.run(tiny(small_corpus), cpu, steps=12, run_dir=tmp_path / "run", progress=False,
                            console=QUIET, try_compile=False)
    assert report.trained == "default" and report.tuned is None and report.comparison is None
    assert report.training.finished and report.training.steps == 12 and report.training.plan.name == "default"
    assert report.tuning.why.startswith("not tuned: the training is predicted at")
    assert "measured over its steps 5-9" in report.tuning.why
    assert [r.label for r in report.rows] == ["training run"]
    doc = json.loads((tmp_path / "run" / "comparison.json").read_text())
    assert doc["trained"] == "default" and doc["side_by_side"] is None
    assert doc["reason"].startswith("no side-by-side: the job is too short to pay for measuring naive")
    assert doc["verdicts"] == ["no before/after: the job is too short to pay for measuring naive beside the default "
                               "plan"]
    assert doc["timing"]["tuning_s"] == 0.0 and doc["timing"]["predicted_training_s"] > 0


def tuned_without_a_search(monkeypatch, found, tuned):
    """A job long enough to tune, whose tuning (without a search) finds `found`, and no side-by-side: each tuning's
    planned steps go in `tuned`."""

    def fake_tune(w, hw, dist, refs, **kw):  # what _tune returns, without the search
        tuned.append(kw["steps"])
        return run_module.Tuning(found, None, 1.5, 30.0, "tuning budget 30 s")

    monkeypatch.setattr(first_steps, "tuning_budget", lambda predicted, informed: (30.0, 60.0))  # long enough to tune
    monkeypatch.setattr(run_module, "_tune", fake_tune)
    monkeypatch.setattr(run_module, "side_by_side", lambda *a, **k: (None, Sizing([], 2, 0.5, False, 0.0, None,
                                                                                  skipped="not measured here")))


@pytest.mark.parametrize("stopped_in", ["the first steps", "the tuned plan's training"])
def test_a_run_stopped_by_a_signal_says_where_and_how_to_resume_before_it_returns(
        tmp_path, small_corpus, cpu, monkeypatch, capsys, stopped_in):
    """The line is said by `train(on_stopped=)`, before the ranks part: said after `run` returns, torchrun could
    stop rank 0 first (rank 1, with nothing to print, exits at once)."""
    import os
    import signal

    w, tuned, sent = tiny(small_corpus), [], []
    real = w.loss_fn

    def loss_fn(model, batch):  # a scheduler's preemption, once, in the session the case names
        if model.training and not sent and (tuned or stopped_in == "the first steps"):
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real(model, batch)

    w.loss_fn = loss_fn
    tuned_without_a_search(monkeypatch, Plan(micro_batch=4, grad_accum=2, name="tuned"), tuned)
    report = run_module.run(w, cpu, steps=40, run_dir=tmp_path / "run", progress=False, console=QUIET,
                            try_compile=False)
    assert report.training.interrupted and report.training.stop_signal == "SIGTERM" and len(sent) == 1
    assert (f"saturate: stopped by SIGTERM at step {report.training.steps}; checkpoint {report.training.checkpoint} "
            f"written; resume with: saturate train --resume --run-dir {report.training.run_dir}"
            ) in capsys.readouterr().err
    assert tuned == ([40] if stopped_in != "the first steps" else [])


def test_a_long_job_pauses_after_its_first_steps_is_tuned_and_goes_on_from_there(tmp_path, small_corpus, cpu,
                                                                                monkeypatch):
    workload = tiny(small_corpus)
    tuned: list[int] = []
    tuned_without_a_search(monkeypatch, Plan(micro_batch=4, grad_accum=2, name="tuned"), tuned)
    report = run_module.run(workload, cpu, steps=16, run_dir=tmp_path / "run", progress=False, console=QUIET,
                            try_compile=False)
    assert tuned == [16] and report.trained == "tuned"
    assert report.training.finished and report.training.steps == 16 and report.training.plan.micro_batch == 4
    assert "the first 9 with the default plan" in report.rows[-1].note
    assert report.tuning.seconds == 1.5 and report.timing["first_steps_s"] > 0  # its steps are training, not tuning
    assert Plan.load(tmp_path / "run" / "plan.toml").micro_batch == 4


def test_after_the_first_steps_the_budget_is_sized_from_them_and_naive_is_not_measured(tmp_path, small_corpus, cpu,
                                                                                         monkeypatch):
    from saturate.engine.distributed import DistInfo
    from saturate.tune.trial import BudgetTooSmall

    budgets = []

    def no_trial(*a, budget_s, **k):
        budgets.append(budget_s)
        raise BudgetTooSmall("not one trial here")

    monkeypatch.setattr(run_module, "RealMeasurer", lambda *a, **k: pytest.fail("naive measured to size the budget"))
    monkeypatch.setattr(run_module, "tune", no_trial)
    workload = tiny(small_corpus)
    first = first_steps.FirstSteps(Plan(), None, 4.0, step_s=0.5, predicted_s=400.0)  # type: ignore[arg-type]
    tuning = run_module._tune(workload, cpu, DistInfo(), run_module.reference_plans(workload, "cpu"), budget_s=None,
                              steps=800, minutes=None, allow_batch_change=False, run_dir=tmp_path, seed=0,
                              console=(said := Console(record=True, width=300, file=open("/dev/null", "w"))),  # noqa: SIM115
                              try_compile=False, first_steps=first)
    assert budgets == [pytest.approx(20.0)]  # 5 % of the 400 s the default plan's first steps predict: the search
    assert tuning.naive is None and tuning.naive_s == 0.0 and tuning.label == "default"  # starts from that plan
    assert "tuning budget 20 s: 5 % of the untuned training, predicted at 400 s (800 steps at the default plan's " \
           "0.5 s/step, timed over its first steps)" in said.export_text()
    short = first_steps.FirstSteps(Plan(), None, 4.0, step_s=0.5, predicted_s=250.0)  # type: ignore[arg-type]
    tuning = run_module._tune(workload, cpu, DistInfo(), run_module.reference_plans(workload, "cpu"), budget_s=None,
                              steps=500, minutes=None, allow_batch_change=False, run_dir=tmp_path, seed=0,
                              console=said, try_compile=False, first_steps=short)
    assert len(budgets) == 1 and tuning.why.startswith("not tuned: the untuned training is predicted at 250 s") \
        and "5% of it is under the 15 s a search needs" in tuning.why  # 12.5 s: no search from the informed plan


@pytest.mark.slow
@pytest.mark.parametrize("busy_windows, called_at", [(0, 9), (1, 14), (5, 19)])
def test_the_job_is_timed_again_while_the_machine_is_busy_and_the_fastest_window_counts(
        tmp_path, small_corpus, cpu, monkeypatch, busy_windows, called_at):
    from saturate.engine import trainer
    from saturate.engine.trainer import RunConfig, train
    from saturate.run.job_window import JobWindows

    stops = []  # other processes' load over each window: busy for the first `busy_windows`
    monkeypatch.setattr(job_window, "ContentionMeter",
                        fake_meter(lambda: stops.append(1) or len(stops) <= busy_windows))
    monkeypatch.setattr(trainer, "_log_window", lambda t, real=trainer._log_window:
                        real(t) + (100.0 if t.step == 9 else 0.0))  # the first window read slow (a burst)
    sized = []
    result = train(tiny(small_corpus), Plan(micro_batch=8), RunConfig(run_dir=tmp_path / "r", steps=20, progress=False,
                                                                      tensorboard=False), hardware=cpu,
                   on_window=JobWindows(lambda done, step_s: sized.append((done, step_s))))
    assert result.finished and [d for d, _ in sized] == [called_at] and len(stops) == min(busy_windows + 1, 3)
    assert (sized[0][1] > 10) == (busy_windows == 0)  # a slow window counts only when nothing was busy


@pytest.mark.slow
def test_a_steady_load_is_timed_once_more_not_three_times(tmp_path, small_corpus, cpu, monkeypatch):
    from saturate.engine import trainer
    from saturate.engine.trainer import RunConfig, train
    from saturate.run.job_window import JobWindows

    monkeypatch.setattr(job_window, "ContentionMeter", fake_meter(lambda: True))
    monkeypatch.setattr(trainer, "_log_window", lambda t, real=trainer._log_window: (lambda n: real(t) + 10.0 * n)(
        t.window_steps))  # every window ~10 s/step, the log windows inside the timed ones too: a steady load
    sized = []
    train(tiny(small_corpus), Plan(micro_batch=8), RunConfig(run_dir=tmp_path / "r", steps=20, progress=False,
                                                             tensorboard=False), hardware=cpu,
          on_window=JobWindows(lambda done, step_s: sized.append(done)))
    assert sized == [14]  # two windows that agree: the load is the job's speed while it lasts
