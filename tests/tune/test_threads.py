"""Intra-op threads as a knob: fewer than the cores when other processes keep some busy (tune/search.py `threads`)."""

from __future__ import annotations

import pytest
import torch
from test_search import FakeMachine, GiB, linear_memory, settings
from torch.utils.data import default_collate

from saturate import plan_cache as cache
from saturate.engine import resume
from saturate.engine.resume import choose_plan
from saturate.engine.step import Stepper, own_threads, use_threads
from saturate.errors import ConfigError
from saturate.hardware.contention import Contention
from saturate.plan import Plan
from saturate.tune.search import search
from saturate.tune.trial import Trial
from saturate.workloads import build_workload


def test_a_plan_keeps_its_threads_through_toml_and_refuses_fewer_than_one(tmp_path):
    with pytest.raises(ConfigError, match="plan.threads must be >= 1"):
        Plan(threads=0)
    Plan(threads=1).save(tmp_path / "one.toml")
    Plan().save(tmp_path / "default.toml")
    assert Plan.load(tmp_path / "one.toml").threads == 1
    assert Plan.load(tmp_path / "default.toml").threads is None
    assert "threads" not in (tmp_path / "default.toml").read_text()  # TOML has no null


def test_a_stepper_runs_with_its_plans_threads_and_gives_the_default_back(small_corpus, cpu):
    if DEFAULT_THREADS < 2:
        pytest.skip("one intra-op thread by default: nothing to lower")
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=2, warmup_steps=1)
    one = Stepper(workload, Plan(micro_batch=2, threads=1), torch.device("cpu"), 1e-3, compile=False)
    assert torch.get_num_threads() == 1
    default = Stepper(workload, Plan(micro_batch=2), torch.device("cpu"), 1e-3, compile=False)
    assert torch.get_num_threads() == DEFAULT_THREADS
    batches = iter([default_collate([workload.train_data[0], workload.train_data[1]])] * 2)
    one.step(batches)  # each step sets its plan's count: another plan's Stepper may have run in between
    assert torch.get_num_threads() == 1
    default.step(batches)
    assert torch.get_num_threads() == DEFAULT_THREADS
    use_threads(None)
    torch.set_num_threads(1)  # the user's own count: a plan without one leaves it alone
    Stepper(workload, Plan(micro_batch=2), torch.device("cpu"), 1e-3, compile=False).step(
        iter([default_collate([workload.train_data[0], workload.train_data[1]])]))
    assert torch.get_num_threads() == 1
    torch.set_num_threads(DEFAULT_THREADS)


DEFAULT_THREADS = torch.get_num_threads()  # this process's count (the tests never leave another behind)


class BusyCPU(FakeMachine):
    """A CPU with `cores` cores whose trials see other processes keeping `busy` cores busy; `fewer` threads run at
    `speedup`× the default's samples/s."""

    def __init__(self, busy: float, speedup: float, cores: int = 2) -> None:
        super().__init__(speed=lambda p: 100.0 * (speedup if p.threads else 1.0), memory=linear_memory(GiB, GiB / 100),
                         device_type="cpu", cores=cores, spread=0.01)
        self.busy = busy

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        t.busy_cores, t.contended = self.busy, self.busy > 0.25
        return t


class Uneven(BusyCPU):
    """Busy during every trial, but the load moves: `busy` cores in odd trials, half as many in even ones."""

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        if len(self.tried) % 2 == 0:
            t.busy_cores = self.busy / 2
        return t


def _tune(machine: FakeMachine):
    return search(machine, Plan(), settings(effective_batch=8, try_compile=False, supports={}, fused_available=False))


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one intra-op thread by default: nothing to lower")
def test_a_busy_machine_trains_with_the_threads_the_others_leave_when_that_is_faster():
    busy = BusyCPU(busy=1.0, speedup=2.5, cores=DEFAULT_THREADS)
    result = _tune(busy)
    free = DEFAULT_THREADS - 1
    # the same load during both trials (a steady neighbour): the two trials compare as quiet ones do, and a decisive
    # gain is taken without measuring torch's count again
    assert busy.tried[1].threads == free
    assert result.plan.threads == free and all(p.threads == free for p in busy.tried[2:])  # the rest at that count
    line = next(d for d in result.decisions if d.startswith("threads"))
    assert f"threads: {free} of {DEFAULT_THREADS}" in line and "kept 1.0 of" in line and "tune again" in line
    assert f"both trials under the same load (1.0 and 1.0 of {DEFAULT_THREADS} cores busy)" in line
    assert "chosen while other processes kept 1.0" in result.plan.provenance["threads"]

    uneven = Uneven(busy=1.0, speedup=2.5, cores=DEFAULT_THREADS)  # the load moved between the trials
    moved = _tune(uneven)
    # the default count measured again to confirm (no pairs on this fake), and the gain held against it
    assert uneven.tried[2].threads is None and moved.plan.threads == free
    assert "under the same load" not in next(d for d in moved.decisions if d.startswith("threads"))

    no_gain = _tune(BusyCPU(busy=1.0, speedup=0.9, cores=DEFAULT_THREADS))
    assert no_gain.plan.threads is None
    assert "measured" in next(d for d in no_gain.decisions if d.startswith("threads"))


def test_a_quiet_machine_keeps_torchs_threads_without_a_trial():
    quiet = BusyCPU(busy=0.0, speedup=2.5, cores=DEFAULT_THREADS)
    result = _tune(quiet)
    assert result.plan.threads is None and not any(p.threads for p in quiet.tried)
    assert "the machine was quiet" in next(d for d in result.decisions if d.startswith("threads"))
    gpu = FakeMachine(speed=lambda p: 100.0, memory=linear_memory(GiB, GiB / 100))  # not a CPU: no threads stage
    assert not any(d.startswith("threads") for d in _tune(gpu).decisions)


def _busy_start(machine: FakeMachine, busy: float | None):
    return search(machine, Plan(), settings(effective_batch=8, try_compile=False, supports={}, fused_available=False,
                                            busy_before=busy))


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one intra-op thread by default: nothing to lower")
def test_a_cpu_busy_before_the_search_starts_it_at_the_threads_left_and_measures_torchs_count_after():
    # Under the bursty neighbour gpt-tiny's first step took 5-7 s at torch's 2 threads (~1 s quiet): a 45 s budget
    # held no trial. The first trial now runs at the cores the others left, and torch's count is measured against it.
    free = DEFAULT_THREADS - 1
    busy = BusyCPU(busy=1.0, speedup=2.5, cores=DEFAULT_THREADS)
    result = _busy_start(busy, 1.0)
    assert busy.tried[0].threads == free and busy.tried[1].threads is None  # the start, then torch's count
    assert result.plan.threads == free and "chosen while other processes kept" in result.plan.provenance["threads"]
    lines = [d for d in result.decisions if d.startswith("threads")]
    assert lines[0].startswith(f"threads: the first trial at {free} of torch's {DEFAULT_THREADS}")
    assert lines[1].startswith(f"threads: {free} of {DEFAULT_THREADS}") and "tune again" in lines[1]

    slower = BusyCPU(busy=1.0, speedup=0.5, cores=DEFAULT_THREADS)  # fewer threads measured slower: torch's wins
    back = _busy_start(slower, 1.0)
    assert back.plan.threads is None and slower.tried[0].threads == free
    assert any(d.startswith(f"threads: torch's {DEFAULT_THREADS}") for d in back.decisions)

    even = BusyCPU(busy=1.0, speedup=1.0, cores=DEFAULT_THREADS)  # within the noise: torch's count, what one had
    same = _busy_start(even, 1.0)
    assert same.plan.threads is None and even.tried[0].threads == free
    line = next(d for d in same.decisions if d.startswith(f"threads: torch's {DEFAULT_THREADS} ("))
    assert f"{free} thread" in line and "within noise" in line and "tune again" not in line

    quiet = BusyCPU(busy=0.0, speedup=2.5, cores=DEFAULT_THREADS)  # quiet before: the search starts as ever
    assert _busy_start(quiet, None).plan.threads is None and quiet.tried[0].threads is None

    class SetsThreads(BusyCPU):  # as the real measurer's Stepper: a plan's count stays set after its trial
        def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
            use_threads(plan.threads)
            return super().model_trial(plan, stage, **kw)

    try:
        real = SetsThreads(busy=1.0, speedup=2.5, cores=DEFAULT_THREADS)
        said = _busy_start(real, 1.0).decisions
        assert real.tried[1].threads is None  # torch's own count measured, not "torch's 1" skipped
        assert any(d.startswith(f"threads: {free} of {DEFAULT_THREADS}") for d in said), said
    finally:
        use_threads(None)
    assert torch.get_num_threads() == DEFAULT_THREADS


class LoadLater(BusyCPU):
    """Quiet for the first trial, then other processes keep `busy` cores busy (the load came back)."""

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        if len(self.tried) == 1:
            t.busy_cores, t.contended = 0.0, False
        return t


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one intra-op thread by default: nothing to lower")
def test_threads_are_tried_again_when_the_load_comes_after_the_first_trial():
    later = LoadLater(busy=1.0, speedup=2.5, cores=DEFAULT_THREADS)
    result = _tune(later)
    assert result.plan.threads == DEFAULT_THREADS - 1
    lines = [d for d in result.decisions if d.startswith("threads")]
    assert "the machine was quiet" in lines[0] and lines[1].startswith("threads, again")
    still_quiet = _tune(BusyCPU(busy=0.0, speedup=2.5, cores=DEFAULT_THREADS))
    assert not any(d.startswith("threads, again") for d in still_quiet.decisions)
    no_gain = _tune(LoadLater(busy=1.0, speedup=0.9, cores=DEFAULT_THREADS))
    assert no_gain.plan.threads is None  # tried again, measured no faster: torch's count stays


def _cached_one_thread(workload, cpu) -> None:
    tuned = Plan(micro_batch=8, threads=1, name="tuned",
                 provenance={"threads": "chosen while other processes kept 1.0 of 2 cores busy"})
    cache.store(tuned, workload, cpu.fingerprint())


def _load_now(monkeypatch, other: float | None) -> list[float]:
    """The load `threads_for_now` reads, faked: `other` cores busy (None: unreadable). Returns the reads' seconds."""
    reads: list[float] = []

    def read(seconds: float) -> Contention:
        reads.append(seconds)
        return Contention(seconds=seconds, usable_cores=2, other_cores=other, own_cores=0.0,
                          notes=[] if other is not None else ["CPU times unreadable: a test"])
    monkeypatch.setattr(resume, "measure_contention", read)
    return reads


def test_training_with_a_cached_plan_of_fewer_threads_keeps_them_while_the_machine_is_busy(small_corpus, cpu,
                                                                                            monkeypatch):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8)
    _cached_one_thread(workload, cpu)
    reads = _load_now(monkeypatch, 1.0)
    notes: list[str] = []
    plan = choose_plan(None, None, workload, cpu, True, notes)
    assert plan.threads == 1 and reads == [0.5]
    said = [n for n in notes if "intra-op thread(s)" in n]
    assert len(said) == 1 and "(chosen while other processes kept 1.0 of 2 cores busy)" in said[0]
    assert "other processes keep 1.0 of 2 cores busy now too, so it stays" in said[0]


def test_a_cached_count_chosen_under_load_gives_way_to_torchs_own_on_a_quiet_machine(small_corpus, cpu, monkeypatch):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8)
    _cached_one_thread(workload, cpu)
    _load_now(monkeypatch, 0.1)
    notes: list[str] = []
    plan = choose_plan(None, None, workload, cpu, True, notes)
    assert plan.threads is None and plan.micro_batch == 8  # only the count changes
    said = [n for n in notes if "intra-op thread(s)" in n]
    assert len(said) == 1 and "the machine is quiet now (other processes keep 0.1 of 2 cores busy)" in said[0]
    assert f"torch's own {own_threads()} are used instead" in said[0]
    assert "dropped, the machine quiet at the start" in plan.provenance["threads"]
    assert cache.lookup(workload, cpu.fingerprint(), 1)[0].threads == 1  # the cached plan itself is left as tuned


def test_a_cached_count_stays_when_the_load_cannot_be_read_or_several_processes_share_it(small_corpus, cpu,
                                                                                         monkeypatch):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8)
    _cached_one_thread(workload, cpu)
    _load_now(monkeypatch, None)
    notes: list[str] = []
    assert choose_plan(None, None, workload, cpu, True, notes).threads == 1
    assert any("the load now was not read (CPU times unreadable: a test), so it stays" in n for n in notes)
    reads = _load_now(monkeypatch, 0.0)
    notes = []
    plan = resume.threads_for_now(Plan(micro_batch=4, threads=1), cpu, notes, world=2)
    assert reads == [] and plan.threads == 1  # each rank would read its own load: not read at all
    assert any("on a quieter machine, tune again" in n for n in notes)


def test_a_plan_given_by_the_user_keeps_its_count_unread(small_corpus, cpu, monkeypatch):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8)
    reads = _load_now(monkeypatch, 0.0)
    assert choose_plan(Plan(micro_batch=8, threads=1), None, workload, cpu, True, []).threads == 1
    assert reads == []


class SlowAtTorchsCount(BusyCPU):
    """A BusyCPU whose trials at torch's count take `slow` seconds and at fewer threads `fast` (a steady neighbour:
    torch's 2 threads ran 4-5x slower, and their trial was as long as that allows)."""

    def __init__(self, slow: float, fast: float, **kw) -> None:
        super().__init__(**kw)
        self.slow, self.fast = slow, fast

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        t = super().model_trial(plan, stage, **kw)
        t.seconds = self.fast if plan.threads else self.slow
        return t


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one intra-op thread by default: nothing to lower")
def test_a_thread_count_left_behind_does_not_predict_the_trials_after_it():
    # Under the steady neighbour torch's two threads took a 16-s trial, one thread's took 4-9 s; once one thread was
    # kept, "a trial takes up to 16 s" left fp32's check and every micro-batch untried in a 60-s budget.
    def tune(speedup: float):
        machine = SlowAtTorchsCount(16.0, 4.0, busy=1.0, speedup=speedup, cores=DEFAULT_THREADS)
        result = search(machine, Plan(), settings(effective_batch=8, try_compile=False, supports={},
                                                  fused_available=False, busy_before=1.0, budget_s=30.0))
        return machine, result

    machine, result = tune(4.0)
    assert result.plan.threads == DEFAULT_THREADS - 1
    assert machine.tried[1].threads is None and all(p.threads for p in machine.tried[2:])
    assert len({p.micro_batch for p in machine.tried}) > 1  # the micro-batch search ran at the fewer threads
    assert not any("a trial takes up to 16 s" in s for s in result.skipped), result.skipped
    # torch's count kept: the trials after it run at that count, and its long trial still predicts them
    even, still = tune(1.0)
    assert still.plan.threads is None and any("a trial takes up to 16 s" in s for s in still.skipped), still.skipped
    assert len({p.micro_batch for p in even.tried}) == 1
