"""`saturate run` with no plan cached and no `--budget`: train the default plan at once (issue 30).

Before, such a run measured naive once to predict the job (its first steps, a build and a warm-up), and, when the
job was too short for a search to pay for itself, measured the default plan once more to guard its bf16, then
built it a third time to train: on a 60-step job 7.5 s of 50 before the first useful step. Now the default plan
(`plan.default_plan`: what the hardware runs natively, labelled as chosen, not measured) trains from step 0,
and its own first steps do both jobs:

- its lower precision is checked against fp32 at the same weights over the first steps
  (`engine/precision_guard.py`), going on in fp32 from there when they disagree;
- `size_steps` of its steps after the first `size_after` are timed (again, up to `size_tries` windows, while other
  processes keep the machine busy: the fastest window counts; `POLICY.job`, job_window.py), and the whole job
  predicted at that speed. Too short for a search (`sizing.tuning_budget`: `informed_share` of it under
  `informed_floor_s`) — it trains on, nothing else run.
  Long enough — it pauses there with a checkpoint; the tuning (its budget sized by that prediction: naive is not
  measured for it), the side-by-side and the rest of the training follow, the training resuming from that
  checkpoint with the plan found (the same effective batch: its first steps are not thrown away).

The prediction is from the default plan's speed, not naive's: tuning must pay for itself against what would train
otherwise, which is now the default plan (naive is slower, so fewer short jobs are tuned than before).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from saturate.engine.console import say_stopped
from saturate.engine.distributed import DistInfo, broadcast_object
from saturate.engine.trainer import RunConfig, RunResult, train
from saturate.plan import Plan, informed_summary
from saturate.policy import POLICY
from saturate.run.informed import informed_plan
from saturate.run.job_window import JobWindows
from saturate.run.sizing import budget_rule, tuning_budget
from saturate.workloads.base import Workload


@dataclass
class FirstSteps:
    """The default plan's session: finished (the whole job) or paused to tune."""

    plan: Plan  # the default plan it started with
    result: RunResult
    seconds: float  # measured: the session's wall time
    step_s: float | None = None  # measured: seconds per step over its timed steps (None: the job ended first)
    predicted_s: float | None = None  # the whole job at that speed (a prediction)
    why: str = ""  # one line: what the prediction decided
    to_tune: bool = False  # the prediction paused it to be tuned

    @property
    def build_s(self) -> float:
        """Measured: the session's wall time less its steps at their timed speed — building the plan, starting its
        loader, the guard's checks, the checkpoint at the pause (what measuring another plan costs besides its
        steps, roughly: `sizing.row_costs`)."""
        if self.step_s is None or self.result is None:
            return 0.0
        return max(0.0, self.seconds - self.result.steps * self.step_s)

    @property
    def paused(self) -> bool:
        """Stopped to be tuned (not by a signal, not at its end)."""
        return self.to_tune and not self.result.finished and not self.result.interrupted


def train_first(workload: Workload, hw: Any, dist: DistInfo, steps: int, config: RunConfig,
                console: Console) -> FirstSteps:
    """Train the default plan for `steps`, pausing after its first steps when they predict a job long enough to
    tune (module docstring). Under torchrun rank 0 decides (train's on_window: job_window.py), every rank learns it."""
    plan = informed_plan(workload, hw, dist.world_size, None).replace(name="default")
    console.print(f"no plan cached for this job: training the default plan at once, {informed_summary(plan)}; its "
                  f"first steps check its precision and predict the job", highlight=False)
    out = FirstSteps(plan, None, 0.0)  # type: ignore[arg-type]

    def sized(done: int, step_s: float) -> str | None:
        out.step_s, out.predicted_s = step_s, steps * step_s
        after, window = POLICY.job.size_after, POLICY.job.size_steps
        source = (f"{steps} steps at the default plan's {step_s:.3g} s/step, measured over its steps "
                  f"{after + 1}-{done}" + (f" (the fastest {window}-step window: other processes kept the "
                                           "machine busy)" if done > after + window else ""))
        if tuning_budget(out.predicted_s, informed=True) is None:
            share, floor = budget_rule(informed=True)
            out.why = (f"not tuned: the training is predicted at {out.predicted_s:.0f} s ({source}); "
                       f"{share:.0%} of it is under the {floor:.0f} s a search from this plan needs to pay for "
                       "itself, so the default plan trains on (--budget tunes anyway)")
            console.print(out.why, highlight=False)
            return None
        out.to_tune = True
        out.why = (f"tuning: the training is predicted at {out.predicted_s:.0f} s ({source}), long enough to tune; "
                   f"paused at step {done} (checkpointed), continued with the plan found")
        console.print(out.why, highlight=False)
        return out.why

    started = time.monotonic()
    out.result = train(workload, plan, dataclasses.replace(config, guard_precision=True), hardware=hw,
                       on_window=JobWindows(sized), on_stopped=say_stopped)
    out.seconds = time.monotonic() - started
    out.step_s, out.predicted_s, out.why, out.to_tune = broadcast_object(
        (out.step_s, out.predicted_s, out.why, out.to_tune) if dist.is_main else None)
    if out.step_s is None:
        out.why = f"not tuned: the job ended ({out.result.steps} steps) before its first steps were timed"
    return out
