"""FLOP formulas PyTorch's counter lacks: scaled-dot-product attention on the CPU.

``torch.utils.flop_counter.FlopCounterMode`` has formulas for the CUDA attention kernels (flash,
memory-efficient, cuDNN) but none for ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward, the ops ``F.scaled_dot_product_attention`` dispatches to on a CPU, so attention counted 0
there and a user model's MFU was low by the attention share (~14 % for nanoGPT's model at T=128).
``register_attention_flops`` registers formulas for those ops from their shapes.

Convention (torch's, and PaLM appendix B's behind ``gpt.flops_per_token``): forward 4·B·H·Tq·Tk·D
(QKᵀ and the weighted sum of V, 2 FLOPs per multiply-add, torch's ``sdpa_flop_count``), backward
twice that (the gradients of both products; torch's backward formula also counts the scores'
recompute, which is not model work), so 3× forward for a training step; a causal mask is *not*
halved: model FLOPs count the full Tq×Tk product, as the analytic 12·L·H·Q·T per token does, which
keeps a counted model's MFU comparable with a preset's. The math fallback (an explicit mask the
fused kernel refuses) decomposes into matmuls the counter already counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter

_registered = False


def register_attention_flops() -> None:
    """Teach FlopCounterMode the CPU attention ops (once per process; a torch that has them keeps its own)."""
    global _registered
    if _registered:
        return
    _registered = True
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in flop_counter.flop_registry:

        @flop_counter.register_flop_formula(forward)
        def _cpu_sdpa(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    if backward is not None and backward not in flop_counter.flop_registry:

        @flop_counter.register_flop_formula(backward)
        def _cpu_sdpa_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                               *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
            # Twice the forward: torch's backward formula adds the scores' recompute (2.5x), which
            # is hardware work, not model FLOPs (activation checkpointing's recompute is not counted either).
            return 2 * flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)
