"""`saturate doctor -- CMD --apply`: the doctor's top fix that saturate can set from outside, measured (issue 62).

The fixes are taken in the doctor's order; the first whose change is a setting the script tuner applies from outside
(`overrides.from_changes`: loader workers, prefetch, persistent workers, pinned memory; torch threads; a plain
loop's compile or bf16 autocast) is run against the script as written as the tuner compares any candidate — both
runs alive and timed in alternating windows where the command allows (`gated.py`), the same-training checks applied
— and its measured ratio, with its interval, is said beside the doctor's prediction. A fix that needs an edit (a
micro-batch split, the script's own code), or none that saturate can set, is said, not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from saturate.doctor.findings import Diagnosis, Fix
from saturate.policy import POLICY
from saturate.script.overrides import Overrides, from_changes
from saturate.script.script_trial import ScriptTrial
from saturate.script.tune_script import tune_command


@dataclass
class CommandApplied:
    """The fix measured on the command (None: none could be set from outside, `why`) and its trial."""

    fix: Fix | None
    overrides: Overrides | None
    trial: ScriptTrial | None
    why: str = ""  # nothing measured: why; else the trial's outcome
    kept: bool = False  # the tuner kept it: faster and the same training (same_training.py) — else `why` says why

    @property
    def predicted(self) -> float | None:
        p = self.fix.prediction if self.fix is not None else None
        return p.before / p.after if p is not None and p.after else None

    @property
    def measured(self) -> float | None:
        """Samples/s with the fix over as written (a ratio), from the comparison the decision rests on."""
        t = self.trial
        return 1 + t.gain if t is not None and t.gain is not None else None

    def to_dict(self) -> dict[str, Any]:
        t = self.trial
        return {"fix": self.fix.title if self.fix else None,
                "overrides": self.overrides.to_dict() if self.overrides is not None else None,
                "predicted_gain": self.predicted, "measured_gain": self.measured,
                "comparison": (t.pair or {}).get("text") if t is not None else None,
                "paired": bool(t is not None and t.pair), "verdict": t.verdict if t is not None else None,
                "kept": self.kept,
                "outcome": t.outcome if t is not None else None, "why": self.why,
                "trial": t.to_dict() if t is not None else None}


def apply_command(command: Sequence[str], d: Diagnosis, report: dict[str, Any], *, warmup: int, steps: int,
                  first_step_timeout: float = POLICY.windows.first_step_timeout_s,
                  quiet_stdout: bool = False) -> CommandApplied:
    """Measure the first of `d.fixes` saturate can set from outside against the command as written."""
    framework = bool(report.get("trainer") or report.get("lightning"))
    if not d.fixes:
        return CommandApplied(None, None, None, "the doctor found no fix to measure")
    for fix in d.fixes:
        if (over := from_changes(fix.changes, framework, d.measurements.device_type)) is not None:
            break
    else:
        return CommandApplied(None, None, None, "no fix the doctor found is a setting saturate can make from outside "
                                                "the script (each needs an edit of it): nothing was measured")

    def measure(search: Any) -> None:
        if over.compile:  # a compilation is stopped, not waited for, past the first step's limit (no length known)
            search.limit = (over, first_step_timeout)
        search.consider(fix.title, over)

    tuning = tune_command(command, warmup=warmup, steps=steps, first_step_timeout=first_step_timeout,
                         quiet_stdout=quiet_stdout, confirm=False, stages=measure)
    trial = next((t for t in tuning.trials if t.overrides == over), None)
    return CommandApplied(fix, over, trial, trial.outcome if trial is not None else "its trial did not run",
                          kept=trial is not None and tuning.best is trial)


def render_command_applied(a: CommandApplied, console: Console) -> None:
    """Predicted against measured, after the doctor's report."""
    console.print()
    if a.fix is None or a.trial is None:
        console.print(Text(f"--apply: {a.why}", style="yellow"))
        return
    console.print(Text(f"applied from outside: {a.fix.title} ({_said(a.overrides)})", style="bold"))
    t = a.trial
    if not t.ok:
        console.print(Text(f"  the script failed with it: {t.outcome}", style="red"))
        return
    predicted = f"{a.predicted:.2f}×" if a.predicted else "not predicted"
    pair = t.pair or {}
    if pair.get("gain") is not None:
        gain, noise = pair["gain"], pair["noise"]
        measured = (f"{1 + gain:.2f}× ({max(0.0, 1 + gain - noise):.2f}–{1 + gain + noise:.2f}×) over "
                    f"{len(pair.get('ratios') or [])} alternating pairs with the script as written, {pair['verdict']}")
    else:
        measured = (f"{a.measured:.2f}× (timed after the script as written, not paired)" if a.measured
                    else "not measured")
    console.print(f"  predicted {predicted}, measured {measured}", highlight=False)
    if not a.kept:  # slower, within noise, or it changes the training (a stream each worker replays): why
        console.print(Text(f"  {t.outcome}", style="yellow"))


def _said(over: Overrides | None) -> str:
    """`num_workers=2, prefetch_factor=2; threads=1`: the settings, as the tuner's JSON names them."""
    parts = []
    for name, value in (over.to_dict() if over is not None else {}).items():
        parts.append(", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else f"{name}={value}")
    return "; ".join(parts)
