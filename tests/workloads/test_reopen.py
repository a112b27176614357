"""saturate.load_model(run_dir): a finished GPT run (model.json beside model.safetensors) and a --workload run
(which needs its build function) reopen with the trained weights: logits equal the last checkpoint's model."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import saturate
from saturate.cli import main
from saturate.engine.checkpoint import load_checkpoint
from saturate.errors import ConfigError
from saturate.workloads.gpt import GPT, GPTConfig

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


def newest_checkpoint(run_dir):
    return load_checkpoint(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1])


def test_a_gpt_run_reopens_with_its_trained_weights(tmp_path, small_corpus, capsys):
    run = tmp_path / "gpt"
    assert main(["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--steps", "2",
                 "--no-progress", "--run-dir", str(run)]) == 0
    record = json.loads((run / "model.json").read_text())
    assert record["kind"] == "saturate-gpt" and record["config"]["n_embd"] == 32 and record["tokenizer"] == "byte"
    model = saturate.load_model(run)
    assert isinstance(model, GPT) and not model.training
    reference = GPT(GPTConfig(**record["config"]))
    state = newest_checkpoint(run)
    assert state["step"] == 2
    reference.load_state_dict(state["model"])
    reference.eval()
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert not torch.equal(model(x), GPT(GPTConfig(**record["config"])).eval()(x))  # not a fresh model


WORKLOAD = textwrap.dedent('''
    import torch
    import saturate

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def regression():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return saturate.custom_workload("reg", model=build, dataset=data, loss=torch.nn.functional.mse_loss,
                                        effective_batch=8, lr=1e-2, steps=3, warmup_steps=1)
''')


def test_a_custom_run_needs_its_build_function(tmp_path, capsys):
    (tmp_path / "mine.py").write_text(WORKLOAD)
    run = tmp_path / "custom"
    spec = f"{tmp_path / 'mine.py'}:regression"
    assert main(["train", "--workload", spec, "--no-progress", "--run-dir", str(run)]) == 0
    with pytest.raises(ConfigError, match=rf"was trained from the workload {spec}, whose model only its code can "
                                          r"build: pass build=") as e:
        saturate.load_model(run)
    assert "\n" not in str(e.value)
    workload = saturate.load_workload(spec)
    model = saturate.load_model(run, build=workload.build_model)
    reference = workload.build_model()
    reference.load_state_dict(newest_checkpoint(run)["model"])
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert torch.equal(saturate.load_model(run, build=workload)(x), model(x))  # a Workload does as well


def test_load_model_refusals_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a run folder"):
        saturate.load_model(tmp_path / "nowhere")
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(ConfigError, match="has no model.safetensors; the run did not finish"):
        saturate.load_model(tmp_path / "unfinished")
