"""TrainingWatch: the background sampler during training, its metrics and its warning.

A `telemetry.Sampler` reads the GPU (NVML / AMD SMI) and the host about once a second in a
daemon thread. At each metrics record the trainer asks for the means since the previous record
(`gpu/util_pct`, `gpu/mem_used_gib`, `gpu/power_w`, `gpu/temp_c`, `host/cpu_pct`,
`host/ram_used_pct`, `host/swap_used_gib`), plus two figures the watch measures itself:
`time/data_wait_share`, the share of wall time the loop waited for the DataLoader (host clock
around `next()`, through the Stepper's timer hook, so no device sync), and on a CPU run
`cpu/util_pct`, the training process's CPU time over the wall time and usable cores (the CPU is
the device there), and `host/other_cores`, the cores other processes kept busy (hardware/contention.py: this
job's own process tree not counted). A figure not measured is left out, never written as 0.

When the device stays under `POLICY.job.low_util_pct` busy for a sustained stretch (every record over
the last `sustained_s` by default), one note names the likeliest cause from these cheap signals, and another only
after utilisation has recovered and dropped again.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

import torch

from saturate.hardware.contention import ContentionMeter
from saturate.policy import POLICY, Load
from saturate.telemetry import Sampler, window_means

_NULL = contextlib.nullcontext()


class TrainingWatch:
    def __init__(self, device: torch.device, note: Callable[[str], None], *, enabled: bool = True,
                 interval: float = 1.0, low_util_pct: float = POLICY.job.low_util_pct,
                 sustained_s: float = POLICY.job.sustained_s) -> None:
        self.device = device
        self.note = note
        self.enabled = enabled
        self.low_util_pct = low_util_pct
        self.sustained_s = sustained_s
        self.sampler: Sampler | None = None
        if enabled:
            index = device.index if device.index is not None else (
                torch.cuda.current_device() if device.type == "cuda" else None)
            self.sampler = Sampler(interval, torch_indices=[index] if index is not None else [], history=4096)
        from saturate.hardware import usable_cores

        self.cores = usable_cores()[0]
        self.data_s = 0.0  # seconds spent waiting for the loader since the last record
        self._window_start = time.monotonic()
        self._cpu_start = time.process_time()
        self._meter = ContentionMeter(gpu=False)  # other processes' cores per window (host/other_cores)
        self._history: deque[tuple[float, float, float | None, float, dict[str, float]]] = deque(maxlen=512)
        self._warned = False
        self._data_cm = _DataTimer(self)

    # --- the Stepper's timer hook: only the wait for data is timed ------------------------------

    def timer(self, phase: str) -> contextlib.AbstractContextManager:
        return self._data_cm if phase == "data" and self.enabled else _NULL

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> TrainingWatch:
        if self.sampler is not None:
            self.sampler.start()
        self.reset()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def reset(self) -> None:
        """Start a new window (the trainer's own window restarts after validation and checkpoints)."""
        self.data_s = 0.0
        self._window_start = time.monotonic()
        self._cpu_start = time.process_time()
        if self.enabled:
            self._meter.start()

    # --- at each metrics record -------------------------------------------------------------------

    def window_metrics(self) -> dict[str, float]:
        """Means over the window since the last call, then a new window. Empty when disabled."""
        if not self.enabled:
            return {}
        now = time.monotonic()
        wall = now - self._window_start
        metrics: dict[str, float] = {}
        if wall > 0:
            metrics["time/data_wait_share"] = min(1.0, self.data_s / wall)
        others = self._meter.stop().other_cores if self._meter._start is not None else None
        if others is not None:
            metrics["host/other_cores"] = others
        util: float | None = None
        if self.device.type == "cpu" and wall > 0:
            util = min(100.0, 100 * (time.process_time() - self._cpu_start) / wall / self.cores)
            metrics["cpu/util_pct"] = util
        snaps = self.sampler.between(self._window_start, now) if self.sampler is not None else []
        if snaps:
            metrics.update(window_means(snaps))
            if self.device.type != "cpu":
                util = metrics.get("gpu/util_pct")
        self._history.append((self._window_start, now, util, metrics.get("time/data_wait_share", 0.0), metrics))
        self.reset()
        self._check()
        return metrics

    def _check(self) -> None:
        if not self._history:
            return
        end = self._history[-1][1]
        stretch = [h for h in self._history if h[1] >= end - self.sustained_s]
        # The stretch must reach back over the whole sustained span, with every window measured.
        covered = end - min(h[0] for h in stretch)
        utils = [h[2] for h in stretch]
        if any(u is None for u in utils) or covered < self.sustained_s:
            return
        low = all(u < self.low_util_pct for u in utils)  # type: ignore[operator]
        if low and not self._warned:
            self._warned = True
            self.note(self._message(stretch, covered))
        elif not low and self._history[-1][2] >= self.low_util_pct:  # type: ignore[operator]
            self._warned = False  # recovered: a later drop is worth another note

    def _message(self, stretch: list[tuple[float, float, float | None, float, dict[str, float]]],
                 covered: float) -> str:
        mean_util = sum(h[2] for h in stretch) / len(stretch)  # type: ignore[misc]
        spans = [h[1] - h[0] for h in stretch]
        data_share = sum(h[3] * s for h, s in zip(stretch, spans, strict=True)) / max(sum(spans), 1e-9)
        last = stretch[-1][4]
        what = "the CPU (the training device)" if self.device.type == "cpu" else "the GPU"
        head = (f"{what} has been under {self.low_util_pct:.0f} % busy for the last {covered:.0f} s "
                f"(mean {mean_util:.0f} %); ")
        ram = last.get("host/ram_used_pct")
        if data_share >= 0.2:
            return head + (f"likeliest cause: waiting for data ({100 * data_share:.0f} % of the time); raise "
                           "plan.num_workers (saturate doctor predicts the gain)")
        if ram is not None and ram >= 90:
            return head + (f"likeliest cause: host memory ({ram:.0f} % of RAM used); lower plan.num_workers or "
                           "plan.prefetch_factor")
        others = [h[4].get("host/other_cores") for h in stretch]
        if all(o is not None for o in others):
            busy = sum(others) / len(others)  # type: ignore[arg-type]
            if Load(busy, self.cores).busy:
                return head + (f"likeliest cause: other processes (they kept {busy:.1f} of {self.cores} cores "
                               "busy over the stretch, measured)" + (
                                   "; fewer torch threads (torch.set_num_threads) stall less behind them"
                                   if self.device.type == "cpu" else ": the host feeds the GPU slower"))
        host_cpu = last.get("host/cpu_pct")
        if self.device.type == "cpu" and host_cpu is not None and host_cpu >= 90:
            return head + f"likeliest cause: other processes using the CPU (host {host_cpu:.0f} % busy)"
        return head + ("not the data and not host memory: likely host syncs or launch overhead; "
                       "`saturate doctor` measures the split")


class _DataTimer:
    def __init__(self, watch: TrainingWatch) -> None:
        self.watch = watch
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.watch.data_s += time.perf_counter() - self.t0
