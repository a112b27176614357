"""Training speed after a stopped torch.compile, against a fresh process (issue 17).

Goal: a process whose compile trial was stopped in flight trains as fast as a fresh one (ratio 1.0).

Each round starts two subprocesses of this script, so both pay the same start-up:

* fresh:   eager gpt-tiny optimizer steps through saturate's Stepper (the code that trains), on
           pre-collated batches as in the tuner's model trials: W warm-up steps, then N steps, each
           timed; tokens/s over the N steps (the JSON keeps every step and the median step's rate);
* stopped: first the tuner's compile trial (RealMeasurer.model_trial with compile="default") on
           the same model, stopped in flight, then the same timed steps.

The stop is provoked where it used to leave work running: while inductor's compile threads build
the C++ kernels (each a g++). By default the alarm rings as the compilation starts waiting for its
kernel builds (all the forward graph's kernels queued, whatever the machine's speed: where a time
limit most often lands, since building takes most of a CPU compilation); `--limit S` uses a plain
time limit of S seconds instead, which lands wherever the compilation is by then.
Every stopped child gets an empty inductor cache (as on a first run), so there are kernels to build.
The two run in the same order each round, reversed every other round; tokens/s stopped ÷ fresh
is taken per round, and its median and min..max are printed, with the compiler processes still
running when the trial returned and during the timed steps (steps with any running, of N). The
timed stretch follows the stop at once and is short by default (N=8): left running, gpt-tiny's
queue of kernel builds lasts tens of seconds, a larger model's longer.

`--without-fix` is for this benchmark only (the before-the-fix figure): in the stopped child it puts
back what a stopped compile trial did before issue 17 (torch._dynamo.reset() and nothing else, no
set-up before the clock, one alarm).

    PYTHONPATH=src python3 bench/compile_stop.py                       # 3 rounds, W=2, N=8
    PYTHONPATH=src python3 bench/compile_stop.py --rounds 2 --json compile_stop.json
    PYTHONPATH=src python3 bench/compile_stop.py --without-fix         # the figure before the fix
    PYTHONPATH=src python3 bench/compile_stop.py --limit 20            # a time limit instead
    PYTHONPATH=src python3 bench/compile_stop.py --busy-below 30       # on a shared machine: wait for a lull
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from _harness import Spread, add_run_args, environment, interleaved, print_table, write_json

SIDES = ("fresh", "stopped")


def compiler_processes() -> list[str]:
    """This process's descendants, by name (none are started by eager training with num_workers 0)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.name())
        except psutil.NoSuchProcess:
            continue
    return out


def undo_fix() -> None:
    """What a stopped compile trial did before issue 17: reset dynamo, nothing else."""
    import torch

    from saturate.tune import measure, process

    measure.prepare_compiler = lambda device: None
    process._RING_AGAIN_S = 0.0  # one alarm
    process.CompileScope.discard = lambda self: torch._dynamo.reset()


def time_discard() -> list[float]:
    """The seconds CompileScope.discard (the cleanup after a stopped compile) takes, appended per call."""
    from saturate.tune import process

    discard, took = process.CompileScope.discard, []

    def timed(self: Any) -> None:
        started = time.perf_counter()
        discard(self)
        took.append(time.perf_counter() - started)

    process.CompileScope.discard = timed
    return took


def ring_at_the_wait() -> dict[str, int]:
    """Ring the alarm (the trial's own handler) as the compilation starts waiting for its kernel builds: all
    of the graph's kernels are queued then, the compile threads building the first two. Returns a record
    of how many kernels the compilation was waiting for."""
    from concurrent.futures import Future

    from torch._inductor.async_compile import AsyncCompile, CodeCacheFuture

    wait = AsyncCompile._wait_futures
    seen: dict[str, int] = {}

    def ring_then_wait(self: Any, scope: dict[str, Any]) -> None:
        if not seen:
            seen["kernels"] = sum(1 for v in scope.values() if isinstance(v, (Future, CodeCacheFuture)))
            os.kill(os.getpid(), signal.SIGALRM)
        wait(self, scope)

    AsyncCompile._wait_futures = ring_then_wait
    return seen


def timed_steps(workload: Any, plan: Any, warmup: int, steps: int) -> tuple[list[float], list[int]]:
    """Seconds of each of `steps` eager optimizer steps after `warmup`, through saturate's Stepper (the code
    that trains) on pre-collated batches, so the model alone is timed (the tuner's model trials do the same);
    and the compiler processes running after each."""
    import torch
    from torch.utils.data import default_collate

    from saturate.engine.step import Stepper

    torch.manual_seed(0)
    stepper = Stepper(workload, plan, torch.device("cpu"), workload.optim.lr, compile=False)
    m, data = plan.micro_batch, workload.train_data
    held = [default_collate([data[i] for i in range(j * m, (j + 1) * m)]) for j in range(4)]
    batches = itertools.cycle(held)
    for _ in range(warmup):
        stepper.step(batches)
    seconds, compilers = [], []
    for _ in range(steps):
        started = time.perf_counter()
        stepper.step(batches)  # on the CPU every op has finished when step() returns
        seconds.append(time.perf_counter() - started)
        compilers.append(len(compiler_processes()))  # outside the timed interval
    stepper.take_loss_sum()
    return seconds, compilers


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One side of a round, in its own process; returns what it measured."""
    from saturate.hardware import probe
    from saturate.plan import Plan
    from saturate.tune.measure import RealMeasurer
    from saturate.workloads import build_workload

    hw = probe(measure_peaks=False, device="cpu")
    workload = build_workload("gpt-tiny", seed=args.seed, effective_batch=args.micro)
    plan = Plan(name="eager", micro_batch=args.micro, grad_accum=1, num_workers=0)
    out: dict[str, Any] = {"side": args.child}
    if args.child == "stopped":
        if args.without_fix:
            undo_fix()
        rang = ring_at_the_wait() if args.limit is None else None
        discard_s = time_discard()
        measurer = RealMeasurer(workload, hw, seed=args.seed, min_steps=1, max_steps=1, min_seconds=0.0)
        started = time.perf_counter()
        trial = measurer.model_trial(plan.replace(compile="default"), "compile",
                                     compile_limit_s=args.limit if args.limit is not None else 3600.0)
        out["trial_s"] = time.perf_counter() - started
        out["trial_status"] = trial.status
        out["discard_s"] = sum(discard_s)
        if rang is not None and not rang:
            raise RuntimeError("the compilation waited for no kernel build, so it was not stopped while building")
        out["kernels_at_stop"] = rang.get("kernels") if rang is not None else None
        out["compilers_after_trial"] = compiler_processes()
    seconds, compilers = timed_steps(workload, plan, args.warmup, args.steps)
    tokens = plan.samples_per_step() * workload.tokens_per_sample
    out["step_s"], out["compilers_per_step"] = seconds, compilers
    out["tokens_per_s"] = tokens * len(seconds) / sum(seconds)
    out["tokens_per_s_median_step"] = tokens / statistics.median(seconds)
    out["compilers_after_training"] = compiler_processes()
    return out


def wait_for_idle(busy_below: float, patience_s: float = 300.0) -> float:
    """Wait until the machine's CPUs were less than `busy_below` % busy over a second (at most
    `patience_s`); the last busy % seen. On a shared machine other jobs otherwise decide the figures."""
    deadline = time.monotonic() + patience_s
    while True:
        busy = psutil.cpu_percent(interval=1.0)
        if busy < busy_below or time.monotonic() > deadline:
            return busy


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--micro", str(args.micro), "--seed", str(args.seed)]
    if args.without_fix:
        cmd.append("--without-fix")
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    busy = wait_for_idle(args.busy_below) if args.busy_below is not None else None
    with tempfile.TemporaryDirectory(prefix="compile_stop-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)  # empty: a first run's compilation
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"busy_pct_before": busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, steps=8, warmup=2, rounds=3)
    ap.add_argument("--micro", type=int, default=8, help="micro-batch = effective batch (default: 8)")
    ap.add_argument("--limit", type=float, help="stop the compilation at this time limit (default: as it "
                                                "starts waiting for its kernel builds)")
    ap.add_argument("--busy-below", type=float, metavar="PCT",
                    help="start each side once the CPUs were under PCT %% busy over a second (waits up to 5 min)")
    ap.add_argument("--without-fix", action="store_true", help="benchmark only: the behaviour before issue 17")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    results: dict[int, dict[str, dict[str, Any]]] = {}
    for r, side in interleaved(SIDES, args.rounds):
        results.setdefault(r, {})[side] = got = run_side(side, args)
        print(f"round {r + 1} {side}: {got['tokens_per_s']:.0f} tokens/s"
              + (f" (trial {got['trial_status']} after {got['trial_s']:.1f} s, compilers left "
                 f"{len(got['compilers_after_trial'])}, per step {got['compilers_per_step']})"
                 if side == "stopped" else ""), flush=True)

    ratios = [results[r]["stopped"]["tokens_per_s"] / results[r]["fresh"]["tokens_per_s"] for r in sorted(results)]
    rows = []
    for r in sorted(results):
        f, s = results[r]["fresh"], results[r]["stopped"]
        rows.append([str(r + 1), f"{f['tokens_per_s']:.0f}", f"{s['tokens_per_s']:.0f}", f"{ratios[r]:.2f}",
                     f"{s['trial_status']} {s['trial_s']:.1f} s", str(s["kernels_at_stop"]),
                     f"{s['discard_s']:.2f} s",
                     str(len(s["compilers_after_trial"])),
                     f"{sum(1 for n in s['compilers_per_step'] if n)} of {args.steps}"])
    spread = Spread.of(ratios)
    title = ("gpt-tiny eager training after a stopped compile vs a fresh process"
             + (" — WITHOUT the fix" if args.without_fix else ""))
    print_table(title, ["round", "fresh tok/s", "stopped tok/s", "ratio", "compile trial", "kernels", "cleanup",
                        "compilers left", "steps beside them"], rows,
                footer=[f"ratio stopped/fresh: {spread.fmt('.2f')} (median, min..max over {len(ratios)} rounds); "
                        "kernels: the compilation's queued kernel builds at the stop; compilers left: processes "
                        "running when the trial returned; steps beside them: timed steps with any running",
                        f"micro-batch {args.micro}, warm-up {args.warmup}, timed {args.steps} steps; stop: "
                        + ("as it waits for its kernel builds" if args.limit is None else f"{args.limit:g} s limit")])
    from saturate.hardware import probe

    write_json(args.json, {"environment": environment(probe(measure_peaks=False, device="cpu")),
                           "without_fix": args.without_fix, "limit": args.limit, "rounds": results,
                           "ratio": spread.to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
