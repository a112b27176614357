"""Batch-coupled layers: where the micro-batch is part of the model's maths, a plan must not change it.

Samples, accumulation and the data order make every micro-batch × accumulation split of a step the
same training (docs/architecture.md) — unless a layer's output for one sample depends on the others
in its micro-batch. BatchNorm normalises with the micro-batch's statistics (a ResNet-18 gave first
losses 2.315, 2.289, 2.286, 2.250 at 8×1, 4×2, 2×4, 1×8 on the same samples), and every BatchNorm
or InstanceNorm that tracks running statistics updates them once per micro-batch, so evaluation
changes too. GroupNorm, LayerNorm and InstanceNorm without running statistics normalise each sample
alone and are not coupled. Layers this cannot see (a custom module computing batch statistics) are
declared with ``--param batch_coupled=true``.

When the model is coupled the tuner keeps the micro-batch (``--param micro_batch=N``, else the whole
effective batch per process) and searches only the other knobs; ``--allow-micro-batch-change``
searches it anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from saturate.errors import ConfigError
from saturate.hardware.kernels import fused_adamw_available
from saturate.plan import Plan, default_plan
from saturate.provenance import Origin, mark
from saturate.workloads.base import Workload


def coupled_layers(model: nn.Module) -> list[str]:
    """Type names of the layers whose results depend on the micro-batch (each name once, in order)."""
    found: list[str] = []
    for module in model.modules():
        coupled = isinstance(module, _BatchNorm) or (
            isinstance(module, _InstanceNorm) and module.track_running_stats)
        if coupled and type(module).__name__ not in found:
            found.append(type(module).__name__)
    return found


def detect(workload: Workload, build_for_real: bool = True) -> tuple[list[str], str | None]:
    """(coupled layer names, a note when the model could not be inspected); the user's flag wins.
    `build_for_real`: where the model cannot be built on the meta device, build it for real to look."""
    if workload.batch_coupled is not None:
        return (["batch-coupled layers (--param batch_coupled=true)"] if workload.batch_coupled else []), None
    try:
        with torch.device("meta"):  # the structure only: no memory, no initialisation cost
            model = workload.build_model()
    except Exception as e:  # a builder that needs real tensors: build it for real
        if not build_for_real:
            return [], ("batch-coupled layers not checked (building the model on the meta device raised "
                        f"{type(e).__name__})")
        try:
            model = workload.build_model()
        except Exception:
            return [], f"batch-coupled layers not checked (building the model raised {type(e).__name__})"
    return coupled_layers(model), None


def kept_micro_batch(workload: Workload, world_size: int, allow_change: bool,
                     build_for_real: bool = True) -> tuple[int | None, str | None]:
    """(the micro-batch the tuner must keep, or None to search it; the line that says why)."""
    layers, note = detect(workload, build_for_real)
    if not layers:
        return None, note
    local = workload.optim.effective_batch // max(1, world_size)
    micro = workload.micro_batch or local
    what = ", ".join(layers)
    if allow_change:
        return None, (f"{what} in the model: the micro-batch is searched (--allow-micro-batch-change), and it "
                      "changes the maths: losses will differ from the same run at another micro-batch")
    if local % micro:
        raise ConfigError(f"micro_batch {micro} does not divide the effective batch per process {local}; with "
                          f"{what} in the model the micro-batch is kept, so give one that divides it")
    return micro, (f"{what} in the model: micro-batch kept at {micro} (it changes the maths); "
                   "--allow-micro-batch-change to search it anyway")


def workload_default_plan(workload: Workload, hardware: Any, world_size: int = 1, *,
                          memory_cap: tuple[int, str] | None = None) -> tuple[Plan, str | None]:
    """`plan.default_plan` for this workload on `hardware` (a `Hardware`, or anything with its `device_type`,
    `torch_device`, `supports` and `cpu_cores`): the informed starting plan, the fused AdamW kernel asked of
    torch on the device. With batch-coupled layers its micro-batch is the kept one (the user's `micro_batch`,
    else the whole effective batch per process) and the line says so. `memory_cap`: see `default_plan`."""
    fused = fused_adamw_available(torch.device(hardware.torch_device))
    plan = default_plan(workload.optim.effective_batch, hardware.device_type, dict(hardware.supports), world_size,
                        cores=getattr(hardware, "cpu_cores", None), fused_optimizer=fused, memory_cap=memory_cap,
                        tokens_per_sample=getattr(workload, "tokens_per_sample", None))
    if plan.grad_accum == 1 and workload.micro_batch is None:
        return plan, None  # the whole batch per process in one micro-batch: nothing split
    # Only a meta-device look: a default plan must not load a large model's weights twice to decide this.
    micro, line = kept_micro_batch(workload, world_size, allow_change=False, build_for_real=False)
    if micro is None or micro == plan.micro_batch:
        return plan, None
    local = plan.micro_batch * plan.grad_accum
    provenance = mark(dict(plan.provenance), "micro_batch", Origin.MODEL, f"{micro}: {line}")
    return plan.replace(micro_batch=micro, grad_accum=max(1, local // micro), provenance=provenance), line
