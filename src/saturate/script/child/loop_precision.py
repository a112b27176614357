"""A plain loop's precision, from outside: bf16 autocast applied (`Overrides.bf16_autocast`), the script's own
autocast noticed, and its per-step losses kept for the check a lower precision must pass.

- bf16 autocast for the whole script: autocast's state is turned on in the script's main thread at start-up
  (`torch.set_autocast_enabled` / `set_autocast_dtype`), as if its `__main__` ran inside `with
  torch.autocast(device, dtype=torch.bfloat16):` — the forward and the loss in bf16 where autocast lists an op,
  the weights, gradients and optimizer in fp32, no GradScaler needed. Its cache of cast weights is turned off:
  an autocast region that is never left would otherwise keep a weight's bf16 copy from before an optimizer step.
  Only the main thread (autocast's state is per thread), where a plain loop trains; a DataLoader's worker, forked
  or spawned, runs with autocast off again, as the script wrote it: its collate and transforms are not the
  training's forward.
- The script's own autocast: a `torch.autocast` region it enters in bf16 or fp16 is noted; `tune -- CMD` then
  says the script already trains in that precision and tries no other.
- Losses: in a trial, each backward pass's tensor (a scalar: the loss, already divided by the accumulation in
  the usual loop) is added on the device and summed per optimizer step (`losses.StepLosses`, read at the end):
  the trials start from the same seed, so the first steps' losses of bf16 against the script's own tell its
  error (`trainer_stages._loss_problem`, the tuner's tolerance).
"""

from __future__ import annotations

import os
from typing import Any

from saturate.script.child.losses import StepLosses


class LoopPrecision:
    """The precision side of a plain loop in the child (module docstring)."""

    def __init__(self, bf16_autocast: str | None, keep_losses: bool) -> None:
        self.device = bf16_autocast  # the device type whose ops run under bf16 autocast, or None
        self.keep_losses = keep_losses
        self.losses = StepLosses()
        self.own: str | None = None  # the lower precision of an autocast region the script entered itself

    def install(self, torch: Any, patches: Any) -> None:
        """Turn bf16 autocast on (when asked) and note the script's own autocast regions."""
        if self.device is not None:
            torch.set_autocast_enabled(self.device, True)
            torch.set_autocast_dtype(self.device, torch.bfloat16)
            torch.set_autocast_cache_enabled(False)
            os.register_at_fork(after_in_child=lambda: torch.set_autocast_enabled(self.device, False))
            self._spawned_workers_off(torch, patches)
        autocast = torch.amp.autocast_mode.autocast
        enter, loop = autocast.__enter__, self

        def entered(region: Any) -> Any:
            dtype = getattr(region, "fast_dtype", None)
            if getattr(region, "_enabled", False) and dtype in (torch.bfloat16, torch.float16) and loop.own is None:
                loop.own = "bf16" if dtype == torch.bfloat16 else "fp16"
            return enter(region)

        patches.replace(autocast, "__enter__", entered)

    def _spawned_workers_off(self, torch: Any, patches: Any) -> None:
        """A loader's worker started by spawn (`multiprocessing_context="spawn"`, or macOS's default) is a fresh
        interpreter: the shim installs the hooks in it too, with autocast on. In such a child (and only there: the
        parent pickles the worker's function by its name) the worker's loop is wrapped to turn autocast off first.
        A process spawned to train (`torch.multiprocessing.spawn`'s ranks) does not run that loop: it keeps it."""
        import multiprocessing

        if multiprocessing.current_process().name == "MainProcess":  # a spawned child is named as it starts (its
            return  # parent_process() is set only once its target runs; its sys.argv is its parent's)
        from torch.utils.data._utils import worker

        real, device = worker._worker_loop, self.device

        def worker_loop(*args: Any, **kwargs: Any) -> Any:
            torch.set_autocast_enabled(device, False)
            return real(*args, **kwargs)

        patches.replace(worker, "_worker_loop", worker_loop)

    def backward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A backward pass's tensor (`torch.autograd.backward`'s first argument), kept when it is one value."""
        tensors = args[0] if args else kwargs.get("tensors")
        if self.keep_losses and hasattr(tensors, "numel") and tensors.numel() == 1:
            self.losses.add(tensors.detach().float().reshape(()))

    def end_step(self) -> None:
        self.losses.end_step()

    def report(self) -> dict[str, Any]:
        return {"bf16_autocast": self.device, "own_autocast": self.own, "losses": self.losses.read()}
