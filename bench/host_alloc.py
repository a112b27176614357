"""The host allocator's thresholds on a CPU (engine/host_alloc.py), each setting in its own fresh process.

The peers' job (bench/peers.py: GPT-2-shaped, 8 × 4 bf16, 0 workers) run by
  saturate         `saturate run --hf …` as shipped (glibc thresholds raised in the training process)
  saturate-system  the same with SATURATE_HOST_ALLOC=system (glibc's defaults)
  hf-bf16          the Transformers Trainer script of bench/peers.py, as written
  hf-bf16-alloc    the same with the variables `run -- CMD` gives a script (host_alloc.child_env)
in interleaved rounds (the order reversed every other round). Each row: the steps' seconds (saturate's
`training_steps_s`, the Trainer's `train_runtime`), the process's minor page faults and system CPU seconds
(getrusage of the child). The allocator's effect is a property of one process's history, so it can only be
compared across processes: hence rounds, and ratios per round.

    python3 bench/peers.py prepare --dir /tmp/peers
    PYTHONPATH=src python3 bench/host_alloc.py --dir /tmp/peers --steps 40 --rounds 3 --out bench/results/…
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ROOT, command  # noqa: E402
from saturate.engine.host_alloc import child_env  # noqa: E402

NAMES = ("saturate", "saturate-system", "hf-bf16", "hf-bf16-alloc")


def one(name: str, steps: int, folder: Path) -> dict:
    cache = folder / f"cache-alloc-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "SATURATE_CACHE": str(cache),
           "PYTHONPATH": str(ROOT / "src")}
    for k in [k for k in env if k.startswith("MALLOC_")] + ["SATURATE_HOST_ALLOC"]:
        env.pop(k, None)
    if name == "saturate-system":
        env["SATURATE_HOST_ALLOC"] = "system"
    if name == "hf-bf16-alloc":
        env.update(child_env({}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command(name.removesuffix("-system").removesuffix("-alloc"), steps, folder), cwd=folder,
                         env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"name": name, "rc": out.returncode, "minor_faults": after.ru_minflt - before.ru_minflt,
           "sys_s": after.ru_stime - before.ru_stime}
    if out.returncode != 0:
        row["error"] = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
    elif name.startswith("saturate"):
        doc = json.loads(out.stdout)
        row["steps_s"] = doc["timing"]["training_steps_s"]
        row["note"] = next((n for n in doc["training"].get("notes", []) if n.startswith("host allocator")), None)
    else:
        m = re.search(r"'train_s': ([0-9.]+)", out.stdout)
        row["steps_s"] = float(m.group(1)) if m else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--names", default=",".join(NAMES))
    ap.add_argument("--out")
    a = ap.parse_args()
    folder = Path(a.dir).resolve()
    names = a.names.split(",")
    rows = []
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            row = {"round": r, **one(name, a.steps, folder)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| process | steps s (median, range) | minor faults (median) | sys s (median) | ÷ its pair's steps s, "
             "per round |", "|---|---|---|---|---|"]
    pairs = {"saturate": "saturate-system", "hf-bf16-alloc": "hf-bf16"}
    for name in names:
        mine = [x for x in rows if x["name"] == name and x.get("steps_s")]
        if not mine:
            continue
        s = [x["steps_s"] for x in mine]
        ratio = ""
        if (other := pairs.get(name)) in names:
            by_round = {x["round"]: x["steps_s"] for x in rows if x["name"] == other and x.get("steps_s")}
            rs = [by_round[x["round"]] / x["steps_s"] for x in mine if x["round"] in by_round]
            if rs:
                ratio = f"{statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f}) faster"
        lines.append(f"| {name} | {statistics.median(s):.1f} ({min(s):.1f}–{max(s):.1f}) | "
                     f"{statistics.median(x['minor_faults'] for x in mine) / 1e3:.0f}k | "
                     f"{statistics.median(x['sys_s'] for x in mine):.2f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host-alloc-{a.steps}.json").write_text(json.dumps(rows, indent=1))
        (out / f"host-alloc-{a.steps}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
