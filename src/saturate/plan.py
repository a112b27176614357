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
from saturate.prior import informed_workers
from saturate.provenance import KEY, Origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STRATEGIES = ("single", "ddp", "fsdp")
ATTENTION_BACKENDS = ("flash", "efficient", "cudnn", "math")  # torch.nn.attention.SDPBackend, by name



def read_toml(path: Path, what: str, missing: str = "does not exist") -> dict[str, Any]:
    """A TOML file's tables; ConfigError naming `what` when it is missing (`what missing`), unreadable or not TOML."""
    try:
        text = Path(path).read_text()
        return tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{what} {missing}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} is not valid TOML: {_duplicate_key(text, str(e)) or e}") from None


def _duplicate_key(text: str, error: str) -> str | None:
    """For tomllib's "Cannot overwrite a value (at line 3, column 16)" (a key given twice), a line naming the key
    and where it is given again; None for any other error, or a line this cannot read a key from."""
    import re

    where = re.search(r"\(at line (\d+), column \d+\)", error)
    if not where or not ("Cannot overwrite" in error or "twice" in error):
        return None
    lines = text.splitlines()
    n = int(where.group(1))
    if not 1 <= n <= len(lines):
        return None
    header = re.compile(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    if m := header.match(lines[n - 1]):
        key = m.group(1)
    elif m := re.match(r"\s*([^=#]+?)\s*=", lines[n - 1]):
        table = next((h.group(1) for line in reversed(lines[:n - 1]) if (h := header.match(line))), None)
        key = f"{table}.{m.group(1)}" if table else m.group(1)
    else:
        return None
    return f"key {key!r} is given twice (again on line {n})"

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
    # A language model's linear + cross-entropy over this many rows of logits at a time (workloads/chunked_loss.py):
    # the (tokens × vocabulary) logits never exist whole. None: the plain loss. Workloads that support it only.
    loss_chunk: int | None = None
    attention: str | None = None  # the SDPA backend (ATTENTION_BACKENDS) forwards run under; None: torch's choice
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
        if self.loss_chunk is not None and self.loss_chunk < 1:
            raise ConfigError(f"plan.loss_chunk must be >= 1, got {self.loss_chunk}")
        if self.persistent_workers and self.num_workers == 0:
            raise ConfigError("plan.persistent_workers needs plan.num_workers > 0")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("compile", self.compile, COMPILE_MODES)
        _check_choice("strategy", self.strategy, STRATEGIES)
        if self.attention is not None:
            _check_choice("attention", self.attention, ATTENTION_BACKENDS)
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
        for key in ("prefetch_factor", "threads", "loss_chunk", "attention"):
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
        elif annotation == "str | None":
            ok = value is None or isinstance(value, str)
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


# How every choice of the default plan is labelled (its provenance, the output, the JSON): an expert's pick from
# the probed hardware, before any trial. A guard that measured it (run/flow.py) adds its own words after.
INFORMED = "chosen from the hardware, not measured"
# The knobs the default plan chooses, in the order its provenance and the output say them.
INFORMED_KNOBS = ("precision", "tf32", "fused_optimizer", "micro_batch", "loader")
# In bf16 on a CPU the default micro-batch may be 16 when 16 samples hold at most this many tokens (`default_plan`).
CPU_BF16_TOKENS = 2048


def default_plan(effective_batch: int, device_type: str, supports: dict[str, bool], world_size: int = 1, *,
                 cores: int | None = None, fused_optimizer: bool | None = None,
                 memory_cap: tuple[int, str] | None = None, tokens_per_sample: int | None = None) -> Plan:
    """The informed starting plan: what an expert would pick from the probed hardware alone, before any trial.

    Where saturate does not measure (`train` without a plan, a job too short to tune, the doctor's seed
    plan) it trains this, never naive (naive stays the "before"). Each choice is said, with why, in
    `provenance` (`INFORMED_KNOBS`), labelled `INFORMED`:

    - the effective batch is kept, global over `world_size` processes (DDP then; when the batch does not
      divide among them, the nearest per-process share);
    - precision: bf16 where the device runs it natively (`supports["bf16"]`: bf16 tensor cores on a GPU; on a
      CPU, AMX, AVX-512 BF16 or Arm BF16 — hardware/cpu.py — and never on an AVX2-only CPU, where torch
      emulates bf16 slower than fp32); fp32 elsewhere (fp16 needs a GradScaler and a loss check: the tuner's);
      TF32 matmuls where the device has TF32 tensor cores (Ampere and later);
    - the fused AdamW kernel where it exists (`fused_optimizer`: the caller's check on the device; None: on a
      GPU only);
    - the micro-batch: the largest divisor of the per-process batch up to 8 on a CPU, 16 on a GPU (no memory
      model predicts without a measured peak; a GPU step that runs out of memory halves it: engine/step.py; on a
      GPU the first steps' measured peak then grows it: engine/grow.py);
      with `memory_cap` (the largest micro-batch a measured peak predicts to fit, and the line that says how),
      within it instead on a GPU, and within both on a CPU — a CPU gains nothing from a micro-batch beyond
      what fills its cores, and larger ones ran slower (measured: bench/results/cpu-2026-11-26f/README.md),
      so memory only lowers it. In bf16 on a CPU, for samples of `tokens_per_sample` tokens where 16 of them
      hold at most `CPU_BF16_TOKENS`, up to 16: the native bf16 matmuls run ~2× fp32's and want more rows to
      stay busy (16 × 2 never slower than 8 × 4, 32 × 1 mixed; measured:
      bench/results/cpu-2026-11-27g/README.md);
    - the loader: on a GPU, workers from the `cores` each process has, one kept for the training process (at
      most 4), pinned memory and non-blocking copies; elsewhere none (the step uses every core).

    `saturate tune` replaces it with a measured plan.
    """
    per_rank = max(1, round(effective_batch / world_size))
    gpu = device_type in ("cuda", "rocm")
    why: dict[str, str] = {}
    precision = "bf16" if supports.get("bf16") and device_type in ("cuda", "rocm", "cpu") else "fp32"
    if precision == "bf16":
        why["precision"] = ("bf16: the GPU has bf16 tensor cores" if gpu else
                            "bf16: the CPU has native bf16 matmul instructions (AMX, AVX-512 BF16 or Arm BF16)")
    elif device_type == "mps":
        why["precision"] = "fp32: bf16 on an Apple GPU is not known to be faster (the tuner measures it)"
    elif gpu and supports.get("fp16"):
        why["precision"] = "fp32: no bf16 tensor cores; fp16 needs a GradScaler and a loss check (the tuner's)"
    else:
        why["precision"] = "fp32: no native bf16 here (a lower precision would be emulated, slower than fp32)"
    tf32 = bool(supports.get("tf32"))
    why["tf32"] = ("on: TF32 tensor cores (Ampere or later) for fp32 matmuls" if tf32 else
                   "off: no TF32 tensor cores")
    fused = gpu if fused_optimizer is None else fused_optimizer
    why["fused_optimizer"] = ("on: a fused AdamW kernel exists on this device" if fused else
                              "off: no fused AdamW kernel on this device")
    cap = 8 if device_type == "cpu" else 16
    short = tokens_per_sample is not None and 1 < tokens_per_sample <= CPU_BF16_TOKENS // 16  # tokens, not rows
    if device_type == "cpu" and precision == "bf16" and short:
        cap = 16
    cpu_rule = (f"up to 16 on a CPU in bf16 for samples of {tokens_per_sample} tokens (bf16's faster matmuls want "
                "more rows)" if cap == 16 else "up to 8 on a CPU (a larger one does not run faster there)")
    if memory_cap is not None and device_type == "cpu":
        fit = max(1, memory_cap[0])
        cap = min(cap, fit)
        rule = (f"the largest that divides the per-process batch {per_rank} {cpu_rule}, within the {fit} "
                f"predicted to fit ({memory_cap[1]})")
    elif memory_cap is not None:
        cap, how = max(1, memory_cap[0]), memory_cap[1]
        rule = f"the largest that divides the per-process batch {per_rank} within the {cap} predicted to fit ({how})"
    elif device_type == "cpu":
        rule = (f"the largest that divides the per-process batch {per_rank} {cpu_rule}: no memory was measured, "
                "and the memory model predicts only from a measured peak")
    else:
        rule = (f"the largest that divides the per-process batch {per_rank} up to {cap}: no memory was measured, "
                "and the memory model predicts only from a measured peak"
                + ("; its first steps' measured peak may grow it, a step that runs out of memory halves it" if gpu
                   else ""))
    micro = max(d for d in range(1, min(cap, per_rank) + 1) if per_rank % d == 0)
    micro_from = Origin.PREDICTED if memory_cap is not None else Origin.NO_MEMORY
    why["micro_batch"] = f"{micro} × {per_rank // micro} accumulation: {rule}"
    if gpu:
        workers, from_what = informed_workers(device_type, cores, world_size)
        why["loader"] = (f"{workers} worker(s) " + (f"({from_what})" if cores is None else from_what)
                         + ", pinned memory, non-blocking copies")
    else:
        workers = 0
        why["loader"] = "no workers: the step uses every core; no pinned memory (no copy to a GPU)"
    return Plan(
        name="default",
        micro_batch=micro,
        grad_accum=per_rank // micro,
        strategy="ddp" if world_size > 1 else "single",
        precision=precision,
        tf32=tf32,
        num_workers=workers,
        pin_memory=gpu,
        non_blocking=gpu,
        fused_optimizer=fused,
        provenance={"informed": INFORMED, **{k: f"{v} ({INFORMED})" for k, v in why.items()},
                    KEY: {k: (micro_from if k == "micro_batch" else Origin.HARDWARE).value for k in why}},
    )


def informed_summary(plan: Plan) -> str:
    """The default plan's settings in one line, labelled: "fp32, fused AdamW, micro-batch 8 × 4, no loader
    workers (chosen from the hardware, not measured)"."""
    parts = ["fp32+tf32" if plan.precision == "fp32" and plan.tf32 else plan.precision
             + (" (TF32 for fp32 matmuls)" if plan.precision != "fp32" and plan.tf32 else "")]
    parts.append("fused AdamW" if plan.fused_optimizer else "AdamW (not fused)")
    parts.append(f"micro-batch {plan.micro_batch} × {plan.grad_accum}")
    parts.append(f"{plan.num_workers} loader worker(s)" if plan.num_workers else "no loader workers")
    if plan.pin_memory:
        parts.append("pinned memory, non-blocking copies" if plan.non_blocking else "pinned memory")
    return f"{', '.join(parts)} ({INFORMED})"


def informed_choices(plan: Plan) -> list[str]:
    """The default plan's choices and why, one line each ("precision: bf16: …"); empty for any other plan."""
    return [f"{k}: {plan.provenance[k]}" for k in INFORMED_KNOBS if plan.provenance.get("informed") and
            isinstance(plan.provenance.get(k), str)]


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
