"""What saturate's framework callbacks share (`transformers.SaturateCallback`, `lightning.SaturateCallback`):
telemetry over the run, samples/s and MFU per logging window and for the whole run, and the doctor's
verdict over a window at the start of training. The framework modules only translate their events:

    watch = RunWatch(warmup=3, count_steps=2, steps=20, interval=1.0, peak_flops=None, verbose=True)
    watch.begin(device, processes, dtype)                     # training starts
    watch.profile(model, optimizer)                           # the doctor's window from the next step
    watch.step_end(step, main)                                # after each optimizer step
    watch.window(step, samples, flops) -> {"samples_per_s", "mfu", "gpu/…", "host/…"}
    watch.end(step, samples, flops, main) -> the whole run's summary

`samples` and `flops` are running totals over all processes (FLOPs of forward and backward).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from saturate.errors import SaturateError
from saturate.hardware.mfu import mfu as shared_mfu
from saturate.telemetry import window_means


def mfu(samples_per_s: float, flops_per_sample: float, peak: float | None, source: str,
        processes: int = 1) -> tuple[float | None, str]:
    """Model FLOPs utilisation and its line, through `saturate.hardware.mfu` (never above 100 %)."""
    if peak and flops_per_sample <= 0:
        return None, "MFU unknown: no FLOPs were counted for the model"
    u = shared_mfu(samples_per_s * flops_per_sample, peak, source, processes)
    return u.value, u.text()


def peak_dtype(low_precision: str | None) -> str:
    """The peak table's dtype for a run in `low_precision` ("bf16", "fp16" or None: fp32, or TF32 when enabled)."""
    if low_precision in ("bf16", "fp16"):
        return low_precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


class RunWatch:
    """The sampler, the doctor's Profiler and the counters of one training run seen from a callback."""

    def __init__(self, *, warmup: int, count_steps: int, steps: int, interval: float, peak_flops: float | None,
                 verbose: bool, name: str) -> None:
        self.warmup, self.count_steps, self.steps = warmup, count_steps, steps
        self.interval, self.verbose, self.name = interval, verbose, name
        self.peak: tuple[float | None, str] = (peak_flops, "given") if peak_flops else (None, "unknown")
        self.diagnosis: Any = None
        self.metrics: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self.notes: list[str] = []
        self.profiler: Any = None
        self.sampler: Any = None
        self.device = torch.device("cpu")
        self.processes = 1
        self._mark: tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)  # time, step, samples, flops
        self._steady: tuple[float, int, float] | None = None  # time, step, samples once the warm-up is done
        self._start = 0.0

    def begin(self, device: torch.device, processes: int, dtype: str) -> None:
        """Training starts: the sampler and the clock; the peak FLOP/s for `dtype` unless given."""
        from saturate.telemetry import Sampler

        self.device, self.processes = device, max(1, processes)
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.sampler = Sampler(self.interval, torch_indices=[index] if index is not None else [], history=4096)
        self.sampler.start()
        if self.peak[0] is None:
            self.peak = self._probe_peak(dtype)
        self._start = time.perf_counter()
        self._mark = (self._start, 0, 0.0, 0.0)

    def profile(self, model: Any, optimizer: Any) -> None:
        """Start the doctor's window on `model` and `optimizer` (not under saturate's own hooks, which measure)."""
        if under_saturate_hooks():
            self.notes.append("running under saturate's hooks (saturate doctor/tune/run -- CMD): they measure the "
                              "steps; the callback adds telemetry, samples/s and MFU only")
            return
        from saturate.doctor.profiler import Profiler

        self.profiler = Profiler(model, optimizer, warmup=self.warmup, count_steps=self.count_steps,
                                 steps=self.steps, device=self.device, report=False)

    def step_end(self, step: int, samples: float, main: bool) -> None:
        if self._steady is None and step >= self.warmup:
            self._steady = (time.perf_counter(), step, samples)
        if self.profiler is None or self.diagnosis is not None:
            return
        self.profiler.step()
        if self.profiler.diagnosis is not None:
            self._diagnosed(self.profiler.diagnosis, main)

    def window(self, step: int, samples: float, flops: float) -> dict[str, float]:
        """The figures since the last window: samples/s, MFU where FLOPs were counted, telemetry means."""
        self._synchronize()
        now = time.perf_counter()
        start, _, samples0, flops0 = self._mark
        metrics: dict[str, float] = {}
        if samples > samples0 and now > start:
            sps = (samples - samples0) / (now - start)
            metrics["samples_per_s"] = sps
            value, _ = mfu(sps, (flops - flops0) / (samples - samples0), *self.peak, self.processes)
            if value is not None:
                metrics["mfu"] = value
        metrics.update(window_means(self.sampler.between(_monotonic_of(start, now), None) if self.sampler else []))
        self.metrics = metrics
        self._mark = (now, step, samples, flops)
        return metrics

    def end(self, step: int, samples: float, flops: float, main: bool) -> dict[str, Any]:
        self._synchronize()
        end = time.perf_counter()
        if self.profiler is not None and self.diagnosis is None:
            inst = self.profiler.instrument
            if inst.mode == "time" and inst.timed_steps >= 1:
                self._diagnosed(self.profiler.finish(), main, short=True)
            else:
                try:
                    self.profiler.finish()
                except SaturateError as e:
                    self.notes.append(f"no verdict: {e}")
        if self.sampler is not None:
            self.sampler.read_once()  # a closing reading: a run shorter than the interval still has one
            self.sampler.stop()
        snaps = self.sampler.between(_monotonic_of(self._start, end), None) if self.sampler else []
        t0, step0, samples0 = self._steady if self._steady and self._steady[1] < step else (self._start, 0, 0.0)
        sps = (samples - samples0) / (end - t0) if end > t0 and samples > samples0 else None
        per_sample = flops / samples if samples else 0.0
        summary: dict[str, Any] = {"steps": step, "samples": samples,
                                   "samples_per_step": samples / step if step else None, "samples_per_s": sps,
                                   "steps_timed_from": step0,
                                   "flops_per_sample": per_sample or None, "peak_flops": self.peak[0],
                                   "peak_source": self.peak[1], "telemetry": window_means(snaps)}
        if sps is not None:
            summary["mfu"], summary["mfu_note"] = mfu(sps, per_sample, *self.peak, self.processes)
        summary["verdict"] = self.diagnosis.verdict if self.diagnosis is not None else None
        summary["notes"] = list(self.notes)
        self.summary = summary
        if self.verbose and main:
            print(summary_line(summary), flush=True)
        return summary

    def _diagnosed(self, diagnosis: Any, main: bool, short: bool = False) -> None:
        self.diagnosis = diagnosis
        if self.verbose and main:
            from saturate.doctor.report import render

            timed = self.profiler.instrument.timed_steps
            render(diagnosis, title=f"saturate ({self.name}): the doctor on {timed} timed steps"
                                    + (" (training ended before the whole window)" if short else ""))

    def _probe_peak(self, dtype: str) -> tuple[float | None, str]:
        from saturate.hardware import probe

        try:
            hw = probe(measure_peaks=True, device=str(self.device))
        except SaturateError as e:
            return None, f"unknown ({e})"
        return hw.peak_flops(dtype)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def summary_line(s: dict[str, Any]) -> str:
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


def _monotonic_of(perf: float, now_perf: float) -> float:
    """A perf_counter() time as a time.monotonic() one (the sampler's clock)."""
    return time.monotonic() - (now_perf - perf)


def under_saturate_hooks() -> bool:
    hooks = sys.modules.get("saturate.script.child.hooks")
    return hooks is not None and getattr(hooks, "_script", None) is not None


class Watched:
    """What a framework callback shows of its RunWatch: the verdict, the latest window, the run's summary."""

    watch: RunWatch

    @property
    def diagnosis(self) -> Any:
        """The doctor's Diagnosis, once its window is complete."""
        return self.watch.diagnosis

    @property
    def metrics(self) -> dict[str, float]:
        """The latest logging window's figures."""
        return self.watch.metrics

    @property
    def summary(self) -> dict[str, Any]:
        """The whole run's, at its end."""
        return self.watch.summary
