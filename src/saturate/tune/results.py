"""What the tuner's search takes and gives back: its settings, the memory fit, its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from saturate.hardware.contention import Contention
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.tune.trial import LoaderTrial, Trial

# loss_tolerance (POLICY.payback): a lower precision's first losses may differ from fp32's by this share of the loss's
# scale (the larger of fp32's loss at that step and its first loss: search.loss_drift); the same as training's guard.


CUDA_ATTENTION = ("cudnn", "flash", "efficient")  # the SDPA backends a CUDA tune measures (plan.attention)
CUDA_COMPILE_LADDER = ("reduce-overhead", "max-autotune")  # after compile "default" is kept, on one CUDA device


@dataclass
class SearchSettings:
    effective_batch: int  # the global batch the user asked for
    planned_steps: int  # optimizer steps the plan will train for (compile must pay back within them)
    supports: dict[str, bool] = field(default_factory=dict)  # native bf16 / fp16 / tf32
    fused_available: bool = False  # a fused AdamW kernel exists for this device
    # The workload's chunked loss: rows of logits per chunk, and rows per sample (tokens); None: no chunked loss.
    loss_chunk_rows: int | None = None
    rows_per_sample: int = 1
    # The SDPA backends measured against torch's own choice (plan.attention): on a CUDA device, for a workload
    # whose attention is SDPA; () for none.
    attention_backends: tuple[str, ...] = ()
    world_size: int = 1
    allow_batch_change: bool = False  # may the effective batch grow (learning rate rescaled)?
    budget_s: float | None = None  # tuning wall-clock budget
    # The budget may grow to this by what the search has found (`SearchState.earn`): half the saving predicted over
    # `training_s` (the untuned training, predicted) from its best trial over its first. None: a fixed budget.
    budget_cap_s: float | None = None
    training_s: float | None = None
    headroom: float = POLICY.job.headroom  # share of the memory capacity a plan may use
    min_gain: float = POLICY.gains.min_gain  # a change is taken only when it gains more than this, and the noise
    verify_tolerance: float = 0.10  # the verification may be this much below its plan's model trial (the loader)
    # The loader must feed this many times the model's rate, beyond both figures' noise (loader_stage.py).
    loader_margin: float = 1.2
    loss_tolerance: float = POLICY.job.loss_tolerance  # per-step loss difference against fp32 (search.loss_drift)
    try_compile: bool = True
    compile_mode: str = "default"
    # Modes tried after `compile_mode` is kept, each against the incumbent (CUDA graphs, then autotuned kernels):
    # on a CUDA device, one process (tune/api.py); () elsewhere.
    compile_ladder: tuple[str, ...] = ()
    compile_speedup_bound: float = 3.0  # the compile time limit assumes at most this speed-up
    # The only micro-batch tried (batch-coupled layers: it is part of the model's maths); None searches it.
    fixed_micro_batch: int | None = None
    # Verify the chosen plan here (real loader, a validation pass); False when the caller measures it again
    # anyway (saturate run's side-by-side): the budget then goes to the search's trials.
    verify: bool = True
    # Cores other processes kept busy just before the search (hardware/contention.py), when that was significant:
    # on a CPU the first trial then runs at the threads they left (start.py), and torch's count is measured after.
    busy_before: float | None = None

    def search_budget(self) -> float | None:
        """The budget less the time kept for writing the evidence at the end (plots, tune.json): 2 s + 3 %, at
        most 10 s."""
        return None if self.budget_s is None else self.budget_s - min(2.0 + 0.03 * self.budget_s, 10.0)


@dataclass
class MemoryFit:
    """Peak memory ≈ intercept + slope × micro-batch, fitted to measured points (least squares)."""

    points: list[tuple[int, int]]
    intercept: float
    slope: float
    limit: int  # bytes a plan may use: headroom × capacity
    capacity: int
    kind: str  # "device" or "host RSS"

    def predict(self, micro: int) -> float:
        return self.intercept + self.slope * micro

    def fits(self, micro: int) -> bool:
        return self.slope <= 0 or self.predict(micro) <= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {"points": [list(p) for p in self.points], "intercept": self.intercept, "slope": self.slope,
                "limit": self.limit, "capacity": self.capacity, "kind": self.kind}


@dataclass
class SearchResult:
    plan: Plan
    trials: list[Trial]
    loader_trials: list[LoaderTrial]
    fit: MemoryFit | None
    decisions: list[str]  # one line per knob: what was chosen and the measured reason
    seconds: float
    chosen: Trial  # the verification trial of `plan`
    skipped: list[str] = field(default_factory=list)  # what was not tried, and why
    warnings: list[str] = field(default_factory=list)  # what makes the result uncertain (said at the top)
    contention: Contention | None = None  # what other processes used of the machine during the search
    budget_s: float | None = None  # the budget at the end (`SearchSettings.budget_cap_s`: it may have grown)
    # Where the search started ("start") and why each knob of plan.INFORMED_KNOBS has its value: what the trials
    # measured, or the informed plan's own reason for a knob no trial measured (those named in `unmeasured`).
    choices: dict[str, str] = field(default_factory=dict)
    unmeasured: list[str] = field(default_factory=list)


def fit_memory(points: list[tuple[int, int]], capacity: int, headroom: float, kind: str) -> MemoryFit:
    xs = [float(m) for m, _ in points]
    ys = [float(b) for _, b in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    return MemoryFit(points=points, intercept=my - slope * mx, slope=slope, limit=int(capacity * headroom),
                     capacity=capacity, kind=kind)
