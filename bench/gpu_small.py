"""gpt-small (GPT-2 124M shape, seq 1024) on one CUDA GPU: tokens/s, MFU and peak memory.

Goal: 45 % MFU or more on an H100/H200-class GPU with bf16 autocast, torch.compile(mode="default"),
fused AdamW and TF32, through saturate's train() (what a user gets). The same plan in eager mode
runs beside it, so the table also shows what compile buys.

MFU = tokens/s x model FLOPs per token (6N + attention, saturate.workloads.gpt.flops_per_token) over
a peak, given against both denominators:

* measured: the bf16 matmul peak from measure_matmul_peak, taken before and after the rounds (the
  higher is used: a cold or busy GPU only lowers it);
* datasheet: probe().peak_flops("bf16"), the dense datasheet figure when the GPU matched a row.

Timing: each run is warm-up W + N steps (default 10 + 30) with log_every=W; the steps after W are
timed by the trainer's own synchronised clock (metrics.jsonl windows; compilation, validation and
checkpoints fall outside them). The few log reads inside the timed steps are what a user's run
does too. Compiled and eager runs are interleaved in one process over rounds (order reversed every
other round); the speed-up of compile is taken per round. Peak memory is
torch.cuda.max_memory_allocated, reset before each run.

On a machine without CUDA it prints "no CUDA device: skipped" and exits 0.

    PYTHONPATH=src python3 bench/gpu_small.py                   # a few minutes on an H200
    PYTHONPATH=src python3 bench/gpu_small.py --micro 32 --steps 50 --json gpu_small.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import _harness as bench
from saturate.hardware import measure_matmul_peak, probe
from saturate.hardware.mfu import mfu
from saturate.plan import Plan
from saturate.workloads import Workload
from saturate.workloads.chunked_loss import chunk_rows
from saturate.workloads.gpt import GPT, GPTConfig, flops_per_token

GOAL_MFU = 0.45


def _mfu_spread(achieved: list[float], peak: float | None, source: str) -> bench.Spread | None:
    """MFU per round through saturate's one MFU function; None when unknown or any round exceeds the peak."""
    values = [mfu(a, peak, source).value for a in achieved]
    return None if any(v is None for v in values) else bench.Spread.of(values)  # type: ignore[arg-type]


def with_vocab(workload: Workload, vocab: int) -> Workload:
    """The workload with its GPT's vocabulary set to `vocab` (padded to 64 by the model); FLOPs and the chunked
    loss's rows follow (before 2026-11-27 the rows stayed the byte vocabulary's, so the tuner never tried chunks)."""
    cfg = GPTConfig(**{**workload.identity["model"], "vocab_size": vocab})
    return dataclasses.replace(workload, build_model=lambda: GPT(cfg),
                               flops_per_sample=flops_per_token(cfg) * cfg.seq_len,
                               loss_chunk_rows=chunk_rows(cfg.padded_vocab),
                               identity={**workload.identity, "model": cfg.to_dict()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N (default: cuda)")
    ap.add_argument("--micro", type=int, default=16, help="micro-batch; accumulation makes 128 (default: 16)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="model vocabulary instead of the byte tokenizer's 257 (50257: GPT-2's, the 124M model "
                         "nanoGPT and llm.c report; the byte corpus's ids stay below it)")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode of the compiled plan")
    bench.add_run_args(ap, steps=30, warmup=10, rounds=3)
    args = ap.parse_args(argv)
    bench.require_positive(ap, micro=args.micro, steps=args.steps, warmup=args.warmup, rounds=args.rounds)

    if bench.no_cuda(args.json, "gpu_small"):
        return 0

    workload = bench.bench_workload("gpt-small", args.seed)
    if args.vocab:
        workload = with_vocab(workload, args.vocab)
    effective = workload.optim.effective_batch
    if effective % args.micro:
        ap.error(f"--micro {args.micro} must divide gpt-small's effective batch {effective}")
    hw = probe(measure_peaks=False, device=args.device)
    if not hw.supports.get("bf16"):
        print(f"{bench.device_label(hw)} has no native bf16: skipped")
        bench.write_json(args.json, {"benchmark": "gpu_small", "skipped": "no native bf16"})
        return 0
    compiled = Plan(name="compile", micro_batch=args.micro, grad_accum=effective // args.micro,
                    precision="bf16", tf32=True, compile=args.compile_mode, fused_optimizer=True, pin_memory=True,
                    non_blocking=True)
    plans = {"compile": compiled, "eager": compiled.replace(name="eager", compile="none")}

    measured = [measure_matmul_peak(hw.torch_device, torch.bfloat16, seconds=1.0)]
    hw.measured_peak_flops["bf16"] = measured[0]  # so train() need not measure it again
    print(f"gpt-small on {bench.device_label(hw)}, torch {torch.__version__}: micro {args.micro} x accum "
          f"{effective // args.micro}, bf16, TF32, fused AdamW; {args.warmup} warm-up + {args.steps} timed "
          f"steps, {args.rounds} rounds", flush=True)

    results = bench.train_rounds(workload, plans, hw, args, lambda r, name, t: (
        f"round {r + 1}/{args.rounds} {name:<7} {t.tokens_per_s:>10,.0f} tok/s {t.step_s:.3f} s/step"))
    measured.append(measure_matmul_peak(hw.torch_device, torch.bfloat16, seconds=1.0))
    peak_measured = max(measured)
    sheet = hw.datasheet_peak_flops.get("bf16")
    peak_sheet = sheet[0] if sheet else None

    flops_per_token = workload.flops_per_sample / workload.tokens_per_sample
    rows, summary = [], {}
    for name, runs in results.items():
        tps = bench.Spread.of(bench.tokens_per_s(runs))
        mfu_measured = _mfu_spread([t.tokens_per_s * flops_per_token for t in runs], peak_measured, "measured")
        mfu_sheet = _mfu_spread([t.tokens_per_s * flops_per_token for t in runs], peak_sheet, "datasheet")
        peak_mem = max((t.peak_memory_bytes or 0) for t in runs) / 2**30
        fell_back = any(n.startswith("torch.compile") for t in runs for n in t.notes)
        label = f"{name} (fell back to eager!)" if fell_back else name
        rows.append([label, tps.fmt(",.0f"), mfu_measured.fmt(".1f", 100, "%") if mfu_measured else "n/a",
                     mfu_sheet.fmt(".1f", 100, "%") if mfu_sheet else "n/a", f"{peak_mem:.1f}"])
        summary[name] = {"plan": plans[name].to_dict(), "tokens_per_s": tps.to_dict(),
                         "mfu_vs_measured": mfu_measured.to_dict() if mfu_measured else None,
                         "mfu_vs_datasheet": mfu_sheet.to_dict() if mfu_sheet else None,
                         "peak_memory_gib": peak_mem, "notes": sorted({n for t in runs for n in t.notes}),
                         "per_round": [t.to_dict() for t in runs]}

    compiled_tps = bench.tokens_per_s(results["compile"])
    speedup = bench.Spread.of(bench.ratios(compiled_tps, bench.tokens_per_s(results["eager"])))
    goal_peak, goal_label = (peak_sheet, "datasheet") if peak_sheet else (peak_measured, "measured")
    goal_mfu = bench.Spread.of(compiled_tps).median * flops_per_token / goal_peak
    footer = [
        f"compile / eager tokens/s per round: {speedup.fmt('.2f', unit='x')}",
        f"bf16 peaks: measured {peak_measured / 1e12:.3g} TFLOP/s (max of {len(measured)}), datasheet "
        + (f"{peak_sheet / 1e12:.1f} TFLOP/s" if peak_sheet else "n/a (no matching row)"),
        f"goal: MFU >= {GOAL_MFU:.0%} vs {goal_label} with compile: {goal_mfu:.1%} "
        + ("met" if goal_mfu >= GOAL_MFU else "NOT met"),
        *(f"note ({name}): {n}" for name, s in summary.items() for n in s["notes"]),
    ]
    bench.print_table(
        f"gpt-small seq 1024, vocab {workload.identity['model']['vocab_size']}, {args.micro} x "
        f"{effective // args.micro}, bf16, compile {args.compile_mode}, {bench.device_label(hw)}, "
        f"{args.rounds} rounds x {args.steps} steps",
        ["mode", "tok/s median (min..max)", "MFU measured", "MFU datasheet", "peak GiB"], rows, footer)

    bench.write_json(args.json, {
        "benchmark": "gpu_small", "goal": f"MFU >= {GOAL_MFU:.0%} on H100/H200-class GPUs",
        "environment": bench.environment(hw), "warmup_steps": args.warmup, "timed_steps": args.steps,
        "rounds": args.rounds, "flops_per_token": flops_per_token,
        "vocab_size": workload.identity["model"]["vocab_size"], "compile_mode": args.compile_mode,
        "peak_flops_bf16": {"measured": measured, "used_measured": peak_measured, "datasheet": peak_sheet,
                            "datasheet_source": sheet[1] if sheet else None},
        "compile_speedup": speedup.to_dict(), "goal_mfu": goal_mfu, "goal_met": goal_mfu >= GOAL_MFU,
        "modes": summary,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
