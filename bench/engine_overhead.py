"""Engine overhead: saturate's train() against a bare hand-written PyTorch loop doing the same work.

Goal: train() within 2 % of the bare loop (median over rounds of saturate time / bare time - 1).

Both sides train gpt-tiny: the same model class (saturate.workloads.gpt.GPT) built under the same
seed, the same RandomWindows over the same token array read in the same order, the same
micro-batch and accumulation, AdamW with the same parameter groups and implementation (fused or
foreach), the same warm-up/cosine learning rate set every step, the same precision, gradient
clipping and zero_grad(set_to_none=True). They start from the same weights and see the same data,
so their mean losses over the timed steps agree; the table prints both as a check.

How each side is timed, after a warm-up of W steps that is excluded:

* bare loop: it reads its loss (a host sync), synchronises the device and starts the clock after
  step W, then runs N steps, reads its loss once, synchronises and stops the clock.
* train(): RunConfig(log_every=W) with W + N steps. The trainer itself synchronises and reads the
  clock after step W and after step W + N (each with one loss read, like the bare loop), and
  writes that window's time/step_s to metrics.jsonl; validation and checkpoints fall outside
  it. W is kept >= N so no third log (and host sync) lands inside the timed window. Subtracting
  train_seconds of a W-step run from a (W+N)-step run was rejected: it adds two runs' noise,
  first-step costs included, to one figure.

Both sides run in one process, interleaved over rounds (A, B | B, A | ...); the overhead is
computed per round from the adjacent pair, and its median and min..max over rounds are printed.

    PYTHONPATH=src python3 bench/engine_overhead.py                 # CPU: 8 x 4, fp32, 5 rounds
    PYTHONPATH=src python3 bench/engine_overhead.py --rounds 2 --steps 3 --json overhead.json
    PYTHONPATH=src python3 bench/engine_overhead.py --device cuda   # GPU: 32 x 4, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import _harness as bench
from saturate.hardware import probe, synchronize
from saturate.plan import Plan, default_plan
from saturate.workloads import PRESETS, Workload
from saturate.workloads.gpt import GPT

SATURATE, BARE = "saturate train()", "bare loop"


def bare_loop(workload: Workload, plan: Plan, *, warmup: int, steps: int, device: torch.device,
              seed: int = 0) -> bench.Timed:
    """The loop a careful engineer writes by hand (nanoGPT's shape), for warmup + steps steps."""
    bench.release_memory(device)  # as timed_train() does before train()
    torch.manual_seed(seed)
    random.seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = plan.tf32
    torch.backends.cudnn.allow_tf32 = plan.tf32
    model = workload.build_model()
    if not isinstance(model, GPT):
        raise TypeError(f"expected saturate.workloads.gpt.GPT, got {type(model).__name__}")
    model.to(device).train()
    params = list(model.parameters())

    o = workload.optim
    accum = plan.grad_accum
    peak_lr = o.lr * plan.samples_per_step() / o.effective_batch  # linear scaling, as train() does
    min_lr, total = peak_lr * o.min_lr_ratio, warmup + steps

    def lr_at(step: int) -> float:
        if step < o.warmup_steps:
            return peak_lr * (step + 1) / o.warmup_steps
        progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)

    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        if not plan.fused_optimizer:
            raise TypeError
        optimizer = torch.optim.AdamW(groups, lr=peak_lr, betas=o.betas, fused=True)
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(groups, lr=peak_lr, betas=o.betas, foreach=device.type != "mps")

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None
    pin = plan.pin_memory and device.type == "cuda"
    # Sequential indices 0, 1, 2, ... are exactly the samples train()'s StepSampler reads in one process.
    loader = DataLoader(workload.train_data, batch_size=plan.micro_batch, num_workers=plan.num_workers,
                        pin_memory=pin)
    batches = iter(loader)
    loss_sum = torch.zeros((), device=device)
    start = 0.0

    for step in range(total):
        if step == warmup:
            loss_sum.item()  # deliberate sync, where train() reads its loss to close the warm-up window
            synchronize(device)
            loss_sum.zero_()
            start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        for _ in range(accum):
            x, y = (t.to(device, non_blocking=plan.non_blocking) for t in next(batches))
            with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
                logits = model(x)  # (B, T, V)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            loss_sum += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if o.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    loss = loss_sum.item() / steps  # deliberate sync: the one loss read of the timed window
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = steps * plan.samples_per_step() * workload.tokens_per_sample
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return bench.Timed(steps, seconds, tokens / seconds, loss, peak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: the best device found)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default: fp32 on CPU, bf16 on GPU")
    ap.add_argument("--micro", type=int, help="micro-batch (default: 8 on CPU, 32 on a GPU)")
    ap.add_argument("--accum", type=int, default=4, help="gradient accumulation (default: 4)")
    ap.add_argument("--micro-model", action="store_true",
                    help="a 1-layer, 16-wide, 16-token variant of gpt-tiny: compute is tiny, so the time is "
                         "almost all per-step Python and framework overhead (use with --steps 300)")
    bench.add_run_args(ap, steps=None, warmup=None, rounds=5)  # steps: 10 on CPU, 200 on a GPU; warmup >= steps
    args = ap.parse_args(argv)
    preset = "gpt-tiny"
    if args.micro_model:  # a registry variant: the preset copied with a smaller shape
        preset = "gpt-micro"
        PRESETS[preset] = dataclasses.replace(PRESETS["gpt-tiny"], name=preset, n_layer=1, n_head=1, n_embd=16,
                                              seq_len=16, description="overhead probe")

    hw = probe(measure_peaks=True, device=args.device)  # measured once, so train() need not re-measure
    device = torch.device(hw.torch_device)
    gpu = device.type == "cuda"
    micro = args.micro or (32 if gpu else 8)
    steps = args.steps or (200 if gpu else 10)
    warmup = max(args.warmup or steps, steps)
    bench.require_positive(ap, micro=micro, accum=args.accum, steps=steps, rounds=args.rounds)
    if args.warmup and args.warmup < steps:
        print(f"note: --warmup raised from {args.warmup} to {steps} (>= --steps keeps train()'s timed "
              "window free of extra log syncs)")

    workload = bench.bench_workload(preset, args.seed)
    base = default_plan(micro * args.accum, hw.device_type, hw.supports)
    plan = base.replace(name="engine-overhead", micro_batch=micro, grad_accum=args.accum,
                        precision=args.precision or ("bf16" if gpu and hw.supports.get("bf16") else "fp32"))
    print(f"{preset} on {bench.device_label(hw)}: micro "
          f"{plan.micro_batch} x accum {plan.grad_accum}, {plan.precision}, tf32={plan.tf32}, "
          f"fused AdamW={plan.fused_optimizer}; {warmup} warm-up + {steps} timed steps, {args.rounds} rounds")

    def run(name: str, run_dir: Path) -> bench.Timed:
        if name == SATURATE:
            return bench.timed_train(workload, plan, warmup=warmup, steps=steps, hardware=hw, run_dir=run_dir,
                                     seed=args.seed)[0]
        return bare_loop(workload, plan, warmup=warmup, steps=steps, device=device, seed=args.seed)

    results = bench.run_rounds([SATURATE, BARE], args.rounds, run, lambda r, name, t: (
        f"round {r + 1}/{args.rounds}  {name:<17} {t.tokens_per_s:>12,.0f} tokens/s  "
        f"{t.step_s:.4f} s/step  loss {t.loss:.4f}"))

    seconds = {name: [t.seconds for t in ts] for name, ts in results.items()}
    overhead = bench.Spread.of([x - 1 for x in bench.ratios(seconds[SATURATE], seconds[BARE])])
    loss_gap = max(abs(s.loss - b.loss) for s, b in zip(results[SATURATE], results[BARE], strict=True))
    rows = [[name, bench.Spread.of(bench.tokens_per_s(ts)).fmt(",.0f"),
             bench.Spread.of([t.step_s for t in ts]).fmt(".4f"), f"{ts[-1].loss:.4f}"]
            for name, ts in results.items()]
    verdict = "met" if overhead.median <= 0.02 else "NOT met"
    bench.print_table(
        f"Engine overhead: {preset}, {plan.micro_batch} x {plan.grad_accum}, {plan.precision}, "
        f"{hw.torch_device}, {args.rounds} rounds x {steps} timed steps",
        ["loop", "tokens/s median (min..max)", "s/step median (min..max)", "loss (last round)"], rows,
        [f"overhead (saturate time / bare time - 1, per round): {overhead.fmt('+.2f', 100, ' %')}; "
         f"goal <= 2 % {verdict} (median)",
         f"largest loss difference between the two in a round: {loss_gap:.2e} (same work: should be ~0)"])

    bench.write_json(args.json, {
        "benchmark": "engine_overhead", "goal": "saturate within 2 % of the bare loop",
        "environment": bench.environment(hw), "plan": plan.to_dict(), "warmup_steps": warmup, "timed_steps": steps,
        "rounds": args.rounds,
        "tokens_per_s": {n: bench.Spread.of(bench.tokens_per_s(ts)).to_dict() for n, ts in results.items()},
        "overhead": overhead.to_dict(), "goal_met": overhead.median <= 0.02, "max_loss_difference": loss_gap,
        "per_round": {n: [t.to_dict() for t in ts] for n, ts in results.items()},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
