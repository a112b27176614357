"""A hand-written loop's split of the effective batch: found where the script keeps it (child/split_source.py), set
there for a trial, and kept only when the child verified it trained as written (script/loop_split.py)."""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from saturate.errors import ConfigError
from saturate.script.child import loader_hooks, split_source
from saturate.script.child.found import caller_site
from saturate.script.child.patches import Patches
from saturate.script.loop_split import NO_ACCUMULATION, LoopSplit, split_verified
from saturate.script.overrides import NONE, Overrides
from saturate.script.script_trial import ScriptTrial
from saturate.script.tuning import edits, split_edit

DATA = TensorDataset(torch.zeros(64, 2))
BATCH, GRAD_ACCUM_STEPS = 4, 8  # a loop's split as module constants


@dataclasses.dataclass
class Config:
    batch_size: int = 4
    grad_accum: int = 8


def hooked(overrides: Overrides = NONE) -> types.SimpleNamespace:
    script = types.SimpleNamespace(overrides=overrides, loaders={}, patches=Patches(), profile=False, profiler=None,
                                   samples=0, done=False, split_set=None)
    loader_hooks.install(script)
    split_source.install(script.patches)
    return script


def split_of(script: types.SimpleNamespace) -> dict:
    return next(iter(script.loaders.values()))["split"]


def test_the_split_is_found_in_a_config_object_beside_the_loaders_batch_size():
    script = hooked()
    try:
        cfg = Config()
        DataLoader(DATA, batch_size=cfg.batch_size)
    finally:
        script.patches.detach()
    assert split_of(script) == {"micro": "cfg.batch_size", "micro_value": 4, "accum": {"cfg.grad_accum": 8},
                                "locals": {}, "flags": {}}


def test_the_split_is_found_in_an_argparse_namespace_with_its_flags():
    script = hooked()
    try:
        parser = argparse.ArgumentParser()
        parser.add_argument("--batch-size", type=int, default=4)
        parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
        args = parser.parse_args([])
        DataLoader(DATA, batch_size=args.batch_size,
                   shuffle=False)
    finally:
        script.patches.detach()
    split = split_of(script)
    assert split["micro"] == "args.batch_size" and split["accum"] == {"args.gradient_accumulation_steps": 8}
    assert split["flags"] == {"args.batch_size": "--batch-size",
                              "args.gradient_accumulation_steps": "--gradient_accumulation_steps"}


def make_from_constants() -> DataLoader:
    grad_accum = 8  # a local: named, not tunable
    del grad_accum
    accum_here = 2
    return DataLoader(DATA, batch_size=BATCH), accum_here


def test_module_constants_are_found_and_a_functions_locals_named_apart():
    script = hooked()
    try:
        make_from_constants()
    finally:
        script.patches.detach()
    split = split_of(script)
    assert split["micro"] == "BATCH" and split["accum"]["GRAD_ACCUM_STEPS"] == 8 and split["locals"] == {
        "accum_here": 2}


def test_a_trial_sets_the_split_where_the_loop_keeps_it_just_before_its_loader_is_made():
    global BATCH, GRAD_ACCUM_STEPS
    cfg = Config()
    site = f"{caller_site().rsplit(':', 1)[0]}:{make_loader.__code__.co_firstlineno + 2}"
    over = Overrides(train_loader={"site": site, "batch_size": 16, "set": {"cfg.batch_size": 16, "cfg.grad_accum": 2,
                                                                           "GRAD_ACCUM_STEPS": 2}})
    script = hooked(over)
    try:
        loader = make_loader(cfg)
    finally:
        script.patches.detach()
        kept, GRAD_ACCUM_STEPS = GRAD_ACCUM_STEPS, 8
    assert loader.batch_size == 16 and (cfg.batch_size, cfg.grad_accum) == (16, 2) and kept == 2
    assert script.split_set == {"cfg.batch_size": "set", "cfg.grad_accum": "set", "GRAD_ACCUM_STEPS": "set"}


def make_loader(cfg: Config) -> DataLoader:
    accum = cfg.grad_accum  # noqa: F841  (read before the loader: a trial cannot reach this copy)
    return DataLoader(DATA, batch_size=cfg.batch_size)


def loop(split: dict, accum: float, batch_size: int = 4) -> LoopSplit:
    return LoopSplit({"loaders": [{"site": "train.py:40", "batch_size": batch_size, "split": split}],
                      "measurements": {"grad_accum": accum}})


def test_the_accumulation_is_the_setting_whose_value_the_run_showed():
    split = {"micro": "cfg.batch_size", "accum": {"cfg.grad_accum": 8, "EVAL_ACCUM": 2}, "locals": {}}
    found = loop(split, 8.0)
    assert found.split() == (4, 8)
    assert found.split_overrides(32, 1) == Overrides(train_loader={
        "site": "train.py:40", "batch_size": 32, "set": {"cfg.grad_accum": 1, "cfg.batch_size": 32}})
    assert loop(split, 1.0).split() == NO_ACCUMULATION
    local = loop({"micro": None, "accum": {}, "locals": {"accum": 8}}, 8.0).split()
    assert local.startswith("not tried (the loop accumulates 8 micro-batches a step, and no one setting") and \
        "accum (a local variable) = 8" in local
    assert "could not be read" in loop({}, 8.0).split()


def test_a_split_is_kept_only_when_set_and_its_losses_compared():
    t = ScriptTrial("micro-batch 32 × 1", Overrides(), 0.1, None, 0.0, 10, split_set={"cfg.grad_accum": "set"},
                    same={"same": "SAME", "loss_drift": 1e-7})
    assert split_verified(t) is None and t.note.startswith("verified: the same samples per step, in the same order")
    t.same = {"same": "SAME", "loss_drift": None}
    assert "could not be compared" in split_verified(t)
    t.split_set = {"accum": "not set (a function's local variable, which cannot be changed from outside)"}
    assert split_verified(t).startswith("its split could not be set where the loop keeps it: accum: not set")


def test_the_split_edit_names_the_settings_and_an_argparse_namespaces_flags():
    train = {"site": "train.py:40", "batch_size": 32, "set": {"args.batch_size": 32, "args.grad_accum": 1}}
    assert split_edit(train, {"flags": {"args.batch_size": "--batch_size", "args.grad_accum": "--grad_accum"}}) == (
        "train.py:40: the split where the loop keeps it: args.batch_size = 32, args.grad_accum = 1 (on its command "
        "line: --batch_size 32 --grad_accum 1)")
    assert split_edit({**train, "set": {"cfg.batch_size": 32}}, {}) == (
        "train.py:40: the split where the loop keeps it: cfg.batch_size = 32")


@pytest.mark.parametrize("names", [{"a.b.c": 2}, {"x": 0}, {"x": True}, ["x"]])
def test_overrides_refuse_a_bad_name_or_value_to_set(names):
    with pytest.raises(ConfigError, match="maps names"):
        Overrides(train_loader={"site": "train.py:1", "batch_size": 4, "set": names})


class SplitMachine:
    """A loop of micro-batch 4 × accumulation 8 over 8 distinct samples a micro-batch, faster the larger its
    micro-batch; `stale`: it read its accumulation before its loader was made (a trial's samples per step then
    grow with the micro-batch); `drift`: a trial's losses off by this share."""

    def __init__(self, stale: bool = False, drift: float = 0.0) -> None:
        self.stale, self.drift = stale, drift

    def __call__(self, command, settings, **kw):
        from saturate.script.command import ScriptRun

        train = settings.overrides.train_loader
        micro = train.get("batch_size", 4)
        accum = 8 if self.stale else train.get("set", {}).get("cfg.grad_accum", 8)
        digests = [f"s{i}" for i in range(64)]
        fingerprint = {"indices": list(range(64)), "sizes": [micro] * (64 // micro), "epoch": None,
                       "digests": [digests[i:i + micro] for i in range(0, 64, micro)]}
        off = self.drift if train else 0.0
        rate = 10.0 * micro / 4
        report = {"measurements": {"step_s": 1 / rate, "samples_per_step": micro * accum, "grad_accum": accum,
                                   "phases": {"data": 0.0}, "steps": 10, "device_type": "cpu"},
                  "loaders": [{"site": "train.py:40", "batch_size": micro, "num_workers": 0, "batches": 20,
                               "fingerprint": fingerprint, "split": {"micro": "cfg.batch_size", "flags": {},
                                                                     "accum": {"cfg.grad_accum": 8}, "locals": {}}}],
                  "optimizer": {"class": "SGD", "site": "train.py:42"}, "first_step_s": 1.0,
                  "loop": {"losses": [2.0 * (1 + off), 1.9, 1.8]},
                  "split_set": {k: "set" for k in train.get("set", {})},
                  "windows": {"rates": [rate * 0.99, rate * 1.01, rate], "steps": 15, "busy": False}}
        return ScriptRun(list(command), 0, report, None, 30, 1.0)


def test_a_loops_split_is_climbed_at_the_same_effective_batch_and_verified():
    from saturate.script.tune_script import tune_command

    tuning = tune_command(["python", "train.py"], runner=SplitMachine(), supports={"bf16": False})
    assert tuning.best.name == "micro-batch 32 × 1" and tuning.best.overrides.train_loader["set"] == {
        "cfg.grad_accum": 1, "cfg.batch_size": 32}
    assert tuning.trials[1].name == "again: as written" and tuning.loss_noise == 0.0  # alone: its losses repeat
    assert "verified: the same samples per step, in the same order" in tuning.best.outcome
    assert "micro-batch: 32 × accumulation 1 (as written 4 × 8; the effective batch 32 kept; tried: 8 × 4, 16 × 2, " \
           "32 × 1)" in tuning.decisions


@pytest.mark.parametrize("machine, said", [
    (SplitMachine(stale=True), "it changes the training: other samples per optimizer step ("),
    (SplitMachine(drift=0.05), "its first 3 losses differ from the script's own by up to 5.0 %"),
])
def test_a_split_that_changes_the_batch_or_the_losses_is_never_kept(machine, said):
    from saturate.script.tune_script import tune_command

    tuning = tune_command(["python", "train.py"], runner=machine, supports={"bf16": False})
    assert tuning.best is tuning.baseline
    split = [t for t in tuning.trials if t.name.startswith("micro-batch")]
    assert split and all(said in t.outcome and t.outcome.startswith("not kept") for t in split)
    assert len(split) == (1 if machine.stale else 2)  # a split that did not reach the loop: no other is tried


# A loop whose split sits in a config dataclass's defaults, read where the loop uses it (guide 1's shape).
CONFIG_LOOP = """
import dataclasses, sys, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

@dataclasses.dataclass
class Config:
    batch_size: int = 2
    grad_accum: int = 16

torch.manual_seed(0)
cfg = Config()
data = TensorDataset(torch.randn(8192, 32), torch.randn(8192, 1))
loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = iter(loader)
for step in range(int(sys.argv[1])):
    for _ in range(cfg.grad_accum):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y) / cfg.grad_accum
        loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_tune_finds_a_loops_faster_split_in_its_config_at_the_same_effective_batch(tmp_path, monkeypatch):
    from saturate.script.command import run_instrumented
    from saturate.script.tune_script import tune_command, window_rule

    (tmp_path / "loop.py").write_text(CONFIG_LOOP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tuning = tune_command(["python", "loop.py", "250"], steps=2, runner=run_instrumented, quiet_stdout=True,
                          rule=window_rule(max_seconds=1.0), window_s=0.2, supports={"bf16": False})
    splits = [t for t in tuning.trials if t.name.startswith("micro-batch")]
    assert splits and all(t.samples_per_step == tuning.baseline.samples_per_step == 32 for t in splits)
    verified = [t for t in splits if t.same["same"] == "SAME" and (t.same.get("loss_drift") or 1.0) < 1e-4]
    assert verified and all(t.split_set == {"cfg.grad_accum": "set", "cfg.batch_size": "set"} for t in splits)
    if best := tuning.best.overrides.train_loader:  # kept where it measured faster (on a loaded machine it may not)
        from conftest import line_of

        assert best["set"] == {"cfg.grad_accum": 32 // best["batch_size"], "cfg.batch_size": best["batch_size"]}
        at = line_of(tmp_path / "loop.py", "DataLoader(")
        assert any(e.startswith(f"{at}: the split where the loop keeps it: ") for e in edits(tuning))
