"""How much of a script's speed stays with the process: the same loop in fresh processes, A and B alternating.

Why (issue 28): `run -- CMD` printed fused AdamW's gain on a small MLP as 2.41× and 1.34× on two quiet runs, each
from one pair of processes whose windows agreed within a few percent. If a process keeps a speed of its own (where
its memory landed, which cache sets its buffers share), one pair of processes is one draw, however many windows
it is timed for — and the ratio of two processes carries both their draws. This measures it: `--procs` fresh
processes per setting, alternating (A B A B …, so a slow stretch of the machine falls on both), each timing
`--steps` steps after a warm-up; printed, each process's median step time and the spread of its windows, then
per setting the spread across processes, and the ratio B ÷ A over adjacent pairs of processes.

    python3 bench/process_spread.py --procs 6            # ~1 minute, quiet machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LOOP = r"""
import json, sys, time, statistics, torch, torch.nn as nn
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=sys.argv[1] == "fused")
x, y = torch.randn(8, 512), torch.randn(8, 512)
warm, steps, times = 100, int(sys.argv[2]), []
for step in range(warm + steps):
    t = time.perf_counter()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    times.append(time.perf_counter() - t)
w = times[warm:]
thirds = [statistics.median(w[i * len(w) // 3:(i + 1) * len(w) // 3]) for i in range(3)]
print(json.dumps({"median_ms": 1000 * statistics.median(w), "thirds_ms": [1000 * t for t in thirds]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=6, help="fresh processes per setting")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"unfused": [], "fused": []}
    for i in range(args.procs):
        for name in (("unfused", "fused") if i % 2 == 0 else ("fused", "unfused")):
            out = subprocess.run([sys.executable, "-c", LOOP, name, str(args.steps)], capture_output=True, text=True,
                                 check=True)
            r = json.loads(out.stdout)
            within = (max(r["thirds_ms"]) - min(r["thirds_ms"])) / r["median_ms"]
            rows[name].append(r | {"within": within})
            print(f"process {i + 1} {name:8s} {r['median_ms']:7.2f} ms/step (its thirds within ±{50 * within:.1f} %)",
                  flush=True)
    for name, rs in rows.items():
        ms = [r["median_ms"] for r in rs]
        print(f"{name:8s} across {len(ms)} processes: median {statistics.median(ms):.2f} ms, range "
              f"{min(ms):.2f}–{max(ms):.2f} ({100 * (max(ms) / min(ms) - 1):.0f} % apart); within one process "
              f"±{50 * max(r['within'] for r in rs):.1f} % at most")
    ratios = [a["median_ms"] / b["median_ms"] for a, b in zip(rows["unfused"], rows["fused"], strict=True)]
    print(f"fused ÷ unfused speed, process by process: {', '.join(f'{r:.2f}×' for r in ratios)} — median "
          f"{statistics.median(ratios):.2f}×, range {min(ratios):.2f}–{max(ratios):.2f}×")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
