"""Runs a training script unchanged with a clock on its optimizer steps (not a benchmark itself).

    STEP_CLOCK=times.json python bench/_step_clock.py train.py ARGS…

PyTorch's global optimizer-step post hook appends `time.perf_counter()` after every optimizer step;
the list is written to $STEP_CLOCK when the script ends. The same clock runs in every configuration
a benchmark compares (with or without saturate's hooks), so its one call per step cancels out.
"""

import atexit
import json
import os
import runpy
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

times: list[float] = []
register_optimizer_step_post_hook(lambda opt, args, kwargs: times.append(time.perf_counter()))


def _write() -> None:
    with open(os.environ["STEP_CLOCK"], "w") as f:
        f.write(json.dumps(times))


atexit.register(_write)
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
assert torch.__version__  # imported before the script, so that saturate's hooks (when present) come first
runpy.run_path(script, run_name="__main__")
