"""The doctor's predictions against measurement: the top fix's predicted gain vs its measured gain.

Goal (issue 4): the predicted gain within ±25 % of the measured gain for the top fix on the
constructed cases. Each case is diagnosed with `diagnose()`; the highest-ranked plan fix that
keeps the training the same is applied (what `saturate doctor --apply` does) and the new plan is
diagnosed the same way. Measured gain = before ÷ after of the fix's own metric (seconds per step,
or the job's host memory for the host-memory case). Before and after run side by side in one
process, interleaved over rounds (before, after | after, before | …); each round pairs its own
prediction with its own measurement, and the error is measured ÷ predicted − 1.

The cases mirror tests/doctor/toy.py (duplicated here: benchmarks do not import the tests):

* input-bound: 8 samples per step, each sleeping 5 ms (slow decoding / I/O), into a small MLP
* overhead-bound: a 16→8→1 MLP at micro-batch 1 × accumulation 32
* host-memory-bound: 3 loader workers each building a 160 MiB table, against a budget of what the
  training process holds plus 256 MiB (the prediction is the job's memory, PSS)

gpt-tiny at micro-batch 1 is not among them: on this CPU its fixed cost per micro-step is ~10 %
of the micro-step (measured), so the doctor rightly calls it compute-bound there.

A compute-bound case has no predicted top fix (bf16 is offered unpredicted), so it has no row.

With `--device cuda` the GPU cases run instead (issue 16; written 2026-11-23, not yet run on a GPU):

* input-bound: as above, into the GPU
* launch-bound: the 16→8→1 MLP at micro-batch 1 × accumulation 32 (every micro-step a few tiny kernels)
* copy/sync-bound: 32 samples of 64 Ki floats (8 MiB a batch) copied from pageable memory with blocking
  copies into a 65536→64→1 MLP: the copy dominates and stalls the host (the fix: pinned, non-blocking)
* memory under-used: gpt-small, bf16, micro-batch 2 × accumulation 16, most of the GPU's memory unused

By default the training uses one intra-op thread (--threads): on the shared 2-core development
machine two OpenMP threads stall at every barrier whenever a loader worker or another process
runs, which swings small models' step times tenfold and says nothing about the doctor.

    PYTHONPATH=src python3 bench/doctor_predictions.py                    # 3 rounds, every case
    PYTHONPATH=src python3 bench/doctor_predictions.py --cases input --rounds 1 --seconds 1
    PYTHONPATH=src python3 bench/doctor_predictions.py --device cuda --rounds 2   # the GPU cases
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset

import _harness as bench
from saturate.doctor.apply import apply_fix, measured_figure, plan_fix
from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.telemetry import read_process_tree
from saturate.workloads import Optimization, Workload


class Samples(Dataset):
    def __init__(self, delay: float = 0.0, features: int = 16) -> None:
        self.delay = delay
        self.x = torch.randn(4096 if features <= 1024 else 64, features, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i % len(self.x)], self.y[i % len(self.x)]


class Hungry(Samples):
    def __init__(self, mib: int) -> None:
        super().__init__()
        self.mib = mib
        self._table: np.ndarray | None = None

    def __getitem__(self, i: int):
        if self._table is None:
            self._table = np.ones(self.mib * 2**20 // 8)
        return super().__getitem__(i)


def mlp(data: Dataset, effective_batch: int, hidden: int, features: int = 16) -> Workload:
    return Workload(
        name="toy-mlp", train_data=data, val_data=None,
        build_model=lambda: nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1)),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        optim=Optimization(effective_batch=effective_batch, lr=1e-3, warmup_steps=0, steps=10**6))


def gpu_cases(seconds: float) -> dict[str, tuple[Workload, Plan, DoctorConfig]]:
    from saturate.workloads import build_workload

    base = DoctorConfig(steps=10, warmup=2, count_steps=2, min_seconds=seconds)
    wide = 65536
    return {
        "input": (mlp(Samples(delay=0.005), 8, 64), Plan(micro_batch=8), base),
        "launch": (mlp(Samples(), 32, 8), Plan(micro_batch=1, grad_accum=32), base),
        "copies": (mlp(Samples(features=wide), 32, 64, features=wide), Plan(micro_batch=32), base),
        "memory": (build_workload("gpt-small", effective_batch=32),
                   Plan(micro_batch=2, grad_accum=16, precision="bf16", tf32=True, pin_memory=True,
                        non_blocking=True, fused_optimizer=True), DoctorConfig(steps=5, warmup=2, min_seconds=seconds)),
    }


def cases(seconds: float) -> dict[str, tuple[Workload, Plan, DoctorConfig]]:
    base = DoctorConfig(steps=10, warmup=2, count_steps=0, min_seconds=seconds)
    own = read_process_tree(os.getpid(), proportional=True).total_bytes or 0
    hungry_cfg = DoctorConfig(steps=10, warmup=2, count_steps=0, min_seconds=seconds, scaling=False,
                              host_memory_budget=own + 256 * 2**20, interval=0.1)
    return {
        "input": (mlp(Samples(delay=0.005), 8, 64), Plan(micro_batch=8), base),
        "overhead": (mlp(Samples(), 32, 8), Plan(micro_batch=1, grad_accum=32), base),
        "host-memory": (mlp(Hungry(160), 8, 64), Plan(micro_batch=8, num_workers=3), hungry_cfg),
    }


def side_by_side(workload: Workload, plans: dict[str, Plan], cfg: DoctorConfig, hw, rounds: int) -> dict[str, list]:
    """Each plan diagnosed once a round, interleaved; the diagnoses per plan in round order."""
    return bench.run_rounds(list(plans), rounds, lambda name, _: diagnose(workload, plans[name], cfg, hardware=hw))


def predicted_gain(diagnosis, fix) -> float:
    """The gain this diagnosis predicts for `fix`; NaN where its top plan fix is another one."""
    same = plan_fix(diagnosis)
    return same.prediction.gain if same is not None and same.title == fix.title else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda: the GPU cases")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="cpu: input overhead host-memory; cuda: input launch copies memory (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per diagnosis (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; see above)")
    ap.add_argument("--load", default="quiet", help="quiet (default), or a profile of the shared neighbour "
                    "(steady, bursty, spiky) running through every diagnosis")
    ap.add_argument("--seed", type=int, default=0, help="the neighbour's seed")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    with contextlib.nullcontext() if args.load == "quiet" else bench.neighbour(args.load, args.seed):
        run(args, ap)


def run(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 3 workers on 2 cores, on purpose
    if args.device == "cuda" and bench.no_cuda(args.json, "doctor_predictions"):
        return
    hw = probe(measure_peaks=False, device=args.device)
    all_cases = gpu_cases(args.seconds) if args.device == "cuda" else cases(args.seconds)
    unknown = sorted(set(args.cases or ()) - set(all_cases))
    if unknown:
        ap.error(f"unknown case(s) for {args.device}: {', '.join(unknown)} (known: {', '.join(all_cases)})")
    chosen = args.cases or list(all_cases)
    rows, results = [], {}
    for name in chosen:
        workload, plan, cfg = all_cases[name]
        first = diagnose(workload, plan, cfg, hardware=hw)
        fix = plan_fix(first)
        if fix is None:
            rows.append([name, first.label, "no plan fix", "-", "-", "-", "-"])
            continue
        fixed = apply_fix(plan, fix)
        metric = fix.prediction.metric
        runs = side_by_side(workload, {"before": plan, "after": fixed}, cfg, hw, args.rounds)
        predicted = [predicted_gain(d, fix) for d in runs["before"]]
        figures = {side: [measured_figure(d, metric) for d in ds] for side, ds in runs.items()}
        measured = bench.ratios(figures["before"], figures["after"])
        errors = [m / p - 1 for m, p in zip(measured, predicted, strict=True) if p == p]
        verdicts = sorted({d.verdict for d in runs["before"]})
        results[name] = {"verdicts": verdicts, "fix": fix.title, "metric": metric, "predicted": predicted,
                         "measured": measured, "errors": errors}
        within = sum(abs(e) <= 0.25 for e in errors)
        rows.append([name, ", ".join(verdicts), fix.title.split(" (")[0],
                     bench.Spread.of(predicted).fmt(".2f", unit="×"), bench.Spread.of(measured).fmt(".2f", unit="×"),
                     bench.Spread.of(errors).fmt("+.0f", 100, " %"), f"{within}/{len(errors)}"])
    where = bench.device_label(hw) if args.device == "cuda" else f"{hw.cpu_name}, {hw.cpu_cores} cores"
    bench.print_table(f"doctor predictions — {where}, {args.load}, {args.threads} torch thread(s), "
                      f"{args.rounds} rounds", ["case", "verdict", "top plan fix", "predicted gain", "measured gain",
                                                "measured ÷ predicted − 1", "within ±25 %"], rows)
    bench.write_json(args.json, {"environment": bench.environment(hw), "rounds": args.rounds, "load": args.load,
                                 "seconds": args.seconds, "threads": args.threads, "cases": results})


if __name__ == "__main__":
    main()
