"""train(workload, plan) -> RunResult: builders first, then a short loop.

Order of wrapping (fixed): activation checkpointing -> compile -> (DDP/FSDP, later).
No host sync inside a step: the loss sum, gradient norm and counters stay on the device and are
read only when logging, validating or checkpointing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from saturate.atomic import atomic_path, atomic_write_bytes
from saturate.data.windows import eval_loader, make_loader
from saturate.engine.checkpoint import CheckpointManager
from saturate.engine.console import ConsoleSink
from saturate.engine.distributed import dist_info
from saturate.engine.hostmem import HostMemoryGuard, relieve
from saturate.engine.metrics import JsonlSink, Sink, tensorboard_sink
from saturate.engine.precision import Precision
from saturate.engine.schedule import WarmupCosine, scaled_lr
from saturate.engine.step import Stepper, rng_state, set_rng_state, to_device
from saturate.errors import CheckpointError, ConfigError, SaturateError
from saturate.hardware import synchronize
from saturate.plan import Plan, default_plan
from saturate.workload import Workload

CHECKPOINT_FORMAT = 1


@dataclass
class RunConfig:
    """How long and where to run; nothing here changes the maths of a step."""

    steps: int | None = None  # optimizer steps in the schedule (default: the workload's)
    minutes: float | None = None  # wall-clock budget; alone, it also sizes the schedule
    run_dir: Path | None = None  # default: runs/<workload>-<timestamp>
    resume: bool = False  # continue from the newest checkpoint in run_dir
    seed: int = 0
    device: str | None = None  # default: the best device probe() finds
    log_every: int = 10  # optimizer steps between metric reads (each read is one host sync)
    eval_every: int | None = None  # default: the workload's
    ckpt_every: int | None = None  # default: eval_every
    keep_checkpoints: int = 3
    progress: bool = True  # console output (rich progress on a terminal, lines otherwise)
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    export_weights: bool = True  # model.safetensors at the end
    use_tuned: bool = True  # with no plan given, use the tuned plan cached for this workload and hardware
    host_memory_guard: bool = True  # lower loader prefetch/workers when host RAM runs short or swap grows

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {v}")
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"minutes must be > 0, got {self.minutes}")


@dataclass
class RunResult:
    run_dir: Path
    plan: Plan
    steps: int  # optimizer steps completed (in total, across resumes)
    total_steps: int  # the schedule's length
    train_seconds: float  # wall time spent in steps this session (validation excluded)
    tokens_per_s: float | None
    samples_per_s: float | None
    mfu: float | None  # model FLOPs utilisation against `peak_label`
    peak_label: str
    peak_memory_bytes: int | None  # device peak on GPUs; host peak RSS on CPU
    memory_kind: str  # "device" or "host RSS"
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    weights: Path | None
    stopped_early: bool  # fewer steps than the schedule: a time budget ran out, or Ctrl-C
    interrupted: bool  # Ctrl-C (SIGINT) asked the run to stop
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the workload's own end-of-run metrics (evaluate)


def train(workload: Workload, plan: Plan | None = None, config: RunConfig | None = None,
          hardware: Any = None) -> RunResult:
    """Train `workload` with `plan`; resume from the run folder when config.resume is set.

    plan=None means the checkpoint's plan when resuming, else the seed plan (`default_plan`).
    """
    from saturate.hardware import measure_matmul_peak, probe

    cfg = config or RunConfig()
    dist = dist_info()
    hw = hardware or probe(measure_peaks=False, device=cfg.device)
    device = torch.device(hw.torch_device)
    notes: list[str] = []
    optim_cfg = workload.optim
    eval_every = cfg.eval_every or optim_cfg.eval_every
    ckpt_every = cfg.ckpt_every or eval_every

    run_dir = _prepare_run_dir(cfg.run_dir, cfg.resume, workload)
    ckpts = CheckpointManager(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    state = _load_resume_state(ckpts) if cfg.resume else None
    if state is None and ckpts.checkpoints():
        raise CheckpointError(f"run folder {run_dir} already holds checkpoints; pass --resume to continue "
                              "it or choose another --run-dir")
    plan = _choose_plan(plan, state, workload, hw, cfg, notes)
    if dist.world_size > 1 or plan.strategy != "single":
        raise ConfigError(f"plan.strategy {plan.strategy!r} with {dist.world_size} process(es): only "
                          "single-process training is available in this version")
    effective = plan.samples_per_step(dist.world_size)
    fingerprint = {**workload.fingerprint(), "effective_batch": str(effective)}
    if state is not None:
        _check_fingerprint(state, fingerprint, workload.identity)

    # Build everything before the loop.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    lr = scaled_lr(optim_cfg.lr, optim_cfg.effective_batch, effective)
    if effective != optim_cfg.effective_batch:
        notes.append(f"effective batch {effective} differs from the workload's {optim_cfg.effective_batch}: "
                     f"learning rate scaled linearly {optim_cfg.lr:g} -> {lr:g}")
    stepper = Stepper(workload, plan, device, lr, notes=notes, compile=False)
    model, optimizer, precision = stepper.model, stepper.optimizer, stepper.precision
    total_steps = cfg.steps or optim_cfg.steps
    schedule = WarmupCosine(lr, optim_cfg.warmup_steps, total_steps, lr * optim_cfg.min_lr_ratio)
    step, elapsed_before = 0, 0.0
    if state is not None:
        step = state["step"]
        elapsed_before = state["train_seconds"]
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        schedule.peak_lr, schedule.min_lr = lr, lr * optim_cfg.min_lr_ratio
        if precision.scaler is not None and state.get("scaler"):
            precision.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        total_steps = schedule.total_steps if cfg.steps is None else cfg.steps
        schedule.total_steps = total_steps
        if state["plan"] != plan.to_dict():
            notes.append("resumed with a different plan than the checkpoint's (same effective batch)")
    start_step = step
    stepper.compile_model()  # after loading: the compile probe restores the RNG it uses
    stepper.steps_done = step  # so an OOM adaptation names the global step
    pin = plan.pin_memory and device.type == "cuda"
    if plan.pin_memory and not pin:
        notes.append(f"pin_memory has no effect on {device.type}; not used")
    peak, peak_label = mfu_peak(hw, plan, measure_matmul_peak)

    resume_step = step if state is not None else None
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step)]
    if cfg.tensorboard and (tb := tensorboard_sink(run_dir / "tensorboard", resume_step)) is not None:
        sinks.append(tb)
    console = ConsoleSink(total_steps, start_step=step, enabled=cfg.progress and dist.is_main)
    sinks.append(console)
    plan.save(run_dir / "plan.toml")
    _write_json(run_dir / "run.json", {
        "workload": workload.name, "info": workload.info, "fingerprint": fingerprint,
        "effective_batch": effective, "lr": lr, "total_steps": total_steps, "seed": cfg.seed,
        "device": hw.torch_device, "hardware": hw.fingerprint(), "notes": notes})
    for n in notes:
        console.note(n)
    console.start(workload, plan, hw, effective, total_steps, resumed_from=step if state else None)

    loader = make_loader(workload.train_data, plan, start_step=step, pin_memory=pin)
    # Built once, so persistent workers really persist between validations.
    val_loader = eval_loader(workload.val_data, plan, pin) if workload.val_data is not None else None
    batches: Iterator[Any] = iter(loader)
    window_steps, window_start = 0, _now(device)
    train_seconds, val_loss, train_loss = 0.0, None, None
    deadline = time.monotonic() + cfg.minutes * 60 if cfg.minutes else None
    size_schedule_at = step + 5 if (cfg.minutes and cfg.steps is None and state is None) else None
    last_ckpt: Path | None = None
    extra_metrics: dict[str, float] = {}
    stop = _StopFlag()
    guard = HostMemoryGuard() if cfg.host_memory_guard else None
    model.train()

    with stop.installed(), _closing(sinks):
        while step < total_steps and not stop.requested:
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            adapted = len(stepper.adaptations)
            stepper.step(batches)
            if len(stepper.adaptations) > adapted:  # an OOM was absorbed: record the plan now in force
                plan = stepper.current_plan()
                plan.save(run_dir / "plan.toml")
                console.note(notes[-1])
                if val_loader is not None:  # validation runs at the smaller micro-batch too
                    val_loader = eval_loader(workload.val_data, plan, pin)
            step += 1
            window_steps += 1
            console.advance(step)  # host-only: moves the bar and ETA, reads nothing from the device

            eval_due = val_loader is not None and (step % eval_every == 0 or step == total_steps)
            ckpt_due = step % ckpt_every == 0 or step == total_steps or stop.requested or _past(deadline)
            # Log before every validation and checkpoint too: the timing window then never spans
            # them, and no checkpoint is written for a step whose loss was not checked.
            if step % cfg.log_every == 0 or step == size_schedule_at or eval_due or ckpt_due:
                seconds = _now(device) - window_start  # _now synchronises the device first
                train_seconds += seconds
                train_loss = stepper.take_loss_sum().item() / window_steps  # deliberate sync: logging
                if not math.isfinite(train_loss):
                    raise SaturateError(f"training loss became {train_loss} at step {step}; lower the learning "
                                        "rate or use fp32/bf16 (the last checkpoint is kept)")
                metrics = _step_metrics(workload, plan, effective, window_steps, seconds, train_loss,
                                        stepper.grad_norm, schedule.lr(step - 1), peak, device)
                for s in sinks:
                    s.log(step, metrics)
                window_steps, window_start = 0, _now(device)
                if step == size_schedule_at:
                    total_steps = _steps_for_budget(step, seconds / 5, deadline, console)
                    schedule.total_steps = total_steps
                if guard is not None and (why := guard.pressure()) and (eased := relieve(plan)) is not None:
                    plan, change = eased  # restart the loaders now, at a step boundary, with less memory
                    stepper.plan = plan
                    loader = make_loader(workload.train_data, plan, start_step=step, pin_memory=pin)
                    batches = iter(loader)
                    if val_loader is not None:
                        val_loader = eval_loader(workload.val_data, plan, pin)
                    plan.save(run_dir / "plan.toml")
                    notes.append(f"step {step}: {why}; lowered {change} and restarted the loader")
                    console.note(notes[-1])
            if eval_due:
                val_loss = _evaluate(model, val_loader, workload, plan, precision, device)  # eager: no recompile
                for s in sinks:
                    s.log(step, {"val/loss": val_loss})
                window_start = _now(device)  # validation time is not training throughput
            if ckpt_due:
                snapshot = _snapshot(step, model, optimizer, precision, schedule, plan, fingerprint,
                                     workload.identity, elapsed_before + train_seconds, cfg.seed)
                last_ckpt = ckpts.save(step, snapshot)
                window_start = _now(device)
            if _past(deadline):
                stop.requested = True  # a budget, not an interruption: stop.interrupted stays False
        if workload.evaluate is not None and step >= total_steps and step > start_step:
            extra_metrics = workload.evaluate(model, device, plan.micro_batch)  # the workload's own metrics
            for s in sinks:
                s.log(step, extra_metrics)

    weights = _export_weights(model, run_dir) if cfg.export_weights and step >= total_steps else None
    result = RunResult(
        run_dir=run_dir, plan=plan, steps=step, total_steps=total_steps, train_seconds=train_seconds,
        tokens_per_s=None, samples_per_s=None, mfu=None, peak_label=peak_label,
        peak_memory_bytes=None, memory_kind="device" if device.type == "cuda" else "host RSS",
        train_loss=train_loss, val_loss=val_loss, checkpoint=last_ckpt, weights=weights,
        stopped_early=step < total_steps, interrupted=stop.interrupted, notes=notes, metrics=extra_metrics,
    )
    _fill_summary(result, workload, effective, step - start_step, peak, device, run_dir)
    console.finish(result)
    return result


# --- builders -------------------------------------------------------------------------------


def _choose_plan(plan: Plan | None, state: dict[str, Any] | None, workload: Workload, hw: Any, cfg: RunConfig,
                 notes: list[str]) -> Plan:
    """The given plan; else the checkpoint's when resuming; else the tuned plan cached for this workload
    on this hardware; else the seed plan. A plan tuned on other hardware is flagged, never silent."""
    from saturate.tune import cache

    if plan is not None:
        if (warning := cache.hardware_mismatch(plan, hw.fingerprint())) is not None:
            notes.append(warning)
        return plan
    if state is not None:
        return Plan.from_dict(state["plan"], source="the checkpoint's plan")
    if cfg.use_tuned:
        cached, cache_notes = cache.lookup(workload, hw.fingerprint())
        notes.extend(cache_notes)
        if cached is not None:
            notes.append(f"using the plan tuned for {workload.name} on this machine "
                         f"({cached.provenance.get('tuned_at', 'date unknown')}); --no-tuned ignores it")
            return cached
    return default_plan(workload.optim.effective_batch, hw.device_type, hw.supports)


def _prepare_run_dir(run_dir: Path | None, resume: bool, workload: Workload) -> Path:
    if run_dir is None:
        if resume:
            run_dir = latest_run_dir(workload.name)
            if run_dir is None:
                raise CheckpointError(f"--resume: no run of {workload.name} with checkpoints under runs/")
        else:
            run_dir = Path("runs") / f"{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise CheckpointError(f"--resume: run folder {run_dir} does not exist")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe_file = run_dir / f".write-test-{os.getpid()}"
        probe_file.write_bytes(b"")
        probe_file.unlink()
    except OSError as e:
        raise ConfigError(f"run folder {run_dir} is not writable: {e.strerror or e}") from None
    return run_dir


def latest_run_dir(workload_name: str, root: Path = Path("runs")) -> Path | None:
    """The most recently checkpointed run folder of this workload under `root`."""
    candidates = []
    for d in root.glob(f"{workload_name}-*"):
        found = CheckpointManager(d / "checkpoints").checkpoints()
        if found:
            candidates.append((found[-1][1].stat().st_mtime, d))
    return max(candidates)[1] if candidates else None


def _load_resume_state(ckpts: CheckpointManager) -> dict[str, Any]:
    ckpts.remove_stale_temporaries()
    loaded = ckpts.load_latest()
    if loaded is None:
        why = f" ({'; '.join(ckpts.skipped)})" if getattr(ckpts, "skipped", None) else ""
        raise CheckpointError(f"--resume: no loadable checkpoint in {ckpts.folder}{why}")
    state, path = loaded
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state.get('format')}, expected {CHECKPOINT_FORMAT}")
    state["path"] = str(path)
    return state


def _check_fingerprint(state: dict[str, Any], fingerprint: dict[str, str], identity: dict[str, Any]) -> None:
    """Refuse to resume another model, other data or another effective batch, naming what differs."""
    theirs = state["fingerprint"]
    differ = [k for k in sorted(set(theirs) | set(fingerprint)) if theirs.get(k) != fingerprint.get(k)]
    if not differ:
        return
    old_identity = state.get("identity", {})
    parts = []
    for k in differ:
        if k == "effective_batch":
            parts.append(f"effective batch {theirs.get(k)} -> {fingerprint.get(k)}")
            continue
        old, new = old_identity.get(k), identity.get(k)
        if isinstance(old, dict) and isinstance(new, dict):
            fields = [f"{f} {old.get(f)!r:.20} -> {new.get(f)!r:.20}" for f in sorted(set(old) | set(new))
                      if old.get(f) != new.get(f)]
            parts.append(f"{k} ({', '.join(fields[:3])})")
        else:
            parts.append(k)
    raise CheckpointError(f"cannot resume from {state['path']}: it was trained with different "
                          f"{'; '.join(parts)}")


def mfu_peak(hw: Any, plan: Plan, measure: Callable[..., float]) -> tuple[float | None, str]:
    dtype = {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "tf32" if plan.tf32 else "fp32")
    if dtype == "tf32" and not hw.supports.get("tf32"):
        dtype = "fp32"
    peak, label = hw.peak_flops(dtype)
    if peak is None:
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        try:
            peak = measure(hw.torch_device, torch_dtype, tf32=dtype == "tf32")
            label = f"measured {dtype} matmul peak"
        except Exception as e:  # a dtype the device cannot multiply: report MFU as unknown
            return None, f"unknown ({type(e).__name__})"
    return peak, label


# --- inside the loop --------------------------------------------------------------------------


def _now(device: torch.device) -> float:
    # Synchronise before reading the clock, or GPU time queued behind us is not counted.
    synchronize(device)
    return time.perf_counter()


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _steps_for_budget(step: int, seconds_per_step: float, deadline: float | None, console: Any) -> int:
    remaining = max(0.0, (deadline or 0) - time.monotonic())
    total = step + max(1, int(remaining / max(seconds_per_step, 1e-9)))
    console.note(f"the time budget fits about {total} steps (a prediction from the first steps' measured "
                 f"{seconds_per_step:.3f} s/step); the schedule is sized to that")
    return total


def _step_metrics(workload: Workload, plan: Plan, effective: int, steps: int, seconds: float, loss: float,
                  grad_norm: torch.Tensor | None, lr: float, peak: float | None,
                  device: torch.device) -> dict[str, float]:
    samples_per_s = steps * effective / seconds if seconds > 0 else 0.0
    m = {
        "train/loss": loss,
        "train/lr": lr,
        "throughput/samples_per_s": samples_per_s,
        "throughput/tokens_per_s": samples_per_s * workload.tokens_per_sample,
        "time/step_s": seconds / steps,
        "plan/micro_batch": plan.micro_batch,  # changes only when an OOM was absorbed
    }
    if grad_norm is not None:
        m["train/grad_norm"] = float(grad_norm)  # already synchronised by the loss read above
    if workload.flops_per_sample and peak:
        m["throughput/mfu"] = samples_per_s * workload.flops_per_sample / peak
    if device.type == "cuda":
        m["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        m["memory/host_peak_rss_gib"] = _host_peak_rss() / 2**30
    return m


def _host_peak_rss() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # macOS reports bytes, Linux KiB


@torch.no_grad()
def _evaluate(model: nn.Module, loader: Any, workload: Workload, plan: Plan, precision: Precision,
              device: torch.device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    count = 0
    for batch in loader:
        n = _batch_len(batch, plan.micro_batch)
        with precision.autocast():
            total += workload.loss_fn(model, to_device(batch, device, plan.non_blocking)).float() * n
        count += n
    model.train()
    return total.item() / max(count, 1)  # deliberate sync: one per validation


def _batch_len(batch: Any, default: int) -> int:
    """Samples in a batch: the first dimension of its first tensor (tuple, list or dict batches)."""
    first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()), None) \
        if isinstance(batch, dict) else batch
    return len(first) if isinstance(first, torch.Tensor) else default


# --- state ------------------------------------------------------------------------------------


def _snapshot(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
              schedule: WarmupCosine, plan: Plan, fingerprint: dict[str, str], identity: dict[str, Any],
              train_seconds: float, seed: int) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,  # the data position: step s next reads global samples [s·E, (s+1)·E)
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else None,
        "schedule": schedule.state_dict(),
        "rng": rng_state(),
        "plan": plan.to_dict(),
        "fingerprint": fingerprint,
        "identity": identity,  # the values behind the fingerprint, to say what differs on a refusal
        "train_seconds": train_seconds,
        "seed": seed,
    }


def _export_weights(model: nn.Module, run_dir: Path) -> Path:
    from safetensors.torch import save_model

    path = run_dir / "model.safetensors"
    try:
        with atomic_path(path) as tmp:
            save_model(model, str(tmp))  # save_model de-duplicates the tied embedding/head weight
    except OSError as e:
        raise CheckpointError(f"could not export weights to {path}: {e.strerror or e}") from None
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def _fill_summary(result: RunResult, workload: Workload, effective: int, steps_this_session: int,
                  peak: float | None, device: torch.device, run_dir: Path) -> None:
    """Whole-session figures: steps timed in this process over the time they took (all measured)."""
    if steps_this_session > 0 and result.train_seconds > 0:
        result.samples_per_s = steps_this_session * effective / result.train_seconds
    if result.samples_per_s:
        result.tokens_per_s = result.samples_per_s * workload.tokens_per_sample
        if workload.flops_per_sample and peak:
            result.mfu = result.samples_per_s * workload.flops_per_sample / peak
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    else:
        result.peak_memory_bytes = _host_peak_rss()
    _write_json(run_dir / "summary.json", {
        "steps": result.steps, "total_steps": result.total_steps, "train_seconds": result.train_seconds,
        "samples_per_s": result.samples_per_s, "tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
        "mfu_peak": result.peak_label, "peak_memory_bytes": result.peak_memory_bytes,
        "memory_kind": result.memory_kind, "train_loss": result.train_loss, "val_loss": result.val_loss,
        "checkpoint": result.checkpoint, "weights": result.weights, "stopped_early": result.stopped_early,
        "plan": result.plan.to_dict(), "notes": result.notes, "metrics": result.metrics})


@contextlib.contextmanager
def _closing(sinks: list[Sink]) -> Iterator[None]:
    """Close every sink however the loop ends, so an error never leaves a live progress display."""
    try:
        yield
    finally:
        for s in sinks:
            s.close()


class _StopFlag:
    """First Ctrl-C asks the loop to stop at the next step boundary and checkpoint; a second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.interrupted:
                raise KeyboardInterrupt
            self.requested = self.interrupted = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
