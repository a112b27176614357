"""The micro-batch on a CPU, by precision: does a larger one train faster at the same effective batch?

The informed plan (`plan.default_plan`) takes the micro-batch by rule before anything is measured; this measures
the rule's ground. For each precision (fp32, and bf16 where probe() finds it native) the informed plan is trained
at each micro-batch that divides the effective batch (accumulation keeping the effective batch), all in one
process, interleaved over rounds (order reversed every other round), timed by the trainer's own clock after the
warm-up (bench/_harness.py). Each micro-batch's ratio to the smallest one of its precision is taken per round;
the median, the distribution-free interval of the median (stats/pairs.py: the tuner's own paired decision) and
min..max are printed.

    PYTHONPATH=src python3 bench/cpu_micro.py
    PYTHONPATH=src python3 bench/cpu_micro.py --param n_layer=6 --param n_embd=384 --micros 4,8,16,32
    PYTHONPATH=src python3 bench/cpu_micro.py --hf /tmp/peers/gpt-peer --data /tmp/peers/train.txt \
        --param seq_len=128 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import _harness as bench
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.stats.pairs import paired_comparison
from saturate.tune.evidence import plan_text
from saturate.workloads.coupling import workload_default_plan

MIN_GAIN: float = POLICY.gains.min_gain


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-tiny", help="the workload (default: gpt-tiny)")
    ap.add_argument("--hf", default=None, help="a local Hugging Face model folder instead of a preset")
    ap.add_argument("--data", default=None, help="the text file for --hf")
    ap.add_argument("--param", action="append", default=[], help="KEY=VALUE for the workload (repeatable)")
    ap.add_argument("--micros", default="8,16,32", help="the micro-batches, comma-separated (default: 8,16,32)")
    ap.add_argument("--precisions", default="fp32,bf16", help="the precisions (default: fp32,bf16)")
    # A warm-up of 4: the default plan's bf16 guard checks the first 4 steps with two extra forwards of the run's
    # first micro-batch each (engine/precision_guard.py), a cost that grows with the micro-batch.
    bench.add_run_args(ap, steps=6, warmup=4, rounds=4)
    args = ap.parse_args(argv)
    bench.require_positive(ap, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
    params = {k: _value(v) for k, _, v in (p.partition("=") for p in args.param)}

    hw = probe(measure_peaks=False, device="cpu")
    if args.hf:
        from saturate.workloads.hf import hf_workload
        workload = hf_workload(args.hf, data=[args.data] if args.data else None, seed=args.seed, **params)
        workload = dataclasses.replace(workload, val_data=None)
        name = args.hf
    else:
        workload = bench.bench_workload(args.preset, args.seed) if not params else dataclasses.replace(
            bench.build_workload(args.preset, seed=args.seed, **params), val_data=None)
        name = args.preset + "".join(f" {k}={v}" for k, v in params.items())
    informed, _ = workload_default_plan(workload, hw)
    batch = informed.micro_batch * informed.grad_accum
    micros = [m for m in (int(x) for x in args.micros.split(",")) if batch % m == 0]
    precisions = [p for p in args.precisions.split(",") if p == "fp32" or hw.supports.get(p)]
    plans: dict[str, Plan] = {}
    for p in precisions:
        for m in micros:
            plans[f"{p} {m}×{batch // m}"] = informed.replace(name=f"{p}-{m}", precision=p, micro_batch=m,
                                                              grad_accum=batch // m)
    print(f"{name} on {bench.device_label(hw)}: the informed plan is {plan_text(informed)}; "
          f"{len(plans)} plans, {args.rounds} rounds")
    results = bench.train_rounds(workload, plans, hw, args, lambda r, key, t: (
        f"round {r + 1}/{args.rounds}  {key:<12} {t.tokens_per_s:>10,.0f} tokens/s  {t.step_s:.3f} s/step"))
    figures = {key: bench.tokens_per_s(runs) for key, runs in results.items()}
    rows, summary = [], {}
    for p in precisions:
        keys = [k for k in plans if k.startswith(p + " ")]
        for k in keys:
            tps = bench.Spread.of(figures[k])
            entry = {"tokens_per_s": tps.to_dict(), "per_round": figures[k]}
            if k == keys[0]:
                vs = "1.00× (the reference)"
            else:
                per_round = bench.ratios(figures[k], figures[keys[0]])
                c = paired_comparison(per_round, MIN_GAIN)
                vs = f"{bench.Spread.of(per_round).fmt('.3f', unit='×')}; {c.text()}"
                entry |= {"ratio": bench.Spread.of(per_round).to_dict(), "comparison": c.text()}
            rows.append([k, tps.fmt(",.0f"), vs])
            summary[k] = entry
    bench.print_table(f"{name} on {bench.device_label(hw)}: {args.rounds} interleaved rounds × {args.steps} timed "
                      f"steps after {args.warmup}", ["plan", "tokens/s median (min..max)",
                                                     f"÷ {micros[0]} of its precision, per round"], rows, [])
    bench.write_json(args.json, {"benchmark": "cpu_micro", "workload": name, "environment": bench.environment(hw),
                                 "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
                                 "informed": plan_text(informed), "plans": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
