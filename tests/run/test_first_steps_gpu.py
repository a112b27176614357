"""The paths built since the first GPU session, on a real GPU: the chunked linear + cross-entropy under CUDA bf16
autocast, and `run()` with nothing cached (the informed default plan trains from its first step, its bf16
guarded). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from saturate.hardware import probe
from saturate.run import flow as run_module
from saturate.workloads import build_workload
from saturate.workloads.chunked_loss import linear_cross_entropy

pytestmark = pytest.mark.gpu
QUIET = Console(file=open("/dev/null", "w"))  # noqa: SIM115


def test_the_chunked_loss_under_cuda_bf16_agrees_with_the_plain_one_and_keeps_no_logits():
    torch.manual_seed(0)
    rows, width, vocab = 4096, 768, 50304
    h0 = torch.randn(rows, width, device="cuda")
    w0 = torch.randn(vocab, width, device="cuda") * 0.02
    y = torch.randint(0, vocab, (rows,), device="cuda")
    out, peaks = [], []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, y, 512) if chunked else F.cross_entropy((h @ w.t()).float(), y)
        loss.backward()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        out.append([loss.detach(), h.grad, w.grad])
    plain, chunked = out
    assert abs(plain[0].item() - chunked[0].item()) < 1e-2 * abs(plain[0].item())
    for a, b in zip(plain[1:], chunked[1:], strict=True):
        assert (a - b).norm() < 2e-2 * a.norm(), ((a - b).norm(), a.norm())
    logits_fp32 = rows * vocab * 4
    assert peaks[1] < peaks[0] - logits_fp32 / 2, (peaks, logits_fp32)  # the whole logits never existed


def test_run_with_nothing_cached_trains_the_default_plan_on_the_gpu(tmp_path, small_corpus, monkeypatch):
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    hw = probe(measure_peaks=False)
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=16, warmup_steps=2)
    report = run_module.run(workload, hw, steps=12, run_dir=tmp_path / "run", progress=False, console=QUIET,
                            try_compile=False)
    assert report.trained == "default" and report.training.finished and report.training.steps == 12
    plan = report.training.plan
    assert plan.pin_memory and plan.precision in ("bf16", "fp16", "fp32")
    assert report.training.memory_kind == "device" and report.training.peak_memory_bytes > 0
