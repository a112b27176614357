"""saturate inside a Transformers `Trainer` run, from one line in the user's code:

    from saturate.integrations.transformers import SaturateCallback
    trainer.add_callback(SaturateCallback())

What it adds to the run:
- telemetry: saturate's background sampler (`telemetry.Sampler`: GPU utilisation, memory, power; host
  CPU and RAM) for the whole run, its means over each logging window;
- samples/s, and MFU where FLOPs are known: the Trainer counts them (`model.floating_point_ops`, into
  `state.total_flos`), the peak is `saturate.hardware`'s (datasheet, else measured here), and an MFU
  above 100 % is not shown: the peak it was divided by is then not this device's real one, and that is said;
- the doctor's verdict: the doctor's `Profiler` on the model and optimizer the callback is handed, over
  a warm-up, a few counted and the timed steps at the start of training; the verdict and its fixes are
  printed once that window ends (kept as `callback.diagnosis`) and the instrument is removed.

The figures are `integrations.callback.RunWatch`'s, shared with the Lightning callback. The window's
figures go into the Trainer's logs as `saturate/…` (seen by loggers added after the
callback) and are kept as `callback.metrics`; the whole run's as `callback.summary` at its end. The
Trainer's data waits are not wrapped here (they are part of "everything else"); `saturate doctor -- CMD`
times them from outside.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from saturate.integrations.callback import RunWatch, Watched, mfu, peak_dtype

__all__ = ["SaturateCallback", "mfu"]


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside Accelerate's wrapper (whose own step hooks never run)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class SaturateCallback(Watched, TrainerCallback):
    """saturate's telemetry, samples/s, MFU and the doctor's verdict for a Transformers `Trainer` run.

    warmup, count_steps, steps: the doctor's window at the start of training (as `saturate.Profiler`).
    interval: seconds between telemetry readings. peak_flops: the MFU denominator per process in FLOP/s
    (default: `saturate.hardware.probe`'s for the precision in use, measured here when no datasheet row
    matches; about a second). verbose: print the verdict and the end-of-run line (rank 0).
    """

    def __init__(self, *, warmup: int = 3, count_steps: int = 2, steps: int = 20, interval: float = 1.0,
                 peak_flops: float | None = None, verbose: bool = True) -> None:
        self.watch = RunWatch(warmup=warmup, count_steps=count_steps, steps=steps, interval=interval,
                              peak_flops=peak_flops, verbose=verbose, name="SaturateCallback")
        self._samples_per_step = 0

    # --- the Trainer's events -----------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        processes = max(1, int(getattr(args, "world_size", 1) or 1))
        self._samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
        low = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        self.watch.begin(torch.device(args.device), processes, peak_dtype(low))
        self.watch.profile(model, _inner_optimizer(optimizer))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.step_end(state.global_step, state.global_step * self._samples_per_step, state.is_world_process_zero)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        metrics = self.watch.window(state.global_step, state.global_step * self._samples_per_step,
                                    float(state.total_flos))
        if logs is not None:
            logs.update({f"saturate/{k}": v for k, v in metrics.items()})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.end(state.global_step, state.global_step * self._samples_per_step, float(state.total_flos),
                       state.is_world_process_zero)
