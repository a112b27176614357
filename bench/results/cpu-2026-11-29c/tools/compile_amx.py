"""Eager vs compiled bf16 step of the peers' GPT-2 on this CPU (outside saturate): per-step times.

    python3 compile_amx.py MICRO ACCUM eager|compile [STEPS]
"""
import statistics
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config.from_pretrained("/tmp/peers/gpt-peer")
micro, accum, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model = GPT2LMHeadModel(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
fwd = torch.compile(model) if mode == "compile" else model
x = torch.randint(0, 2000, (micro, 128))


def step() -> None:
    for _ in range(accum):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fwd(input_ids=x, labels=x)
        (out.loss / accum).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


t0 = time.perf_counter()
step()
step()
print("warm", round(time.perf_counter() - t0, 1), flush=True)
ts = []
for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 12):
    t = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t)
print(mode, micro, accum, "median step", round(statistics.median(ts), 4), "min", round(min(ts), 4),
      "max", round(max(ts), 4))
