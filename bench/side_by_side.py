"""Why `saturate run`'s printed speed-up and an independent train() measurement differ (issue 14): one
difference between the two methods removed at a time, all measured round by round in this process.

Two plans (naive, 8×4 fp32, and a tuned one, 8×4 bf16 by default) at the preset's effective batch;
in each round every method measures both, back to back, and gives tuned ÷ naive:

- ``rebuilt``: the side-by-side as it was — every measurement builds its plan again, one warm-up
  step, timed windows of about ``--seconds``, the 5 ms RSS sampler (PeakMemory) running throughout;
- ``no-sampler``: the same without the RSS sampler;
- ``warm-3``: the same with three warm-up steps;
- ``resident``: each plan built and warmed up (two steps) once, every round times more of its run
  (run/resident.py, as side_by_side.py uses it: the side-by-side now, off a GPU);
- ``train``: saturate's train() for ``--warmup`` + ``--steps`` steps, the last timed
  (bench/_harness.py: the independent measurement of bench/trust.py).

Each method's ratio is the median of its per-round ratios (with their range); the table also gives
each method ÷ train. The method whose difference from ``rebuilt`` closes the gap names the cause.

    PYTHONPATH=src python3 bench/side_by_side.py                       # the lead's run, quiet machine
    PYTHONPATH=src python3 bench/side_by_side.py --rounds 1 --steps 1 --warmup 1 --effective-batch 4 \\
        --seconds 0.2 --methods rebuilt,resident,train                  # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness as bench
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.run.resident import ResidentMeasurer
from saturate.stats.noise import WindowRule
from saturate.tune import measure
from saturate.workloads import build_workload

METHODS = ("rebuilt", "no-sampler", "warm-3", "resident", "train")


class _NoSampler:
    """PeakMemory's interface without its sampling thread."""

    def __init__(self, device: Any) -> None:
        self.peak = None

    def __enter__(self) -> _NoSampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def _sampler(on: bool) -> Iterator[None]:
    real = measure.PeakMemory
    if not on:
        measure.PeakMemory = _NoSampler  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        measure.PeakMemory = real  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-tiny")
    ap.add_argument("--effective-batch", type=int, default=32)
    ap.add_argument("--tuned-precision", default="bf16", help="the tuned plan's precision (default bf16)")
    ap.add_argument("--seconds", type=float, default=0.63,
                    help="timed seconds per side-by-side measurement (default 0.63: a 150-step gpt-tiny job's share)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    bench.add_run_args(ap, steps=6, warmup=2, rounds=3)
    args = ap.parse_args(argv)
    bench.require_positive(ap, effective_batch=args.effective_batch, rounds=args.rounds, steps=args.steps,
                           warmup=args.warmup)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or not set(methods) <= set(METHODS):
        ap.error(f"--methods takes {', '.join(METHODS)}, got {args.methods!r}")
    hw = probe(measure_peaks=False)
    workload = dataclasses.replace(build_workload(args.preset, seed=args.seed, effective_batch=args.effective_batch),
                                   val_data=None)
    micro = max(d for d in range(1, min(8, args.effective_batch) + 1) if args.effective_batch % d == 0)
    plans = {"naive": Plan(micro_batch=micro, grad_accum=args.effective_batch // micro, name="naive"),
             "tuned": Plan(micro_batch=micro, grad_accum=args.effective_batch // micro,
                           precision=args.tuned_precision, name="tuned")}
    print(f"# side by side: {args.preset}, effective batch {args.effective_batch}, on {bench.device_label(hw)}, "
          f"{time.strftime('%Y-%m-%d')}; {args.rounds} rounds", flush=True)

    def measurer(method: str) -> Any:
        kind = ResidentMeasurer if method == "resident" else measure.RealMeasurer
        m = kind(workload, hw, seed=args.seed, max_steps=40, min_seconds=args.seconds,
                 window_s=min(0.25, args.seconds / 2), warmup={"warm-3": 3, "resident": 2}.get(method, 1),
                 min_steps=2, rule=WindowRule(min_windows=2))
        m.window_cap_s = args.seconds
        return m

    resident = measurer("resident") if "resident" in methods else None
    figures: dict[str, dict[str, list[float]]] = {m: {"naive": [], "tuned": []} for m in methods}
    with tempfile.TemporaryDirectory(prefix="saturate-sbs-") as tmp:
        for r in range(args.rounds):
            for method in methods if r % 2 == 0 else list(reversed(methods)):
                for name in plans if r % 2 == 0 else list(reversed(plans)):
                    if method == "train":
                        timed, _ = bench.timed_train(workload, plans[name], warmup=args.warmup, steps=args.steps,
                                                     hardware=hw, run_dir=Path(tmp) / f"{r}-{name}", seed=args.seed)
                        value = timed.tokens_per_s / workload.tokens_per_sample
                    else:
                        with _sampler(method != "no-sampler"):
                            m = resident if method == "resident" else measurer(method)
                            t = m.verify(plans[name])
                        if not t.ok:
                            raise SystemExit(f"{method} {name} failed: {t.error}")
                        value = t.samples_per_s or 0.0
                    figures[method][name].append(value)
                    print(f"  round {r + 1} {method:>10} {name:>5} {value:8.2f} samples/s", flush=True)
    if resident is not None:
        resident.close()
    ratio = {m: bench.ratios(f["tuned"], f["naive"]) for m, f in figures.items()}
    base = ratio.get("train")
    rows = [[m, bench.Spread.of(v).fmt(".3f"),
             bench.Spread.of(bench.ratios(v, base)).fmt(".3f") if base and m != "train" else "-"]
            for m, v in ratio.items()]
    bench.print_table(f"tuned ÷ naive by method ({args.preset}, {args.rounds} rounds)",
                      ["method", "tuned ÷ naive, median (range)", "÷ train, median (range)"], rows,
                      footer=["per-round ratios: each method measured both plans back to back in each round"])
    bench.write_json(args.json, {"benchmark": "side_by_side", "environment": bench.environment(hw),
                                 "args": vars(args), "samples_per_s": figures, "ratios": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
