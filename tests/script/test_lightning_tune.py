"""`saturate tune -- CMD` and `run -- CMD` for a Lightning `Trainer`: the shared trainer stages through the
Lightning adapter on a fake machine (every decision, no script run), the overrides applied inside a real
Lightning script (Trainer arguments, the training DataLoader's batch size, fused AdamW), overrides files
checked, and (slow) tune and run end to end on `examples/scripts/lightning_fit`."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import cli_env, run_main, saturate_cmd
from saturate.errors import ConfigError
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun, run_instrumented
from saturate.script.overrides import Overrides
from saturate.script.tune_script import tune_command
from saturate.script.tuning import ScriptTuning, edits

SCRIPT = Path(__file__).parents[2] / "examples" / "scripts" / "lightning_fit" / "train.py"
LOSSES = [0.5, 0.45, 0.41, 0.4, 0.38]


class FakeLightning:
    """A Lightning script as written with DataLoader batch 4 × accumulate_grad_batches 8: larger micro-batches
    are faster per sample; bf16-mixed saves a share and drifts its losses by `bf16_drift`; fused AdamW saves 10 %."""

    def __init__(self, device: str = "cpu", bf16_drift: float = 0.001, optimizer: str = "AdamW",
                 loader: dict[str, Any] | None = None, automatic: bool = True) -> None:
        self.device, self.bf16_drift, self.optimizer, self.automatic = device, bf16_drift, optimizer, automatic
        self.loader = {"site": "train.py:49", "batch_size": 4, "sets_batch_size": True, **(loader or {})}
        self.runs: list[dict[str, Any]] = []

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        over = settings.overrides.to_dict()
        self.runs.append(over)
        micro = (over.get("train_loader") or {}).get("batch_size", self.loader["batch_size"])
        accum = (over.get("lightning") or {}).get("accumulate_grad_batches", 8)
        step = accum * (0.01 + 0.002 * micro)
        losses = list(LOSSES)
        if (over.get("lightning") or {}).get("precision") == "bf16-mixed":
            step *= 0.7
            losses = [x * (1 + self.bf16_drift) for x in losses]
        if (over.get("optimizer") or {}).get("fused"):
            step *= 0.9
        report = {"measurements": {"step_s": step, "samples_per_step": micro * accum, "phases": {"data": 0.0},
                                   "steps": 3, "device_type": self.device},
                  "loaders": [self.loader], "first_step_s": 5.0,
                  "optimizer": {"class": self.optimizer, "site": "train.py:66", "fused": None},
                  "lightning": {"class": "Trainer", "site": "train.py:78", "args": {
                      "precision": None, "accumulate_grad_batches": 8, "max_steps": 300},
                      "automatic_optimization": self.automatic, "planned_steps": 300, "losses": losses}}
        return ScriptRun(list(command), 0, report, None, 5, 1.0)


def tune(machine: FakeLightning) -> ScriptTuning:
    return tune_command(["python", "train.py"], runner=machine, supports={"bf16": True})


def test_the_split_climbs_at_the_same_effective_batch_through_the_loader_batch_size_and_the_trainer():
    tuning = tune(FakeLightning())
    splits = [(t.overrides.train_loader["batch_size"], t.overrides.lightning["accumulate_grad_batches"])
              for t in tuning.trials if t.name.startswith("micro-batch")]
    assert splits == [(8, 4), (16, 2), (32, 1)] and all(t.samples_per_step == 32 for t in tuning.trials)
    best = tuning.best.overrides
    assert best.train_loader == {"site": "train.py:49", "batch_size": 32}
    assert best.lightning["accumulate_grad_batches"] == 1
    assert "micro-batch: 32 × accumulation 1 (as written 4 × 8; the effective batch 32 kept; tried: 8 × 4, " \
           "16 × 2, 32 × 1)" in tuning.decisions


def test_bf16_mixed_is_kept_only_when_its_first_losses_stay_close():
    close = tune(FakeLightning(bf16_drift=0.001))
    assert close.best.overrides.lightning["precision"] == "bf16-mixed"
    far = tune(FakeLightning(bf16_drift=0.05))
    assert "precision" not in far.best.overrides.lightning
    assert any(d.startswith("precision: Trainer(precision='bf16-mixed') not kept: its first 5 losses differ")
               for d in far.decisions)


def test_fused_is_tried_for_adamw_and_said_why_not_for_other_optimizers():
    assert tune(FakeLightning()).best.overrides.optimizer == {"fused": True}
    machine = FakeLightning(optimizer="SGD")
    sgd = tune(machine)
    assert not any("optimizer" in o for o in machine.runs)
    assert "fused optimizer: not tried (SGD has no fused variant saturate tries; Adam and AdamW do)" in sgd.decisions


def test_checkpointing_and_compile_are_skipped_with_their_reason_even_on_a_gpu():
    machine = FakeLightning(device="cuda")
    tuning = tune(machine)
    assert any(d.startswith("activation checkpointing: not tried (a Lightning Trainer takes no argument")
               for d in tuning.decisions)
    assert any(d.startswith("compile: not tried (torch.compile of the LightningModule") for d in tuning.decisions)
    assert not any(set(o) - {"lightning", "train_loader", "optimizer", "loader", "tf32"} for o in machine.runs)


@pytest.mark.parametrize("machine, why", [
    (FakeLightning(loader={"sets_batch_size": False, "batch_size": 4}), "takes its batches from a batch_sampler"),
    (FakeLightning(loader={"site": None}), "where the training DataLoader is made was not found"),
    (FakeLightning(automatic=False), "manual optimization"),
])
def test_the_split_is_skipped_with_the_reason_when_the_batch_size_cannot_be_set_from_outside(machine, why):
    tuning = tune(machine)
    assert not any("train_loader" in o or "accumulate_grad_batches" in o.get("lightning", {}) for o in machine.runs)
    line = next(d for d in tuning.decisions if d.startswith("micro-batch:"))
    assert line.startswith("micro-batch: not tried (") and why in line


def test_the_tuned_settings_are_said_as_edits_at_the_trainer_the_loader_and_the_optimizer():
    tuning = tune(FakeLightning())
    tuning.best.overrides = tuning.best.overrides.merged(Overrides(loader={"num_workers": 2}))
    assert edits(tuning) == ["train.py:78: Trainer(..., precision='bf16-mixed', accumulate_grad_batches=1)",
                             "train.py:49: DataLoader(..., batch_size=32, num_workers=2)",
                             "train.py:66: AdamW(..., fused=True)"]


@pytest.mark.parametrize("overrides, message", [
    ({"lightning": {"max_steps": 10}}, "max_steps not among the Lightning Trainer arguments saturate applies"),
    ({"lightning": "bf16"}, '"lightning" must be an object of Lightning Trainer arguments'),
    ({"train_loader": {"site": "train.py:49", "batch_size": 0}}, '"train_loader" needs "site"'),
    ({"train_loader": {"batch_size": 8}}, '"train_loader" needs "site"'),
    ({"optimizer": {"lr": 1.0}}, "lr not among the optimizer settings"),
    ({"precision": "bf16"}, "unknown setting(s) precision"),
])
def test_an_overrides_file_naming_what_saturate_does_not_apply_is_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        Overrides.from_dict(overrides, "--overrides over.json")
    assert message in str(e.value) and str(e.value).startswith("--overrides over.json: ")
    Overrides.from_dict({"lightning": {"precision": "bf16-mixed", "accumulate_grad_batches": 2}, "tf32": True,
                      "train_loader": {"site": "train.py:49", "batch_size": 16}, "optimizer": {"fused": True}})


def test_run_refuses_a_bad_lightning_override_in_one_line(tmp_path, monkeypatch, capsys):
    # in process (a refusal in a subprocess: test_script_tune.test_run_refuses_an_unreadable_overrides_file)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "over.json").write_text(json.dumps({"lightning": {"max_epochs": 3}}))
    out = run_main(capsys, "run", "--overrides", "over.json", "--", sys.executable, "x.py")
    assert out.returncode == 2 and "max_epochs not among the Lightning Trainer arguments" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_batch_size_is_changed_only_where_the_call_sets_one():
    signature = inspect.signature(torch.utils.data.DataLoader.__init__)
    over = Overrides(train_loader={"site": "a.py:1", "batch_size": 16}, loader={"num_workers": 2})
    plain = signature.bind(None, [1, 2], batch_size=4)
    assert over.loader_changes(plain, resized=True) == {"num_workers": 2, "batch_size": 16}
    assert over.loader_changes(plain, resized=False) == {"num_workers": 2}  # another line's loader
    own_sampler = signature.bind(None, [1, 2], batch_sampler=[[0, 1]])
    assert over.loader_changes(own_sampler, resized=True) == {"num_workers": 2}
    assert Overrides(optimizer={"fused": True}).optimizer_changes(torch.optim.AdamW) == {"fused": True, "foreach": None}
    assert Overrides(optimizer={"fused": True}).optimizer_changes(torch.optim.SGD) == {}


@pytest.mark.slow
def test_the_overrides_are_applied_inside_a_lightning_script(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    overrides = {"lightning": {"precision": "bf16-mixed", "accumulate_grad_batches": 2},
                 "train_loader": {"site": "train.py:49", "batch_size": 16}, "optimizer": {"fused": True}}
    settings = ChildSettings(mode="trial", warmup=1, count_steps=0, steps=3, stop=True,
                             overrides=Overrides.from_dict(overrides))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    run = run_instrumented([sys.executable, "train.py", "--width", "32"], settings, quiet_stdout=True)
    report = run.report
    lightning = report["lightning"]
    assert lightning["args"]["accumulate_grad_batches"] == 8 and lightning["args"]["precision"] is None  # as written
    assert lightning["in_force"] == {"precision": "bf16-mixed", "accumulate_grad_batches": 2}
    assert report["loaders"][0]["site"] == "train.py:49" and report["loaders"][0]["batch_size"] == 16
    assert report["loaders"][0]["as_written"] == {"batch_size": 4}
    assert report["measurements"]["samples_per_step"] == 32  # the effective batch kept
    assert report["optimizer"]["fused"] is True
    assert len(lightning["losses"]) >= 4 and all(x > 0 for x in lightning["losses"])
    assert lightning["redirected"]["default_root_dir"] and not (tmp_path / "lightning_logs").exists()


@pytest.mark.slow
def test_the_doctor_times_lightnings_closure_as_forward_and_backward_and_names_its_default_precision(tmp_path):
    pytest.importorskip("lightning")
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    out = saturate("doctor", "--warmup", "1", "--steps", "4", "--", sys.executable, "train.py", "--width", "32",
                   cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shares = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip().startswith(
        ("forward ", "backward ", "optimizer "))}
    assert set(shares) == {"forward", "backward", "optimizer"}, out.stdout
    share = {k: int(v.split("%")[0].split()[-1]) for k, v in shares.items()}  # "forward  2.7 ms  10 % …"
    # training_step and backward run inside optimizer.step(closure): theirs, not the optimizer's
    assert share["forward"] > 0 and share["backward"] > 0 and share["optimizer"] < 50  # 99–100 % before
    assert "precision='32-true' (Lightning's default)" in out.stdout


def saturate(*args: str, cwd: Path, timeout: float = 580) -> subprocess.CompletedProcess:
    env = cli_env()
    env.update(OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    return subprocess.run(saturate_cmd(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_tune_finds_the_lightning_settings_and_writes_them_as_overrides(tmp_path, cpu):
    pytest.importorskip("lightning")
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    out = saturate("tune", "--trial-steps", "3", "--trial-seconds", "1", "--json", "--out", "t", "--", sys.executable,
                   "train.py", "--width", "32", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["lightning"]["site"] == "train.py:78"
    names = [t["name"] for t in d["trials"]]
    precision = ["Trainer(precision='bf16-mixed')"] if cpu.supports["bf16"] else []  # tried where bf16 is native
    assert names[:2 + len(precision)] == ["as written", *precision, "micro-batch 8 × 4"]
    assert "AdamW(fused=True)" in names
    assert all(t["samples_per_step"] == 32 for t in d["trials"] if t["steps"])  # the effective batch kept
    reference = d["baseline"]["losses"]
    split = next(t for t in d["trials"] if t["name"] == "micro-batch 8 × 4")
    # the same samples, another split: equal to float rounding, or to bf16's when the precision trial (a timing
    # decision, 1-s trials) kept bf16-mixed before the split was tried
    bf16 = "bf16" in json.dumps(split["overrides"])
    assert split["losses"][:3] == pytest.approx(reference[:3], rel=2e-2 if bf16 else 1e-4)
    assert json.loads((tmp_path / "t" / "overrides.json").read_text()) == d["overrides"]
    assert (tmp_path / "train.py").read_text() == SCRIPT.read_text()


@pytest.mark.slow
def test_run_applies_lightning_overrides_in_the_full_run(tmp_path):
    pytest.importorskip("lightning")
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    (tmp_path / "over.json").write_text(json.dumps({"lightning": {"accumulate_grad_batches": 2},
                                                    "train_loader": {"site": "train.py:49", "batch_size": 16}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "3", "--trial-seconds", "1", "--json", "--",
                   sys.executable, "train.py", "--width", "32", "--max-steps", "12", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["ratios"]) == 3 and all(t["samples_per_step"] == 32 for t in d["as_written"] + d["tuned"])
    full = d["full_run"]
    assert full["returncode"] == 0 and full["optimizer_steps"] == 12  # max_steps counts optimizer steps
    assert full["loaders"][0]["batch_size"] == 16 and full["loaders"][0]["batches"] == 12 * 2
    assert full["lightning"]["in_force"]["accumulate_grad_batches"] == 2
    assert full["lightning"]["redirected"] == {}  # the full run is the real one: it writes where the script says
    assert "trained 12 steps" in out.stderr
