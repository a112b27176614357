"""`saturate tune -- CMD`: the settings a user's own script can take from outside, found by measurement.

Each trial is the script's first optimizer steps run with saturate's hooks, some settings applied
from outside (`hooks`: DataLoader arguments at construction, TF32 at start-up, a Transformers
`Trainer`'s `TrainingArguments` before the Trainer reads them), then stopped. The doctor's Profiler
splits its first timed steps into phases (the share spent waiting for data); then, detached, the
script's own steps are timed in windows until they agree or a cap (`child/trial_windows.py`, with the preset
tuner's `stats.noise.WindowRule`), so a trial's step time is a median with a spread. What is tried, in
order, each kept only when faster than the best so far beyond both trials' spreads added and by at
least `MIN_GAIN` (`stats.comparison.compare`; otherwise "within noise (±x %)"):

For a Transformers `Trainer` or a Lightning `Trainer` (`trainer_stages`' stages, the knobs in each
framework's terms from `frameworks.py`): precision, checked against the script's own first losses;
micro-batch × accumulation at the same effective batch; activation checkpointing where memory stopped a
larger micro-batch; the fused optimizer; compile, where the planned steps pay back its compile time.
For a plain script (no Trainer): the fused optimizer, when the optimizer the script steps is torch's
`Adam`/`AdamW`, not fused, and torch has the fused kernel on the script's device (`fused=True` given at
its constructor from outside; the edit said at that line).
For every script:
6. loader workers (only when the as-written run waits for data): 1, 2, 4, … up to the usable cores,
   with persistent workers; growth stops at the first count from 2 on that does not gain (one worker
   only overlaps loading with the step, so it may not gain where two do);
7. a deeper prefetch (4) where workers are kept;
8. pinned memory, on a GPU;
9. TF32 matmuls, on a GPU that has them.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.atomic import atomic_write_bytes
from saturate.errors import SaturateError
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun, run_instrumented
from saturate.script.doctor_script import TRAINER_TERMS, trainer_edit
from saturate.script.frameworks import framework_of, fused_option
from saturate.script.overrides import NONE, Overrides
from saturate.script.script_trial import MIN_GAIN, WINDOW_S, ScriptTrial, TrialOptions, window_rule
from saturate.script.trainer_stages import Option, stage, trainer_stages
from saturate.stats.comparison import Comparison
from saturate.stats.noise import WindowRule, rate_text

INPUT_SHARE_MIN = 0.05  # below this share of the step waiting for data, loader settings cannot gain much

Runner = Callable[..., ScriptRun]  # run_instrumented's signature; tests pass a fake machine


@dataclass
class ScriptTuning:
    command: list[str]
    baseline: ScriptTrial
    best: ScriptTrial
    trials: list[ScriptTrial] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    loaders: list[dict[str, Any]] = field(default_factory=list)  # as the as-written run saw them
    device_type: str = "cpu"
    trainer: dict[str, Any] | None = None  # a Transformers Trainer as the as-written run saw it
    lightning: dict[str, Any] | None = None  # a Lightning Trainer as the as-written run saw it
    optimizer: dict[str, Any] | None = None  # the followed optimizer: class, where it was made, fused

    rule: WindowRule = field(default_factory=window_rule)  # how each trial's windows were judged

    @property
    def speedup(self) -> float:
        return self.baseline.step_s / self.best.step_s if self.best.step_s > 0 else 1.0

    def gain(self) -> Comparison | None:
        """The best trial against the script as written, with both spreads (None when nothing was kept)."""
        return None if self.best is self.baseline else self.best.against(self.baseline)

    def to_dict(self) -> dict[str, Any]:
        gain = self.gain()
        return {"command": self.command, "overrides": self.best.overrides.to_dict(), "speedup": self.speedup,
                "gain": None if gain is None else {"gain": gain.gain, "noise": gain.noise, "text": gain.text()},
                "min_gain": MIN_GAIN, "window_rule": asdict(self.rule),
                "baseline": self.baseline.to_dict(), "best": self.best.to_dict(),
                "trials": [t.to_dict() for t in self.trials],
                "decisions": self.decisions, "loaders": self.loaders, "device_type": self.device_type,
                "trainer": self.trainer, "lightning": self.lightning, "optimizer": self.optimizer,
                "edits": edits(self)}


def tune_command(command: Sequence[str], *, warmup: int = 2, steps: int = 10, cores: int = 1,
                 first_step_timeout: float = 300.0, quiet_stdout: bool = False,
                 on_trial: Callable[[ScriptTrial], None] | None = None, runner: Runner = run_instrumented,
                 supports: dict[str, bool] | None = None, rule: WindowRule | None = None,
                 window_s: float = WINDOW_S, allow_micro_batch_change: bool = False) -> ScriptTuning:
    """Measure the script as written, then the settings above one family at a time; the fastest wins.

    `steps`: the Profiler's timed steps per trial (and with several processes, each window's steps); then
    windows of at least `window_s` until `rule` says they are enough (default `window_rule()`).
    `supports`: native bf16/fp16/tf32 on the script's device (default: `saturate.hardware.probe`'s).
    `allow_micro_batch_change`: search a trainer's micro-batch even when the model has batch-coupled layers."""
    rule = rule or window_rule()
    search = _Search(list(command), warmup, steps, first_step_timeout, quiet_stdout, on_trial, runner, rule, window_s)
    base, run = search.trial("as written", NONE)
    base.outcome = "the script's own settings"
    report = run.report or {}
    device = report["measurements"]["device_type"]
    result = ScriptTuning(list(run.command), base, base, [base], loaders=report.get("loaders", []),
                          device_type=device, trainer=report.get("trainer"), lightning=report.get("lightning"),
                          optimizer=report.get("optimizer"), rule=rule)
    search.result = result
    framework = framework_of(report)
    if framework is not None:
        if supports is None:
            from saturate.hardware import probe

            supports = probe(measure_peaks=False, device=device).supports
        trainer_stages(search, framework, supports, report.get("model"), allow_micro_batch_change)
    else:
        stage(search, "fused optimizer", _plain_fused(result.optimizer or {}, device))
    search.loader_stages(cores)
    if device == "cuda":
        search.consider("TF32", search.with_overrides(Overrides(tf32=True)))
    else:
        result.decisions.append(f"TF32: not on {device}")
    if framework is None:
        result.decisions.append("micro-batch, precision and compile: need the script's training code (a "
                                "Transformers or a Lightning Trainer's arguments); not tried from outside")
    if ended := [t.name for t in result.trials if t.ran_to_end]:
        result.decisions.append(f"warning: the script ran to its end during {len(ended)} trial(s) ({ended[0]}, …): "
                                "what it writes at its end was written, and the trials timed all of its steps; a "
                                "trial needs a run longer than its windows (--trial-seconds shortens them)")
    return result


def tune_with_progress(command: Sequence[str], options: TrialOptions, console: Console, *,
                       allow_micro_batch_change: bool = False) -> ScriptTuning:
    """`saturate tune -- CMD` (and `run -- CMD`'s tuning): `tune_command` on this machine's usable cores, each
    trial's step time printed as it ends."""
    from saturate.hardware import usable_cores

    console.print(f"[dim]tune: each trial runs your command's first {options.warmup + options.steps} optimizer "
                  "steps with saturate's hooks, then times its steps in windows until they agree (at most "
                  f"{options.seconds:g} s), then stops it …[/]")

    def show(t: ScriptTrial) -> None:
        spread = f" ±{100 * t.spread:.1f} %" if t.spread is not None else ""
        console.print(f"[dim]  {t.name}: {t.step_s:.4g} s/step{spread}[/]")

    return tune_command(command, warmup=options.warmup, steps=options.steps, cores=usable_cores()[0],
                        first_step_timeout=options.first_step_timeout, quiet_stdout=options.quiet_stdout,
                        on_trial=show, allow_micro_batch_change=allow_micro_batch_change, rule=options.rule)


def _plain_fused(optimizer: dict[str, Any], device: str) -> Option:
    """A plain script's fused-optimizer trial (`frameworks.fused_option`), where torch has the kernel on `device`."""
    option = fused_option(optimizer)
    if isinstance(option, str):
        return option
    import torch

    from saturate.tune.api import fused_adamw_available

    if not fused_adamw_available(torch.device(device)):
        return f"not tried (this torch has no fused {optimizer.get('class')} on {device})"
    return option


class _Search:
    """The trials of one tuning: each a run of the script, kept only when measured faster."""

    def __init__(self, command: list[str], warmup: int, steps: int, first_step_timeout: float, quiet_stdout: bool,
                 on_trial: Callable[[ScriptTrial], None] | None, runner: Runner, rule: WindowRule,
                 window_s: float) -> None:
        self.command, self.warmup, self.steps = command, warmup, steps
        self.first_step_timeout, self.quiet_stdout = first_step_timeout, quiet_stdout
        self.on_trial, self.runner = on_trial, runner
        self.result: ScriptTuning = None  # type: ignore[assignment]  # set once the baseline is measured
        self.rule = rule  # when a trial's windows are enough, in the child (`windows.StepWindows`) and here
        self.window_s = window_s

    def trial(self, name: str, overrides: Overrides) -> tuple[ScriptTrial, ScriptRun]:
        settings = trial_settings(overrides, self.warmup, self.steps, self.rule, self.window_s)
        run = self.runner(self.command, settings, first_step_timeout=self.first_step_timeout,
                          quiet_stdout=self.quiet_stdout)
        t = ScriptTrial.of(name, overrides, run, self.rule)
        error = ((run.report or {}).get("trainer") or {}).get("error")
        if error and overrides.trainer:
            t = ScriptTrial.failed(name, overrides, f"the Trainer refused the arguments ({error})")
        if self.on_trial is not None:
            self.on_trial(t)
        return t, run

    def consider(self, name: str, overrides: Overrides,
                 check: Callable[[ScriptTrial], str | None] | None = None) -> ScriptTrial:
        """Run a trial; keep it when `check` finds nothing wrong and it is faster than the best so far beyond
        both trials' noise and by `MIN_GAIN` at least (`ScriptTrial.against`)."""
        try:
            t, _ = self.trial(name, overrides)
        except SaturateError as e:  # the script failed with this setting (out of memory, refused)
            t = ScriptTrial.failed(name, overrides, str(e), out_of_memory=getattr(e, "out_of_memory", False))
            if self.on_trial is not None:
                self.on_trial(t)
        result = self.result
        result.trials.append(t)
        if not t.ok:
            return t
        problem = check(t) if check is not None else None
        c = t.against(result.best)
        if problem:
            t.outcome = f"not kept: {problem}"
        elif c.faster:
            t.outcome = f"kept: {c.text()} over the best so far"
            result.best = t
        else:
            t.outcome = f"not kept: {c.text()} against the best so far"
        if t.note and not problem:
            t.outcome += f"; {t.note}"
        return t

    def kept(self, t: ScriptTrial) -> bool:
        return self.result.best is t

    def with_overrides(self, overrides: Overrides) -> Overrides:
        """The best overrides so far with these added."""
        return self.result.best.overrides.merged(overrides)

    # --- every script's DataLoaders ----------------------------------------------------------

    def loader_stages(self, cores: int) -> None:
        result = self.result
        base = result.baseline
        loader = result.loaders[0] if result.loaders else None
        if loader is None:
            result.decisions.append("loader settings: no DataLoader in the timed steps; not tried")
            return
        if base.data_share < INPUT_SHARE_MIN:
            result.decisions.append(f"loader settings: waiting for data is {100 * base.data_share:.0f} % of the "
                                    f"step as written; more workers cannot gain more than that; not tried")
            return
        written = loader.get("num_workers") or 0
        counts = [w for w in _powers_of_two(max(1, cores)) if w != written]
        for w in counts:
            t = self.consider(f"{w} workers", self.with_overrides(Overrides(loader={
                "num_workers": w, "persistent_workers": True})))
            if not self.kept(t) and w >= 2:  # one worker only overlaps loading with the step: 2 is the first test
                break
        workers = result.best.overrides.loader.get("num_workers", written)
        result.decisions.append(f"loader workers: {workers} (as written {written}; tried "
                                f"{', '.join(map(str, counts))})")
        if workers:
            self.consider("prefetch 4", self.with_overrides(Overrides(loader={"prefetch_factor": 4})))
        if result.device_type == "cuda" and not loader.get("pin_memory"):
            self.consider("pinned memory", self.with_overrides(Overrides(loader={"pin_memory": True})))


def trial_settings(overrides: Overrides, warmup: int, steps: int, rule: WindowRule,
                   window_s: float = WINDOW_S) -> ChildSettings:
    """What the child is told for one trial: warm up (draining the loader's buffer), time `steps` steps with the
    Profiler, then windows of at least `window_s` until `rule` says they are enough, then stop."""
    return ChildSettings(mode="trial", warmup=drained(warmup, overrides), count_steps=0, steps=steps, stop=True,
                         overrides=overrides, windows={"window_s": window_s, "window_steps": steps, **asdict(rule)})


def drained(warmup: int, overrides: Overrides) -> int:
    """Warm-up steps that also drain what loader workers prepared while the script started (workers ×
    prefetch batches, at least one batch a step), so a trial times the loader's steady rate, not its buffer."""
    loader = overrides.loader
    workers = loader.get("num_workers") or 0
    return warmup + workers * (loader.get("prefetch_factor") or 2)


def _powers_of_two(limit: int) -> list[int]:
    out, w = [], 1
    while w <= limit:
        out.append(w)
        w *= 2
    return out


def edits(tuning: ScriptTuning) -> list[str]:
    """The tuned overrides as the edits a user would make in the script: a Transformers Trainer's
    TrainingArguments when the script has one; else a Lightning Trainer's arguments, its DataLoader calls
    (the training loader's batch_size with them), its optimizer's constructor and TF32 at start-up."""
    over = tuning.best.overrides
    if tuning.trainer:
        fields = dict(over.trainer)
        fields.update({TRAINER_TERMS[k]: v for k, v in over.loader.items() if k in TRAINER_TERMS})
        if over.tf32:
            fields["tf32"] = True
        return [trainer_edit(fields, tuning.trainer)] if fields else []
    lines = []
    if over.lightning:
        lightning = tuning.lightning or {}
        site = f"{lightning['site']}: " if lightning.get("site") else ""
        args = ", ".join(f"{k}={v!r}" for k, v in over.lightning.items())
        lines.append(f"{site}{lightning.get('class') or 'Trainer'}(..., {args})")
    site = (tuning.loaders[0] if tuning.loaders else {}).get("site") or "your DataLoader"
    calls: dict[str, dict[str, Any]] = {}  # DataLoader(...) call -> its arguments to change
    if "batch_size" in (train := over.train_loader):
        calls[train.get("site") or site] = {"batch_size": train["batch_size"]}
    if over.loader:
        calls[site] = {**calls.get(site, {}), **over.loader}
    for at, changes in calls.items():
        lines.append(f"{at}: DataLoader(..., {', '.join(f'{k}={v!r}' for k, v in changes.items())})")
    if over.optimizer:
        opt = tuning.optimizer or {}
        at = f"{opt['site']}: " if opt.get("site") else ""
        args = ", ".join(f"{k}={v!r}" for k, v in over.optimizer.items())
        lines.append(f"{at}{opt.get('class') or 'your optimizer'}(..., {args})")
    if over.tf32:
        lines.append("at start-up: torch.backends.cuda.matmul.allow_tf32 = True; "
                     "torch.backends.cudnn.allow_tf32 = True")
    return lines


def write(tuning: ScriptTuning, folder: Path) -> Path:
    """overrides.json (what `saturate run --overrides` applies) and tune.json (every trial) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    overrides = json.dumps(tuning.best.overrides.to_dict(), indent=2) + "\n"
    atomic_write_bytes(folder / "overrides.json", overrides.encode())
    atomic_write_bytes(folder / "tune.json", (json.dumps(tuning.to_dict(), indent=2, default=str) + "\n").encode())
    return folder / "overrides.json"


def render(tuning: ScriptTuning, console: Console, written: Path | None = None) -> None:
    console.print(Text(f"saturate tune -- {shlex.join(tuning.command)}", style="bold"))
    if tuning.trainer:
        tr = tuning.trainer
        console.print(Text(f"Transformers {tr['class']} at {tr.get('site') or '?'}; its "
                           f"{tr.get('args_class') or 'TrainingArguments'} at {tr.get('args_site') or '?'}"))
    elif tuning.lightning:
        console.print(Text(f"Lightning {tuning.lightning['class']} at {tuning.lightning.get('site') or '?'}"))
    t = Table(box=None, padding=(0, 1))
    for col, justify in (("trial", "left"), ("s/step", "right"), ("samples/s (median ±)", "right"),
                         ("data", "right"), ("windows", "right")):
        t.add_column(col, justify=justify)
    for trial in tuning.trials:
        if not trial.ok:
            t.add_row(trial.name, "failed", "-", "-", "-")
            continue
        spread = trial.spread if trial.windows > 1 else None
        rate = rate_text(trial.samples_per_s, spread, unit="") if trial.samples_per_s else (
            f"±{100 * spread:.1f} %" if spread is not None else "-")
        t.add_row(trial.name, f"{trial.step_s:.4g}", rate, f"{100 * trial.data_share:.0f} %",
                  str(trial.windows or "-") + (" busy" if trial.busy else ""))
    console.print(t)
    for trial in tuning.trials[1:]:
        console.print(Text(f"  {trial.name}: {trial.outcome}"))
    for d in tuning.decisions:
        console.print(Text(f"  {d}"))
    gain = tuning.gain()
    if gain is None:
        console.print(Text("best: the script as written (no setting was faster beyond the noise and by "
                           f"{100 * MIN_GAIN:.0f} %; medians of each trial's timed windows)", style="bold"))
    else:
        console.print(Text(f"best: {tuning.best.name}, {tuning.speedup:.2f}× the script as written ({gain.text()}; "
                           "medians of each trial's timed windows)", style="bold"))
    lines = edits(tuning)
    if lines:
        console.print("the edit to make in your script:")
        for line in lines:
            console.print(Text(f"  {line}"))
    else:
        console.print("no setting measured faster than the script as written beyond the noise; nothing to change")
    if written is not None:
        console.print(f"overrides written to {written} (`saturate run --overrides {written} -- CMD` applies them "
                      "without an edit)")
