"""Where gpt-small's step time goes on a CUDA GPU: the kernels by GPU time, and the SDPA backend in use.

The MFU push (issue 16) needs to know what the ~57 % of the datasheet peak that a tuned gpt-small
leaves unused is spent on. This runs the model as saturate's plan would (bf16 autocast, TF32,
fused AdamW, torch.compile unless --eager) for a few steps outside train() — the kernel mix is the
model's, not the trainer's — then profiles `--steps` more with torch.profiler and prints:

* which scaled_dot_product_attention backend ran (flash, cuDNN, memory-efficient or math), read
  from the kernels' names in a separate profiled call with the model's shapes;
* the top kernels by total GPU time, and GPU time grouped by kind (matmul, attention, elementwise
  and norms, optimizer, cross-entropy, other), each as a share of the profiled GPU time;
* the GPU-busy share of the profiled wall time (1 − busy = the GPU waited on the host).

Figures are one profiled window (profiling adds host overhead): read the shares, not the speed.

    PYTHONPATH=src:bench python3 bench/gpu_profile.py                  # byte vocabulary, 16 x 1024
    PYTHONPATH=src:bench python3 bench/gpu_profile.py --vocab 50257 --micro 32 --json profile.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import _harness as bench
from gpu_small import with_vocab
from saturate.hardware import probe

KINDS = [  # (kind, pattern over a kernel's name), first match wins
    ("attention", r"flash|fmha|cudnn.*(attn|sdpa|mha)|attention|sdpa"),
    ("matmul", r"gemm|sm90_xmma|cutlass|nvjet|matmul|cublas"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("cross-entropy", r"nll|log_softmax|cross_entropy"),
    ("elementwise/norm (triton or aten)", r"triton|elementwise|vectorized|layer_norm|reduce|gelu|copy|fill"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def sdpa_backend(device: torch.device, batch: int, heads: int, seq: int, head_dim: int) -> str:
    """The SDPA backend that runs for these shapes (bf16, causal), from the kernel names it launches."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize(device)
    names = " ".join(e.key.lower() for e in prof.key_averages())
    for backend, pattern in (("cuDNN", r"cudnn"), ("flash", r"flash"), ("memory-efficient", r"fmha|efficient|mem_eff")):
        if re.search(pattern, names):
            return backend
    return "math (no fused attention kernel seen)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the byte tokenizer's)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    bench.require_positive(ap, micro=args.micro, warmup=args.warmup, steps=args.steps, top=args.top)
    if bench.no_cuda(args.json, "gpu_profile"):
        return 0

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    workload = bench.bench_workload("gpt-small", 0)
    if args.vocab:
        workload = with_vocab(workload, args.vocab)
    cfg = workload.identity["model"]
    model = workload.build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = model if args.eager else torch.compile(model, mode=args.compile_mode)
    data = workload.train_data

    def step(i: int) -> None:
        xs, ys = zip(*(data[i * args.micro + j] for j in range(args.micro)), strict=True)
        x = torch.stack(xs).to(device, non_blocking=True)
        y = torch.stack(ys).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = workload.loss_fn(step_model, (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for i in range(args.steps):
            step(args.warmup + i)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - started

    kernels = [(e.key, e.device_time_total / 1e6) for e in prof.key_averages()
               if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(t for _, t in kernels)
    by_kind: dict[str, float] = defaultdict(float)
    for name, t in kernels:
        by_kind[kind_of(name)] += t
    backend = sdpa_backend(device, args.micro, cfg["n_head"], cfg["seq_len"], cfg["n_embd"] // cfg["n_head"])
    top = sorted(kernels, key=lambda kv: -kv[1])[:args.top]
    label = bench.device_label(probe(measure_peaks=False, device="cuda"))
    bench.print_table(
        f"gpt-small (vocab {cfg['vocab_size']}), micro-batch {args.micro}, bf16, "
        f"{'eager' if args.eager else 'compile ' + args.compile_mode}, {label}: top kernels over {args.steps} steps",
        ["kernel", "GPU s", "share"], [[n[:90], f"{t:.4f}", f"{t / total:.1%}"] for n, t in top],
        [*(f"{k}: {t / total:.1%} of GPU time" for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])),
         f"GPU busy {total / wall:.1%} of the profiled wall time ({total:.3f} of {wall:.3f} s; kernels may overlap)",
         f"scaled_dot_product_attention backend: {backend}"])
    bench.write_json(args.json, {
        "benchmark": "gpu_profile", "micro": args.micro, "vocab_size": cfg["vocab_size"],
        "compile": None if args.eager else args.compile_mode, "steps": args.steps, "wall_s": wall,
        "gpu_s": total, "by_kind": dict(by_kind), "sdpa_backend": backend,
        "top": [{"kernel": n, "gpu_s": t} for n, t in top]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
