"""`saturate doctor` end to end: the report in a subprocess; --apply and bad input through `cli.main` in this
process (one bad input also in a subprocess), the doctor timed briefly (conftest.short_doctor)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_main
from saturate.plan import Plan

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60
QUICK = ("--steps", "1", "--warmup", "0", "--no-scaling")


def _doctor(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**cli_env(), "SATURATE_CACHE": str(tmp_path / "cache")}
    (tmp_path / "small.txt").write_text(TEXT)
    return subprocess.run([sys.executable, "-m", "saturate", "doctor", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_doctor_prints_the_split_the_verdict_and_the_fixes(tmp_path):
    proc = _doctor(tmp_path, "--data", "small.txt", "--plan", "naive", *QUICK)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ("waiting for data", "forward", "backward", "optimizer step", "synchronisations per step: 0",
                 "device utilisation: unmeasured (no GPU", "verdict:"):
        assert text in out, text


def test_apply_runs_the_fixed_plan_and_saves_it(tmp_path, monkeypatch, capsys, short_doctor):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text(TEXT)
    proc = run_main(capsys, "doctor", "--data", "small.txt", "--plan", "naive", "--effective-batch", "8", *QUICK,
                    "--apply", "--save-plan", "fixed.toml", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    if data["applied"] is None:  # nothing to apply on this machine (no plan fix): said so, nothing saved
        assert not (tmp_path / "fixed.toml").exists()
        return
    saved = Plan.load(tmp_path / "fixed.toml")
    for key, value in data["applied"]["changes"].items():
        assert getattr(saved, key) == value
    assert saved.samples_per_step() == 8  # the naive plan's effective batch is kept
    before, after = data["before"]["measurements"], data["after"]["measurements"]
    assert data["diagnoses_gain"] == pytest.approx(before["step_s"] / after["step_s"])
    side = data["side_by_side"]  # a speed fix: its gain measured side by side, in interleaved rounds
    assert side["rounds"] >= 3 and side["min"] <= data["measured_gain"] == side["median"] <= side["max"]


@pytest.mark.parametrize("args, message, real", [
    (("--preset", "nope"), "unknown preset 'nope'", True),  # `python -m saturate` itself, once
    (("--plan", "missing.toml"), "plan file missing.toml does not exist", False),
    (("--save-plan", "x.toml"), "--save-plan needs --apply", False),
    (("--warmup", "-1"), "--warmup must be >= 0", False),
    (("--steps", "0"), "--steps must be > 0", False),
    (("--host-memory-budget", "-2"), "--host-memory-budget must be > 0", False),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message, real):
    monkeypatch.chdir(tmp_path)
    proc = _doctor(tmp_path, *args, timeout=120) if real else run_main(capsys, "doctor", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
