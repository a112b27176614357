"""A compilation stopped in flight leaves nothing behind (issue 17): no compiler processes or threads
running beside what follows, no compiled code or frame callback, the process usable.

The stop is provoked where it used to leave work running: as the compilation waits for inductor's
compile threads to build its C++ kernels (each a g++), all of them queued. The alarm is rung there
rather than by a short time limit, whose landing point would depend on the machine's speed; the
trial handles it as it handles its limit.
"""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
import torch

from saturate.plan import Plan
from saturate.tune.measure import RealMeasurer
from saturate.tune.process import prepare_compiler
from saturate.workloads import build_workload
from saturate.workloads.gpt import GPT


@pytest.fixture
def workload(small_corpus):
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2)


def running_children(me: psutil.Process, before: set[int]) -> list[str]:
    out = []
    for c in me.children(recursive=True):
        try:
            if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{c.pid} {c.name()}")
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.slow
def test_a_compilation_stopped_while_building_kernels_leaves_nothing_behind(workload, cpu, tmp_path, monkeypatch):
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.utils import clear_caches

    prepare_compiler(torch.device("cpu"))  # the CPU probe, built in the usual cache, not the empty one below
    # Empty compile caches, on disk and in memory: the compilation has kernels to build.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    clear_caches()
    m = RealMeasurer(workload, cpu, min_seconds=0.1, min_steps=2, max_steps=3)
    plan = Plan(micro_batch=4, grad_accum=2)
    assert m.model_trial(plan, "before").ok  # the threads torch starts for its first steps exist from here on
    me = psutil.Process()
    children_before = {c.pid for c in me.children(recursive=True)}
    threads_before = set(threading.enumerate())
    torch_threads = torch.get_num_threads()

    wait = AsyncCompile._wait_futures
    rang = threading.Event()

    def ring_then_wait(self, scope):
        if not rang.is_set():
            rang.set()  # the graph's kernels are queued, the compile threads building: stop the compilation now
            os.kill(os.getpid(), signal.SIGALRM)
        wait(self, scope)

    monkeypatch.setattr(AsyncCompile, "_wait_futures", ring_then_wait)
    stopped = m.model_trial(plan.replace(compile="default"), "compile", compile_limit_s=3600.0)
    assert rang.is_set(), "the compilation waited for no kernel build: nothing was provoked"
    assert stopped.status == "timeout", (stopped.status, stopped.error)

    assert running_children(me, children_before) == []  # no g++ building the rest of the queue
    assert set(threading.enumerate()) <= threads_before, set(threading.enumerate()) - threads_before
    assert torch.get_num_threads() == torch_threads
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    assert entries(GPT.forward.__code__) == [] and entries(torch.nn.Module._call_impl.__code__) == []
    assert torch._C._dynamo.eval_frame.get_eval_frame_callback() is None
    eager = m.model_trial(plan, "after")  # the process is left usable
    assert eager.ok and eager.samples_per_s > 0


def test_an_eager_trial_between_a_compilation_and_its_rejection_keeps_what_discarding_ends(workload, cpu):
    """The search may measure the eager plan again (a confirmation) after a compile trial: the later discard must
    still end that compilation, so the eager trial must not forget it."""
    m = RealMeasurer(workload, cpu, min_seconds=0.05, min_steps=1, max_steps=2)
    ended = []

    class Scope:  # what a compile trial leaves (CompileScope's interface)
        def discard(self) -> None:
            ended.append(True)

    m._compile_scope = Scope()
    assert m.model_trial(Plan(micro_batch=4, grad_accum=2), "compile").ok  # eager, as the confirmation runs it
    m.discard_compiled()
    assert ended == [True] and m._compile_scope is None
