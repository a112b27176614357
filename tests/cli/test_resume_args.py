"""What a resume may change, through the command line in this process: the run's own workload flags are
recorded and reused by `--resume --run-dir R` alone; another optimisation (an --effective-batch or a
learning rate that differs) is refused in one line, like another model or other data."""

from __future__ import annotations

import json

import pytest

from saturate.cli import main
from saturate.engine.metrics import read_jsonl
from saturate.plan import Plan, tomllib

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


@pytest.fixture
def run_dir(tmp_path, small_corpus, capsys):
    """Two steps of a tiny run started with workload flags (data, parameters, effective batch)."""
    run = tmp_path / "run"
    assert main(["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--steps", "2",
                 "--no-progress", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    return run


def test_resume_run_dir_alone_reuses_the_runs_workload(run_dir, small_corpus, capsys):
    source = json.loads((run_dir / "run.json").read_text())["source"]
    assert source["data"] == [str(small_corpus)] and source["effective_batch"] == 4
    assert source["params"] == {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}
    assert main(["train", "--resume", "--run-dir", str(run_dir), "--steps", "3", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""  # the same model, data and optimisation: nothing refused
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_resume_keeps_the_runs_cadence_unless_given_again(tmp_path, small_corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--steps", "2",
                 "--log-every", "1", "--eval-every", "3", "--keep", "5", "--no-progress", "--run-dir", str(run)]) == 0
    assert main(["train", "--resume", "--run-dir", str(run), "--steps", "4", "--no-progress"]) == 0
    logged = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert logged == [1, 2, 3, 4]  # not only the last step, as --log-every's default 10 would
    recorded = tomllib.loads((run / "run.toml").read_text())["run"]
    assert (recorded["log_every"], recorded["eval_every"], recorded["keep"]) == (1, 3, 5)
    assert main(["train", "--resume", "--run-dir", str(run), "--steps", "6", "--log-every", "2", "--no-progress"]) == 0
    assert tomllib.loads((run / "run.toml").read_text())["run"]["log_every"] == 2  # given again: it wins
    capsys.readouterr()


@pytest.mark.parametrize("change, differs", [
    (("--effective-batch", "8"), "effective_batch 4 -> 8"),
    (("--effective-batch", "4", "--param", "lr=0.01"), "lr 0.002 -> 0.01"),
])
def test_resume_with_another_optimisation_is_refused(run_dir, small_corpus, capsys, change, differs):
    code = main(["train", "--data", str(small_corpus), *TINY, *change, "--resume", "--run-dir", str(run_dir),
                 "--steps", "3", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"saturate: error: cannot resume from {run_dir / 'checkpoints' / 'ckpt-00000002.pt'}: it "
                      f"was trained with a different optimisation ({differs}); resume with the run's own settings "
                      "(--resume --run-dir alone reuses them)")


def test_resuming_with_the_checkpoints_own_plan_is_not_called_different(tmp_path, small_corpus, capsys):
    """A tuned plan's provenance can hold a NaN (a trial that measured nothing), which never equals itself
    after a round trip: the settings decide whether a plan differs, not the notes on where it came from."""
    plan_file = tmp_path / "plan.toml"
    Plan(micro_batch=4, provenance={"decisions": ["micro-batch 4"], "verified_samples_per_s": float("nan")}
         ).save(plan_file)
    argv = ["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--plan", str(plan_file),
            "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert main([*argv, "--steps", "1"]) == 0
    assert main([*argv, "--steps", "2", "--resume"]) == 0
    notes = json.loads((tmp_path / "run" / "run.json").read_text())["notes"]
    assert not any("different plan" in n for n in notes), notes
