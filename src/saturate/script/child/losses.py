"""Per-step losses of a script, a framework's trainer or a plain loop, kept on the device until the report is written.

A Transformers `Trainer`'s `training_step` and a Lightning `Trainer`'s strategy `backward` both see each
micro-step's loss already divided by the accumulation, so a step's loss is the sum of its micro-steps'
(whatever the split). `tune -- CMD` compares a trial's first losses with the script's own to accept a
lower precision; no host sync is added to a step (the values are read once, at the end).

The losses go into one float32 tensor of `MAX_LOSSES` values made on the device at the first loss, each step's
added in place to its slot. Keeping each step's loss as a tensor of its own (as before) left a small
allocation alive per step among the step's large freed buffers: glibc's heap could not reuse or trim past them,
so a plain AdamW loop's trial process grew by megabytes a step and, while it grew, faulted fresh pages in and ran
far slower — a slowdown of saturate's making, which the unfused optimizer (more buffers a step) paid more than the
fused one (measured: bench/results/cpu-2026-11-28c/README.md).
"""

from __future__ import annotations

from typing import Any

MAX_LOSSES = 1000  # per-step losses kept (a trial needs its first few dozen)


class StepLosses:
    """Micro-step losses summed per optimizer step; `add` at each micro-step, `end_step` at each step."""

    def __init__(self, limit: int = MAX_LOSSES) -> None:
        self.limit = limit
        self.count = 0  # optimizer steps with a loss
        self._buffer: Any = None  # float32 [limit] on the losses' device, made at the first tensor loss
        self._floats: dict[int, float] = {}  # the part of a step's loss given as a Python number
        self._pending = False  # a loss was added in the step under way
        self._failed = False  # a loss could not be added (another device, a tensor subclass): no more are kept

    def add(self, loss: Any) -> None:
        if self.count >= self.limit or self._failed:
            return
        if not hasattr(loss, "detach"):
            self._floats[self.count] = self._floats.get(self.count, 0.0) + float(loss)
            self._pending = True
            return
        try:
            value = loss.detach().reshape(())
            if self._buffer is None:
                import torch

                self._buffer = torch.zeros(self.limit, dtype=torch.float32, device=value.device)
            self._buffer[self.count].add_(value)  # in place: nothing new stays allocated
        except (RuntimeError, TypeError, ValueError, AttributeError):
            self._failed, self._pending = True, False  # this step's part-sum is not counted
            return
        self._pending = True

    def end_step(self) -> None:
        if self._pending:
            self.count += 1
            self._pending = False

    def read(self) -> list[float]:
        """The losses as floats (read from the device now, one copy), those of the steps ended."""
        if self._buffer is None:
            kept = [0.0] * self.count
        else:
            try:
                kept = self._buffer[:self.count].tolist()
            except RuntimeError:  # the device is gone (a CUDA error): no losses
                return []
        return [value + self._floats.get(i, 0.0) for i, value in enumerate(kept)]
