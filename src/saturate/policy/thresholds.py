"""Every threshold the tuners, the doctor and `run` decide with, once, typed, each with its reason.

    from saturate.policy import POLICY
    POLICY.load.same_cores        # what load makes two trials comparable: this line, and `Load.same_as`

A section is a frozen dataclass; each field is `rule(value, why, see)`: the value, one line on why it is what it is,
and where the measurement behind it is recorded (a bench log, a test, a docs section). `Policy.to_dict()` is written
into every tuning's `tune.json`; `SATURATE_POLICY=FILE.toml` overrides fields for an experiment (`policy.load_policy`).
Nothing here measures or decides: the decisions stay with their stages, the doctor's rules and the judges of
`stats/`; they read their thresholds here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from saturate.policy.doctor_rules import DoctorRules
from saturate.policy.fields import rule
from saturate.policy.job_rules import JobRules
from saturate.policy.payback_rules import PaybackRules
from saturate.policy.same_rules import SameRules


@dataclass(frozen=True)
class LoadRules:
    """When other processes' CPU use makes a machine busy, and when two readings of it are the same load."""

    busy_cores: float = rule(0.5, "other processes keeping half a core busy or more make a machine busy (the least "
                             "that moves a 2-core CPU's throughput beyond the tuners' few percent)",
                             "docs/tuning.md (On a busy machine)")
    busy_share: float = rule(0.25, "...or a quarter of the usable cores, whichever is more: on many cores half a core "
                             "of neighbour moves nothing", "docs/tuning.md (On a busy machine)")
    same_cores: float = rule(0.2, "two readings this close (other processes' mean cores) are the same load, trusted "
                             "as such: a steady neighbour reads 1.0 and 1.0 of 2 cores, a burst spanning one trial "
                             "0.0 against 0.7-1.0", "docs/tuning.md (On a busy machine)")
    uneven_cores: float = rule(0.5, "two readings this far apart are not the same load: a pair of windows across a "
                               "burst's edge is left out. Between same_cores and this, neither trusted as the same "
                               "nor thrown out: leaving data out costs only time, trusting it costs a decision",
                               "docs/scripts.md (saturate tune -- CMD)")
    forgiven_cores: float = rule(0.25, "a quarter of a core of the neighbours' reading is forgiven when counting the "
                                 "threads they leave (a reading of 1.2 of 2 cores leaves one thread, not none)",
                                 "docs/tuning.md (On a busy machine)")


@dataclass(frozen=True)
class GainRules:
    """How much faster a change must be to be taken, and when a gain must be measured again before it is."""

    min_gain: float = rule(0.03, "a change is taken only when faster by this share, and beyond both figures' noise "
                           "(preset tuner, script tuner, run's side-by-side alike)",
                           "docs/tuning.md (How a trial is timed)")
    confirm_below: float = rule(0.15, "a preset trial's gain under this (or under twice its noise) is confirmed by "
                                "measuring the incumbent again: the same plan built twice read 45-55 samples/s, "
                                "seconds apart, on a quiet 2-core CPU",
                                "bench/side_by_side.py, 2026-11-23 (docs/results.md)")
    again_below: float = rule(0.25, "a script's paired gain under this is timed again on a fresh pair of runs: a "
                              "run's speed has a part that stays with its process (bf16 read +4.4 % in 6 of 6 "
                              "pairs where it cannot gain 1 %), larger than one process's trial-to-trial noise",
                              "bench/results, 2026-11-28 (docs/results.md)")
    decisive_noise: float = rule(2.0, "a preset trial's gain decides alone only beyond this many times the "
                                 "comparison's noise (and confirm_below); a loss within it may still hide a gain",
                                 "tune/state.py SearchState.beats")
    drift: float = rule(0.25, "a live run whose speed moved this much since its first paired windows is not "
                        "compared as it is (a fresh pair is taken)", "script/drift.py")


@dataclass(frozen=True)
class WindowRules:
    """How long things are timed, and when a run that does not answer is stopped."""

    window_s: float = rule(0.5, "a timed window lasts at least this long, in whole steps (preset paired trials and "
                           "script trials alike): the kernel's CPU counters tick every 10 ms",
                           "stats/noise.py; hardware/contention.py MIN_READ_S")
    trial_seconds: float = rule(10.0, "the cap on a script trial's timed windows, doubled on a busy machine "
                                "(--trial-seconds)", "docs/scripts.md (saturate tune -- CMD)")
    first_step_timeout_s: float = rule(300.0, "a run of the user's command with no optimizer step within this is "
                                       "stopped (--first-step-timeout): a large model's first step can take minutes",
                                       "docs/scripts.md (saturate doctor -- CMD)")
    window_timeout_s: float = rule(300.0, "one window of steps this long means a paired run is stuck: it is stopped",
                                   "script/gated.py")
    loader_window_s: float = rule(0.05, "a loader trial's window lasts at least this long (and a few batches)",
                                  "tune/measure.py RealMeasurer.measure_loader")
    loader_min_s: float = rule(0.3, "a loader trial times at least this long before its windows may agree",
                               "tune/measure.py RealMeasurer.measure_loader")
    loader_max_batches: int = rule(2000, "a loader trial stops after this many batches, agreed or not",
                                   "tune/measure.py RealMeasurer.measure_loader")
    eval_batches: int = rule(3, "validation batches run once before a trial is timed, so the evaluation path is "
                             "built and its memory counted", "tune/measure.py")
    side_by_side_rounds: int = rule(3, "as written and tuned (naive and tuned), alternating: enough rounds for a "
                                    "median and a range, short beside a job", "docs/tuning.md (saturate run)")
    fresh_tries: int = rule(2, "fresh pairs of runs taken when a run ends before its pairs decide: a short script's "
                            "few pairs can fall across a burst (run_clm 8 x 1: 2 of 3 pairs uneven)",
                            "bench/results, 2026-11-29 (docs/results.md)")


@dataclass(frozen=True)
class StageRules:
    """When a tuning stage is worth running, and how far it searches."""

    input_share_min: float = rule(0.05, "below this share of its step waiting for data, a script's loader settings "
                                  "cannot gain much: its loader stage is not run", "script/host_stages.py")
    workers_per_core: int = rule(4, "a script's loader workers are tried up to this many per usable core (past the "
                                 "cores only while the best run still waits for data: 4 ms of I/O a sample ran 4x at "
                                 "8 workers on 2 cores)", "docs/scripts.md (saturate tune -- CMD)")
    worker_memory_share: float = rule(0.5, "loader workers are not tried when, each holding the training process's "
                                      "peak, they could use more than this share of the host memory available",
                                      "script/host_stages.py")
    prior_workers: int = rule(4, "the informed prior's loader workers on a GPU at most (from the cores each process "
                              "has, one kept for training): enough to feed a step without a measurement",
                              "saturate/prior.py; docs/tuning.md")
    prior_cpu_workers: int = rule(2, "the informed prior's workers on a CPU where a trial saw the step wait for data "
                                  "(a job too short to tune): a core each, taken from the step",
                                  "script/short_job.py; docs/scripts.md")
    bound_margin: float = rule(2.0, "a stage is skipped when its phase's share of the step is under the minimum "
                               "gain divided by this (the most it could gain, with room for the share's error)",
                               "tune/bound.py")
    chunk_memory_gain: float = rule(0.10, "the chunked loss, within noise on speed, is kept when it measures this "
                                    "much less peak memory (memory a larger micro-batch can use)", "tune/search.py")
    gpu_share: int = rule(8, "on a GPU, a script's trials are paired (two runs alive) only when the script as "
                          "written used at most 1/this of the device's memory: a candidate may need several times "
                          "as much", "script/gated.py can_gate")


@dataclass(frozen=True)
class Policy:
    """The whole policy: one tree, frozen. `POLICY` (saturate.policy) is the one in force."""

    load: LoadRules = field(default_factory=LoadRules)
    gains: GainRules = field(default_factory=GainRules)
    windows: WindowRules = field(default_factory=WindowRules)
    stages: StageRules = field(default_factory=StageRules)
    doctor: DoctorRules = field(default_factory=DoctorRules)
    payback: PaybackRules = field(default_factory=PaybackRules)
    job: JobRules = field(default_factory=JobRules)
    same: SameRules = field(default_factory=SameRules)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}}, as written into tune.json."""
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def replaced(self, changes: dict[str, dict[str, Any]]) -> Policy:
        """This policy with `changes` ({section: {field: value}}) made; an unknown section or field, or a value of
        another type, raises ValueError naming it."""
        sections = {s.name: getattr(self, s.name) for s in dataclasses.fields(self)}
        for name, values in changes.items():
            if name not in sections:
                raise ValueError(f"unknown policy section {name!r}; known: {', '.join(sections)}")
            if not isinstance(values, dict):
                raise ValueError(f"policy section {name!r} must be a table of fields")
            known = {f.name: f for f in dataclasses.fields(sections[name])}
            for key, value in values.items():
                if key not in known:
                    raise ValueError(f"unknown policy field {name}.{key}; known: {', '.join(known)}")
                default = getattr(sections[name], key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                        isinstance(default, int) and not isinstance(default, bool) and not isinstance(value, int)):
                    raise ValueError(f"policy field {name}.{key} must be a {type(default).__name__}, not {value!r}")
            sections[name] = dataclasses.replace(sections[name], **values)
        return Policy(**sections)


def reasons(policy: Policy) -> dict[str, dict[str, str]]:
    """{section: {field: "why (see: where)"}}: the policy's reasons, for the docs and a reader of tune.json."""
    out: dict[str, dict[str, str]] = {}
    for s in dataclasses.fields(policy):
        section = getattr(policy, s.name)
        out[s.name] = {f.name: f.metadata["why"] + (f" (see: {f.metadata['see']})" if f.metadata.get("see") else "")
                       for f in dataclasses.fields(section)}
    return out
