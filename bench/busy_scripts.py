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
rounds, the neighbour stopped: bare where the setting can be written in by hand — into the loop, or into the
Trainer example's `TrainingArguments` (`reference`: no saturate in the process, the script timing itself) — else
whole trials (run_script.side_by_side). Checked, per the
issue's goals:

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
from saturate.engine.host_alloc import ENV_MMAP, ENV_TRIM, thresholds
from saturate.hardware import probe
from saturate.script.overrides import NONE, Overrides
from saturate.script.run_script import side_by_side
from saturate.stats.rounds import Ratio, interleaved

PY = sys.executable
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "scripts"

def script(case: str, over: Overrides = NONE, seconds: float | None = None) -> str | None:
    """The input or fused loop as Python source: as written (`over` empty, the step count from argv: what the tunes
    are given), or with `over` written in by hand and, with `seconds`, timing itself — steps/s in 2-s windows for
    `seconds`, printed as JSON — for the bare reference. None where `over` holds a setting this cannot write in."""
    if (over.trainer or over.lightning or over.train_loader or (over.optimizer and case != "fused")
            or (over.loader and case != "input") or over.bf16_autocast not in (None, "cpu")):
        return None
    loader = ", ".join(f"{k}={v!r}" for k, v in ({"num_workers": 0} | dict(over.loader)).items())
    fused = ", fused=True" if over.optimizer.get("fused") else ""
    head = (f"import json, sys, time, torch, torch.nn as nn\ntorch.set_num_threads({over.threads or 1})\n"
            + ("torch.backends.cuda.matmul.allow_tf32 = True\n" if over.tf32 else ""))
    if case == "input":
        body = f"""from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.randn(16), torch.randn(1)
loader = DataLoader(Slow(), batch_size=8, {loader})
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = iter(loader)
"""
        batch = "x, y = next(batches)\n    "
    else:
        body = f"""torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4{fused})
x, y = torch.randn(8, 512), torch.randn(8, 512)
"""
        batch = ""
    cast = "with torch.autocast('cpu', dtype=torch.bfloat16):\n        " if over.bf16_autocast else ""
    step = f"""def step():
    {batch}{cast}loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""
    if seconds is None:
        return head + body + step + "for _ in range(int(sys.argv[1])):\n    step()\n"
    return head + body + step + f"""t0 = last = time.perf_counter(); n = 0; rates = []
while last - t0 < {seconds}:
    step()
    n += 1
    if (now := time.perf_counter()) - last >= 2.0:
        rates.append(n / (now - last)); n = 0; last = now
print(json.dumps(rates))
"""


TRAINER = [str(EXAMPLES / "gpt2_finetune" / "train.py"), "--size", "toy", "--max-length", "64", "--max-steps",
           "100000", "--output-dir", "user-out"]


def trainer_script(over: Overrides, seconds: float) -> str | None:
    """The Trainer example with `over`'s `TrainingArguments` fields written in by hand (what the edit saturate prints
    does), timing its optimizer steps in 2-s windows for `seconds` with a callback of its own, printed as JSON, then
    ending (no save) — the bare reference of the trainer case. None where `over` holds a setting that is not a
    `TrainingArguments` field (threads and the host allocator are the process's: set as for the loops)."""
    if over.loader or over.train_loader or over.lightning or over.optimizer or over.bf16_autocast or over.tf32:
        return None
    return f"""import json, os, sys, time
import torch
torch.set_num_threads({over.threads or 1})
sys.path.insert(0, {str(EXAMPLES / "gpt2_finetune")!r})
sys.argv = {TRAINER!r}
import train
from transformers import TrainerCallback
class Windows(TrainerCallback):
    def __init__(self):
        self.t0 = self.last = time.perf_counter(); self.n = 0; self.rates = []
    def on_step_end(self, args, state, control, **kw):
        self.n += 1
        now = time.perf_counter()
        if now - self.last >= 2.0:
            self.rates.append(self.n / (now - self.last)); self.n = 0; self.last = now
        if now - self.t0 >= {seconds}:
            print(json.dumps(self.rates), flush=True)
            os._exit(0)
made, base = train.TrainingArguments, train.Trainer
train.TrainingArguments = lambda **kw: made(**{{**kw, **{dict(over.trainer)!r}}})
class Timed(base):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.add_callback(Windows())
train.Trainer = Timed
train.main()
"""


def bare(case: str, over: Overrides, seconds: float) -> str | None:
    """`case` with `over` written in by hand, timing itself (`script`, `trainer_script`); None where it cannot be."""
    return trainer_script(over, seconds) if case == "trainer" else script(case, over, seconds)


def commands(folder: Path) -> dict[str, list[str]]:
    for case in ("input", "fused"):
        (folder / f"{case}.py").write_text(script(case) or "")
    return {"input": [PY, "input.py", "1000000"], "fused": [PY, "fused.py", "1000000"], "trainer": [PY, *TRAINER]}


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


def reference(case: str, cmd: list[str], overrides: dict[str, Any], folder: Path,
              args: argparse.Namespace) -> tuple[Ratio | None, str]:
    """Tuned ÷ as written, quiet, in `--ref-rounds` alternating rounds, independent of the tuner: (ratio, how).

    "bare" where the setting can be written into the script by hand (`bare`): no saturate in the process, each
    run timing itself for `--ref-seconds` with its first 2-s window left out (start-up, loader workers, a fresh
    heap), a round's figure the median of its windows — what a user's long run sees. Else "trials": rounds of
    whole trials under saturate's hooks (run_script.side_by_side), which time a fresh process's first seconds
    (on the fused loop they read fused + the host allocator 2.72–2.98× where the bare loop reads 2.18×,
    bench/results/cpu-2026-11-28c/README.md)."""
    over = Overrides.from_dict(overrides)
    tuned = bare(case, over, args.ref_seconds)
    if tuned is None:
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            written, trials = side_by_side(cmd, over, rounds=args.ref_rounds, steps=args.trial_steps,
                                           quiet_stdout=True)
        finally:
            os.chdir(cwd)
        return Ratio.between([a.step_s for a in written], [t.step_s for t in trials]), "trials"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
    mmap, trim = thresholds()
    runs = {"as written": (bare(case, NONE, args.ref_seconds), env),
            "tuned": (tuned, env | ({ENV_MMAP: str(mmap), ENV_TRIM: str(trim)} if over.host_alloc else {}))}
    rates: dict[str, list[float | None]] = {"as written": [], "tuned": []}
    for _, name in interleaved(list(runs), args.ref_rounds):
        text, run_env = runs[name]
        path = folder / f"bare_{case}.py"
        path.write_text(text or "")
        out = subprocess.run([PY, str(path)], cwd=folder, env=run_env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"bare reference {case} {name}: {(out.stderr.strip().splitlines() or ['(no output)'])[-1]}")
        windows = json.loads(out.stdout.strip().splitlines()[-1])[1:] if out.returncode == 0 else []
        rates[name].append(statistics.median(windows) if windows else None)
    return Ratio.between(rates["tuned"], rates["as written"]), "bare"


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
    ap.add_argument("--ref-seconds", type=float, default=10.0,
                    help="each bare reference run's length (its first 2-s window left out)")
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
    how: dict[tuple[str, str], str] = {}
    for r in runs:  # every setting any tune tried or kept, measured quiet against as written
        for over in [t["overrides"] for t in r.get("tried", [])] + [r.get("overrides") or {}, r.get("found") or {}]:
            if over and (r["case"], key(over)) not in refs:
                refs[(r["case"], key(over))], how[(r["case"], key(over))] = reference(r["case"], cmds[r["case"]],
                                                                                     over, folder, args)
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
                     f"{printed:.3f}×" if printed else "-",
                     f"{ref.fmt()} {how[(r['case'], key(over))]}" if ref else "-",
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
                                 "references": {f"{c} {k}": (v.to_dict() | {"how": how[(c, k)]} if v else None)
                                                for (c, k), v in refs.items()},
                                 "kept_slower": slower, "printed_off": off})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
