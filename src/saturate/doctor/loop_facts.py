"""What the doctor's Profiler reads of a loop it did not write: its precision, device, autograd nodes, whether its
model is compiled, a batch's samples."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def precision_of(model: nn.Module, device: torch.device) -> str:
    """"bf16"/"fp16" under autocast or with half-precision weights, else "fp32" (as a Plan names it)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    try:
        if torch.is_autocast_enabled(device.type):
            return names.get(torch.get_autocast_dtype(device.type), "fp32")
    except (TypeError, RuntimeError):  # a device type autocast does not know
        pass
    weight = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return names.get(weight, "fp32")


def device_of(model: nn.Module | None, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grad_nodes(value: Any, found: list[Any]) -> None:
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            found.append(value.grad_fn)
    elif isinstance(value, dict):
        for v in value.values():
            grad_nodes(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            grad_nodes(v, found)


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` runs compiled: `torch.compile(model)` (an `OptimizedModule`), `model.compile()` (its compiled
    call), or its `forward` compiled in place (`torch.compile(model.forward)`, as `saturate tune -- CMD` does)."""
    return (type(model).__name__ == "OptimizedModule" or getattr(model, "_compiled_call_impl", None) is not None
            or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable"))


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (a tensor, or a tuple, list or dict of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            if isinstance(b, torch.Tensor) and b.dim():
                return int(b.shape[0])
    return 0
