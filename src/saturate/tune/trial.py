"""What the tuner's search is made of: one trial of a plan, one trial of a loader setting.

`Measurer` is the interface the search sees (`RealMeasurer` in measure.py runs real steps; tests
provide a deterministic fake); `is_oom` and `first_line` turn an error into a trial's status and
message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from saturate.engine.step import OutOfMemoryError
from saturate.errors import ConfigError
from saturate.plan import Plan


@dataclass
class Trial:
    """One measured plan. `status` is "ok", "oom", "failed", "timeout" (compilation stopped) or OVER_BUDGET
    (stopped after its first step: predicted to end past the tuning budget); figures are None when not measured."""

    stage: str  # what the trial was for: "precision", "memory", "micro-batch", "compile", "verify", …
    plan: Plan
    status: str = "ok"
    samples_per_s: float | None = None  # the median over timed windows (stats/noise.py)
    step_s: float | None = None  # seconds per optimizer step (the effective batch), at the median rate
    spread: float | None = None  # relative half-range of the windows: samples/s is known to ± this share
    windows: int = 0  # timed windows
    window_samples_per_s: list[float] = field(default_factory=list)  # each window's throughput
    busy_cores: float | None = None  # mean CPU cores other processes kept busy during the trial
    contended: bool = False  # other processes used enough of the machine to move the figure
    peak_memory_bytes: int | None = None
    compile_s: float | None = None  # torch.compile plus its first micro-batch, when compiled
    losses: list[float] = field(default_factory=list)  # per-step training loss (same batches for every plan)
    loss_drift: float | None = None  # largest per-step difference from fp32's losses (search.loss_drift)
    seconds: float = 0.0  # wall time the trial cost, building included
    steps: int = 0  # timed optimizer steps
    error: str = ""  # the first line of the error, for "oom" and "failed"
    verdict: str = ""  # set by the search: "chosen", or why it lost
    paired: bool = False  # timed in alternating windows with another plan (paired.py), not alone
    optimizer_share: float | None = None  # of the timed steps' time, in the optimizer step (bound.py)
    decision: dict[str, Any] | None = None  # the judge's on this trial against the incumbent (policy.judge)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        out: dict[str, Any] = {
            "stage": self.stage, "status": self.status, "micro_batch": p.micro_batch, "grad_accum": p.grad_accum,
            "precision": p.precision, "tf32": p.tf32, "compile": p.compile,
            "activation_checkpointing": p.activation_checkpointing, "fused_optimizer": p.fused_optimizer,
            "strategy": p.strategy, "cpu_offload": p.cpu_offload, "threads": p.threads,
            "loss_chunk": p.loss_chunk, "attention": p.attention,
            "samples_per_s": self.samples_per_s,
            "step_s": self.step_s, "peak_memory_bytes": self.peak_memory_bytes,
            "spread": self.spread, "windows": self.windows or None,
            "window_samples_per_s": [round(r, 3) for r in self.window_samples_per_s] or None,
            "busy_cores": None if self.busy_cores is None else round(self.busy_cores, 2),
            "contended": self.contended or None,
            "compile_s": self.compile_s, "losses": self.losses or None, "loss_drift": self.loss_drift,
            "seconds": round(self.seconds, 3),
            "steps": self.steps, "error": self.error or None, "verdict": self.verdict or None,
            "paired": self.paired or None,
            "optimizer_share": None if self.optimizer_share is None else round(self.optimizer_share, 4),
            "decision": self.decision,
        }
        return {k: v for k, v in out.items() if v is not None}  # TOML has no null


@dataclass
class LoaderTrial:
    """The DataLoader alone at one setting: sustained samples/s and the host memory its workers add."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    samples_per_s: float | None = None  # the median over timed windows (stats/noise.py)
    spread: float | None = None  # relative half-range of the windows
    windows: int = 0
    worker_memory_bytes: int | None = None  # unique memory (USS) of all workers together
    startup_s: float | None = None  # until the first batch arrived
    swap_grew_bytes: int = 0
    status: str = "ok"
    error: str = ""
    seconds: float = 0.0
    verdict: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("num_workers", "prefetch_factor", "pin_memory", "samples_per_s", "spread",
                                             "windows", "worker_memory_bytes", "startup_s", "swap_grew_bytes", "status",
                                             "error", "seconds", "verdict")}
        return {k: v for k, v in out.items() if v not in (None, "")}


class Measurer(Protocol):
    """What the search needs from the machine; tests provide a deterministic fake."""

    device_type: str  # "cuda", "cpu", …
    memory_capacity: int  # bytes a plan may use (device memory on a GPU, available host RAM on a CPU)
    memory_kind: str  # "device" or "host RSS"
    ram_budget: int  # bytes of host RAM the loader's workers may add
    cores: int  # usable CPU cores

    def model_trial(self, plan: Plan, stage: str, *, steps: int | None = None,
                    compile_limit_s: float | None = None) -> Trial: ...

    def loader_trial(self, plan: Plan) -> LoaderTrial: ...

    def verify(self, plan: Plan) -> Trial: ...

    def all_agree(self, flag: bool) -> bool:
        """True when `flag` is true on every process (the identity in one process)."""
        ...

    def discard_compiled(self) -> None:
        """Leave nothing of the last compile trial running or cached (the search rejected it)."""
        ...


OVER_BUDGET = "over budget"  # a trial's status when its first step predicted it would end past the budget


class OverBudget(Exception):
    """Raised inside a trial whose first step predicts it would end past the tuning budget's deadline."""


class BudgetTooSmall(ConfigError):
    """The tuning budget does not hold one trial (`trials`: what was measured before that was known)."""

    trials: list[Trial] = []  # noqa: RUF012 (set on the instance where raised)


def is_oom(e: BaseException) -> bool:
    """Device OOM, or the CPU allocator failing (`DefaultCPUAllocator: can't allocate memory`)."""
    return isinstance(e, OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__

