"""Inside a user's script: a Lightning `Trainer`, recognised without importing Lightning.

The shim hands `hooks.imported()` the module `lightning.pytorch.trainer.trainer` (or
`pytorch_lightning.trainer.trainer`) once it has run; `LightningWatch.patch` wraps `Trainer.__init__`
to note the first Trainer's class, where it was made (`train.py:LINE`) and the arguments saturate's
fixes name (`FIELDS`: `precision=`, `accumulate_grad_batches=`, …) as the script passed them. In a
trial or a doctor run (not a full run) its `default_root_dir` (where Lightning writes its logs and
checkpoints unless a logger or checkpoint callback is given its own folder) points to a scratch folder.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

WATCHED = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")
FIELDS = ("precision", "accumulate_grad_batches", "max_steps", "max_epochs", "accelerator", "devices", "strategy",
          "default_root_dir")


class LightningWatch:
    """The first Lightning Trainer made in this process, as the script made it."""

    def __init__(self, scratch: Path | None, site: Callable[[], str | None]) -> None:
        self.scratch = scratch  # None: leave default_root_dir as written (a full run)
        self.site = site
        self.info: dict[str, Any] | None = None
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
            if watch.info is None:
                bound = signature.bind(trainer, *args, **kwargs)
                written = {k: bound.arguments.get(k, signature.parameters[k].default) for k in FIELDS
                           if k in signature.parameters}
                redirected = {}
                if watch.scratch is not None:
                    redirected["default_root_dir"] = str(watch.scratch / "lightning")
                    bound.arguments.update(redirected)
                    args, kwargs = bound.args[1:], bound.kwargs
                watch.info = {"class": type(trainer).__name__, "site": watch.site(),
                              "args": {k: _plain(v) for k, v in written.items()}, "redirected": redirected}
            init(trainer, *args, **kwargs)

        cls.__init__ = wrapped_init  # type: ignore[method-assign]

    def report(self) -> dict[str, Any] | None:
        return self.info


def _plain(value: Any) -> Any:
    """A JSON-able form of an argument (a precision given as an int, a strategy object by its class name)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
        return list(value)
    return type(value).__name__
