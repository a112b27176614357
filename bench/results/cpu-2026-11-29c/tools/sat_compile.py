"""The tuner's model trials (RealMeasurer), eager and compiled alternately, on the peers' job, in one process.

    PYTHONPATH=src python3 sat_compile.py [STEPS]
"""
import dataclasses
import sys
import time

from saturate.hardware import probe
from saturate.tune.measure import RealMeasurer
from saturate.workloads.coupling import workload_default_plan
from saturate.workloads.hf import hf_workload

hw = probe(measure_peaks=False, device="cpu")
wl = hf_workload("/tmp/peers/gpt-peer", data=["/tmp/peers/train.txt"], seed=0, seq_len=128, lr=2e-3,
                 warmup_steps=20, effective_batch=32)
wl = dataclasses.replace(wl, val_data=None)
informed, _ = workload_default_plan(wl, hw)
print("informed", informed.micro_batch, informed.grad_accum, informed.precision, informed.fused_optimizer)
m = RealMeasurer(wl, hw, seed=0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 0
for mode in ["none", "default", "none", "default"]:
    t0 = time.perf_counter()
    t = m.model_trial(informed.replace(compile=mode), "x", steps=steps or None)
    print(mode, t.status, "samples/s %.1f" % (t.samples_per_s or 0), "spread", t.spread, "steps", t.steps,
          "compile_s", t.compile_s and round(t.compile_s, 1), "secs %.1f" % (time.perf_counter() - t0), flush=True)
    if mode != "none":
        m.discard_compiled()
