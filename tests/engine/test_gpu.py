"""The engine on a real GPU: the plan knobs that only matter there. Skipped without CUDA/ROCm."""

from __future__ import annotations

import pytest
import torch

from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_gpu_plan_trains_and_reports_device_memory(tmp_path, small_corpus, precision):
    hw = probe(measure_peaks=False)
    if precision == "bf16" and not hw.supports.get("bf16"):
        pytest.skip("no native bf16")
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=32, warmup_steps=2)
    plan = Plan(micro_batch=16, grad_accum=2, precision=precision, tf32=precision == "fp32", pin_memory=True,
                non_blocking=True, fused_optimizer=True, num_workers=2, prefetch_factor=2, persistent_workers=True)
    result = train(workload, plan, RunConfig(run_dir=tmp_path / precision, steps=30, log_every=5, eval_every=15,
                                             progress=False, tensorboard=False), hardware=hw)
    records = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert records[-1]["train/loss"] < records[0]["train/loss"] - 1.0
    assert all(r["memory/peak_gib"] > 0 for r in records)
    assert result.memory_kind == "device" and result.peak_memory_bytes > 0
    assert not any("fused AdamW is not available" in n for n in result.notes)
    assert result.mfu is not None and 0 < result.mfu < 1


def test_gpu_compile_and_activation_checkpointing(tmp_path, small_corpus):
    hw = probe(measure_peaks=False)
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=16, warmup_steps=2)
    plan = Plan(micro_batch=16, grad_accum=1, precision="bf16" if hw.supports.get("bf16") else "fp32",
                compile="default", activation_checkpointing=True, fused_optimizer=True)
    result = train(workload, plan, RunConfig(run_dir=tmp_path / "c", steps=10, log_every=5, progress=False,
                                             tensorboard=False), hardware=hw)
    assert not any("failed" in n for n in result.notes), result.notes
    assert result.steps == 10 and torch.cuda.max_memory_allocated() > 0
