"""Tokens/s of the informed starting plan against the plan the tuner reaches from it (issue 30's "within 15 %").

The informed plan is what saturate trains without measuring (`plan.default_plan` through
`workload_default_plan`: bf16 only where native, fused AdamW where torch has the kernel, TF32 on Ampere and
later, the micro-batch by rule, loader workers and pinning from the cores on a GPU). The tuned plan is `tune()`'s
result within `--budget`, which since the search starts from the informed plan is the informed plan with what
the trials measured beyond the noise changed. Both then train through train() in interleaved rounds (order
reversed every other round), timed by the trainer's own synchronised clock after the warm-up (bench/_harness.py);
the ratio tuned ÷ informed is taken per round, and its median with the distribution-free interval of the median
(stats/pairs.py, the tuner's own paired decision) and min..max are printed. With the same settings (nothing
changed by the tuning) the plans are the same and one row is measured.

    PYTHONPATH=src python3 bench/informed_vs_tuned.py
    PYTHONPATH=src python3 bench/informed_vs_tuned.py --preset gpt-small --budget 120 --rounds 6 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console

import _harness as bench
from saturate.hardware import probe
from saturate.plan import Plan, informed_summary
from saturate.stats.pairs import paired_comparison
from saturate.tune import tune
from saturate.tune.evidence import plan_text
from saturate.tune.results import SearchSettings
from saturate.tune.trial import BudgetTooSmall
from saturate.workloads.coupling import workload_default_plan

GOAL = 1.15  # issue 30: the informed plan alone within 15 % of the tuned plan's tokens/s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-tiny", help="the workload (default: gpt-tiny)")
    ap.add_argument("--budget", type=float, default=60.0, help="the tuning budget in seconds (default: 60)")
    ap.add_argument("--device", default=None, help="cpu, cuda, … (default: what probe() picks)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out of the tuning")
    bench.add_run_args(ap, steps=6, warmup=2, rounds=6)
    args = ap.parse_args(argv)
    bench.require_positive(ap, steps=args.steps, warmup=args.warmup, rounds=args.rounds)

    hw = probe(measure_peaks=False, device=args.device)
    workload = bench.bench_workload(args.preset, args.seed)
    informed, _ = workload_default_plan(workload, hw)
    informed = informed.replace(name="informed")
    print(f"{args.preset} on {bench.device_label(hw)}: the informed plan is {informed_summary(informed)}")
    try:
        with tempfile.TemporaryDirectory(prefix="saturate-bench-tune-") as tmp:
            tuned_result = tune(workload, hw, budget_s=args.budget, out_dir=Path(tmp) / "tune", seed=args.seed,
                                try_compile=not args.no_compile, use_cache=False, console=Console(width=120),
                                keep=False)
    except BudgetTooSmall as e:  # a loaded machine: the first trial alone overran the budget; said, nothing measured
        print(f"not measured: {e}")
        bench.write_json(args.json, {"benchmark": "informed_vs_tuned", "skipped": str(e),
                                     "environment": bench.environment(hw)})
        return 2
    tuned = tuned_result.plan.replace(name="tuned")
    same = tuned.knobs() == informed.knobs() and all(
        getattr(tuned, f) == getattr(informed, f) for f in ("num_workers", "pin_memory", "prefetch_factor"))
    plans: dict[str, Plan] = {"informed": informed} if same else {"informed": informed, "tuned": tuned}
    print(f"tuned in {tuned_result.search.seconds:.0f} s: {plan_text(tuned)}, {tuned.num_workers} loader worker(s)"
          + ("; the same settings as the informed plan: measured once" if same else ""))

    results = bench.train_rounds(workload, plans, hw, args, lambda r, name, t: (
        f"round {r + 1}/{args.rounds}  {name:<9} {t.tokens_per_s:>10,.0f} tokens/s  {t.step_s:.3f} s/step"))
    figures = {name: bench.tokens_per_s(runs) for name, runs in results.items()}
    rows, summary = [], {}
    for name, plan in plans.items():
        tps = bench.Spread.of(figures[name])
        rows.append([name, plan_text(plan), str(plan.num_workers), tps.fmt(",.0f")])
        summary[name] = {"plan": plan.to_dict() | {"provenance": None}, "tokens_per_s": tps.to_dict(),
                         "per_round": [t.to_dict() for t in results[name]]}
    footer = bench.tuning_footer(tuned_result)
    verdict: dict[str, object] = {"same_settings": same}
    if not same:
        per_round = bench.ratios(figures["tuned"], figures["informed"])
        c = paired_comparison(per_round, SearchSettings.__dataclass_fields__["min_gain"].default)
        spread = bench.Spread.of(per_round)
        met = spread.median <= GOAL
        footer.insert(0, f"tuned ÷ informed per round: {spread.fmt('.3f', unit='×')}; {c.text()}; goal ≤ "
                         f"{GOAL:.2f}× (the informed plan within 15 %): {'met' if met else 'NOT met'}")
        verdict.update(ratio=spread.to_dict(), comparison=c.text(), goal=GOAL, met=met)
    bench.print_table(f"{args.preset} on {bench.device_label(hw)}: {args.rounds} interleaved rounds × {args.steps} "
                      f"timed steps after {args.warmup}", ["plan", "settings", "workers", "tokens/s median (min..max)"],
                      rows, footer)
    bench.write_json(args.json, {
        "benchmark": "informed_vs_tuned", "goal": "the informed plan within 15 % of the tuned plan's tokens/s",
        "preset": args.preset, "environment": bench.environment(hw), "budget_s": args.budget,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds, "plans": summary,
        **verdict, **bench.tuning_json(tuned_result),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
