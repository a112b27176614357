"""Per-step losses of a framework's trainer, kept on the device until the report is written.

A Transformers `Trainer`'s `training_step` and a Lightning `Trainer`'s strategy `backward` both see each
micro-step's loss already divided by the accumulation, so a step's loss is the sum of its micro-steps'
(whatever the split). `tune -- CMD` compares a trial's first losses with the script's own to accept a
lower precision; no host sync is added to a step (the values are read once, at the end).
"""

from __future__ import annotations

from typing import Any

MAX_LOSSES = 1000  # per-step losses kept (a trial needs its first few dozen)


class StepLosses:
    """Micro-step losses summed per optimizer step; `add` at each micro-step, `end_step` at each step."""

    def __init__(self, limit: int = MAX_LOSSES) -> None:
        self.values: list[Any] = []  # per optimizer step: a detached device tensor (or a float)
        self.limit = limit
        self._pending: Any = None

    def add(self, loss: Any) -> None:
        if len(self.values) >= self.limit:
            return
        value = loss.detach() if hasattr(loss, "detach") else loss
        self._pending = value if self._pending is None else self._pending + value

    def end_step(self) -> None:
        if self._pending is not None:
            self.values.append(self._pending)
            self._pending = None

    def read(self) -> list[float]:
        """The losses as floats (read from the device now), up to the first that cannot be read."""
        out = []
        for value in self.values:
            try:
                out.append(float(value))
            except (TypeError, ValueError, RuntimeError):
                break
        return out
