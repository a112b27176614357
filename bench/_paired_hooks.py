"""saturate's hooks attached and detached in turn inside one process (not a benchmark itself: run by
bench/script_overhead.py, whose docstring says what it measures).

Guide 1's model, data and loop (examples/scripts/gpt_pretrain: its classes, its config, its step) run
block after block: an "on" block installs saturate's hooks as the shim does in a script
(`script.child.hooks.install()`), whose Profiler then finds the model, warms up one step, times `--block`
steps and detaches; an "off" block runs `--block` steps with nothing of saturate registered. Each step's
wall and CPU time (`time.process_time`: every thread, the telemetry thread's included) is written with
its block and role, as JSON, to `--out`. Neighbouring blocks share the machine's state, so their ratio
is free of what differs from one process to the next.

    SATURATE_SCRIPT_DIR=DIR python bench/_paired_hooks.py --config mid --pairs 30 --block 10 --out steps.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from saturate.script.boundary import ENV_SETTINGS, ChildSettings
from saturate.script.child import hooks

GPT_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "scripts" / "gpt_pretrain"
sys.path.insert(0, str(GPT_SCRIPT))
from config import get_config  # noqa: E402  (the script's own modules)
from train import GPT, TextWindows, read_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="mid")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ[ENV_SETTINGS] = ChildSettings(mode="doctor", warmup=1, count_steps=0, steps=args.block,
                                             stop=False).to_json()
    cfg = get_config(args.config)
    windows = TextWindows(read_text([]), cfg.block_size)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    steps: list[dict] = []
    step = 0
    for pair in range(args.pairs):
        for block in ("on", "off"):
            if block == "on":
                hooks._script = None  # a fresh install, as in a new process (the last one detached itself)
                hooks.install()
                roles = ["start", "warm-up"] + ["on"] * args.block
            else:
                roles = ["detaching"] + ["off"] * args.block  # its first forward removes the optimizer hook
            batches = iter(DataLoader(windows, batch_size=cfg.batch_size, shuffle=True))
            for role in roles:
                lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * (step % 1000) / 1000))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(cfg.grad_accum):  # the script's step, as written
                    x, y = next(batches)
                    logits = model(x)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / cfg.grad_accum
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                steps.append({"pair": pair, "role": role, "wall": time.perf_counter() - wall,
                              "cpu": time.process_time() - cpu})
                step += 1
            if block == "on" and not hooks._script.done:
                raise SystemExit("the hooks' window did not end inside the block")
    Path(args.out).write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
