"""Linear + cross-entropy over row chunks: the (rows × vocabulary) logits never exist whole.

A language model's last matmul and its loss, `F.cross_entropy(h @ W.T, targets)`, keep the whole logits tensor
for backward: at GPT-2's shape (micro-batch 16 × 1024 tokens × 50304) that is 3.3 GB in fp32, more than the rest
of the activations, and it caps the micro-batch (measured: bench/results/h100-2026-11-23/README.md). Here the
rows go through in chunks of `chunk`: each chunk's logits are made, reduced to its loss and its gradients
(softmax minus the one-hot target, times the hidden rows and the weight), and dropped; what backward keeps is the
gradient of the hidden states (rows × width) and of the weight (vocabulary × width) — the approach of
Liger-Kernel's fused linear cross-entropy, in plain torch ops.

    loss = linear_cross_entropy(h, lm_head.weight, targets, chunk=4096)   # == F.cross_entropy(h @ W.T, targets)

Exact up to rounding: the same matmuls in the same precision (autocast's, where it is on), the log-sum-exp and
the softmax in fp32 as `F.cross_entropy` computes them under autocast, the mean over targets that are not
`ignore_index`. The gradients are made in forward, so a graph that calls backward twice through it, or asks for
second derivatives, is not supported (training never does either).
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default
CHUNK_BYTES = 2**28  # one chunk's fp32 logits: 256 MiB (1334 rows of GPT-2's 50304; matmuls still large)


def chunk_rows(vocabulary: int) -> int:
    """Rows per chunk for a vocabulary: the power of two whose fp32 logits fit in `CHUNK_BYTES`, at least 64."""
    rows = max(64, CHUNK_BYTES // (4 * vocabulary))
    return 1 << (rows.bit_length() - 1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                ignore_index: int, grads: bool) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if grads and h.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grads and weight.requires_grad else None
        valid_rows = targets != ignore_index
        for start in range(0, h.shape[0], chunk):
            hs, valid = h[start:start + chunk], valid_rows[start:start + chunk]
            ts = targets[start:start + chunk].clamp_min(0)
            logits = (hs @ weight.t()).float()  # autocast, where on, runs the matmul in its precision
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, ts.unsqueeze(1)).squeeze(1)) * valid).sum()
            if grad_h is None and grad_w is None:
                continue
            g = torch.exp(logits.sub_(lse.unsqueeze(1)))  # d(sum of losses)/d(logits): softmax minus one-hot
            g[torch.arange(g.shape[0], device=g.device), ts] -= 1.0
            g = (g * valid.unsqueeze(1)).to(h.dtype)  # autocast, where on, casts it for the matmuls as backward would
            if grad_h is not None:
                grad_h[start:start + chunk] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ hs).float()
        denominator = valid_rows.sum().clamp_min(1).float()
        ctx.grads, ctx.denominator, ctx.weight_dtype = (grad_h, grad_w), denominator, weight.dtype
        return total / denominator

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_h, grad_w), scale = ctx.grads, grad_out / ctx.denominator
        ctx.grads = (None, None)  # backward runs once: the held gradients go with it
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype), None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """`F.cross_entropy(h @ weight.T, targets, ignore_index=ignore_index)` (mean) with the logits made `chunk`
    rows at a time. `h` is (rows, width) or (..., width) with `targets` of the leading shape."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    # Under no_grad (validation) the weight still requires grad: the gradients are made only when asked for.
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk, ignore_index,
                                     torch.is_grad_enabled())
