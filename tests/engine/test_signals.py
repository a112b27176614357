"""Preemption: SIGTERM and SIGUSR1 stop a run at a step boundary with a checkpoint, as Ctrl-C does, through
the real command line in subprocesses sent real signals (a tiny model, so each run takes seconds)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import cli_env, saturate_cmd
from saturate.engine.checkpoint import CheckpointManager, load_checkpoint
from saturate.engine.metrics import read_jsonl

# A one-layer GPT of width 32 on 32-token windows: steps take milliseconds.
TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")
EXIT_PREEMPTED = 75


def tiny_args(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), *TINY, "--effective-batch", "4", "--steps", "100000",
            "--log-every", "1", "--ckpt-every", "100000", "--no-progress", "--run-dir", str(run_dir), *extra]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path) if "train/loss" in r] if path.exists() else []


def wait_until(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) early:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_checkpoints_says_so_exits_75_and_the_printed_resume_works(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    args = tiny_args(small_corpus, run_dir)
    args[args.index("--steps") + 1] = "30"
    proc = subprocess.Popen(saturate_cmd(*args), env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_until(lambda: bool(logged_steps(run_dir)), proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out
    (stopped_at, path), = CheckpointManager(run_dir / "checkpoints").checkpoints()
    assert stopped_at == max(logged_steps(run_dir)) < 30  # the step boundary it stopped at was logged and saved
    hint = f"resume with: saturate train --resume --run-dir {run_dir}"
    assert f"saturate: stopped by SIGTERM at step {stopped_at}; checkpoint {path} written; {hint}" in out
    assert "Traceback" not in out
    assert load_checkpoint(path)["step"] == stopped_at

    # What a requeued job does: the command exactly as printed (the run's workload flags are in its run.json).
    done = subprocess.run(saturate_cmd(*hint.split()[3:]), env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"resuming at step {stopped_at}" in done.stdout
    assert max(logged_steps(run_dir)) == 30 and (run_dir / "model.safetensors").is_file()


SLOW_STOP_SAVE = textwrap.dedent("""
    import pathlib, sys, time
    import torch
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "step" in obj:  # the checkpoint: say so, then take a while
            pathlib.Path(sys.argv[1]).write_text("writing")
            time.sleep(1.5)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    from saturate.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
def test_sigusr1_then_ctrl_c_during_the_save_leaves_a_whole_checkpoint(tmp_path, small_corpus):
    """SLURM's early warning (SIGUSR1), then a Ctrl-C (which would otherwise abort) while the checkpoint
    is being written: the write finishes, the stop is reported, no traceback, no temporary left."""
    run_dir, marker, script = tmp_path / "run", tmp_path / "writing", tmp_path / "slow_save.py"
    script.write_text(SLOW_STOP_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(marker), *tiny_args(small_corpus, run_dir)],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: bool(logged_steps(run_dir)), proc)
    proc.send_signal(signal.SIGUSR1)
    wait_until(marker.exists, proc)
    proc.send_signal(signal.SIGINT)  # while the checkpoint is being written
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out
    assert "Traceback" not in out
    (step, path), = CheckpointManager(run_dir / "checkpoints").checkpoints()
    assert load_checkpoint(path)["step"] == step == max(logged_steps(run_dir))
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))
    assert f"stopped by SIGUSR1 at step {step}" in out
