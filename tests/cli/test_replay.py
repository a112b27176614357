"""run.toml and `saturate train --config run.toml`, through the command line in this process: a replay into
another folder gives bit-identical losses; flags given with --config win; a bad file is one line."""

from __future__ import annotations

import re

import pytest

from saturate.cli import main
from saturate.engine.metrics import read_jsonl
from saturate.plan import tomllib

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


@pytest.fixture
def first(tmp_path, small_corpus, capsys):
    run = tmp_path / "first"
    assert main(["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--steps", "4",
                 "--eval-every", "2", "--log-every", "1", "--log-to", "csv", "--early-stop", "val/loss:5",
                 "--seed", "3", "--no-progress", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    return run


def losses(run_dir):
    return [(r["step"], r["train/loss"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_run_toml_records_the_run_and_replays_it_exactly(first, tmp_path, small_corpus, capsys):
    settings = tomllib.loads((first / "run.toml").read_text())
    assert settings["workload"]["data"] == [str(small_corpus)] and settings["workload"]["effective_batch"] == 4
    assert settings["workload"]["params"] == {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}
    assert {k: settings["run"][k] for k in ("steps", "seed", "eval_every", "ckpt_every", "log_every", "log_to",
                                            "early_stop", "device")} == {
        "steps": 4, "seed": 3, "eval_every": 2, "ckpt_every": 2, "log_every": 1, "log_to": ["csv"],
        "early_stop": "val/loss:5", "device": "cpu"}
    assert settings["plan"]["micro_batch"] * settings["plan"]["grad_accum"] == 4
    replay = tmp_path / "replay"
    assert main(["train", "--config", str(first / "run.toml"), "--run-dir", str(replay), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert losses(replay) == losses(first) and len(losses(first)) == 4  # bit-identical
    assert (replay / "metrics.csv").exists() and not (replay / "tensorboard").exists()  # its sinks too
    assert (replay / "run.toml").read_text() == (first / "run.toml").read_text()


def test_flags_given_with_config_win(first, tmp_path, capsys):
    out = tmp_path / "shorter"
    assert main(["train", "--config", str(first / "run.toml"), "--steps", "2", "--log-to", "tensorboard",
                 "--param", "n_embd=64", "--run-dir", str(out), "--no-progress"]) == 0
    settings = tomllib.loads((out / "run.toml").read_text())
    assert settings["run"]["steps"] == 2 and settings["run"]["log_to"] == ["tensorboard"]
    assert settings["workload"]["params"]["n_embd"] == 64 and settings["workload"]["params"]["n_layer"] == 1
    assert settings["run"]["seed"] == 3  # the rest from the file
    assert len(losses(out)) == 2 and (out / "tensorboard").is_dir() and not (out / "metrics.csv").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("[run]\n", "[run]\nstpes = 5\n"),
     r"unknown key 'stpes' in \[run\] \(did you mean 'steps'\?\)"),
    (lambda t: t.replace("[plan]\n", "[plan]\nmicro_bach = 2\n"),
     r"unknown key 'micro_bach' in \[plan\] \(did you mean 'micro_batch'\?\)"),
    (lambda t: t + "\n[trainer]\nx = 1\n", r"unknown section \[trainer\]"),
    (lambda t: t + "\n[run\n", r"is not valid TOML"),
])
def test_a_bad_run_toml_is_one_line(first, tmp_path, capsys, edit, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(edit((first / "run.toml").read_text()))
    assert main(["train", "--config", str(bad), "--run-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("saturate: error: ")
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("text, message", [
    ("steps = 5\n", "'steps' is not a section but a key of [run]: put it under [run]"),
    ('preset = "gpt-tiny"\n[run]\nseed = 1\n', "'preset' is not a section but a key of [workload]: put it under "
                                                "[workload]"),
])
def test_a_section_key_at_the_top_of_a_run_toml_says_where_it_goes(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"saturate: error: {config}: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_a_missing_run_toml_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert capsys.readouterr().err.strip() == f"saturate: error: --config {tmp_path / 'nope.toml'} does not exist"
