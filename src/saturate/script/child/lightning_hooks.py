"""Inside a user's script: a Lightning `Trainer`, recognised without importing Lightning.

The shim hands `hooks.imported()` the module `lightning.pytorch.trainer.trainer` (or
`pytorch_lightning.trainer.trainer`) once it has run; `LightningWatch.patch` wraps `Trainer.__init__` to note
the first Trainer's class, where it was made (`train.py:LINE`) and the arguments saturate's fixes name
(`FIELDS`: `precision=`, `accumulate_grad_batches=`, …) as the script passed them, and, before the Trainer
reads them, to apply saturate's overrides (`{"lightning": {argument: value}}`, only the
`overrides.LIGHTNING_TUNABLE` ones). In a trial or a doctor run (not a full run) its `default_root_dir` (where
Lightning writes its logs and checkpoints unless a logger or checkpoint callback is given its own folder)
points to a scratch folder. Once made, its strategy's `backward` is wrapped to keep each step's loss (the
micro-steps' losses, which Lightning already divides by the accumulation, summed) on the device."""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saturate.doctor import selftime
from saturate.script.child.losses import StepLosses
from saturate.script.overrides import LIGHTNING_TUNABLE

WATCHED = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")
FIELDS = ("precision", "accumulate_grad_batches", "max_steps", "max_epochs", "accelerator", "devices", "strategy",
          "default_root_dir")


class LightningWatch:
    """The first Lightning Trainer made in this process, as the script made it; `overrides`: its arguments."""

    def __init__(self, overrides: dict[str, Any], scratch: Path | None, site: Callable[[], str | None]) -> None:
        self.overrides = dict(overrides)  # Trainer arguments (checked by `Overrides` against LIGHTNING_TUNABLE)
        self.scratch = scratch  # None: leave default_root_dir as written (a full run)
        self.site = site
        self.info: dict[str, Any] | None = None
        self.trainer: weakref.ref | None = None
        self.losses = StepLosses()
        self._patched: set[str] = set()

    def patch(self, name: str, module: Any) -> None:
        if name in self._patched or not hasattr(module, "Trainer"):
            return
        self._patched.add(name)
        cls = module.Trainer
        init = cls.__init__
        signature = inspect.signature(init)
        watch = self

        @functools.wraps(init)
        def wrapped_init(trainer: Any, *args: Any, **kwargs: Any) -> None:
            if watch.info is not None:
                init(trainer, *args, **kwargs)
                return
            bound = signature.bind(trainer, *args, **kwargs)

            def given(k: str) -> Any:
                return bound.arguments.get(k, signature.parameters[k].default)

            written = {k: given(k) for k in FIELDS if k in signature.parameters}
            redirected = {"default_root_dir": str(watch.scratch / "lightning")} if watch.scratch is not None else {}
            bound.arguments.update({**redirected, **watch.overrides})
            watch.info = {"class": type(trainer).__name__, "site": watch.site(),
                          "args": {k: _plain(v) for k, v in written.items()}, "overrides": dict(watch.overrides),
                          "in_force": {k: _plain(given(k)) for k in LIGHTNING_TUNABLE if k in signature.parameters},
                          "redirected": redirected}
            init(trainer, *bound.args[1:], **bound.kwargs)
            watch._follow(trainer)

        cls.__init__ = wrapped_init  # type: ignore[method-assign]

    def _follow(self, trainer: Any) -> None:
        """Keep the losses its strategy back-propagates (Lightning calls `strategy.backward` for every micro-step,
        automatic or manual optimization alike)."""
        self.trainer = weakref.ref(trainer)
        strategy = getattr(trainer, "strategy", None)
        backward = getattr(strategy, "backward", None)
        if backward is None:
            return
        losses = self.losses

        @selftime.own
        @functools.wraps(backward)
        def wrapped(closure_loss: Any, *args: Any, **kwargs: Any) -> Any:
            losses.add(closure_loss)
            return selftime.foreign(backward, closure_loss, *args, **kwargs)

        strategy.backward = wrapped

    def end_step(self) -> None:
        """An optimizer step of the followed optimizer ended: its loss is the micro-steps' sum; once, what the
        running Trainer knows (whether the module steps its optimizers itself, the steps it plans)."""
        self.losses.end_step()
        trainer = self.trainer() if self.trainer is not None else None
        if self.info is None or trainer is None or "automatic_optimization" in self.info:
            return
        module = getattr(trainer, "lightning_module", None)
        with contextlib.suppress(Exception):  # what the Trainer runs in ("32-true" when the script names none)
            self.info["precision_in_force"] = str(trainer.precision)
        self.info["automatic_optimization"] = bool(getattr(module, "automatic_optimization", True))
        planned = getattr(trainer, "max_steps", -1)
        if not planned or planned < 0:
            try:
                planned = trainer.estimated_stepping_batches
            except Exception:  # Lightning cannot tell (an iterable of unknown length): compile's pay-back unknown
                planned = None
        self.info["planned_steps"] = int(planned) if planned and planned != float("inf") else None

    def report(self) -> dict[str, Any] | None:
        if self.info is None:
            return None
        return {**self.info, "losses": self.losses.read()}


def _plain(value: Any) -> Any:
    """A JSON-able form of an argument (a precision given as an int, a strategy object by its class name)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
        return list(value)
    return type(value).__name__
