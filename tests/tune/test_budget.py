"""Budgets are kept: the search against a fake machine on a fake clock (no timing involved)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_search import FakeMachine, GiB, linear_memory, saturating, settings

from saturate.errors import ConfigError
from saturate.plan import Plan
from saturate.tune.api import no_empty_folders
from saturate.tune.search import search
from saturate.tune.trial import OVER_BUDGET, Trial


class Clocked(FakeMachine):
    """A fake machine on a fake clock: each trial advances it by its length (`length(plan, stage)`). Like the
    real measurer, a model trial whose first step predicts an end past `deadline` stops there."""

    def __init__(self, length, **kw) -> None:
        super().__init__(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), **kw)
        self.now, self.length, self.deadline = 0.0, length, None

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        seconds = self.length(plan, stage)
        if self.deadline is not None and stage != "verify" and self.now + seconds > self.deadline:
            self.now += seconds / 10  # its first step
            self.tried.append(plan)
            return Trial(stage=stage, plan=plan, status=OVER_BUDGET, seconds=seconds / 10,
                         error="was stopped after its first step: it would end past the budget")
        t = super().model_trial(plan, stage, **kw)
        self.now += seconds
        t.seconds = seconds
        return t

    def loader_trial(self, plan: Plan):
        self.now += 1.0
        t = super().loader_trial(plan)
        t.seconds = 1.0
        return t


@pytest.fixture
def clocked(monkeypatch):
    def make(length, **kw) -> Clocked:
        machine = Clocked(length, **kw)
        module = importlib.import_module("saturate.tune.state")
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: machine.now))
        return machine
    return make


@pytest.mark.parametrize("budget", [30, 60, 120])
def test_the_search_ends_within_a_tenth_of_its_budget(clocked, budget):
    # bf16 trials take 3× as long as fp32 ones (a CPU without native bf16 units): the first step says so.
    machine = clocked(lambda p, stage: 24.0 if p.precision == "bf16" else 8.0)
    result = search(machine, Plan(), settings(budget_s=budget, try_compile=True), started=0.0)
    assert result.chosen.ok and machine.now <= 1.1 * budget, (machine.now, result.skipped)
    assert result.seconds == machine.now
    unbounded = clocked(lambda p, stage: 8.0)
    search(unbounded, Plan(), settings(try_compile=True), started=0.0)
    assert len(machine.tried) < len(unbounded.tried) and result.skipped


def test_time_before_the_search_counts(clocked):
    machine = clocked(lambda p, stage: 8.0)
    machine.now = 20.0  # probing and building the workload took 20 s of a 60 s budget
    result = search(machine, Plan(), settings(budget_s=60, try_compile=False), started=0.0)
    assert result.chosen.ok and machine.now <= 66 and result.seconds == machine.now
    assert len(machine.tried) <= 4
    late = clocked(lambda p, stage: 8.0)
    late.now = 40.0  # 40 s gone: the first trial and its verification no longer fit
    with pytest.raises(ConfigError, match="too small.*with the verification"):
        search(late, Plan(), settings(budget_s=60, try_compile=False), started=0.0)


def test_a_trial_predicted_past_the_budget_is_stopped_and_said(clocked):
    machine = clocked(lambda p, stage: 40.0 if p.precision == "bf16" else 5.0)
    result = search(machine, Plan(), settings(budget_s=40, try_compile=False), started=0.0)
    stopped = [t for t in result.trials if t.status == OVER_BUDGET]
    assert result.plan.precision == "fp32" and machine.now <= 44
    assert all(t.plan.precision == "bf16" for t in stopped)
    assert any("not tried, the budget is spent (a trial was stopped at its deadline)" in s for s in result.skipped)
    assert not any("up to 0 s" in s for s in result.skipped)  # no trial of a kind yet: no length said


def test_a_budget_smaller_than_one_trial_fails_after_its_first_step(clocked):
    machine = clocked(lambda p, stage: 70.0)
    with pytest.raises(ConfigError, match=r"^tuning budget 1 s is too small: the first trial \(micro-batch 8, fp32\) "
                                          r"was stopped after its first step"):
        search(machine, Plan(), settings(budget_s=1), started=0.0)
    assert len(machine.tried) == 1 and machine.now == pytest.approx(7.0)  # its first step, not the whole trial


def test_a_failed_tune_leaves_no_empty_folder(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "run" / "tune"
    with pytest.raises(KeyboardInterrupt), no_empty_folders(run_dir, out):
        out.mkdir(parents=True)
        raise KeyboardInterrupt
    assert not run_dir.exists()
    kept = tmp_path / "kept"
    with pytest.raises(RuntimeError), no_empty_folders(kept):
        kept.mkdir()
        (kept / "tune.json").write_text("{}")
        raise RuntimeError("after the evidence was written")
    assert (kept / "tune.json").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError), no_empty_folders(existing):
        raise RuntimeError("a folder that was there before is the user's")
    assert existing.exists() and Path(existing).is_dir()


def test_writing_the_evidence_is_kept_out_of_the_search_budget():
    assert settings(budget_s=100).search_budget() == pytest.approx(95.0)  # 2 s + 3 %
    assert settings(budget_s=1000).search_budget() == pytest.approx(990.0)  # at most 10 s
    assert settings().search_budget() is None


class Capped(Clocked):
    """A fake whose trials take `setup` seconds and are then timed for the rule's `timed` seconds, or for the
    search's window cap when it is shorter (but never under `shortest`, the minimum windows)."""

    def __init__(self, setup: float = 2.0, timed: float = 8.0, shortest: float = 1.5, **kw) -> None:
        super().__init__(lambda p, stage: setup + self.timed(), **kw)
        self.setup, self.full, self.shortest = setup, timed, shortest
        self.window_cap_s: float | None = None
        self.caps: list[float | None] = []

    def timed(self) -> float:
        return self.full if self.window_cap_s is None else max(self.shortest, min(self.full, self.window_cap_s))

    def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
        self.caps.append(self.window_cap_s)
        t = super().model_trial(plan, stage, **kw)
        if t.ok:  # as many steps as the timed seconds hold
            t.steps = max(1, round((t.seconds - self.setup) / t.step_s))
        return t


@pytest.fixture
def capped(clocked, monkeypatch):
    def make(**kw) -> Capped:
        machine = Capped(**kw)
        module = importlib.import_module("saturate.tune.state")
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: machine.now))
        return machine
    return make


@pytest.mark.parametrize("verify", [True, False])
def test_trials_timed_for_a_share_of_the_budget_reach_the_micro_batch_stage(capped, clocked, verify):
    # 45 s holds four 10 s trials: timed in full, the search ends after the precision stage (or one micro-batch
    # when it verifies nothing); timed for a share of the budget left, it climbs every micro-batch, within budget.
    machine = capped()
    result = search(machine, Plan(), settings(budget_s=45, try_compile=False, verify=verify), started=0.0)
    stages = [t.stage for t in result.trials]
    assert stages.count("micro-batch") >= 2 and result.plan.micro_batch > 8, (stages, result.skipped)
    assert machine.now <= 45 and result.chosen.ok
    assert all(c is not None and c < 8 for c in machine.caps)
    full = clocked(lambda p, stage: 10.0)  # a measurer that times every trial for the rule's full 8 s
    search(full, Plan(), settings(budget_s=45, try_compile=False, verify=verify), started=0.0)
    assert len([p for p in full.tried if p.micro_batch > 8]) == (0 if verify else 1)


def test_without_verification_the_budget_holds_more_trials(capped):
    verified, unverified = capped(), capped()
    a = search(verified, Plan(), settings(budget_s=45, try_compile=False), started=0.0)
    b = search(unverified, Plan(), settings(budget_s=45, try_compile=False, verify=False), started=0.0)
    assert [t.stage for t in a.trials][-1] == "verify" and "verify" not in [t.stage for t in b.trials]
    assert len([t for t in b.trials if t.ok]) > len([t for t in a.trials if t.ok and t.stage != "verify"])
    assert unverified.now <= 45 and verified.now <= 45
    assert b.chosen.plan == b.plan and b.chosen.stage != "verify" and "measured again by the caller" in b.chosen.verdict
    assert any(d.startswith("verification: left to the caller") for d in b.decisions)


def test_a_search_that_finds_a_saving_may_spend_half_of_it_and_one_that_finds_none_keeps_its_budget(clocked):
    # 8 s trials, a 30 s first budget that may grow to 100 s over a 1,000 s training: bf16 at 1.8x saves 444 s,
    # half of it is more than the cap allows, so the search goes on to 100 s.
    grown = clocked(lambda p, stage: 8.0)
    result = search(grown, Plan(), settings(budget_s=30, budget_cap_s=100, training_s=1000, try_compile=False,
                                            verify=False), started=0.0)
    fixed = clocked(lambda p, stage: 8.0)
    search(fixed, Plan(), settings(budget_s=30, try_compile=False, verify=False), started=0.0)
    assert result.budget_s == 100 and 30 < grown.now <= 100 and len(grown.tried) > len(fixed.tried) and fixed.now <= 30
    assert any(d.startswith("budget: 30 -> 100 s: 8×8 bf16+tf32 measured +80.0% over the first trial (the "
                            "comparisons that kept its changes), 444 s saved over the 1000 s training (a prediction); "
                            "the search may spend 50% of it, up to 100 s")
               for d in result.decisions), result.decisions
    flat = clocked(lambda p, stage: 8.0)
    flat.speed = lambda p: 100.0  # nothing is faster than the first trial: nothing earned
    kept = search(flat, Plan(), settings(budget_s=30, budget_cap_s=100, training_s=1000, try_compile=False,
                                         verify=False), started=0.0)
    assert kept.budget_s == 30 and flat.now <= 30 and not any(d.startswith("budget:") for d in kept.decisions)


@pytest.mark.parametrize("budget", [30, 60, 120])
def test_a_search_from_the_informed_plan_ends_within_a_tenth_of_its_budget(clocked, budget):
    from saturate.plan import default_plan

    informed = default_plan(64, "cuda", {"bf16": True, "fp16": True, "tf32": True}, cores=8, fused_optimizer=True)
    machine = clocked(lambda p, stage: 8.0 if p.precision == "bf16" else 12.0)  # fp32, its alternative, is slower
    result = search(machine, informed, settings(budget_s=budget, try_compile=True), started=0.0)
    assert result.chosen.ok and machine.now <= 1.1 * budget, (machine.now, result.skipped)
    assert machine.tried[0].knobs() == informed.knobs()


def _staking(machine: Clocked) -> object:
    """Nothing before compiling gains (every eager plan at 100 samples/s), so a 40-s budget that may grow to 100 s
    over an 800-s training has found nothing to grow by, and no room for the 30-s compilation after three trials."""
    return search(machine, Plan(), settings(budget_s=40, budget_cap_s=100, training_s=800, planned_steps=100_000,
                                            supports={}, fused_available=False, verify=False), started=0.0)


def test_a_runs_compile_trial_is_staked_on_with_room_to_confirm_a_small_gain(clocked):
    # Compiled runs 10 % faster, under the 15 % that is confirmed (the incumbent measured again): 5 % of the
    # training (40 s) and a trial to confirm are staked on it, and the gain is confirmed and kept.
    machine = clocked(lambda p, stage: 38.0 if p.compile != "none" else 8.0)
    machine.speed = lambda p: 110.0 if p.compile != "none" else 100.0
    result = _staking(machine)
    [stake] = [d for d in result.decisions if "for torch.compile" in d]
    assert stake.startswith("budget: 40 -> ") and "5% of the 800 s training (a prediction) is staked" in stake
    [line] = [d for d in result.decisions if d.startswith("compile:")]
    assert result.plan.compile == "default" and "confirmed" in line, line
    assert 40 < machine.now <= result.budget_s <= 100, (machine.now, result.budget_s)


def test_what_a_stake_did_not_use_goes_back(monkeypatch):
    # A compilation that fails at once costs nothing of the stake: the budget is the 40 s it was.
    class Failing(Clocked):
        def model_trial(self, plan: Plan, stage: str, **kw) -> Trial:
            t = super().model_trial(plan, stage, **kw)
            if plan.compile != "none":
                t.status, t.error, t.samples_per_s = "failed", "no C++ compiler", None
            return t

    machine = Failing(lambda p, stage: 2.0 if p.compile != "none" else 8.0)
    machine.speed = lambda p: 100.0
    monkeypatch.setattr(importlib.import_module("saturate.tune.state"), "time",
                        SimpleNamespace(monotonic=lambda: machine.now))
    result = _staking(machine)
    assert any("for torch.compile" in d for d in result.decisions)
    assert result.plan.compile == "none" and result.budget_s == 40 and machine.now <= 40, (machine.now, result)


def test_nothing_is_staked_on_a_busy_machine(clocked):
    # The same search with its trials under load: the compilation has only the budget's room, and it is said.
    machine = clocked(lambda p, stage: 38.0 if p.compile != "none" else 8.0)
    machine.speed = lambda p: 110.0 if p.compile != "none" else 100.0
    model_trial = machine.model_trial

    def loaded(plan: Plan, stage: str, **kw) -> Trial:
        t = model_trial(plan, stage, **kw)
        t.contended, t.busy_cores = True, 1.0
        return t

    machine.model_trial = loaded
    result = _staking(machine)
    assert not any("for torch.compile" in d for d in result.decisions) and result.plan.compile == "none"
    assert any(s.startswith("torch.compile: no stake, other processes kept the machine busy") for s in result.skipped)
