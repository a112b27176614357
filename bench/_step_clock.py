"""Runs a training script unchanged with a clock on its optimizer steps (not a benchmark itself).

    STEP_CLOCK=times.json [STEP_LIMIT=N] python bench/_step_clock.py train.py ARGS…

PyTorch's global optimizer-step post hook records `[time.perf_counter(), time.process_time()]` after every
optimizer step (wall time, and the CPU time of the whole process: every thread, the time other processes
took the cores left out); the list is written to $STEP_CLOCK when the script ends, or after N steps with
STEP_LIMIT (the script is then ended as by `sys.exit(0)`, so its atexit handlers run). The same clock runs
in every configuration a benchmark compares (with or without saturate's hooks), so its one call per step
cancels out; saturate's hooks, installed when torch is imported, run before it at each step.
"""

import atexit
import json
import os
import runpy
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

times: list[list[float]] = []
limit = int(os.environ.get("STEP_LIMIT") or 0)


def _tick(opt, args, kwargs) -> None:  # type: ignore[no-untyped-def]
    times.append([time.perf_counter(), time.process_time()])
    if len(times) == limit:
        raise SystemExit(0)


def _write() -> None:
    with open(os.environ["STEP_CLOCK"], "w") as f:
        f.write(json.dumps(times))


register_optimizer_step_post_hook(_tick)
atexit.register(_write)
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
assert torch.__version__  # imported before the script, so that saturate's hooks (when present) come first
runpy.run_path(script, run_name="__main__")
