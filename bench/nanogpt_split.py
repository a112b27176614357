"""nanoGPT's split found through its flags (issue 59's nanoGPT goal): `saturate tune -- CMD` on karpathy/nanoGPT's
train.py (shakespeare-char, a small model, the CPU) written as micro-batch 1 × accumulation 32 finds the faster split
at the same effective batch through its configurator's `--batch_size=` / `--gradient_accumulation_steps=` flags, and
`saturate run --overrides` (those flags alone, appended from outside) trains at the speed of the same flags given by
hand.

1. `saturate tune --json -- CMD` (the split it keeps, how it was verified);
2. `--rounds` interleaved rounds of: `saturate run --overrides overrides.json -- CMD` (its full run) and
   `CMD --batch_size=M --gradient_accumulation_steps=A` by hand (no saturate) — each timed by nanoGPT itself: the
   median of the `iter N: … time T ms` lines it prints every `--log_interval` iterations, the first left out;
3. the ratio per round, by hand's iteration time ÷ applied (above 1: the applied run is faster): median and range.

nanoGPT as in bench/real_scripts.py (`--nanogpt-git`: a mirror of karpathy/nanoGPT; its data written offline).

    PYTHONPATH=src python3 bench/nanogpt_split.py --out bench/results/DIR/nanogpt_split.json   # ~15 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_scripts import MIRRORS, prep_nanogpt  # noqa: E402

FLAGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--n_layer=2", "--n_head=2",
         "--n_embd=64", "--block_size=64", "--eval_iters=5", "--log_interval=10", "--always_save_checkpoint=False"]
WRITTEN = ["--batch_size=1", "--gradient_accumulation_steps=32"]


def iter_ms(output: str) -> float:
    """The median of nanoGPT's own per-iteration times (its `iter N: loss L, time T ms` lines), the first left out."""
    times = [float(t) for t in re.findall(r"^iter \d+: loss [0-9.]+, time ([0-9.]+)ms", output, re.M)][1:]
    if len(times) < 3:
        raise SystemExit(f"fewer than 3 timed iterations in the run's output:\n{output[-2000:]}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="max_iters of each timed run")
    ap.add_argument("--nanogpt-git", type=Path, default=MIRRORS / "karpathy+nanoGPT" / "repo")
    ap.add_argument("--out", default="bench/results/nanogpt_split.json")
    args = ap.parse_args()
    saturate = [sys.executable, "-m", "saturate"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "nanogpt"
        commit = prep_nanogpt(folder, args)
        base = [sys.executable, "train.py", *FLAGS]
        timed = [*base, f"--max_iters={args.iters}", f"--eval_interval={args.iters * 10}"]
        tune = subprocess.run([*saturate, "tune", "--json", "--out", str(Path(tmp) / "t"), "--", *base,
                               *WRITTEN, "--max_iters=100000", "--eval_interval=100000"], cwd=folder,
                              capture_output=True, text=True, timeout=3600)
        if tune.returncode:
            raise SystemExit(f"tune failed:\n{tune.stderr[-3000:]}")
        tuned = json.loads(tune.stdout)
        flags = tuned["overrides"].get("flags", {})
        result = {"nanogpt": commit, "command": " ".join([*base, *WRITTEN]), "decisions": tuned["decisions"],
                  "edits": tuned["edits"], "speedup_tuned": tuned.get("speedup"), "flags": flags}
        if flags:
            best = next(t for t in tuned["trials"] if t["name"] == tuned["best"]["name"])
            hand = [f"--{k}={v}" for k, v in flags.items()]
            split_only = Path(tmp) / "split.json"  # the split alone: what by hand sets (not threads kept under load)
            split_only.write_text(json.dumps({"flags": flags}))
            applied_ms, hand_ms = [], []
            for r in range(args.rounds):
                for which in (("applied", "hand") if r % 2 == 0 else ("hand", "applied")):
                    if which == "applied":
                        out = subprocess.run([*saturate, "run", "--json", "--overrides", str(split_only), "--",
                                              *timed, *WRITTEN], cwd=folder,
                                             capture_output=True, text=True, timeout=3600)
                        applied_ms.append(iter_ms(out.stderr + out.stdout))
                    else:
                        out = subprocess.run([*timed, *WRITTEN, *hand], cwd=folder, capture_output=True, text=True,
                                             timeout=3600)
                        hand_ms.append(iter_ms(out.stdout))
            ratios = [h / a for a, h in zip(applied_ms, hand_ms, strict=True)]
            result.update(verified=best.get("note"), applied_iter_ms=applied_ms, by_hand_iter_ms=hand_ms,
                          ratio_median=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)])
            print(f"nanoGPT: found {' '.join(hand)} ({tuned.get('speedup')}x as written, tuned); applied from "
                  f"outside / by hand (speed): median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
                  f"{max(ratios):.3f}, {args.rounds} interleaved rounds)", flush=True)
        else:
            print("nanoGPT: no split kept: " + "; ".join(d for d in tuned["decisions"] if "micro-batch" in d))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
