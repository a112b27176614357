"""What saturate's hooks cost a user's script (`saturate doctor|tune|run -- CMD`): goal under 2 % of
step time while they measure, and nothing once they detach.

Guide 1's GPT pretraining script (examples/scripts/gpt_pretrain, `--config mid`: tens of milliseconds a
step on one core), unchanged, run four ways, each timed by the same clock on its optimizer steps
(bench/_step_clock.py) and ended after `--steps` steps:

- as written: no saturate;
- measuring: under the shim with the doctor's Profiler timing every step after its one warm-up step
  (no counted steps: their sync counting is not a timed mode), to the end of the run;
- detached: under the shim with a 1 + 2 step window, after which the hooks detach (nothing of saturate
  stays registered: tests/script/test_script_detach.py);
- counting: the mode of `saturate run -- CMD`'s full run (no Profiler; each optimizer step and batch
  counted for the whole run).

Two clocks: wall time, and the process's CPU time (every thread, the sampler's included; the time other
processes held the cores left out). Each run's figure is its median step over the steps after `--skip`;
rounds are interleaved (A, B, C, D | D, C, B, A | …) and the cost is the per-round ratio to the same
round's as-written run, median and range. Beside it, the hooks' own time as they account for it
themselves (`doctor/selftime.py`: the median timed step's time inside their bodies, measured in the same
runs) and the telemetry thread's CPU time per step.

From one process to the next a step's time moves by several per cent on a shared machine, more than the
goal. So a second part pairs neighbouring blocks inside one process (bench/_paired_hooks.py: guide 1's
model, data and step; the hooks installed as the shim does, measuring `--block` steps and detaching, then
`--block` steps with nothing of saturate registered, `--pairs` times): the cost is each pair's ratio of
median steps, measuring ÷ detached, summarised over pairs (median, quartiles, range); and what one window
adds once (installing, finding the model, the telemetry's start and last readings, the report), from its
first two steps and its last.

    PYTHONPATH=src python3 bench/script_overhead.py                 # about 10 minutes on 2 busy cores
    PYTHONPATH=src python3 bench/script_overhead.py --rounds 1 --steps 30 --pairs 2 --block 6  # a smoke run
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
from typing import Any

import _harness as bench
from saturate.hardware import probe
from saturate.script.boundary import ChildSettings
from saturate.script.command import run_instrumented

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "examples" / "scripts" / "gpt_pretrain" / "train.py"
CLOCK = HERE / "_step_clock.py"
PAIRED = HERE / "_paired_hooks.py"
NAMES = ["as written", "measuring", "detached", "counting"]


def settings(name: str, steps: int) -> ChildSettings:
    """The hooks' settings for a run of `steps` optimizer steps; the measuring window ends at the last one."""
    return {"measuring": ChildSettings(mode="doctor", warmup=1, count_steps=0, steps=steps - 2, stop=False),
            "detached": ChildSettings(mode="doctor", warmup=1, count_steps=0, steps=2, stop=False),
            "counting": ChildSettings(mode="apply", profile=False, stop=False)}[name]


def medians(ticks: list[list[float]], skip: int) -> dict[str, float]:
    """The median step's wall and CPU seconds, from the clock's [wall, cpu] after each step."""
    kept = ticks[skip:-1]  # the last step: the measuring run's report is written in it
    if len(kept) < 4:
        raise SystemExit(f"only {len(ticks)} steps recorded; lower --skip or raise --steps")
    return {clock: statistics.median(b[i] - a[i] for a, b in zip(kept, kept[1:], strict=False))
            for i, clock in enumerate(("wall", "cpu"))}


def run_once(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    clock = folder / "times.json"
    # inherited by the command (run_instrumented copies the environment)
    os.environ.update(STEP_CLOCK=str(clock), STEP_LIMIT=str(args.steps), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(CLOCK), str(SCRIPT), "--config", args.config, "--out-dir", str(folder / "out")]
    own = sampler = None
    if name == "as written":
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    else:
        run = run_instrumented(cmd, settings(name, args.steps), quiet_stdout=True)
        inst = (run.report or {}).get("instrumentation") or {}
        own = inst.get("per_step_s")
        if inst.get("sampler_cpu_s") is not None and inst.get("steps"):
            sampler = inst["sampler_cpu_s"] / inst["steps"]
    return {**medians(json.loads(clock.read_text()), args.skip), "own": own, "sampler": sampler}


def paired(args: argparse.Namespace) -> dict[str, Any]:
    """The in-process part: per pair, measuring ÷ detached (median steps) for each clock, and a window's
    once-only cost (its first two steps and its last, less three detached steps)."""
    with tempfile.TemporaryDirectory(prefix="saturate-paired-") as tmp:
        env = {**os.environ, "SATURATE_SCRIPT_DIR": tmp, "OMP_NUM_THREADS": "1"}
        out = Path(tmp) / "steps.json"
        subprocess.run([sys.executable, str(PAIRED), "--config", args.config, "--pairs", str(args.pairs),
                        "--block", str(args.block), "--out", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
        steps = json.loads(out.read_text())
    cost: dict[str, list[float]] = {"cpu": [], "wall": []}
    once: list[float] = []
    for p in range(args.pairs):
        mine = [s for s in steps if s["pair"] == p]
        for clock in cost:
            on, off = (statistics.median(s[clock] for s in mine if s["role"] == r) for r in ("on", "off"))
            cost[clock].append(on / off - 1)
            if clock == "cpu":
                edges = [s["cpu"] for s in mine if s["role"] in ("start", "warm-up")] + \
                    [[s["cpu"] for s in mine if s["role"] == "on"][-1]]
                once.append(sum(edges) - len(edges) * off)
    return {"cost": cost, "window_once_cpu_s": once}


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid", choices=["tiny", "mid", "small", "medium"], help="the script's config")
    ap.add_argument("--steps", type=int, default=90, help="optimizer steps per run (default 90)")
    ap.add_argument("--skip", type=int, default=10, help="steps left out at the start of each run (default 10)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=30, help="in-process pairs of blocks (default 30)")
    ap.add_argument("--block", type=int, default=12, help="steps per in-process block (default 12)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    args = ap.parse_args()
    bench.require_positive(ap, rounds=args.rounds, skip=args.skip, steps=args.steps, pairs=args.pairs,
                           block=args.block)
    if args.steps < args.skip + 6:
        ap.error(f"--steps must be at least --skip + 6 ({args.skip + 6})")
    runs = bench.run_rounds(NAMES, args.rounds, lambda name, d: run_once(name, args, d),
                            lambda r, name, m: f"round {r}: {name}: {1000 * m['wall']:.2f} ms wall, "
                                               f"{1000 * m['cpu']:.2f} ms CPU per step (median)")
    step = {clock: {name: [m[clock] for m in runs[name]] for name in NAMES} for clock in ("wall", "cpu")}
    cost = {clock: {name: bench.Spread.of([x - 1 for x in bench.ratios(step[clock][name], step[clock]["as written"])])
                    for name in NAMES} for clock in step}
    own, sampler = ({name: [m[k] for m in runs[name] if m[k] is not None] for name in NAMES}
                    for k in ("own", "sampler"))
    rows = [[name, bench.Spread.of(step["cpu"][name]).fmt(".2f", 1000, " ms"),
             *("-" if name == "as written" else cost[clock][name].fmt("+.2f", 100, " %") for clock in ("cpu", "wall")),
             *(bench.Spread.of(f[name]).fmt(".3f", 1000, " ms") if f[name] and name == "measuring" else "-"
               for f in (own, sampler))]
            for name in NAMES]
    pairs = paired(args)
    hw = probe(measure_peaks=False, device="cpu")
    load = os.getloadavg()
    bench.print_table(f"saturate's hooks on guide 1's script ({args.config}, {args.steps} steps a run), "
                      f"{args.rounds} interleaved rounds, {bench.device_label(hw)}",
                      ["run", "CPU time per step: median (range)", "cost, CPU time: median (range)",
                       "cost, wall time: median (range)", "inside the hooks per step (selftime)",
                       "telemetry thread's CPU per step"], rows,
                      ["cost: per-round ratio to the same round's as-written run, less 1; median (range) over rounds",
                       "goal: under +2 % while measuring, about 0 once detached",
                       f"load average at the end: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)"])
    rows = []
    for clock in ("cpu", "wall"):
        c = pairs["cost"][clock]
        lo, hi = quartiles(c)
        rows.append([f"measuring ÷ detached, {clock} time", f"{100 * statistics.median(c):+.2f} %",
                     f"{100 * lo:+.2f}..{100 * hi:+.2f} %", f"{100 * min(c):+.2f}..{100 * max(c):+.2f} %"])
    once = bench.Spread.of(pairs["window_once_cpu_s"])
    bench.print_table(f"the same hooks attached and detached in turn in one process: {args.pairs} pairs of "
                      f"{args.block}-step blocks", ["per step", "median over pairs", "quartiles", "range"], rows,
                      [f"what one window adds once, CPU time: {once.fmt('.1f', 1000, ' ms')} (median (range) over "
                       "pairs)",
                       "goal: under +2 % while measuring"])
    bench.write_json(args.json, {"config": args.config, "steps": args.steps, "skip": args.skip,
                                 "rounds": args.rounds, "step_s": step, "own_per_step_s": own,
                                 "sampler_cpu_per_step_s": sampler,
                                 "cost": {c: {k: v.to_dict() for k, v in cost[c].items()} for c in cost},
                                 "paired": {"pairs": args.pairs, "block": args.block, **pairs},
                                 "load_average": load, "environment": bench.environment(hw)})


if __name__ == "__main__":
    main()
