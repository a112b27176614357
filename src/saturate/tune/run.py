"""`saturate run`: probe, tune, measure naive / the guide's plan / tuned side by side, train, compare.

The comparison rows are measured in this process, one after another, by the same method (real
training steps through each plan's own loader, after a warm-up step), so their ratios are fair on
a noisy machine; the last row is the training run itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from rich import box
from rich.console import Console
from rich.table import Table

from saturate.atomic import atomic_write_bytes
from saturate.engine.distributed import (
    DistInfo,
    all_reduce_scalar,
    broadcast_object,
    init_distributed,
    teardown_distributed,
)
from saturate.engine.summary import mfu_peak
from saturate.engine.trainer import RunConfig, RunResult, train
from saturate.errors import ConfigError
from saturate.hardware.mfu import Mfu, mfu
from saturate.plan import Plan, reference_plan
from saturate.tune.api import TuneResult, tune
from saturate.tune.measure import RealMeasurer
from saturate.tune.trial import Trial
from saturate.workloads.base import Workload

# The guide whose "after" plan applies, by device kind (shared/GUIDES.md): the A6000 guide for one
# NVIDIA GPU, the ROCm guide for AMD. On a CPU no guide applies.
GUIDE_AFTER = {"cuda": "a6000-after", "rocm": "rocm-after"}


@dataclass
class Row:
    label: str
    plan: Plan
    samples_per_s: float | None
    tokens_per_s: float | None
    step_s: float | None
    peak_memory_bytes: int | None
    utilisation: float | None  # share of the device busy (GPU) or of the usable cores (CPU), measured
    mfu: Mfu | None  # hardware.mfu: the figure, or why there is none (above the peak: never shown)
    status: str = "ok"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "plan": self.plan.to_dict() | {"provenance": None},
                "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s, "step_s": self.step_s,
                "peak_memory_bytes": self.peak_memory_bytes, "utilisation": self.utilisation,
                "mfu": self.mfu.value if self.mfu else None, "mfu_detail": self.mfu.to_dict() if self.mfu else None,
                "status": self.status, "note": self.note}


@dataclass
class RunReport:
    rows: list[Row]
    tuned: TuneResult
    training: RunResult
    run_dir: Path
    notes: list[str] = field(default_factory=list)


def at_effective_batch(plan: Plan, effective: int) -> Plan | None:
    """A reference plan measured at the workload's effective batch: its micro-batch kept (or the largest
    divisor below it), accumulation adjusted. None when nothing divides."""
    micro = max((d for d in range(1, min(plan.micro_batch, effective) + 1) if effective % d == 0), default=None)
    if micro is None:
        return None
    return plan.replace(micro_batch=micro, grad_accum=effective // micro)


def reference_plans(workload: Workload, device_type: str, world_size: int = 1) -> list[tuple[str, Plan]]:
    """The plans the tuned one is compared with, at the workload's effective batch over `world_size`
    processes (DDP when there are several, as the guides ran them)."""
    e = workload.optim.effective_batch // world_size
    out = [("naive", at_effective_batch(reference_plan("naive"), e))]
    # A workload from one of the guides (the time-series job, GPT-2 through Transformers) compares with that
    # guide's plans; otherwise the guide for this kind of device.
    guides = list(workload.guide_plans) or ([GUIDE_AFTER[device_type]] if device_type in GUIDE_AFTER else [])
    for guide in guides:
        out.append((f"guide: {guide}", at_effective_batch(reference_plan(guide), e)))
    strategy = "ddp" if world_size > 1 else "single"
    return [(label, p.replace(strategy=strategy)) for label, p in out if p is not None]


def compare(workload: Workload, hw: Any, plans: list[tuple[str, Plan]], *, seed: int = 0,
            min_seconds: float = 3.0, dist: DistInfo | None = None) -> list[Row]:
    """Measure each plan the same way, one after another, in this process (every rank together under
    torchrun; the rows then give the whole job's samples/s and the ranks' mean utilisation)."""
    dist = dist or DistInfo()
    measurer = RealMeasurer(workload, hw, seed=seed, min_seconds=min_seconds, max_steps=40, dist=dist)
    rows = []
    for label, plan in plans:
        with _Utilisation(hw, measurer.cores) as util:
            t = measurer.verify(plan)
        value = util.value
        if dist.world_size > 1:
            value = None if not all_reduce_scalar(value is not None, "min") else all_reduce_scalar(value or 0.0)
        rows.append(_row(label, plan, t, value, workload, hw, dist.world_size))
    return rows


def _row(label: str, plan: Plan, t: Trial, util: float | None, workload: Workload, hw: Any,
         world_size: int = 1) -> Row:
    sps = t.samples_per_s * world_size if t.samples_per_s else None  # a trial's figure is per process
    return Row(label, plan, sps, sps * workload.tokens_per_sample if sps else None, t.step_s, t.peak_memory_bytes,
               util if t.ok else None, _mfu(workload, hw, plan, sps, world_size), status=t.status, note=t.error)


def _mfu(workload: Workload, hw: Any, plan: Plan, samples_per_s: float | None, world_size: int) -> Mfu:
    peak, source = mfu_peak(hw, plan)  # one device's peak; the job has world_size of them
    return mfu((samples_per_s or 0) * (workload.flops_per_sample or 0), peak, source, world_size)


def run(workload: Workload, hardware: Any = None, *, budget_s: float | None = None, steps: int | None = None,
        minutes: float | None = None, run_dir: Path | None = None, allow_batch_change: bool = False,
        seed: int = 0, progress: bool = True, console: Console | None = None,
        try_compile: bool = True, source: dict[str, Any] | None = None,
        allow_micro_batch_change: bool = False) -> RunReport:
    from saturate.hardware import probe

    hw = hardware or probe(measure_peaks=True)
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dist = init_distributed(torch.device(hw.torch_device).type)  # under torchrun: every rank, together
    console = console or Console()
    if not dist.is_main:
        console = Console(quiet=True)  # rank 0 reports and writes
    chosen, problem = broadcast_object(_choose_run_dir(run_dir, workload) if dist.is_main else None)
    if problem:
        raise ConfigError(problem)
    run_dir = Path(chosen)
    planned = steps or workload.optim.steps
    tuned = tune(workload, hw, budget_s=budget_s, planned_steps=planned, allow_batch_change=allow_batch_change,
                 out_dir=run_dir / "tune", seed=seed, console=console, try_compile=try_compile,
                 allow_micro_batch_change=allow_micro_batch_change)
    console.print("[bold]Before/after[/bold]: measuring each plan side by side (same method, this process"
                  + (f"; {dist.world_size} processes" if dist.world_size > 1 else "") + ") …")
    plans = [*reference_plans(workload, hw.device_type, dist.world_size), ("tuned", tuned.plan)]
    rows = compare(workload, hw, plans, seed=seed, dist=dist)
    config = RunConfig(steps=steps, minutes=minutes, run_dir=run_dir, seed=seed, device=hw.torch_device,
                       progress=progress, source=source)  # source: so `train --resume --run-dir` alone continues
    training = train(workload, tuned.plan, config, hardware=hw)
    rows.append(Row("tuned: the training run", training.plan, training.samples_per_s, training.tokens_per_s,
                    training.train_seconds / max(1, training.steps) if training.steps else None,
                    training.peak_memory_bytes, None,
                    _mfu(workload, hw, training.plan, training.samples_per_s, dist.world_size),
                    note=f"{training.steps} steps, validation loss {training.val_loss:.3f}"
                    if training.val_loss is not None else f"{training.steps} steps"))
    report = RunReport(rows=rows, tuned=tuned, training=training, run_dir=run_dir)
    console.print(comparison_table(rows, workload, training.memory_kind))
    report.notes += [f"{r.label}: {r.mfu.text()}" for r in rows if r.mfu and r.mfu.exceeds_peak]
    for n in report.notes:
        console.print(f"[yellow]note:[/yellow] {n}")
    if dist.is_main:
        atomic_write_bytes(run_dir / "comparison.json", (json.dumps(
            {"workload": workload.name, "hardware": hw.to_dict(), "processes": dist.world_size,
             "rows": [r.to_dict() for r in rows], "plots": [str(p) for p in tuned.plots],
             "tuned_plan": str(tuned.plan_path)}, indent=2, default=str) + "\n").encode())
    console.print(f"run folder: {run_dir}  (tuned plan {tuned.plan_path}; plots: "
                  f"{', '.join(str(p) for p in tuned.plots) or 'none'}; comparison {run_dir / 'comparison.json'})")
    if made_group:
        teardown_distributed()
    return report


def _choose_run_dir(run_dir: Path | None, workload: Workload) -> tuple[str, str | None]:
    """The run folder, and why it cannot be used (None when it can)."""
    path = Path(run_dir) if run_dir else Path("runs") / f"{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if path.exists() and any(path.iterdir()):
        return str(path), f"run folder {path} is not empty; choose another --run-dir"
    return str(path), None


def comparison_table(rows: list[Row], workload: Workload, memory_kind: str) -> Table:
    t = Table(title=f"{workload.name}: before and after (measured in this run)", box=box.SIMPLE_HEAVY,
              title_justify="left")
    tokens = workload.tokens_per_sample > 1  # samples that are not tokens get no tokens/s column
    for col in ("plan", "micro×accum", "precision", "workers", *(["tokens/s"] if tokens else []), "samples/s",
                "step s", f"peak {memory_kind}", "utilisation", "MFU", "× naive"):
        t.add_column(col, justify="left" if col in ("plan", "precision") else "right")
    base = next((r.samples_per_s for r in rows if r.label == "naive" and r.samples_per_s), None)
    for r in rows:
        p = r.plan
        t.add_row(
            r.label, f"{p.micro_batch}×{p.grad_accum}", p.precision + ("+tf32" if p.tf32 else ""),
            str(p.num_workers), *([_f(r.tokens_per_s, "{:,.0f}")] if tokens else []), _f(r.samples_per_s, "{:.1f}"),
            _f(r.step_s, "{:.3f}"),
            "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:,.0f} MiB",
            _f(r.utilisation, "{:.0%}"), r.mfu.cell() if r.mfu else "-",
            _f(r.samples_per_s / base if base and r.samples_per_s else None, "{:.2f}×")
            if r.status == "ok" else r.status)
    return t


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


class _Utilisation:
    """Measured busy share over a block: GPU utilisation (NVML, sampled) or process CPU time / (wall × cores)."""

    def __init__(self, hw: Any, cores: int | None = None) -> None:
        self.hw = hw
        self.cores = cores or hw.cpu_cores  # this process's share of the cores (under torchrun)
        self.value: float | None = None

    def __enter__(self) -> _Utilisation:
        self._proc = psutil.Process()
        self._cpu0 = sum(self._proc.cpu_times()[:2])
        self._t0 = time.perf_counter()
        self._gpu = _GpuBusy(self.hw) if self.hw.device_type == "cuda" and torch.cuda.is_available() else None
        if self._gpu is not None:
            self._gpu.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t0
        if self._gpu is not None:
            self.value = self._gpu.stop()
        elif wall > 0:
            self.value = (sum(self._proc.cpu_times()[:2]) - self._cpu0) / (wall * max(1, self.cores))


class _GpuBusy:
    """Mean NVML utilisation of the training GPU, sampled every 100 ms; None if NVML cannot be read."""

    def __init__(self, hw: Any) -> None:
        import threading

        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        index = torch.device(hw.torch_device).index
        self._index = index if index is not None else torch.cuda.current_device()  # torchrun bound this rank's

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self._index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            while not self._stop.wait(0.1):
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # NVML missing or unreadable: utilisation is reported as not measured
            self.samples = []

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=2)
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None
