"""The default plan `saturate run` trains untuned: sized by naive's measured peak, guarded by its first steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.nn as nn

from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.run.informed import informed_plan
from saturate.tune.trial import Trial
from saturate.workloads.base import Optimization, Workload

_GIB = 2**30
AMX = SimpleNamespace(device_type="cpu", torch_device="cpu", supports={"bf16": True, "fp16": False, "tf32": False},
                      cpu_cores=2)
AVX2 = SimpleNamespace(device_type="cpu", torch_device="cpu", supports={"bf16": False, "fp16": False, "tf32": False},
                       cpu_cores=2)
# A GPU's rules (the micro-batch grows to what memory holds), its fused-kernel check asked of the CPU here.
GPU = SimpleNamespace(device_type="cuda", torch_device="cpu", supports={"bf16": True, "fp16": True, "tf32": True},
                      cpu_cores=2)
NAIVE = Plan(name="naive", micro_batch=8, grad_accum=4)
FP32_LOSSES = [5.5, 5.4, 5.2, 5.0]


def _workload(effective: int = 32) -> Workload:
    return Workload(name="w", build_model=lambda: nn.Linear(4, 4), train_data=[], val_data=None,
                    loss_fn=lambda m, b: 0, optim=Optimization(effective_batch=effective, lr=1e-3))


class Guard:
    """The measurer that measured naive: its memory, and the guard's trial of the informed plan, as given."""

    def __init__(self, capacity: int = 10 * _GIB, **trial: object) -> None:
        self.memory_capacity, self.memory_kind = capacity, "host RSS"
        self.trial, self.plans = trial, []

    def verify(self, plan: Plan) -> Trial:
        self.plans.append(plan)
        return Trial(stage="verify", plan=plan, **({"losses": FP32_LOSSES, "peak_memory_bytes": _GIB} | self.trial))


def naive(peak: int | None = _GIB) -> Trial:
    return Trial(stage="verify", plan=NAIVE, samples_per_s=10.0, step_s=3.2, peak_memory_bytes=peak,
                 losses=FP32_LOSSES)


def test_naive_s_peak_sizes_the_micro_batch_and_the_guard_checks_bf16s_losses_and_memory():
    m = Guard(losses=[5.51, 5.41, 5.19, 5.01])
    plan = informed_plan(_workload(), GPU, 1, naive(), m)  # 1 GiB at 8 in proportion: 72 fit in 9 GiB
    assert (plan.precision, plan.micro_batch, plan.grad_accum) == ("bf16", 32, 1)
    assert m.plans == [plan.replace(provenance=m.plans[0].provenance)]  # one guard trial, of that plan
    assert "naive's measured peak" in plan.provenance["micro_batch"] and "a prediction" in \
        plan.provenance["micro_batch"]
    assert "(measured, the guard)" in plan.provenance["micro_batch"]
    assert "chosen from the hardware, not measured" in plan.provenance["precision"]
    assert "within 0.18 % of fp32's (measured, the guard)" in plan.provenance["precision"]


def test_a_bf16_whose_first_losses_drift_from_fp32s_is_not_kept():
    plan = informed_plan(_workload(), AMX, 1, naive(), Guard(losses=[5.5, 5.9, 6.3, 7.0]))
    assert plan.precision == "fp32" and "differed from fp32's by up to" in plan.provenance["precision"]


def test_a_micro_batch_that_runs_out_of_memory_in_its_first_steps_falls_back_to_the_rule():
    plan = informed_plan(_workload(), GPU, 1, naive(), Guard(status="oom", error="out of memory"))
    assert (plan.micro_batch, plan.grad_accum) == (16, 2) and "ran out of memory" in plan.provenance["micro_batch"]
    plan = informed_plan(_workload(), GPU, 1, naive(), Guard(peak_memory_bytes=20 * _GIB))  # over 9 GiB
    assert plan.micro_batch == 16 and "peaked at 20.00 GiB" in plan.provenance["micro_batch"]


def test_an_informed_plan_that_fails_its_guard_trains_naive_s_settings():
    plan = informed_plan(_workload(), AMX, 1, naive(), Guard(status="failed", error="boom"))
    assert plan.name == "default" and plan.knobs() == NAIVE.knobs() and "boom" in plan.provenance["guard"]


def test_no_guard_when_there_is_nothing_to_check_or_nothing_measured():
    m = Guard()
    plan = informed_plan(_workload(8), AVX2, 1, naive(), m)  # fp32 at naive's micro-batch: nothing to check
    assert (plan.precision, plan.micro_batch, m.plans) == ("fp32", 8, [])
    plan = informed_plan(_workload(), AMX, 1, None, m)  # --minutes: naive not measured, the rule's micro-batch
    assert (plan.precision, plan.micro_batch, m.plans) == ("bf16", 8, [])
    assert "no memory was measured" in plan.provenance["micro_batch"]


def test_an_avx2_only_cpu_never_trains_bf16_untuned():
    m = Guard()
    plan = informed_plan(_workload(), AVX2, 1, naive(), m)
    assert plan.precision == "fp32" and plan.micro_batch == 8 and m.plans == []  # naive's size on a CPU: no guard


def test_on_a_cpu_the_untuned_micro_batch_stays_at_8_however_much_memory_there_is():
    # 32 × 1 measured 12.4 % slower than 8 × 4 for a GPT-2-shaped job on the 2-core AVX2 EPYC (2026-11-26)
    m = Guard(capacity=100 * _GIB, losses=[5.51, 5.41, 5.19, 5.01])
    plan = informed_plan(_workload(), AMX, 1, naive(), m)
    assert (plan.precision, plan.micro_batch, plan.grad_accum) == ("bf16", 8, 4) and len(m.plans) == 1
    assert "up to 8 on a CPU" in plan.provenance["micro_batch"]


@pytest.mark.parametrize(("capacity", "micro"), [(2 * _GIB, 8), (_GIB, 4)])
def test_little_memory_keeps_the_micro_batch_small(capacity, micro):
    # 1 GiB at 8 in proportion: 90 % of 2 GiB holds 14 (8 divides 32), 90 % of 1 GiB holds 7 (4 divides 32)
    plan = informed_plan(_workload(), AVX2, 1, naive(), Guard(capacity=capacity))
    assert plan.micro_batch == micro and POLICY.job.headroom == 0.9
