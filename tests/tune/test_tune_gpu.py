"""The tuner on a real GPU (skipped without one): native bf16 chosen by trial, memory from the allocator.

gpt-small, not gpt-tiny: on an H100 gpt-tiny at micro-batch 8 is launch-bound, and fp32 rightly beat
bf16 there (autocast's casts are extra kernels; measured 2026-11-23). gpt-small is compute-bound
from the first micro-batch, where bf16 is several times fp32.
"""

from __future__ import annotations

import pytest
from rich.console import Console

from saturate.hardware import probe
from saturate.tune import tune
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


def test_tune_on_gpu_picks_a_measured_plan(tmp_path):
    hw = probe(measure_peaks=False, device="cuda")
    workload = build_workload("gpt-small", effective_batch=16)
    measurer = RealMeasurer(workload, hw, min_seconds=0.2, max_steps=5)
    result = tune(workload, hw, out_dir=tmp_path, measurer=measurer, try_compile=False, use_cache=False,
                  console=Console(width=160))
    assert result.plan.samples_per_step() == 16
    if hw.supports.get("bf16"):
        assert result.plan.precision == "bf16"
    # memory from the device's allocator: a fit of memory trials, or (every candidate fitting even in
    # proportion to the micro-batch) the allocator's peak at the first micro-batch, said as a prediction
    fit = result.search.fit
    [memory] = [d for d in result.search.decisions if d.startswith("memory:")]
    assert (fit is not None and fit.kind == "device") or ("peak device" in memory and "a prediction" in memory)
    assert result.search.chosen.peak_memory_bytes and result.search.chosen.peak_memory_bytes > 0
    assert result.plan.pin_memory in (True, False)
