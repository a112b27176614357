"""The doctor's vocabulary: the verdicts (their thresholds: POLICY.doctor), what a run measured, and what the rules
return.

Measurements (with the batch-scaling probe) go into `decide` (rules.py); a Diagnosis comes out: a
verdict, its evidence and Fixes, each with a Prediction that says how it was made. Plain data, no
machine access.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from saturate.policy import POLICY
from saturate.stats.noise import trimmed
from saturate.telemetry import Stat

VERDICTS = {
    "oom-risk": "at risk of OOM",
    "host-memory-bound": "host-memory-bound",
    "input-bound": "input-bound",
    "sync-bound": "synchronisation-bound",
    "overhead-bound": "launch/overhead-bound",
    "device-memory-underused": "device memory under-used",
    "own-code-bound": "bound by its own code (outside the phases saturate times)",
    "compute-bound": "compute-bound (healthy)",
    # Other processes kept our cores (or GPU) busy while we measured: the timings say more about the
    # neighbours than about the workload, so no verdict blames it (hardware.contention).
    "contended": "contended (other processes were using this machine)",
}


@dataclass
class ScalingProbe:
    """Forward+backward time (and device memory) of one micro-step at two micro-batch sizes."""

    micro_batches: tuple[int, int]
    seconds: tuple[float, float]
    peak_memory: tuple[int | None, int | None] = (None, None)  # device bytes; None on the CPU
    # Relative spread of each timing over its repeats ((slowest - fastest) / fastest); `seconds` are the fastest.
    spread: tuple[float, float] = (0.0, 0.0)
    # Per round, the large size's time ÷ the small one's, the two timed back to back (the same load on both): the
    # fixed share rests on these when there are POLICY.doctor.min_rounds or more (`fixed_share_range`), since a burst
    # of load that spans a round moves both of its timings alike.
    ratios: tuple[float, ...] = ()

    @property
    def per_sample_s(self) -> float:
        (b1, b2), (t1, t2) = self.micro_batches, self.seconds
        return max(0.0, (t2 - t1) / (b2 - b1))

    @property
    def fixed_s(self) -> float:
        """The part of a micro-step that does not grow with the batch (launches, Python, framework)."""
        return max(0.0, self.seconds[0] - self.per_sample_s * self.micro_batches[0])

    def time_at(self, b: int) -> float:
        return self.fixed_s + self.per_sample_s * b

    def fixed_share(self, b: int) -> float:
        t = self.time_at(b)
        return self.fixed_s / t if t > 0 else 0.0

    def fixed_share_range(self, b: int) -> tuple[float, float]:
        """The lowest and highest fixed share the timings allow: over the rounds' ratios (`kept_ratios`) when
        there are `POLICY.doctor.min_rounds` or more, else within the two timings' spreads.

        A slower small micro-batch (or a faster large one) means a larger fixed part, and the other
        way round; a verdict is only called when the whole range is on one side of its threshold.
        """
        if len(self.ratios) >= POLICY.doctor.min_rounds:
            kept = self.kept_ratios()
            shares = [ScalingProbe(self.micro_batches, (1.0, r)).fixed_share(b) for r in (kept[0], kept[-1])]
            return min(shares + [self.fixed_share(b)]), max(shares + [self.fixed_share(b)])
        (t1, t2), (s1, s2) = self.seconds, self.spread
        shares = [ScalingProbe(self.micro_batches, times).fixed_share(b)
                  for times in ((t1, t2 * (1 + s2)), (t1 * (1 + s1), t2))]
        return min(shares + [self.fixed_share(b)]), max(shares + [self.fixed_share(b)])

    def kept_ratios(self) -> list[float]:
        """The rounds' ratios the fixed share rests on, sorted and trimmed as stats.noise trims a spread."""
        return trimmed(list(self.ratios))

    def memory_at(self, b: int) -> float | None:
        (b1, b2), (m1, m2) = self.micro_batches, self.peak_memory
        if m1 is None or m2 is None:
            return None
        slope = max(0.0, (m2 - m1) / (b2 - b1))
        return m1 + slope * (b - b1)


@dataclass
class Measurements:
    """Everything one instrumented stretch of training measured. None = not measured (see notes)."""

    device_type: str  # "cpu", "cuda", "rocm", "mps"
    device_name: str
    timing: str  # how phases were timed
    steps: int  # optimizer steps timed
    step_s: float  # wall seconds per optimizer step over the timed window
    phases: dict[str, float]  # seconds per step by phase (sums to about step_s)
    # The timed steps in windows of equal step counts (doctor.phase_windows): each window's share of the step by
    # phase, and its mean device utilisation (accelerators, percent). A figure's range is over these windows
    # (trimmed of the extremes from five on, as stats.noise does); with none, a figure is a single value.
    window_shares: list[dict[str, float]] = field(default_factory=list)
    window_util: list[float] = field(default_factory=list)
    step_spread: float | None = None  # relative half-range of the windows' step rates (stats.noise.summarize)
    context: str = "plan"  # "plan" (a saturate preset) or "loop" (a user's own loop)
    samples_per_step: float | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None  # micro-steps (loader batches) per optimizer step
    num_workers: int | None = None
    prefetch_factor: int | None = None
    pin_memory: bool | None = None
    non_blocking: bool | None = None
    precision: str | None = None
    compile: str | None = None
    supports_bf16: bool | None = None
    syncs_per_step: float | None = None
    syncs_each_step: list[float] = field(default_factory=list)  # the count of every counted step
    syncs_by_phase: dict[str, float] = field(default_factory=dict)
    syncs_by_site: dict[str, float] = field(default_factory=dict)  # `file.py:line` in a script → syncs per step
    # a line that reads every N steps, counted over the timed steps: line → (timed steps that read, timed steps)
    syncs_seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    sync_method: str = ""
    sync_missing: str | None = None
    device_util: Stat = field(default_factory=lambda: Stat(missing="not sampled"))  # percent
    device_mem_peak: int | None = None  # bytes the process reserved on the device at peak (torch)
    device_mem_total: int | None = None
    device_mem_used_peak: int | None = None  # NVML/AMD SMI: all processes on the device
    host_ram_total: int | None = None
    host_ram_available_min: int | None = None
    host_cpu: Stat = field(default_factory=lambda: Stat(missing="not sampled"))  # percent of all cores
    swap_bytes: int | None = None  # swapped in + out during the window
    swap_missing: str | None = None
    tree_peak: int | None = None  # the training process + workers at peak
    main_peak: int | None = None
    worker_peak: int | None = None  # the largest single worker's own memory at peak
    workers_seen: int = 0
    memory_kind: str = "pss"
    host_budget: int | None = None
    host_budget_source: str = ""
    data_cpu_share: float | None = None  # main-thread CPU time ÷ wall time while waiting for data
    item_s: float | None = None  # seconds per extra sample of a batch read and collated in the training process
    cpu_cores: int = 1
    cpu_threads: int | None = None  # torch intra-op threads of the training process
    scaling: ScalingProbe | None = None
    # The probe again on one intra-op thread: taken on a CPU run with several when the machine was busy (busy.py)
    scaling_one_thread: ScalingProbe | None = None
    # With it, per round: a micro-step's forward+backward on `cpu_threads` threads ÷ on one, timed back to back
    threads_ratios: tuple[float, ...] = ()
    # What other processes used while we measured (hardware.contention.Contention.to_dict() plus its "line")
    contention: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # The steps traced after the timed ones (doctor/trace.py TraceFiles.to_dict()): no figure above comes from them
    trace: dict[str, Any] | None = None

    @property
    def accelerator(self) -> bool:
        return self.device_type in ("cuda", "rocm", "mps")

    def share(self, *phases: str) -> float:
        return sum(self.phases.get(p, 0.0) for p in phases) / self.step_s if self.step_s > 0 else 0.0

    def share_range(self, *phases: str) -> tuple[float, float]:
        """The lowest and highest share of the step these phases took over the timed windows (trimmed), widened to
        hold the share over the whole stretch; without windows, that share twice."""
        whole = self.share(*phases)
        values = trimmed([sum(w.get(p, 0.0) for p in phases) for w in self.window_shares])
        return (min(values[0], whole), max(values[-1], whole)) if values else (whole, whole)

    def idle_range(self) -> tuple[float, float] | None:
        """The device's idle share (1 − utilisation) over the windows (trimmed), or over the samples' mean alone;
        None when utilisation was not measured."""
        values = trimmed([1 - u / 100 for u in self.window_util])
        if values:
            return values[0], values[-1]
        return None if self.device_util.mean is None else (1 - self.device_util.mean / 100,) * 2

    def syncs_range(self) -> tuple[float, float] | None:
        """The fewest and most synchronisations of a counted step; None when they were not counted."""
        if self.syncs_each_step:
            return min(self.syncs_each_step), max(self.syncs_each_step)
        return None if self.syncs_per_step is None else (self.syncs_per_step, self.syncs_per_step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurements:
        """The inverse of `to_dict` (measurements taken in another process, e.g. a user's script)."""
        d = dict(d)
        for name in ("device_util", "host_cpu"):
            if isinstance(d.get(name), dict):
                d[name] = Stat(**d[name])
        for name in ("scaling", "scaling_one_thread"):
            if isinstance(s := d.get(name), dict):
                d[name] = ScalingProbe(tuple(s["micro_batches"]), tuple(s["seconds"]), tuple(s["peak_memory"]),
                                       tuple(s.get("spread", (0.0, 0.0))), tuple(s.get("ratios", ())))
        d["threads_ratios"] = tuple(d.get("threads_ratios") or ())
        d["syncs_seen"] = {k: tuple(v) for k, v in (d.get("syncs_seen") or {}).items()}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Prediction:
    """A predicted figure after a fix. `after` None: no model predicts it ("not predicted")."""

    metric: str  # "step_s", "sample_s" (seconds per sample), "host_bytes" or "device_bytes"
    before: float
    after: float | None
    basis: str  # how the prediction was made

    @property
    def gain(self) -> float | None:
        """Speed-up (step_s) or reduction factor (memory): before ÷ after; > 1 is better."""
        if self.after is None or self.after <= 0:
            return None
        return self.before / self.after


@dataclass
class Fix:
    title: str
    changes: dict[str, Any]  # plan fields to change; empty for a change to the user's code
    prediction: Prediction
    why: str
    same_training: bool = True  # False: the fix changes what is learned (e.g. the effective batch)


@dataclass
class Finding:
    verdict: str  # a VERDICTS key, or "note" for something worth saying that is no verdict
    evidence: list[str]
    fixes: list[Fix] = field(default_factory=list)


@dataclass
class Diagnosis:
    verdict: str  # a VERDICTS key
    evidence: list[str]
    fixes: list[Fix]  # ranked: the verdict's fixes by predicted gain, then the other findings'
    findings: list[Finding]  # every rule that held, the verdict's first, plus notes
    measurements: Measurements

    @property
    def label(self) -> str:
        return VERDICTS[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["label"] = self.label
        for fix in out["fixes"]:
            p = fix["prediction"]
            p["gain"] = None if p["after"] in (None, 0) else p["before"] / p["after"]
        return out


def sites_line(sites: dict[str, float], most: int = 3, seen: dict[str, tuple[int, int]] | None = None) -> str:
    """`train.py:323 (1 per step), …` — the lines that synchronise, most first; a line read every N steps says in
    how many of the timed steps (`seen`)."""
    seen = seen or {}
    shown = [f"{k} ({round(v, 2):g} per step" + (f": in {seen[k][0]} of {seen[k][1]} timed steps)" if k in seen
                                                 else ")") for k, v in list(sites.items())[:most]]
    return ", ".join(shown) + (f" and {len(sites) - most} more lines" if len(sites) > most else "")
