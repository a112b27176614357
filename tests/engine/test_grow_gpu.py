"""The informed micro-batch grown from the first steps' measured peak, on a real GPU (engine/grow.py): the CUDA
allocator's readings, the joined loader batches on the device, the run finishing at the grown size. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from saturate.engine.trainer import RunConfig, train
from saturate.hardware import probe
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


def test_train_without_a_plan_grows_the_informed_micro_batch_on_the_gpu(tmp_path, small_corpus, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=64, warmup_steps=2)
    config = RunConfig(run_dir=tmp_path / "run", steps=6, progress=False, tensorboard=False, log_every=1,
                       use_tuned=False)
    result = train(workload, None, config, hardware=probe(measure_peaks=False))
    assert result.steps == 6
    assert (result.plan.micro_batch, result.plan.grad_accum) == (64, 1), result.notes  # gpt-tiny: all of it fits
    line = next(n for n in result.notes if n.startswith("step 2: micro-batch 16 × 4 → 64 × 1"))
    assert "GiB (measured)" in line and "a prediction" in line
    assert 0 < result.peak_memory_bytes < torch.cuda.get_device_properties(0).total_memory
