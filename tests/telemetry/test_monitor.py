"""`saturate monitor`: the host always, GPUs when there are any, the running job when there is one."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from rich.console import Console

from conftest import cli_env
from saturate.hardware.gpu_sensors import GpuSource
from saturate.hardware.readings import GpuReading
from saturate.telemetry import monitor


def _run_dir(root, name: str, pid: int, metrics: list[dict] | None) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"workload": "gpt-tiny", "total_steps": 300, "pid": pid}))
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


@pytest.mark.slow
def test_once_json_on_a_machine_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "saturate", "monitor", "--once", "--json"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    host = data["host"]
    assert host["ram_total"] > 0 and 0 <= host["cpu_pct"] <= 100
    assert data["job"] is None
    if not data["gpus"]:  # this machine: no GPU, and the reason is given
        assert data["gpu_source"] == "none" and data["gpu_note"].startswith("no GPU")


def test_the_running_job_is_found_by_its_live_pid(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _run_dir(tmp_path, "gpt-tiny-old", dead.pid, [{"step": 5, "throughput/tokens_per_s": 1.0, "train/loss": 9.0}])
    time.sleep(0.05)
    _run_dir(tmp_path, "gpt-tiny-live", os.getpid(), [
        {"step": 10, "train/loss": 3.5, "throughput/tokens_per_s": 8000.0},
        {"step": 10, "val/loss": 3.4},
        {"step": 20, "train/loss": 3.1, "throughput/tokens_per_s": 8100.0, "throughput/mfu": 0.75},
    ])
    with open(tmp_path / "gpt-tiny-live" / "metrics.jsonl", "a") as f:
        f.write('{"step": 30, "train/lo')  # a line the trainer is writing right now
    job = monitor.running_job(tmp_path)
    assert job["run_dir"].endswith("gpt-tiny-live") and job["pid"] == os.getpid()
    assert (job["step"], job["tokens_per_s"], job["loss"], job["total_steps"]) == (20, 8100.0, 3.1, 300)


def test_no_live_job_and_a_job_with_no_metrics_yet(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _run_dir(tmp_path, "a", dead.pid, [])
    assert monitor.running_job(tmp_path) is None
    _run_dir(tmp_path, "b", os.getpid(), None)
    assert monitor.running_job(tmp_path)["note"] == "no training metrics logged yet"


class FakeGpus(GpuSource):
    name = "fake"

    def read(self):
        return [GpuReading(0, "Fake H200", util_pct=97.0, mem_used=80 * 2**30, mem_total=140 * 2**30, power_w=650.0,
                           power_limit_w=700.0, sm_clock_mhz=1980.0, mem_clock_mhz=None, temp_c=None,
                           missing={"mem_clock_mhz": "NVML: Not Supported",
                                    "temp_c": "NVML: Insufficient Permissions"})]


def test_the_view_shows_unmeasured_sensors_as_n_a_with_their_reason(tmp_path):
    data = monitor.reading(FakeGpus(None), tmp_path)
    out = io.StringIO()
    Console(file=out, width=160).print(monitor.render(data, wide=True))  # wide: the clocks too
    text = out.getvalue()
    assert "Fake H200" in text and "97 %" in text and "650/700 W" in text and "1980 MHz" in text
    assert "n/a[1]" in text and "n/a[2]" in text
    assert "[1] NVML: Not Supported" in text and "[2] NVML: Insufficient Permissions" in text
    assert "no saturate training running" in text


def test_the_live_view_refreshes_then_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "open_gpu_source", lambda indices=None: FakeGpus(None))
    out = io.StringIO()
    assert monitor.run_monitor(interval=0.01, root=tmp_path, console=Console(file=out), max_updates=2) == 0
    assert "Fake H200" in out.getvalue()


def test_monitor_rejects_a_bad_interval(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "saturate", "monitor", "--interval", "0"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--interval must be > 0" in proc.stderr
