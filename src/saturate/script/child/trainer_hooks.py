"""Inside a user's script: a Hugging Face Transformers `Trainer`, recognised without importing Transformers.

The shim hands `hooks.imported()` the modules `transformers.training_args` and `transformers.trainer`
once they have run (whenever the script imports them); `TrainerWatch.patch` then wraps:

- `TrainingArguments.__post_init__`, to note where the script made its arguments (`train.py:LINE`);
- `Trainer.__init__`, to note the first Trainer's class, where it was made and the `TrainingArguments`
  fields saturate reads or tunes (`FIELDS`), and, before the Trainer reads them, to apply saturate's
  overrides (`{"trainer": {field: value}}`) and, in a trial, to point its output and logging folders to
  a scratch folder (and turn off hub pushes and experiment trackers) so a trial never writes where the
  script's real run does;
- `Trainer.training_step`, to keep each step's loss (the sum of its micro-steps' returned losses,
  which the Trainer already divides so that they add up to the step's loss, whatever the split) as a
  device tensor, read only when the report is written: no host sync is added to a step.

Overrides are applied by rebuilding the arguments with `dataclasses.replace` (Transformers' own
`__post_init__` then derives what depends on them: mixed precision from `bf16`, the optimizer name)
and copying the result into the script's own object, so code of the script that reads its
`training_args` later sees the same values as the Trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saturate.doctor import selftime
from saturate.script.child.losses import StepLosses

# TrainingArguments fields reported (those saturate may change: overrides.TRAINER_TUNABLE)
FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32",
          "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
          "dataloader_persistent_workers", "torch_compile", "gradient_checkpointing", "optim", "output_dir",
          "logging_dir", "max_steps", "num_train_epochs", "learning_rate", "seed", "report_to", "push_to_hub",
          "use_cpu", "logging_nan_inf_filter")


def field_values(args: Any) -> dict[str, Any]:
    """The `FIELDS` of a TrainingArguments that it has, as plain JSON values (enums by their value)."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        if hasattr(args, name):
            value = getattr(args, name)
            out[name] = getattr(value, "value", value)
    return out


def apply(args: Any, changes: dict[str, Any]) -> None:
    """Set `changes` on a TrainingArguments in place, with Transformers' own derivations re-run."""
    names = {f.name for f in dataclasses.fields(args) if f.init}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"not TrainingArguments fields here: {', '.join(unknown)}")
    changes = dict(changes)
    if "gradient_checkpointing" in changes and "activation_checkpointing" in names:
        changes["activation_checkpointing"] = changes["gradient_checkpointing"]  # its new name (Transformers 5)
    site = getattr(args, "_saturate_site", None)
    rebuilt = dataclasses.replace(args, **changes)
    vars(args).update(vars(rebuilt))
    if site is not None:
        args._saturate_site = site


class TrainerWatch:
    """What the wrapped Trainer saw in this process; `overrides` are `{"trainer": …}` of saturate's settings."""

    def __init__(self, overrides: dict[str, Any], scratch: Path | None, site: Callable[[], str | None]) -> None:
        self.overrides = dict(overrides)  # TrainingArguments fields (checked by `Overrides` against TRAINER_TUNABLE)
        self.scratch = scratch  # None: leave the output folders as written (a full run)
        self.site = site
        self.info: dict[str, Any] | None = None  # the first Trainer: class, sites, fields as written and in force
        self.trainer: weakref.ref | None = None
        self.losses = StepLosses()
        self._patched: set[str] = set()

    # --- wrapping Transformers ----------------------------------------------------------------

    def patch(self, name: str, module: Any) -> None:
        if name in self._patched:
            return
        if name == "transformers.training_args" and hasattr(module, "TrainingArguments"):
            self._patch_arguments(module.TrainingArguments)
        elif name == "transformers.trainer" and hasattr(module, "Trainer"):
            self._patch_trainer(module.Trainer, module)
        else:
            return
        self._patched.add(name)

    def _patch_arguments(self, cls: type) -> None:
        post_init = cls.__post_init__
        watch = self

        @functools.wraps(post_init)
        def wrapped(args: Any) -> None:
            post_init(args)
            if "_saturate_site" not in vars(args):
                args._saturate_site = watch.site()
                if from_command_line():  # HfArgumentParser made it: the user edits flags, not a call
                    args._saturate_from_command_line = True

        cls.__post_init__ = wrapped  # type: ignore[method-assign]

    def _patch_trainer(self, cls: type, module: Any) -> None:
        init, step = cls.__init__, cls.training_step
        signature = inspect.signature(init)
        watch = self

        @functools.wraps(init)
        def wrapped_init(trainer: Any, *args: Any, **kwargs: Any) -> None:
            if watch.info is None:
                bound = signature.bind(trainer, *args, **kwargs)
                if bound.arguments.get("args") is None:  # the Trainer's own default, made here to apply to it
                    bound.arguments["args"] = module.TrainingArguments(output_dir="tmp_trainer")
                args, kwargs = bound.args[1:], bound.kwargs
                watch._before(trainer, bound.arguments["args"])
            init(trainer, *args, **kwargs)

        @selftime.own
        @functools.wraps(step)
        def wrapped_step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            loss = selftime.foreign(step, trainer, *args, **kwargs)
            if watch.trainer is not None and watch.trainer() is trainer:
                watch.losses.add(loss)
            return loss

        cls.__init__ = wrapped_init  # type: ignore[method-assign]
        cls.training_step = wrapped_step  # type: ignore[method-assign]

    def _before(self, trainer: Any, args: Any) -> None:
        """The first Trainer, before it reads its arguments: note them, apply overrides, redirect outputs."""
        written = field_values(args)
        changes = dict(self.overrides)
        redirected: dict[str, Any] = {}
        if self.scratch is not None:
            redirected["output_dir"] = str(self.scratch / "output")
            if hasattr(args, "logging_dir"):
                redirected["logging_dir"] = str(self.scratch / "logs")
            if getattr(args, "push_to_hub", False):
                redirected["push_to_hub"] = False
            if getattr(args, "report_to", None):
                redirected["report_to"] = []
        error = None
        if redirected:  # first and alone, so that an override refused below still leaves the outputs redirected
            apply(args, redirected)
        if changes:
            try:
                apply(args, changes)
            except (ValueError, TypeError) as e:  # an override this Transformers refuses: said in the report
                error = f"{type(e).__name__}: {e}"
        self.trainer = weakref.ref(trainer)
        self.info = {"class": type(trainer).__name__, "site": self.site(),
                     "args_class": type(args).__name__, "args_site": getattr(args, "_saturate_site", None),
                     "args_from_command_line": bool(getattr(args, "_saturate_from_command_line", False)),
                     "args": written, "in_force": field_values(args), "overrides": changes,
                     "redirected": redirected, "error": error}

    # --- steps --------------------------------------------------------------------------------

    def end_step(self) -> None:
        """An optimizer step of the followed optimizer ended: its loss is the micro-steps' sum."""
        self.losses.end_step()
        trainer = self.trainer() if self.trainer is not None else None
        if self.info is not None and "planned_steps" not in self.info and trainer is not None:
            state = getattr(trainer, "state", None)  # the Trainer knows its steps once training started
            self.info["planned_steps"] = getattr(state, "max_steps", None) or None

    def report(self) -> dict[str, Any] | None:
        """The first Trainer and its per-step losses (read from the device now), for the report."""
        if self.info is None:
            return None
        return {**self.info, "losses": self.losses.read()}


def from_command_line() -> bool:
    """Whether the TrainingArguments being made come from Transformers' `HfArgumentParser` (the script's command line
    or a JSON/YAML file it parses), judged by the calling frames."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith("hf_argparser.py"):
            return True
        frame = frame.f_back
    return False
