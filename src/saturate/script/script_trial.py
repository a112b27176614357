"""One trial of a user's script (`saturate tune|run -- CMD`): what it measured, and how two trials compare.

A trial's step time is the median over the windows its child timed (`child/trial_windows.py`, summarised with
the same `stats.noise.WindowRule` the child stopped by), its spread their relative half-range; a report without
windows (a side-by-side round, an older child) gives the Profiler's window and no spread. Two trials
compare through `stats.comparison.compare`, as the preset tuner's do: a gain counts only beyond both spreads
added and `POLICY.gains.min_gain` (`Comparison.verdict`). `TrialOptions` is how every run of the command is measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from saturate.policy import POLICY, Load
from saturate.policy.judge import Decision, Evidence, judge
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun
from saturate.script.overrides import Overrides
from saturate.stats.comparison import Comparison, compare
from saturate.stats.noise import WindowRule


@dataclass(frozen=True)
class TrialOptions:
    """How each run of the user's command is measured: `--trial-steps` (the Profiler's timed steps after
    `warmup`), `--trial-seconds` (the cap on its timed windows), `--first-step-timeout`; `quiet_stdout` sends the
    script's stdout to stderr (saturate's stdout then carries one JSON document)."""

    steps: int = 10
    seconds: float = POLICY.windows.trial_seconds
    first_step_timeout: float = POLICY.windows.first_step_timeout_s
    quiet_stdout: bool = False
    warmup: int = 2
    try_compile: bool = True  # False: `--no-compile`, no compile trial

    @property
    def rule(self) -> WindowRule:
        return window_rule(self.seconds)


def window_rule(max_seconds: float = POLICY.windows.trial_seconds) -> WindowRule:
    """When a script trial's windows are enough: the last 3 agree within ±2 %, or 8 windows, or `max_seconds`
    (each cap doubled when other processes kept the machine busy)."""
    return WindowRule(target=0.02, max_seconds=max_seconds)


@dataclass
class ScriptTrial:
    """One short instrumented run of the script with `overrides` applied.

    `step_s` is the median over the timed windows when there were any (`spread` their relative half-range,
    None for a single window), else the Profiler's window; `data_share` is from the Profiler's window."""

    name: str
    overrides: Overrides
    step_s: float
    samples_per_s: float | None
    data_share: float
    steps: int
    outcome: str = ""  # why it was kept or not
    losses: list[float] = field(default_factory=list)  # a Trainer's per-step losses, from the first step
    first_step_s: float | None = None  # from torch's import to the end of the first optimizer step
    samples_per_step: float | None = None
    note: str = ""  # what a check found when it passed (the losses' drift)
    spread: float | None = None  # the step time is known to about ± this share
    windows: int = 0  # timed windows (0: only the Profiler's window)
    window_steps_per_s: list[float] = field(default_factory=list)
    busy: bool | None = None  # other processes kept the machine busy (read when the windows hit the cap)
    ran_to_end: bool = False  # the script finished during the trial's windows (its own end-of-run code ran)
    out_of_memory: bool = False  # it failed with torch's out-of-memory error (`command.ScriptFailed`)
    timed_out: bool = False  # it was stopped at its time limit (`command.ScriptFailed`)
    trainer_error: str | None = None  # the script's Trainer refused the overrides' arguments (its message)
    host_peak: int | None = None  # the training process's host memory at its peak (bytes), from the Profiler
    other_cores: float | None = None  # cores other processes kept busy while it was timed (when read)
    threads: int | None = None  # torch's intra-op threads in the run
    faults_per_s: float | None = None  # the training process's minor page faults per second of its timed windows
    optimizer_share: float | None = None  # of the step, in the optimizer step (the Profiler's window; None: not timed)
    pair: dict[str, Any] | None = None  # timed in alternating windows with the best so far (`gated.py`): its pairs
    gain: float | None = None  # against the best so far, when compared with it (the decision's point estimate)
    decision: dict[str, Any] | None = None  # the judge's (policy.judge Decision.to_dict), when it was compared
    verdict: str | None = None  # that comparison's `Verdict` (its value)
    fingerprint: dict[str, Any] | None = None  # its training DataLoader's (data/fingerprint.py LoaderPrint.record)
    same: dict[str, Any] | None = None  # that against the script as written's (fingerprint.SameCheck.to_dict)
    split_set: dict[str, str] | None = None  # a loop's split set where it keeps it: each name's "set", or why not
    compiled: dict[str, Any] | None = None  # a loop's model compiled from outside (child/loop_compile.py's report)

    @classmethod
    def of(cls, name: str, overrides: Overrides, run: ScriptRun, rule: WindowRule | None = None) -> ScriptTrial:
        """The trial from a run's report; its windows summarised by `rule` (the one the trial was timed with)."""
        report = run.report or {}
        m = report["measurements"]
        profiled = m["step_s"]
        per_step = m.get("samples_per_step")
        data = m["phases"].get("data", 0.0) / profiled if profiled > 0 else 0.0
        losses = (report.get("trainer") or report.get("lightning") or report.get("loop") or {}).get("losses") or []
        t = cls(name, overrides, profiled, None, data, m["steps"], losses=losses,
                first_step_s=report.get("first_step_s"), samples_per_step=per_step,
                trainer_error=(report.get("trainer") or {}).get("error"), host_peak=m.get("main_peak"),
                threads=(report.get("threads") or {}).get("in_force"),
                optimizer_share=m["phases"].get("optimizer", 0.0) / profiled if profiled > 0 else None,
                fingerprint=training_print(report.get("loaders") or []), split_set=report.get("split_set"),
                compiled=report.get("compile"))
        windows = report.get("windows") or {}
        if rates := windows.get("rates"):
            summary = (rule or window_rule()).result(rates)
            t.step_s, t.steps, t.windows, t.window_steps_per_s = 1 / summary.median, windows["steps"], len(rates), rates
            t.spread = summary.spread if len(rates) > 1 else None
            t.busy = windows.get("busy")
            t.other_cores = windows.get("other_cores")
            t.faults_per_s = windows.get("minor_faults_per_s")
        t.ran_to_end = bool(windows.get("script_ended"))
        t.samples_per_s = per_step / t.step_s if per_step and t.step_s > 0 else None
        return t

    @classmethod
    def failed(cls, name: str, overrides: Overrides, why: str, out_of_memory: bool = False,
               timed_out: bool = False) -> ScriptTrial:
        return cls(name, overrides, float("inf"), None, 0.0, 0, outcome=f"failed: {why}", out_of_memory=out_of_memory,
                   timed_out=timed_out)

    def to_dict(self) -> dict[str, Any]:
        """Every field, the overrides as their JSON object, the fingerprint without its digests and indices."""
        return {**vars(self), "overrides": self.overrides.to_dict(), "fingerprint": lean(self.fingerprint)}

    @property
    def ok(self) -> bool:
        return self.step_s != float("inf")

    def against(self, other: ScriptTrial) -> Comparison:
        """This trial's speed against `other`'s, given both spreads (steps per second: every trial of a tuning
        keeps the script's effective batch). Two trials timed apart while other processes kept the machine busy to
        a different degree (`Load.uneven_with`) were not measured under the same conditions: their ratio is
        the load's as much as the setting's, so it is said to be within the noise, and why (nanoGPT's fused AdamW
        read 3.6× "beyond noise" against an as-written trial timed in a burst, 2026-11-28). A gain read off a trial
        of one timed window (its noise not measured: the run ended) is not kept either: nanoGPT's fused AdamW read
        "+6.9 %" so under the bursty neighbour, and its confirmation then measured it within noise (2026-11-28). A
        loss so read still counts: not keeping a setting is what the trial would have led to anyway."""
        c = compare(_Speed(1 / self.step_s, self.spread), _Speed(1 / other.step_s, other.spread), POLICY.gains.min_gain)
        if c.faster and not c.noise_known and 1 in (self.windows, other.windows):
            return replace(c, noise=max(c.noise, abs(c.gain)), note=(
                "no gain is kept on one window alone"))
        mine, theirs = self.other_cores, other.other_cores
        if not Load(mine).uneven_with(Load(theirs)):
            return c
        return replace(c, noise=max(c.noise, abs(c.gain)), note=(
            f"timed apart while other processes kept {theirs:.1f} and then {mine:.1f} cores busy: not the same "
            "conditions, so not compared"))


def training_print(loaders: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fingerprint of the loader the run trained from: the one that gave the most batches (listed first)."""
    used = [x for x in loaders if x.get("batches")] or [x for x in loaders if (x.get("fingerprint") or {}).get("sizes")]
    return used[0].get("fingerprint") if used else None


def judged(t: ScriptTrial, best: ScriptTrial) -> Decision:
    """The judge's decision on a lone trial `t` against the best so far's own trial (`policy.judge`, separate
    trials): kept alone only when decisive on a quiet machine (or under the same load); a gain it cannot decide
    alone is to be confirmed."""
    c = compare(_Speed(1 / t.step_s, t.spread), _Speed(1 / best.step_s, best.spread), POLICY.gains.min_gain)
    return judge(c, Evidence.TRIALS, Load(t.other_cores), Load(best.other_cores),
                 one_window=1 in (t.windows, best.windows))


@dataclass(frozen=True)
class _Speed:
    """A trial as `stats.comparison.compare` reads it (a rate and its spread)."""

    samples_per_s: float
    spread: float | None


def lean(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    """A fingerprint record as the JSON keeps it: without its per-sample digests and indices (~35 KB a loader),
    which only the comparison in the run reads."""
    return None if fingerprint is None else {k: v for k, v in fingerprint.items() if k not in ("digests", "indices")}


def lean_loaders(loaders: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """DataLoader records (the child's) with their fingerprints `lean`."""
    if loaders is None:
        return None
    return [{**x, "fingerprint": lean(x["fingerprint"])} if x.get("fingerprint") else x for x in loaders]


def trial_settings(overrides: Overrides, warmup: int, steps: int, rule: WindowRule,
                   window_s: float = POLICY.windows.window_s) -> ChildSettings:
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


def refused(t: ScriptTrial, overrides: Overrides) -> str | None:
    """Why the script refused the overrides (from the trial's report: its Trainer their arguments, its model a
    compile from outside), or None."""
    error = t.trainer_error
    if error and overrides.trainer:
        return f"the Trainer refused the arguments ({error})"
    if overrides.compile and t.compiled is not None and not t.compiled.get("applied"):
        return f"its model could not be compiled from outside ({t.compiled.get('why')})"
    return None


def paired_figures(t: ScriptTrial) -> dict[str, Any]:
    """A paired trial's figures, for the JSON of the trial it was paired with."""
    return {"name": t.name, "step_s": t.step_s, "spread": t.spread, "windows": t.windows,
            "steps_per_s": t.window_steps_per_s}
