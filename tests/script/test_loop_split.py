"""A hand-written loop's split of the effective batch: found where the script keeps it (child/split_source.py), set
there for a trial, and kept only when the child verified it trained as written (script/loop_split.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
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
    max_steps: int = 100  # how long it trains, beside its batch size (a compile's pay-back)


def hooked(overrides: Overrides = NONE) -> types.SimpleNamespace:
    script = types.SimpleNamespace(overrides=overrides, loaders={}, patches=Patches(), profile=False, profiler=None,
                                   samples=0, done=False, split_set=None, optimizer_steps=0,
                                   batch_rows=None)
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
                                "locals": {}, "flags": {}, "length": {"steps": {"cfg.max_steps": 100}, "epochs": {}}}


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
    t.same = {"same": "NOT_SEEN", "loss_drift": 0.005}  # nanoGPT's get_batch: no DataLoader, nothing fingerprinted
    assert split_verified(t) is None and t.note == ("verified: its settings took the values and the same effective "
                                                    "batch ran (no DataLoader: the samples not fingerprinted), its "
                                                    "first losses within 0.50 % of the script's own")
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


# nanoGPT's shape: no DataLoader, its split in module globals that `--name=value` flags set through its configurator
# (nanoGPT's configurator.py, its reading of sys.argv as written there, cut to the `--key=value` branch).
CONFIGURATOR = """
import sys
from ast import literal_eval
for arg in sys.argv[1:]:
    assert arg.startswith('--') and '=' in arg
    key, val = arg.split('=')
    key = key[2:]
    if key in globals():
        attempt = literal_eval(val)
        assert type(attempt) == type(globals()[key])
        globals()[key] = attempt
    else:
        raise ValueError(f"Unknown config key: {key}")
"""
NANOGPT_LOOP = """
import torch, torch.nn as nn
batch_size = 2
gradient_accumulation_steps = 8
max_iters = 400
exec(open('configurator.py').read())  # overrides from command line or config file
torch.manual_seed(0)
data = torch.randint(0, 64, (20000,))
def get_batch():
    i = torch.randint(0, len(data) - 17, (batch_size,))
    return torch.stack([data[j:j + 16] for j in i]), torch.stack([data[j + 1:j + 17] for j in i])
model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
X, Y = get_batch()
for it in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        loss = nn.functional.cross_entropy(model(X).view(-1, 64), Y.view(-1)) / gradient_accumulation_steps
        X, Y = get_batch()
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_a_configurator_scripts_split_is_found_in_its_globals(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(NANOGPT_LOOP)
    main = types.ModuleType("__main__")
    main.__file__ = str(tmp_path / "train.py")
    vars(main).update(batch_size=2, gradient_accumulation_steps=8, max_iters=400, eval_batches=3, n_layer=2)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert split_source.configurator() == {"micro": {"batch_size": 2, "eval_batches": 3},
                                           "accum": {"gradient_accumulation_steps": 8},
                                           "length": {"steps": {"max_iters": 400}, "epochs": {}}}
    assert split_source.flags_set({"batch_size": 2, "gradient_accumulation_steps": 8}, 2, 8) == dict.fromkeys(
        ("batch_size", "gradient_accumulation_steps", "the effective batch"), "set")
    held = split_source.flags_set({"batch_size": 16, "gradient_accumulation_steps": 2}, 2, 8)
    assert held["batch_size"].startswith("not set (the script holds 2 at its first optimizer step, not the "
                                         "--batch_size=16") and held["the effective batch"].startswith("not set")
    (tmp_path / "train.py").write_text(NANOGPT_LOOP.replace("exec(open('configurator.py').read())", "pass"))
    import linecache

    linecache.checkcache(str(tmp_path / "train.py"))
    assert split_source.configurator() is None  # globals alone are no command line to set them through


def test_a_configurator_scripts_split_is_tried_as_its_flags_and_handed_over_as_them():
    report = {"measurements": {"grad_accum": None}, "loaders": [], "world_size": 1,
              "configurator": {"micro": {"batch_size": 2, "eval_batches": 3},
                               "accum": {"gradient_accumulation_steps": 8}, "rows": 2, "backwards": 8}}
    loop = LoopSplit(report)
    assert loop.split() == (2, 8)
    over = loop.split_overrides(16, 1)
    assert over.flags == {"batch_size": 16, "gradient_accumulation_steps": 1} and not over.train_loader
    assert over.argv() == ["--batch_size=16", "--gradient_accumulation_steps=1"]
    assert Overrides.from_dict(over.to_dict()) == over
    tuning = types.SimpleNamespace(trainer=None, lightning=None, loaders=[], optimizer=None,
                                   best=types.SimpleNamespace(overrides=over))
    assert edits(tuning) == ["on its command line: --batch_size=16 --gradient_accumulation_steps=1 (after its own "
                             "flags: the last of each wins)"]
    assert LoopSplit({**report, "world_size": 2}).split().startswith("not tried (a command of 2 processes")
    one = {**report, "configurator": {**report["configurator"], "backwards": 1}}
    assert LoopSplit(one).split() == NO_ACCUMULATION
    two = {**report, "configurator": {**report["configurator"], "micro": {"batch_size": 2, "micro_bs": 2}}}
    assert LoopSplit(two).split().startswith("not tried (the loop ran micro-batches of 2 and 8 backward passes")


def test_the_flags_a_script_parses_from_its_command_line_are_named_and_checked(monkeypatch):
    monkeypatch.setattr(split_source, "PARSED", {})
    monkeypatch.setattr(sys, "argv", ["train.py", "--per_device_train_batch_size", "2", "--max_train_steps=50"])
    script = hooked()
    try:
        parser = argparse.ArgumentParser()
        parser.add_argument("--per_device_train_batch_size", type=int, default=8)
        parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
        parser.add_argument("--max_train_steps", type=int)
        parser.add_argument("--num_warmup_steps", type=int, default=0)
        parser.add_argument("--lr", type=float, default=1e-3)
        parser.parse_args(["--per_device_train_batch_size", "99"])  # a list of its own: not the command line
        assert split_source.parsed() is None
        parser.parse_args()
    finally:
        script.patches.detach()
    assert split_source.parsed() == {"micro": {"per_device_train_batch_size": 2},
                                     "accum": {"gradient-accumulation-steps": 4},
                                     "length": {"steps": {"--max_train_steps": 50}, "epochs": {}}}
    asked = {"per_device_train_batch_size": 2, "gradient-accumulation-steps": 4}
    assert set(split_source.flags_set(asked, 2, 4).values()) == {"set"}
    held = split_source.flags_set({**asked, "per_device_train_batch_size": 8}, 2, 4)
    assert held["per_device_train_batch_size"].startswith("not set (the script holds 2 at its first optimizer step")


def test_a_split_in_argparse_flags_is_tried_as_them_before_the_loaders_names():
    # accelerate's prepared loader is not the script's: no batch_size= of its own fed the steps
    report = {"measurements": {"grad_accum": 8}, "world_size": 1,
              "loaders": [{"batch_size": 1, "sets_batch_size": False, "site": None}],
              "argparse": {"micro": {"per_device_train_batch_size": 1, "per_device_eval_batch_size": 8},
                           "accum": {"gradient_accumulation_steps": 8}, "rows": 1, "backwards": 8}}
    loop = LoopSplit(report)
    assert loop.split() == (1, 8)
    over = loop.split_overrides(8, 1)
    assert over.argv() == ["--per_device_train_batch_size=8", "--gradient_accumulation_steps=1"]
    tuning = types.SimpleNamespace(best=types.SimpleNamespace(overrides=over), loaders=[], optimizer=None)
    from saturate.script.patch_edit import tuned_patch

    assert tuned_patch(tuning).left == ["on its command line: --per_device_train_batch_size=8 "
                                        "--gradient_accumulation_steps=1 (flags, not a file's text)"]
    from saturate.doctor.findings import Fix, Prediction
    from saturate.script.doctor_script import in_your_script

    fix = Fix("micro-batch 1 → 8, accumulation 8 → 1", {"micro_batch": 8, "grad_accum": 1},
              Prediction("step_s", 1.0, 0.5, "test"), "")
    assert in_your_script(fix, report, "cpu") == ["on its command line: --per_device_train_batch_size=8 "
                                                  "--gradient_accumulation_steps=1 (the flags that hold its split)"]
    # where no one flag of each holds the run's split, the DataLoader's own names are looked at
    two = {**report, "argparse": {**report["argparse"], "accum": {}}}
    assert LoopSplit(two).split() == "not tried (no training DataLoader with a batch_size= of its own fed the " \
                                     "timed steps)"


@pytest.mark.parametrize("flags", [{"x": 0}, {"-x": 2}, {"x y": 2}, {"x": True}, ["x"]])
def test_overrides_refuse_a_bad_command_line_flag(flags):
    with pytest.raises(ConfigError, match="command-line flags"):
        Overrides(flags=flags)


@pytest.mark.slow
def test_a_configurator_scripts_flags_reach_its_globals_and_keep_its_effective_batch(tmp_path, monkeypatch):
    from saturate.script.boundary import ChildSettings
    from saturate.script.command import run_instrumented

    (tmp_path / "train.py").write_text(NANOGPT_LOOP)
    (tmp_path / "configurator.py").write_text(CONFIGURATOR)
    monkeypatch.chdir(tmp_path)
    command = ["python", "train.py", "--max_iters=60"]
    written = run_instrumented(command, ChildSettings(mode="trial", warmup=1, count_steps=0, steps=2),
                               quiet_stdout=True).report
    assert written["configurator"] == {"micro": {"batch_size": 2}, "accum": {"gradient_accumulation_steps": 8},
                                       "length": {"steps": {"max_iters": 60}, "epochs": {}},
                                       "rows": 2, "backwards": 8} and written["split_set"] is None
    loop = LoopSplit(written)
    assert loop.split() == (2, 8)
    over = loop.split_overrides(8, 2)
    trial = run_instrumented(command, ChildSettings(mode="trial", warmup=1, count_steps=0, steps=2, overrides=over),
                             quiet_stdout=True).report
    assert trial["split_set"] == dict.fromkeys(("batch_size", "gradient_accumulation_steps", "the effective batch"),
                                               "set")
    assert trial["configurator"]["rows"] == 8 and trial["configurator"]["backwards"] == 2
    a, b = written["loop"]["losses"], trial["loop"]["losses"]  # the same samples drawn, in 8 x 2 as in 2 x 8
    assert len(a) >= 3 and b[:3] == pytest.approx(a[:3], rel=1e-5)


ACCELERATE_LOOP = """
import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--per_device_train_batch_size", type=int, default=1)
parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
parser.add_argument("--max_train_steps", type=int, default=40)
args = parser.parse_args()
# the accumulation is read here, before the DataLoader is made, and the loader feeding the steps is accelerate's
accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=True)
torch.manual_seed(0)
data = TensorDataset(torch.randn(1024, 8), torch.randn(1024, 1))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(data, batch_size=args.per_device_train_batch_size, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
model, opt, loader = accelerator.prepare(model, opt, loader)
step = 0
for x, y in loader:
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(input=x), y))  # keywords only, as model(**batch)
        opt.step()
        opt.zero_grad()
    step += accelerator.sync_gradients
    if step == args.max_train_steps:
        break
"""


@pytest.mark.slow
def test_a_split_in_argparse_flags_read_before_the_loader_is_made_is_tried_as_its_flags(tmp_path, monkeypatch):
    """run_clm_no_trainer's shape: `Accelerator(gradient_accumulation_steps=args...)` before the DataLoader, and
    accelerate's prepared loader feeding the steps; the flags appended reach it, at the same effective batch."""
    pytest.importorskip("accelerate")
    from saturate.script.boundary import ChildSettings
    from saturate.script.command import run_instrumented
    from saturate.script.compile_stage import planned_steps

    (tmp_path / "train.py").write_text(ACCELERATE_LOOP)
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "train.py", "--per_device_train_batch_size", "1"]
    settings = ChildSettings(mode="trial", warmup=1, count_steps=0, steps=2)
    written = run_instrumented(command, settings, quiet_stdout=True).report
    assert written["argparse"] == {"micro": {"per_device_train_batch_size": 1},
                                   "accum": {"gradient_accumulation_steps": 8},
                                   "length": {"steps": {"--max_train_steps": 40}, "epochs": {}},
                                   "rows": 1, "backwards": 8}
    assert planned_steps(written) == (40, "--max_train_steps = 40")
    loop = LoopSplit(written)
    assert loop.split() == (1, 8)
    over = loop.split_overrides(4, 2)
    trial = run_instrumented(command, dataclasses.replace(settings, overrides=over), quiet_stdout=True).report
    assert trial["split_set"] == dict.fromkeys(
        ("per_device_train_batch_size", "gradient_accumulation_steps", "the effective batch"), "set")
    assert trial["argparse"]["rows"] == 4 and trial["argparse"]["backwards"] == 2
    a, b = written["loop"]["losses"], trial["loop"]["losses"]  # the same samples, in 4 x 2 as in 1 x 8
    assert len(a) >= 3 and b[:3] == pytest.approx(a[:3], rel=1e-5)
