"""Issue 28's table: condition × case × repetition → decision, printed ratio, reference ratio.

Reads the folders `bench/real_scripts.py run` wrote (each a results.json with its condition and seed) and a
references file of quiet bare measurements (no saturate in the process), and says of every decision:

* `tune -- CMD`: what it kept and its confirmation's median ratio; `run -- CMD`: what it applied and its side by
  side's median (a short job's prior is "chosen, not measured": no ratio);
* against the reference for exactly that setting: WRONG when the reference measures it ≥ 5 % slower than what it
  replaced, "off" when the printed ratio is outside ±15 % of the reference, "missed" when nothing was kept where
  the reference holds a gain ≥ 20 %, "no reference" when that setting was never measured bare;
* the doctor: its verdict and first fix against the quiet ones in the references.

The references file (JSON), written by hand from the reference logs it names:

    {"tune": {"run_clm": {"trainer 8x1": [1.99, 1.87, 2.13, "cpu-2026-11-28f/reference.log"], ...}, ...},
     "doctor": {"run_clm": ["overhead-bound", "per_device_train_batch_size 1 → 8"], ...}}

A setting is named by its overrides, sorted: `trainer 8x1`, `host_alloc`, `fused`, `bf16_autocast`,
`lightning precision bf16-mixed`, `threads 1`, joined by " + ".

    python3 bench/decisions.py --refs bench/results/cpu-2026-11-29b/references.json \
        bench/results/cpu-2026-11-29b/bursty-s* [--out table.md]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

WRONG_BELOW = 0.95  # the reference measures what was kept this much slower than what it replaced, or more
RATIO_BAND = 0.15  # a printed ratio within ±15 % of the reference
REAL_GAIN = 1.20  # a gain the issue asks to be found


def setting(overrides: dict[str, Any] | None) -> str:
    """The name of a setting from its overrides (see the module's docstring)."""
    parts: list[str] = []
    for k, v in sorted((overrides or {}).items()):
        if k == "trainer":
            parts.append(f"trainer {v.get('per_device_train_batch_size')}x{v.get('gradient_accumulation_steps')}")
        elif k == "optimizer" and v.get("fused"):
            parts.append("fused")
        elif k == "lightning":
            parts += [f"lightning {a} {b}" for a, b in sorted(v.items())]
        elif k in ("host_alloc", "bf16_autocast") and v:
            parts.append(k)
        else:
            parts.append(f"{k} {v}")
    return " + ".join(sorted(parts)) or "as written"


def as_json(rec: dict[str, Any]) -> dict[str, Any]:
    j = rec.get("json") or {}
    if isinstance(j, str):
        try:
            j = ast.literal_eval(j)
        except (ValueError, SyntaxError):
            j = {}
    return j


def judge(case: str, name: str, printed: float | None, refs: dict[str, Any]) -> tuple[str, str]:
    """(reference text, judgement) for `name` kept or applied with `printed` as its ratio."""
    table = refs.get("tune", {}).get(case, {})
    best = max((r[0] for r in table.values()), default=1.0)
    if name == "as written":
        return ((f"best {best:.2f}×", "missed") if best >= REAL_GAIN else ("—", "right"))
    ref = table.get(name)
    if ref is None:
        return "no reference", "no reference"
    text = f"{ref[0]:.2f}× ({ref[1]:.2f}–{ref[2]:.2f})"
    if ref[0] < WRONG_BELOW:
        return text, "WRONG: slower"
    if printed is not None and abs(printed / ref[0] - 1) > RATIO_BAND:
        return text, f"off {100 * (printed / ref[0] - 1):+.0f} %"
    return text, "right"


def rows(folder: Path, refs: dict[str, Any]) -> list[dict[str, str]]:
    data = json.loads((folder / "results.json").read_text())
    cond, seed = data.get("condition", "?"), data.get("seed", "?")
    out = []
    for key, rec in sorted(data.get("runs", {}).items()):
        case, verb = key.split("/")
        j = as_json(rec)
        row = {"condition": cond, "seed": str(seed), "case": case, "verb": verb, "decision": "", "printed": "",
               "reference": "", "judgement": ""}
        if verb == "doctor":
            fixes = [f.get("title", "") for f in j.get("fixes") or []]
            row["decision"] = f"{j.get('verdict')}: " + ("; ".join(fixes) or "(no fix)")
            want = refs.get("doctor", {}).get(case)
            if want:
                row["reference"] = f"{want[0]}: {want[1]}"
                same = j.get("verdict") == want[0] or (j.get("verdict") == "contended" and any(
                    f.get("verdict") == want[0] for f in j.get("findings") or []))
                row["judgement"] = ("same" + (" (and the load's own fix)" if j.get("verdict") == "contended" else "")
                                    if same and any(want[1] in f for f in fixes) else
                                    "contended, no fix" if j.get("verdict") == "contended" and not fixes else
                                    "contended, only the load's fix" if j.get("verdict") == "contended" else
                                    "DIFFERENT")
        elif verb in ("tune", "run"):
            if rec.get("returncode") != 0 or not j:
                row["decision"], row["judgement"] = f"rc {rec.get('returncode')}", "failed"
                out.append(row)
                continue
            name = setting(j.get("overrides"))
            if verb == "tune":
                conf = j.get("confirmation") or {}
                printed = 1 + conf["gain"] if name != "as written" and conf.get("gain") is not None else None
                row["decision"] = f"kept {name}" if name != "as written" else "nothing kept"
            else:
                sbs = j.get("side_by_side") or {}
                applied = bool(j.get("applied"))
                printed = 1 + sbs["gain"] if applied and sbs.get("gain") is not None else None
                if applied and not sbs:
                    row["decision"] = f"applied {name} (short job: chosen, not measured)"
                else:
                    row["decision"] = f"applied {name}" if applied else (
                        "as written" + (f" (tuned {name} not applied)" if name != "as written" else ""))
                name = name if applied else "as written"
            row["printed"] = f"{printed:.3f}×" if printed else ""
            row["reference"], row["judgement"] = judge(case, name, printed, refs)
            if verb == "run" and not (j.get("side_by_side") or {}) and (j.get("short_job") or {}):
                row["judgement"] += " (short job)"
        else:
            continue
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--refs", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    refs = json.loads(a.refs.read_text())
    all_rows = [r for f in a.folders for r in rows(f, refs)]
    cols = ["condition", "seed", "case", "verb", "decision", "printed", "reference", "judgement"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in all_rows]
    wrong = [r for r in all_rows if r["judgement"].startswith(("WRONG", "off", "DIFFERENT"))]
    lines += ["", f"{len(all_rows)} decisions; wrong, off or different: {len(wrong)}"]
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
