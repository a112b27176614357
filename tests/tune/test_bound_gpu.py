"""What sessions 12-14 built for the CPU, checked where it must hold on a real GPU (skipped without CUDA):

- the optimizer step's share (tune/bound.py) is read from CUDA events without a sync in the timed steps: it must
  agree with a clock that synchronises around the optimizer phase, and must not bound away the fused stage where
  the optimizer is a large share of the step (an 85 M-parameter model on 128 tokens);
- glibc's allocator thresholds (engine/host_alloc.py) are set for a CPU step only;
- a measured peak is measured again when the steps beat 75 % of it (engine/summary.recheck_peak), a datasheet's
  never: on a GPU the datasheet's peak is the MFU's denominator and stays.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import default_collate

from saturate.engine.step import Stepper
from saturate.engine.summary import mfu_peak, peak_dtype, recheck_peak
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.tune.bound import not_worth
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


class _SyncedOptimizerClock:
    """A phase timer that synchronises the device around the optimizer step: the reference for the CUDA events."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, phase: str) -> contextlib.AbstractContextManager:
        return self._timed() if phase == "optimizer" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0


def test_the_optimizer_share_from_cuda_events_agrees_with_a_synchronised_clock():
    hw = probe(measure_peaks=False, device="cuda")
    workload = build_workload("gpt-small", effective_batch=2, seq_len=64)  # 85 M parameters, 128 tokens a step
    plan = Plan(micro_batch=2, grad_accum=1, precision="bf16" if hw.supports.get("bf16") else "fp32",
                fused_optimizer=False)
    trial = RealMeasurer(workload, hw, min_seconds=0.5, max_steps=40).model_trial(plan, "fused-optimizer")
    assert trial.ok, trial.error
    share = trial.optimizer_share
    assert share is not None and 0 < share < 1

    stepper = Stepper(workload, plan, torch.device("cuda"), workload.optim.lr, compile=False)
    held = [default_collate([workload.train_data[i] for i in range(2 * j, 2 * j + 2)]) for j in range(2)]
    batches = iter(held * 100)
    for _ in range(3):
        stepper.step(batches)
    clock = _SyncedOptimizerClock()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        stepper.step(batches, clock)
    torch.cuda.synchronize()
    reference = clock.seconds / (time.perf_counter() - t0)
    # The synchronised clock adds its syncs' gaps to the optimizer phase: the events may read somewhat less.
    assert 0.5 * reference - 0.02 < share < 1.2 * reference + 0.02, (share, reference)
    if reference > 0.1:  # an optimizer this large a share: the fused kernel may gain, so it must be tried
        assert not not_worth(share, 0.03), share


def test_the_host_allocator_is_left_alone_for_a_gpu_step():
    notes: list[str] = []
    Stepper(build_workload("gpt-tiny", effective_batch=8), Plan(micro_batch=8, grad_accum=1),
            torch.device("cuda"), 1e-3, notes=notes, compile=False)
    assert not any("host allocator" in n for n in notes), notes  # a CPU step notes glibc's thresholds


def test_a_datasheet_peak_on_the_gpu_is_never_measured_again():
    hw = probe(measure_peaks=False, device="cuda")
    plan = Plan(precision="bf16" if hw.supports.get("bf16") else "fp32")
    datasheet, source = hw.peak_flops(peak_dtype(hw, plan))
    if datasheet is None:
        pytest.skip(f"no datasheet row for this GPU ({source})")
    peak, label = mfu_peak(hw, plan)
    assert (peak, label) == (datasheet, source)
    # Steps at 99 % of it: a measured peak would be measured again; the datasheet's stays, with no note.
    assert recheck_peak(hw, plan, peak, label, 0.99 * peak) == (peak, label, None)
