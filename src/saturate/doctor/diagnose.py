"""diagnose(workload, plan) -> Diagnosis: a short instrumented stretch of real training steps.

The steps are the trainer's own (`engine.step.Stepper`), fed by the plan's DataLoader, with the
instrument's timer around each phase. After the timed steps, a batch-scaling probe times one
forward+backward at the plan's micro-batch and at a larger one, which separates the fixed cost
of a micro-step (launches, Python, the framework) from the per-sample cost; the overhead,
memory and micro-batch predictions come from that fit. Nothing is written to disk but the trace of a few
steps after the timed ones, when `DoctorConfig.trace` names a folder (doctor/trace.py).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from saturate.doctor.findings import Diagnosis, ScalingProbe
from saturate.doctor.instrument import Instrument, contention_record, device_facts, loader_worker_pids
from saturate.doctor.loop_probe import again_on_one_thread, one_thread, probe_of, time_thread_counts, time_two_sizes
from saturate.doctor.phase_windows import Windows
from saturate.doctor.rules import decide
from saturate.doctor.trace import TRACE_STEPS, PhaseTrace
from saturate.engine.schedule import scaled_lr
from saturate.engine.step import OutOfMemoryError, Stepper, split_batch, to_device
from saturate.errors import ConfigError
from saturate.hardware.contention import ContentionMeter
from saturate.plan import Plan
from saturate.stats.noise import WindowRule
from saturate.workloads.base import Workload
from saturate.workloads.coupling import workload_default_plan


@dataclass
class DoctorConfig:
    """How long the instrumented stretch runs; nothing here changes a step."""

    steps: int = 10  # optimizer steps timed at least
    warmup: int = 2  # untimed steps first (compilation, allocator, loader start-up)
    count_steps: int = 1  # steps with synchronisations counted (not timed)
    # Timed at least this long, in windows of `min_seconds / rule.min_windows`, until the last windows' step
    # rates agree or the rule's cap (raised when other processes keep the machine busy): doctor.phase_windows.
    min_seconds: float = 2.0
    rule: WindowRule = field(default_factory=WindowRule)
    scaling: bool = True  # run the batch-scaling probe
    host_memory_budget: int | None = None  # bytes the job may use on the host (default: what is free)
    interval: float = 0.25  # telemetry sampling period, seconds
    seed: int = 0
    trace: Path | None = None  # a folder: the steps after the timed ones traced there (doctor/trace.py); None: not
    trace_steps: int = TRACE_STEPS

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("warmup", 0), ("count_steps", 0), ("trace_steps", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"doctor {name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.min_seconds < 0:
            raise ConfigError(f"doctor min-seconds must be >= 0, got {self.min_seconds}")
        if self.host_memory_budget is not None and self.host_memory_budget <= 0:
            raise ConfigError(f"host memory budget must be > 0, got {self.host_memory_budget}")


def diagnose(workload: Workload, plan: Plan | None = None, config: DoctorConfig | None = None,
             hardware: Any = None, device: str | None = None) -> Diagnosis:
    """Run `config.steps` instrumented steps of `workload` with `plan` and decide a verdict."""
    from saturate.hardware import probe

    cfg = config or DoctorConfig()
    hw = hardware or probe(measure_peaks=False, device=device)
    dev = torch.device(hw.torch_device)
    optim = workload.optim
    if plan is None:
        plan, _ = workload_default_plan(workload, hw)
    if plan.strategy != "single":
        raise ConfigError(f"the doctor runs one process; plan.strategy {plan.strategy!r} is not supported here")
    effective = plan.samples_per_step()
    notes: list[str] = []
    torch.manual_seed(cfg.seed)
    stepper = Stepper(workload, plan, dev, scaled_lr(optim.lr, optim.effective_batch, effective), notes=notes,
                      adapt_oom=False)
    pin = plan.pin_memory and dev.type == "cuda"
    from saturate.data.loaders import make_loader

    loader = make_loader(workload.train_data, plan, pin_memory=pin)
    batches = iter(loader)
    inst = Instrument(dev, compiled=plan.compile != "none", interval=cfg.interval,
                      host_budget=cfg.host_memory_budget)
    inst.worker_pids = loader_worker_pids(batches)
    # Loader workers start together and fill their queues in the first steps: warm up past that.
    warmup = max(cfg.warmup, -(-plan.num_workers * (plan.prefetch_factor or 2) // plan.grad_accum))
    try:
        for _ in range(warmup):
            stepper.step(batches)
        if cfg.count_steps:
            inst.begin_count()
            for _ in range(cfg.count_steps):
                stepper.step(batches, timer=inst.timer)
                inst.end_step()  # the count of each step, for its range
            inst.end_count(cfg.count_steps)
        meter = ContentionMeter().start()  # what else runs, over the timed steps and the probe
        windows = Windows(cfg.steps, cfg.min_seconds, cfg.min_seconds / cfg.rule.min_windows, cfg.rule)
        inst.begin_timing()
        start = time.perf_counter()
        done = 0
        while True:
            inst.begin_step()
            stepper.step(batches, timer=inst.timer)
            inst.end_step()
            done += 1
            if windows.step_done(done, time.perf_counter() - start, inst.step_seconds,
                                 lambda: meter.stop().significant()):
                break
        inst.window_ends = windows.ends
        inst.end_timing()
        if cfg.trace is not None:  # after the timed steps: the profiler colours none of their figures
            inst.begin_trace(PhaseTrace(dev, cfg.trace, cfg.trace_steps))
            while inst.mode == "trace":
                stepper.step(batches, timer=inst.timer)
                inst.end_step()
    finally:
        inst.end_trace()  # written, also when a step failed (what was traced)
        inst.close()
        del batches, loader  # stops the loader's workers (persistent ones too) before the probe
        gc.collect()
    probe = None
    single = None  # the probe on one thread, on a busy CPU (busy.py)
    ratios: list[float] = []  # with it, a micro-step on the plan's threads ÷ on one, per round
    if cfg.scaling:
        probe = scaling_probe(stepper, workload, plan, dev, notes)
        if probe is not None and again_on_one_thread(dev, meter.stop().significant()):
            threads = torch.get_num_threads()
            with one_thread():
                single = scaling_probe(stepper, workload, plan, dev, notes, also=lambda step: ratios.extend(
                    time_thread_counts(step, plan.micro_batch, threads, dev)))
    traced = inst.traced.steps if inst.traced is not None else 0
    item_s = time_items(workload, plan, done + warmup + cfg.count_steps + traced) if cfg.scaling else None
    contention = meter.stop()
    m = inst.measurements(
        context="plan", device_type=hw.device_type, samples_per_step=float(effective), micro_batch=plan.micro_batch,
        grad_accum=plan.grad_accum, num_workers=plan.num_workers, prefetch_factor=plan.prefetch_factor,
        pin_memory=pin, non_blocking=plan.non_blocking, precision=plan.precision, compile=plan.compile,
        **device_facts(dev, hw))
    m.scaling, m.scaling_one_thread = probe, single
    m.threads_ratios = tuple(ratios)
    m.item_s = item_s
    m.contention = contention_record(contention)
    m.notes = notes + m.notes
    m.trace = inst.traced.to_dict() if inst.traced is not None else None
    return decide(m)


def scaling_probe(stepper: Stepper, workload: Workload, plan: Plan, device: torch.device, notes: list[str],
                  reps: int = 5, also: Callable[[Callable[[int], None]], None] | None = None) -> ScalingProbe | None:
    """Forward+backward seconds and device memory at two micro-batch sizes, timed back to back in `reps` rounds
    (`loop_probe.time_two_sizes`; the probe built by `loop_probe.probe_of`); `also` as in
    `loop_probe.probe_from_inputs`."""
    small = plan.micro_batch
    large = max(2 * small, 4)
    try:
        batch = default_collate([workload.train_data[i] for i in range(large)])
    except Exception as e:  # a dataset that cannot be indexed from 0: say so, no probe
        notes.append(f"batch-scaling probe skipped: reading samples 0..{large - 1} failed ({type(e).__name__}: {e})")
        return None
    batch = to_device(batch, device, False)
    model = stepper.step_model
    chunks = {b: split_batch(batch, b)[0] for b in (small, large)}

    def step(b: int) -> None:
        with stepper.precision.autocast():
            loss = workload.loss_fn(model, chunks[b])
        loss.backward()
        stepper.model.zero_grad(set_to_none=True)

    try:
        times, memory = time_two_sizes(step, (small, large), device, reps)
        if also is not None:
            also(step)
    except OutOfMemoryError:
        stepper.model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        notes.append(f"batch-scaling probe: micro-batch {large} does not fit in device memory")
        return None
    return probe_of((small, large), times, memory)


def time_items(workload: Workload, plan: Plan, step: int, k: int = 16, reps: int = 3) -> float | None:
    """Seconds per extra sample of a loader batch read in this process: reading and collating.

    (time for k samples − time for 1) ÷ (k − 1), each the fastest of `reps`, so the per-batch cost
    of the loader stays out of it. Samples are the ones the loop would read next.
    """
    first = step * plan.samples_per_step()
    data = workload.train_data

    def batch_time(n: int) -> float:
        best = float("inf")
        for r in range(reps):
            start = first + r * k
            t0 = time.perf_counter()
            default_collate([data[i] for i in range(start, start + n)])
            best = min(best, time.perf_counter() - t0)
        return best

    try:
        return max(0.0, (batch_time(k) - batch_time(1)) / (k - 1))
    except Exception:  # a dataset that cannot be read outside its loader: the model does without
        return None
