"""saturate inside a Lightning `Trainer` run, from one line in the user's code:

    from saturate.integrations.lightning import SaturateCallback
    trainer = Trainer(..., callbacks=[SaturateCallback()])

What it adds (the same as the Transformers callback, through `integrations.callback.RunWatch`):
telemetry means over each logging window (`saturate/…` in the module's logs, every
`log_every_n_steps` optimizer steps) and over the run; samples/s counted from the batches the
Trainer fed (times the processes); MFU where FLOPs are known: counted once, with PyTorch's FLOP
counter, over the first training batch's forward and backward (an estimate of every batch's, labelled
so); the doctor's verdict over a window at the start of training (`callback.diagnosis`, printed once).
Kept as `callback.metrics` (the latest window) and `callback.summary` (the whole run).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from saturate.doctor.loop_facts import batch_len
from saturate.integrations.callback import RunWatch, Watched, peak_dtype


class SaturateCallback(Watched, Callback):
    """saturate's telemetry, samples/s, MFU and the doctor's verdict for a Lightning `Trainer` run.

    warmup, count_steps, steps: the doctor's window at the start of training (as `saturate.Profiler`).
    interval: seconds between telemetry readings. peak_flops: the MFU denominator per process in FLOP/s
    (default: `saturate.hardware.probe`'s for the precision in use). flops_per_sample: forward and backward
    FLOPs of one sample, when known (default: counted on the first batch). verbose: print the verdict and
    the end-of-run line (rank 0).
    """

    def __init__(self, *, warmup: int = 3, count_steps: int = 2, steps: int = 20, interval: float = 1.0,
                 peak_flops: float | None = None, flops_per_sample: float | None = None, verbose: bool = True) -> None:
        self.watch = RunWatch(warmup=warmup, count_steps=count_steps, steps=steps, interval=interval,
                              peak_flops=peak_flops, verbose=verbose, name="SaturateCallback")
        self.flops_per_sample = flops_per_sample
        self._counter: Any = None
        self._samples = 0  # this process's
        self._roots: list[Any] | None = None
        self._handles: list[Any] = []
        self._step = 0

    def _totals(self, trainer: Any) -> tuple[float, float]:
        samples = float(self._samples * max(1, trainer.world_size))
        return samples, samples * (self.flops_per_sample or 0.0)

    # --- the Trainer's events -----------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        precision = str(trainer.precision)
        low = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else None
        self._step = trainer.global_step
        self.watch.begin(pl_module.device, trainer.world_size, peak_dtype(low))
        self._roots: list[Any] | None = []  # modules called at the top level in the first batch

    def _find_model(self, trainer: Any, pl_module: Any) -> None:
        """After the first batch: the doctor's model is the module called at the top level (Lightning calls
        `training_step`, which need not call the LightningModule's own forward) owning most of the
        optimizer's parameters; the LightningModule when none was seen."""
        for handle in self._handles:
            handle.remove()
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
        found = sorted(self._roots or [], key=lambda m: -sum(id(p) in owned for p in m.parameters()))
        self._roots = None
        self.watch.profile(found[0] if found else pl_module, optimizer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._roots == [] and not self._handles:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            depth = [0]

            def pre(module: Any, args: Any) -> None:
                if depth[0] == 0 and self._roots is not None and module not in self._roots:
                    self._roots.append(module)
                depth[0] += 1

            def post(module: Any, args: Any, output: Any) -> None:
                depth[0] = max(0, depth[0] - 1)

            self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        if self.flops_per_sample is None and self._counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = batch_len(batch)
        self._samples += n
        if self._counter is not None and self.flops_per_sample is None:
            self._counter.__exit__(None, None, None)
            counted = self._counter.get_total_flops()
            self.flops_per_sample = counted / n if n and counted else 0.0
            if self.flops_per_sample:
                self.watch.notes.append(f"FLOPs per sample counted on the first batch: {self.flops_per_sample:.3g} "
                                        "(PyTorch's FLOP counter, forward and backward)")
        if self._roots is not None:
            self._find_model(trainer, pl_module)
        step = trainer.global_step
        if step == self._step:  # a micro-batch inside an accumulation
            return
        self._step = step
        samples, flops = self._totals(trainer)
        self.watch.step_end(step, samples, trainer.is_global_zero)
        if step % max(1, trainer.log_every_n_steps) == 0:
            metrics = self.watch.window(step, samples, flops)
            if metrics:
                pl_module.log_dict({f"saturate/{k}": float(v) for k, v in metrics.items()}, on_step=True,
                                   on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._counter is not None and self.flops_per_sample is None:  # no batch ended: the counter is still on
            self._counter.__exit__(None, None, None)
        samples, flops = self._totals(trainer)
        self.watch.end(trainer.global_step, samples, flops, trainer.is_global_zero)


__all__ = ["SaturateCallback"]
