"""Which fused kernels this torch has for a device: asked of torch, never assumed from the device's name.

The informed starting plan (`plan.default_plan`) and the tuner's fused-optimizer stage both ask here.
"""

from __future__ import annotations

import torch


def fused_adamw_available(device: torch.device) -> bool:
    """Whether torch builds AdamW with `fused=True` on `device` (CUDA and ROCm; the CPU since torch 2.4)."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
        return True
    except (RuntimeError, TypeError):
        return False
