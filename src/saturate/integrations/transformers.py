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

The window's figures go into the Trainer's logs as `saturate/…` (seen by loggers added after the
callback) and are kept as `callback.metrics`; the whole run's as `callback.summary` at its end. The
Trainer's data waits are not wrapped here (they are part of "everything else"); `saturate doctor -- CMD`
times them from outside.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import TrainerCallback

from saturate.errors import SaturateError
from saturate.hardware.mfu import mfu as shared_mfu
from saturate.telemetry import window_means


def mfu(samples_per_s: float, flops_per_sample: float, peak: float | None, source: str,
        processes: int = 1) -> tuple[float | None, str]:
    """Model FLOPs utilisation and its line, through `saturate.hardware.mfu` (never above 100 %)."""
    if peak and flops_per_sample <= 0:
        return None, "MFU unknown: the Trainer counted no FLOPs (the model has no floating_point_ops)"
    u = shared_mfu(samples_per_s * flops_per_sample, peak, source, processes)
    return u.value, u.text()


def _peak_dtype(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside Accelerate's wrapper (whose own step hooks never run)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class SaturateCallback(TrainerCallback):
    """saturate's telemetry, samples/s, MFU and the doctor's verdict for a Transformers `Trainer` run.

    warmup, count_steps, steps: the doctor's window at the start of training (as `saturate.Profiler`).
    interval: seconds between telemetry readings. peak_flops: the MFU denominator per process in FLOP/s
    (default: `saturate.hardware.probe`'s for the precision in use, measured here when no datasheet row
    matches; about a second). verbose: print the verdict and the end-of-run line (rank 0).
    """

    def __init__(self, *, warmup: int = 3, count_steps: int = 2, steps: int = 20, interval: float = 1.0,
                 peak_flops: float | None = None, verbose: bool = True) -> None:
        self.warmup, self.count_steps, self.steps = warmup, count_steps, steps
        self.interval, self.verbose = interval, verbose
        self.peak: tuple[float | None, str] = (peak_flops, "given") if peak_flops else (None, "unknown")
        self.diagnosis: Any = None  # the doctor's Diagnosis, once its window is complete
        self.metrics: dict[str, float] = {}  # the latest logging window's figures
        self.summary: dict[str, Any] = {}  # the whole run's, at its end
        self.notes: list[str] = []
        self.profiler: Any = None
        self.sampler: Any = None
        self._samples_per_step = 0
        self._processes = 1
        self._mark: tuple[float, int, float] = (0.0, 0, 0.0)  # time, step, total_flos at the window's start
        self._steady: tuple[float, int] | None = None  # time and step once the warm-up steps are done
        self._start = 0.0

    # --- the Trainer's events -----------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        from saturate.telemetry import Sampler

        device = torch.device(args.device)
        self._processes = max(1, int(getattr(args, "world_size", 1) or 1))
        self._samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * \
            self._processes
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.sampler = Sampler(self.interval, torch_indices=[index] if index is not None else [], history=4096)
        self.sampler.start()
        if self.peak[0] is None:
            self.peak = self._probe_peak(args, device)
        if _under_saturate_hooks():
            self.notes.append("running under saturate's hooks (saturate doctor/tune/run -- CMD): they measure the "
                              "steps; the callback adds telemetry, samples/s and MFU only")
        else:
            from saturate.doctor.profiler import Profiler

            inner = _inner_optimizer(optimizer)
            self.profiler = Profiler(model, inner, warmup=self.warmup, count_steps=self.count_steps,
                                     steps=self.steps, device=device, report=False)
        self._start = time.perf_counter()
        self._mark = (self._start, state.global_step, float(state.total_flos))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._steady is None and state.global_step >= self.warmup:
            self._steady = (time.perf_counter(), state.global_step)
        if self.profiler is None or self.diagnosis is not None:
            return
        self.profiler.step()
        if self.profiler.diagnosis is not None:
            self._diagnosed(self.profiler.diagnosis, state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        _synchronize(args)
        now = time.perf_counter()
        start, step, flos = self._mark
        steps = state.global_step - step
        metrics: dict[str, float] = {}
        if steps > 0 and now > start:
            sps = steps * self._samples_per_step / (now - start)
            metrics["samples_per_s"] = sps
            per_sample = (float(state.total_flos) - flos) / (steps * self._samples_per_step)
            value, _ = mfu(sps, per_sample, self.peak[0], self.peak[1], self._processes)
            if value is not None:
                metrics["mfu"] = value
        metrics.update(window_means(self.sampler.between(_monotonic_of(start, now), None) if self.sampler else []))
        self.metrics = metrics
        self._mark = (now, state.global_step, float(state.total_flos))
        if logs is not None:
            logs.update({f"saturate/{k}": v for k, v in metrics.items()})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _synchronize(args)
        end = time.perf_counter()
        if self.profiler is not None and self.diagnosis is None:
            inst = self.profiler.instrument
            if inst.mode == "time" and inst.timed_steps >= 1:
                self._diagnosed(self.profiler.finish(), state, short=True)
            else:
                try:
                    self.profiler.finish()
                except SaturateError as e:
                    self.notes.append(f"no verdict: {e}")
        snaps = self.sampler.between(_monotonic_of(self._start, end), None) if self.sampler else []
        if self.sampler is not None:
            self.sampler.stop()
        steps = state.global_step
        steady_t, steady_step = self._steady if self._steady and self._steady[1] < steps else (self._start, 0)
        sps = (steps - steady_step) * self._samples_per_step / (end - steady_t) if end > steady_t else None
        per_sample = float(state.total_flos) / (steps * self._samples_per_step) if steps else 0.0
        summary: dict[str, Any] = {"steps": steps, "samples_per_step": self._samples_per_step,
                                   "samples_per_s": sps, "steps_timed_from": steady_step,
                                   "flops_per_sample": per_sample or None, "peak_flops": self.peak[0],
                                   "peak_source": self.peak[1], "telemetry": window_means(snaps)}
        if sps is not None:
            summary["mfu"], summary["mfu_note"] = mfu(sps, per_sample, self.peak[0], self.peak[1], self._processes)
        summary["verdict"] = self.diagnosis.verdict if self.diagnosis is not None else None
        summary["notes"] = list(self.notes)
        self.summary = summary
        if self.verbose and state.is_world_process_zero:
            print(_summary_line(summary), flush=True)

    # --- helpers ------------------------------------------------------------------------------

    def _diagnosed(self, diagnosis: Any, state: Any, short: bool = False) -> None:
        self.diagnosis = diagnosis
        if self.verbose and state.is_world_process_zero:
            from saturate.doctor.report import render

            timed = self.profiler.instrument.timed_steps
            render(diagnosis, title=f"saturate (SaturateCallback): the doctor on {timed} timed steps"
                                    + (" (training ended before the whole window)" if short else ""))

    def _probe_peak(self, args: Any, device: torch.device) -> tuple[float | None, str]:
        from saturate.hardware import probe

        try:
            hw = probe(measure_peaks=True, device=str(device))
        except SaturateError as e:
            return None, f"unknown ({e})"
        return hw.peak_flops(_peak_dtype(args))


def _summary_line(s: dict[str, Any]) -> str:
    parts = [f"saturate: {s['steps']} steps"]
    if s.get("samples_per_s"):
        parts.append(f"{s['samples_per_s']:.1f} samples/s (measured from step {s['steps_timed_from']})")
    if s.get("mfu") is not None:
        parts.append(f"MFU {s['mfu_note']}")
    elif s.get("mfu_note"):
        parts.append(s["mfu_note"])
    tel = s.get("telemetry") or {}
    if "gpu/util_pct" in tel:
        parts.append(f"GPU {tel['gpu/util_pct']:.0f} % busy")
    if "host/cpu_pct" in tel:
        parts.append(f"host CPU {tel['host/cpu_pct']:.0f} %")
    if s.get("verdict"):
        parts.append(f"verdict: {s['verdict']}")
    return "; ".join(parts)


def _synchronize(args: Any) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _monotonic_of(perf: float, now_perf: float) -> float:
    """A perf_counter() time as a time.monotonic() one (the sampler's clock)."""
    return time.monotonic() - (now_perf - perf)


def _under_saturate_hooks() -> bool:
    import sys

    hooks = sys.modules.get("saturate.integrations.hooks")
    return hooks is not None and getattr(hooks, "_script", None) is not None
