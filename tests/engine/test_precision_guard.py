"""Training's own first steps (issue 30): a lower precision chosen from the hardware checked against fp32 at the same
weights, and the job timed from its first steps, pausing there (with a checkpoint) when the callback says so."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from saturate.engine.checkpoint import load_checkpoint
from saturate.engine.precision_guard import loss_drift, needs_guard
from saturate.engine.trainer import RunConfig, train
from saturate.plan import INFORMED, Plan
from saturate.policy import POLICY
from saturate.provenance import KEY, Origin, mark
from saturate.run.job_window import JobWindows
from saturate.workloads import build_workload

CHOSEN = {"informed": INFORMED, "precision": f"bf16: native here ({INFORMED})", KEY: {"precision": "hardware"}}


def tiny(corpus, **over):
    return build_workload("gpt-tiny", data=[str(corpus)], effective_batch=8, warmup_steps=2, n_layer=1, n_embd=32,
                          n_head=2, seq_len=32, **over)


def config(tmp_path, name="run", **kw):
    return RunConfig(run_dir=tmp_path / name, progress=False, tensorboard=False, **kw)


def test_only_a_lower_precision_chosen_from_the_hardware_and_not_yet_checked_is_guarded():
    assert needs_guard(Plan(precision="bf16", provenance=CHOSEN))
    assert not needs_guard(Plan(precision="fp32", provenance={**CHOSEN, "precision": f"fp32 ({INFORMED})"}))
    assert not needs_guard(Plan(precision="bf16"))  # the user's own, or a tuned plan: measured or meant
    checked = mark(dict(CHOSEN), "precision", Origin.MEASURED, CHOSEN["precision"] + "; within 0.01 % (measured)")
    assert not needs_guard(Plan(precision="bf16", provenance=checked))  # a resumed run checked before
    # what decides is the recorded origin, not the words: the same text without its origin is not guarded
    assert not needs_guard(Plan(precision="bf16", provenance={k: v for k, v in CHOSEN.items() if k != KEY}))
    # ...and a default plan's, written to plan.toml and read back, is still guarded
    assert needs_guard(Plan.from_dict(Plan(precision="bf16", provenance=CHOSEN).to_dict()))


def test_drift_is_a_share_of_the_loss_scale_and_infinite_for_a_non_finite_loss():
    assert loss_drift([5.0, 4.0], [5.0, 4.1]) == pytest.approx(0.1 / 5.0)
    assert loss_drift([5.0, float("nan")], [5.0, 4.0]) == math.inf
    assert loss_drift([], []) == math.inf


def test_a_chosen_bf16_is_checked_in_its_first_steps_and_kept_when_it_agrees(tmp_path, small_corpus, cpu):
    plan = Plan(micro_batch=4, grad_accum=2, precision="bf16", provenance=CHOSEN)
    cpu = dataclasses.replace(cpu, measured_peak_flops={"bf16": 1e30}, measured_peak_source={"bf16": "given"})
    result = train(tiny(small_corpus), plan, config(tmp_path, steps=POLICY.job.guard_steps + 1), hardware=cpu)
    assert result.plan.precision == "bf16"
    line = next(n for n in result.notes if n.startswith("guard:"))
    assert "within" in line and f"first {POLICY.job.guard_steps} steps" in line
    saved = Plan.load(tmp_path / "run" / "plan.toml")
    assert saved.precision == "bf16" and "(measured, the guard)" in saved.provenance["precision"]
    # Not asked for and not chosen from the hardware: no check at all
    mine = train(tiny(small_corpus), plan.replace(provenance={}), config(tmp_path, "mine", steps=2), hardware=cpu)
    assert not any(n.startswith("guard:") for n in mine.notes)


class Disagrees:
    """A loss that reads 20 % higher under autocast: what a precision too coarse for the model looks like."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, model, batch):
        loss = self.loss_fn(model, batch)
        return loss * 1.2 if torch.is_autocast_enabled("cpu") else loss


def test_a_chosen_bf16_that_disagrees_with_fp32_goes_on_in_fp32_and_the_plan_says_so(tmp_path, small_corpus, cpu):
    workload = tiny(small_corpus)
    workload = dataclasses.replace(workload, loss_fn=Disagrees(workload.loss_fn))
    plan = Plan(micro_batch=4, grad_accum=2, precision="bf16", provenance=CHOSEN)
    result = train(workload, plan, config(tmp_path, steps=POLICY.job.guard_steps + 2), hardware=cpu)
    assert result.plan.precision == "fp32" and result.finished
    line = next(n for n in result.notes if n.startswith("guard:"))
    assert "bf16 rejected" in line and "20.0 % from fp32's" in line
    saved = Plan.load(tmp_path / "run" / "plan.toml")
    assert saved.precision == "fp32" and saved.provenance["precision"].startswith("fp32: bf16's loss was 20.0 %")
    assert load_checkpoint(result.checkpoint)["plan"]["precision"] == "fp32"


def test_the_job_is_timed_after_its_first_steps_and_a_reason_pauses_it_to_be_continued(tmp_path, small_corpus, cpu,
                                                                                       monkeypatch):
    from saturate.run import job_window

    class Quiet:  # other processes' load read as none: a busy host would have the job timed again (size_tries)
        def start(self):
            return self

        def stop(self):
            return type("Seen", (), {"significant": lambda self: False})()

    monkeypatch.setattr(job_window, "ContentionMeter", Quiet)
    calls = []
    at = POLICY.job.size_after + POLICY.job.size_steps
    workload = tiny(small_corpus)
    goes_on = train(workload, Plan(micro_batch=8), config(tmp_path, "on", steps=at + 2), hardware=cpu,
                    on_window=JobWindows(lambda done, step_s: calls.append((done, step_s))))
    assert [c[0] for c in calls] == [at] and calls[0][1] > 0 and goes_on.finished and goes_on.steps == at + 2

    paused = train(workload, Plan(micro_batch=8), config(tmp_path, steps=40), hardware=cpu,
                   on_window=JobWindows(lambda done, step_s: "tuning: long enough"))
    assert paused.steps == at and not paused.finished and paused.stop_reason == "tuning: long enough"
    assert paused.weights is None and not (tmp_path / "run" / "model.safetensors").exists()
    assert load_checkpoint(paused.checkpoint)["step"] == at
    # Continued with another plan of the same effective batch: the steps trained are kept
    rest = train(workload, Plan(micro_batch=4, grad_accum=2), dataclasses.replace(config(tmp_path, steps=40),
                                                                                   resume=True), hardware=cpu)
    assert rest.finished and rest.steps == 40 and rest.plan.micro_batch == 4 and rest.weights is not None

    short = train(workload, Plan(micro_batch=8), config(tmp_path, "short", steps=at - 1), hardware=cpu,
                  on_window=JobWindows(lambda *a: pytest.fail("timed a job that ended first")))
    assert short.finished
