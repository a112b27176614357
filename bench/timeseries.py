"""Any model, side by side: the tuned plan against the guides' hand-tuned plans, in one process.

1. ts-lstm (the time-series guide's job): `saturate tune`'s plan against `timeseries-before` (batch
   128, 4 workers, fp32) and `timeseries-after` (batch 256, 8 workers, prefetch 4, pinned and
   persistent workers, TF32, torch.compile max-autotune), each at the workload's effective batch
   (micro-batch kept, accumulation adjusted), trained through saturate's train() in interleaved rounds.
2. With --hf-gpt2 on a CUDA GPU: a GPT-2 124M ("gpt-small"-sized) built through Hugging Face
   Transformers from a local config (no weights, nothing downloaded; the byte tokenizer on the
   embedded corpus), tuned against the ROCm guide's `rocm-after` plan (32 × 4, 4 workers). Without
   CUDA it prints "no CUDA device: skipped".

Figures: tokens/s (= samples/s for ts-lstm) of the timed steps after a warm-up, by the trainer's own
synchronised clock; the ratio to the guide's "before" (or "after") is taken per round, so a noisy
machine moves both sides together.

    PYTHONPATH=src python3 bench/timeseries.py                          # ts-lstm on this machine
    PYTHONPATH=src python3 bench/timeseries.py --hidden 64 --rounds 2   # the guide's "before" model size
    PYTHONPATH=src python3 bench/timeseries.py --hf-gpt2 --device cuda  # GPT-2 via Transformers on a GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

import _harness as bench
from saturate.hardware import probe
from saturate.plan import Plan, reference_plan
from saturate.run.flow import at_effective_batch
from saturate.tune import tune
from saturate.workloads.timeseries import ts_lstm_workload


def compare(title: str, workload, hw, plans: dict[str, Plan], base: str, args, tuned) -> dict:
    def line(r: int, name: str, timed: bench.Timed) -> str:
        compiled = f" (compile: {plans[name].compile})" if plans[name].compile != "none" else ""
        return (f"  round {r}: {name:>18}  {timed.tokens_per_s:>10,.1f} samples/s{compiled}"
                + (f"  notes: {'; '.join(timed.notes)}" if timed.notes else ""))

    tps = {name: bench.tokens_per_s(runs) for name, runs in bench.train_rounds(workload, plans, hw, args, line).items()}
    ratios = bench.ratios_to(tps, base)
    unit = "tokens/s" if workload.tokens_per_sample > 1 else "samples/s"
    rows = [[n, f"{p.micro_batch}×{p.grad_accum}", p.precision + ("+tf32" if p.tf32 else ""), str(p.num_workers),
             p.compile, bench.Spread.of(tps[n]).fmt(",.1f"), ratios[n].fmt(".2f", unit="×")] for n, p in plans.items()]
    bench.print_table(f"{title}: {unit} through train(), interleaved rounds (median (min..max))",
                      ["plan", "micro×accum", "precision", "workers", "compile", unit, f"× {base} (per round)"], rows,
                      footer=bench.tuning_footer(tuned))
    return {"throughput": tps, "ratio_to_" + base: {n: r.to_dict() for n, r in ratios.items()},
            "plans": {n: p.to_dict() | {"provenance": None} for n, p in plans.items()}, **bench.tuning_json(tuned)}


def timeseries(args, hw, tmp: Path) -> dict:
    workload = ts_lstm_workload(hidden=args.hidden, window=args.window, seed=args.seed)
    e = workload.optim.effective_batch
    print(f"# ts-lstm (hidden {args.hidden}, window {args.window}, {workload.info['series']} series, effective "
          f"batch {e}) on {bench.device_label(hw)}, {time.strftime('%Y-%m-%d')}", flush=True)
    tuned = tune(workload, hw, out_dir=tmp / "tune", budget_s=args.budget, console=Console(width=160),
                 use_cache=False, planned_steps=args.planned_steps)
    plans = {name: at_effective_batch(reference_plan(name), e) for name in workload.guide_plans}
    plans["tuned"] = tuned.plan
    return compare("ts-lstm", workload, hw, plans, "timeseries-before", args, tuned)


def hf_gpt2(args, hw, tmp: Path) -> dict:
    if hw.device_type != "cuda":
        print("no CUDA device: skipped (GPT-2 through Transformers runs on a GPU)")
        return {"skipped": "no CUDA device"}
    from saturate.workloads.hf import hf_workload, transformers_module

    folder = tmp / "gpt2-124m"
    transformers_module().GPT2Config().save_pretrained(folder)  # GPT-2 124M shape; no weights, nothing downloaded
    workload = hf_workload(folder, data=None, tokenizer="byte", seq_len=1024, seed=args.seed)
    print(f"# GPT-2 124M via Transformers ({workload.info['parameters']} parameters, {workload.info['attention']} "
          f"attention) on {bench.device_label(hw)}, {time.strftime('%Y-%m-%d')}", flush=True)
    tuned = tune(workload, hw, out_dir=tmp / "tune-hf", budget_s=args.budget, console=Console(width=160),
                 use_cache=False, planned_steps=args.planned_steps)
    e = workload.optim.effective_batch
    plans = {"rocm-after": at_effective_batch(reference_plan("rocm-after"), e), "tuned": tuned.plan}
    return compare("GPT-2 124M via Transformers", workload, hw, plans, "rocm-after", args, tuned)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device")
    ap.add_argument("--hidden", type=int, default=128, help="ts-lstm hidden size (the guide's after: 128)")
    ap.add_argument("--window", type=int, default=60, help="ts-lstm window (default 60)")
    ap.add_argument("--budget", type=float, default=300, help="tuning budget in seconds (default 300)")
    ap.add_argument("--planned-steps", type=int, help="steps the tuned plan is for (compile must pay back)")
    ap.add_argument("--hf-gpt2", action="store_true", help="also GPT-2 124M through Transformers (CUDA only)")
    bench.add_run_args(ap, steps=6, warmup=2, rounds=3)
    args = ap.parse_args()
    hw = probe(measure_peaks=False, device=args.device)
    result: dict = {"environment": bench.environment(hw)}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        result["ts_lstm"] = timeseries(args, hw, tmp)
        if args.hf_gpt2:
            result["hf_gpt2"] = hf_gpt2(args, hw, tmp)
    bench.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
