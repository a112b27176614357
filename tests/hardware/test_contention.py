"""The contention meter tells our own CPU use from other processes'."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import saturate
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


# An agent (as torchrun's) starts two ranks: one busy, one measuring; under torchrun the busy sibling is this job.
_RANKS = """
import os, subprocess, sys
busy = "import time\\nend = time.perf_counter() + 60\\nwhile time.perf_counter() < end: pass"
measure = ("import time; from saturate.hardware.contention import ContentionMeter; time.sleep(0.3); "
           "m = ContentionMeter(gpu=False).start(); time.sleep(1.2); print(m.stop().own_cores)")
env = dict(os.environ)
if sys.argv[1] == "torchrun":
    env.update(TORCHELASTIC_RUN_ID="test", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2")
else:
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        env.pop(k, None)
sibling = subprocess.Popen([sys.executable, "-c", busy], env=env)
out = subprocess.run([sys.executable, "-c", measure], env=env, capture_output=True, text=True, check=True).stdout
sibling.kill()  # busy until the measurement is read
sibling.wait()
print(out.strip())
"""


@pytest.mark.slow
def test_a_sibling_rank_of_a_torchrun_job_is_not_a_neighbour():
    # The job's own CPU use, read by the sleeping rank: it holds the busy sibling's under torchrun (up to a core,
    # less when other processes share the machine), and next to nothing for the same process outside a job.
    def own_cores(launch: str) -> float:
        src = str(Path(saturate.__file__).resolve().parents[1])  # the saturate under test, in the ranks too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, "-c", _RANKS, launch], capture_output=True, text=True, check=True,
                             timeout=60, env=env)
        return float(out.stdout.strip().splitlines()[-1])

    assert own_cores("torchrun") > 0.25
    assert own_cores("separate") < 0.1


def test_a_window_too_short_for_the_cpu_counters_is_not_read_as_busy():
    c = ContentionMeter(gpu=False).start().stop()  # microseconds: the 10 ms ticks cannot resolve it
    assert c.other_cores is None and c.own_cores is None and not c.significant()
    assert any("shorter than the 0.25 s the CPU time counters" in n for n in c.notes)
    assert c.line().startswith("contention not measured: CPU share not read")
