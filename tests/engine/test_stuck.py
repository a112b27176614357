"""A data-loader worker that stops answering (blocked for real, opening a FIFO that no one writes) ends the run
in one line naming the loader's workers, after --stuck-after seconds, instead of hanging forever.
(A stuck rank under torchrun: test_torchrun.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import cli_env

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")

# The worker's read of sample 8 (the third step, at an effective batch of 4) blocks in open() on a FIFO.
HANGING_WORKER = textwrap.dedent("""
    import os, sys
    import torch.utils.data
    from saturate.data import loaders as windows

    real = windows.RandomWindows.__getitem__

    def getitem(self, index):
        if index >= 8 and torch.utils.data.get_worker_info() is not None:
            open(sys.argv[1], "rb").read()  # no writer: blocks for ever
        return real(self, index)

    windows.RandomWindows.__getitem__ = getitem
    from saturate.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
def test_a_hanging_loader_worker_ends_the_run_in_one_line(tmp_path, small_corpus):
    plan, fifo, script = tmp_path / "plan.toml", tmp_path / "fifo", tmp_path / "hang.py"
    plan.write_text("micro_batch = 4\nnum_workers = 1\nprefetch_factor = 2\npersistent_workers = true\n")
    os.mkfifo(fifo)
    script.write_text(HANGING_WORKER)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), str(fifo), "train", "--data", str(small_corpus), *TINY,
                             "--effective-batch", "4", "--plan", str(plan), "--steps", "100", "--log-every", "1",
                             "--stuck-after", "3", "--no-progress", "--run-dir", str(tmp_path / "run")],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    while proc.poll() is None and time.monotonic() - started < 120:
        try:
            workers |= {c.pid for c in psutil.Process(proc.pid).children()}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    (line,) = lines
    m = re.fullmatch(r"saturate: error: the data loader gave no batch for 3 s: a worker \(pids ([\d, ]+)\) is "
                     r"stuck; raise --stuck-after if a batch can legitimately take longer", line)
    assert m, line
    named = {int(p) for p in m.group(1).split(", ")}
    assert named and named <= workers
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in named)


@pytest.mark.parametrize("text", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation to complete",
    "Application timeout caused pair closure",  # gloo, when the pair's own deadline fires first (seen in CI)
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 5003 "
    "milliseconds before timing out.",
])
def test_each_backends_timeout_wording_names_the_silent_rank(monkeypatch, text):
    """Every wording gloo and NCCL use for a collective that timed out gives the one line naming the rank."""
    from saturate.cli import _stuck
    from saturate.engine import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "unresponsive_ranks", lambda world: [(1, 12.0)])
    line = _stuck(RuntimeError(text))
    assert line is not None and line.startswith("rank 1 (no sign of life for 12 s) did not answer within "), line
    assert _stuck(RuntimeError("Connection closed by peer")) is None  # a crashed peer is another message


def test_a_timeout_on_one_process_is_not_a_stuck_rank(monkeypatch):
    from saturate.cli import _stuck

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _stuck(RuntimeError("Timed out waiting 5000ms for recv operation to complete")) is None
