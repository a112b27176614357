"""Host sensors: the host and the process tree measured, a worker that ends mid-read left out and said to be."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from saturate.hardware import host_sensors
from saturate.hardware.host_sensors import host_memory_budget, read_host, read_process_tree


def test_host_reading_is_measured():
    h = read_host()
    vm = psutil.virtual_memory()
    assert h.ram_total == vm.total
    assert 0 < h.ram_available <= h.ram_total


def test_process_tree_counts_a_child_and_survives_one_that_ends(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.time() + 10
        while child.pid not in [c.pid for c in psutil.Process().children()] and time.time() < deadline:
            time.sleep(0.05)
        tree = read_process_tree(os.getpid(), proportional=True)
        assert child.pid in tree.children_bytes
        assert tree.total_bytes >= tree.main_bytes > 0
        # The child ends between listing and reading: it is left out and said to be, nothing is invented.
        real = host_sensors._smaps_rollup

        def vanished(pid):
            if pid == child.pid:
                raise FileNotFoundError(pid)
            return real(pid)

        monkeypatch.setattr(host_sensors, "_smaps_rollup", vanished)
        tree = read_process_tree(os.getpid(), proportional=True)
        assert child.pid not in tree.children_bytes
        assert tree.missing[f"child {child.pid}"] == "ended during sampling"
        assert tree.main_bytes > 0
    finally:
        child.kill()
        child.wait()


def test_a_process_that_has_ended_is_reported_not_read():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    tree = read_process_tree(proc.pid)
    assert tree.total_bytes is None and "ended" in tree.missing["process"]


def test_host_memory_budget_respects_a_container_limit(monkeypatch):
    monkeypatch.setattr(host_sensors, "cgroup_memory", lambda: (4 * 2**30, 3 * 2**30))
    budget, source = host_memory_budget(own_bytes=2**30)
    assert budget == 4 * 2**30 - 2 * 2**30  # the limit less what the other processes in it use
    assert "cgroup" in source
    monkeypatch.setattr(host_sensors, "cgroup_memory", lambda: (None, None))
    budget, source = host_memory_budget(own_bytes=2**30)
    assert budget >= 2**30 and "available" in source
