"""`saturate tune -- CMD` on a trainer whose model has BatchNorm: the micro-batch × accumulation stage keeps the
split as written (it is part of the model's maths) unless `--allow-micro-batch-change`. The stage on a fake
Lightning machine (every decision, no script run); the batch-coupled layers found inside a real Lightning script."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_lightning_tune import SCRIPT, FakeLightning

from saturate.script.boundary import ChildSettings
from saturate.script.child.coupled import record
from saturate.script.command import ScriptRun, run_instrumented
from saturate.script.trainer_stages import kept_split
from saturate.script.tune_script import tune_command


class CoupledLightning(FakeLightning):
    """The fake Lightning script, its model holding `layers` (as the script's report would say)."""

    def __init__(self, layers: list[str] | None) -> None:
        super().__init__()
        self.layers = layers

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        run = super().__call__(command, settings, **kw)
        run.report["model"] = {"class": "Sequential", "wrapped_in": [], "parameters": 100,
                               "batch_coupled": self.layers}
        return run


def tune(machine: FakeLightning, allow: bool = False) -> Any:
    return tune_command(["python", "train.py"], runner=machine, supports={"bf16": True},
                        allow_micro_batch_change=allow)


def test_batchnorm_keeps_the_split_as_written_and_says_why():
    machine = CoupledLightning(["BatchNorm1d"])
    tuning = tune(machine)
    assert not any(t.name.startswith("micro-batch") for t in tuning.trials)
    assert not any("train_loader" in over or "accumulate_grad_batches" in over.get("lightning", {})
                   for over in machine.runs)  # no run changed the split
    assert ("micro-batch: not searched (the model has batch-coupled layers (BatchNorm1d): the micro-batch is part "
            "of its maths; kept at 4 × accumulation 8 as written; --allow-micro-batch-change searches it)"
            in tuning.decisions)
    assert any(t.name == "AdamW(fused=True)" for t in tuning.trials)  # the other stages still run


def test_allow_micro_batch_change_searches_it_and_says_the_maths_change():
    tuning = tune(CoupledLightning(["BatchNorm1d"]), allow=True)
    assert [t.name for t in tuning.trials if t.name.startswith("micro-batch")] == [
        "micro-batch 8 × 4", "micro-batch 16 × 2", "micro-batch 32 × 1"]
    assert any(d.startswith("micro-batch: searched although the model has batch-coupled layers (BatchNorm1d)")
               for d in tuning.decisions)


@pytest.mark.parametrize("layers", [[], None])
def test_a_model_without_coupled_layers_or_not_inspected_is_searched_without_a_word(layers):
    tuning = tune(CoupledLightning(layers))
    assert any(t.name.startswith("micro-batch") for t in tuning.trials)
    assert not any("batch-coupled" in d for d in tuning.decisions)


def test_the_decision_helper_and_the_record():
    import torch.nn as nn

    assert record(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LayerNorm(2))) == {
        "batch_coupled": ["BatchNorm1d"]}
    assert kept_split({"batch_coupled": ["BatchNorm2d"]}, 8, 1, allow_change=False)[0] is True
    assert kept_split({"batch_coupled": ["BatchNorm2d"]}, 8, 1, allow_change=True)[0] is False
    assert kept_split(None, 8, 1, allow_change=False) == (False, None)


@pytest.mark.slow
def test_a_lightning_script_with_batchnorm_reports_its_coupled_layers(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    text = SCRIPT.read_text()
    coupled = text.replace("nn.GELU(), nn.Linear(width, width)", "nn.BatchNorm1d(width), nn.Linear(width, width)")
    assert coupled != text
    (tmp_path / "train.py").write_text(coupled)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    settings = ChildSettings(mode="trial", warmup=1, count_steps=0, steps=2, stop=True)
    run = run_instrumented([sys.executable, "train.py", "--width", "16"], settings, quiet_stdout=True)
    assert run.report["model"]["batch_coupled"] == ["BatchNorm1d"]
    assert Path(tmp_path / "train.py").read_text() == coupled  # the script is not touched


@pytest.mark.parametrize("flag", [[], ["--allow-micro-batch-change"]])
def test_the_cli_hands_the_flag_to_the_script_tuning(flag, monkeypatch, tmp_path):
    import saturate.script.progress as script_tune
    from saturate.cli import main

    seen: dict[str, Any] = {}

    def fake(command: list[str], **kw: Any) -> Any:
        seen.update(kw)
        return tune_command(command, runner=CoupledLightning(["BatchNorm2d"]), supports={"bf16": True},
                            allow_micro_batch_change=kw["allow_micro_batch_change"])

    monkeypatch.setattr(script_tune, "tune_command", fake)
    monkeypatch.chdir(tmp_path)
    assert main(["tune", *flag, "--out", "t", "--", "python", "train.py"]) == 0
    assert seen["allow_micro_batch_change"] is bool(flag)
    decisions = json.loads((tmp_path / "t" / "tune.json").read_text())["decisions"]
    assert any(d.startswith("micro-batch: not searched") for d in decisions) is not bool(flag)
