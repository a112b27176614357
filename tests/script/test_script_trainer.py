"""A Transformers `Trainer` script, unchanged (guide 3's before): `saturate doctor -- CMD` recognises the
Trainer and its TrainingArguments, says fixes in their terms, and never writes the script's output_dir."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from conftest import line_of, run_main, run_saturate
from saturate.doctor.findings import Fix, Prediction
from saturate.script.doctor_script import in_your_script

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "gpt2_finetune" / "train.py"
TINY = ["--size", "toy", "--max-length", "32", "--max-steps", "60"]


saturate = functools.partial(run_saturate, timeout=300)


@pytest.mark.slow
def test_doctor_recognises_the_trainer_and_leaves_its_output_dir_alone(tmp_path):
    out = saturate("doctor", "--warmup", "1", "--steps", "2", "--json", "--", sys.executable, str(SCRIPT), *TINY,
                   "--output-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    script = d["script"]
    assert script["model"]["class"] == "GPT2LMHeadModel"
    trainer = script["trainer"]
    assert trainer["class"] == "Trainer" and trainer["site"].endswith(line_of(SCRIPT, "Trainer(model="))
    assert trainer["args_class"] == "TrainingArguments"
    assert trainer["args_site"].endswith(line_of(SCRIPT, "TrainingArguments("))
    args = trainer["args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (8, 1)
    assert args["dataloader_num_workers"] == 0 and args["bf16"] is False and args["optim"] == "adamw_torch"
    assert args["output_dir"] == "user-out"
    assert trainer["in_force"]["output_dir"] != "user-out" and trainer["redirected"]["output_dir"]
    assert len(trainer["losses"]) == script["optimizer_steps"] and all(3 < x < 7 for x in trainer["losses"])
    assert script["loaders"][0]["batch_size"] == 8  # the Trainer's batch sampler's
    assert d["measurements"]["samples_per_step"] == 8
    assert not (tmp_path / "user-out").exists()  # neither the Trainer's start-up nor a save wrote it
    # its nan/inf filter reads the loss twice a micro-step inside Transformers: placed there, and the flag named
    sites = d["measurements"]["syncs_by_site"]
    assert list(sites) and all(k.startswith("transformers/trainer.py:") and "train.py:" in k for k in sites)
    assert "logging_nan_inf_filter=False" in script["trainer_syncs"]


@pytest.mark.slow
def test_human_report_says_the_trainer_and_its_arguments(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    out = saturate("doctor", "--warmup", "1", "--steps", "2", "--", sys.executable, "train.py", *TINY,
                   "--output-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"Transformers Trainer at {line_of(SCRIPT, 'Trainer(model=')}; TrainingArguments at " \
           f"{line_of(SCRIPT, 'TrainingArguments(')}" in out.stdout
    assert "per_device_train_batch_size=8" in out.stdout
    assert "its output_dir 'user-out' was not written" in out.stdout


TRAINER = {"class": "Trainer", "site": "train.py:82", "args_class": "TrainingArguments", "args_site": "train.py:65",
           "args": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "bf16": False,
                    "fp16": False, "optim": "adamw_torch"}}


@pytest.mark.parametrize(("changes", "edit"), [
    ({"num_workers": 2, "prefetch_factor": 4}, "dataloader_num_workers=2, dataloader_prefetch_factor=4"),
    ({"pin_memory": True, "persistent_workers": True},
     "dataloader_pin_memory=True, dataloader_persistent_workers=True"),
    ({"micro_batch": 4, "grad_accum": 2}, "per_device_train_batch_size=4, gradient_accumulation_steps=2"),
    ({"micro_batch": 2}, "per_device_train_batch_size=2, gradient_accumulation_steps=4"),  # effective batch kept
    ({"precision": "bf16"}, "bf16=True"),
    ({"compile": "default"}, "torch_compile=True"),
    ({"compile": "max-autotune"}, "torch_compile=True, torch_compile_mode='max-autotune'"),
    ({"activation_checkpointing": True}, "gradient_checkpointing=True"),
    ({"fused": True}, "optim='adamw_torch_fused'"),
    ({"tf32": True}, "tf32=True"),
])
def test_fixes_are_said_as_training_arguments(changes, edit):
    fix = Fix("t", changes, Prediction("step_s", 1.0, 0.5, "test"), "")
    lines = in_your_script(fix, {"loaders": [{"site": "train.py:83"}], "trainer": TRAINER}, "cuda")
    assert lines == [f"train.py:65: TrainingArguments(..., {edit})"]


def test_bf16_on_a_cpu_is_said_with_use_cpu_which_the_trainer_needs_for_it():
    fix = Fix("bf16", {"precision": "bf16"}, Prediction("step_s", 1.0, 0.5, "test"), "")
    assert in_your_script(fix, {"loaders": [], "trainer": TRAINER}, "cpu") == [
        "train.py:65: TrainingArguments(..., bf16=True, use_cpu=True)"]


# A Trainer that writes from its first step: a checkpoint every step, and TensorBoard logs.
SAVES_EVERY_STEP = """
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class Data(Dataset):
    def __len__(self):
        return 512
    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 64
        return {"input_ids": ids, "labels": ids}

model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="user-out", per_device_train_batch_size=4, max_steps=6, save_steps=1,
                         logging_steps=1, report_to=["tensorboard"], push_to_hub=False)
Trainer(model=model, args=args, train_dataset=Data()).train()
"""


@pytest.mark.slow
def test_trials_write_to_scratch_and_the_full_run_where_the_script_says(tmp_path, monkeypatch):
    from saturate.script.boundary import ChildSettings
    from saturate.script.command import run_instrumented

    pytest.importorskip("tensorboard")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saves.py").write_text(SAVES_EVERY_STEP)
    # a tune trial (doctor runs: test_doctor_recognises_the_trainer_and_leaves_its_output_dir_alone)
    run = run_instrumented([sys.executable, "saves.py"], ChildSettings(mode="trial", warmup=1, count_steps=0,
                                                                     steps=2, stop=True))
    trainer = run.report["trainer"]
    assert trainer["args"]["output_dir"] == "user-out" and trainer["args"]["report_to"] == ["tensorboard"]
    assert trainer["redirected"]["report_to"] == [] and "saturate-script-" in trainer["in_force"]["output_dir"]
    # redirected: not even the trial's scratch layer over the folder holds a user-out
    assert run.optimizer_steps >= 3 and not any("user-out" in w for w in run.written or [])
    full = run_instrumented([sys.executable, "saves.py"], ChildSettings(mode="apply", profile=False, stop=False))
    assert full.returncode == 0 and full.optimizer_steps == 6
    assert (tmp_path / "user-out" / "checkpoint-1").is_dir()  # the same script writes there when it really runs


@pytest.mark.slow
def test_tune_tries_the_training_arguments_and_says_them_as_an_edit(tmp_path):
    from saturate.hardware import probe

    out = saturate("tune", "--trial-steps", "3", "--trial-seconds", "1", "--json", "--out", str(tmp_path / "t"), "--",
                   sys.executable, str(SCRIPT), *TINY, "--output-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["trainer"]["class"] == "Trainer" and json.loads((tmp_path / "t" / "overrides.json").read_text()) == \
        d["overrides"]
    trials = {t["name"]: t for t in d["trials"]}
    base = trials["as written"]
    assert len(base["losses"]) >= 5  # warm-up and timed steps, each the sum of its micro-steps' losses
    if probe(measure_peaks=False, device="cpu").supports["bf16"]:
        bf16 = trials["bf16=True, use_cpu=True"]  # same seed, same batches: its losses are comparable
        assert bf16["overrides"]["trainer"] == {"bf16": True, "use_cpu": True}
        # each trial runs until its windows settle, so the two count different steps; the first ones line up
        n = len(bf16["losses"])
        assert "losses within" in bf16["outcome"] and 3 <= n <= len(base["losses"]), bf16
        assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(bf16["losses"], base["losses"][:n], strict=True))
    else:
        assert "precision: fp32 (no lower precision is native on cpu)" in d["decisions"]
    split = trials["micro-batch 4 × 2"]  # 8 × 1 as written: nothing above, so one step down, same effective batch
    assert split["samples_per_step"] == 8
    assert split["overrides"]["trainer"]["per_device_train_batch_size"] == 4
    assert split["overrides"]["trainer"]["gradient_accumulation_steps"] == 2
    assert trials['optim="adamw_torch_fused"']["overrides"]["trainer"]["optim"] == "adamw_torch_fused"
    assert any(x.startswith("torch_compile: not tried on cpu") for x in d["decisions"])
    assert any(x.startswith("gradient_checkpointing: not tried on cpu") for x in d["decisions"])
    fields = d["overrides"].get("trainer", {})  # which setting wins is the machine's to say: the edit says it
    site = d["trainer"]["args_site"]
    assert site.endswith(line_of(SCRIPT, "TrainingArguments("))
    expected = [f"{site}: TrainingArguments(..., {', '.join(f'{k}={v!r}' for k, v in fields.items())})"]
    assert d["edits"] == (expected if fields else [])
    assert not (tmp_path / "user-out").exists()  # no trial wrote where the script's real run does


@pytest.mark.slow
def test_run_applies_training_arguments_from_outside_and_the_full_run_writes_its_output(tmp_path):
    (tmp_path / "over.json").write_text(json.dumps({"trainer": {"optim": "adamw_torch_fused"}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "2", "--trial-seconds", "1", "--json", "--",
                   sys.executable, str(SCRIPT), "--size", "toy", "--max-length", "32", "--max-steps", "12",
                   "--output-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["as_written"]) == len(d["tuned"]) == 3  # alternating rounds
    full = d["full_run"]
    assert full["returncode"] == 0 and full["optimizer_steps"] == 12
    assert full["trainer"]["args"]["optim"] == "adamw_torch" and full["trainer"]["in_force"]["optim"] == \
        "adamw_torch_fused"
    assert full["trainer"]["redirected"] == {}  # the full run is the real one: its outputs go where the script says
    assert (tmp_path / "user-out" / "model.safetensors").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"trainer": {"learning_rate": 1e-3}}, "learning_rate not among the TrainingArguments fields saturate applies"),
    ({"trainer": [1]}, '"trainer" must be an object of TrainingArguments fields'),
])
def test_run_refuses_trainer_overrides_it_does_not_apply(tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.chdir(tmp_path)  # in process: the refusal comes before any script runs
    (tmp_path / "over.json").write_text(json.dumps(overrides))
    out = run_main(capsys, "run", "--overrides", "over.json", "--", sys.executable, "x.py")
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0]


@pytest.mark.slow
def test_run_stops_in_one_line_when_the_trainer_refuses_an_override(tmp_path):
    # refused by Transformers (fp16 and bf16 together; on a CPU, bf16 without use_cpu)
    (tmp_path / "over.json").write_text(json.dumps({"trainer": {"fp16": True, "bf16": True}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "1", "--trial-seconds", "1", "--",
                   sys.executable, str(SCRIPT), *TINY, "--output-dir", "user-out", cwd=tmp_path)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]  # after the script's progress bar, which ends without a newline
    assert "saturate: error: the script's Trainer refused the overrides {'fp16': True, 'bf16': True}: " \
           "ValueError: " in last
    assert not (tmp_path / "user-out").exists()  # stopped before the full run


def test_arguments_parsed_from_the_command_line_are_said_as_flags():
    parsed = {**TRAINER, "args_site": "run_clm.py:249", "args_from_command_line": True}
    fix = Fix("bf16", {"precision": "bf16", "micro_batch": 4, "grad_accum": 2},
              Prediction("step_s", 1.0, 0.5, "test"), "")
    assert in_your_script(fix, {"loaders": [], "trainer": parsed}, "cuda") == [
        "on the command line: --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --bf16 (the script "
        "parses its TrainingArguments from the command line at run_clm.py:249)"]


HF_ARGS = """
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
class Tokens(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
Trainer(model=model, args=args, train_dataset=Tokens()).train()
"""


@pytest.mark.slow
def test_the_doctor_sees_training_arguments_that_came_from_the_command_line(tmp_path):
    (tmp_path / "hf.py").write_text(HF_ARGS)
    out = saturate("doctor", "--warmup", "1", "--steps", "2", "--json", "--", sys.executable, "hf.py", "--output_dir",
                   "user-out", "--max_steps", "40", "--per_device_train_batch_size", "4", "--report_to", "none",
                   "--use_cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    trainer = json.loads(out.stdout)["script"]["trainer"]
    assert trainer["args_from_command_line"] is True
    assert trainer["args_site"].endswith(line_of(tmp_path / "hf.py", "parse_args_into_dataclasses"))
