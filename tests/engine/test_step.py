"""The shared step: OOM inside forward/backward is absorbed exactly; anywhere else it is raised."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from saturate.data.loaders import make_loader
from saturate.engine.metrics import read_jsonl
from saturate.engine.step import MicroBatchOOM, OutOfMemoryError, Stepper, largest_divisor_below, split_batch
from saturate.engine.trainer import RunConfig, train
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads import build_workload

CPU = torch.device("cpu")


def oom_above(workload, limit: int, calls: list[int] | None = None, training_only: bool = False):
    """The workload, with a model whose forward raises OutOfMemoryError above `limit` samples (`training_only`:
    only its training forwards, with grad enabled — not validation's, nor the precision guard's); each forward's
    samples counted into `calls`."""
    build = workload.build_model

    def build_model():
        model = build()

        def hook(module, args):
            if training_only and not torch.is_grad_enabled():
                return
            if calls is not None:
                calls.append(args[0].shape[0])
            if args[0].shape[0] > limit:
                raise OutOfMemoryError(f"simulated: {args[0].shape[0]} samples > {limit}")

        model.register_forward_pre_hook(hook)
        return model

    return dataclasses.replace(workload, build_model=build_model)


@pytest.fixture
def workload(small_corpus):
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2)


def run_steps(workload, plan: Plan, steps: int = 2, **kw) -> Stepper:
    torch.manual_seed(0)
    stepper = Stepper(workload, plan, CPU, lr=1e-3, **kw)
    batches = iter(make_loader(workload.train_data, plan, start_step=0, pin_memory=False))
    for _ in range(steps):
        stepper.step(batches)
    return stepper


def test_oom_halves_micro_batch_and_gives_the_same_step(workload):
    plan = Plan(micro_batch=8, grad_accum=1)
    calls: list[int] = []
    adapted = run_steps(oom_above(workload, 4, calls), plan)
    reference = run_steps(workload, Plan(micro_batch=4, grad_accum=2))
    assert adapted.micro_batch == 4 and adapted.grad_accum == 2
    assert calls == [8, 4, 4, 4, 4]  # one failed try, then the same step and the next at 4 × 2
    assert len(adapted.adaptations) == 1 and adapted.adaptations[0].step == 0
    assert adapted.current_plan().micro_batch == 4 and adapted.current_plan().grad_accum == 2
    assert adapted.current_plan().samples_per_step() == plan.samples_per_step()
    for (name, a), b in zip(adapted.model.state_dict().items(), reference.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(adapted.take_loss_sum(), reference.take_loss_sum())
    assert "micro-batch 4 × 2 accumulation" in adapted.notes[-1]


def test_oom_backs_off_to_a_divisor_of_the_loader_batch(workload):
    plan = Plan(micro_batch=4, grad_accum=2)
    stepper = run_steps(oom_above(workload, 1), plan, steps=1)
    assert [a.micro_batch for a in stepper.adaptations] == [2, 1]
    assert stepper.grad_accum == 8


def test_oom_at_micro_batch_one_fails_clearly(workload):
    with pytest.raises(MicroBatchOOM, match="even at micro-batch 1"):
        run_steps(oom_above(workload, 0), Plan(micro_batch=2, grad_accum=4), steps=1)


def test_oom_is_raised_when_adaptation_is_off(workload):
    with pytest.raises(OutOfMemoryError):
        run_steps(oom_above(workload, 4), Plan(micro_batch=8, grad_accum=1), steps=1, adapt_oom=False)


def test_oom_in_the_optimizer_step_is_not_swallowed(workload, monkeypatch):
    def fail(*a, **k):
        raise OutOfMemoryError("simulated OOM in the optimizer")

    stepper = Stepper(workload, Plan(micro_batch=8, grad_accum=1), CPU, lr=1e-3)
    monkeypatch.setattr(stepper.optimizer, "step", fail)
    batches = iter(make_loader(workload.train_data, stepper.plan, start_step=0, pin_memory=False))
    with pytest.raises(OutOfMemoryError, match="optimizer"):
        stepper.step(batches)
    assert stepper.adaptations == []


def test_training_absorbs_an_oom_and_records_the_new_plan(tmp_path, workload):
    hw = probe(measure_peaks=False, device="cpu")
    config = RunConfig(run_dir=tmp_path / "run", steps=3, progress=False, tensorboard=False, log_every=1)
    result = train(oom_above(workload, 2), Plan(micro_batch=8, grad_accum=1), config, hardware=hw)
    assert result.steps == 3
    assert (result.plan.micro_batch, result.plan.grad_accum) == (2, 4)
    assert Plan.load(tmp_path / "run" / "plan.toml").micro_batch == 2
    logged = [r["plan/micro_batch"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "plan/micro_batch" in r]
    assert logged == [2, 2, 2]
    assert any("out of memory at micro-batch 4" in n for n in result.notes)


def test_split_batch_keeps_structure():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_batch((x, y), 2)
    assert len(parts) == 3 and isinstance(parts[0], tuple)
    assert torch.equal(parts[1][0], x[2:4]) and torch.equal(parts[2][1], y[4:])
    dparts = split_batch({"a": x, "b": y}, 3)
    assert torch.equal(dparts[1]["b"], y[3:])
    assert [largest_divisor_below(12, m) for m in (12, 6, 4, 2)] == [6, 3, 2, 1]


def test_an_oom_during_the_precision_guards_steps_keeps_the_step_the_same_samples(tmp_path, small_corpus):
    # The guard's verdict (after its 4 checked steps) put the trainer's plan, already at the halved micro-batch, into
    # the Stepper while the loader still gave batches of the first: each step then trained twice its samples.
    # One block 32 wide (bf16 is emulated on an AVX2 CPU: the full gpt-tiny took ~70 s here) and a given peak (no
    # bf16 matmul peak measured): the flow is checked, not the figures.
    calls: list[int] = []
    small = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2, n_layer=1,
                           n_embd=32, n_head=2)
    hw = dataclasses.replace(probe(measure_peaks=False, device="cpu"), measured_peak_flops={"bf16": 1e30},
                             measured_peak_source={"bf16": "given"})
    config = RunConfig(run_dir=tmp_path / "run", steps=6, progress=False, tensorboard=False, log_every=1,
                       guard_precision=True)
    result = train(oom_above(small, 4, calls, training_only=True),
                   Plan(micro_batch=8, grad_accum=1, precision="bf16"), config, hardware=hw)
    assert result.steps == 6 and (result.plan.micro_batch, result.plan.grad_accum) == (4, 2)
    assert calls == [8] + [4] * 12  # the failed try, then two micro-batches of 4 in each of the 6 steps
