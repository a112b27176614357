"""`saturate tune -- CMD` and `saturate run -- CMD` on guide 1's GPT pretraining script and guide 4's
time-series grid script, unchanged, at tiny sizes: the trials never write the script's outputs, the
overrides reach the script's own DataLoader from outside, and the full run is the script's real run."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import line_of, run_saturate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scripts"
GPT = EXAMPLES / "gpt_pretrain" / "train.py"
TIMESERIES = EXAMPLES / "timeseries_grid" / "train.py"
TS_TINY = ["--hidden", "8", "--window", "8", "--batch-size", "16", "--num-workers", "1"]
WORKERS = {"loader": {"num_workers": 1, "persistent_workers": True}}

pytestmark = pytest.mark.slow  # each runs the script several times


saturate = functools.partial(run_saturate, timeout=500)


def check_tuning(d: dict, tmp_path: Path, script: Path) -> None:
    assert d["trials"][0]["name"] == "as written" and d["trials"][0]["steps"] >= 2  # the windows' timed steps
    assert not any(t["ran_to_end"] for t in d["trials"]) and not any(x.startswith("warning") for x in d["decisions"])
    assert d["loaders"][0]["site"].endswith(line_of(script, "DataLoader("))
    assert any(x.startswith("loader") for x in d["decisions"])  # workers tried, or why not
    assert json.loads((tmp_path / "t" / "overrides.json").read_text()) == d["overrides"]
    edits = list(d["edits"])  # whichever settings won on this machine, each said as the edit at its call
    if d["overrides"].get("train_loader"):  # a loop's split, kept where it was verified
        assert edits.pop(0).startswith(d["loaders"][0]["site"] + ": the split where the loop keeps it: ")
    if d["overrides"].get("loader"):
        assert edits.pop(0).startswith(d["loaders"][0]["site"] + ": DataLoader(..., ")
    if d["overrides"].get("optimizer"):  # the fused AdamW stage, at the script's AdamW(...) line
        assert edits.pop(0).endswith(f"{line_of(script, 'optim.Adam')}: {d['optimizer']['class']}(..., fused=True)")
    if d["overrides"].get("compile"):  # compiled from outside, kept where its planned steps paid it back
        assert edits.pop().startswith("after building the model: model.compile()")
    if d["overrides"].get("threads"):  # a busy machine (other processes on the cores): fewer threads, measured
        assert edits.pop() == f"at start-up: torch.set_num_threads({d['overrides']['threads']})"
    assert edits == [] and set(d["overrides"]) <= {"loader", "optimizer", "threads", "train_loader", "compile"}
    if d["overrides"].get("loader") or d["overrides"].get("optimizer"):  # a call's arguments: in the patch too
        patch = tmp_path / "t" / "edit.diff"
        done = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(patch)], cwd=d["patch"]["apply_in"],
                              capture_output=True, text=True)
        assert done.returncode == 0 and patch.read_text() == d["patch"]["diff"], done.stdout + done.stderr
    assert any(x.startswith("fused optimizer") for x in d["decisions"])  # tried, or why not


def test_tune_the_gpt_pretraining_script(tmp_path):
    out = saturate("tune", "--trial-steps", "2", "--trial-seconds", "2", "--json", "--out", str(tmp_path / "t"), "--",
                   sys.executable, str(GPT), "--config", "tiny", "--max-steps", "5000", "--out-dir", "user-out",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    check_tuning(json.loads(out.stdout), tmp_path, GPT)
    assert not (tmp_path / "user-out").exists()  # every trial was stopped before the script saves


def test_run_the_gpt_pretraining_script_with_workers_applied_from_outside(tmp_path):
    (tmp_path / "over.json").write_text(json.dumps(WORKERS))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "2", "--trial-seconds", "1", "--json", "--",
                   sys.executable, str(GPT), "--config", "tiny", "--out-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["as_written"]) == len(d["tuned"]) == 3 and len(d["ratios"]) == 3  # alternating rounds
    assert all(t["overrides"] == WORKERS for t in d["tuned"]) and all(not t["overrides"] for t in d["as_written"])
    full = d["full_run"]
    assert full["returncode"] == 0 and full["optimizer_steps"] == 40  # the tiny config's max_steps
    loader = full["loaders"][0]
    assert loader["site"].endswith(line_of(GPT, "DataLoader(")) and loader["as_written"] == {
        "num_workers": 0, "persistent_workers": False}
    assert (loader["num_workers"], loader["persistent_workers"]) == (1, True)
    assert (tmp_path / "user-out" / "model.pt").exists()  # the full run is the real one


def test_tune_the_time_series_grid_script(tmp_path):
    # --no-compile: its LSTM's compile trial would take minutes here (a loop's compile: test_loop_compile.py, and
    # the GPT script above)
    out = saturate("tune", "--trial-steps", "2", "--trial-seconds", "1", "--no-compile", "--json", "--out",
                   str(tmp_path / "t"), "--", sys.executable, str(TIMESERIES), *TS_TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    check_tuning(d, tmp_path, TIMESERIES)
    assert d["baseline"]["samples_per_step"] == 16


def test_run_the_time_series_grid_script_applies_the_overrides_to_every_grid_point(tmp_path):
    (tmp_path / "over.json").write_text(json.dumps({"loader": {"num_workers": 0}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "2", "--trial-seconds", "1", "--json", "--",
                   sys.executable, str(TIMESERIES), *TS_TINY, "--hidden", "8", "12", "--length", "200", "--epochs", "1",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    full = d["full_run"]
    assert full["returncode"] == 0 and full["optimizer_steps"] == 2 * 12  # 2 grid points × 191 windows / 16
    assert len(full["loaders"]) == 2 and all(x["num_workers"] == 0 for x in full["loaders"])
    assert "best: hidden" in out.stderr  # the script ran its grid to the end (its output, off stdout by --json)
