"""Bring-your-own workloads: the examples train through every verb, FLOPs are counted, bad input is one line."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import cli_env, saturate_cmd
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError
from saturate.tune.measure import RealMeasurer
from saturate.workloads.custom import Epochs, count_flops, custom_workload, load_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def short(run_dir: Path, steps: int = 3) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=steps, progress=False, tensorboard=False, eval_every=steps)


@pytest.mark.parametrize("example, params", [("cnn", {"width": 8, "n": 256}), ("rnn", {"hidden": 8}),
                                             ("lm", {"width": 32})])
def test_examples_train_with_counted_flops_and_mfu(tmp_path, cpu, example, params):
    w = load_workload(f"{EXAMPLES / example}.py:workload", {**params, "steps": 3})
    assert w.flops_per_sample and w.flops_per_sample > 0 and "(counted)" in w.info["flops_per_sample"]
    assert isinstance(w.train_data, Epochs) and w.identity["params"]["steps"] == 3
    result = train(w, None, short(tmp_path / "run"), hardware=cpu)
    assert result.steps == 3 and result.mfu is not None and result.mfu > 0
    assert result.val_loss is not None and torch.isfinite(torch.tensor(result.val_loss))
    assert (tmp_path / "run" / "model.safetensors").exists()


def test_lstm_flops_are_counted_not_missed():
    """oneDNN's fused LSTM is invisible to the FLOP counter; the probe turns it off so the matmuls count."""
    lstm, head = nn.LSTM(8, 32, num_layers=2, batch_first=True), nn.Linear(32, 8)
    model = nn.ModuleDict({"lstm": lstm, "head": head})
    x = torch.randn(4, 30, 8)

    def step(m, batch):
        out, _ = m["lstm"](batch)
        return m["head"](out[:, -1]).pow(2).mean()

    h = 32
    forward = 4 * (30 * (2 * 4 * h * (8 + h) + 2 * 4 * h * (h + h)) + 2 * h * 8)  # 4 sequences
    counted = count_flops(model, step, x)
    assert 2.5 * forward < counted <= 3.05 * forward  # backward ≈ 2× forward (no gradient for the input)


def test_finite_dataset_epochs_are_permutations_fixed_by_seed():
    data = list(range(10))
    e = Epochs(data, seed=3)
    first, second = [e[i] for i in range(10)], [e[i] for i in range(10, 20)]
    assert sorted(first) == sorted(second) == data and first != second  # each epoch sees every item once
    assert [Epochs(data, seed=3)[i] for i in range(20)] == first + second  # a function of the index alone
    assert [Epochs(data, seed=3)[i] for i in (15, 2)] == [second[5], first[2]]  # in any order
    assert [Epochs(data, shuffle=False)[i] for i in range(12)] == data + [0, 1]


def test_a_module_instance_is_copied_so_every_build_starts_alike():
    data = [(torch.randn(4), torch.tensor(1.0)) for _ in range(8)]
    w = custom_workload("lin", model=nn.Linear(4, 1), dataset=data,
                        loss=lambda out, y: (out.squeeze(-1) - y).pow(2).mean(), effective_batch=4, lr=1e-2)
    a, b = w.build_model(), w.build_model()
    assert a is not b and torch.equal(a.weight, b.weight)
    assert w.flops_per_sample == pytest.approx(2 * 2 * 4)  # forward 2·4, weight gradient 2·4; no input gradient


BAD_MODULE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import saturate

    NOT_A_FUNCTION = 3

    def dict_instead():
        return {"model": 1}

    def boom():
        raise ValueError("no data here")

    class Sized:
        def __len__(self):
            return 4

    class Stream(torch.utils.data.IterableDataset):
        def __len__(self):
            return 8
        def __iter__(self):
            return iter([(torch.zeros(3), torch.tensor(0))] * 8)

    class Random(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.randn(3), torch.tensor(0)

    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.zeros(i + 1), torch.tensor(0)

    def make(dataset, loss, name="bad"):
        return saturate.custom_workload(name, model=lambda: nn.Linear(3, 2), dataset=dataset, loss=loss,
                                        effective_batch=4, lr=1e-3)

    good = [(torch.zeros(3), torch.tensor(0))] * 8

    def not_indexable():
        return make(Sized(), nn.CrossEntropyLoss())

    def not_deterministic():
        return make(Random(), nn.CrossEntropyLoss())

    def ragged():
        return make(Ragged(), nn.CrossEntropyLoss())

    def vector_loss():
        return make(good, nn.CrossEntropyLoss(reduction="none"))

    def no_grad_loss():
        return make(good, lambda out, y: torch.tensor(1.0))

    def stream():
        return make(Stream(), nn.CrossEntropyLoss())

    def bad_name():
        return make(good, nn.CrossEntropyLoss(), name="a/b")
''')


@pytest.fixture
def bad_module(tmp_path) -> Path:
    path = tmp_path / "badwork.py"
    path.write_text(BAD_MODULE)
    return path


@pytest.mark.parametrize("function, message", [
    ("nothere", "module 'badwork' has no attribute 'nothere'"),
    ("NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
    ("dict_instead", "returned a dict, not a saturate.Workload"),
    ("boom", "calling boom() raised ValueError: no data here"),
    ("not_indexable", "the dataset is a Sized, not map-style"),
    ("stream", "the dataset is a Stream, not map-style (it needs len() and [index]): samples are read by their "
               "index, so that resume, any micro-batch split and any number of loader workers train on the same"),
    ("not_deterministic", "train_data[0] returned different values on two reads"),
    ("ragged", "samples cannot be batched together"),
    ("vector_loss", "the loss must be a scalar float tensor (the batch mean), got a tensor of shape (2,)"),
    ("no_grad_loss", "the loss has no gradient"),
    ("bad_name", "workload name 'a/b' must start with a letter"),
])
def test_bad_user_workloads_fail_in_one_line_naming_the_function(bad_module, function, message):
    spec = f"{bad_module}:{function}"
    with pytest.raises(ConfigError) as e:
        load_workload(spec)
    text = str(e.value)
    assert message in text and "\n" not in text
    assert text.startswith(f"--workload {spec}") or text.startswith("workload 'bad'")


def test_bad_specs_and_parameters(tmp_path, bad_module):
    cases = {
        "no_colon": "expected package.module:function",
        "no_such_module_xyz:workload": "cannot import module 'no_such_module_xyz'",
        f"{tmp_path / 'missing.py'}:workload": "missing.py does not exist",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_workload(spec)
    (tmp_path / "broken.py").write_text("def workload(:\n")
    with pytest.raises(ConfigError, match=r"broken.py:1: syntax error"):
        load_workload(f"{tmp_path / 'broken.py'}:workload")
    with pytest.raises(ConfigError, match=r"workload\(\) has no parameter 'widht' \(did you mean 'width'\?\); "
                                          r"it takes: width, n, steps"):
        load_workload(f"{EXAMPLES / 'cnn.py'}:workload", {"widht": 3})


@pytest.mark.slow
def test_tune_and_run_are_as_complete_for_a_user_workload(tmp_path, monkeypatch):
    """`saturate run --workload …` (through the CLI entry point, with short trials): trials, decisions,
    before/after rows with MFU from the counted FLOPs."""
    from saturate import cli
    from saturate.run import flow as run
    from saturate.tune import api

    monkeypatch.setattr(api, "RealMeasurer", functools.partial(RealMeasurer, min_seconds=0.05, min_steps=1,
                                                               max_steps=2))
    monkeypatch.setattr(run, "compare", functools.partial(run.compare, min_seconds=0.05))
    rc = cli.main(["run", "--workload", f"{EXAMPLES / 'cnn.py'}:workload", "--param", "width=8", "--param", "n=256",
                   "--effective-batch", "16", "--steps", "3", "--budget", "60", "--no-compile",
                   "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert rc == 0
    evidence = json.loads((tmp_path / "run" / "tune" / "tune.json").read_text())
    stages = {t["stage"] for t in evidence["trials"]}
    assert "precision" in stages and "fused-optimizer" in stages
    assert "verify" not in stages  # `run` skips the tuner's verification: its side-by-side measures the plan again
    assert evidence["loader_trials"] and any(d.startswith("micro-batch:") for d in evidence["decisions"])
    assert evidence["plan"]["micro_batch"] * evidence["plan"]["grad_accum"] == 16
    rows = json.loads((tmp_path / "run" / "comparison.json").read_text())["rows"]
    labels = [r["label"] for r in rows]  # a runner-up when the search measured one
    assert labels in (["naive", "tuned", "training run"], ["naive", "runner-up", "tuned", "training run"]), labels
    assert all(r["samples_per_s"] and r["mfu"] for r in rows)  # MFU from the counted FLOPs


@pytest.mark.slow
def test_cli_train_with_a_module_function_and_a_bad_one(tmp_path):
    (tmp_path / "mywork.py").write_text(textwrap.dedent('''
        import torch, torch.nn as nn, saturate

        def workload(hidden=8):
            data = [(torch.randn(4, generator=torch.Generator().manual_seed(i)), torch.tensor(i % 2))
                    for i in range(64)]
            return saturate.custom_workload("mine", model=lambda: nn.Sequential(nn.Linear(4, hidden), nn.ReLU(),
                                            nn.Linear(hidden, 2)), dataset=data, val_dataset=data[:8],
                                            loss=nn.CrossEntropyLoss(), effective_batch=8, lr=1e-2)

        def broken():
            return saturate.custom_workload("mine", model=lambda: nn.Linear(4, 2), dataset=[1, 2, 3],
                                            loss=nn.CrossEntropyLoss(), effective_batch=8, lr=1e-2)
    '''))
    ok = subprocess.run(saturate_cmd("train", "--workload", "mywork:workload", "--param", "hidden=16", "--steps", "4",
                                     "--run-dir", "r", "--no-progress"),
                        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["mfu"] > 0
    run_json = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run_json["info"]["source"] == "mywork:workload"

    bad = subprocess.run(saturate_cmd("train", "--workload", "mywork:broken", "--steps", "4", "--run-dir", "r2"),
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("saturate: error: --workload mywork:broken:")
    assert "loss= needs batches of (inputs..., target)" in bad.stderr
    assert not (tmp_path / "r2").exists()  # nothing was written before the error


@pytest.mark.slow
def test_the_readme_cnn_learns_in_the_steps_the_readme_shows(tmp_path, cpu):
    """README, docs/models.md: `saturate train --workload examples/cnn.py:workload --steps 50` leaves chance
    (ln 10) far behind."""
    w = load_workload(f"{EXAMPLES / 'cnn.py'}:workload")
    result = train(w, None, RunConfig(run_dir=tmp_path / "run", steps=50, progress=False, tensorboard=False),
                   hardware=cpu)
    assert result.val_loss < 0.5 < math.log(10)
