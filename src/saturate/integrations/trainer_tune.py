"""`saturate tune -- CMD`'s stages for a Transformers `Trainer`: its TrainingArguments, by measurement.

Called by `tune.tune_command` when the as-written run saw a Trainer; each stage runs trials through
the search (`consider`: a run of the script with the overrides, kept only when measured faster by
`GAIN_MIN`) and adds a decision line. The stages and their order are in `tune`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from saturate.tune.results import LOSS_TOLERANCE
from saturate.tune.search import loss_drift

UNFUSED_ADAMW = ("adamw_torch", "adamw_hf", "adamw")  # Trainer `optim` values with a fused variant to try


class Search(Protocol):
    """What the stages need of `tune._Search`."""

    result: Any  # tune.ScriptTuning

    def consider(self, name: str, overrides: dict[str, Any],
                 check: Callable[[Any], str | None] | None = None) -> Any: ...

    def kept(self, t: Any) -> bool: ...

    def with_trainer(self, fields: dict[str, Any]) -> dict[str, Any]: ...


def trainer_stages(search: Search, trainer: dict[str, Any], supports: dict[str, bool]) -> None:
    """Precision, micro-batch × accumulation, checkpointing, fused optimizer and compile, in that order."""
    written = trainer.get("args") or {}
    decisions = search.result.decisions
    base = search.result.baseline

    def with_trainer(fields: dict[str, Any]) -> dict[str, Any]:
        return search.with_trainer(fields)

    # 1. precision, checked against the script's own losses
    device = search.result.device_type
    if written.get("bf16") or written.get("fp16"):
        decisions.append(f"precision: the script already trains in {'bf16' if written.get('bf16') else 'fp16'}")
    else:
        name = "bf16" if supports.get("bf16") else "fp16" if supports.get("fp16") and device == "cuda" else None
        if name is None:
            decisions.append(f"precision: fp32 (no lower precision is native on {device})")
        else:
            fields = {name: True, **({"use_cpu": True} if device == "cpu" else {})}  # bf16 on a CPU needs use_cpu
            label = ", ".join(f"{k}=True" for k in fields)
            t = search.consider(label, with_trainer(fields), lambda t: _loss_problem(t, base))
            decisions.append(f"precision: {label} {t.outcome}")

    # 2. micro-batch × accumulation at the same effective batch
    micro = int(written.get("per_device_train_batch_size") or 1)
    accum = int(written.get("gradient_accumulation_steps") or 1)
    effective = micro * accum
    splits = [d for d in range(1, effective + 1) if effective % d == 0]
    memory_stopped = None
    climbed = False
    for m in [d for d in splits if d > micro]:
        t = search.consider(f"micro-batch {m} × {effective // m}", with_trainer(
            {"per_device_train_batch_size": m, "gradient_accumulation_steps": effective // m}))
        if not t.ok and "out of memory" in t.outcome.lower():
            memory_stopped = m
        if not search.kept(t):
            break
        climbed = True
    if not climbed and (below := [d for d in splits if d < micro]):
        m = below[-1]
        search.consider(f"micro-batch {m} × {effective // m}", with_trainer(
            {"per_device_train_batch_size": m, "gradient_accumulation_steps": effective // m}))
    fields = search.result.best.overrides.get("trainer", {})
    tried = [t.name.removeprefix("micro-batch ") for t in search.result.trials if t.name.startswith("micro-batch")]
    decisions.append(f"micro-batch: {fields.get('per_device_train_batch_size', micro)} × accumulation "
                     f"{fields.get('gradient_accumulation_steps', accum)} (as written {micro} × {accum}; the "
                     f"effective batch {effective} kept; tried: {', '.join(tried) or 'no other exact split'})")

    # 3. activation checkpointing, only where memory stopped a larger micro-batch
    if device == "cpu":
        decisions.append("gradient_checkpointing: not tried on cpu (it trades recompute for memory; host memory "
                         "did not limit the micro-batch)")
    elif written.get("gradient_checkpointing"):
        decisions.append("gradient_checkpointing: already on in the script")
    elif memory_stopped is None:
        decisions.append("gradient_checkpointing: not tried (no larger micro-batch ran out of memory, so "
                         "recomputing activations could only cost time)")
    else:
        t = search.consider(f"gradient_checkpointing at micro-batch {memory_stopped}", with_trainer(
            {"gradient_checkpointing": True, "per_device_train_batch_size": memory_stopped,
             "gradient_accumulation_steps": effective // memory_stopped}))
        decisions.append(f"gradient_checkpointing: {t.outcome}")

    # 4. the fused optimizer
    optim = str(written.get("optim") or "")
    if optim in UNFUSED_ADAMW:
        t = search.consider('optim="adamw_torch_fused"', with_trainer({"optim": "adamw_torch_fused"}))
        decisions.append(f"fused optimizer: {t.outcome}")
    else:
        decisions.append(f"fused optimizer: not tried (optim={optim!r}"
                         f"{' is already fused' if 'fused' in optim else ' has no fused variant saturate tries'})")

    # 5. torch_compile, where it can pay back its compile time
    if written.get("torch_compile"):
        decisions.append("torch_compile: already on in the script")
    elif device == "cpu":
        decisions.append("torch_compile: not tried on cpu (compiling takes tens of seconds here, more than a "
                         "trial's steps can show back; try it where the model runs on a GPU)")
    else:
        best = search.result.best
        planned = trainer.get("planned_steps") or (written.get("max_steps") or 0)
        t = search.consider("torch_compile=True", with_trainer({"torch_compile": True}),
                            lambda t: _compile_problem(t, best, planned))
        decisions.append(f"torch_compile: {t.outcome}")


def _loss_problem(t: Any, reference: Any) -> str | None:
    """Why a lower precision's first losses are not close enough to the script's own, or None."""
    if not t.losses or not reference.losses:
        return "no per-step losses to compare with the script's own"
    n = min(len(t.losses), len(reference.losses))
    drift = loss_drift(t.losses, reference.losses)
    if drift > LOSS_TOLERANCE:
        return (f"its first {n} losses differ from the script's own by up to {100 * drift:.1f} % "
                f"(> {100 * LOSS_TOLERANCE:.0f} %)")
    t.note = f"its first {n} losses within {100 * drift:.2f} % of the script's own"
    return None


def _compile_problem(t: Any, best: Any, planned_steps: int) -> str | None:
    """Why a compiled trial does not pay back its compile time within the planned steps, or None."""
    if t.first_step_s is None or best.first_step_s is None or not planned_steps:
        return "its compile time or the planned steps are unknown"
    extra = t.first_step_s - best.first_step_s
    saved = (best.step_s - t.step_s) * planned_steps
    if saved <= extra:
        return f"{planned_steps} planned steps would save {saved:.0f} s, less than the {extra:.0f} s compile"
    return None
