"""Tokens/s of gpt-tiny on the CPU: the naive reference plan against a hand-picked good plan.

Goal: the baseline the plan tuner has to reach or beat, and a split of where the speed-up comes
from. Every plan runs through saturate's train(), so this is what a user gets. The rows form a
ladder, each changing one thing from the row above:

    naive        REFERENCE_PLANS["naive"]: micro 8, fp32, foreach AdamW; grad_accum 1 -> 4 so
                 the effective batch is gpt-tiny's 32 (same learning rate, same samples per step)
    +fused       the fused AdamW kernel
    +micro M     micro-batch M (default 32) with accumulation to keep 32, still fp32
    +bf16        bf16 autocast (only where probe() finds native CPU bf16): the good plan

so "+micro" over "+fused" is the batch effect and "+bf16" over "+micro" the precision effect.
All use num_workers 0: a sample is a slice of a memory-mapped token array, cheaper to load in the
training process than to send from a worker.

Timing: each run is warm-up W + N steps with log_every=W; the steps after W are timed by the
trainer's own synchronised clock (metrics.jsonl windows; validation and checkpoints excluded).
Plans run in one process, interleaved over rounds (order reversed every other round); the ratio
to naive is taken per round from the same round's naive run, and its median and min..max are
printed. MFU is against the CPU's matmul peak for the row's precision, measured by probe() and
again once a round; the highest measurement is used (contention only ever lowers it).

    PYTHONPATH=src python3 bench/cpu_plans.py
    PYTHONPATH=src python3 bench/cpu_plans.py --rounds 2 --steps 4 --micro 16 --json cpu_plans.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import _harness as bench
from saturate.hardware import Hardware, measure_matmul_peak, probe
from saturate.hardware.mfu import mfu
from saturate.plan import Plan, reference_plan


def ladder(effective: int, micro: int, bf16: bool) -> list[Plan]:
    naive = reference_plan("naive")
    naive = naive.replace(grad_accum=effective // naive.micro_batch)
    fused = naive.replace(name="+fused", fused_optimizer=True)
    big = fused.replace(name=f"+micro {micro}", micro_batch=micro, grad_accum=effective // micro)
    plans = [naive, fused, big]
    if bf16:
        plans.append(big.replace(name="+bf16 (good)", precision="bf16"))
    return plans


def remeasure_peaks(hw: Hardware) -> None:
    """Keep the highest matmul peak seen: a peak measured while another job held a core is too low."""
    for dtype, value in list(hw.measured_peak_flops.items()):
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        bound = hw.peak_bounds.get(dtype, (float("inf"), ""))[0]  # the instruction set's ceiling
        hw.measured_peak_flops[dtype] = max(value, min(bound, measure_matmul_peak("cpu", torch_dtype)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=32, help="the good plan's micro-batch (default: 32)")
    bench.add_run_args(ap, steps=6, warmup=2, rounds=3)
    args = ap.parse_args(argv)
    bench.require_positive(ap, micro=args.micro, steps=args.steps, warmup=args.warmup, rounds=args.rounds)

    workload = bench.bench_workload("gpt-tiny", args.seed)
    effective = workload.optim.effective_batch
    naive_micro = reference_plan("naive").micro_batch
    if effective % args.micro or effective % naive_micro:
        ap.error(f"--micro {args.micro} must divide gpt-tiny's effective batch {effective}")
    hw = probe(measure_peaks=True, device="cpu")  # measured once; the MFU denominators
    bf16 = bool(hw.supports.get("bf16"))
    plans = {p.name: p for p in ladder(effective, args.micro, bf16)}

    notes = [f"naive is micro {naive_micro} x accum 1 (effective {naive_micro}); here accum "
             f"{effective // naive_micro} so every plan trains gpt-tiny's effective batch {effective}"]
    if not bf16:
        notes.append("no native bf16 on this CPU (software bf16 is slower than fp32): no +bf16 row; "
                     f"the good plan is +micro {args.micro}")
    print(f"gpt-tiny on {bench.device_label(hw)}: {len(plans)} plans, {args.warmup} warm-up + {args.steps} timed "
          f"steps, {args.rounds} rounds")

    def run(name: str, run_dir: Path) -> bench.Timed:
        if name == "naive":
            remeasure_peaks(hw)
        return bench.timed_train(workload, plans[name], warmup=args.warmup, steps=args.steps, hardware=hw,
                                 run_dir=run_dir, seed=args.seed)[0]

    results = bench.run_rounds(list(plans), args.rounds, run, lambda r, name, t: (
        f"round {r + 1}/{args.rounds}  {name:<14} {t.tokens_per_s:>10,.0f} tokens/s  {t.step_s:.3f} s/step"))

    ratios = bench.ratios_to({name: bench.tokens_per_s(runs) for name, runs in results.items()}, "naive")
    flops_per_token = workload.flops_per_sample / workload.tokens_per_sample
    rows, summary = [], {}
    for name, runs in results.items():
        plan = plans[name]
        tps, ratio = bench.Spread.of(bench.tokens_per_s(runs)), ratios[name]
        peak, source = hw.peak_flops(plan.precision)
        util = mfu(tps.median * flops_per_token, peak, source)
        rows.append([name, f"{plan.micro_batch} x {plan.grad_accum}", plan.precision,
                     "fused" if plan.fused_optimizer else "foreach", tps.fmt(",.0f"),
                     ratio.fmt(".2f", unit="x"), util.cell()])
        summary[name] = {"plan": plan.to_dict(), "tokens_per_s": tps.to_dict(),
                         "ratio_vs_naive": ratio.to_dict(), "mfu": util.to_dict(),
                         "per_round": [t.to_dict() for t in runs]}
    peaks = ", ".join(f"{d} {hw.measured_peak_flops[d] / 1e9:,.0f} GFLOP/s"
                      for d in ("fp32", "bf16") if d in hw.measured_peak_flops)
    bench.print_table(
        f"gpt-tiny on {bench.device_label(hw)}, {torch.get_num_threads()} threads: {args.rounds} rounds x "
        f"{args.steps} timed steps",
        ["plan", "micro x accum", "precision", "AdamW", "tokens/s median (min..max)", "vs naive (per round)",
         "MFU"], rows,
        [*notes, f"MFU against the highest matmul peak measured in this process: {peaks}"])

    bench.write_json(args.json, {
        "benchmark": "cpu_plans", "goal": "baseline tokens/s for the tuner: naive vs a hand-picked good plan",
        "environment": bench.environment(hw), "effective_batch": effective, "warmup_steps": args.warmup,
        "timed_steps": args.steps, "rounds": args.rounds, "measured_peak_flops": hw.measured_peak_flops,
        "notes": notes, "plans": summary,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
