"""The Plan: how to train a workload fast, as one validated dataclass saved as TOML.

A Plan never changes what is learned (the workload owns model, data, effective batch and
learning rate); it changes how the work is laid on the hardware. The one exception is
numerical precision, which the tuner only accepts after comparing losses against fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from saturate.atomic import atomic_write_bytes
from saturate.errors import ConfigError, did_you_mean, unknown_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STRATEGIES = ("single", "ddp", "fsdp")



def read_toml(path: Path, what: str, missing: str = "does not exist") -> dict[str, Any]:
    """A TOML file's tables; ConfigError naming `what` when it is missing (`what missing`), unreadable or not TOML."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {missing}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} is not valid TOML: {e}") from None

LOADER_FIELDS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "non_blocking")


@dataclass(repr=False)
class Plan:
    """Every speed knob saturate turns. Effective batch = micro_batch × grad_accum × processes."""

    micro_batch: int = 8  # samples per forward/backward on one device
    grad_accum: int = 1  # micro-steps per optimizer step
    num_workers: int = 0  # DataLoader worker processes (0 = load in the training process)
    prefetch_factor: int | None = None  # batches each worker keeps ready; only with workers > 0
    pin_memory: bool = False  # page-locked host batches so copies to the GPU can overlap compute
    persistent_workers: bool = False  # keep workers alive between loader restarts (validation)
    non_blocking: bool = False  # asynchronous host-to-device copies (needs pin_memory to help)
    precision: str = "fp32"  # "fp32", "bf16" (autocast) or "fp16" (autocast + GradScaler)
    tf32: bool = False  # allow TF32 tensor cores for fp32 matmuls/convolutions (Ampere and later)
    compile: str = "none"  # torch.compile mode, or "none" for eager
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    fused_optimizer: bool = False  # fused AdamW kernel where the device supports it
    strategy: str = "single"  # "single" process; "ddp" (replicas) or "fsdp" (FSDP2 shards) under torchrun
    cpu_offload: bool = False  # FSDP only: sharded parameters, gradients and optimizer state live in host RAM
    threads: int | None = None  # torch intra-op threads (CPU work); None: the process's own count (torch: one per core)
    name: str = ""  # a label for reports ("naive", "a6000-after", "tuned", ...)
    provenance: dict[str, Any] = field(default_factory=dict)  # where the plan came from (free-form)

    def __post_init__(self) -> None:
        _check_type(self)
        for name in ("micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ConfigError(f"plan.num_workers must be >= 0, got {self.num_workers}")
        if self.prefetch_factor is not None:
            if self.prefetch_factor < 1:
                raise ConfigError(f"plan.prefetch_factor must be >= 1, got {self.prefetch_factor}")
            if self.num_workers == 0:
                raise ConfigError("plan.prefetch_factor needs plan.num_workers > 0 (got num_workers = 0)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"plan.threads must be >= 1, got {self.threads}")
        if self.persistent_workers and self.num_workers == 0:
            raise ConfigError("plan.persistent_workers needs plan.num_workers > 0")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("compile", self.compile, COMPILE_MODES)
        _check_choice("strategy", self.strategy, STRATEGIES)
        if self.cpu_offload and self.strategy != "fsdp":
            raise ConfigError(f"plan.cpu_offload needs plan.strategy = 'fsdp' (got {self.strategy!r})")

    def __repr__(self) -> str:
        """One line, valid Python: the name, the split, and only the settings that differ from the defaults
        (the provenance is left out; `to_dict()` has everything)."""
        shown = ("provenance", "name", "micro_batch", "grad_accum")  # said otherwise, or not at all
        rest = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(Plan)
                if f.name not in shown and getattr(self, f.name) != f.default]
        name = f"name={self.name!r}, " if self.name else ""
        return (f"Plan({name}micro_batch={self.micro_batch}, grad_accum={self.grad_accum}"
                + "".join(f", {r}" for r in rest) + ")")

    __str__ = __repr__

    def samples_per_step(self, world_size: int = 1) -> int:
        """The effective (global) batch this plan trains with, in samples."""
        return self.micro_batch * self.grad_accum * world_size

    def knobs(self) -> tuple[Any, ...]:
        """What this plan sets other than its loader, name and provenance: two plans with the same knobs train the
        same model code at the same speed but for their input pipeline."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in (*LOADER_FIELDS, "name",
                                                                                              "provenance"))

    def replace(self, **changes: Any) -> Plan:
        """A copy with `changes`; the copy never shares its provenance dict with this plan."""
        changes.setdefault("provenance", copy.deepcopy(self.provenance))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("prefetch_factor", "threads"):
            if out[key] is None:
                del out[key]  # TOML has no null
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: " + unknown_name("key", unknown[0], sorted(known)))
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as TOML atomically (temporary name, then rename)."""
        try:
            text = tomli_w.dumps(self.to_dict())
        except TypeError as e:  # only provenance is free-form enough to hold a non-TOML value
            raise ConfigError(f"plan.provenance cannot be written as TOML: {e}") from None
        atomic_write_bytes(path, text.encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        path = Path(path)
        data = read_toml(path, f"plan file {path}", "does not exist")
        if "plan" in data and isinstance(data["plan"], dict) and len(data) == 1:
            data = data["plan"]  # accept a [plan] table as well as top-level keys
        return cls.from_dict(data, source=str(path))


def _check_type(plan: Plan) -> None:
    hints = {"int": int, "bool": bool, "str": str}
    for f in fields(plan):
        value = getattr(plan, f.name)
        annotation = str(f.type)
        if annotation == "int | None":
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif annotation in hints:
            want = hints[annotation]
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        else:
            ok = isinstance(value, dict)
        if not ok:
            raise ConfigError(f"plan.{f.name} must be {annotation}, got {type(value).__name__} {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"plan.{name} must be one of {', '.join(choices)}; got {value!r}")


# The reference plans. "naive" is what a first script does; the others are the guides'
# hand-tuned before/after settings (shared/GUIDES.md), carried so every report can compare.
REFERENCE_PLANS: dict[str, Plan] = {
    "naive": Plan(name="naive", micro_batch=8, grad_accum=1),
    "a6000-before": Plan(name="a6000-before", micro_batch=12, grad_accum=10),
    "a6000-after": Plan(
        name="a6000-after", micro_batch=32, grad_accum=4, num_workers=8, prefetch_factor=4,
        pin_memory=True, persistent_workers=True, non_blocking=True, precision="fp16",
    ),
    "three-gpu-before": Plan(name="three-gpu-before", micro_batch=16, grad_accum=8, num_workers=4, strategy="ddp"),
    "three-gpu-after": Plan(
        name="three-gpu-after", micro_batch=32, grad_accum=2, num_workers=8, prefetch_factor=2,
        pin_memory=True, persistent_workers=True, non_blocking=True, strategy="ddp",
    ),
    "rocm-before": Plan(name="rocm-before", micro_batch=8, grad_accum=1),
    "rocm-after": Plan(
        name="rocm-after", micro_batch=32, grad_accum=4, num_workers=4, prefetch_factor=2,
        pin_memory=True, non_blocking=True,
    ),
    "timeseries-before": Plan(name="timeseries-before", micro_batch=128, grad_accum=1, num_workers=4),
    "timeseries-after": Plan(
        name="timeseries-after", micro_batch=256, grad_accum=1, num_workers=8, prefetch_factor=4,
        pin_memory=True, persistent_workers=True, non_blocking=True, tf32=True, compile="max-autotune",
    ),
}


def reference_plan(name: str) -> Plan:
    try:
        return REFERENCE_PLANS[name].replace()
    except KeyError:
        raise ConfigError(unknown_name("reference plan", name, REFERENCE_PLANS)) from None


def default_plan(effective_batch: int, device_type: str, supports: dict[str, bool], world_size: int = 1) -> Plan:
    """The untuned starting plan `train` uses when given none: sensible, not measured.

    Keeps the workload's effective batch, global over `world_size` processes (DDP then; when the
    batch does not divide among them, the nearest per-process share); bf16 where the device has it
    natively; on CUDA, TF32, pinned memory with non-blocking copies and the fused optimizer.
    `saturate tune` replaces it with a measured plan.
    """
    per_rank = max(1, round(effective_batch / world_size))
    cap = 8 if device_type == "cpu" else 16
    micro = max(d for d in range(1, min(cap, per_rank) + 1) if per_rank % d == 0)
    gpu = device_type in ("cuda", "rocm")
    return Plan(
        name="default",
        micro_batch=micro,
        grad_accum=per_rank // micro,
        strategy="ddp" if world_size > 1 else "single",
        precision="bf16" if supports.get("bf16") and gpu else "fp32",
        tf32=bool(supports.get("tf32")),
        pin_memory=gpu,
        non_blocking=gpu,
        fused_optimizer=gpu,
    )


def fit_to_world(plan: Plan, effective_batch: int, world_size: int) -> Plan:
    """The plan with its accumulation re-derived so micro_batch × grad_accum × world_size = effective_batch.

    How one plan keeps its optimisation at another process count (a resume on more or fewer
    GPUs). Raises ConfigError, naming the numbers, when the effective batch does not divide.
    """
    per_step = plan.micro_batch * world_size
    if effective_batch % per_step:
        raise ConfigError(f"effective batch {effective_batch} does not split into micro-batch {plan.micro_batch} × "
                          f"{world_size} process(es) × a whole accumulation count; choose a micro_batch that "
                          f"divides {effective_batch} // {world_size}")
    accum = effective_batch // per_step
    return plan if accum == plan.grad_accum else plan.replace(grad_accum=accum)


def resolve_plan(spec: str) -> Plan:
    """A plan from a TOML file path, or a reference plan by name (a file of that name wins)."""
    if Path(spec).exists() or spec.endswith(".toml"):
        return Plan.load(spec)  # a missing .toml file gets "does not exist"
    if spec in REFERENCE_PLANS:
        return reference_plan(spec)
    raise ConfigError(f"plan {spec!r} is neither a file nor a reference plan{did_you_mean(spec, REFERENCE_PLANS)}; "
                      f"reference plans: {', '.join(REFERENCE_PLANS)}")
