"""Tuned vs as written for each guide script (examples/scripts), through `saturate run -- CMD`: saturate
tunes what it can change from outside, measures the script as written and tuned side by side in
alternating rounds, then runs it whole with the tuned settings. Printed: each script's tuned ÷ as-written
speed (median of the per-round ratios, with their range), the overrides found and the edit they mean,
for the session's bench/results/<folder>/README.md (and docs/results.md).

    PYTHONPATH=src python3 bench/scripts_tuned.py                       # all four, their default test sizes
    PYTHONPATH=src python3 bench/scripts_tuned.py --only gpt_pretrain --trial-steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as bench
from saturate.hardware import probe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "scripts"
PY = sys.executable
# each guide's script at a size a CPU runs in minutes (pass --size-args to change them)
SCRIPTS = {
    "gpt_pretrain": [PY, str(EXAMPLES / "gpt_pretrain" / "train.py"), "--config", "small", "--out-dir", "{out}"],
    "chat_sft": ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLES / "chat_sft" / "train_low_mem.py"),
                 "train", "--size", "toy", "--max-steps", "40", "--output-dir", "{out}"],
    "gpt2_finetune": [PY, str(EXAMPLES / "gpt2_finetune" / "train.py"), "--size", "toy", "--max-length", "64",
                      "--max-steps", "60", "--output-dir", "{out}"],
    "timeseries_grid": [PY, str(EXAMPLES / "timeseries_grid" / "train.py"), "--hidden", "64", "--window", "30",
                        "--epochs", "1", "--length", "8000"],
}


def measure(name: str, trial_steps: int, folder: Path) -> dict:
    cmd = [part.replace("{out}", str(folder / "out")) for part in SCRIPTS[name]]
    env = dict(os.environ)
    if name == "chat_sft" and not _has_gpu():
        env["ACCELERATE_USE_CPU"] = "1"  # two CPU processes (gloo)
    out = subprocess.run([PY, "-m", "saturate", "run", "--trial-steps", str(trial_steps), "--json", "--", *cmd],
                         cwd=folder, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"{name}: saturate run failed: {last[0]}")
    return json.loads(out.stdout)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(SCRIPTS), default=list(SCRIPTS))
    ap.add_argument("--trial-steps", type=int, default=5, help="timed steps per trial and side-by-side run")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    args = ap.parse_args()
    bench.require_positive(ap, trial_steps=args.trial_steps)
    results, rows = {}, []
    for name in args.only:
        with tempfile.TemporaryDirectory(prefix=f"saturate-{name}-") as tmp:
            d = measure(name, args.trial_steps, Path(tmp))
        results[name] = d
        # nothing kept by the tuning: no side-by-side (it would time the same command twice), the script as written
        ratio = bench.Spread.of(d["ratios"]).fmt(".2f", unit="×") if d["ratios"] else "- (nothing to apply)"
        rows.append([name, ratio, str(len(d["ratios"])), json.dumps(d["overrides"]) or "{}",
                     f"{d['full_run']['steps_per_s']:.3g}" if d["full_run"].get("steps_per_s") else "-"])
        print(f"{name}: tuned ÷ as written {ratio}", flush=True)
    hw = probe(measure_peaks=False)
    date = datetime.date.today().isoformat()
    bench.print_table(f"guide scripts, tuned ÷ as written (saturate run -- CMD), {bench.device_label(hw)}, {date}",
                      ["script", "tuned ÷ as written: median (range)", "rounds", "overrides", "full run steps/s"],
                      rows, ["ratios are per alternating round (as written, tuned, …); measured, not predicted"])
    bench.write_json(args.json, {"date": date, "results": results, "environment": bench.environment(hw)})


if __name__ == "__main__":
    main()
