"""Reads of a model tensor's value into Python over the doctor's timed steps, placed at their line.

The sync counter (phases.SyncCounter) runs over a few counted steps only: on the CPU it interposes on every
torch call, which would distort the clock. A read that a loop makes every N steps — minGPT logs `loss.item()`
every tenth iteration — falls between them and was reported as 0 per step. This light count runs over the timed
steps instead: it wraps the few Tensor methods that hand a value to Python (and nothing else, so the step's own
ops run as they are) and keeps, per line and phase, how many of the timed steps made one. What it counts is a
lower bound of what the sync counter sees: on a GPU every read of a device tensor, on the CPU a read of a tensor
that requires grad or came out of autograd (a loss, not a `loss.detach()`; see phases.py for how the counter
tells the model's tensors from the host's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from saturate.doctor.phases import SyncCounter

# Each one hands a value to Python, a sync on a GPU; none calls another of them (no read counted twice)
_WRAPPED = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


class ValueReads:
    """While started, counts reads of model tensors' values by (phase, `file.py:line`); `phase()` names the
    step's phase at each read. Reads in the data and optimizer phases on the CPU are not counted (a dataset's
    or an optimizer's own host tensors: see SyncCounter)."""

    def __init__(self, device: torch.device, phase: Callable[[], str]) -> None:
        self.cuda = device.type == "cuda"
        self.phase = phase
        self.counts: dict[tuple[str, str | None], int] = {}  # (phase, line) → reads
        self.steps_with: dict[str | None, set[int]] = {}  # line → the timed steps that made one
        self.step = 0
        self._originals: dict[str, Any] = {}
        self._inside = False

    def _model_tensor(self, t: torch.Tensor) -> bool:
        if self.cuda:
            return t.device.type != "cpu"
        return t.requires_grad or t.grad_fn is not None or hasattr(t, "_saturate_on_device")

    def _seen(self, t: torch.Tensor) -> None:
        if self._inside or not isinstance(t, torch.Tensor) or not self._model_tensor(t):
            return
        phase = self.phase()
        if not self.cuda and phase in ("data", "optimizer"):
            return
        self._inside = True
        try:
            key = (phase, SyncCounter.site() if SyncCounter.site is not None else None)
        finally:
            self._inside = False
        self.counts[key] = self.counts.get(key, 0) + 1
        self.steps_with.setdefault(key[1], set()).add(self.step)

    def start(self) -> None:
        if self._originals:
            return
        for name in _WRAPPED:
            original = getattr(torch.Tensor, name)
            self._originals[name] = vars(torch.Tensor).get(name)  # None: inherited, so deleted again at stop()
            setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original: Any) -> Any:
        def read(t: Any, *args: Any, **kwargs: Any) -> Any:
            self._seen(t)
            return original(t, *args, **kwargs)

        read.__name__ = getattr(original, "__name__", "read")
        read.__doc__ = getattr(original, "__doc__", None)
        return read

    def stop(self) -> None:
        for name, original in self._originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._originals = {}

    def by_site(self, steps: int) -> dict[str | None, tuple[float, int]]:
        """Per line: (reads per timed step, timed steps that made one) over `steps` timed steps."""
        out: dict[str | None, tuple[float, int]] = {}
        for (_, site), n in self.counts.items():
            out[site] = (out.get(site, (0.0, 0))[0] + n / steps, len(self.steps_with[site]))
        return out

    def phases_of(self, site: str | None) -> dict[str, float]:
        """The share of a line's reads made in each phase."""
        mine = {phase: n for (phase, s), n in self.counts.items() if s == site}
        total = sum(mine.values()) or 1
        return {phase: n / total for phase, n in mine.items()}
