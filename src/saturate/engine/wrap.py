"""What a plan wraps around a model before it trains: FSDP2 sharding, DDP, activation
checkpointing, and the AdamW optimizer (fused where the device has the kernel).

The Stepper (step.py) applies these in its fixed order; `repeated_blocks` also tells compile which
modules to compile one by one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from saturate.engine.precision import Precision
from saturate.errors import ConfigError


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the largest nn.ModuleList of two or more modules of one type.

    FSDP shards each one as a unit and compile treats each one as a graph (GPT's `blocks`, a
    Hugging Face model's `layers` / `h`); an empty list when the model has none.
    """
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best


def _fsdp_api() -> tuple[Any, Any, Any, Any]:
    try:  # public from torch 2.6
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def shard_model(model: nn.Module, device: torch.device, precision: Precision, cpu_offload: bool,
                notes: list[str]) -> None:
    """FSDP2: `fully_shard` each transformer block, then the root (which holds embeddings and head).

    Mixed precision: parameters are gathered and computed in the plan's bf16/fp16, gradients
    reduced in fp32. CPU offload keeps the shards (and so the optimizer step) in host RAM.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy = _fsdp_api()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    low = precision.dtype if precision.name != "fp32" else None
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if cpu_offload and device.type == "cpu":
        notes.append("plan.cpu_offload has no effect when training on the CPU; not used")
        cpu_offload = False
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP with no collective inside a forward: buffers are synchronised once at construction, not before
    every forward, so a rank that ran out of memory mid-step cannot leave the others waiting in one
    (rank 0's buffers are the ones saved, as with DDP's default)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    no_forward_sync = ({"forward_sync_buffers": False}  # torch >= 2.13; broadcast_buffers is deprecated there
                       if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                       else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **no_forward_sync)


def all_reduce_gradients(params: list[torch.Tensor], world_size: int) -> None:
    """Average gradients over ranks, as DDP does (divide, then sum), for a step run entirely under no_sync."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        g.div_(world_size)
    for work in [dist.all_reduce(g, async_op=True) for g in grads]:
        work.wait()


def enable_activation_checkpointing(model: nn.Module) -> None:
    if hasattr(model, "set_activation_checkpointing"):
        model.set_activation_checkpointing(True)
    elif hasattr(model, "gradient_checkpointing_enable"):  # Hugging Face models
        model.gradient_checkpointing_enable()
    else:
        raise ConfigError(f"plan.activation_checkpointing: {type(model).__name__} has no way to enable it")


def enable_chunked_loss(model: nn.Module, chunk: int) -> None:
    """`plan.loss_chunk`: the model's loss made `chunk` rows of logits at a time (workloads/chunked_loss.py)."""
    if not hasattr(model, "set_loss_chunk"):
        raise ConfigError(f"plan.loss_chunk: {type(model).__name__} has no chunked loss (the GPT presets have)")
    model.set_loss_chunk(chunk)


def build_optimizer(model: nn.Module, o: Any, lr: float, fused: bool,
                    device: torch.device) -> tuple[torch.optim.Optimizer, bool]:
    """AdamW with weight decay on matrices only; returns (optimizer, whether it is the fused kernel)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=o.betas, fused=True), True
        except (RuntimeError, TypeError):
            pass  # this device/dtype has no fused kernel
    return torch.optim.AdamW(groups, lr=lr, betas=o.betas, foreach=device.type != "mps"), False
