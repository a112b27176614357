"""The tuner's goals, measured side by side in one process.

1. Speed-up: the tuned plan (what `saturate tune` writes, compile tried as usual) against the
   `naive` reference plan (and the guide's "after" plan on a GPU), all trained through saturate's
   train() in interleaved rounds (order reversed every other round). Goal on CPU/gpt-tiny: ≥ 2×
   naive tokens/s; on a GPU/gpt-small: ≥ 3× naive and ≥ 1.3× a6000-after.
2. Quality: an exhaustive grid over the knobs the tuner turns here (micro-batch over every exact
   split × precision × fused optimizer × loader workers; compile is left out of both sides, because
   each compile trial costs tens of seconds on a CPU), each point measured the way the tuner
   verifies a plan. Then the tuner (compile off) and the grid's best are re-measured side by side.
   Goals: tuned ≥ 95 % of the grid's best; tuning time ≤ 20 % of the grid's.

    PYTHONPATH=src python3 bench/tuner.py                      # gpt-tiny on the CPU
    PYTHONPATH=src python3 bench/tuner.py --preset gpt-small --device cuda --no-grid
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

import _harness as bench
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.run.flow import reference_plans
from saturate.tune import tune
from saturate.tune.api import fused_adamw_available
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload


def side_by_side(workload, hw, plans: dict[str, Plan], args) -> dict[str, list[float]]:
    runs = bench.train_rounds(workload, plans, hw, args, lambda r, name, timed: (
        f"  round {r}: {name:>24}  {timed.tokens_per_s:>10,.0f} tokens/s"))
    return {name: bench.tokens_per_s(timed) for name, timed in runs.items()}


def grid(workload, hw, args) -> tuple[list[tuple[Plan, float | None]], float]:
    measurer = RealMeasurer(workload, hw, seed=args.seed)
    e = workload.optim.effective_batch
    micros = [d for d in range(1, e + 1) if e % d == 0]
    precisions = ["fp32"] + (["bf16"] if hw.supports.get("bf16") else []) + \
        (["fp16"] if hw.device_type == "cuda" and not hw.supports.get("bf16") else [])
    fused = [False, True] if fused_adamw_available(__import__("torch").device(hw.torch_device)) else [False]
    workers = sorted({0, *[w for w in (1, 2, 4, 8) if w <= hw.cpu_cores]})
    started = time.monotonic()
    out = []
    for m, p, f, w in itertools.product(micros, precisions, fused, workers):
        plan = Plan(micro_batch=m, grad_accum=e // m, precision=p, fused_optimizer=f, num_workers=w,
                    prefetch_factor=2 if w else None, persistent_workers=w > 0,
                    pin_memory=hw.device_type == "cuda", non_blocking=hw.device_type == "cuda",
                    tf32=bool(hw.supports.get("tf32")))
        t = measurer.verify(plan)
        out.append((plan, t.samples_per_s if t.ok else None))
        print(f"  grid {m:>3}×{e // m:<3} {p} fused={f!s:5} workers={w}: "
              f"{t.samples_per_s or 0:8.1f} samples/s {t.status}", flush=True)
    return out, time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-tiny")
    ap.add_argument("--device")
    ap.add_argument("--no-grid", action="store_true", help="only the speed-up part")
    ap.add_argument("--planned-steps", type=int, help="steps the tuned plan is for (default: the preset's)")
    ap.add_argument("--vocab", type=int, help="a GPT preset's vocabulary instead of the byte tokenizer's "
                    "(50257: the GPT-2 124M shape llm.c and nanoGPT report)")
    ap.add_argument("--budget", type=float, help="the tuning budget in seconds (default: none, the search ends itself)")
    ap.add_argument("--no-naive", action="store_true", help="leave the naive plan out of the side by side "
                    "(ratios are then to the first plan left)")
    bench.add_run_args(ap, steps=8, warmup=2, rounds=3)
    args = ap.parse_args()

    hw = probe(measure_peaks=False, device=args.device)
    workload = build_workload(args.preset, seed=args.seed)
    if args.vocab:
        from gpu_small import with_vocab
        workload = with_vocab(workload, args.vocab)
    console = Console(width=160)
    print(f"# {args.preset} on {bench.device_label(hw)}, {time.strftime('%Y-%m-%d')}")
    result: dict = {"environment": bench.environment(hw), "preset": args.preset}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tuned = tune(workload, hw, out_dir=tmp / "tune", planned_steps=args.planned_steps, console=console,
                     use_cache=False, budget_s=args.budget)
        plans = {label: plan for label, plan in reference_plans(workload, hw.device_type)
                 if not (args.no_naive and label == "naive")}
        plans["tuned"] = tuned.plan
        tps = side_by_side(workload, hw, plans, args)
        base = next(iter(plans))
        ratios = bench.ratios_to(tps, base)
        rows = [[n, plans[n].precision, f"{plans[n].micro_batch}×{plans[n].grad_accum}",
                 bench.Spread.of(v).fmt(",.0f"), ratios[n].fmt(".2f", unit="×")] for n, v in tps.items()]
        bench.print_table("Tokens/s through train(), interleaved rounds (median (min..max))",
                          ["plan", "precision", "micro×accum", "tokens/s", f"× {base} (per round)"], rows,
                          footer=bench.tuning_footer(tuned))
        result["speedup"] = {"tokens_per_s": tps, "ratio_base": base,
                             "ratio_to_naive": {n: r.to_dict() for n, r in ratios.items()},
                             **bench.tuning_json(tuned), "tuned_plan": tuned.plan.to_dict() | {"provenance": None}}
        if not args.no_grid:
            nocompile = tune(workload, hw, out_dir=tmp / "tune-nc", planned_steps=args.planned_steps,
                             console=Console(file=open("/dev/null", "w")), try_compile=False,  # noqa: SIM115
                             use_cache=False)
            points, grid_s = grid(workload, hw, args)
            best_plan, best = max(((p, s) for p, s in points if s), key=lambda ps: ps[1])
            final = side_by_side(workload, hw, {"tuned (no compile)": nocompile.plan, "grid best": best_plan}, args)
            q = bench.Spread.of(bench.ratios(final["tuned (no compile)"], final["grid best"]))
            share = nocompile.search.seconds / grid_s
            bench.print_table("Tuner quality against an exhaustive grid", ["", "value"], [
                ["grid points", str(len(points))],
                ["grid best (grid measurement)", f"{best_plan.micro_batch}×{best_plan.grad_accum} {best_plan.precision}"
                 f" fused={best_plan.fused_optimizer} workers={best_plan.num_workers}: {best:.1f} samples/s"],
                ["tuned (no compile)", f"{nocompile.plan.micro_batch}×{nocompile.plan.grad_accum} "
                 f"{nocompile.plan.precision} fused={nocompile.plan.fused_optimizer} "
                 f"workers={nocompile.plan.num_workers}"],
                ["tuned / grid best, side by side", q.fmt(".3f")],
                ["tuning time / grid time", f"{nocompile.search.seconds:.0f} s / {grid_s:.0f} s = {share:.0%}"],
            ])
            result["quality"] = {"ratio": q.to_dict(), "tuning_seconds": nocompile.search.seconds,
                                 "grid_seconds": grid_s, "grid_points": len(points),
                                 "grid_best": best_plan.to_dict(), "tuned": nocompile.plan.to_dict() |
                                 {"provenance": None}}
    bench.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
