"""A plain loop's model compiled from outside (`Overrides.compile`), and how long its compilation took.

The model is the one the hooks find at the first optimizer step (the top-level module owning most of the followed
optimizer's parameters, `found.model_of`); it is compiled in place there: its `forward` becomes
`torch.compile(model.forward, mode=…)`. So the first step ran as written, every later one runs compiled; the module
object, its parameters and its `state_dict` keys stay what the script holds (no `_orig_mod.` prefix in what it
saves), and hooks on the module — the doctor's Profiler's forward timing — stay outside the compiled code.

Not done, and said: a model the script compiles itself (an `OptimizedModule`, or `Module.compile()`), a run of
several processes (a DDP-wrapped model compiles with its own graph breaks, untried here), no model found.

What its compilation cost is timed where it is paid: from the compile call to the end of the next optimizer step,
the first that runs compiled (dynamo traces and inductor builds the forward and backward kernels in it). The parent
subtracts a compiled step's own time (`script/compile_stage.py`).
"""

from __future__ import annotations

import time
from typing import Any


class LoopCompile:
    """The compile side of a plain loop in the child (module docstring)."""

    def __init__(self, mode: str | None, world: int) -> None:
        self.mode, self.world = mode, world
        self.applied = False
        self.why: str | None = None  # why it was asked for and not applied
        self._started: float | None = None
        self.compile_step_s: float | None = None  # from the compile call to the end of the first compiled step

    def apply(self, model: Any) -> None:
        """At the first optimizer step: compile `model`'s forward in place, when asked and it can be."""
        if self.mode is None:
            return
        from saturate.doctor.loop_facts import is_compiled

        if model is None:
            self.why = "no model owning the optimizer's parameters was called"
        elif self.world > 1:
            self.why = f"not with {self.world} processes"
        elif is_compiled(model):
            self.why = "the script compiles its model itself"
        else:
            import torch

            model.forward = torch.compile(model.forward, mode=None if self.mode == "default" else self.mode)
            self.applied = True
            self._started = time.perf_counter()

    def end_step(self) -> None:
        """An optimizer step ended: the first after compiling closes its compilation's time."""
        if self._started is not None and self.compile_step_s is None:
            self.compile_step_s = time.perf_counter() - self._started

    def report(self) -> dict[str, Any] | None:
        if self.mode is None:
            return None
        return {"mode": self.mode, "applied": self.applied, "why": self.why, "compile_step_s": self.compile_step_s}
