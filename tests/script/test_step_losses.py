"""The per-step losses a trial keeps for the precision check (script/child/losses.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from saturate.script.child.losses import StepLosses


def live_tensors() -> int:
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def test_micro_steps_are_summed_per_step_and_a_step_without_a_loss_is_not_counted():
    losses = StepLosses(limit=3)
    losses.add(torch.tensor(1.5))
    losses.add(torch.tensor(0.25, dtype=torch.bfloat16))  # a micro-step in bf16 adds into the float32 slot
    losses.end_step()
    losses.end_step()  # a step with no loss seen (the script's own backward elsewhere): no slot
    losses.add(2.0)  # a loss given as a number
    losses.add(torch.tensor([3.0]))
    losses.end_step()
    for v in (4.0, 5.0):  # beyond the limit: not kept
        losses.add(torch.tensor(v))
        losses.end_step()
    assert losses.read() == [1.75, 5.0, 4.0]


def test_a_loss_that_cannot_be_kept_ends_the_record_without_its_part_sum():
    losses = StepLosses()
    losses.add(torch.tensor(1.0))
    losses.end_step()
    losses.add(torch.tensor(2.0))
    losses.add(torch.ones(2))  # not one value: the record ends here, the step under way not counted
    losses.end_step()
    losses.add(torch.tensor(3.0))
    losses.end_step()
    assert losses.read() == [1.0]


def test_no_tensor_stays_alive_per_step():
    # each step's loss kept as a tensor of its own pinned glibc's heap among the step's freed buffers: a plain
    # AdamW loop's trial grew ~2.5 MB a step and ran at half speed while it grew (2026-11-28)
    losses = StepLosses()
    gc.collect()
    before = live_tensors()
    for step in range(50):
        losses.add(torch.tensor(float(step), requires_grad=True) * 2)
        losses.end_step()
    gc.collect()
    assert live_tensors() - before <= 1  # the one buffer
    assert losses.read()[:3] == [0.0, 2.0, 4.0] and len(losses.read()) == 50


def test_a_trials_losses_still_reach_its_report(tmp_path):
    from saturate.script.child.loop_precision import LoopPrecision

    loop = LoopPrecision(None, keep_losses=True)
    x = torch.ones(4, requires_grad=True)
    for k in range(3):
        loss = (x * (k + 1)).sum()
        loop.backward((loss,), {})
        loop.end_step()
    assert loop.report()["losses"] == pytest.approx([4.0, 8.0, 12.0])
