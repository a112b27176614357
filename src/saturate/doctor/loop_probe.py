"""The batch-scaling probe for a user's own loop: its model's forward+backward at the micro-batch it ran and at
twice that, on the inputs it last saw, so the doctor can say whether a micro-step's fixed cost dominates
(overhead-bound) for a script as it does for a preset (`diagnose.scaling_probe`).

    probe = probe_from_inputs(model, args, kwargs, micro_batch=8, device=dev, autocast=None)

The doubled batch is every input whose first dimension is the micro-batch, concatenated with itself; what is
back-propagated is the output's `loss` when it has one (a Transformers model given labels), else the sum of the
means of its floating tensors that require grad — the same graph back to the parameters, so the same backward
work as the script's own loss to within its last few ops. Run only where its side effects cannot matter: the
doctor's run of a script, which is stopped right after (the model's gradients are restored; extra forwards still
move BatchNorm's running statistics and the random generators).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from saturate.doctor.findings import ScalingProbe

ROUNDS = 5


def _surrogate_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum()
    if isinstance(output, dict):
        output = list(output.values())
    leaves = [t for t in tree_flatten(output)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return sum((t.float().mean() for t in leaves), torch.zeros((), device=leaves[0].device)) if leaves else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_from_inputs(model: nn.Module, args: tuple, kwargs: dict, micro_batch: int, device: torch.device,
                      autocast: torch.dtype | None, rounds: int = ROUNDS) -> tuple[ScalingProbe | None, str | None]:
    """(the probe, None) or (None, why not, in one line)."""
    doubled = [False]

    def double(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == micro_batch:
            doubled[0] = True
            return torch.cat([t, t])
        return t

    large = tree_map(double, (args, kwargs))
    if not doubled[0]:
        return None, (f"batch-scaling probe skipped: no input of the model has the micro-batch ({micro_batch}) "
                      "as its first dimension")
    inputs = {micro_batch: (args, kwargs), 2 * micro_batch: large}
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    times: dict[int, list[float]] = {b: [] for b in inputs}
    memory: dict[int, int | None] = {}
    try:
        for round_ in range(rounds + 1):  # the first round warms up each shape
            for b, (a, k) in inputs.items():
                if device.type == "cuda" and round_ == 0:
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t0 = time.perf_counter()
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    loss = _surrogate_loss(model(*a, **k))
                if loss is None:
                    return None, "batch-scaling probe skipped: the model's output holds no tensor that requires grad"
                loss.backward()
                _sync(device)
                elapsed = time.perf_counter() - t0
                for p in params:
                    p.grad = None
                if round_ == 0:
                    memory[b] = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
                else:
                    times[b].append(elapsed)
    except torch.OutOfMemoryError:
        return None, f"batch-scaling probe: micro-batch {2 * micro_batch} does not fit in device memory"
    except Exception as e:  # a model whose forward the captured inputs cannot be replayed through
        return None, f"batch-scaling probe skipped: replaying the model's forward failed ({type(e).__name__}: {e})"
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        if device.type == "cuda":
            torch.cuda.empty_cache()
    small, big = inputs
    ratios = tuple(t2 / t1 for t1, t2 in zip(times[small], times[big], strict=True) if t1 > 0)
    fastest = min(times[small])
    seconds = (fastest, fastest * statistics.median(ratios) if ratios else min(times[big]))
    spread = tuple((max(times[b]) - min(times[b])) / min(times[b]) if min(times[b]) > 0 else 0.0 for b in inputs)
    return ScalingProbe((small, big), seconds, (memory[small], memory[big]), spread, ratios), None
