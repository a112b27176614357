"""Lightning: `SaturateCallback` adds telemetry, samples/s, MFU and the doctor's verdict from inside a run, and
`saturate doctor -- CMD` recognises a Lightning Trainer and says fixes as its arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cli_env, line_of, saturate_cmd
from saturate.doctor.findings import Fix, Prediction
from saturate.script.doctor_script import in_your_script, in_your_terms

SCRIPT = """
import json, sys
import torch, torch.nn as nn
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1)), batch_size=8)
callbacks = []
if "--callback" in sys.argv:
    from saturate.integrations.lightning import SaturateCallback
    callbacks.append(SaturateCallback(warmup=2, count_steps=1, steps=4, interval=0.2))
trainer = pl.Trainer(max_steps=12, accumulate_grad_batches=2, log_every_n_steps=5, accelerator="cpu",
                     enable_progress_bar=False, enable_model_summary=False, logger=False, callbacks=callbacks)
trainer.fit(Module(), loader)
if callbacks:
    c = callbacks[0]
    print("RESULT " + json.dumps({"summary": c.summary, "metrics": c.metrics, "verdict": c.diagnosis.verdict,
                                  "timed": c.diagnosis.measurements.steps, "phases": c.diagnosis.measurements.phases}))
"""

pytest.importorskip("lightning")


def env() -> dict[str, str]:
    e = cli_env()
    e.update(OMP_NUM_THREADS="1", COLUMNS="200", PL_DISABLE_FORK="1")
    return e


@pytest.mark.slow
def test_the_callback_adds_samples_per_s_flops_and_the_verdict(tmp_path):
    (tmp_path / "fit.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "fit.py", "--callback"], env=env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert r["verdict"] and r["timed"] == 4  # the doctor's window ran inside Lightning's own loop
    assert r["phases"]["forward"] > 0 and r["phases"]["backward"] > 0 and r["phases"]["optimizer"] > 0
    s = r["summary"]
    assert s["steps"] == 12 and s["samples_per_step"] == 8 * 2 and s["samples_per_s"] > 0
    # forward 2·(16·32 + 32·1) per sample; backward: both weight gradients and the second layer's input gradient
    assert s["flops_per_sample"] == 2 * (16 * 32 + 32) + 2 * (16 * 32 + 32) + 2 * 32
    assert s["mfu"] is not None or s["mfu_note"].startswith(("MFU not shown", "MFU unknown"))
    assert "host/cpu_pct" in s["telemetry"] and r["metrics"]["samples_per_s"] > 0
    assert "saturate (SaturateCallback): the doctor on 4 timed steps" in out.stdout
    assert "saturate: 12 steps" in out.stdout


@pytest.mark.slow
def test_doctor_recognises_a_lightning_trainer_and_says_fixes_as_its_arguments(tmp_path):
    (tmp_path / "fit.py").write_text(SCRIPT.replace("max_steps=12", "max_steps=200"))
    out = subprocess.run(saturate_cmd("doctor", "--warmup", "1", "--steps", "2", "--json", "--", sys.executable,
                                      "fit.py"), env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    lightning = d["script"]["lightning"]
    assert lightning["class"] == "Trainer" and lightning["site"] == line_of(tmp_path / "fit.py", "pl.Trainer(")
    assert lightning["args"]["accumulate_grad_batches"] == 2 and lightning["args"]["max_steps"] == 200
    assert lightning["redirected"]["default_root_dir"]  # a doctor run writes nothing where the script's run does
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()
    assert d["script"]["loaders"][0]["site"] == line_of(tmp_path / "fit.py", "DataLoader(TensorDataset")
    assert d["measurements"]["samples_per_step"] == 16 and d["script"]["model"]["class"] == "Sequential"


REPORT = {"lightning": {"class": "Trainer", "site": "fit.py:30", "args": {"precision": None,
                                                                          "accumulate_grad_batches": 8}},
          "loaders": [{"site": "fit.py:20", "batch_size": 4}], "optimizer": {"class": "AdamW", "site": "fit.py:15"}}
P = Prediction("step_s", 1.0, 0.5, "test")


def test_fixes_are_said_as_lightning_trainer_arguments():
    assert in_your_script(Fix("bf16", {"precision": "bf16"}, P, ""), REPORT, "cuda") == [
        "fit.py:30: Trainer(..., precision='bf16-mixed')"]
    assert in_your_script(Fix("micro", {"micro_batch": 16, "grad_accum": 2}, P, ""), REPORT, "cuda") == [
        "fit.py:30: Trainer(..., accumulate_grad_batches=2)", "fit.py:20: DataLoader(..., batch_size=16)"]
    assert in_your_script(Fix("workers", {"num_workers": 2}, P, ""), REPORT, "cuda") == [
        "fit.py:20: DataLoader(..., num_workers=2)"]
    assert in_your_script(Fix("fused", {"fused": True}, P, ""), REPORT, "cuda") == ["fit.py:15: AdamW(..., fused=True)"]
    assert in_your_script(Fix("one thread", {"threads": 1}, P, ""), REPORT, "cpu") == [  # the doctor on a busy CPU
        "torch.set_num_threads(1) before training, or OMP_NUM_THREADS=1 in the script's environment"]


def test_fix_titles_name_the_knobs_where_the_user_sets_them():
    micro = Fix("micro-batch 4 → 16, accumulation 8 → 2 (same effective batch)", {"micro_batch": 16, "grad_accum": 2},
                P, "")
    assert in_your_terms(micro, REPORT, "cuda") == "DataLoader batch_size 4 → 16, accumulate_grad_batches 8 → 2"
    assert in_your_terms(Fix("precision fp32 → bf16 autocast", {"precision": "bf16"}, P, ""), REPORT, "cuda") == \
        "precision None → 'bf16-mixed'"
    workers = Fix("DataLoader num_workers 0 → 2", {"num_workers": 2}, P, "")
    assert in_your_terms(workers, REPORT, "cuda") == "DataLoader num_workers 0 → 2"  # already the user's terms
    trainer = {"trainer": {"args": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                    "dataloader_num_workers": 0, "bf16": False}}, "loaders": []}
    assert in_your_terms(workers, trainer, "cuda") == "dataloader_num_workers 0 → 2"
    micro = Fix("micro-batch 8 → 4, accumulation 1 → 2", {"micro_batch": 4, "grad_accum": 2}, P, "")
    assert in_your_terms(micro, trainer, "cuda") == \
        "per_device_train_batch_size 8 → 4, gradient_accumulation_steps 1 → 2"
    assert in_your_terms(Fix("precision fp32 → bf16 autocast", {"precision": "bf16"}, P, ""), trainer, "cpu") == \
        "bf16 False → True, use_cpu=True"
    code = Fix("keep losses and metrics on the device; read them every N steps", {}, P, "")
    assert in_your_terms(code, trainer, "cuda") == code.title
