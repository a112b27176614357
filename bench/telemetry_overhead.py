"""The cost of the background telemetry sampler during training (goal: under 1 % of throughput).

Two measurements, in one process:

1. Side by side: train() with telemetry on and off (RunConfig.telemetry), interleaved over rounds
   (on, off | off, on | …), timed by the trainer's own clock over the steps after a warm-up (as in
   bench/_harness.py). Cost = on time ÷ off time − 1, per round; median and range printed. On a
   shared machine the round-to-round noise is several percent, so this bounds the cost only
   coarsely.
2. Directly: the sampler thread's own CPU time per second of sampling (`Sampler.read_seconds`,
   read with time.thread_time), from the same runs. The sampler can take no more than that from
   the training, so its share of throughput is at most that CPU time ÷ the cores training uses —
   a figure far below the noise of (1), and the one that shows whether the goal is met.

    PYTHONPATH=src python3 bench/telemetry_overhead.py                 # CPU, gpt-tiny 8 x 4, 6 rounds
    PYTHONPATH=src python3 bench/telemetry_overhead.py --device cuda   # GPU: NVML reads included
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import _harness as bench
import saturate.engine.watch as watch_module
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads import build_workload

_samplers: list = []


class _Recorded(watch_module.Sampler):
    """The trainer's sampler, kept after the run so its CPU time can be read."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        _samplers.append(self)


def timed(workload, plan, hw, warmup: int, steps: int, telemetry: bool,
          run_dir: Path) -> tuple[float, float | None]:
    """(seconds per timed step, sampler CPU seconds per wall second or None when off)."""
    _samplers.clear()
    start = time.monotonic()
    windows, _ = bench.train_windows(workload, plan, warmup=warmup, steps=steps, hardware=hw, run_dir=run_dir,
                                     telemetry=telemetry)
    wall = time.monotonic() - start
    last = windows[-1]
    if last["step"] != warmup + steps:
        raise RuntimeError(f"the last window ends at step {last['step']}")
    cpu_share = None
    if telemetry and _samplers:
        cpu_share = _samplers[0].read_seconds / wall
    return last["time/step_s"], cpu_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_run_args(ap, steps=20, warmup=20, rounds=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's; 1 keeps a shared 2-core machine's OpenMP "
                         "barrier stalls out of the comparison)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    watch_module.Sampler = _Recorded  # the watch builds its sampler through this name
    hw = probe(measure_peaks=False, device=args.device)
    gpu = hw.device_type in ("cuda", "rocm")
    workload = build_workload("gpt-tiny", effective_batch=32 if not gpu else 128)
    plan = Plan(micro_batch=8, grad_accum=4) if not gpu else Plan(micro_batch=32, grad_accum=4, precision="bf16",
                                                                  pin_memory=True, non_blocking=True)
    runs = bench.run_rounds(["on", "off"], args.rounds, lambda side, run_dir: timed(
        workload, plan, hw, args.warmup, args.steps, side == "on", run_dir))
    step_s = {side: [seconds for seconds, _ in measured] for side, measured in runs.items()}
    cpu_shares = [share for _, share in runs["on"] if share is not None]
    costs = [x - 1 for x in bench.ratios(step_s["on"], step_s["off"])]
    threads = torch.get_num_threads()
    cores = min(threads, hw.cpu_cores) if not gpu else 1
    bound = [s / cores for s in cpu_shares]
    bench.print_table(
        f"telemetry overhead — {bench.device_label(hw)}, gpt-tiny {plan.micro_batch} × {plan.grad_accum}, "
        f"{args.rounds} rounds of {args.steps} timed steps",
        ["telemetry", "s/step median (min..max)"],
        [[side, bench.Spread.of(step_s[side]).fmt(".4f")] for side in ("on", "off")],
        footer=[f"side by side: on ÷ off − 1 per round: {bench.Spread.of(costs).fmt('+.2f', 100, ' %')}",
                f"sampler thread CPU: {bench.Spread.of(cpu_shares).fmt('.4f', 100, ' %')} of one core; "
                f"bound on the throughput cost over {cores} training core(s): "
                f"{bench.Spread.of(bound).fmt('.4f', 100, ' %')}"])
    bench.write_json(args.json, {"environment": bench.environment(hw), "step_s": step_s, "costs": costs,
                                 "sampler_cpu_share": cpu_shares, "throughput_cost_bound": bound})


if __name__ == "__main__":
    main()
