"""The training job's own checks: the first steps that size it, its precision guard, its micro-batch grown, its
watch."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule


@dataclass(frozen=True)
class JobRules:
    """How a job's first steps are timed and checked before anything is spent on it, and how it is watched."""

    # --- the job's first steps, timed to size it (run/job_window.py, on train's windows) ----------------------
    size_after: int = rule(4, "steps of a session left out of timing the job: cold, and the precision guard "
                           "checks them", "run/job_window.py; run/first_steps.py")
    size_steps: int = rule(5, "the steps timed to size the job (one window)", "run/job_window.py; run/first_steps.py")
    size_tries: int = rule(3, "windows at most while other processes keep the machine busy: a neighbour only slows "
                           "steps, so the fastest is nearest the job's speed (a burst over steps 5-9 read 1.81 s/step "
                           "for a 0.78 s/step job: a 543-s prediction sized an 87-s search for a 230-s job)",
                           "bursty neighbour, 2026-11-27 (docs/benchmarks.md, eleventh session, on the CPU)")
    size_agree: float = rule(0.15, "...and only while the windows disagree by more than this share: a steady load "
                             "reads every window alike (14.4-15.9 s/step beside the steady neighbour), and timing "
                             "it again only delays the tuning that finds fewer threads",
                             "steady neighbour, 2026-11-27 (docs/benchmarks.md, eleventh session, on the CPU)")
    # --- the precision guard, the micro-batch grown, the watch -----------------------------------------------
    loss_tolerance: float = rule(0.02, "a lower precision's losses may differ from fp32's by this share of the loss's "
                                 "scale (training's guard and the tuner's loss check alike)",
                                 "engine/precision_guard.py loss_drift; tune/results.py SearchSettings")
    guard_steps: int = rule(4, "optimizer steps the precision guard checks (before each): as many as the tuner's "
                            "loss check compares", "engine/precision_guard.py")
    grow_after: int = rule(2, "steps of a session before the informed micro-batch may grow: the second is the first "
                           "with the optimizer's state allocated, so the peak holds it", "engine/grow.py")
    headroom: float = rule(0.9, "the share of the device's memory a plan may use: the micro-batch grown, the "
                           "informed plan's, the tuner's memory fit", "engine/grow.py; run/informed.py; "
                           "tune/results.py SearchSettings.headroom")
    low_util_pct: float = rule(50.0, "a training device under this busy (%) for sustained_s gets one note naming "
                               "the likeliest cause", "engine/watch.py")
    sustained_s: float = rule(30.0, "...every metrics record over the last this many seconds", "engine/watch.py")
