"""`saturate tune -- CMD`: the settings a user's own script can take from outside, found by measurement.

Each trial is the script's first optimizer steps run with saturate's hooks, some settings applied
from outside (`hooks`: DataLoader arguments at construction, TF32 at start-up), timed, then
stopped. What is tried, in order, each kept only when measured faster than the best so far by more
than `GAIN_MIN` (so a change within the machine's noise is not taken):

1. loader workers (only when the as-written run waits for data): 1, 2, 4, … up to the usable cores,
   with persistent workers; growth stops at the first count from 2 on that does not gain (one worker
   only overlaps loading with the step, so it may not gain where two do);
2. a deeper prefetch (4) where workers are kept;
3. pinned memory, on a GPU;
4. TF32 matmuls, on a GPU that has them.

Micro-batch, precision, compile and the rest need the script's own training code (a Transformers or
Lightning `Trainer`'s arguments); they are not tried from outside yet.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.atomic import atomic_write_bytes
from saturate.integrations.command import ScriptRun, run_instrumented

GAIN_MIN = 1.05  # a setting is kept only when measured at least this much faster than the best so far
INPUT_SHARE_MIN = 0.05  # below this share of the step waiting for data, loader settings cannot gain much


@dataclass
class ScriptTrial:
    """One short instrumented run of the script with `overrides` applied."""

    name: str
    overrides: dict[str, Any]
    step_s: float
    samples_per_s: float | None
    data_share: float
    steps: int
    outcome: str = ""  # why it was kept or not

    @classmethod
    def of(cls, name: str, overrides: dict[str, Any], run: ScriptRun) -> ScriptTrial:
        m = (run.report or {})["measurements"]
        step_s = m["step_s"]
        sps = m["samples_per_step"] / step_s if m.get("samples_per_step") and step_s > 0 else None
        data = m["phases"].get("data", 0.0) / step_s if step_s > 0 else 0.0
        return cls(name, overrides, step_s, sps, data, m["steps"])


@dataclass
class ScriptTuning:
    command: list[str]
    baseline: ScriptTrial
    best: ScriptTrial
    trials: list[ScriptTrial] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    loaders: list[dict[str, Any]] = field(default_factory=list)  # as the as-written run saw them
    device_type: str = "cpu"

    @property
    def speedup(self) -> float:
        return self.baseline.step_s / self.best.step_s if self.best.step_s > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "overrides": self.best.overrides, "speedup": self.speedup,
                "baseline": vars(self.baseline), "best": vars(self.best), "trials": [vars(t) for t in self.trials],
                "decisions": self.decisions, "loaders": self.loaders, "device_type": self.device_type}


def tune_command(command: Sequence[str], *, warmup: int = 2, steps: int = 10, cores: int = 1,
                 first_step_timeout: float = 300.0, quiet_stdout: bool = False,
                 on_trial: Callable[[ScriptTrial], None] | None = None) -> ScriptTuning:
    """Measure the script as written, then the settings above one family at a time; the fastest wins."""
    def trial(name: str, overrides: dict[str, Any]) -> tuple[ScriptTrial, ScriptRun]:
        settings = {"mode": "trial", "warmup": drained(warmup, overrides), "count_steps": 0, "steps": steps,
                    "stop": True, "overrides": overrides}
        run = run_instrumented(command, settings, first_step_timeout=first_step_timeout, quiet_stdout=quiet_stdout)
        t = ScriptTrial.of(name, overrides, run)
        if on_trial is not None:
            on_trial(t)
        return t, run

    base, run = trial("as written", {})
    base.outcome = "the script's own settings"
    report = run.report or {}
    device = report["measurements"]["device_type"]
    result = ScriptTuning(list(run.command), base, base, [base], loaders=report.get("loaders", []),
                          device_type=device)

    def consider(name: str, overrides: dict[str, Any]) -> bool:
        t, _ = trial(name, overrides)
        result.trials.append(t)
        gain = result.best.step_s / t.step_s if t.step_s > 0 else 0.0
        if gain >= GAIN_MIN:
            t.outcome = f"kept: {gain:.2f}× the best so far"
            result.best = t
            return True
        t.outcome = f"not kept: {gain:.2f}× the best so far (needs {GAIN_MIN:.2f}×)"
        return False

    loader = result.loaders[0] if result.loaders else None
    if loader is None:
        result.decisions.append("loader settings: no DataLoader in the timed steps; not tried")
    elif base.data_share < INPUT_SHARE_MIN:
        result.decisions.append(f"loader settings: waiting for data is {100 * base.data_share:.0f} % of the step "
                                f"as written; more workers cannot gain more than that; not tried")
    else:
        written = loader.get("num_workers") or 0
        counts = [w for w in _powers_of_two(max(1, cores)) if w != written]
        for w in counts:
            gained = consider(f"{w} workers", _merge(result.best.overrides, {"loader": {
                "num_workers": w, "persistent_workers": True}}))
            if not gained and w >= 2:  # one worker only overlaps loading with the step: 2 is the first real test
                break
        workers = result.best.overrides.get("loader", {}).get("num_workers", written)
        result.decisions.append(f"loader workers: {workers} (as written {written}; tried "
                                f"{', '.join(map(str, counts))})")
        if workers:
            consider("prefetch 4", _merge(result.best.overrides, {"loader": {"prefetch_factor": 4}}))
        if device == "cuda" and not loader.get("pin_memory"):
            consider("pinned memory", _merge(result.best.overrides, {"loader": {"pin_memory": True}}))
    if device == "cuda":
        consider("TF32", _merge(result.best.overrides, {"tf32": True}))
    else:
        result.decisions.append(f"TF32: not on {device}")
    result.decisions.append("micro-batch, precision, compile and fused optimizer: need the script's training code "
                            "(a Trainer's arguments); not tried from outside")
    return result


def drained(warmup: int, overrides: dict[str, Any]) -> int:
    """Warm-up steps that also drain what loader workers prepared while the script started (workers ×
    prefetch batches, at least one batch a step), so a trial times the loader's steady rate, not its buffer."""
    loader = overrides.get("loader") or {}
    workers = loader.get("num_workers") or 0
    return warmup + workers * (loader.get("prefetch_factor") or 2)


def _powers_of_two(limit: int) -> list[int]:
    out, w = [], 1
    while w <= limit:
        out.append(w)
        w *= 2
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def edits(tuning: ScriptTuning) -> list[str]:
    """The tuned overrides as the edits a user would make in the script."""
    over = tuning.best.overrides
    lines = []
    loader = tuning.loaders[0] if tuning.loaders else {}
    if over.get("loader"):
        args = ", ".join(f"{k}={v!r}" for k, v in over["loader"].items())
        lines.append(f"{loader.get('site') or 'your DataLoader'}: DataLoader(..., {args})")
    if over.get("tf32"):
        lines.append("at start-up: torch.backends.cuda.matmul.allow_tf32 = True; "
                     "torch.backends.cudnn.allow_tf32 = True")
    return lines


def write(tuning: ScriptTuning, folder: Path) -> Path:
    """overrides.json (what `saturate run --overrides` applies) and tune.json (every trial) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "overrides.json", (json.dumps(tuning.best.overrides, indent=2) + "\n").encode())
    atomic_write_bytes(folder / "tune.json", (json.dumps(tuning.to_dict(), indent=2, default=str) + "\n").encode())
    return folder / "overrides.json"


def render(tuning: ScriptTuning, console: Console, written: Path | None = None) -> None:
    console.print(Text(f"saturate tune -- {shlex.join(tuning.command)}", style="bold"))
    t = Table(box=None, padding=(0, 1))
    for col, justify in (("trial", "left"), ("s/step", "right"), ("samples/s", "right"), ("data", "right")):
        t.add_column(col, justify=justify)
    for trial in tuning.trials:
        t.add_row(trial.name, f"{trial.step_s:.4g}", f"{trial.samples_per_s:.1f}" if trial.samples_per_s else "-",
                  f"{100 * trial.data_share:.0f} %")
    console.print(t)
    for trial in tuning.trials[1:]:
        console.print(f"  {trial.name}: {trial.outcome}")
    for d in tuning.decisions:
        console.print(f"  {d}")
    console.print(Text(f"best: {tuning.best.name}, {tuning.speedup:.2f}× the script as written (measured, "
                       f"{tuning.best.steps} timed steps each)", style="bold"))
    lines = edits(tuning)
    if lines:
        console.print("the edit to make in your script:")
        for line in lines:
            console.print(f"  {line}")
    else:
        console.print("no setting measured faster than the script as written; nothing to change")
    if written is not None:
        console.print(f"overrides written to {written} (`saturate run --overrides {written} -- CMD` applies them "
                      "without an edit)")
