"""A plain loop's model compiled from outside: how long the script trains read where it keeps it, the compile tried
only where that length can pay it back, kept only when it does (script/compile_stage.py, child/loop_compile.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from saturate.doctor.loop_facts import is_compiled
from saturate.errors import ConfigError
from saturate.script.child.loop_compile import LoopCompile
from saturate.script.compile_stage import planned_steps
from saturate.script.overrides import Overrides


def report(length: dict | None = None, batches: int | None = 100, accum: int = 4, configurator: bool = False) -> dict:
    length = length or {"steps": {}, "epochs": {}}
    loader = {"site": "train.py:9", "batch_size": 8, "batches_per_epoch": batches,
              "split": {"micro": "cfg.batch_size", "length": length}}
    if configurator:
        return {"measurements": {"grad_accum": accum}, "loaders": [], "configurator": {"length": length}}
    return {"measurements": {"grad_accum": accum}, "loaders": [loader]}


def test_the_planned_steps_are_read_where_the_script_keeps_them():
    assert planned_steps(report({"steps": {"cfg.max_steps": 5000}, "epochs": {}})) == (5000, "cfg.max_steps = 5000")
    assert planned_steps(report({"steps": {"max_iters": 600}, "epochs": {}}, configurator=True)) == (
        600, "max_iters = 600")
    # epochs: one pass over the loader's 100 batches at 4 micro-batches a step is 25 optimizer steps
    assert planned_steps(report({"steps": {}, "epochs": {"args.epochs": 3}})) == (
        75, "args.epochs = 3 epochs of 25 optimizer steps")
    assert planned_steps(report({"steps": {}, "epochs": {"args.epochs": 3}}, batches=None)) == (
        "args.epochs = 3 epochs of a training loader with no length (a stream)")
    both = planned_steps(report({"steps": {"args.max_steps": 10, "args.num_steps": 20}, "epochs": {}}))
    assert both == "the names that say how long it trains do not give one length: args.max_steps = 10, " \
                   "args.num_steps = 20"
    assert planned_steps(report()).startswith("no setting beside its batch size or flag says how long it trains")


def test_the_names_that_say_how_long_a_script_trains():
    from saturate.script.child.split_source import length

    names = {"cfg.max_steps": 100, "max_iters": 5, "eval_iters": 200, "warmup_iters": 10, "epochs": 3,
             "args.num_epochs": 2, "lr_decay_iters": 5000, "steps": True, "n_steps": 0, "iterations": 7}
    assert length(names) == {"steps": {"cfg.max_steps": 100, "max_iters": 5, "iterations": 7},
                             "epochs": {"epochs": 3, "args.num_epochs": 2}}


def test_a_model_compiled_in_any_of_the_three_ways_is_seen_as_compiled():
    plain = nn.Linear(2, 2)
    assert not is_compiled(plain)
    assert is_compiled(torch.compile(nn.Linear(2, 2)))  # compiling is lazy: nothing is compiled until called
    in_place = nn.Linear(2, 2)
    in_place.compile()
    assert is_compiled(in_place)
    forward = nn.Linear(2, 2)
    forward.forward = torch.compile(forward.forward)
    assert is_compiled(forward)


def test_a_compile_asked_for_is_not_applied_where_it_cannot_be_and_says_why():
    assert LoopCompile(None, 1).report() is None  # not asked: nothing said
    for model, world, why in ((None, 1, "no model owning the optimizer's parameters was called"),
                              (nn.Linear(2, 2), 2, "not with 2 processes"),
                              (torch.compile(nn.Linear(2, 2)), 1, "the script compiles its model itself")):
        c = LoopCompile("default", world)
        c.apply(model)
        assert c.report() == {"mode": "default", "applied": False, "why": why, "compile_step_s": None}
    c = LoopCompile("default", 1)
    model = nn.Linear(2, 2)
    c.apply(model)
    c.end_step()  # the first optimizer step after compiling closes its time
    assert c.applied and is_compiled(model) and c.compile_step_s is not None and c.compile_step_s >= 0


@pytest.mark.parametrize("mode", ["fast", 1, ""])
def test_overrides_refuse_a_compile_mode_torch_does_not_have(mode):
    with pytest.raises(ConfigError, match="\"compile\" must be one of default, reduce-overhead, max-autotune"):
        Overrides(compile=mode)
    assert Overrides.from_dict({"compile": "max-autotune"}).to_dict() == {"compile": "max-autotune"}
    assert Overrides(threads=1).merged(Overrides(compile="default")).compile == "default"


class CompileMachine:
    """A loop whose compiled model steps `faster` times as fast, its compilation taking `compile_s`; `length`: what
    names say how long it trains."""

    def __init__(self, length: dict | None, faster: float = 1.5, compile_s: float = 3.0, applied: bool = True,
                 forward: float | None = None) -> None:
        self.length, self.faster, self.compile_s, self.applied = length, faster, compile_s, applied
        self.forward = forward  # the as-written forward's share of the step (None: not split into phases)
        self.compiled_trials = 0
        self.limits: list[float | None] = []  # each trial's time limit (None: none)

    def __call__(self, command, settings, **kw):
        from saturate.script.command import ScriptRun

        compiled = settings.overrides.compile is not None
        self.compiled_trials += compiled
        self.limits.append(kw.get("timeout"))
        if compiled and kw.get("timeout") is not None and self.compile_s > kw["timeout"]:
            from saturate.script.command import ScriptFailed

            raise ScriptFailed(f"the script did not finish its measured steps within {kw['timeout']:.0f} s; it was "
                               "stopped", timed_out=True)  # as Child.check stops a run past its limit
        rate = 10.0 * (self.faster if compiled and self.applied else 1.0)
        phases = {"data": 0.0} if self.forward is None else {"data": 1 / rate - self.forward / rate,
                                                             "forward": self.forward / rate, "backward": 0.0}
        out = {"measurements": {"step_s": 1 / rate, "samples_per_step": 32, "grad_accum": 4,
                                "phases": phases, "steps": 10, "device_type": "cpu"},
               "loaders": [{"site": "train.py:40", "batch_size": 8, "num_workers": 0, "batches": 20,
                            "batches_per_epoch": 400, "split": {"micro": "cfg.batch_size", "flags": {}, "accum": {},
                                                                "locals": {}, "length": self.length}}],
               "model": {"class": "Net", "wrapped_in": [], "compiled": False, "parameters": 10},
               "optimizer": {"class": "SGD", "site": "train.py:42"}, "first_step_s": 1.0,
               "loop": {"losses": [2.0, 1.9, 1.8]},
               "windows": {"rates": [rate * 0.99, rate * 1.01, rate], "steps": 15, "busy": False}}
        if compiled:
            out["compile"] = {"mode": "default", "applied": self.applied, "compile_step_s": self.compile_s + 1 / rate,
                              "why": None if self.applied else "the script compiles its model itself"}
        return ScriptRun(list(command), 0, out, None, 30, 1.0)


def tuned(machine: CompileMachine):
    from saturate.script.tune_script import tune_command

    return tune_command(["python", "train.py"], runner=machine, supports={"bf16": False})


def test_a_loop_is_compiled_from_outside_where_its_planned_steps_pay_the_compilation_back():
    tuning = tuned(CompileMachine({"steps": {"cfg.max_steps": 5000}, "epochs": {}}))
    assert tuning.best.overrides.compile == "default" and tuning.best.name == "torch.compile"
    # 0.1 s a step as written, 0.0667 compiled: 3 s of compilation back after 90 steps
    assert "its 3.0 s compilation paid back after 90 of the 5000 planned steps (cfg.max_steps = 5000)" in \
           tuning.best.outcome
    assert any(e.startswith("after building the model: model.compile() (in place") for e in tuning.to_dict()["edits"])


@pytest.mark.parametrize("length, said", [
    ({"steps": {"cfg.max_steps": 50}, "epochs": {}},  # 50 steps save 1.7 s, under the 3 s compilation
     "compile: torch.compile not kept: 50.0 % faster a step, but the 50 planned steps (cfg.max_steps = 50) would "
     "save 1.7 s at 33.33 ms a step, less than the 3.0 s its compilation cost"),
    ({"steps": {}, "epochs": {}},
     "compile: not tried (no setting beside its batch size or flag says how long it trains (max_steps, max_iters, "
     "epochs): a compilation pays back only over a length saturate knows)"),
    ({"steps": {"cfg.max_steps": 20}, "epochs": {}},  # 20 steps of 0.1 s: 2 s of training, under the least compile
     "compile: not tried (the 20 planned steps (cfg.max_steps = 20) take about 2.0 s at the best speed so far, less "
     "than the 5 s a compilation costs at the least)"),
])
def test_a_compile_that_cannot_pay_back_is_not_kept_or_not_tried(length, said):
    machine = CompileMachine(length)
    tuning = tuned(machine)
    assert tuning.best is tuning.baseline and said in tuning.decisions, tuning.decisions
    assert machine.compiled_trials == (1 if "not kept" in said else 0)


def test_a_compilation_running_past_what_the_planned_training_takes_is_stopped_there():
    # 500 planned steps of 0.1 s: a compilation still running after ~50 s (the best run's first step, the planned and
    # the trial's own steps, and its windows) cannot pay back; the fake one takes 600 s
    machine = CompileMachine({"steps": {"cfg.max_steps": 500}, "epochs": {}}, compile_s=600.0)
    tuning = tuned(machine)
    limit = next(x for x in machine.limits if x is not None)
    assert limit < 600 and machine.limits.count(None) == len(machine.limits) - 1  # only the compile trial is bounded
    compiled = next(t for t in tuning.trials if t.name == "torch.compile")
    assert tuning.best is tuning.baseline and compiled.timed_out and not compiled.ok
    line = next(d for d in tuning.decisions if d.startswith("compile: "))
    assert f"stopped at {limit:.0f} s, the 500 planned steps (cfg.max_steps = 500)" in line, line


def test_a_compile_not_measured_faster_is_not_kept_for_that_not_for_its_pay_back():
    tuning = tuned(CompileMachine({"steps": {"cfg.max_steps": 500}, "epochs": {}}, faster=1.01))
    compiled = next(t for t in tuning.trials if t.name == "torch.compile")
    assert tuning.best is tuning.baseline and compiled.verdict != "faster"
    assert compiled.outcome.startswith("not kept: +1.0 %") and "planned steps" not in compiled.outcome


def test_a_loop_whose_forward_and_backward_are_a_sliver_of_its_step_gets_no_compile_trial():
    machine = CompileMachine({"steps": {"cfg.max_steps": 5000}, "epochs": {}}, forward=0.004)
    tuning = tuned(machine)
    assert machine.compiled_trials == 0
    assert "compile: not tried (forward and backward take 0.4 % of the step (measured as written): a compiled model " \
           "can gain at most 0.4 %, under 50% of the 3 % a change must gain)" in tuning.decisions, tuning.decisions


def test_no_compile_tries_none():
    from saturate.script.tune_script import tune_command

    machine = CompileMachine({"steps": {"cfg.max_steps": 5000}, "epochs": {}})
    tuning = tune_command(["python", "train.py"], runner=machine, supports={"bf16": False}, try_compile=False)
    assert machine.compiled_trials == 0 and "compile: not tried (--no-compile)" in tuning.decisions


def test_a_model_that_could_not_be_compiled_is_a_failed_trial():
    tuning = tuned(CompileMachine({"steps": {"cfg.max_steps": 5000}, "epochs": {}}, applied=False))
    assert tuning.best is tuning.baseline
    assert "compile: torch.compile failed: its model could not be compiled from outside (the script compiles its " \
           "model itself)" in tuning.decisions, tuning.decisions


# A plain loop whose length sits beside its batch size; it saves its weights, so what it saves can be read back.
LOOP = """
import dataclasses, json, sys, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

@dataclasses.dataclass
class Config:
    batch_size: int = 8
    max_steps: int = 400

torch.manual_seed(0)
cfg = Config()
loader = DataLoader(TensorDataset(torch.randn(512, 16), torch.randn(512, 1)), batch_size=cfg.batch_size)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while step < cfg.max_steps:
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            with open("keys.json", "w") as f:
                json.dump(list(model.state_dict()), f)
"""


@pytest.mark.slow
def test_the_childs_compile_runs_the_model_compiled_keeps_its_keys_and_its_losses(tmp_path, monkeypatch,
                                                                                  request):
    from saturate.script.boundary import ChildSettings
    from saturate.script.command import run_instrumented

    (tmp_path / "loop.py").write_text(LOOP)
    monkeypatch.chdir(tmp_path)
    from saturate.script.isolation import unavailable

    monkeypatch.setenv("SATURATE_ISOLATION", "off")  # what a trial writes reaches the folder: its saved keys
    unavailable.cache_clear()  # read once a process: the suite's earlier tests read it with isolation on
    request.addfinalizer(unavailable.cache_clear)
    command = [sys.executable, "loop.py"]
    runs = {}
    for name, over in (("eager", Overrides()), ("compiled", Overrides(compile="default"))):
        runs[name] = run_instrumented(command, ChildSettings(mode="trial", warmup=2, count_steps=0, steps=3,
                                                             overrides=over), quiet_stdout=True).report
        assert json.loads((tmp_path / "keys.json").read_text()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    eager, compiled = runs["eager"], runs["compiled"]
    assert eager["compile"] is None and eager["model"]["compiled"] is False
    c = compiled["compile"]
    assert c["applied"] is True and c["why"] is None and c["compile_step_s"] > compiled["measurements"]["step_s"]
    assert compiled["loaders"][0]["split"]["length"] == {"steps": {"cfg.max_steps": 400}, "epochs": {}}
    assert compiled["loaders"][0]["batches_per_epoch"] == 64
    losses = eager["loop"]["losses"], compiled["loop"]["losses"]
    assert len(losses[0]) >= 3 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses, strict=False))
