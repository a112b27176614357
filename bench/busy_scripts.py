"""`saturate tune -- CMD` on a quiet and on a busy machine (issue 28): no confident wrong decision, still useful.

Three scripts that never import saturate, each tuned `--reps` times per condition, `quiet` and `bursty` (the shared
seeded neighbour, `../shared/tools/neighbour.py --profile bursty`, started outside our process tree):

* input: a loop whose dataset sleeps 4 ms per sample, loaded in the training process (0 workers) — the real gain is
  loader workers (~2× at 2 workers);
* fused: a plain AdamW loop over a ~2 M-parameter MLP — the change on offer is fused AdamW;
* trainer: examples/scripts/gpt2_finetune (a Transformers `Trainer`, toy size) — micro-batch × accumulation and the
  fused optimizer through its `TrainingArguments`.

Each tune's decision is read from its JSON: the overrides kept, the printed ratio (the paired confirmation against
the script as written) and every trial's paired ratio. The reference is independent and quiet: after the tunes,
each distinct setting any tune tried is measured against the script as written in `--ref-rounds` alternating
rounds of whole trials (run_script.side_by_side, the neighbour stopped). Checked, per the issue's goals:

* zero confident wrong decisions: nothing kept that the reference measures ≥ 5 % slower than as written, and no
  printed ratio outside ±15 % of the reference;
* still useful: a real gain of ≥ 20 % (by the reference) found in ≥ 2 of 3 bursty tunes and every quiet one;
* every tune's wall time.

`--verb run` runs `saturate run -- CMD` instead (each script given a step count its whole run ends at, RUN_STEPS):
the decision is what the whole run applied (tuned settings only when its side-by-side confirmed them), the printed
ratio its side-by-side's, and the reference measures both what it applied and what it found.

    PYTHONPATH=src python3 bench/busy_scripts.py                                  # ~30 minutes
    PYTHONPATH=src python3 bench/busy_scripts.py --cases input --reps 1 --conditions quiet --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as bench
from _harness import neighbour
from saturate.hardware import probe
from saturate.script.overrides import Overrides
from saturate.script.run_script import side_by_side
from saturate.stats.rounds import Ratio

PY = sys.executable
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "scripts"

INPUT = """
import sys, time, torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
torch.set_num_threads(1)
class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.randn(16), torch.randn(1)
loader = DataLoader(Slow(), batch_size=8, num_workers=0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step + 1 == int(sys.argv[1]):
        break
"""

FUSED = """
import sys, torch, torch.nn as nn
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = torch.randn(8, 512), torch.randn(8, 512)
for step in range(int(sys.argv[1])):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def commands(folder: Path) -> dict[str, list[str]]:
    (folder / "input.py").write_text(INPUT)
    (folder / "fused.py").write_text(FUSED)
    return {"input": [PY, "input.py", "1000000"], "fused": [PY, "fused.py", "1000000"],
            "trainer": [PY, str(EXAMPLES / "gpt2_finetune" / "train.py"), "--size", "toy", "--max-length", "64",
                        "--max-steps", "100000", "--output-dir", "user-out"]}


def saturate_json(verb: list[str], cmd: list[str], folder: Path,
                  args: argparse.Namespace) -> tuple[dict[str, Any] | None, float, str | None]:
    """`saturate VERB --json -- CMD` with the bench's trial settings: (its JSON, wall seconds, its error line)."""
    started = time.monotonic()
    out = subprocess.run([PY, "-m", "saturate", *verb, "--trial-steps", str(args.trial_steps), "--trial-seconds",
                          str(args.trial_seconds), "--json", "--", *cmd],
                         cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.monotonic() - started
    if out.returncode != 0:
        return None, wall, (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return json.loads(out.stdout), wall, None


def tune_once(cmd: list[str], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    d, wall, error = saturate_json(["tune", "--out", str(folder / "tune")], cmd, folder, args)
    if d is None:
        return {"error": error, "wall_s": wall}
    tried = [{"name": t["name"], "overrides": t["overrides"], "outcome": t["outcome"],
              "pair_ratio": None if not t.get("pair") or t["pair"].get("gain") is None else 1 + t["pair"]["gain"]}
             for t in d["trials"][1:]]
    return {"overrides": d["overrides"], "speedup": d["speedup"], "paired": d["paired"], "wall_s": wall,
            "confirmation": d["confirmation"], "tried": tried, "decisions": d["decisions"]}


RUN_STEPS = {"input": 1500, "fused": 3000, "trainer": 1500}  # whole runs of ~30–60 s as written, quiet


def for_run(case: str, cmd: list[str], steps: dict[str, int] | None = None) -> list[str]:
    """The command with a step count the whole run ends at (`run` trains the script to its end): `steps`, else
    RUN_STEPS."""
    cmd, n = list(cmd), {**RUN_STEPS, **(steps or {})}[case]
    if case == "trainer":
        cmd[cmd.index("--max-steps") + 1] = str(n)
    else:
        cmd[-1] = str(n)
    return cmd


def run_once(cmd: list[str], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`saturate run -- CMD`: what it applied to the whole run (decide, confirm, act) and the ratio it printed."""
    d, wall, error = saturate_json(["run"], cmd, folder, args)
    if d is None:
        return {"error": error, "wall_s": wall}
    side = d.get("side_by_side") or {}
    printed = (1 + side["gain"] if side.get("paired") and side.get("gain") is not None  # what it printed, paired
               else (d.get("speedup") or {}).get("median"))
    return {"overrides": d["overrides"] if d["applied"] else {}, "found": d["overrides"], "speedup": printed,
            "applied": d["applied"], "withheld": d["withheld"], "reason": d["reason"], "wall_s": wall,
            "short_job": d["short_job"], "side_by_side": side, "full_s": d["full_run"]["seconds"], "tried": []}


def reference(cmd: list[str], overrides: dict[str, Any], folder: Path, args: argparse.Namespace) -> Ratio | None:
    """Tuned ÷ as written, quiet, in alternating rounds of whole trials (independent of the tuner's pairs)."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        written, tuned = side_by_side(cmd, Overrides.from_dict(overrides), rounds=args.ref_rounds,
                                      steps=args.trial_steps, quiet_stdout=True)
    finally:
        os.chdir(cwd)
    return Ratio.between([a.step_s for a in written], [t.step_s for t in tuned])


def key(overrides: dict[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="input,fused,trainer")
    ap.add_argument("--conditions", default="quiet,bursty")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trial-steps", type=int, default=4)
    ap.add_argument("--trial-seconds", type=float, default=4.0)
    ap.add_argument("--ref-rounds", type=int, default=4)
    ap.add_argument("--verb", choices=("tune", "run"), default="tune",
                    help="tune -- CMD (the default), or run -- CMD: tune, side by side, and the whole run (its steps: "
                         "RUN_STEPS), where the decision is what the whole run applied")
    ap.add_argument("--run-steps", default="", metavar="CASE=N,…",
                    help="--verb run: other step counts than RUN_STEPS (trainer=6000: long enough to tune)")
    ap.add_argument("--json")
    args = ap.parse_args()
    steps = {k: int(v) for k, v in (x.split("=") for x in args.run_steps.split(",") if x)}
    folder = Path(tempfile.mkdtemp(prefix="busy-scripts-"))
    cmds = {k: v for k, v in commands(folder).items() if k in args.cases.split(",")}
    if args.verb == "run":
        cmds = {k: for_run(k, v, steps) for k, v in cmds.items()}
    once = run_once if args.verb == "run" else tune_once
    runs: list[dict[str, Any]] = []
    for cond in args.conditions.split(","):
        load = neighbour(cond, args.seed) if cond != "quiet" else contextlib.nullcontext()
        with load:
            for rep in range(args.reps):
                for case, cmd in cmds.items():
                    r = once(cmd, folder, args)
                    r.update(condition=cond, case=case, rep=rep + 1)
                    runs.append(r)
                    print(f"{cond} {case} #{rep + 1}: {r.get('overrides', r.get('error'))} "
                          f"{r.get('speedup') or 0:.3f}× in {r['wall_s']:.0f} s"
                          + (f" ({r['reason'] or r['withheld']})" if r.get("reason") or r.get("withheld") else ""),
                          flush=True)
    refs: dict[tuple[str, str], Ratio | None] = {}
    for r in runs:  # every setting any tune tried or kept, measured quiet against as written
        for over in [t["overrides"] for t in r.get("tried", [])] + [r.get("overrides") or {}, r.get("found") or {}]:
            if over and (r["case"], key(over)) not in refs:
                refs[(r["case"], key(over))] = reference(cmds[r["case"]], over, folder, args)
    rows, slower, off, found = [], 0, 0, {}
    for r in runs:
        over = r.get("overrides") or {}
        ref = refs.get((r["case"], key(over))) if over else None
        printed = r.get("speedup")
        bad = []
        if ref is not None and ref.median < 0.95:
            bad.append("kept a slower setting")
        if ref is not None and printed and abs(printed / ref.median - 1) > 0.15:
            bad.append("printed ratio off the reference by > 15 %")
        slower += "kept a slower setting" in bad
        off += any(b.startswith("printed ratio off") for b in bad)
        real = [k for (case, k), v in refs.items() if case == r["case"] and v is not None and v.median >= 1.2]
        hit = bool(over) and key(over) in real
        found.setdefault((r["condition"], r["case"]), []).append((hit, bool(real)))
        rows.append([r["condition"], r["case"], str(r["rep"]), key(over) if over else ("error: " + r["error"]
                                                                                        if "error" in r else "{}"),
                     f"{printed:.3f}×" if printed else "-", ref.fmt() if ref else "-",
                     f"{r['wall_s']:.0f} s", "; ".join(bad) or "ok"])
    bench.print_table(f"{args.verb} -- CMD: decision, printed ratio, quiet reference",
                      ["condition", "case", "rep", "kept", "printed", "reference", "wall", "check"], rows)
    for (cond, case), hits in found.items():
        if any(real for _, real in hits):
            print(f"{cond} {case}: a real gain ≥ 20 % found in {sum(h for h, _ in hits)} of {len(hits)}")
    print(f"kept or applied a setting the reference measures slower: {slower} of {len(runs)}; "
          f"printed ratio off the reference by > 15 %: {off} of {len(runs)}")
    walls = [r["wall_s"] for r in runs]
    print(f"tune wall time: median {statistics.median(walls):.0f} s, max {max(walls):.0f} s")
    hw = probe(measure_peaks=False)
    bench.write_json(args.json, {"benchmark": "busy_scripts", "environment": bench.environment(hw),
                                 "args": vars(args), "runs": runs,
                                 "references": {f"{c} {k}": (v.to_dict() if v else None) for (c, k), v in
                                                refs.items()}, "kept_slower": slower, "printed_off": off})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
