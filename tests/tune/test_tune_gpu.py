"""The tuner on a real GPU (skipped without one): native bf16 chosen by trial, memory from the allocator."""

from __future__ import annotations

import pytest
from rich.console import Console

from saturate.hardware import probe
from saturate.tune import tune
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


def test_tune_on_gpu_picks_a_measured_plan(tmp_path, small_corpus):
    hw = probe(measure_peaks=False, device="cuda")
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=32)
    measurer = RealMeasurer(workload, hw, min_seconds=0.2, max_steps=5)
    result = tune(workload, hw, out_dir=tmp_path, measurer=measurer, try_compile=False, use_cache=False,
                  console=Console(width=160))
    assert result.plan.samples_per_step() == 32
    if hw.supports.get("bf16"):
        assert result.plan.precision == "bf16"
    assert result.search.fit is not None and result.search.fit.kind == "device"
    assert result.search.chosen.peak_memory_bytes and result.search.chosen.peak_memory_bytes > 0
    assert result.plan.pin_memory in (True, False)
