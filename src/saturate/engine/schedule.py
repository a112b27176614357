"""Learning-rate schedule: linear warm-up then cosine decay, and the linear scaling rule."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class WarmupCosine:
    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float

    def lr(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.peak_lr - self.min_lr)

    def state_dict(self) -> dict:
        return {"peak_lr": self.peak_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr": self.min_lr}

    def load_state_dict(self, state: dict) -> None:
        self.peak_lr = state["peak_lr"]
        self.warmup_steps = state["warmup_steps"]
        self.total_steps = state["total_steps"]
        self.min_lr = state["min_lr"]


def scaled_lr(base_lr: float, reference_batch: int, effective_batch: int) -> float:
    """Linear scaling rule (Goyal et al., 2017): the learning rate follows the batch size."""
    return base_lr * effective_batch / reference_batch
