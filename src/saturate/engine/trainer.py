"""train(workload, plan) -> RunResult: builders first, then a short loop.

Order of wrapping (fixed, in the Stepper): activation checkpointing -> compile -> DDP/FSDP.
No host sync inside a step: the loss sum, gradient norm and counters stay on the device and are
read only when logging, validating or checkpointing.

Under torchrun every rank runs this same loop on its own slice of each step's samples. What must
agree does: the loss (all-reduced before it is checked), stop requests and time budgets (agreed
every step), the run folder and a budget-sized schedule (rank 0's, broadcast). Metrics, progress,
plan.toml, run.json, summary.json and the exported weights come from rank 0 only.
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
from saturate.engine.checkpoint import CheckpointManager, restore_model_and_optimizer
from saturate.engine.console import ConsoleSink
from saturate.engine.distributed import (
    DistInfo,
    agree_any,
    all_reduce_mean_,
    all_reduce_scalar,
    broadcast_object,
    gather_objects,
    init_distributed,
    rank_device,
    resolve_strategy,
    teardown_distributed,
)
from saturate.engine.hostmem import HostMemoryGuard, relieve
from saturate.engine.metrics import JsonlSink, Sink, tensorboard_sink
from saturate.engine.precision import Precision
from saturate.engine.schedule import WarmupCosine, scaled_lr
from saturate.engine.step import Stepper, rng_state, set_rng_state, to_device
from saturate.engine.watch import TrainingWatch
from saturate.errors import CheckpointError, ConfigError, SaturateError
from saturate.hardware import synchronize
from saturate.plan import Plan, default_plan, fit_to_world
from saturate.workloads.base import Workload

CHECKPOINT_FORMAT = 1  # the same for a file and a DCP folder's meta.pt


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
    telemetry: bool = True  # background GPU/host sampler: gpu/*, host/* metrics and low-utilisation notes
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
    Under torchrun, joins the process group and, if it made it, destroys it at the end (after an
    error, `saturate.engine.distributed.teardown_distributed()` does, once the error is handled).
    """
    from saturate.hardware import probe

    cfg = config or RunConfig()
    hw = hardware or probe(measure_peaks=False, device=cfg.device)
    device_type = torch.device(hw.torch_device).type
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dist = init_distributed(device_type)  # joins torchrun's group; a no-op in one process
    result = _train(workload, plan, cfg, hw, dist)
    # On an error the group is left up: the traceback still holds DDP/DCP objects that must be freed
    # before the group is destroyed, so the CLI tears it down once the error is handled.
    if made_group:
        teardown_distributed()
    return result


def _train(workload: Workload, plan: Plan | None, cfg: RunConfig, hw: Any, dist: DistInfo) -> RunResult:
    from saturate.hardware import measure_matmul_peak

    device_type = torch.device(hw.torch_device).type
    notes: list[str] = []
    optim_cfg = workload.optim
    eval_every = cfg.eval_every or optim_cfg.eval_every
    ckpt_every = cfg.ckpt_every or eval_every
    world = dist.world_size

    run_dir = broadcast_object(_prepare_run_dir(cfg.run_dir, cfg.resume, workload) if dist.is_main else None)
    if not dist.is_main:  # rank 0 chose it (a default name has a timestamp); the others check they can write
        run_dir = _prepare_run_dir(run_dir, cfg.resume, workload)
    ckpts = CheckpointManager(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    state = _load_resume_state(ckpts, dist) if cfg.resume else None
    if state is None and ckpts.checkpoints():
        raise CheckpointError(f"run folder {run_dir} already holds checkpoints; pass --resume to continue "
                              "it or choose another --run-dir")
    plan_given = plan is not None
    plan = _choose_plan(plan, state, workload, hw, cfg, notes, world)
    strategy, note = resolve_strategy(plan.strategy, world)
    if note:
        notes.append(note)
        plan = plan.replace(strategy=strategy)
    if strategy == "fsdp" and not dist.active:  # FSDP in one process: a process group of one
        dist = init_distributed(device_type, one_process_group=True)
    device = rank_device(device_type, dist) if dist.active else torch.device(hw.torch_device)
    effective = plan.samples_per_step(world)
    fingerprint = {**workload.fingerprint(), "effective_batch": str(effective)}
    if state is not None:
        _check_fingerprint(state, fingerprint, workload.identity, world)

    # Build everything before the loop.
    torch.manual_seed(cfg.seed)  # the same on every rank: FSDP ranks build identical models, then shard
    random.seed(cfg.seed)
    lr = scaled_lr(optim_cfg.lr, optim_cfg.effective_batch, effective)
    if effective != optim_cfg.effective_batch:
        notes.append(f"effective batch {effective} differs from the workload's {optim_cfg.effective_batch}: "
                     f"learning rate scaled linearly {optim_cfg.lr:g} -> {lr:g}")
    stepper = Stepper(workload, plan, device, lr, notes=notes, compile=False, dist=dist)
    model, optimizer, precision = stepper.model, stepper.optimizer, stepper.precision
    if world > 1:  # after the (identical) build: each rank its own stream, as for dropout on its own data
        torch.manual_seed(cfg.seed + dist.rank)
        random.seed(cfg.seed + dist.rank)
    total_steps = cfg.steps or optim_cfg.steps
    schedule = WarmupCosine(lr, optim_cfg.warmup_steps, total_steps, lr * optim_cfg.min_lr_ratio)
    step, elapsed_before = 0, 0.0
    if state is not None:
        step = state["step"]
        elapsed_before = state["train_seconds"]
        restore_model_and_optimizer(state, Path(state["path"]), model, optimizer, stepper.strategy == "fsdp")
        schedule.load_state_dict(state["schedule"])
        schedule.peak_lr, schedule.min_lr = lr, lr * optim_cfg.min_lr_ratio
        if precision.scaler is not None and state.get("scaler"):
            precision.scaler.load_state_dict(state["scaler"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        elif dist.is_main:
            notes.append(f"the checkpoint has no RNG state for some of the {world} ranks (it was written by "
                         f"{state.get('world_size', 1)}); those ranks continue from fresh seeds")
        total_steps = schedule.total_steps if cfg.steps is None else cfg.steps
        schedule.total_steps = total_steps
        if plan_given and state["plan"] != plan.to_dict():
            notes.append("resumed with a different plan than the checkpoint's (same effective batch)")
    start_step = step
    stepper.compile_model()  # after loading: the compile probe restores the RNG it uses
    stepper.steps_done = step  # so an OOM adaptation names the global step
    pin = plan.pin_memory and device.type == "cuda"
    if plan.pin_memory and not pin:
        notes.append(f"pin_memory has no effect on {device.type}; not used")
    peak, peak_label = mfu_peak(hw, plan, measure_matmul_peak)
    if peak is not None and world > 1:
        peak, peak_label = peak * world, f"{world} × {peak_label}"  # MFU of all the devices together

    resume_step = step if state is not None else None
    sinks: list[Sink] = []
    if dist.is_main:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step))
        if cfg.tensorboard and (tb := tensorboard_sink(run_dir / "tensorboard", resume_step)) is not None:
            sinks.append(tb)
    console = ConsoleSink(total_steps, start_step=step, enabled=cfg.progress and dist.is_main)
    sinks.append(console)
    if dist.is_main:
        plan.save(run_dir / "plan.toml")
        _write_json(run_dir / "run.json", {
            "workload": workload.name, "info": workload.info, "fingerprint": fingerprint,
            "effective_batch": effective, "lr": lr, "total_steps": total_steps, "seed": cfg.seed,
            "device": str(device), "processes": world, "strategy": stepper.strategy,
            "hardware": hw.fingerprint(), "notes": notes,
            "pid": os.getpid()})  # `saturate monitor` finds a live run by it
    for n in notes:
        console.note(n)
    console.start(workload, plan, hw, effective, total_steps, resumed_from=step if state else None,
                  processes=world)

    loader = make_loader(workload.train_data, plan, start_step=step, pin_memory=pin, rank=dist.rank,
                         world_size=world)
    # Built once, so persistent workers really persist between validations.
    val_loader = eval_loader(workload.val_data, plan, pin) if workload.val_data is not None else None
    batches: Iterator[Any] = iter(loader)
    window_steps, window_start = 0, _now(device)
    train_seconds, val_loss, train_loss = 0.0, None, None
    deadline = time.monotonic() + cfg.minutes * 60 if cfg.minutes else None
    size_schedule_at = step + 5 if (cfg.minutes and cfg.steps is None and state is None) else None
    last_ckpt: Path | None = None
    extra_metrics: dict[str, float] = {}
    stop = _StopFlag(coalesce_s=2.0 if world > 1 else 0.0)
    watch = TrainingWatch(device, console.note, enabled=cfg.telemetry and dist.is_main)
    guard = HostMemoryGuard() if cfg.host_memory_guard else None
    model.train()

    with stop.installed(), _closing(sinks), watch:
        stopping = False  # decided once per step, below: the loop never reads the signal flag directly
        while step < total_steps and not stopping:
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            adapted = len(stepper.adaptations)
            stepper.step(batches, timer=watch.timer)  # the watch times only the wait for data
            if len(stepper.adaptations) > adapted:  # an OOM was absorbed: record the plan now in force
                plan = stepper.current_plan()
                if dist.is_main:
                    plan.save(run_dir / "plan.toml")
                console.note(notes[-1])
                if val_loader is not None:  # validation runs at the smaller micro-batch too
                    val_loader = eval_loader(workload.val_data, plan, pin)
            step += 1
            window_steps += 1
            console.advance(step)  # host-only: moves the bar and ETA, reads nothing from the device
            # Read once: a Ctrl-C landing later in this step is seen at the next one, never between the
            # checkpoint decision and the loop test (which would stop without a checkpoint, or, with
            # several ranks, stop one rank a step before the others). A budget is not an interruption.
            stopping = stop.requested or _past(deadline)
            if world > 1:  # a Ctrl-C or a budget seen by one rank stops all of them at this same step
                stopping = agree_any(stopping)

            eval_due = val_loader is not None and (step % eval_every == 0 or step == total_steps)
            ckpt_due = step % ckpt_every == 0 or step == total_steps or stopping
            # Log before every validation and checkpoint too: the timing window then never spans
            # them, and no checkpoint is written for a step whose loss was not checked.
            if step % cfg.log_every == 0 or step == size_schedule_at or eval_due or ckpt_due:
                seconds = _now(device) - window_start  # _now synchronises the device first
                train_seconds += seconds
                # deliberate sync: logging; the mean over ranks, so every rank sees the same value
                train_loss = all_reduce_mean_(stepper.take_loss_sum()).item() / window_steps
                if not math.isfinite(train_loss):  # every rank raises: they stop together
                    raise SaturateError(f"training loss became {train_loss} at step {step}; lower the learning "
                                        "rate or use fp32/bf16 (the last checkpoint is kept)")
                if dist.is_main:
                    metrics = _step_metrics(workload, plan, effective, window_steps, seconds, train_loss,
                                            stepper.grad_norm, schedule.lr(step - 1), peak, device)
                    metrics.update(watch.window_metrics())  # telemetry means over the same window
                    for s in sinks:
                        s.log(step, metrics)
                window_steps, window_start = 0, _now(device)
                if step == size_schedule_at:
                    total_steps = broadcast_object(_steps_for_budget(step, seconds / 5, deadline, console)
                                                   if dist.is_main else None)
                    schedule.total_steps = total_steps
                why = _memory_pressure(guard, world)
                if why and (eased := relieve(plan)) is not None:
                    plan, change = eased  # restart the loaders now, at a step boundary, with less memory
                    stepper.plan = plan
                    loader = make_loader(workload.train_data, plan, start_step=step, pin_memory=pin,
                                         rank=dist.rank, world_size=world)
                    batches = iter(loader)
                    if val_loader is not None:
                        val_loader = eval_loader(workload.val_data, plan, pin)
                    if dist.is_main:
                        plan.save(run_dir / "plan.toml")
                    notes.append(f"step {step}: {why}; lowered {change} and restarted the loader")
                    console.note(notes[-1])
            if eval_due:
                # eager module, no recompile; every rank evaluates all of it (FSDP needs all ranks in a forward)
                val_loss = _evaluate(model, val_loader, workload, plan, precision, device)
                for s in sinks:
                    s.log(step, {"val/loss": val_loss})
                window_start = _now(device)  # validation time is not training throughput
                watch.reset()
            if ckpt_due:
                snapshot = _snapshot(step, stepper, precision, schedule, plan, fingerprint, workload.identity,
                                     elapsed_before + train_seconds, cfg.seed, world)
                if stepper.strategy == "single":
                    last_ckpt = ckpts.save(step, snapshot)
                else:
                    rng = snapshot.pop("rng")
                    last_ckpt = ckpts.save_sharded(step, model, optimizer, snapshot, {"rng": rng})
                window_start = _now(device)
                watch.reset()
        if workload.evaluate is not None and step >= total_steps and step > start_step:
            extra_metrics = workload.evaluate(model, device, plan.micro_batch)  # the workload's own metrics
            for s in sinks:
                s.log(step, extra_metrics)

    weights = None
    if cfg.export_weights and step >= total_steps:
        weights = _export_weights(model, run_dir, workload, stepper.strategy, dist)
    result = RunResult(
        run_dir=run_dir, plan=plan, steps=step, total_steps=total_steps, train_seconds=train_seconds,
        tokens_per_s=None, samples_per_s=None, mfu=None, peak_label=peak_label,
        peak_memory_bytes=None, memory_kind="device" if device.type == "cuda" else "host RSS",
        train_loss=train_loss, val_loss=val_loss, checkpoint=last_ckpt, weights=weights,
        stopped_early=step < total_steps, interrupted=stop.interrupted, notes=notes, metrics=extra_metrics,
    )
    _fill_summary(result, workload, effective, step - start_step, peak, device, run_dir, dist)
    console.finish(result)
    return result


# --- builders -------------------------------------------------------------------------------


def _choose_plan(plan: Plan | None, state: dict[str, Any] | None, workload: Workload, hw: Any, cfg: RunConfig,
                 notes: list[str], world: int = 1) -> Plan:
    """The given plan; else the checkpoint's when resuming; else the tuned plan cached for this workload
    on this hardware; else the seed plan. A plan tuned on other hardware is flagged, never silent.
    Under torchrun the checkpoint's and the cached plan keep their effective batch over `world` processes."""
    from saturate.tune import cache

    if plan is not None:
        if (warning := cache.hardware_mismatch(plan, hw.fingerprint())) is not None:
            notes.append(warning)
        return plan
    if state is not None:
        return _checkpoint_plan(state, world, notes)
    if cfg.use_tuned:
        cached, cache_notes = cache.lookup(workload, hw.fingerprint(), world)
        notes.extend(cache_notes)
        tuned_world = int(cached.provenance.get("world_size", 1)) if cached is not None else world
        if cached is not None and tuned_world != world:
            try:
                cached = fit_to_world(cached, cached.samples_per_step(tuned_world), world).replace(
                    strategy=cached.strategy if cached.strategy != "single" else "ddp")
            except ConfigError as e:
                notes.append(f"the cached tuned plan does not split over {world} processes ({e}); not used")
                cached = None
        if cached is not None:
            notes.append(f"using the plan tuned for {workload.name} on this machine "
                         f"({cached.provenance.get('tuned_at', 'date unknown')}); --no-tuned ignores it")
            return cached
    return default_plan(workload.optim.effective_batch, hw.device_type, hw.supports, world)


def _memory_pressure(guard: HostMemoryGuard | None, world: int) -> str | None:
    """Why host memory is short, agreed over ranks (they share a node's RAM): all relieve their loaders together."""
    if guard is None:
        return None
    why = guard.pressure()
    if world > 1 and agree_any(why is not None):
        why = next(w for w in gather_objects(why) if w is not None)
    return why


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


def _load_resume_state(ckpts: CheckpointManager, dist: DistInfo) -> dict[str, Any]:
    if dist.is_main:
        ckpts.remove_stale_temporaries()  # nothing is being written yet: every rank is here
    loaded = ckpts.load_latest()
    if loaded is None:
        why = f" ({'; '.join(ckpts.skipped)})" if getattr(ckpts, "skipped", None) else ""
        raise CheckpointError(f"--resume: no loadable checkpoint in {ckpts.folder}{why}")
    state, path = loaded
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state.get('format')}, expected {CHECKPOINT_FORMAT}")
    state["path"] = str(path)
    return state


def _checkpoint_plan(state: dict[str, Any], world: int, notes: list[str]) -> Plan:
    """The checkpoint's plan, its accumulation re-derived when the process count changed."""
    plan = Plan.from_dict(state["plan"], source="the checkpoint's plan")
    saved_world = state.get("world_size", 1)
    if saved_world == world:
        return plan
    effective = plan.samples_per_step(saved_world)
    try:
        fitted = fit_to_world(plan, effective, world)
    except ConfigError as e:
        raise CheckpointError(f"cannot resume {state['path']}, written by {saved_world} process(es), with {world}: "
                              f"{e}; pass a --plan with micro_batch × grad_accum × {world} = {effective}") from None
    notes.append(f"resuming a checkpoint of {saved_world} process(es) with {world}: grad_accum "
                 f"{plan.grad_accum} -> {fitted.grad_accum} keeps the effective batch {effective}")
    return fitted


def _check_fingerprint(state: dict[str, Any], fingerprint: dict[str, str], identity: dict[str, Any],
                       world: int = 1) -> None:
    """Refuse to resume another model, other data or another effective batch, naming what differs."""
    theirs = state["fingerprint"]
    differ = [k for k in sorted(set(theirs) | set(fingerprint)) if theirs.get(k) != fingerprint.get(k)]
    if not differ:
        return
    old_identity = state.get("identity", {})
    parts = []
    for k in differ:
        if k == "effective_batch":
            saved_world = state.get("world_size", 1)
            counts = f" ({saved_world} process(es) then, {world} now)" if saved_world != world else ""
            parts.append(f"effective batch {theirs.get(k)} -> {fingerprint.get(k)}{counts}")
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


def _snapshot(step: int, stepper: Stepper, precision: Precision, schedule: WarmupCosine, plan: Plan,
              fingerprint: dict[str, str], identity: dict[str, Any], train_seconds: float, seed: int,
              world: int) -> dict[str, Any]:
    """Everything a resume needs; for DDP/FSDP without model and optimizer, which go through DCP."""
    state: dict[str, Any] = {}
    if stepper.strategy == "single":
        state = {"model": stepper.model.state_dict(), "optimizer": stepper.optimizer.state_dict()}
    return {
        **state,
        "format": CHECKPOINT_FORMAT,
        "step": step,  # the data position: step s next reads global samples [s·E, (s+1)·E)
        "world_size": world,
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else None,
        "schedule": schedule.state_dict(),
        "rng": rng_state(),
        "plan": plan.to_dict(),
        "fingerprint": fingerprint,
        "identity": identity,  # the values behind the fingerprint, to say what differs on a refusal
        "train_seconds": train_seconds,
        "seed": seed,
    }


def _export_weights(model: nn.Module, run_dir: Path, workload: Workload, strategy: str, dist: DistInfo) -> Path:
    from safetensors.torch import save_model

    path = run_dir / "model.safetensors"
    if strategy == "fsdp":  # gather the full weights to rank 0 (every rank takes part), into a plain model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.is_main:
            plain = workload.build_model()
            plain.load_state_dict(full)
            model = plain
    if not dist.is_main:
        return path
    try:
        with atomic_path(path) as tmp:
            save_model(model, str(tmp))  # save_model de-duplicates the tied embedding/head weight
        if workload.export_extras is not None:
            workload.export_extras(model, run_dir)
    except OSError as e:
        raise CheckpointError(f"could not export weights to {path}: {e.strerror or e}") from None
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def _fill_summary(result: RunResult, workload: Workload, effective: int, steps_this_session: int,
                  peak: float | None, device: torch.device, run_dir: Path, dist: DistInfo) -> None:
    """Whole-session figures: steps timed in this process over the time they took (all measured).

    Throughput counts the global batch on rank 0's clock; peak memory is the largest over ranks.
    """
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
    result.peak_memory_bytes = int(all_reduce_scalar(result.peak_memory_bytes, "max"))
    if not dist.is_main:
        return
    _write_json(run_dir / "summary.json", {
        "steps": result.steps, "total_steps": result.total_steps, "train_seconds": result.train_seconds,
        "samples_per_s": result.samples_per_s, "tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
        "mfu_peak": result.peak_label, "peak_memory_bytes": result.peak_memory_bytes,
        "memory_kind": result.memory_kind, "train_loss": result.train_loss, "val_loss": result.val_loss,
        "checkpoint": result.checkpoint, "weights": result.weights, "stopped_early": result.stopped_early,
        "processes": dist.world_size, "plan": result.plan.to_dict(), "notes": result.notes,
        "metrics": result.metrics})


@contextlib.contextmanager
def _closing(sinks: list[Sink]) -> Iterator[None]:
    """Close every sink however the loop ends, so an error never leaves a live progress display."""
    try:
        yield
    finally:
        for s in sinks:
            s.close()


class _StopFlag:
    """First Ctrl-C asks the loop to stop at the next step boundary and checkpoint; a second aborts.

    Under torchrun a Ctrl-C reaches each worker twice (from the terminal, then forwarded by the
    launcher): a second SIGINT within `coalesce_s` of the first counts as the same one.
    """

    def __init__(self, coalesce_s: float = 0.0) -> None:
        self.requested = False
        self.interrupted = False
        self.coalesce_s = coalesce_s
        self._first_at = 0.0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.interrupted:
                if time.monotonic() - self._first_at < self.coalesce_s:
                    return
                raise KeyboardInterrupt
            self.requested = self.interrupted = True
            self._first_at = time.monotonic()

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
