"""The contention meter tells our own CPU use from other processes'."""

from __future__ import annotations

import subprocess
import sys
import time

from saturate.hardware.contention import Contention, ContentionMeter


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def test_own_work_is_not_counted_as_a_neighbour():
    meter = ContentionMeter(gpu=False).start()
    _burn(0.6)
    c = meter.stop()
    assert c.own_cores is not None and c.own_cores > 0.6  # one busy thread, ~1 core


def test_another_process_tree_is_a_neighbour():
    # Measured on behalf of a sleeping process, this test's own busy loop is "someone else".
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = ContentionMeter(root_pid=sleeper.pid, gpu=False).start()
        _burn(0.6)
        c = meter.stop()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert c.other_cores is not None and c.other_cores > 0.6
    assert c.own_cores is not None and c.own_cores < 0.3
    assert c.significant()
    assert c.line().startswith("machine busy")
    d = c.to_dict()
    assert d["significant"] is True and d["other_cores"] == c.other_cores


def test_threshold_and_line_for_a_quiet_machine():
    quiet = Contention(seconds=2.0, usable_cores=8, other_cores=0.4, own_cores=7.5)
    assert not quiet.significant()
    assert quiet.line().startswith("machine quiet")
    busy = Contention(seconds=2.0, usable_cores=8, other_cores=2.5, own_cores=5.0)
    assert busy.significant()
    gpu = Contention(seconds=1.0, usable_cores=8, other_cores=0.0, own_cores=1.0,
                     gpu_neighbours=[{"gpu": 0, "pid": 1234, "name": "python", "memory_mib": 900}])
    assert gpu.significant() and "python (pid 1234, GPU 0)" in gpu.line()
    unknown = Contention(seconds=1.0, usable_cores=2, other_cores=None, own_cores=None, notes=["no /proc"])
    assert not unknown.significant() and "not measured" in unknown.line()
