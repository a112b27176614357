"""The informed plan's micro-batch grown from its first steps' measured peak (engine/grow.py), and the Stepper that
joins loader batches for it (engine/step.py `Stepper.grow`)."""

from __future__ import annotations

import pytest
import torch
from test_step import CPU, oom_above, run_steps

from saturate.data.loaders import make_loader
from saturate.engine import grow
from saturate.engine.metrics import read_jsonl
from saturate.engine.step import Stepper, join_batches, split_batch
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError
from saturate.hardware import probe
from saturate.plan import INFORMED, Plan
from saturate.provenance import Origin, mark
from saturate.workloads import build_workload

GiB = 2**30
UNMEASURED_RULE = ("2 × 4 accumulation: the largest that divides the per-process batch 8 up to 16: no memory was "
                   "measured, "
                   f"and the memory model predicts only from a measured peak ({INFORMED})")


def _leaves(batch):
    if isinstance(batch, dict):
        return list(batch.values())
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]


def training_forwards(workload, limit: int, calls: list[int]):
    """The workload, its training forwards counted into `calls` and out of memory above `limit` samples."""
    return oom_above(workload, limit, calls, training_only=True)


@pytest.fixture
def workload(small_corpus):
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2)


def test_joined_batches_undo_a_split():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    for batch in ((x, y), [x, y], {"a": x, "b": y}, x):
        parts = split_batch(batch, 2)
        joined = join_batches(parts)
        assert type(joined) is type(batch)
        assert all(torch.equal(a, b) for a, b in zip(_leaves(joined), _leaves(batch), strict=True))
    with pytest.raises(ConfigError, match="cannot join"):
        join_batches(["a", "b"])


def test_a_grown_stepper_trains_the_same_samples_in_fewer_larger_micro_batches(workload):
    calls: list[int] = []
    grown = run_steps(training_forwards(workload, 100, calls), Plan(micro_batch=2, grad_accum=4), steps=1)
    kept = run_steps(workload, Plan(micro_batch=2, grad_accum=4), steps=1)  # the same, not grown
    batches = iter(make_loader(workload.train_data, grown.plan, start_step=1, pin_memory=False))
    grown.grow(8)
    assert grown.grad_accum == 1 and (grown.current_plan().micro_batch, grown.current_plan().grad_accum) == (8, 1)
    grown.step(batches)
    kept.step(iter(make_loader(workload.train_data, kept.plan, start_step=1, pin_memory=False)))
    assert calls == [2, 2, 2, 2, 8]
    # the second step's loss, from the same weights over the same 8 samples: equal up to the order of the sums
    assert torch.allclose(grown.take_loss_sum(), kept.take_loss_sum(), atol=1e-5)
    for bad in (8, 16):  # not larger than the micro-batch now; beyond the step's samples
        with pytest.raises(ValueError):
            grown.grow(bad)
    with pytest.raises(ValueError):
        kept.grow(6)  # three loader batches do not divide the step's four


def test_an_oom_at_a_grown_micro_batch_goes_back_through_the_joined_sizes(workload):
    calls: list[int] = []
    torch.manual_seed(0)
    stepper = Stepper(training_forwards(workload, 4, calls), Plan(micro_batch=1, grad_accum=8), CPU, lr=1e-3)
    batches = iter(make_loader(workload.train_data, stepper.plan, start_step=0, pin_memory=False))
    stepper.grow(8)
    stepper.step(batches)
    assert [a.micro_batch for a in stepper.adaptations] == [4]  # 8 failed: four loader batches joined, twice
    assert calls == [8, 4, 4] and stepper.grad_accum == 2


def _grown_run(tmp_path, workload, monkeypatch, memory, provenance=UNMEASURED_RULE, steps=4, name="run",
               chosen=Origin.NO_MEMORY):
    monkeypatch.setattr(grow, "device_memory", lambda device: memory)
    plan = Plan(micro_batch=2, grad_accum=4, provenance=mark({"informed": INFORMED}, "micro_batch", chosen, provenance))
    config = RunConfig(run_dir=tmp_path / name, steps=steps, progress=False, tensorboard=False, log_every=1)
    return train(workload, plan, config, hardware=probe(measure_peaks=False, device="cpu"))


def test_the_informed_micro_batch_grows_after_two_steps_within_the_predicted_memory(tmp_path, workload, monkeypatch):
    # 2 × 4 peaked at 1 GiB: in proportion, 8 would use at most 4 GiB of the 9 GiB allowed (90 % of 10)
    calls: list[int] = []
    result = _grown_run(tmp_path, training_forwards(workload, 100, calls), monkeypatch, (GiB, 10 * GiB))
    assert calls == [2] * 8 + [8] * 2  # two steps at 2 × 4, then the same 8 samples in one forward
    assert (result.plan.micro_batch, result.plan.grad_accum) == (8, 1)
    saved = Plan.load(tmp_path / "run" / "plan.toml")
    assert saved.micro_batch == 8 and "peaked at 1.00 GiB (measured)" in saved.provenance["micro_batch"]
    assert "a prediction" in saved.provenance["micro_batch"]
    line = next(n for n in result.notes if n.startswith("step 2: micro-batch 2 × 4 → 8 × 1"))
    assert "within 9.00 GiB (90 % of the device's 10.00 GiB)" in line
    logged = [r["plan/micro_batch"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "plan/micro_batch" in r]
    assert logged[-1] == 8
    plain = _grown_run(tmp_path, workload, monkeypatch, None, name="cpu")  # no device memory to read: as it was
    assert (plain.plan.micro_batch, plain.plan.grad_accum) == (2, 4)
    def losses(name: str) -> list[float]:
        return [r["train/loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/loss" in r]
    # the same samples in each step, whatever the micro-batch: the same losses up to the order of the sums
    assert losses("run") == pytest.approx(losses("cpu"), rel=1e-4) and len(losses("run")) == 4


def test_the_micro_batch_grows_only_as_far_as_memory_allows_and_only_when_nothing_measured_it(tmp_path, workload,
                                                                                             monkeypatch):
    # 8 would need at most 4 GiB, within the 4.2 GiB free but not its 90 %; 4 needs at most 2 GiB
    tight = _grown_run(tmp_path, workload, monkeypatch, (GiB, int(4.2 * GiB)), name="tight")
    assert (tight.plan.micro_batch, tight.plan.grad_accum) == (4, 2)
    none = _grown_run(tmp_path, workload, monkeypatch, (GiB, GiB), name="none")  # not even 4 fits
    assert none.plan.micro_batch == 2
    measured = _grown_run(tmp_path, workload, monkeypatch, (GiB, 10 * GiB), name="measured",
                          provenance="2 × 4: within the 2 predicted to fit (naive's measured peak): a prediction",
                          chosen=Origin.PREDICTED)
    assert measured.plan.micro_batch == 2  # sized from a measurement already: left as it is


def test_an_oom_after_growing_halves_it_and_the_step_keeps_its_samples(tmp_path, workload, monkeypatch):
    calls: list[int] = []
    result = _grown_run(tmp_path, training_forwards(workload, 4, calls), monkeypatch, (GiB, 10 * GiB))
    assert (result.plan.micro_batch, result.plan.grad_accum) == (4, 2)
    assert calls == [2] * 8 + [8] + [4] * 4  # step 3 tried 8, went back to 4 × 2 with the same samples
    assert any("out of memory at micro-batch 8" in n for n in result.notes)


def test_a_run_that_cannot_join_its_batches_keeps_its_micro_batch(tmp_path, workload, monkeypatch):
    def refuse(batches):
        raise ConfigError("cannot join batches of type str into a larger micro-batch")
    monkeypatch.setattr(grow, "join_batches", refuse)
    result = _grown_run(tmp_path, workload, monkeypatch, (GiB, 10 * GiB))
    assert result.plan.micro_batch == 2
    assert any("the micro-batch stays 2 (cannot join" in n for n in result.notes)


def test_batches_that_differ_in_shape_go_back_to_the_loaders_micro_batch_for_the_same_samples(workload):
    # a dataset whose samples change length from one loader batch to the next (bucketed by length): torch.cat fails
    torch.manual_seed(1)
    x = torch.randint(0, 200, (4, 17))
    steps = [(x[:2, :16], x[:2, 1:17]), (x[2:, :12], x[2:, 1:13])]
    grown = run_steps(workload, Plan(micro_batch=2, grad_accum=2), steps=0)
    kept = run_steps(workload, Plan(micro_batch=2, grad_accum=2), steps=0)
    grown.grow(4)
    grown.step(iter(steps))
    kept.step(iter(steps))
    assert grown.micro_batch == 2 and grown.grad_accum == 2
    assert "cannot be joined into micro-batch 4" in grown.adaptations[-1].reason
    assert "retrying the same samples at micro-batch 2 × 2" in grown.notes[-1]
    assert torch.equal(grown.take_loss_sum(), kept.take_loss_sum())
