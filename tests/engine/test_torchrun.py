"""DDP and FSDP2 under torchrun on the CPU (gloo, two processes), through the real command line.

Every run trains gpt-tiny for a few steps at a global batch of 8: one process with 4 × 2, or two
processes with 4 × 1 each, so they see the same samples and must reach the same parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, cli_env, make_small_corpus, saturate_cmd
from saturate.engine.checkpoint import CheckpointManager
from saturate.engine.metrics import read_jsonl
from saturate.plan import Plan

pytestmark = pytest.mark.dist

STEPS = 8
TIMEOUT = 300


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def train_args(corpus: Path, plan: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--plan", str(plan), "--steps", str(STEPS), "--ckpt-every", "3",
            "--eval-every", "4", "--log-every", "1", "--run-dir", str(run_dir), *extra]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def env(shared: Path) -> dict[str, str]:
    return {**cli_env(), "SATURATE_CACHE": str(shared / "cache")}


@pytest.fixture(scope="module")
def corpus(shared: Path) -> Path:
    return make_small_corpus(shared)


@pytest.fixture(scope="module")
def plans(shared: Path) -> dict[str, Path]:
    """Global batch 8 each: one process 4 × 2, two processes 4 × 1."""
    found = {}
    for name, fields in {"single": dict(grad_accum=2), "ddp": dict(strategy="ddp"),
                         "fsdp": dict(strategy="fsdp")}.items():
        found[name] = shared / f"{name}.toml"
        Plan(micro_batch=4, **{"grad_accum": 1, **fields}).save(found[name])
    return found


def short(env: dict[str, str]) -> dict[str, str]:
    """`env` with trials cut short (stats/noise.py testing knob), for the tests of a tuning's flow, not its figures."""
    return {**env, "SATURATE_TESTING_SHORT_TRIALS": "1"}


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def single(shared: Path, corpus: Path, env: dict[str, str], plans: dict[str, Path]) -> Path:
    run_dir = shared / "single"
    run(saturate_cmd(*train_args(corpus, plans["single"], run_dir)), env)
    return run_dir


@pytest.fixture(scope="module")
def ddp(shared: Path, corpus: Path, env: dict[str, str], plans: dict[str, Path]) -> Path:
    run_dir = shared / "ddp"
    run(torchrun("-m", "saturate", *train_args(corpus, plans["ddp"], run_dir)), env)
    return run_dir


@pytest.fixture(scope="module")
def fsdp(shared: Path, corpus: Path, env: dict[str, str], plans: dict[str, Path]) -> Path:
    run_dir = shared / "fsdp"
    run(torchrun("-m", "saturate", *train_args(corpus, plans["fsdp"], run_dir)), env)
    return run_dir


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if key in r}


def assert_close_runs(a: Path, b: Path, exact: bool = False) -> None:
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, STEPS + 1)) and sorted(lb) == sorted(la)
    va, vb = losses(a, "val/loss"), losses(b, "val/loss")
    assert sorted(va) == sorted(vb) == [4, 8]
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    if exact:
        assert la == lb and va == vb
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
        return
    # Same samples, same maths, another summation order: float rounding only (Adam amplifies it
    # on near-zero gradients, so parameters are compared to a fraction of one update, lr 5e-4).
    assert [la[s] for s in sorted(la)] == pytest.approx([lb[s] for s in sorted(lb)], rel=1e-5)
    assert [va[s] for s in sorted(va)] == pytest.approx([vb[s] for s in sorted(vb)], rel=1e-5)
    for k in wa:
        assert (wa[k] - wb[k]).abs().max().item() < 5e-5, k


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(ddp, single):
    assert_close_runs(ddp, single)
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["plan"]["strategy"] == "ddp"
    assert [s for s, _ in CheckpointManager(ddp / "checkpoints").checkpoints()] == [3, 6, 8]
    assert (ddp / "checkpoints" / "ckpt-00000008" / ".metadata").is_file()  # a DCP folder


@pytest.mark.slow
def test_fsdp_two_processes_match_one_process(fsdp, single):
    assert_close_runs(fsdp, single)
    # Every rank wrote its own shard of the model and optimizer.
    assert sorted(p.name for p in (fsdp / "checkpoints" / "ckpt-00000008").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


def rank_pid(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker with RANK=rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no worker with RANK={rank}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_rank_resumes_exactly(strategy, request, tmp_path, shared, corpus, env, plans):
    reference = request.getfixturevalue(strategy)  # the uninterrupted two-process run
    run_dir = tmp_path / "killed"
    args = train_args(corpus, plans[strategy], run_dir)
    launcher = subprocess.Popen(torchrun("-m", "saturate", *args), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    victim = rank_pid(launcher, 1)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    deadline = time.monotonic() + TIMEOUT
    while not ckpts.checkpoints():
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    psutil.Process(victim).send_signal(signal.SIGKILL)
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0, out  # torchrun saw a worker die and stopped the other
    killed_at = ckpts.checkpoints()[-1][0]
    assert killed_at < STEPS, "the run finished before it could be killed"
    assert not (run_dir / "model.safetensors").exists()

    done = run(torchrun("-m", "saturate", *args, "--resume"), env)
    assert f"resuming at step {killed_at}" in done.stdout
    assert_close_runs(run_dir, reference, exact=True)  # bit-identical, like a one-process resume


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_in_one_process(tmp_path, fsdp, single, env, corpus, shared):
    """DCP reshards: the two-process FSDP checkpoint of step 6 continues in one process."""
    run_dir = tmp_path / "resharded"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(fsdp / "checkpoints" / "ckpt-00000006"), str(ckpt)], check=True)
    subprocess.run(["cp", str(fsdp / "metrics.jsonl"), str(run_dir)], check=True)
    done = run(saturate_cmd("train", "--data", str(corpus), "--steps", str(STEPS), "--ckpt-every", "3",
                            "--eval-every", "4", "--log-every", "1", "--run-dir", str(run_dir), "--resume"), env)
    assert "resuming a checkpoint of 2 process(es) with 1: grad_accum 1 -> 2" in done.stdout
    assert Plan.load(run_dir / "plan.toml").grad_accum == 2
    assert_close_runs(run_dir, single)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_fsdp(tmp_path, single, env, corpus, shared, plans):
    """A single-process checkpoint file is split into FSDP shards on two processes."""
    run_dir = tmp_path / "from-single"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    subprocess.run(["cp", str(single / "checkpoints" / "ckpt-00000006.pt"), str(ckpt)], check=True)
    subprocess.run(["cp", str(single / "metrics.jsonl"), str(run_dir)], check=True)
    done = run(torchrun("-m", "saturate", *train_args(corpus, plans["fsdp"], run_dir, "--resume")), env)
    assert "resuming at step 6" in done.stdout
    assert_close_runs(run_dir, single)


OOM_ON_RANK_1 = textwrap.dedent("""
    import os, sys
    from saturate.engine.step import OutOfMemoryError
    from saturate.workloads import gpt

    real_init = gpt.GPT.__init__

    def init(self, cfg):
        real_init(self, cfg)
        if os.environ["RANK"] == "1":  # only this rank runs out of memory, above 2 samples
            def hook(module, args):
                if args[0].shape[0] > 2:
                    raise OutOfMemoryError(f"simulated, {args[0].shape[0]} samples")
            self.register_forward_pre_hook(hook)

    gpt.GPT.__init__ = init
    from saturate.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_oom_on_one_rank_shrinks_both(tmp_path, shared, corpus, env, single, plans):
    script = tmp_path / "oom_rank1.py"
    script.write_text(OOM_ON_RANK_1)
    run_dir = tmp_path / "oom"
    done = run(torchrun(str(script), *train_args(corpus, plans["ddp"], run_dir)), env)
    assert "out of memory at micro-batch 4 (rank 1: simulated, 4 samples)" in done.stdout
    # Rank 0 never ran out of memory itself, yet it writes the plan both now run: 2 × 2 per process.
    plan = Plan.load(run_dir / "plan.toml")
    assert (plan.micro_batch, plan.grad_accum, plan.strategy) == (2, 2, "ddp")
    assert [r["plan/micro_batch"] for r in read_jsonl(run_dir / "metrics.jsonl") if "plan/micro_batch" in r] \
        == [2] * STEPS
    assert_close_runs(run_dir, single)  # the same samples and effective batch: the same training


RANK_1_FAILS_AT_STEP_3 = textwrap.dedent("""
    import os, sys
    import torch
    from saturate.engine.step import OutOfMemoryError
    from saturate.workloads import gpt

    KIND = sys.argv[1]
    real_init = gpt.GPT.__init__

    def init(self, cfg):
        real_init(self, cfg)
        calls = []

        def hook(module, args, output):
            if module.training:
                calls.append(1)
            if os.environ["RANK"] == "1" and len(calls) == 3:  # rank 1, third training forward: step 3
                if KIND == "oom":
                    raise OutOfMemoryError("simulated")
                return output * float("nan")
            return output

        self.register_forward_hook(hook)

    gpt.GPT.__init__ = init
    from saturate.cli import main
    code = main(sys.argv[2:])
    if KIND == "nan" and os.environ["RANK"] == "1":
        import time
        time.sleep(3)  # stay a moment, so torchrun does not stop rank 0 before it reports on its own
    sys.exit(code)
""")


@pytest.mark.slow
def test_oom_in_the_synchronising_backward_ends_every_rank_clearly(tmp_path, shared, corpus, env, plans):
    """At a proven micro-batch DDP overlaps the all-reduce with the last backward: an OOM there cannot be
    retried in lock-step, so the rank says why and exits, and torchrun stops the rank waiting for it."""
    script = tmp_path / "fail.py"
    script.write_text(RANK_1_FAILS_AT_STEP_3)
    started = time.monotonic()
    done = subprocess.run(torchrun(str(script), "oom", *train_args(corpus, plans["ddp"], tmp_path / "run")),
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0
    assert ("saturate: error: [rank 1] out of memory on rank 1 in the gradient-synchronising backward at "
            "micro-batch 4") in done.stderr, done.stderr[-4000:]
    # Rank 0 was inside the gradient all-reduce; if gloo reports the lost peer before torchrun stops it,
    # it says so in one line rather than a traceback.
    assert "[rank0]: Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # no hang until a collective's timeout


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_stops_every_rank(tmp_path, shared, corpus, env, plans):
    script = tmp_path / "nan.py"
    script.write_text(RANK_1_FAILS_AT_STEP_3)
    run_dir = tmp_path / "run"
    done = subprocess.run(torchrun(str(script), "nan", *train_args(corpus, plans["ddp"], run_dir)),
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0
    for rank in (0, 1):  # the loss is averaged over ranks before it is checked: both see nan and stop
        assert f"saturate: error: [rank {rank}] training loss became nan at step 3" in done.stderr
    assert [s for s, _ in CheckpointManager(run_dir / "checkpoints").checkpoints()] == []  # none for step 3


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path, corpus, env, plans):
    """A terminal's Ctrl-C reaches torchrun and every worker (and torchrun forwards it again): the ranks
    take it as one request, agree on the step, checkpoint it and exit."""
    run_dir = tmp_path / "interrupted"
    args = train_args(corpus, plans["ddp"], run_dir)
    args[args.index("--steps") + 1] = "200"
    launcher = subprocess.Popen(torchrun("-m", "saturate", *args), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    while not ((run_dir / "metrics.jsonl").exists() and losses(run_dir)):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    out, _ = launcher.communicate(timeout=120)
    assert CheckpointManager(run_dir / "checkpoints").checkpoints(), out[-5000:]
    stopped_at = CheckpointManager(run_dir / "checkpoints").checkpoints()[-1][0]
    assert 0 < stopped_at < 200
    assert max(losses(run_dir)) == stopped_at  # every step it ran was logged, and that step saved
    assert "saturate: interrupted" not in out and "lost contact" not in out, out[-3000:]  # no rank aborted
    assert "resume with: torchrun --nproc_per_node=2 -m saturate train --resume" in out


@pytest.mark.slow
def test_run_under_torchrun_tunes_compares_and_trains_as_one_job(tmp_path, corpus, env):
    """`torchrun -m saturate run`: every rank measures every trial together and takes the same
    decisions (DDP against FSDP2 included); rank 0 alone reports and writes; the plan splits the
    global batch over both processes and trains with it."""
    run_dir = tmp_path / "run"
    done = run(torchrun("-m", "saturate", "run", "--data", str(corpus), *TINY, "--effective-batch", "8", "--budget",
                        "150", "--steps", "4", "--no-compile", "--no-progress", "--run-dir", str(run_dir)), short(env))
    out = done.stdout
    assert out.count("saturate tune gpt-tiny") == 1 and "2 processes" in out  # reported once, by rank 0
    plan = Plan.load(run_dir / "tune" / "plan.toml")
    assert plan.strategy in ("ddp", "fsdp") and plan.micro_batch * plan.grad_accum * 2 == 8
    assert plan.provenance["world_size"] == 2 and plan.provenance["effective_batch"] == 8
    evidence = json.loads((run_dir / "tune" / "tune.json").read_text())
    trials = evidence["trials"]
    strategies = {t["strategy"] for t in trials}
    assert strategies == {"ddp", "fsdp"}, strategies  # both measured, the faster kept
    assert any(d.startswith("strategy: ") for d in evidence["decisions"])
    comparison = json.loads((run_dir / "comparison.json").read_text())
    assert comparison["processes"] == 2
    labels = [r["label"] for r in comparison["rows"]]  # a runner-up when the search measured one
    assert labels in (["naive", "tuned", "training run"], ["naive", "runner-up", "tuned", "training run"]), labels
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in comparison["rows"])
    assert max(losses(run_dir)) == 4
    cached = list((Path(env["SATURATE_CACHE"]) / "plans").glob("gpt-tiny-*-2p.toml"))
    assert len(cached) == 1  # kept apart from a one-process plan



@pytest.mark.slow
def test_run_under_torchrun_with_nothing_cached_trains_the_default_plan_at_once_on_every_rank(tmp_path, corpus, env):
    """No --budget and no plan cached: the default plan trains from its first step over both processes; rank 0's
    prediction from its first steps (too short to tune) reaches every rank, so none waits for a tuning."""
    run_dir = tmp_path / "run"
    own = {**short(env), "SATURATE_CACHE": str(tmp_path / "cache")}  # no plan another test here cached for this job
    done = run(torchrun("-m", "saturate", "run", "--data", str(corpus), *TINY, "--effective-batch", "8", "--steps",
                        "12", "--no-compile", "--no-progress", "--run-dir", str(run_dir)), own)
    out = done.stdout
    assert out.count("not tuned: the training is predicted at") == 1, out[-3000:]  # said once, by rank 0
    comparison = json.loads((run_dir / "comparison.json").read_text())
    assert comparison["processes"] == 2 and comparison["trained"] == "default"
    assert comparison["tuning"]["label"] == "default" and not (run_dir / "tune").exists()
    assert Plan.load(run_dir / "plan.toml").strategy == "ddp" and max(losses(run_dir)) == 12

OPTIMIZER_OOM_ON_RANK_1 = textwrap.dedent("""
    import os, sys
    from saturate.engine import step as step_module
    from saturate.engine.step import OutOfMemoryError
    from saturate.workloads import gpt

    seen = [0]
    real_init, real_step = gpt.GPT.__init__, step_module.optimizer_step

    def init(self, cfg):
        real_init(self, cfg)
        self.register_forward_pre_hook(lambda module, args: seen.__setitem__(0, args[0].shape[0]))

    def optimizer_step(*args, **kwargs):  # only rank 1, only after micro-batches above 2 samples
        if os.environ["RANK"] == "1" and seen[0] > 2:
            raise OutOfMemoryError(f"simulated in the optimizer step after micro-batch {seen[0]}")
        return real_step(*args, **kwargs)

    gpt.GPT.__init__ = init
    step_module.optimizer_step = optimizer_step
    from saturate.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_trial_failing_on_one_rank_outside_forward_backward_ends_on_both(tmp_path, corpus, env):
    """An OOM in one rank's optimizer step (where the optimizer's state is allocated) would leave the other
    rank waiting in the next all-reduce: both end the trial, as out of memory, and the search backs off."""
    script = tmp_path / "optimizer_oom.py"
    script.write_text(OPTIMIZER_OOM_ON_RANK_1)
    out_dir = tmp_path / "tune"
    done = run(torchrun(str(script), "tune", "--data", str(corpus), *TINY, "--effective-batch", "8", "--budget",
                        "150", "--no-compile", "--out", str(out_dir)), short(env))
    said = " ".join(done.stdout.split())  # the tables fit 80 columns: an outcome may wrap
    assert "rank 1: OutOfMemoryError: simulated in the optimizer step after micro-batch 4" in said, done.stdout
    plan = Plan.load(out_dir / "plan.toml")
    assert plan.micro_batch <= 2 and plan.micro_batch * plan.grad_accum * 2 == 8


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path, corpus, env, plans):
    """SLURM's early warning may reach the ranks at different moments (here: rank 1 only): the ranks agree
    on the step and on the reason, every rank writes its part of the checkpoint, rank 0 says so, exit 75."""
    run_dir = tmp_path / "preempted"
    args = [*train_args(corpus, plans["ddp"], run_dir), *TINY, "--ckpt-every", "100000", "--no-progress"]
    args[args.index("--steps") + 1] = "100000"
    launcher = subprocess.Popen(torchrun("-m", "saturate", *args), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    victim = rank_pid(launcher, 1)
    deadline = time.monotonic() + TIMEOUT
    while not ((run_dir / "metrics.jsonl").exists() and losses(run_dir)):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    psutil.Process(victim).send_signal(signal.SIGUSR1)
    out, _ = launcher.communicate(timeout=120)
    (stopped_at, path), = CheckpointManager(run_dir / "checkpoints").checkpoints()
    assert stopped_at == max(losses(run_dir)), out[-3000:]
    assert sorted(p.name for p in path.glob("rank-*.pt")) == ["rank-00000.pt", "rank-00001.pt"]
    assert f"saturate: stopped by SIGUSR1 at step {stopped_at}; checkpoint {path} written" in out
    # torchrun's report: the first rank to leave exits 75 (torchrun then stops any rank still exiting)
    assert "exitcode  : 75" in out, out[-3000:]
    assert "saturate/engine" not in out, out[-3000:]  # torchrun's own traceback (ChildFailedError) only


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_the_others_within_the_timeout(tmp_path, corpus, env, plans):
    """Rank 1 stopped with SIGSTOP: rank 0's next collective times out after --stuck-after seconds and it exits
    in one line naming rank 1 (whose heartbeat in the rendezvous store went stale), instead of waiting forever."""
    run_dir = tmp_path / "stuck"
    args = [*train_args(corpus, plans["ddp"], run_dir), *TINY, "--stuck-after", "5", "--no-progress"]
    args[args.index("--steps") + 1] = "100000"
    launcher = subprocess.Popen(torchrun("-m", "saturate", *args), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    victim = psutil.Process(rank_pid(launcher, 1))
    deadline = time.monotonic() + TIMEOUT
    while not ((run_dir / "metrics.jsonl").exists() and losses(run_dir)):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    seen = []
    for line in launcher.stdout:  # until rank 0 reports; torchrun would then wait 30 s to SIGKILL the stopped rank
        seen.append(line)
        if "saturate: error:" in line:
            break
    noticed_after = time.monotonic() - stopped_at
    with contextlib.suppress(psutil.NoSuchProcess):  # torchrun may have ended it already, once rank 0 exited
        victim.kill()  # what the scheduler does in the end; it also spares the test torchrun's 30 s wait
    out = "".join(seen) + launcher.communicate(timeout=120)[0]
    assert ("saturate: error: [rank 0] rank 1 (no sign of life for " in out
            and ") did not answer within 5 s: stopped, frozen or dead" in out), out[-3000:]
    assert noticed_after < 60, noticed_after
    assert "saturate/engine" not in out, out[-3000:]  # no traceback from the ranks
