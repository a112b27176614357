"""`SaturateCallback`: one line in a Transformers Trainer script adds telemetry, samples/s, MFU and the
doctor's verdict."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cli_env

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WITH_CALLBACK = """
import json, sys
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from saturate.integrations.transformers import SaturateCallback

class Data(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        ids = (torch.arange(i, i + 32) * 7) % 64
        return {"input_ids": ids, "labels": ids}

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=14, logging_steps=5, save_strategy="no", report_to="none", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Data())
callback = SaturateCallback(warmup=2, count_steps=1, steps=4, interval=0.2)
trainer.add_callback(callback)
trainer.train()
d = callback.diagnosis
print("RESULT " + json.dumps({"summary": callback.summary, "metrics": callback.metrics,
                              "verdict": d.verdict if d else None, "timed": d.measurements.steps if d else None,
                              "phases": d.measurements.phases if d else None,
                              "params": model.num_parameters(exclude_embeddings=True)}))
"""


@pytest.mark.slow
def test_one_line_adds_telemetry_samples_per_s_mfu_and_the_verdict(tmp_path):
    (tmp_path / "train.py").write_text(WITH_CALLBACK)
    env = cli_env()
    env["OMP_NUM_THREADS"] = "1"
    env["COLUMNS"] = "200"
    out = subprocess.run([sys.executable, "train.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert r["verdict"] and r["timed"] == 4  # the doctor's window ran inside the Trainer's own loop
    assert r["phases"]["forward"] > 0 and r["phases"]["backward"] > 0 and r["phases"]["optimizer"] > 0
    s = r["summary"]
    assert s["steps"] == 14 and s["samples_per_step"] == 8 and s["samples_per_s"] > 0
    assert s["flops_per_sample"] == 6 * 32 * r["params"]  # the Trainer's count: 6 × tokens × parameters
    if s["mfu"] is not None:
        assert 0 < s["mfu"] <= 1 and "FLOP/s" in s["mfu_note"]
    else:
        assert s["mfu_note"].startswith(("MFU n/a", "MFU unknown"))
    assert "host/cpu_pct" in s["telemetry"]
    assert r["metrics"]["samples_per_s"] > 0  # the last logging window's
    assert "saturate (SaturateCallback): the doctor on 4 timed steps" in out.stdout
    assert "saturate: 14 steps" in out.stdout and f"verdict: {r['verdict']}" in out.stdout


def test_mfu_is_never_shown_above_100_percent():
    from saturate.integrations.transformers import mfu

    value, note = mfu(100.0, 1e9, 1e12, "measured")
    assert value == pytest.approx(0.1) and note == "10.0 % of 1 TFLOP/s (measured)"
    value, note = mfu(100.0, 1e9, 5e10, "datasheet: X")  # 1e11 FLOP/s achieved against a 5e10 peak
    assert value is None and note.startswith("MFU n/a: measured throughput exceeds the peak estimate")
    assert "peak 50 GFLOP/s, achieved 100 GFLOP/s" in note
    assert mfu(100.0, 1e9, None, "unknown")[0] is None
    assert mfu(100.0, 0.0, 1e12, "measured")[1].startswith("MFU unknown: no FLOPs were counted")
    assert mfu(100.0, 1e9, 1e12, "measured", processes=2)[0] == pytest.approx(0.05)
