"""The doctor and telemetry on a CUDA GPU: device-time phases, sync debug mode, NVML, the GPU verdicts.

Skipped without a GPU (the `gpu` marker). Passed on an H100 80GB HBM3 on 2026-11-23
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from toy import Samples, mlp_loss_read_every_step, mlp_workload

from conftest import cli_env
from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.doctor.phases import PhaseClock, SyncCounter
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.telemetry import open_gpu_source
from saturate.workloads import build_workload

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    return probe(measure_peaks=False, device="cuda")


def test_phase_clock_measures_device_time():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    clock = PhaseClock(dev)
    clock.begin_step()
    with clock.phase("forward"):
        for _ in range(20):
            a = a @ a.T / 4096  # queued; the host returns at once
    clock.end_step()
    [split] = clock.per_step()
    assert split["forward"] > 0.5 * sum(split.values())  # the device time lands in the phase


def test_sync_debug_mode_counts_reads_per_phase():
    dev = torch.device("cuda")
    x = torch.randn(1024, device=dev)
    with SyncCounter(dev) as counter:
        counter.phase = "forward"
        y = (x * 2).sum()  # no sync
        counter.phase = "other"
        y.item()  # one sync
    assert counter.counts == {"other": 1}
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


def test_nvml_reads_the_gpu_training_uses():
    source = open_gpu_source([torch.cuda.current_device()])
    try:
        [r] = source.read()
        assert r.mem_total and r.util_pct is not None, r.missing
    finally:
        source.close()


def test_monitor_lists_the_gpus(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "saturate", "monitor", "--once", "--json"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    data = json.loads(proc.stdout)
    assert data["gpus"] and data["gpus"][0]["mem_total"] > 0


def test_the_loss_read_every_step_on_a_gpu_is_sync_bound(gpu):
    workload = mlp_workload(Samples(), effective_batch=8, loss_fn=mlp_loss_read_every_step)
    config = DoctorConfig(steps=20, warmup=3, count_steps=2, min_seconds=2.0, scaling=False)
    d = diagnose(workload, Plan(micro_batch=8, pin_memory=True, non_blocking=True), config, hardware=gpu)
    m = d.measurements
    assert m.timing.startswith("device time")
    assert m.syncs_by_phase.get("forward", 0) >= 1  # the .item() inside the loss
    assert d.verdict == "sync-bound", d.evidence


def test_pageable_blocking_copies_are_counted_in_the_copy_phase(gpu):
    config = DoctorConfig(steps=5, warmup=2, count_steps=2, min_seconds=0.0, scaling=False)
    d = diagnose(mlp_workload(Samples(), 8), Plan(micro_batch=4, grad_accum=2), config, hardware=gpu)
    assert d.measurements.syncs_by_phase.get("h2d", 0) >= 2  # one blocking copy per micro-batch


def test_a_healthy_gpt_small_is_compute_bound(gpu):
    workload = build_workload("gpt-small", effective_batch=32)
    plan = Plan(micro_batch=32, precision="bf16", tf32=True, pin_memory=True, non_blocking=True, fused_optimizer=True)
    d = diagnose(workload, plan, DoctorConfig(steps=5, warmup=2, min_seconds=2.0), hardware=gpu)
    assert d.verdict == "compute-bound", d.evidence
    m = d.measurements
    assert m.device_util.mean is not None and m.device_util.mean > 80
    assert m.device_mem_peak and m.device_mem_total
