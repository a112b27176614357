"""Two runs, one run folder: the second is refused in one line naming the holder's PID (a real lock held by
another real process), the lock goes with its holder even on SIGKILL, and default folder names are unique."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from conftest import cli_env
from saturate.cli import main
from saturate.engine.resume import lock_run_dir, prepare_run_dir, release_run_dirs

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")
HOLDER = ("import sys, time; from pathlib import Path; from saturate.engine.resume import lock_run_dir; "
          "lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(120)")


def test_a_second_run_in_the_same_folder_is_refused(tmp_path, small_corpus, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=cli_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code = main(["train", "--data", str(small_corpus), *TINY, "--steps", "1", "--no-progress",
                     "--run-dir", str(run_dir)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"saturate: error: run folder {run_dir} is in use by another saturate run "
                                     f"(pid {holder.pid}); wait for it to end or choose another --run-dir"]
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock_run_dir(run_dir)  # the kernel released the killed holder's lock
    release_run_dirs()


def test_default_run_folders_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")  # the same second, for sure

    class W:
        name = "gpt-tiny"

    first, second = prepare_run_dir(None, False, W()), prepare_run_dir(None, False, W())
    assert first != second and first.is_dir() and second.is_dir()
    assert (first.name, second.name) == ("gpt-tiny-20260101-000000", "gpt-tiny-20260101-000000-2")


@pytest.fixture(autouse=True)
def _no_locks_left():
    yield
    release_run_dirs()
