"""`saturate tune -- CMD` with progress: each trial's step time printed as it ends (`tune_command` does the work)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from saturate.script.script_trial import ScriptTrial, TrialOptions
from saturate.script.tune_script import tune_command
from saturate.script.tuning import ScriptTuning


def tune_with_progress(command: Sequence[str], options: TrialOptions, console: Console, *,
                       allow_micro_batch_change: bool = False, confirm: bool = True,
                       short_jobs: bool = False) -> ScriptTuning:
    """`saturate tune -- CMD` (and `run -- CMD`'s tuning): `tune_command` on this machine's usable cores, each
    trial's step time printed as it ends."""
    from saturate.hardware import usable_cores
    from saturate.script.isolation import notice
    from saturate.script.scratch import trial_logs

    console.print(f"[dim]tune: each trial runs your command's first {options.warmup + options.steps} optimizer "
                  "steps with saturate's hooks, then times its steps in windows until they agree (at most "
                  f"{options.seconds:g} s), then stops it; {notice(command)}; each trial's own output goes to "
                  f"{trial_logs()} …[/]")

    def show(t: ScriptTrial) -> None:
        spread = f" ±{100 * t.spread:.1f} %" if t.spread is not None else ""
        pair = (f", paired with {t.pair['with']}: {1 + t.pair['gain']:.3f}× in {len(t.pair['ratios'])} pairs"
                if t.pair and t.pair.get("gain") is not None else "")
        console.print(f"[dim]  {t.name}: {t.step_s:.4g} s/step{spread}{pair}[/]")

    return tune_command(command, warmup=options.warmup, steps=options.steps, cores=usable_cores()[0],
                        first_step_timeout=options.first_step_timeout, quiet_stdout=options.quiet_stdout,
                        on_trial=show, allow_micro_batch_change=allow_micro_batch_change, rule=options.rule,
                        confirm=confirm, short_jobs=short_jobs, try_compile=options.try_compile)
