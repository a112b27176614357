"""The trainers `saturate tune -- CMD` tunes, each as a `trainer_stages.Framework`: its knobs in its own terms.

- `TransformersTrainer`: a Transformers `Trainer`'s `TrainingArguments` fields (`{"trainer": …}` overrides):
  `bf16`/`fp16` (with `use_cpu` for bf16 on a CPU), `per_device_train_batch_size` ×
  `gradient_accumulation_steps`, `gradient_checkpointing`, `optim="adamw_torch_fused"`, `torch_compile`.
- `LightningTrainer`: a Lightning `Trainer`'s arguments (`{"lightning": …}`) `precision="bf16-mixed"` (or
  `"16-mixed"`) and `accumulate_grad_batches`, with the micro-batch as the batch size of the training
  `DataLoader(...)` (`{"train_loader": …}`, only where that call sets `batch_size=`), and `fused=True` for the
  script's torch `Adam`/`AdamW` (`{"optimizer": …}`). Activation checkpointing and compile are not tried: a
  Lightning Trainer takes neither as an argument, and compiling the LightningModule from outside is unsafe.
"""

from __future__ import annotations

from typing import Any

from saturate.script.overrides import FUSED_OPTIMIZERS, Overrides
from saturate.script.trainer_stages import Framework, Option

UNFUSED_ADAMW = ("adamw_torch", "adamw_hf", "adamw")  # Trainer `optim` values with a fused variant to try
FP32 = (None, 32, "32", "32-true")  # a Lightning Trainer's full-precision settings


def framework_of(report: dict[str, Any]) -> Framework | None:
    """The trainer the as-written run's report saw, if any."""
    if report.get("trainer"):
        return TransformersTrainer(report["trainer"])
    if report.get("lightning"):
        return LightningTrainer(report["lightning"], report.get("loaders") or [], report.get("optimizer") or {})
    return None


def fused_option(optimizer: dict[str, Any]) -> Option:
    """The fused trial for the script's own optimizer (as the report names it: class, site, fused), or why not:
    torch's `Adam`/`AdamW` constructed with `fused=True` (the `"optimizer"` override)."""
    cls = optimizer.get("class") or "?"
    if optimizer.get("fused"):
        return f"not tried (the script's {cls} is already fused)"
    if cls not in FUSED_OPTIMIZERS:
        return f"not tried ({cls} has no fused variant saturate tries; Adam and AdamW do)"
    return f"{cls}(fused=True)", Overrides(optimizer={"fused": True})


class TransformersTrainer:
    checkpointing_knob = "gradient_checkpointing"
    compile_knob = "torch_compile"

    def __init__(self, trainer: dict[str, Any]) -> None:
        self.written = trainer.get("args") or {}
        self.planned_steps = trainer.get("planned_steps") or self.written.get("max_steps") or None

    def lower_precision(self) -> str | None:
        return "bf16" if self.written.get("bf16") else "fp16" if self.written.get("fp16") else None

    def precision(self, name: str, device: str) -> tuple[str, Overrides]:
        fields = {name: True, **({"use_cpu": True} if device == "cpu" else {})}  # bf16 on a CPU needs use_cpu
        return ", ".join(f"{k}=True" for k in fields), Overrides(trainer=fields)

    def split(self) -> tuple[int, int]:
        return (int(self.written.get("per_device_train_batch_size") or 1),
                int(self.written.get("gradient_accumulation_steps") or 1))

    def split_overrides(self, micro: int, accum: int) -> Overrides:
        return Overrides(trainer={"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum})

    def checkpointing(self) -> Overrides | str:
        if self.written.get("gradient_checkpointing"):
            return "already on in the script"
        return Overrides(trainer={"gradient_checkpointing": True})

    def fused(self) -> Option:
        optim = str(self.written.get("optim") or "")
        if optim in UNFUSED_ADAMW:
            return 'optim="adamw_torch_fused"', Overrides(trainer={"optim": "adamw_torch_fused"})
        return (f"not tried (optim={optim!r}"
                f"{' is already fused' if 'fused' in optim else ' has no fused variant saturate tries'})")

    def compile(self) -> Option:
        if self.written.get("torch_compile"):
            return "already on in the script"
        return "torch_compile=True", Overrides(trainer={"torch_compile": True})


class LightningTrainer:
    checkpointing_knob = "activation checkpointing"
    compile_knob = "compile"

    def __init__(self, lightning: dict[str, Any], loaders: list[dict[str, Any]], optimizer: dict[str, Any]) -> None:
        self.info = lightning
        self.written = lightning.get("args") or {}
        self.loader = loaders[0] if loaders else None  # the one that fed the timed steps most
        self.optimizer = optimizer
        self.planned_steps = lightning.get("planned_steps")

    def lower_precision(self) -> str | None:
        precision = self.written.get("precision")
        return None if precision in FP32 else f"precision={precision!r}"

    def precision(self, name: str, device: str) -> tuple[str, Overrides]:
        value = {"bf16": "bf16-mixed", "fp16": "16-mixed"}[name]
        return f"Trainer(precision={value!r})", Overrides(lightning={"precision": value})

    def split(self) -> tuple[int, int] | str:
        loader = self.loader
        if self.info.get("automatic_optimization") is False:
            return ("not tried (the LightningModule steps its optimizer itself, manual optimization: its "
                    "accumulation is in its own code)")
        if loader is None:
            return "not tried (no DataLoader fed the timed steps: the batch size is set in the script's own code)"
        if not loader.get("sets_batch_size", True) or not loader.get("batch_size"):
            return (f"not tried (the training DataLoader at {loader.get('site') or '?'} takes its batches from a "
                    "batch_sampler of its own; saturate changes only a DataLoader's batch_size=)")
        if not loader.get("site"):
            return "not tried (where the training DataLoader is made was not found, so its batch_size cannot be set)"
        return int(loader["batch_size"]), int(self.written.get("accumulate_grad_batches") or 1)

    def split_overrides(self, micro: int, accum: int) -> Overrides:
        site = self.loader.get("site") if self.loader else None
        return Overrides(lightning={"accumulate_grad_batches": accum}, train_loader={"site": site, "batch_size": micro})

    def checkpointing(self) -> str:
        return ("not tried (a Lightning Trainer takes no argument for it: it is in the LightningModule's code, "
                "or FSDPStrategy(activation_checkpointing_policy=...))")

    def fused(self) -> Option:
        return fused_option(self.optimizer)

    def compile(self) -> str:
        return ("not tried (torch.compile of the LightningModule from outside compiles only its forward, which "
                "training_step need not call, and changes the module Lightning's hooks and checkpoints see; "
                "compile inside the module instead, e.g. self.net = torch.compile(self.net))")


def plain_fused(optimizer: dict[str, Any], device: str) -> Option:
    """A plain script's fused-optimizer trial (`frameworks.fused_option`), where torch has the kernel on `device`."""
    option = fused_option(optimizer)
    if isinstance(option, str):
        return option
    import torch

    from saturate.tune.api import fused_adamw_available

    if not fused_adamw_available(torch.device(device)):
        return f"not tried (this torch has no fused {optimizer.get('class')} on {device})"
    return option
