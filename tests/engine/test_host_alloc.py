"""The host allocator's thresholds: what they are, when they are left alone, and that they stop the page faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from saturate.engine import host_alloc
from saturate.engine.host_alloc import ENV_MMAP, ENV_TRIM, MiB, child_env, left_alone, thresholds

GLIBC = left_alone({}) is None


def test_the_thresholds_scale_with_the_ram_and_stay_bounded():
    assert thresholds(24 * 1024 * MiB) == (128 * MiB, 768 * MiB)
    assert thresholds(1024 * 1024 * MiB) == (128 * MiB, 1024 * MiB)  # a big host keeps at most 1 GiB
    assert thresholds(4 * 1024 * MiB) == (64 * MiB, 128 * MiB)  # a small one 1/32 of its RAM
    mmap, trim = thresholds(16 * MiB)
    assert 0 < mmap <= trim == MiB


@pytest.mark.parametrize(("env", "why"), [
    ({"SATURATE_HOST_ALLOC": "system"}, "SATURATE_HOST_ALLOC=system"),
    ({"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "preloaded"),
])
def test_the_users_own_allocator_settings_are_left_alone(env, why):
    assert why in left_alone(env)
    assert child_env(env) == {}


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_script_gets_the_thresholds_in_its_environment():
    mmap, trim = thresholds()
    assert child_env({"MALLOC_ARENA_MAX": "2"}) == {ENV_MMAP: str(mmap), ENV_TRIM: str(trim)}


FAULTS = """
import json, resource, sys, torch
from saturate.engine.host_alloc import keep_freed_memory
note = keep_freed_memory() if sys.argv[1] == "ours" else None
torch.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 48 MiB, past glibc's largest dynamic mmap threshold (32 MiB): mapped afresh each time
    x = torch.ones(12 * 2**20)
    del x
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "note": note}))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_raised_thresholds_reuse_freed_buffers_instead_of_faulting_them_in_again():
    def faults(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                             env={k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")})
        return json.loads(out.stdout)

    system, ours = faults("system"), faults("ours")
    pages = 48 * MiB // 4096
    assert system["faults"] >= 15 * pages  # every buffer's pages touched afresh
    assert ours["faults"] <= 3 * pages  # the first buffer's pages, then reused
    assert ours["note"].startswith("host allocator: freed blocks under 128 MiB reused")


def test_a_cpu_stepper_notes_the_setting_once_and_a_second_stepper_changes_nothing(monkeypatch):
    from saturate.engine.step import Stepper
    from saturate.plan import Plan
    from saturate.workloads import custom_workload

    calls = []
    monkeypatch.setattr(host_alloc, "_applied", None)
    monkeypatch.setattr(host_alloc, "left_alone", lambda environ=None: None)
    monkeypatch.setattr(host_alloc.ctypes, "CDLL", lambda name: type("Libc", (), {
        "mallopt": staticmethod(lambda param, value: calls.append((param, value)) or 1)}))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    workload = custom_workload("tiny", model=lambda: torch.nn.Linear(4, 1), dataset=data,
                               loss=torch.nn.functional.mse_loss, effective_batch=4, lr=1e-3)
    notes: list[str] = []
    Stepper(workload, Plan(micro_batch=4, grad_accum=1), torch.device("cpu"), 1e-3, notes=notes, compile=False)
    Stepper(workload, Plan(micro_batch=4, grad_accum=1), torch.device("cpu"), 1e-3, notes=notes, compile=False)
    assert [n.split(":")[0] for n in notes] == ["host allocator"]  # said once for the run's list of notes
    assert [p for p, _ in calls] == [host_alloc.M_MMAP_THRESHOLD, host_alloc.M_TRIM_THRESHOLD]  # set once


def test_a_refused_threshold_is_said_and_not_claimed(monkeypatch):
    monkeypatch.setattr(host_alloc, "_applied", None)
    monkeypatch.setattr(host_alloc, "left_alone", lambda environ=None: None)
    monkeypatch.setattr(host_alloc.ctypes, "CDLL", lambda name: type("Libc", (), {
        "mallopt": staticmethod(lambda param, value: 0)}))
    assert host_alloc.keep_freed_memory() == "host allocator: left as it is (glibc's mallopt refused the thresholds)"
    assert host_alloc._applied is None
