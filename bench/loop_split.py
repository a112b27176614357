"""A hand-written loop's split of the effective batch, found and applied from outside (issue 59's first goal):
`saturate tune -- CMD` finds the faster split at the same effective batch, and the script under
`saturate run --overrides` (the split applied from outside) trains at the speed of the same split set by hand
(within 10 %, interleaved).

Three loops over one small MLP (effective batch 32, written as micro-batch 2 × accumulation 16), the split kept
three ways: argparse flags, module constants, a config dataclass's defaults. For each:

1. `saturate tune --json -- python LOOP` (the split it keeps, how it was verified);
2. then `--rounds` interleaved rounds of: the loop with the split applied from outside (`saturate run
   --overrides overrides.json --json`, its full run), and the same loop with that split written into its
   source by hand (no saturate) — each run's own rate, timed by the loop itself over its steps after the first
   `SKIP` (printed `rate R steps/s`);
3. the ratio per round, applied ÷ by hand: median and range.

    PYTHONPATH=src python3 bench/loop_split.py            # about 10 minutes on 2 quiet cores
    PYTHONPATH=src python3 bench/loop_split.py --rounds 1 --steps 100   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 20  # steps left out of a run's own rate (start-up)
BODY = """
torch.manual_seed(0)
data = TensorDataset(torch.randn(16384, 64), torch.randn(16384, 1))
loader = DataLoader(data, batch_size=MICRO, shuffle=True)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches, started = iter(loader), None
for step in range(STEPS):
    if step == SKIP:
        started = time.perf_counter()
    for _ in range(ACCUM):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y) / ACCUM
        loss.backward()
    opt.step()
    opt.zero_grad()
print(f"rate {(STEPS - SKIP) / (time.perf_counter() - started):.3f} steps/s")
"""
HEAD = "import argparse, dataclasses, sys, time, torch, torch.nn as nn\nfrom torch.utils.data import DataLoader, " \
       "TensorDataset\n"
LOOPS = {
    "flags": (HEAD + "p = argparse.ArgumentParser()\np.add_argument('--batch_size', type=int, default=2)\n"
              "p.add_argument('--grad_accum', type=int, default=16)\np.add_argument('--steps', type=int)\n"
              "args = p.parse_args()\nSTEPS, SKIP = args.steps, {skip}\n"
              + BODY.replace("MICRO", "args.batch_size").replace("ACCUM", "args.grad_accum")),
    "constants": (HEAD + "BATCH_SIZE = 2\nGRAD_ACCUM_STEPS = 16\nSTEPS, SKIP = int(sys.argv[1]), {skip}\n"
                  + BODY.replace("MICRO", "BATCH_SIZE").replace("ACCUM", "GRAD_ACCUM_STEPS")),
    "dataclass": (HEAD + "@dataclasses.dataclass\nclass Config:\n    batch_size: int = 2\n    grad_accum: int = 16\n"
                  "cfg = Config()\nSTEPS, SKIP = int(sys.argv[1]), {skip}\n"
                  + BODY.replace("MICRO", "cfg.batch_size").replace("ACCUM", "cfg.grad_accum")),
}
WRITTEN = {"flags": ("default=2)", "default=16)"), "constants": ("BATCH_SIZE = 2", "GRAD_ACCUM_STEPS = 16"),
           "dataclass": ("batch_size: int = 2", "grad_accum: int = 16")}


def command(kind: str, path: Path, steps: int) -> list[str]:
    return [sys.executable, str(path), *(["--steps", str(steps)] if kind == "flags" else [str(steps)])]


def by_hand(kind: str, text: str, micro: int, accum: int) -> str:
    """The loop with the split written into its source."""
    a, b = WRITTEN[kind]
    return text.replace(a, a.replace("2", str(micro)), 1).replace(b, b.replace("16", str(accum)), 1)


def rate(output: str) -> float:
    found = re.findall(r"rate ([0-9.]+) steps/s", output)
    if not found:
        raise SystemExit(f"no rate in the run's output:\n{output[-2000:]}")
    return float(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600, help="steps of each timed run")
    ap.add_argument("--out", default="bench/results/loop_split.json")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    saturate = [sys.executable, "-m", "saturate"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, template in LOOPS.items():
            folder = Path(tmp) / kind
            folder.mkdir()
            text = template.replace("{skip}", str(SKIP))
            loop = folder / "loop.py"
            loop.write_text(text)
            tune = subprocess.run([*saturate, "tune", "--json", "--trial-seconds", "2", "--out", str(folder / "t"),
                                   "--", *command(kind, loop, 100_000)], cwd=folder, env=env, capture_output=True,
                                  text=True, timeout=1800)
            if tune.returncode:
                raise SystemExit(f"{kind}: tune failed:\n{tune.stderr[-3000:]}")
            tuned = json.loads(tune.stdout)
            split = tuned["overrides"].get("train_loader", {})
            if not split:
                results[kind] = {"found": None, "decisions": tuned["decisions"]}
                print(f"{kind}: no split kept", flush=True)
                continue
            micro = split["batch_size"]
            accum = 32 // micro
            (folder / "hand.py").write_text(by_hand(kind, text, micro, accum))
            applied, hand = [], []
            for r in range(args.rounds):
                order = ("applied", "hand") if r % 2 == 0 else ("hand", "applied")
                for which in order:
                    if which == "applied":
                        out = subprocess.run([*saturate, "run", "--json", "--overrides", str(folder / "t" /
                                             "overrides.json"), "--", *command(kind, loop, args.steps)],
                                             cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
                        applied.append(rate(out.stderr))
                    else:
                        out = subprocess.run(command(kind, folder / "hand.py", args.steps), cwd=folder, env=env,
                                             capture_output=True, text=True, timeout=1800)
                        hand.append(rate(out.stdout))
            ratios = [a / h for a, h in zip(applied, hand, strict=True)]
            best = next(t for t in tuned["trials"] if t["name"] == tuned["best"]["name"])
            results[kind] = {"found": f"{micro} x {accum}", "written": "2 x 16", "speedup_tuned": tuned["speedup"],
                             "verified": best.get("note"), "edits": tuned["edits"], "applied_steps_per_s": applied,
                             "by_hand_steps_per_s": hand, "ratio_median": statistics.median(ratios),
                             "ratio_range": [min(ratios), max(ratios)]}
            print(f"{kind}: found {micro} x {accum} ({tuned['speedup']:.2f}x the loop as written, tuned); applied "
                  f"from outside / by hand: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
                  f"{max(ratios):.3f}, {args.rounds} interleaved rounds)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
