"""saturate's gpt-tiny step (fp32, 8 × 4, fused AdamW) timed in this process: `python3 engine_step.py fused 10`.
Run in fresh processes with and without GLIBC_TUNABLES=...:glibc.malloc.hugetlb=1 (engine_step_thp.log)."""

import json
import resource
import statistics
import sys
import time

import torch

from saturate.data.loaders import make_loader
from saturate.engine.step import Stepper
from saturate.plan import Plan
from saturate.workloads import build_workload

torch.manual_seed(0)
wl = build_workload("gpt-tiny", data=None, effective_batch=32)
plan = Plan(micro_batch=8, grad_accum=4, precision="fp32", fused_optimizer=sys.argv[1] == "fused")
stepper = Stepper(wl, plan, torch.device("cpu"), lr=1e-3)
batches = iter(make_loader(wl.train_data, plan, start_step=0, pin_memory=False))
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    stepper.step(batches)
    times.append(time.perf_counter() - t)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"median_s": statistics.median(times[3:]), "faults": faults}))
