"""What a tuning of a user's script found (`ScriptTuning`), and how it is told: the edits to make in the script
(`edits`), overrides.json and tune.json (`write`), the table and lines (`render`). The search is tune_script.py's."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.atomic import atomic_write_bytes
from saturate.policy import POLICY, policy_record
from saturate.script.doctor_script import TRAINER_TERMS, trainer_edit
from saturate.script.gated import PairedTrials
from saturate.script.overrides import Overrides
from saturate.script.patch_edit import Patch, tuned_patch
from saturate.script.script_trial import ScriptTrial, lean_loaders, window_rule
from saturate.stats.comparison import Comparison
from saturate.stats.noise import WindowRule, rate_text


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
    paired: str | None = None  # None: comparisons were paired (`gated.py`); else why they were not
    confirmation: PairedTrials | None = None  # the best against the script as written, paired, at the end
    short: str | None = None  # why the job was too short to tune past its first trial (`run -- CMD` only)
    prior: Overrides = field(default_factory=Overrides)  # then: the risk-free settings chosen, not measured
    prior_said: list[str] = field(default_factory=list)  # one line per such decision
    loss_noise: float | None = None  # two runs of the script as written, apart in their first losses (loss_drift)

    def patch(self) -> Patch:
        """The best overrides as a unified diff of the script's files, and what sits at a line of them but could not
        go in it (`patch_edit.tuned_patch`, its sites relative to the working folder)."""
        if self.best is self.baseline or self.trainer:  # a Trainer's arguments: the line edit says them
            return Patch("", Path.cwd(), [])
        return tuned_patch(self)

    @property
    def speedup(self) -> float:
        """The best against the script as written: the confirmation's median ratio when there was one, else the
        ratio of their trials' step times."""
        if self.confirmation is not None and self.confirmation.comparison is not None:
            return 1 + self.confirmation.comparison.gain
        return self.baseline.step_s / self.best.step_s if self.best.step_s > 0 else 1.0

    def gain(self) -> Comparison | None:
        """The best trial against the script as written (None when nothing was kept): paired when confirmed so,
        else with both trials' spreads."""
        if self.best is self.baseline:
            return None
        if self.confirmation is not None and self.confirmation.comparison is not None:
            return self.confirmation.comparison
        return self.best.against(self.baseline)

    def to_dict(self) -> dict[str, Any]:
        gain = self.gain()
        patch = self.patch()
        return {"command": self.command, "overrides": self.best.overrides.to_dict(), "speedup": self.speedup,
                "gain": None if gain is None else {"gain": gain.gain, "noise": gain.noise, "text": gain.text()},
                "min_gain": POLICY.gains.min_gain, "window_rule": asdict(self.rule), **policy_record(),
                "baseline": self.baseline.to_dict(), "best": self.best.to_dict(),
                "trials": [t.to_dict() for t in self.trials],
                "decisions": self.decisions, "loaders": lean_loaders(self.loaders), "device_type": self.device_type,
                "trainer": self.trainer, "lightning": self.lightning, "optimizer": self.optimizer,
                "paired": self.paired is None, "not_paired_because": self.paired, "loss_noise": self.loss_noise,
                "confirmation": None if self.confirmation is None else self.confirmation.to_dict(),
                "short_job": None if self.short is None else {"why": self.short, "applied": self.prior.to_dict(),
                                                              "chosen_not_measured": self.prior_said},
                "edits": edits(self), "patch": {"diff": patch.text, "apply_in": str(patch.folder)} if patch.text
                else None, "not_in_patch": patch.left}



PATCH = "edit.diff"  # the edit as a unified diff, beside overrides.json (patch_edit.py)


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
        threads = [f"at start-up: torch.set_num_threads({over.threads})"] if over.threads else []
        return ([trainer_edit(fields, tuning.trainer)] if fields else []) + threads + _alloc_edit(over)
    lines = []
    if over.lightning:
        lightning = tuning.lightning or {}
        site = f"{lightning['site']}: " if lightning.get("site") else ""
        args = ", ".join(f"{k}={v!r}" for k, v in over.lightning.items())
        lines.append(f"{site}{lightning.get('class') or 'Trainer'}(..., {args})")
    site = (tuning.loaders[0] if tuning.loaders else {}).get("site") or "your DataLoader"
    calls: dict[str, dict[str, Any]] = {}  # DataLoader(...) call -> its arguments to change
    if over.flags:
        lines.append(f"on its command line: {' '.join(over.argv())} (after its own flags: the last of each wins)")
    if names := (train := over.train_loader).get("set"):
        lines.append(split_edit(train, (tuning.loaders[0] if tuning.loaders else {}).get("split") or {}))
    if "batch_size" in train and not (names and (tuning.loaders[0].get("split") or {}).get("micro") in names):
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
    if over.threads:
        lines.append(f"at start-up: torch.set_num_threads({over.threads})")
    if over.bf16_autocast:
        lines.append(f"around each forward and its loss: with torch.autocast({over.bf16_autocast!r}, "
                     "dtype=torch.bfloat16):")
    if over.compile:
        mode = "" if over.compile == "default" else f"mode={over.compile!r}"
        lines.append(f"after building the model: model.compile({mode}) (in place: its state_dict keys stay as they "
                     "are)")
    return lines + _alloc_edit(over)


def split_edit(train: dict[str, Any], source: dict[str, Any]) -> str:
    """A loop's split as the edit: the names set where the loop keeps them, and an argparse namespace's as the
    command-line flags that set them."""
    names = train["set"]
    said = ", ".join(f"{k} = {v}" for k, v in names.items())
    flags = source.get("flags") or {}
    line = f"{train.get('site')}: the split where the loop keeps it: {said}"
    if flags and all(k in flags for k in names):
        line += f" (on its command line: {' '.join(f'{flags[k]} {v}' for k, v in names.items())})"
    return line


def _alloc_edit(over: Any) -> list[str]:
    """The host allocator's thresholds as the environment the command is started with."""
    from saturate.engine.host_alloc import child_env

    env = child_env({}) if over.host_alloc else {}
    return [f"in the environment: {' '.join(f'{k}={v}' for k, v in env.items())}"] if env else []


def write(tuning: ScriptTuning, folder: Path) -> Path:
    """overrides.json (what `saturate run --overrides` applies) and tune.json (every trial) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    overrides = json.dumps(tuning.best.overrides.to_dict(), indent=2) + "\n"
    atomic_write_bytes(folder / "overrides.json", overrides.encode())
    atomic_write_bytes(folder / "tune.json", (json.dumps(tuning.to_dict(), indent=2, default=str) + "\n").encode())
    (folder / PATCH).unlink(missing_ok=True)  # a folder tuned again: no patch of an earlier tuning left beside it
    if patch := tuning.patch().text:
        atomic_write_bytes(folder / PATCH, patch.encode())
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
                         ("data", "right"), ("windows", "right"), ("decided on", "right")):
        t.add_column(col, justify=justify)
    for trial in tuning.trials:
        if not trial.ok:
            t.add_row(trial.name, "failed", "-", "-", "-", "-")
            continue
        spread = trial.spread if trial.windows > 1 else None
        # no samples counted (no DataLoader in the timed steps): the spread goes with the step time
        rate = rate_text(trial.samples_per_s, spread, unit="") if trial.samples_per_s else "- (no DataLoader)"
        step = f"{trial.step_s:.4g}" + (f" ±{100 * spread:.1f} %" if spread is not None and not trial.samples_per_s
                                         else "")
        t.add_row(trial.name, step, rate, f"{100 * trial.data_share:.0f} %",
                  str(trial.windows or "-") + (" busy" if trial.busy else ""), decided_on(trial))
    console.print(_rows_note(tuning))
    console.print(t)
    for trial in tuning.trials[1:]:  # each trial's outcome once: a stage's decision line may already say it
        if not any(trial.outcome and trial.outcome in d for d in tuning.decisions):
            console.print(Text(f"  {trial.name}: {trial.outcome}"))
    for d in tuning.decisions:
        console.print(Text(f"  {d}"))
    gain = tuning.gain()
    how = ("each setting timed with the best so far in alternating windows" if tuning.paired is None
           else "medians of each trial's timed windows")
    if gain is None:
        console.print(Text("best: the script as written (no setting was faster beyond the noise and by "
                           f"{100 * POLICY.gains.min_gain:.0f} %; {how})", style="bold"))
    elif tuning.confirmation is not None:
        console.print(Text(f"best: {tuning.best.name}, {tuning.speedup:.2f}× the script as written, paired with it "
                           f"at the end ({gain.text()})", style="bold"))
        if note := tuning.confirmation.load_note(threads=tuning.best.overrides.threads is not None):
            console.print(Text(f"  {note}", style="yellow"))
    else:
        console.print(Text(f"best: {tuning.best.name}, {tuning.speedup:.2f}× the script as written ({gain.text()}; "
                           f"{how})", style="bold"))
    lines = edits(tuning)
    if lines:
        console.print("the edit to make in your script:")
        for line in lines:
            console.print(Text(f"  {line}"))
    else:
        console.print("no setting measured faster than the script as written beyond the noise; nothing to change")
    patch = tuning.patch()
    for line in patch.left:
        console.print(Text(f"  not in the patch: {line}"))
    if written is not None:
        console.print(f"overrides written to {written} (`saturate run --overrides {written} -- CMD` applies them "
                      "without an edit)")
        if patch.text and (written.parent / PATCH).is_file():
            where = "this folder" if patch.folder == Path.cwd().resolve() else str(patch.folder)
            console.print(f"the edit as a patch: {written.parent / PATCH} (in {where}: `git apply "
                          f"{(written.parent / PATCH).resolve()}`, or `patch -p1 -i` it)")


def decided_on(trial: ScriptTrial) -> str:
    """What a trial's decision rests on, for its row: its speed against the best so far as the comparison that
    decided measured it (paired: the median per-pair ratio; alone: the two trials' ratio), or "-"."""
    if trial.gain is None:
        return "-"
    return f"{1 + trial.gain:.3f}× " + ("paired" if trial.pair else "vs best")


def _rows_note(tuning: ScriptTuning) -> Text:
    """The line above the trials table: what its rows can and cannot be read against."""
    if tuning.paired is None:
        return Text("each row timed in its own windows, under the load of its moment; what decided is the ratio "
                    "against the best so far timed beside it in alternating windows (decided on)", style="dim")
    return Text(f"trials timed one after another, not in pairs ({tuning.paired}): a row's figures compare with "
                "another's only under the same load; what decided is in the last column", style="yellow")
