"""`saturate tune -- CMD`: the settings a user's own script can take from outside, found by measurement.

Each trial is the script's first optimizer steps run with saturate's hooks, some settings applied from outside
(`hooks`: DataLoader arguments at construction, TF32 at start-up, a Transformers `Trainer`'s `TrainingArguments`
before the Trainer reads them), then stopped. The doctor's Profiler splits its first timed steps into phases (the
share spent waiting for data); then, detached, the script's own steps are timed in windows until they agree or a cap
(`child/trial_windows.py`, with the preset tuner's `stats.noise.WindowRule`), so a trial's step time is a median with
a spread. What is tried, in order, each kept only when faster than the best so far beyond both trials' spreads added
and by at least `POLICY.gains.min_gain` (`stats.comparison.compare`; otherwise "within noise (±x %)"):

For a command of one process, on a CPU and on a GPU where two runs fit in its memory (`gated.can_gate`), every such
comparison is paired (`gated.py`): the best run so far and the candidate are alive at once and timed in alternating
windows, and the median of the per-pair ratios and its interval decide (stats/pairs.py), so a neighbour's burst
during one trial cannot pass for a gain; the best run stays alive for the next comparison (a gain against it is
timed again on fresh runs when its speed moved since first timed: `drift.py`). A tuning that kept a change then confirms
it against the script as written, paired again (`confirm`), and keeps nothing it could not confirm. Elsewhere (a
launcher, a GPU the script fills) trials run one after another and compare by their windows' spreads.

For a Transformers `Trainer` or a Lightning `Trainer` (`trainer_stages`' stages, the knobs in each
framework's terms from `frameworks.py`): precision, checked against the script's own first losses;
micro-batch × accumulation at the same effective batch; activation checkpointing where memory stopped a
larger micro-batch; the fused optimizer; compile, where the planned steps pay back its compile time.
For a plain script (no Trainer): bf16 autocast from outside where bf16 is native (`trainer_stages.loop_precision`,
checked against the script's own first losses as a Trainer's precision is); the fused optimizer, when the
optimizer the script steps is torch's `Adam`/`AdamW`, not fused, and torch has the fused kernel on the script's
device (`fused=True` given at its constructor from outside; the edit said at that line); and last, after the
stages below, its model compiled in place, where the length it plans can pay that back (`compile_stage.py`).
For every script:
6. loader workers (only when the as-written run waits for data): 1, 2, 4, … up to the usable cores, and on to
   4 per core while the best run still waits for data and host memory allows (a dataset waiting on I/O needs
   no core), with persistent workers; growth stops at the first count from 2 on that does not gain (one
   worker only overlaps loading with the step, so it may not gain where two do);
7. a deeper prefetch (4) where workers are kept;
8. pinned memory, on a GPU;
9. TF32 matmuls, on a GPU that has them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from saturate.errors import SaturateError
from saturate.policy import POLICY
from saturate.policy.judge import Evidence, confirms, judge
from saturate.script.command import NotTunable, ScriptRun, run_instrumented
from saturate.script.compile_stage import compile_stage
from saturate.script.drift import moved
from saturate.script.frameworks import framework_of, plain_fused
from saturate.script.gated import Gated, PairedTrials, again, can_gate, time_pairs
from saturate.script.host_stages import alloc_stage, loader_stages, threads_stage
from saturate.script.loop_split import loop_split_stage
from saturate.script.overrides import NONE, Overrides
from saturate.script.same_training import changed_training, loss_noise
from saturate.script.script_trial import (
    ScriptTrial,
    judged,
    paired_figures,
    refused,
    trial_settings,
    window_rule,
)
from saturate.script.short_job import prior_overrides, too_short
from saturate.script.trainer_stages import loop_precision, stage, trainer_stages, worth_fusing
from saturate.script.tuning import ScriptTuning
from saturate.stats.comparison import Comparison
from saturate.stats.noise import WindowRule

# A paired gain under POLICY.gains.again_below is timed again on a fresh pair of runs (the judge; gated.again).
Runner = Callable[..., ScriptRun]  # run_instrumented's signature; tests pass a fake machine


def tune_command(command: Sequence[str], *, warmup: int = 2, steps: int = 10, cores: int = 1,
                 first_step_timeout: float = POLICY.windows.first_step_timeout_s, quiet_stdout: bool = False,
                 on_trial: Callable[[ScriptTrial], None] | None = None, runner: Runner = run_instrumented,
                 supports: dict[str, bool] | None = None, rule: WindowRule | None = None,
                 window_s: float = POLICY.windows.window_s, allow_micro_batch_change: bool = False,
                 paired: bool | None = None, confirm: bool = True, short_jobs: bool = False,
                 try_compile: bool = True, stages: Callable[[_Search], Any] | None = None) -> ScriptTuning:
    """Measure the script as written, then the settings above one family at a time; the fastest wins.

    `steps`: the Profiler's timed steps per trial (and with several processes, each window's steps); then
    windows of at least `window_s` until `rule` says they are enough (default `window_rule()`).
    `supports`: native bf16/fp16/tf32 on the script's device (default: `saturate.hardware.probe`'s).
    `allow_micro_batch_change`: search a trainer's micro-batch even when the model has batch-coupled layers.
    `paired`: compare in alternating windows where the command allows (default: when `runner` is the real one);
    `confirm`: end with the best against the script as written, paired (`run -- CMD` measures that side by side
    itself). `short_jobs` (`run -- CMD`): a job too short to pay back its tuning (`too_short`) is not tuned past
    its first trial; `result.short` says why and `result.prior` holds the risk-free settings `prior_overrides`
    takes from the hardware and that trial. `try_compile` False (`--no-compile`): no compile trial. `stages`: these
    trials instead (`doctor -- CMD --apply`: the doctor's fix)."""
    rule = rule or window_rule()
    search = _Search(list(command), warmup, steps, first_step_timeout, quiet_stdout, on_trial, runner, rule, window_s)
    try:
        base, run = search.trial("as written", NONE)
    except SaturateError as e:  # nothing to tune against: `run -- CMD` then runs the script as written
        raise NotTunable(str(e)) from e
    base.outcome = "the script's own settings"
    report = run.report or {}
    device = report["measurements"]["device_type"]
    if paired is None:
        paired = runner is run_instrumented
    m = report["measurements"]
    why = can_gate(command, device, int(report.get("world_size") or 1),
                   device_peak=m.get("device_mem_peak"),  # this process's (reserved): not other jobs' on the GPU
                   device_total=m.get("device_mem_total")) if paired else "not asked for"
    result = ScriptTuning(list(run.command), base, base, [base], loaders=report.get("loaders", []),
                          device_type=device, trainer=report.get("trainer"), lightning=report.get("lightning"),
                          optimizer=report.get("optimizer"), rule=rule, paired=why)
    search.result = result
    if short_jobs and (why := too_short(base, run.seconds, framework_of(report), report)):
        search.close()
        result.short = why
        result.prior, result.prior_said = prior_overrides(result, cores)
        return result
    try:
        stages(search) if stages is not None else _stages(  # those asked for, else every stage
            search, result, framework_of(report), report, supports, cores, allow_micro_batch_change, try_compile)
        if confirm:
            search.confirm()
    finally:
        search.close()
    if ended := [t.name for t in result.trials if t.ran_to_end]:
        result.decisions.append(f"warning: the script ran to its end during {len(ended)} trial(s) ({ended[0]}, …): "
                                "the trials timed all of its steps; a trial needs a run longer than its windows "
                                "(--trial-seconds shortens them)")
    return result


def _stages(search: _Search, result: ScriptTuning, framework: Any, report: dict[str, Any],
            supports: dict[str, bool] | None, cores: int, allow_micro_batch_change: bool, try_compile: bool) -> None:
    device = result.device_type
    alloc_stage(search, device)
    if supports is None:
        from saturate.hardware import probe

        supports = probe(measure_peaks=False, device=device).supports
    if framework is not None:
        trainer_stages(search, framework, supports, report.get("model"), allow_micro_batch_change, try_compile)
    else:
        loop_split_stage(search, report, allow_micro_batch_change)
        loop_precision(search, report, supports)
        stage(search, "fused optimizer", worth_fusing(plain_fused(result.optimizer or {}, device), result))
    loader_stages(search, cores)
    threads_stage(search, cores)
    if device == "cuda":
        search.consider("TF32", search.with_overrides(Overrides(tf32=True)))
    else:
        result.decisions.append(f"TF32: not on {device}")
    if framework is None:  # last: each trial after it would compile again
        compile_stage(search, report, try_compile)


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
        self.incumbent: Gated | None = None  # the best so far, alive and parked at its gate (paired comparisons)
        self.limit: tuple[Overrides, float] | None = None  # a candidate's runs stopped past these seconds (compile)

    def gated(self, name: str, overrides: Overrides) -> Gated:
        """A run of the command with `overrides` that will wait at its gate (`gated.py`), not yet started."""
        settings = trial_settings(overrides, self.warmup, self.steps, self.rule, self.window_s)
        return Gated(name, overrides, self.command, settings, self.rule, first_step_timeout=self.first_step_timeout,
                     quiet_stdout=self.quiet_stdout, timeout=self.limit_of(overrides))

    def close(self) -> None:
        """End the live run of the best so far, if any."""
        if self.incumbent is not None:
            self.incumbent.close()
            self.incumbent = None

    def trial(self, name: str, overrides: Overrides) -> tuple[ScriptTrial, ScriptRun]:
        settings = trial_settings(overrides, self.warmup, self.steps, self.rule, self.window_s)
        limit_s = self.limit_of(overrides)
        run = self.runner(self.command, settings, first_step_timeout=self.first_step_timeout,
                          quiet_stdout=self.quiet_stdout, **({"timeout": limit_s} if limit_s is not None else {}))
        t = ScriptTrial.of(name, overrides, run, self.rule)
        if why := refused(t, overrides):
            t = ScriptTrial.failed(name, overrides, why)
        if self.on_trial is not None:
            self.on_trial(t)
        return t, run

    def consider(self, name: str, overrides: Overrides,
                 check: Callable[[ScriptTrial], str | None] | None = None) -> ScriptTrial:
        """Run a trial; keep it when `check` finds nothing wrong and it is faster than the best so far by
        `POLICY.gains.min_gain` at least and beyond the noise: paired with the best so far where the command allows
        (`gated.py`), else beyond both trials' spreads (`ScriptTrial.against`)."""
        if self.result.paired is None:
            return self._consider_paired(name, overrides, check)
        return self._consider_alone(name, overrides, check)

    def _consider_alone(self, name: str, overrides: Overrides, check: Callable[[ScriptTrial], str | None] | None,
                        note: str = "") -> ScriptTrial:
        """`consider` as a trial run alone, against the best so far's own trial (`note`: why, when it was meant to
        be paired)."""
        try:
            t, _ = self.trial(name, overrides)
        except SaturateError as e:  # the script failed with this setting (out of memory, refused)
            t = self._failed(name, overrides, e)
        result = self.result
        result.trials.append(t)
        if note:
            t.note = f"{t.note}; {note}" if t.note else note
        if not t.ok:
            return t
        return self._alone(t, result.best, check)

    def _failed(self, name: str, overrides: Overrides, e: SaturateError) -> ScriptTrial:
        t = ScriptTrial.failed(name, overrides, str(e), out_of_memory=getattr(e, "out_of_memory", False),
                               timed_out=getattr(e, "timed_out", False))
        if self.on_trial is not None:
            self.on_trial(t)
        return t

    def _consider_paired(self, name: str, overrides: Overrides,
                         check: Callable[[ScriptTrial], str | None] | None) -> ScriptTrial:
        """`consider`, the candidate and the best so far timed in alternating windows."""
        result = self.result
        best = result.best
        if self.incumbent is None:
            self.incumbent = self.gated(best.name, best.overrides)
            try:
                live = self.incumbent.open()
            except SaturateError:
                self.close()
                raise
            if best is result.baseline and result.loss_noise is None:  # a second run of the script as written
                result.loss_noise = loss_noise(live, best)
        candidate = self.gated(name, overrides)
        try:
            t = candidate.open()
            if why := refused(t, overrides):
                raise SaturateError(why)
        except SaturateError as e:  # the script failed with this setting (out of memory, refused)
            candidate.close()
            if getattr(e, "out_of_memory", False) and result.device_type != "cpu":
                # beside the parked best run on the same GPU: tried again alone, which is how it would train
                self.close()
                return self._consider_alone(name, overrides, check, "out of device memory beside the parked best "
                                            "run, so tried alone")
            t = self._failed(name, overrides, e)
            result.trials.append(t)
            return t
        except BaseException:  # Ctrl-C or SIGTERM while it starts: its run and its folder go too
            candidate.close()
            raise
        try:
            pairs, since = self._with_best(candidate, best_first=True)
            aged = moved(self.incumbent.windows, since)
            c = pairs.comparison
            if judge(c, Evidence.RUN_PAIRS, aged=bool(aged)).to_confirm:  # timed again on a fresh pair of runs
                pairs = again(pairs, lambda: (self.gated(best.name, best.overrides), self.gated(name, overrides)),
                              POLICY.gains.min_gain, cap_s=2 * self.rule.max_seconds)
                if aged and (c2 := pairs.comparison) is not None:
                    pairs.comparison = c2.said("; ".join(x for x in (aged, c2.note) if x))
                if pairs.comparison is None:  # the second pair decided nothing: one pair of runs is not enough
                    said = (f"{c.note}; " if c.note else "") + ("a run of the second pair of runs ended before its "
                                                                "windows decided; one pair alone can be off by this")
                    pairs = replace(pairs, comparison=replace(c, noise=max(c.noise, c.gain), note=said))
        except BaseException:  # Ctrl-C, or a failure: neither run is left behind (the incumbent: `close`)
            candidate.close()
            raise
        if pairs.comparison is None:  # a run ended before enough pairs: compared as trials one after another
            candidate.close()
            if not self.incumbent.parked:
                self.close()
            t = pairs.b
            if self.on_trial is not None:
                self.on_trial(t)
            result.trials.append(t)
            return self._alone(t, best, check)
        t = pairs.b
        t.pair = {"with": best.name, "incumbent": paired_figures(pairs.a), **pairs.to_dict()}
        if self.on_trial is not None:
            self.on_trial(t)
        result.trials.append(t)
        t.decision = judge(pairs.comparison, Evidence.RUN_PAIRS_AGAIN if pairs.more else Evidence.RUN_PAIRS).to_dict()
        self._decide(t, pairs.comparison, check)
        if self.kept(t):
            self.incumbent.close()
            self.incumbent = candidate
        else:
            candidate.close()
        return t

    def _with_best(self, other: Gated, *, best_first: bool) -> tuple[PairedTrials, int]:
        """The live best run and `other` timed in alternating windows (A: the best when `best_first`), and how many
        windows the best run had timed before them (`drift.moved`). When the best run reaches its script's end
        first (a short job, timed many windows), a fresh one of it, up to `POLICY.windows.fresh_tries` times."""
        for fresh in (False, *[True] * POLICY.windows.fresh_tries):
            if fresh:
                best = self.result.best
                self.incumbent.close()
                self.incumbent = self.gated(best.name, best.overrides)
                self.incumbent.open()
            since = len(self.incumbent.windows)
            runs = (self.incumbent, other) if best_first else (other, self.incumbent)
            pairs = time_pairs(*runs, POLICY.gains.min_gain, cap_s=2 * self.rule.max_seconds)
            if pairs.comparison is not None or self.incumbent.parked or not other.parked:
                break
        return pairs, since

    def confirm(self) -> None:
        """The best against the script as written, paired (when comparisons were): kept only when faster beyond
        the pairs' interval and `POLICY.gains.min_gain` — what the tuning's trials, one comparison at a time, found in
        all."""
        result = self.result
        if result.paired is not None or result.best is result.baseline:
            return
        try:
            if self.incumbent is None:
                self.incumbent = self.gated(result.best.name, result.best.overrides)
                self.incumbent.open()
            written = self.gated("as written", NONE)
            with written:
                written.open()
                pairs, _ = self._with_best(written, best_first=False)
            best = result.best
            pairs = again(pairs, lambda: (self.gated("as written", NONE), self.gated(best.name, best.overrides)),
                          POLICY.gains.min_gain, cap_s=2 * self.rule.max_seconds)
        except SaturateError as e:
            result.decisions.append(f"confirmation against the script as written: failed ({e}); nothing kept")
            result.best = result.baseline
            return
        result.confirmation = pairs
        c = pairs.comparison
        if c is not None and c.faster:
            result.decisions.append(f"confirmed against the script as written, paired: {c.text()}")
            return
        why = "a run ended before enough pairs of windows" if c is None else c.text()
        result.decisions.append(f"not confirmed against the script as written, paired ({why}): {result.best.name} "
                                "is not kept; the script as written is the best measured")
        result.best = result.baseline

    def _alone(self, t: ScriptTrial, best: ScriptTrial, check: Callable[[ScriptTrial], str | None] | None
               ) -> ScriptTrial:
        """`t` against the best so far's own trial, as the judge says (`script_trial.judged`): a gain it cannot
        decide alone is confirmed against the best measured again right after (the preset tuner's rule: two trials
        one after another are one comparison, and a machine's drift between them reads as a gain)."""
        d, c = judged(t, best), t.against(best)
        if d.to_confirm and d.comparison is not None and d.comparison.faster:
            try:
                again, _ = self.trial(f"again: {best.name}", best.overrides)
            except SaturateError as e:
                again = self._failed(f"again: {best.name}", best.overrides, e)
            again.outcome = f"measured again to confirm {t.name} ({d.reason.value})"
            if best is self.result.baseline and self.result.loss_noise is None:
                self.result.loss_noise = loss_noise(again, best)
            self.result.trials.append(again)
            first = f"{100 * c.gain:+.1f} % against its earlier trial"
            if not again.ok:
                c = replace(c, noise=max(c.noise, abs(c.gain)), note=f"not confirmed: measuring {best.name} again "
                            "failed")
            elif confirms(c2 := t.against(again)):
                c = c2.said(f"confirmed: {first}, and against {best.name} measured again right after")
            else:
                c = replace(c2, noise=max(c2.noise, abs(c2.gain)), note=f"not confirmed: {first}, "
                            f"{100 * c2.gain:+.1f} % against {best.name} timed again")
        t.decision = d.to_dict()
        return self._decide(t, c, check)

    def _decide(self, t: ScriptTrial, c: Comparison, check: Callable[[ScriptTrial], str | None] | None) -> ScriptTrial:
        """Keep `t` when `check` finds nothing wrong and `c` (it against the best so far) says faster."""
        result = self.result
        t.gain, t.verdict = c.gain, c.verdict.value
        problem = changed_training(t, result) or (check(t) if check is not None else None)
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

    def limit_of(self, overrides: Overrides) -> float | None:
        return self.limit[1] if self.limit is not None and self.limit[0] == overrides else None

    def kept(self, t: ScriptTrial) -> bool:
        return self.result.best is t

    def with_overrides(self, overrides: Overrides) -> Overrides:
        """The best overrides so far with these added."""
        return self.result.best.overrides.merged(overrides)
