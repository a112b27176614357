"""The background sampler during training: metrics it adds, the low-utilisation note, off switch."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.engine.watch import TrainingWatch
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads import Optimization, Workload


class SlowSamples(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        x = torch.full((8,), float(i % 7))
        return x, x.sum(0, keepdim=True)


def tiny_workload(delay: float) -> Workload:
    return Workload(name="watch-toy", build_model=lambda: nn.Linear(8, 1), train_data=SlowSamples(delay),
                    val_data=None, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                    optim=Optimization(effective_batch=4, lr=1e-3, warmup_steps=0, steps=1000, eval_every=1000))


def test_a_loop_waiting_for_data_gets_one_note_naming_the_data():
    notes: list[str] = []
    watch = TrainingWatch(torch.device("cpu"), notes.append, interval=0.05, sustained_s=0.4)
    with watch:
        for _ in range(12):
            with watch.timer("data"):
                time.sleep(0.05)  # the loader, waited on
            with watch.timer("forward"):
                pass  # compute that takes no time
            watch.window_metrics()
    assert len(notes) == 1, notes  # once per low stretch, not at every record
    assert "under 50 % busy" in notes[0] and "waiting for data" in notes[0]
    assert "raise plan.num_workers" in notes[0]


def test_low_utilisation_must_be_sustained_and_recovery_rearms_the_note():
    notes: list[str] = []
    watch = TrainingWatch(torch.device("cpu"), notes.append, enabled=False, sustained_s=10)
    watch.enabled = True  # drive the history by hand: (start, end, util %, data share, metrics)

    def window(start, end, util, data=0.0, **metrics):
        watch._history.append((start, end, util, data, metrics))
        watch._check()

    window(0, 4, 20.0)
    window(4, 8, 20.0)
    assert notes == []  # 8 s is not yet the 10 s stretch
    window(8, 12, 30.0, data=0.05, **{"host/ram_used_pct": 96.0})
    assert len(notes) == 1 and "host memory (96 % of RAM used)" in notes[0]
    window(12, 16, 25.0)
    assert len(notes) == 1
    window(16, 20, 90.0)  # recovered
    for t in (20, 24, 28):
        window(t, t + 4, 10.0)
    assert len(notes) == 2 and "likely host syncs or launch overhead" in notes[1]


def test_a_low_stretch_while_other_processes_kept_the_cores_busy_names_them():
    notes: list[str] = []
    watch = TrainingWatch(torch.device("cpu"), notes.append, enabled=False, sustained_s=8)
    watch.enabled, watch.cores = True, 2
    for t in (0, 4, 8):
        watch._history.append((t, t + 4, 30.0, 0.0, {"host/other_cores": 1.6, "host/cpu_pct": 80.0}))
        watch._check()
    assert len(notes) == 1 and "other processes (they kept 1.6 of 2 cores busy" in notes[0], notes
    assert "host syncs" not in notes[0]


def test_each_window_reads_the_other_processes_cores():
    watch = TrainingWatch(torch.device("cpu"), lambda _: None, interval=0.05)
    with watch:
        time.sleep(0.3)
        assert watch.window_metrics()["host/other_cores"] >= 0.0


def test_training_records_telemetry_and_can_turn_it_off(tmp_path):
    hw = probe(measure_peaks=False, device="cpu")
    plan = Plan(micro_batch=4)
    on = train(tiny_workload(0.0), plan, RunConfig(steps=4, log_every=2, run_dir=tmp_path / "on", progress=False,
                                                     tensorboard=False, export_weights=False), hardware=hw)
    records = [r for r in read_jsonl(on.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert len(records) == 2
    for r in records:
        assert 0.0 <= r["time/data_wait_share"] <= 1.0
        assert 0.0 <= r["cpu/util_pct"] <= 100.0
        assert "gpu/util_pct" not in r  # no GPU: left out, never written as 0
    off = train(tiny_workload(0.0), plan, RunConfig(steps=2, log_every=1, run_dir=tmp_path / "off", progress=False,
                                                      tensorboard=False, export_weights=False, telemetry=False),
                hardware=hw)
    for r in read_jsonl(off.run_dir / "metrics.jsonl"):
        assert not any(k.startswith(("gpu/", "host/", "cpu/")) or k == "time/data_wait_share" for k in r)


def test_training_on_slow_data_warns_on_the_console(tmp_path, monkeypatch, capsys):
    original = TrainingWatch.__init__  # the trainer's watch, with a 0.3 s stretch instead of 30 s

    def quick(self, device, note, *, enabled=True, interval=1.0, low_util_pct=50.0, sustained_s=30.0):
        original(self, device, note, enabled=enabled, interval=0.05, low_util_pct=low_util_pct, sustained_s=0.3)

    monkeypatch.setattr(TrainingWatch, "__init__", quick)
    hw = probe(measure_peaks=False, device="cpu")
    train(tiny_workload(0.02), Plan(micro_batch=4), RunConfig(steps=8, log_every=1, run_dir=tmp_path / "slow",
                                                               tensorboard=False, export_weights=False), hardware=hw)
    out = capsys.readouterr().out
    assert "waiting for data" in out and "under 50 % busy" in out


@pytest.mark.parametrize("phase", ["h2d", "forward", "backward", "optimizer"])
def test_only_the_data_wait_is_timed(phase):
    watch = TrainingWatch(torch.device("cpu"), print, enabled=True)
    with watch.timer(phase):
        time.sleep(0.01)
    assert watch.data_s == 0.0
    with watch.timer("data"):
        time.sleep(0.01)
    assert watch.data_s >= 0.01
    watch.sampler.stop()
