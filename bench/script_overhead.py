"""What saturate's hooks cost a user's script (`saturate doctor|tune|run -- CMD`): goal under 2 % of
step time while they measure, and nothing once they detach.

Three runs of guide 1's GPT pretraining script (examples/scripts/gpt_pretrain), each unchanged and
each timed by the same clock on its optimizer steps (bench/_step_clock.py):

- as written: no saturate;
- measuring: under the shim with the doctor's Profiler timing every step of the run (its warm-up,
  then timed steps to the end; no counted steps, whose sync counting is not a timed mode);
- detached: under the shim with a 1 + 2 step window, after which the hooks only check that they are
  done (the DataLoader iterator wrapper and the optimizer hook stay installed).

Rounds are interleaved (A, B, C | C, B, A | …); each run's figure is its median step time over the
steps after `--skip` (past start-up, and past the detached run's window); the cost is the per-round
ratio to the same round's as-written run, median and range printed.

    PYTHONPATH=src python3 bench/script_overhead.py --config small --rounds 6
    PYTHONPATH=src python3 bench/script_overhead.py --config tiny --rounds 1 --skip 5   # a smoke run
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

import _harness as bench
from saturate.hardware import probe
from saturate.integrations.command import run_instrumented

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "examples" / "scripts" / "gpt_pretrain" / "train.py"
CLOCK = HERE / "_step_clock.py"
SETTINGS = {
    "measuring": {"mode": "doctor", "warmup": 1, "count_steps": 0, "steps": 10**6, "stop": False},
    "detached": {"mode": "doctor", "warmup": 1, "count_steps": 0, "steps": 2, "stop": False},
}


def median_step(times: list[float], skip: int) -> float:
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1:], strict=False)]
    if len(gaps) < 3:
        raise SystemExit(f"only {len(times)} steps recorded; lower --skip or use a longer config")
    return statistics.median(gaps)


def run_once(name: str, config: str, skip: int, folder: Path) -> float:
    folder.mkdir(parents=True)
    clock = folder / "times.json"
    os.environ["STEP_CLOCK"] = str(clock)  # inherited by the command (run_instrumented copies the environment)
    cmd = [sys.executable, str(CLOCK), str(SCRIPT), "--config", config, "--out-dir", str(folder / "out")]
    if name == "as written":
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    else:
        run_instrumented(cmd, SETTINGS[name], quiet_stdout=True)
    return median_step(json.loads(clock.read_text()), skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", choices=["tiny", "small", "medium"], help="the script's config")
    ap.add_argument("--skip", type=int, default=10, help="steps left out at the start of each run (default 10)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    args = ap.parse_args()
    bench.require_positive(ap, rounds=args.rounds, skip=args.skip)
    names = ["as written", "measuring", "detached"]
    with tempfile.TemporaryDirectory(prefix="saturate-overhead-") as tmp:
        step = bench.run_rounds(names, args.rounds, lambda name, d: run_once(name, args.config, args.skip,
                                                                          Path(tmp) / d.name),
                                lambda r, name, s: f"round {r}: {name}: {1000 * s:.2f} ms/step (median)")
    cost = {name: bench.Spread.of([x - 1 for x in bench.ratios(step[name], step["as written"])]) for name in names}
    rows = [[name, bench.Spread.of(step[name]).fmt(".2f", 1000, " ms"),
             "-" if name == "as written" else cost[name].fmt("+.1f", 100, " %")] for name in names]
    hw = probe(measure_peaks=False, device="cpu")
    bench.print_table(f"saturate's hooks on guide 1's script ({args.config}), {args.rounds} interleaved rounds, "
                      f"{bench.device_label(hw)}", ["run", "step time: median (range) over rounds",
                                                    "cost vs as written: median (range)"], rows,
                      ["goal: under +2 % while measuring, about 0 once detached"])
    bench.write_json(args.json, {"config": args.config, "skip": args.skip, "rounds": args.rounds,
                                 "step_s": step, "cost": {k: v.to_dict() for k, v in cost.items()},
                                 "environment": bench.environment(hw)})


if __name__ == "__main__":
    main()
