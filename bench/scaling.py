"""Throughput per process at 1 and N processes under torchrun (DDP or FSDP): scaling efficiency.

Weak scaling, the usual data-parallel measure: every process keeps the same per-process work
(micro-batch × accumulation), so N processes train a global batch N times larger. Efficiency is
(tokens/s at N ÷ N) ÷ (tokens/s at 1), per round, its median and min..max printed. Goal on a GPU
node: ≥ 90 % for gpt-small with DDP.

Each run is a real `torchrun --standalone --nproc_per_node=N` of saturate's train() (the one-process
run too, so both pay the same launcher); warm-up W + N steps with log_every=W, the steps after W
timed by rank 0's synchronised clock (metrics.jsonl windows; validation and checkpoints excluded).
Process counts are interleaved over rounds (order reversed every other round).

On a CPU each process gets one thread (torchrun's OMP_NUM_THREADS=1), so N processes use N
cores: on a 2-core machine shared with other jobs this is a sanity check of the distributed
engine's overhead, not a measure of a CPU's scaling.

    PYTHONPATH=src python3 bench/scaling.py                       # CPU: gpt-tiny, 1 and 2 processes
    PYTHONPATH=src python3 bench/scaling.py --device cuda --preset gpt-small --nproc 1,8 --json scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import _harness as bench
from saturate.engine.distributed import barrier, dist_info, init_distributed, teardown_distributed
from saturate.engine.trainer import train
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads import build_workload


def worker(args: argparse.Namespace) -> None:
    """One torchrun'd run: every rank trains, rank 0 writes what it timed to args.out."""
    hw = probe(measure_peaks=False, device=args.device)
    info = init_distributed(torch.device(hw.torch_device).type)
    world = info.world_size
    plan = Plan(micro_batch=args.micro, grad_accum=args.accum, precision=args.precision, compile=args.compile,
                tf32=args.device == "cuda", fused_optimizer=args.device == "cuda", pin_memory=args.device == "cuda",
                non_blocking=args.device == "cuda", strategy=args.strategy if world > 1 else "single")
    workload = build_workload(args.preset, seed=args.seed)
    run_dir = Path(args.out).with_suffix(".run")
    config = bench.run_config(warmup=args.warmup, steps=args.steps, run_dir=run_dir, seed=args.seed,
                              use_tuned=False, host_memory_guard=False)
    result = train(workload, plan, config, hardware=hw)
    if dist_info().is_main:
        seconds, loss = bench.timed_window(bench.read_windows(run_dir), warmup=args.warmup, steps=args.steps)
        samples = args.steps * plan.samples_per_step(world)
        Path(args.out).write_text(json.dumps({
            "processes": world, "strategy": result.plan.strategy, "seconds": seconds,
            "tokens_per_s": samples * workload.tokens_per_sample / seconds,
            "loss": loss, "notes": result.notes, "environment": bench.environment(hw)}))
    barrier()
    if dist_info().is_main:
        shutil.rmtree(run_dir, ignore_errors=True)
    teardown_distributed()


def launch(nproc: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, "--worker", "--out", str(out), "--device", args.device, "--preset", args.preset,
           "--strategy", args.strategy, "--micro", str(args.micro), "--accum", str(args.accum),
           "--precision", args.precision, "--compile", args.compile, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                          os.environ.get("PYTHONPATH", "")])}
    if args.device == "cpu":  # one thread per process at every count (torchrun sets this only for N > 1)
        env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{nproc} process(es) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--preset", default=None, help="default: gpt-tiny on cpu, gpt-small on cuda")
    ap.add_argument("--nproc", default=None, help="comma-separated process counts (default: 1,2 on cpu; "
                                                   "1,<GPUs> on cuda)")
    ap.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    ap.add_argument("--micro", type=int, default=None, help="per-process micro-batch (default: 8 cpu, 16 cuda)")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--precision", default=None, help="default: fp32 on cpu, bf16 on cuda")
    ap.add_argument("--compile", default=None, help="default: none on cpu, default on cuda")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    bench.add_run_args(ap, steps=None, warmup=None, rounds=3)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.preset = args.preset or ("gpt-small" if gpu else "gpt-tiny")
    args.micro = args.micro or (16 if gpu else 8)
    args.precision = args.precision or ("bf16" if gpu else "fp32")
    args.compile = args.compile or ("default" if gpu else "none")
    args.steps = args.steps or (20 if gpu else 6)
    args.warmup = args.warmup or (5 if gpu else 2)
    if args.worker:
        worker(args)
        return

    if gpu and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return
    counts = ([int(n) for n in args.nproc.split(",")] if args.nproc
              else [1, torch.cuda.device_count()] if gpu else [1, 2])
    if gpu and max(counts) > torch.cuda.device_count():
        raise SystemExit(f"--nproc {max(counts)} but only {torch.cuda.device_count()} GPU(s)")
    results = bench.run_rounds(counts, args.rounds, lambda n, run_dir: launch(n, args, run_dir.with_suffix(".json")),
                               lambda r, n, res: f"round {r + 1}: {n} process(es) {res['tokens_per_s']:,.0f} tokens/s")

    per_process = {n: [x["tokens_per_s"] / n for x in results[n]] for n in counts}
    rows, out = [], {"config": vars(args), "environment": results[counts[0]][0]["environment"], "results": {}}
    for n in counts:
        tps = bench.Spread.of([x["tokens_per_s"] for x in results[n]])
        per = bench.Spread.of(per_process[n])
        eff = bench.Spread.of(bench.ratios(per_process[n], per_process[counts[0]])) if n != counts[0] else None
        rows.append([f"{n} ({results[n][0]['strategy']})", tps.fmt(",.0f"), per.fmt(",.0f"),
                     eff.fmt(".1f", 100, " %") if eff else "(baseline)"])
        out["results"][n] = {"tokens_per_s": tps.to_dict(), "per_process": per.to_dict(),
                             "efficiency": eff.to_dict() if eff else None}
    env = out["environment"]
    bench.print_table(
        f"{args.preset}, {args.micro} × {args.accum} per process, {args.precision}, compile {args.compile}; "
        f"{args.warmup} warm-up + {args.steps} timed steps; {args.rounds} rounds",
        ["processes", "tokens/s median (min..max)", "per process", "efficiency vs 1 (per round)"], rows,
        footer=[f"{env['device']} {env['device_names'] or env['cpu']}; torch {env['torch']}"])
    bench.write_json(args.json, out)


if __name__ == "__main__":
    main()
