"""The doctor's verdict on a busy machine (issue 14): the same in 3 of 3 runs per case, quiet and loaded.

Each case is diagnosed `--runs` (3) times in a row with `diagnose()` (its timed windows, the rules'
ranges), quiet and then with a second process keeping one core busy (trust.py's `condition`, the
same busy loop). A case passes when every run of a condition gives the same verdict; under load
that verdict may rightly be "contended" (other processes were measured using the machine, so no
verdict blames the workload), which counts as agreeing with itself, not with the quiet verdict.
`bursty` runs the shared neighbour (`../shared/tools/neighbour.py --profile bursty`, seeded, in a session of its
own) instead of the busy loop: since 2026-11-25 a finding the load cannot cause (the input case: its loading runs
inside the training process) keeps its verdict and fix there (doctor/busy.py), so it should agree with quiet.

The cases:

* compute: gpt-tiny at its default plan (the doctor's healthy case);
* input: 8 samples per step, each sleeping 5 ms, into a small MLP (doctor_predictions.py's case);
* overhead: a 16→8→1 MLP at micro-batch 1 × accumulation 32 (doctor_predictions.py's case).

Printed per case and condition: the verdicts in run order, how many agree with the most common one,
and each run's measured wait for data (its range over the timed windows) and step-time spread, so a
flip can be traced to the figure that moved. One intra-op thread (--threads), as
doctor_predictions.py, for the same reason (two OpenMP threads on a shared 2-core machine stall at
every barrier).

    PYTHONPATH=src python3 bench/doctor_stability.py                             # about 5 minutes
    PYTHONPATH=src python3 bench/doctor_stability.py --runs 1 --cases input --conditions quiet --seconds 0.5
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Any

import torch

import _harness as bench
from doctor_predictions import Samples, mlp
from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads.coupling import workload_default_plan
from trust import condition

CASES = ("compute", "input", "overhead")


def cases(names: list[str], seed: int, hw: Any) -> dict[str, tuple[Any, Plan]]:
    out: dict[str, tuple[Any, Plan]] = {}
    for name in names:
        if name == "compute":
            workload = bench.bench_workload("gpt-tiny", seed)
            out[name] = (workload, workload_default_plan(workload, hw)[0])
        elif name == "input":
            out[name] = (mlp(Samples(delay=0.005), 8, 64), Plan(micro_batch=8))
        else:
            out[name] = (mlp(Samples(), 32, 8), Plan(micro_batch=1, grad_accum=32))
    return out


def one_run(workload: Any, plan: Plan, cfg: DoctorConfig, hw: Any) -> dict[str, Any]:
    started = time.monotonic()
    d = diagnose(workload, plan, cfg, hardware=hw)
    m = d.measurements
    low, high = m.share_range("data")
    return {"verdict": d.verdict, "fix": d.fixes[0].title if d.fixes else None,
            "findings": [f.verdict for f in d.findings if f.verdict != "note"],
            "seconds": time.monotonic() - started, "steps": m.steps,
            "windows": len(m.window_shares), "step_s": m.step_s, "step_spread": m.step_spread,
            "data_share": m.share("data"), "data_range": [low, high],
            "fixed_share_range": list(m.scaling.fixed_share_range(m.micro_batch)) if m.scaling and m.micro_batch
            else None,
            "contended": bool(m.contention and m.contention.get("significant")),
            "within_noise": [e for f in d.findings if f.verdict == "note" for e in f.evidence if "within noise" in e]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="diagnoses per case and condition (default 3)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)} (default: all)")
    ap.add_argument("--conditions", default="quiet,loaded", help="quiet, loaded, bursty, steady (default quiet,loaded)")
    ap.add_argument("--seconds", type=float, default=2.0, help="the doctor's minimum timed seconds (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    args = ap.parse_args(argv)
    bench.require_positive(ap, runs=args.runs, threads=args.threads)
    names = [c for c in args.cases.split(",") if c]
    conditions = [c for c in args.conditions.split(",") if c]
    if not set(names) <= set(CASES):
        ap.error(f"--cases takes some of {', '.join(CASES)}, got {args.cases!r}")
    if not set(conditions) <= {"quiet", "loaded", "bursty", "steady"}:
        ap.error(f"--conditions takes some of quiet, loaded, bursty, steady, got {args.conditions!r}")
    torch.set_num_threads(args.threads)
    hw = probe(measure_peaks=False, device="cpu")
    cfg = DoctorConfig(steps=10, warmup=2, count_steps=1, min_seconds=args.seconds, seed=args.seed)
    print(f"# doctor stability on {bench.device_label(hw)}, {time.strftime('%Y-%m-%d')}: {args.runs} runs per case "
          f"and condition, {args.threads} thread(s)", flush=True)
    result: dict[str, Any] = {"benchmark": "doctor_stability", "environment": bench.environment(hw),
                              "args": vars(args), "cases": {}}
    rows = []
    started = time.monotonic()
    for c in conditions:
        with condition(c, args.seed):
            for name, (workload, plan) in cases(names, args.seed, hw).items():
                runs = []
                for i in range(args.runs):
                    r = one_run(workload, plan, cfg, hw)
                    runs.append(r)
                    lo, hi = r["data_range"]
                    also = ", ".join(r["findings"])
                    print(f"  {c:<6} {name:<8} run {i + 1}: {r['verdict']:<15} ({also}) fix {r['fix']!r} "
                          f"data {100 * lo:.0f}..{100 * hi:.0f} % "
                          f"step ±{100 * (r['step_spread'] or 0):.1f} % over {r['windows']} windows, "
                          f"{r['seconds']:.0f} s", flush=True)
                common, agree = collections.Counter(r["verdict"] for r in runs).most_common(1)[0]
                result["cases"].setdefault(name, {})[c] = {"runs": runs, "verdict": common, "agree": agree,
                                                           "all_agree": agree == len(runs)}
                spreads = [r["step_spread"] for r in runs if r["step_spread"] is not None]
                fixes = collections.Counter(r["fix"] for r in runs).most_common(1)[0][1]
                rows.append([f"{name} ({c})", " / ".join(r["verdict"] for r in runs), f"{agree} of {len(runs)}",
                             f"{fixes} of {len(runs)}",
                             " / ".join(f"{100 * r['data_range'][0]:.0f}..{100 * r['data_range'][1]:.0f}"
                                        for r in runs),
                             f"{100 * max(spreads):.1f} %" if spreads else "-",
                             str(sum(r["contended"] for r in runs))])
    bench.print_table(f"doctor stability, {time.monotonic() - started:.0f} s in all", [
        "case", "verdicts", "agree (goal: all)", "same top fix", "data % range per run", "max step ±",
        "runs contended"], rows,
        footer=["each run one diagnose(): timed windows until their step rates agree (or the cap, doubled when "
                "busy); ranges over the windows"])
    result["all_agree"] = all(v["all_agree"] for per in result["cases"].values() for v in per.values())
    bench.write_json(args.json, result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
