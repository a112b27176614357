"""Batch-coupled layers are found, and the tuner keeps the micro-batch for them (saying so in one line)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch.nn as nn

from saturate.errors import ConfigError
from saturate.workloads.base import Optimization, Workload
from saturate.workloads.coupling import coupled_layers, detect, kept_micro_batch, workload_default_plan
from saturate.workloads.source import with_coupling


def _workload(build, effective=32, **kw) -> Workload:
    return Workload(name="w", build_model=build, train_data=[], val_data=None, loss_fn=lambda m, b: 0,
                    optim=Optimization(effective_batch=effective, lr=1e-3), **kw)


@pytest.mark.parametrize(("layer", "coupled"), [
    (nn.BatchNorm1d(4), True), (nn.BatchNorm2d(4), True), (nn.SyncBatchNorm(4), True), (nn.LazyBatchNorm2d(), True),
    (nn.InstanceNorm2d(4, track_running_stats=True), True), (nn.InstanceNorm2d(4), False),
    (nn.GroupNorm(2, 4), False), (nn.LayerNorm(4), False), (nn.Linear(4, 4), False),
])
def test_which_layers_couple_the_samples_of_a_micro_batch(layer, coupled):
    assert bool(coupled_layers(nn.Sequential(nn.Linear(4, 4), layer))) is coupled


def test_a_resnet_like_model_keeps_the_micro_batch_and_says_so():
    w = _workload(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()), micro_batch=8)
    micro, line = kept_micro_batch(w, 1, allow_change=False)
    assert micro == 8
    assert line == ("BatchNorm2d in the model: micro-batch kept at 8 (it changes the maths); "
                    "--allow-micro-batch-change to search it anyway")
    assert kept_micro_batch(dataclasses.replace(w, micro_batch=None), 2, False)[0] == 16  # effective per process
    micro, line = kept_micro_batch(w, 1, allow_change=True)
    assert micro is None and "changes the maths" in line
    with pytest.raises(ConfigError, match="micro_batch 5 does not divide the effective batch per process 32"):
        kept_micro_batch(dataclasses.replace(w, micro_batch=5), 1, False)


def test_a_model_without_coupled_layers_is_searched_freely_and_the_user_flag_wins():
    w = _workload(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert kept_micro_batch(w, 1, False) == (None, None)
    flagged = with_coupling(w, {"batch_coupled": True, "micro_batch": 4})
    assert kept_micro_batch(flagged, 1, False)[0] == 4
    assert detect(_workload(lambda: nn.BatchNorm1d(4), batch_coupled=False)) == ([], None)


def test_a_model_that_cannot_be_built_is_said_not_checked():
    def broken():
        raise RuntimeError("no")

    assert detect(_workload(broken)) == ([], "batch-coupled layers not checked (building the model raised "
                                             "RuntimeError)")


@pytest.mark.parametrize(("params", "message"), [
    ({"batch_coupled": "yes"}, "--param batch_coupled='yes': expected true or false"),
    ({"micro_batch": 0}, "--param micro_batch=0: expected a whole number >= 1"),
    ({"micro_batch": 2.5}, "--param micro_batch=2.5: expected a whole number >= 1"),
])
def test_bad_coupling_params_are_one_clear_line(params, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        with_coupling(_workload(lambda: nn.Linear(1, 1)), params)


def test_the_untuned_default_plan_keeps_a_coupled_models_micro_batch():
    cpu = SimpleNamespace(device_type="cpu", torch_device="cpu", supports={}, cpu_cores=2)
    bn = _workload(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), effective=32)
    plan, line = workload_default_plan(bn, cpu)
    assert (plan.micro_batch, plan.grad_accum) == (32, 1) and "BatchNorm2d" in line  # not the 8×4 split
    assert "BatchNorm2d" in plan.provenance["micro_batch"]  # the label says why, not "from the hardware"
    plan, _ = workload_default_plan(dataclasses.replace(bn, micro_batch=4), cpu)
    assert (plan.micro_batch, plan.grad_accum) == (4, 8)
    free = _workload(lambda: nn.Sequential(nn.Linear(4, 4)), effective=32)
    plan, line = workload_default_plan(free, cpu)
    assert (plan.micro_batch, plan.grad_accum) == (8, 4) and line is None


@pytest.mark.parametrize(("flags", "precision"), [
    ("fpu sse2 avx avx2 fma", "fp32"),  # AVX2 only (this machine's kind: an EPYC Zen 3): bf16 would be emulated
    ("fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile", "bf16"),  # AMX (Sapphire Rapids and later)
    ("fpu sse2 avx avx2 fma avx512f avx512_bf16", "bf16"),  # AVX-512 BF16 (Cooper Lake, Zen 4)
])
def test_the_default_plan_on_a_faked_cpu_probe_chooses_bf16_only_where_native(monkeypatch, flags, precision):
    from saturate.hardware import cpu as cpu_module
    from saturate.hardware import probe

    monkeypatch.setattr(cpu_module, "read_cpuinfo", lambda: f"model name\t: Faked CPU\nflags\t\t: {flags}\n")
    hw = probe(measure_peaks=False, device="cpu")
    assert hw.cpu_name == "Faked CPU"
    plan, _ = workload_default_plan(_workload(lambda: nn.Linear(4, 4)), hw)
    assert plan.precision == precision and plan.tf32 is False
    assert plan.provenance["precision"].startswith(precision) and "chosen from the hardware" in \
        plan.provenance["precision"]
