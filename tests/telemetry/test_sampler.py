"""The telemetry sampler: failures never stop sampling; a window's statistics are measured or missing with a reason."""

from __future__ import annotations

import os
import time

import pytest

from saturate.hardware.gpu_sensors import GpuSource
from saturate.hardware.host_sensors import read_host
from saturate.telemetry import sampler as sampler_module
from saturate.telemetry.sampler import Sampler, Snapshot, Stat, swap_traffic


class CountingGpu(GpuSource):
    """A sensor that counts its readings and reads no GPU."""

    name = "counting"

    def __init__(self):
        super().__init__(None)
        self.calls = 0

    def read(self):
        self.calls += 1
        return []


class BrokenGpu(CountingGpu):
    name = "broken"

    def read(self):
        super().read()
        raise RuntimeError("GPU has fallen off the bus")


def test_sampler_keeps_sampling_through_a_failing_sensor():
    gpu = BrokenGpu()
    with Sampler(0.01, gpu=gpu, process_pid=os.getpid()) as s:
        deadline = time.time() + 10
        while len(s.snapshots) < 3 and time.time() < deadline:
            time.sleep(0.02)
    assert len(s.snapshots) >= 3 and gpu.calls >= 3
    assert all(snap.gpus == [] for snap in s.snapshots)
    assert "fallen off the bus" in s.errors[0]
    assert s.latest().process.main_bytes > 0
    n = len(s.snapshots)
    time.sleep(0.05)
    assert len(s.snapshots) == n  # stopped


def test_sampler_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        Sampler(0, gpu=GpuSource("none"))


def test_stat_of_nothing_is_missing_not_zero():
    assert Stat.of([None, None], ["NVML: Not Supported"]) == Stat(missing="NVML: Not Supported")
    s = Stat.of([10.0, None, 30.0], [])
    assert (s.mean, s.low, s.peak, s.samples) == (20.0, 10.0, 30.0, 2)


def test_swap_traffic_over_a_window():
    a, b = read_host(), read_host()
    a.swap_in, a.swap_out, b.swap_in, b.swap_out = 100, 200, 1100, 1200
    snaps = [Snapshot(0, 0, a, [], None), Snapshot(1, 1, b, [], None)]
    assert swap_traffic(snaps) == (2000, None)
    a.swap_in = None
    a.missing["swap_in"] = "swap traffic is only counted on Linux"
    assert swap_traffic(snaps) == (None, "swap traffic is only counted on Linux")


class CostlyGpu(CountingGpu):
    """A sensor whose reading burns 20 ms of the reading thread's CPU time."""

    name = "costly"

    def read(self):
        burn(0.02)
        return super().read()


def burn(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_cpu_share_caps_the_process_readings_not_the_gpu_ones(monkeypatch):
    trees = []

    def costly_tree(pid, proportional):
        trees.append(pid)
        burn(0.02)
        return None

    monkeypatch.setattr(sampler_module, "read_process_tree", costly_tree)
    gpu = CountingGpu()
    started = time.process_time()
    with Sampler(0.01, gpu=gpu, process_pid=os.getpid(), max_cpu_share=0.01) as s:
        deadline = time.time() + 30
        while gpu.calls < 10 and time.time() < deadline:
            time.sleep(0.02)
    used = time.process_time() - started
    assert gpu.calls >= 10 and s.process_read_seconds >= 0.02
    # 20 ms of CPU at 1 %: each next tree reading only once the process used 2 s more CPU time (here: one in all)
    assert len(trees) <= 1 + int(used / 2.0) and len(trees) < gpu.calls
    assert sum(snap.process is None for snap in s.snapshots) >= len(s.snapshots) - len(trees)


def test_a_reading_taken_just_before_start_is_not_repeated():
    gpu = CostlyGpu()
    s = Sampler(30.0, gpu=gpu)
    s.read_once()
    s.start()
    time.sleep(0.2)
    s.stop()
    assert gpu.calls == 1 and len(s.snapshots) == 1
