"""`saturate run -- CMD`: the script as written and with the tuned settings side by side, then the whole
run with those settings applied from outside (no edit), and the before/after table.

Where the tuning's comparisons were paired (a CPU, a command of one process: `gated.py`), the side-by-side is too:
the script as written and tuned, both alive, timed in alternating windows; the ratio is the median of the per-pair
ratios with its interval (stats/pairs.py), and the tuned settings are faster when the whole interval is above 1
and the median gains `POLICY.gains.min_gain`. Elsewhere (a GPU, a launcher, `--overrides` given) the side-by-side is
rounds of whole trials that alternate (as written, tuned | tuned, as written | …; stats/rounds.py) so that a burst of
load on the machine hits both; the ratio reported is the median of the per-round ratios, with its range, and "within
noise" when the range includes 1.0.

When there is nothing to apply (tuning kept no setting: none was faster beyond the noise), there is no
side-by-side — it would time the same command twice — and the script runs as written (`NOTHING_FOUND`).

Decide, then confirm, then act: settings tuned in this run are applied to the full run only when the side-by-side
measured them faster (paired: beyond the interval; rounds: in every round, `Ratio.faster`); otherwise the full run
is the script as written and the report says why (`withheld`) — trials minutes apart can read a neighbour's burst
as a gain, alternating windows or rounds cannot. Settings the user gave (`--overrides FILE`) are the user's
decision: applied, with a warning when the side-by-side did not confirm them.

    run_script(command, options, console)   the whole flow: tune (or --overrides), side by side, full run
"""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.data.fingerprint import SameCheck, compare
from saturate.errors import ConfigError
from saturate.policy import POLICY
from saturate.policy.judge import Evidence, judge, judge_rounds
from saturate.script.boundary import ChildSettings
from saturate.script.command import NotTunable, ScriptRun, check_command, run_instrumented, run_plain
from saturate.script.gated import Gated, PairedTrials, again, time_pairs
from saturate.script.overrides import NONE, Overrides
from saturate.script.progress import tune_with_progress
from saturate.script.scratch import trial_logs
from saturate.script.script_trial import (
    ScriptTrial,
    TrialOptions,
    lean_loaders,
    training_print,
    trial_settings,
    window_rule,
)
from saturate.script.tuning import ScriptTuning
from saturate.script.tuning import render as render_tuning
from saturate.stats.comparison import Comparison
from saturate.stats.noise import WindowRule
from saturate.stats.rounds import Ratio, interleaved, per_round

NOTHING_FOUND = ("tuning found no setting faster than the script as written beyond the noise; it runs as written "
                 "(no side-by-side: it would time the same command twice)")


@dataclass
class ScriptRunReport:
    command: list[str]
    overrides: Overrides
    as_written: list[ScriptTrial]  # one per round (none when there was no side-by-side)
    tuned: list[ScriptTrial]
    full: ScriptRun  # the whole run, with the overrides applied when `applied`
    reason: str | None = None  # why there was no side-by-side
    applied: bool = True  # the full run had the overrides (False: withheld, or nothing to apply)
    withheld: str | None = None  # why the full run is as written although overrides were found, or a warning
    pairs: PairedTrials | None = None  # the side-by-side in alternating windows (then one trial each above)
    tuning: ScriptTuning | None = None  # what the tuning tried and decided (None: `--overrides` given)

    @property
    def short(self) -> dict[str, Any] | None:
        """A job too short to tune: why, and the settings chosen, not measured (None: tuned, or given)."""
        return None if self.tuning is None or self.tuning.short is None else self.tuning.to_dict()["short_job"]

    @property
    def ratios(self) -> list[float]:
        """Per round (or per pair of windows), the speed-up of tuned over as written."""
        if self.pairs is not None:
            return self.pairs.ratios
        return per_round([a.step_s for a in self.as_written], [t.step_s for t in self.tuned])

    def verdict(self) -> Ratio | Comparison | None:
        """What the side-by-side found: the pairs' comparison, else the rounds' ratio (None: no ratio)."""
        if self.pairs is not None:
            return self.pairs.comparison
        return Ratio.of(self.ratios)

    def same(self) -> SameCheck | None:
        """The full run's training against the script as written's run (the tuning's, or the side-by-side's) by what
        no seed changes (`data.fingerprint.compare`, seeded=False): None where neither has a loader's fingerprint."""
        written = self.tuning.baseline if self.tuning is not None else next(iter(self.as_written), None)
        full = training_print((self.full.summary or {}).get("loaders") or [])
        if written is None or written.fingerprint is None or full is None:
            return None
        return compare(written.fingerprint, full, seeded=False)

    def full_rate(self, skip: int = 2) -> tuple[float | None, int]:
        """Optimizer steps per second over the whole run, its first `skip` steps (start-up) left out."""
        times = (self.full.summary or {}).get("step_times", [])
        if len(times) <= skip + 1:
            return None, len(times)
        return (len(times) - 1 - skip) / (times[-1] - times[skip]), len(times)

    def to_dict(self) -> dict[str, Any]:
        rate, n = self.full_rate()
        ratio = Ratio.of(self.ratios)
        side: dict[str, Any] | None = None
        if self.pairs is not None:
            side = {"paired": True, "pairs": len(self.pairs.ratios), **self.pairs.to_dict()}
        elif not self.reason:
            side = {"paired": False, "rounds": len(self.as_written),
                    "verdict": ratio.to_dict()["verdict"] if ratio else None}
        return {"command": self.command, "overrides": self.overrides.to_dict(), "ratios": self.ratios,
                "applied": self.applied and bool(self.overrides), "withheld": self.withheld,
                "speedup": ratio.to_dict() if ratio else None, "reason": self.reason, "side_by_side": side,
                "short_job": self.short, "tuning": self.tuning.to_dict() if self.tuning is not None else None,
                "as_written": [t.to_dict() for t in self.as_written], "tuned": [t.to_dict() for t in self.tuned],
                "full_run": {"returncode": self.full.returncode, "counted": self.full.counted,
                             "optimizer_steps": self.full.optimizer_steps if self.full.counted else None,
                             "steps_per_s": rate, "seconds": self.full.seconds,
                             "trainer": (self.full.summary or {}).get("trainer"),
                             "lightning": (self.full.summary or {}).get("lightning"),
                             "loaders": lean_loaders((self.full.summary or {}).get("loaders")),
                             "compile": (self.full.summary or {}).get("compile"),
                             "same": None if (same := self.same()) is None else same.to_dict()}}


def side_by_side(command: Sequence[str], overrides: Overrides, *, rounds: int = POLICY.windows.side_by_side_rounds,
                 warmup: int = 2, steps: int = 10, first_step_timeout: float = POLICY.windows.first_step_timeout_s,
                 quiet_stdout: bool = False,
                 on_round: Callable[[int, str], None] | None = None,
                 rule: WindowRule | None = None) -> tuple[list[ScriptTrial], list[ScriptTrial]]:
    """The script as written and with `overrides`, measured in alternating rounds (interleaved()), each round
    timed in windows as a tuning trial is (`rule`, default `window_rule()`), so a round's figure is a median.

    `on_round(round, name)` is called before each measurement (for a progress line)."""
    rule = rule or window_rule()
    trials: dict[str, list[ScriptTrial]] = {"as written": [], "tuned": []}
    for r, name in interleaved(list(trials), rounds):
        if on_round is not None:
            on_round(r, name)
        over = overrides if name == "tuned" else NONE
        run = run_instrumented(command, trial_settings(over, warmup, steps, rule),
                               first_step_timeout=first_step_timeout, quiet_stdout=quiet_stdout)
        refused = ((run.report or {}).get("trainer") or {}).get("error")
        if refused and over.trainer:
            raise ConfigError(f"the script's Trainer refused the overrides {over.trainer}: {refused}")
        trials[name].append(ScriptTrial.of(name, over, run, rule))
    return trials["as written"], trials["tuned"]


def side_by_side_paired(command: Sequence[str], overrides: Overrides, options: TrialOptions) -> PairedTrials:
    """The script as written and with `overrides`, both alive, timed in alternating windows (`gated.py`); a gain
    timed again on a second, fresh pair of runs (`gated.again`: one pair's ratio can be off by a third)."""
    rule = options.rule

    def fresh() -> tuple[Gated, Gated]:
        a, b = (Gated(name, over, command, trial_settings(over, options.warmup, options.steps, rule), rule,
                      first_step_timeout=options.first_step_timeout, quiet_stdout=options.quiet_stdout)
                for name, over in (("as written", NONE), ("tuned", overrides)))
        return a, b

    runs = fresh()
    try:
        for run in runs:
            t = run.open()
            if t.trainer_error and run.overrides.trainer:
                raise ConfigError(f"the script's Trainer refused the overrides {run.overrides.trainer}: "
                                  f"{t.trainer_error}")
        first = time_pairs(runs[0], runs[1], POLICY.gains.min_gain, cap_s=2 * rule.max_seconds)
    finally:
        for run in runs:
            run.close()
    return again(first, fresh, POLICY.gains.min_gain, cap_s=2 * rule.max_seconds)


def full_run(command: Sequence[str], overrides: Overrides, *,
             first_step_timeout: float = POLICY.windows.first_step_timeout_s, quiet_stdout: bool = False) -> ScriptRun:
    """The whole script with `overrides` applied from outside; only its step times and samples are recorded."""
    settings = ChildSettings(mode="apply", profile=False, stop=False, overrides=overrides)
    return run_instrumented(command, settings, first_step_timeout=first_step_timeout, quiet_stdout=quiet_stdout)


def run_script(command: Sequence[str], options: TrialOptions, console: Console, *, overrides: Overrides | None = None,
               overrides_file: str | None = None, rounds: int = POLICY.windows.side_by_side_rounds,
               allow_micro_batch_change: bool = False) -> ScriptRunReport:
    """`saturate run -- CMD`: the tuned settings (tuned here, or `overrides` read from `overrides_file`), the
    script as written and tuned in `rounds` alternating rounds, then the whole script with them applied."""
    paired = False
    tuning = None
    if overrides is not None:
        reason = f"{overrides_file} sets nothing; the script runs as written (no side-by-side)"
    else:
        check_command(command)  # a command that cannot run is refused, not run as written
        try:
            tuning = tune_with_progress(command, options, console, allow_micro_batch_change=allow_micro_batch_change,
                                        confirm=False, short_jobs=True)  # the side-by-side below confirms it
        except NotTunable as e:  # the job still runs: as written, without the hooks, and the report says why
            console.print(f"[dim]run: not tuned ({e}); the whole script as written, without saturate's hooks …[/]")
            full = run_plain(command, quiet_stdout=options.quiet_stdout)
            return ScriptRunReport(list(full.command), NONE, [], [], full, f"not tuned: {e}", applied=False)
        if tuning.short is not None:  # no tuning, no side-by-side: the risk-free settings, said as not measured
            said = "; ".join(tuning.prior_said)
            console.print("[dim]run: a short job, not tuned; the whole script with the risk-free settings …[/]")
            full = full_run(command, tuning.prior, first_step_timeout=options.first_step_timeout,
                            quiet_stdout=options.quiet_stdout)
            return ScriptRunReport(list(full.command), tuning.prior, [], [], full,
                                   f"a short job: {tuning.short}; {said}", applied=bool(tuning.prior),
                                   tuning=tuning)
        render_tuning(tuning, console)
        overrides, reason = tuning.best.overrides, NOTHING_FOUND
        paired = tuning.paired is None  # its comparisons were paired: so is the side-by-side
    given = overrides_file is not None
    written: list[ScriptTrial] = []
    tuned: list[ScriptTrial] = []
    applied, withheld = bool(overrides), None
    pairs: PairedTrials | None = None
    if overrides and paired:
        reason = None
        console.print("[dim]run: the script as written and tuned, both alive, in alternating windows …[/]")
        pairs = side_by_side_paired(command, overrides, options)
        written, tuned = [pairs.a, *(a for a, _ in pairs.more)], [pairs.b, *(b for _, b in pairs.more)]
        applied, withheld = confirmed(pairs.comparison, given, overrides_file)
        if pairs.comparison is None:
            withheld = ("the tuned settings were not confirmed: a run of the script ended before three pairs of "
                        "windows under the same load (run it for longer, or shorten --trial-seconds); the full run "
                        "is the script as written, nothing applied")
    elif overrides:
        reason = None
        console.print(f"[dim]run: the script as written and tuned, in alternating rounds (their own output goes to "
                      f"{trial_logs()}) …[/]")

        def on_round(r: int, name: str) -> None:
            console.print(f"[dim]  measuring side by side: round {r + 1}/{rounds} ({name})[/]")

        written, tuned = side_by_side(
            command, overrides, steps=options.steps, warmup=options.warmup, rounds=rounds,
            first_step_timeout=options.first_step_timeout, quiet_stdout=options.quiet_stdout, rule=options.rule,
            on_round=on_round)
        applied, withheld = confirmed(Ratio.between([a.step_s for a in written], [t.step_s for t in tuned]), given,
                                      overrides_file)
        flags = f" (the command that runs: {shlex.join([*command, *overrides.argv()])})" if overrides.flags else ""
        console.print(f"[dim]run: the whole script with the tuned settings applied from outside{flags} …[/]"
                      if applied else
                      "[dim]run: the tuned settings were not confirmed; the whole script as written …[/]")
    else:
        console.print("[dim]run: nothing to apply; the whole script as written …[/]")
    full = full_run(command, overrides if applied else NONE, first_step_timeout=options.first_step_timeout,
                    quiet_stdout=options.quiet_stdout)
    return ScriptRunReport(list(full.command), overrides, written, tuned, full, reason, applied, withheld, pairs,
                           tuning=tuning)


def confirmed(found: Ratio | Comparison | None, given: bool, source: str | None = None) -> tuple[bool, str | None]:
    """(whether the full run applies the overrides, why not or a warning) from the side-by-side: rounds' ratio of
    as written ÷ tuned step times (faster in every round), or paired windows' comparison (faster beyond the
    interval and `POLICY.gains.min_gain`); tuned settings only when faster; given ones (`--overrides`) always,
    warned when not confirmed."""
    paired = isinstance(found, Comparison)  # alternating windows of two pairs of runs (`again`), else rounds
    decided = judge(found, Evidence.RUN_PAIRS_AGAIN) if paired else judge_rounds(found)  # type: ignore[arg-type]
    if decided.kept:
        return True, None
    if isinstance(found, Comparison):
        measured, how = f"tuned against as written {found.text()}", "faster beyond the noise in alternating windows"
    else:
        measured = f"tuned ÷ as written {found.verdict()}" if found is not None else "no round gave a ratio"
        how = "faster in every round side by side"
    if given:
        return True, (f"warning: {source} was not measured faster side by side ({measured}); applied as you asked")
    return False, (f"the tuned settings were not {how} ({measured}); the full run is the script as written, "
                   "nothing applied")


def render(report: ScriptRunReport, console: Console) -> None:
    console.print(Text(f"saturate run -- {shlex.join(report.command)}", style="bold"))
    if report.reason:
        console.print(Text(report.reason))
    else:
        _render_side_by_side(report, console)
    rate, n = report.full_rate()
    full = report.full
    status = "finished" if full.returncode == 0 else f"ended with exit code {full.returncode}"
    if report.withheld:
        console.print(Text(report.withheld))
    which = "with the tuned settings" if report.overrides and report.applied else "as written"
    if report.short is not None:
        which = "with the settings chosen above, not measured" if report.overrides else "as written"
    if not full.counted:
        console.print(f"the full run as written, without saturate's hooks: {status} in {full.seconds:.1f} s (its "
                      "steps not counted)")
        return
    line = f"the full run {which}: {status} after {full.optimizer_steps} optimizer steps in {full.seconds:.1f} s"
    if rate is not None:
        line += f", {rate:.3g} steps/s after its first steps (measured)"
    console.print(line)
    if (compiled := (full.summary or {}).get("compile")) and not compiled.get("applied"):
        console.print(Text(f"warning: its model was not compiled in the full run ({compiled.get('why')})",
                           style="yellow"))
    if (same := report.same()) is not None and same.changed:
        console.print(Text(f"warning: the full run's training differs from the script as written's: {same.text()}"
                           + (f"; {same.edit}" if same.edit else ""), style="yellow"))


def _render_side_by_side(report: ScriptRunReport, console: Console) -> None:
    t = Table(box=None, padding=(0, 1))
    count = "windows" if report.pairs is not None else "rounds"
    for col, justify in (("", "left"), ("s/step (median)", "right"), ("samples/s", "right"), (count, "right")):
        t.add_column(col, justify=justify)
    for name, trials in (("as written", report.as_written), ("tuned", report.tuned)):
        step = statistics.median(x.step_s for x in trials)
        rates = [x.samples_per_s for x in trials if x.samples_per_s]
        n = sum(x.windows for x in trials) if report.pairs is not None else len(trials)
        t.add_row(name, f"{step:.4g}", f"{statistics.median(rates):.1f}" if rates else "-", str(n))
    console.print(t)
    if report.pairs is not None:
        c = report.pairs.comparison
        console.print("tuned against as written: " + (c.text() if c else "not decided (a run of the script ended "
                                                                      "before its pairs of windows decided)"))
        if c is not None and (note := report.pairs.load_note(threads=report.overrides.threads is not None)):
            console.print(Text(f"  {note}", style="yellow"))
        return
    ratio = Ratio.of(report.ratios)
    if ratio is None:
        return
    console.print(f"tuned ÷ as written: {ratio.verdict()} (median of {ratio.rounds} alternating rounds, "
                  "with their range)")
    if not (ratio.faster or ratio.slower):
        noise = 50 * (ratio.high - ratio.low) / ratio.median
        console.print(f"  the tuned settings' gain is within noise here (±{noise:.1f} % between rounds): side by "
                      "side, they were not measurably faster")
