"""`saturate run -- CMD` acts only on what its own side-by-side confirmed: tuned settings reach the full run only
when the alternating rounds measured them faster in every round (issue 28: decide, then confirm, then act)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console

from conftest import run_saturate
from saturate.script import run_script
from saturate.script.command import ScriptRun
from saturate.script.overrides import NONE, Overrides
from saturate.script.script_trial import ScriptTrial, TrialOptions
from saturate.stats.rounds import Ratio

WORKERS = Overrides(loader={"num_workers": 2})


def test_tuned_settings_are_applied_only_when_faster_in_every_round():
    assert run_script.confirmed(Ratio.of([1.4, 1.3, 1.5]), given=False) == (True, None)
    applied, why = run_script.confirmed(Ratio.of([1.9, 0.7, 1.1]), given=False)  # a burst in one round
    assert not applied and "not faster in every round" in why and "nothing applied" in why
    applied, why = run_script.confirmed(None, given=False)
    assert not applied and "no round gave a ratio" in why
    applied, why = run_script.confirmed(Ratio.of([0.8, 0.9, 0.7]), given=True, source="over.json")
    assert applied and why.startswith("warning: over.json was not measured faster side by side")


def _trial(name: str, step_s: float) -> ScriptTrial:
    return ScriptTrial(name, NONE, step_s, None, 0.0, 3)


@pytest.mark.parametrize("tuned_steps, applied", [((0.5, 0.5, 0.5), True), ((0.5, 1.3, 0.5), False)])
def test_the_full_run_is_as_written_when_the_side_by_side_does_not_confirm(monkeypatch, tuned_steps, applied):
    seen: dict[str, Any] = {}

    class Tuning:
        best = ScriptTrial("2 workers", WORKERS, 0.5, None, 0.0, 3)
        baseline = ScriptTrial("as written", NONE, 1.0, None, 0.0, 3)
        paired = "not asked for"  # trials one after another: the side-by-side is in rounds
        short = None  # long enough to tune

        def to_dict(self) -> dict[str, Any]:
            return {"trials": ["…"]}

    def side_by_side(command: list[str], overrides: Overrides, **kw: Any) -> tuple[list, list]:
        return [_trial("as written", 1.0)] * 3, [_trial("tuned", s) for s in tuned_steps]

    def full_run(command: list[str], overrides: Overrides, **kw: Any) -> ScriptRun:
        seen["overrides"] = overrides
        return ScriptRun(list(command), 0, None, {"step_times": []}, 10, 1.0)

    monkeypatch.setattr(run_script, "tune_with_progress", lambda *a, **kw: Tuning())
    monkeypatch.setattr(run_script, "render_tuning", lambda *a, **kw: None)
    monkeypatch.setattr(run_script, "side_by_side", side_by_side)
    monkeypatch.setattr(run_script, "full_run", full_run)
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None)
    report = run_script.run_script(["python", "train.py"], TrialOptions(), console)
    assert (seen["overrides"] == WORKERS) is applied and report.applied is applied
    d = report.to_dict()
    assert d["overrides"] == WORKERS.to_dict() and d["applied"] is applied and d["tuning"] == {"trials": ["…"]}
    run_script.render(report, console)
    text = out.getvalue()
    if applied:
        assert d["withheld"] is None and "the full run with the tuned settings" in text
    else:
        assert seen["overrides"] == NONE and "not faster in every round" in d["withheld"]
        assert "the full run as written" in text and "not faster in every round" in text


# a model updated by hand, no torch.optim: saturate's hooks see no optimizer step, so nothing can be tuned
HAND_UPDATED_JOB = """
import torch
torch.manual_seed(0)
w = torch.randn(16, requires_grad=True)
x = torch.randn(64, 16)
for step in range(20):
    loss = (x @ w).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
        w.grad = None
open("model.txt", "w").write(f"{loss.item():.6f}")
"""


@pytest.mark.slow
def test_run_runs_the_job_as_written_when_it_cannot_tune_it(tmp_path):
    (tmp_path / "train.py").write_text(HAND_UPDATED_JOB)
    out = run_saturate("run", "--json", "--", sys.executable, "train.py", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["reason"].startswith("not tuned: the script ended without an optimizer step")
    assert d["full_run"]["returncode"] == 0 and d["full_run"]["counted"] is False and not d["applied"]
    assert (tmp_path / "model.txt").exists()  # the user's own run: its output is where a plain run puts it
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.py").write_text(HAND_UPDATED_JOB)
    subprocess.run([sys.executable, "train.py"], cwd=plain, check=True, timeout=120)
    assert (tmp_path / "model.txt").read_text() == (plain / "model.txt").read_text()


def test_run_refuses_a_command_that_cannot_run_instead_of_running_it_as_written(tmp_path):
    from saturate.errors import ConfigError

    console = Console(file=io.StringIO(), width=100, color_system=None)
    with pytest.raises(ConfigError, match="command not found"):
        run_script.run_script(["no-such-python-here", "train.py"], TrialOptions(), console)


def test_a_script_whose_first_trial_fails_is_not_tunable():
    from saturate.script.command import NotTunable, ScriptFailed
    from saturate.script.tune_script import tune_command

    def runner(*a: Any, **kw: Any) -> ScriptRun:
        raise ScriptFailed("the script ended without an optimizer step (exit code 0)")

    with pytest.raises(NotTunable, match="without an optimizer step"):
        tune_command(["python", "train.py"], runner=runner, paired=False)


def test_run_writes_the_tuned_settings_only_to_a_run_dir_asked_for(monkeypatch, tmp_path, capsys):
    from saturate import cli
    from saturate.script.tuning import ScriptTuning

    base, best = ScriptTrial("as written", NONE, 1.0, None, 0.0, 3), ScriptTrial("2 workers", WORKERS, 0.5, None,
                                                                                  0.0, 3)
    tuning = ScriptTuning(["python", "train.py"], base, best, [base, best])

    def fake(command, options, console, **kw):
        full = ScriptRun(list(command), 0, None, {"step_times": []}, 10, 1.0)
        return run_script.ScriptRunReport(list(command), WORKERS, [], [], full, "(no side-by-side here)", tuning=tuning)

    monkeypatch.setattr(run_script, "run_script", fake)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--", "python", "train.py"]) == 0
    assert list(tmp_path.iterdir()) == [] and "--run-dir DIR writes the tuned settings" in capsys.readouterr().out
    assert cli.main(["run", "--run-dir", "r", "--", "python", "train.py"]) == 0
    assert json.loads((tmp_path / "r" / "overrides.json").read_text()) == WORKERS.to_dict()
    assert "the tuned settings: r/overrides.json (`saturate run --overrides r/overrides.json" in capsys.readouterr().out
