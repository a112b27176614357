"""Everyday use of the command line: --version, env, -q/-v/--debug anywhere, "did you mean", --json on
tune/train/run (one document on stdout, the rest on stderr)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from conftest import cli_env
from saturate.cli import build_parser, main
from saturate.errors import ConfigError, did_you_mean
from saturate.plan import Plan, resolve_plan
from saturate.tune import measure
from saturate.workloads import custom_workload


def _one_error_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("saturate 0.")


def test_env_is_plain_text_and_json(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for key in ("saturate", "python", "torch", "numpy", "transformers", "devices", "os", "cpu", "cores"):
        assert f"\n- {key}: " in "\n" + text, key
    assert "\x1b[" not in text  # no colour codes: it is pasted into a bug report
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"] and data["saturate"] and isinstance(data["devices"], list)


@pytest.mark.parametrize("argv", [["-q", "--debug", "train"], ["train", "-q", "--debug"], ["--debug", "train", "-q"]])
def test_quiet_and_debug_before_or_after_the_verb(argv):
    args = build_parser().parse_args(argv)
    assert args.quiet and args.debug and not args.verbose


def test_debug_after_the_verb_shows_the_traceback():
    proc = subprocess.run([sys.executable, "-m", "saturate", "train", "--preset", "nope", "--debug"],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_did_you_mean_for_a_verb_and_an_option(capsys):
    with pytest.raises(SystemExit):
        main(["tun"])
    assert "did you mean 'tune'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--stpes", "3"])
    assert "did you mean '--steps'?" in capsys.readouterr().err
    assert did_you_mean("zzzz", ["tune", "train"]) == ""  # nothing close: no guess


def test_did_you_mean_for_a_preset_and_a_param(capsys):
    line = _one_error_line(capsys, ["train", "--preset", "gpt-tine"])
    assert "unknown preset 'gpt-tine'" in line and "did you mean 'gpt-tiny'?" in line
    line = _one_error_line(capsys, ["train", "--param", "n_emb=64"])
    assert "'n_emb'" in line and "did you mean 'n_embd'?" in line
    line = _one_error_line(capsys, ["train", "--preset", "ts-lstm", "--param", "hiden=8"])
    assert "did you mean 'hidden'?" in line
    line = _one_error_line(capsys, ["train", "--param", "lr=fast"])
    assert "lr must be a number, got 'fast'" in line and "not supported" not in line


def test_did_you_mean_for_a_plan_key_and_a_plan_name(tmp_path):
    (tmp_path / "plan.toml").write_text("micro_bach = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'micro_batch'"):
        resolve_plan(str(tmp_path / "plan.toml"))
    with pytest.raises(ConfigError, match="did you mean 'naive'"):
        resolve_plan("naiv")


def test_no_python_internals_for_a_bad_optim_option():
    import torch

    data = [(torch.zeros(2), torch.zeros(1))] * 4
    with pytest.raises(ConfigError) as e:
        custom_workload("w", model=torch.nn.Linear(2, 1), dataset=data, loss=torch.nn.functional.mse_loss,
                        effective_batch=2, lr=1e-3, warmup_step=1)
    assert "__init__" not in str(e.value) and "did you mean 'warmup_steps'?" in str(e.value)


def test_plan_repr_is_one_short_line():
    plan = Plan(name="tuned", micro_batch=4, grad_accum=2, num_workers=2,
                provenance={"trials": [{"stage": "x"}] * 50})
    text = repr(plan)
    assert text == "Plan(name='tuned', micro_batch=4, grad_accum=2, num_workers=2)" and str(plan) == text
    assert eval(text, {"Plan": Plan}).to_dict() == {**plan.to_dict(), "provenance": {}}


# --- --json: one document on stdout -------------------------------------------------------------


@pytest.fixture
def quick_trials(monkeypatch):
    """Trials of a few steps, so tune and run finish in seconds."""
    from saturate.run import flow as run
    from saturate.tune import api

    quick = functools.partial(measure.RealMeasurer, min_seconds=0.05, min_steps=1, max_steps=2)
    monkeypatch.setattr(api, "RealMeasurer", quick)
    monkeypatch.setattr(run, "RealMeasurer", lambda *a, **kw: quick(*a, **{**kw, "min_seconds": 0.05,
                                                                           "max_steps": 2}))


TINY = ["--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32",
        "--effective-batch", "4", "--device", "cpu"]


def test_train_json(tmp_path, small_corpus, capsys):
    assert main(["train", "--data", str(small_corpus), *TINY, "--steps", "2", "--run-dir", str(tmp_path / "r"),
                 "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout is exactly one JSON document
    assert doc["steps"] == 2 and doc["plan"]["micro_batch"] and doc["run_dir"] == str(tmp_path / "r")
    assert doc["samples_per_s"] > 0 and doc["weights"].endswith("model.safetensors")
    assert "run summary" in err  # the human output went to stderr


@pytest.mark.slow
def test_tune_json(tmp_path, small_corpus, capsys, quick_trials):
    assert main(["tune", "--data", str(small_corpus), *TINY, "--steps", "5", "--no-compile",
                 "--out", str(tmp_path / "t"), "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["plan"]["name"] == "tuned" and doc["trials"] and doc["decisions"]
    assert doc["plan_path"] == str(tmp_path / "t" / "plan.toml") and "saturate tune" in err


@pytest.mark.slow
def test_run_json(tmp_path, small_corpus, capsys, quick_trials):
    assert main(["run", "--data", str(small_corpus), *TINY, "--steps", "2", "--no-compile",
                 "--run-dir", str(tmp_path / "r"), "--json"]) == 0
    out, _ = capsys.readouterr()
    doc = json.loads(out)
    assert {"rows", "tuned", "training", "run_dir"} <= set(doc)
    # Two steps, nothing cached: the default plan trains at once, nothing measured before it (no naive row)
    assert doc["training"]["steps"] == 2 and [r["label"] for r in doc["rows"]] == ["training run"]
    assert doc["trained"] == "default" and doc["tuning"]["why"].startswith("not tuned: the job ended (2 steps)")


def test_quiet_train_prints_only_the_summary(tmp_path, small_corpus, capsys):
    assert main(["train", "-q", "--data", str(small_corpus), *TINY, "--steps", "2",
                 "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "run summary" in out and "starting" not in out and "step 2/2" not in out


def test_no_progress_still_prints_the_start_and_the_summary(tmp_path, small_corpus, capsys):
    assert main(["train", "--no-progress", "--data", str(small_corpus), *TINY, "--steps", "2", "--log-every", "1",
                 "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "run summary" in out and "starting" in out and "step 1/2" not in out



@pytest.mark.slow
def test_doctor_diagnoses_the_plan_train_would_run_and_says_which(small_corpus, capsys, cpu, short_doctor):
    from saturate import plan_cache as cache
    from saturate.workloads import build_workload

    argv = ["doctor", "--data", str(small_corpus), *TINY, "--steps", "1", "--warmup", "0", "--no-scaling"]
    assert main(argv) == 0
    assert "with the seed plan" in capsys.readouterr().out
    w = build_workload("gpt-tiny", data=[str(small_corpus)], n_layer=1, n_embd=32, n_head=2, seq_len=32,
                       effective_batch=4)
    cache.store(Plan(name="tuned", micro_batch=2, grad_accum=2, provenance={"hardware": cpu.fingerprint()}), w,
                cpu.fingerprint())
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan_used"].startswith("the tuned plan") and doc["measurements"]["micro_batch"] == 2
    assert main([*argv, "--no-tuned", "-q"]) == 0
    assert "warm-up steps" not in capsys.readouterr().out  # -q: the result only, no progress line


def test_an_effective_batch_far_beyond_the_data_is_warned():
    import torch

    from saturate.workloads.base import data_note

    data = [(torch.zeros(2), torch.zeros(1))] * 10
    w = custom_workload("w", model=torch.nn.Linear(2, 1), dataset=data, loss=torch.nn.functional.mse_loss,
                        effective_batch=16, lr=1e-3)
    assert "larger than the training data (10 distinct samples)" in data_note(w.train_data, 16, 5)
    assert "about 1600 times over" in data_note(w.train_data, 8, 2000)
    assert data_note(w.train_data, 8, 20) is None  # 16 passes: ordinary


def test_train_says_so(tmp_path, small_corpus, capsys):
    assert main(["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4096", "--steps", "1",
                 "--run-dir", str(tmp_path / "r"), "--no-progress"]) == 0
    assert "larger than the training data" in capsys.readouterr().out


@pytest.mark.slow
def test_verbose_shows_the_machine_and_the_plan_and_quiet_tune_one_line(tmp_path, small_corpus, capsys,
                                                                         quick_trials):
    assert main(["train", "-v", "--data", str(small_corpus), *TINY, "--steps", "1", "--no-progress",
                 "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "saturate probe" in out and "the plan trained:" in out and "micro_batch = " in out
    assert main(["tune", "-q", "--data", str(small_corpus), *TINY, "--steps", "5", "--no-compile",
                 "--out", str(tmp_path / "t")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tuned plan: {tmp_path / 't' / 'plan.toml'} Plan(name='tuned'")
