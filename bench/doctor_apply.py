"""`saturate doctor --apply -- CMD` on an input-bound loop: the doctor's predicted gain against the one it measures
(issue 62's goal: within ±25 %). The loop waits `--delay` seconds a sample in its Dataset (a slow decode) at
num_workers=0; the doctor's top fix is loader workers, which `--apply` sets from outside and times paired with the
script as written. Each repetition is a fresh doctor run; the log is every run's JSON.

    PYTHONPATH=src python3 bench/doctor_apply.py --reps 3 --out bench/results/cpu-2026-12-03/apply
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LOOP = """
import time, torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 100000
    def __getitem__(self, i):
        time.sleep({delay})
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Slow(), batch_size=8, shuffle=True):
    nn.functional.mse_loss(model(x), y).backward(); opt.step(); opt.zero_grad()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.002, help="seconds a sample waits (default 0.002)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "slow.py").write_text(LOOP.format(delay=a.delay))
        for rep in range(a.reps):
            out = subprocess.run([sys.executable, "-m", "saturate", "doctor", "--apply", "--json", "--no-trace",
                                  "--warmup", "1", "--steps", "4", "--", sys.executable, "slow.py"],
                                 cwd=folder, env=env, capture_output=True, text=True, timeout=600)
            (a.out / f"rep{rep}.json").write_text(out.stdout)
            (a.out / f"rep{rep}.stderr").write_text(out.stderr)
            d = json.loads(out.stdout)["applied"]
            rows.append({"rep": rep, "fix": d["fix"], "predicted": d["predicted_gain"], "measured": d["measured_gain"],
                         "comparison": d["comparison"], "verdict": d["verdict"],
                         "measured_over_predicted": d["measured_gain"] / d["predicted_gain"]})
            print(f"rep {rep}: {d['fix']}: predicted {d['predicted_gain']:.2f}×, measured {d['measured_gain']:.2f}× "
                  f"({rows[-1]['measured_over_predicted']:.2f} of it) — {d['comparison']}", flush=True)
    ratios = [r["measured_over_predicted"] for r in rows]
    summary = {"rows": rows, "median_measured_over_predicted": statistics.median(ratios),
               "within_25_percent": sum(abs(r - 1) <= 0.25 for r in ratios)}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"measured ÷ predicted: median {summary['median_measured_over_predicted']:.2f}, "
          f"{summary['within_25_percent']} of {len(ratios)} within ±25 %")


if __name__ == "__main__":
    main()
