"""Everything a run needs, built before its loop: `prepare()` -> `Training`.

In order: the run folder (rank 0 names it), the checkpoint to resume, the plan (given, the
checkpoint's, the tuned plan cached for this machine, or the seed plan), the process group for
FSDP, the Stepper (model, optimizer, precision), the schedule, the restored state, compile, the
MFU denominator, the metric sinks and console, run.json and run.toml, and the loaders. The loop in
`trainer.py` then only steps, logs, validates and checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from saturate.data.loaders import eval_loader, make_loader
from saturate.engine.checkpoint import CheckpointManager
from saturate.engine.console import ConsoleSink
from saturate.engine.distributed import (
    DistInfo,
    broadcast_object,
    init_distributed,
    rank_device,
    resolve_strategy,
    stuck_after_s,
)
from saturate.engine.early_stop import EarlyStop
from saturate.engine.hostmem import HostMemoryGuard
from saturate.engine.metrics import Sink, Sinks
from saturate.engine.precision_guard import PrecisionGuard, needs_guard
from saturate.engine.resume import (
    check_fingerprint,
    check_optimization,
    choose_plan,
    load_resume_state,
    lock_run_dir,
    prepare_run_dir,
    remove_stale_temporaries,
    restore,
)
from saturate.engine.runfile import recorded_cadence, run_settings, write_run_toml
from saturate.engine.schedule import WarmupCosine, scaled_lr
from saturate.engine.signals import StopFlag
from saturate.engine.step import Stepper, to_device
from saturate.engine.summary import SUSPECT_MFU, mfu_peak, recheck_peak, write_json
from saturate.engine.trackers import make_sinks, parse_log_to
from saturate.engine.watch import TrainingWatch
from saturate.errors import CheckpointError, ConfigError, SaturateError
from saturate.hardware import synchronize
from saturate.plan import Plan
from saturate.workloads.base import FLOAT32_MAX, Workload, data_note


@dataclass
class RunConfig:
    """How long and where to run; nothing here changes the maths of a step."""

    steps: int | None = None  # optimizer steps in the schedule (default: the workload's)
    minutes: float | None = None  # wall-clock budget; alone, it also sizes the schedule
    run_dir: Path | None = None  # default: runs/<workload>-<timestamp>
    resume: bool = False  # continue from the newest checkpoint in run_dir
    seed: int = 0
    device: str | None = None  # default: the best device probe() finds
    # The cadence; None: a resumed run's own (its run.toml), else the default given
    log_every: int | None = None  # optimizer steps between metric reads (each read is one host sync); default 10
    eval_every: int | None = None  # default: the workload's
    ckpt_every: int | None = None  # default: eval_every
    keep_checkpoints: int | None = None  # default 3
    progress: bool = True  # live progress (a bar on a terminal, a line per logged window otherwise)
    quiet: bool = False  # no start line and no notes: only the final summary (printed unless rank > 0)
    tensorboard: bool = True  # also write TensorBoard events (run_dir/tensorboard)
    # More sinks beside metrics.jsonl: names ("tensorboard", "csv", "wandb", "mlflow") and/or your own Sink objects
    log_to: Sequence[str | Sink] = ()
    early_stop: str | None = None  # "val/loss:PATIENCE[:MIN_DELTA]": stop when validation stops improving
    telemetry: bool = True  # background GPU/host sampler: gpu/*, host/* metrics and low-utilisation notes
    export_weights: bool = True  # model.safetensors at the end
    # How the workload was described (a Source as a dict: preset, --param, --data, …), recorded in run.json so
    # that `saturate train --resume --run-dir R` alone rebuilds it; None from the Python API.
    source: dict[str, Any] | None = None
    # Seconds a collective or a data-loader batch may take before the run stops as stuck (a rank or a loader
    # worker that does not answer); None: $SATURATE_STUCK_AFTER, else 600.
    stuck_after: float | None = None
    use_tuned: bool = True  # with no plan given, use the tuned plan cached for this workload and hardware
    host_memory_guard: bool = True  # lower loader prefetch/workers when host RAM runs short or swap grows
    # Check a lower precision against fp32 over the first steps (precision_guard.py); None: where the plan's was
    # chosen from the hardware and not yet checked (the default plan's bf16)
    guard_precision: bool | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {v}")
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"minutes must be > 0, got {self.minutes}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise ConfigError(f"seed must be an integer between 0 and 2**64 - 1, got {self.seed!r}")
        if self.stuck_after is not None and not self.stuck_after > 0:
            raise ConfigError(f"stuck-after must be > 0 seconds, got {self.stuck_after}")
        if isinstance(self.log_to, str):
            self.log_to = parse_log_to(self.log_to)
        parse_log_to(",".join(n for n in self.log_to if isinstance(n, str)))
        if self.early_stop is not None:
            EarlyStop.parse(self.early_stop)


@dataclass
class Training:
    """A run, built and ready for its loop; the loop advances `step` and the window counters."""

    workload: Workload
    cfg: RunConfig
    dist: DistInfo
    device: torch.device
    run_dir: Path
    ckpts: CheckpointManager
    plan: Plan  # the plan in force (an absorbed OOM or host-memory relief replaces it)
    stepper: Stepper
    schedule: WarmupCosine
    effective: int  # samples per optimizer step over all ranks
    fingerprint: dict[str, str]
    peak: float | None  # the MFU denominator (FLOP/s), None when unknown
    peak_label: str
    pin: bool
    sinks: Sinks  # the console among them
    console: ConsoleSink
    watch: TrainingWatch
    guard: HostMemoryGuard | None
    stop: StopFlag
    val_loader: Any
    batches: Iterator[Any]
    step: int  # optimizer steps done, across resumes (the data position)
    start_step: int  # where this session started
    total_steps: int  # the schedule's length
    elapsed_before: float  # training seconds of earlier sessions (from the checkpoint)
    eval_every: int
    ckpt_every: int
    deadline: float | None  # time.monotonic() when a --minutes budget runs out
    size_schedule_at: int | None  # the step at which a --minutes-only run sizes its schedule
    precision_guard: PrecisionGuard | None  # the lower precision's check over the first steps, while due
    notes: list[str]
    early_stop: EarlyStop | None = None
    on_log: Callable[[dict[str, Any]], Any] | None = None  # train()'s callbacks (rank 0)
    on_validation: Callable[[dict[str, Any]], Any] | None = None
    stop_reason: str | None = None  # why the run stopped before its schedule's end (early stop, a callback)
    on_window: Any = None  # train(on_window=…): a trainer.WindowWatch, told of every timing window (rank 0)
    window_due: int | None = None  # the step at which it asked for a window to close (every rank)
    paused: str | None = None  # why the run stopped to be continued (on_window): not done, no export
    window_steps: int = 0
    window_start: float = 0.0
    train_seconds: float = 0.0  # this session's time in steps (validation and checkpoints excluded)
    train_loss: float | None = None
    val_loss: float | None = None
    last_ckpt: Path | None = None
    extra_metrics: dict[str, float] = field(default_factory=dict)
    hw: Any = None  # the probed hardware (the MFU denominator is measured again on it when the run out-ran it)
    peak_rechecked: bool = False  # the peak was measured again (once a run: `recheck_peak`)

    @property
    def world(self) -> int:
        return self.dist.world_size

    @property
    def model(self) -> torch.nn.Module:
        return self.stepper.model

    def recheck_peak(self, steps: int, seconds: float) -> None:
        """The MFU's denominator measured again (summary.recheck_peak) when `steps` in `seconds` ran the model's
        FLOPs over `SUSPECT_MFU` of a measured peak — at most once a run, from the first window that did: the lines
        from there on, the summary and the stored peak use what it found, said in a note. One process only."""
        if self.peak_rechecked or self.world != 1 or self.hw is None or not self.peak or steps <= 0 or seconds <= 0:
            return
        achieved = steps * self.effective / seconds * (self.workload.flops_per_sample or 0)
        if achieved <= SUSPECT_MFU * self.peak:
            return
        self.peak_rechecked = True
        self.peak, self.peak_label, note = recheck_peak(self.hw, self.plan, self.peak, self.peak_label, achieved)
        if note:
            self.notes.append(note)
            self.console.note(note)

    def restart_loaders(self) -> None:
        """New loaders for the plan in force, reading on from the current step."""
        self.batches = iter(make_loader(self.workload.train_data, self.plan, start_step=self.step,
                                        pin_memory=self.pin, rank=self.dist.rank, world_size=self.world,
                                        timeout=stuck_after_s()))
        if self.val_loader is not None:
            self.val_loader = eval_loader(self.workload.val_data, self.plan, self.pin, stuck_after_s())

    def save_plan(self) -> None:
        if self.dist.is_main:
            self.plan.save(self.run_dir / "plan.toml")


def _precision_guard(workload: Workload, plan: Plan, cfg: RunConfig, step: int,
                     device: torch.device) -> PrecisionGuard | None:
    """The lower precision's check over the first steps (precision_guard.py), on the first micro-batch this session
    trains on (rank 0's: every rank checks the same samples); None when it is not wanted, and under FSDP, whose
    mixed-precision policy is set when the model is sharded (the default plan never shards)."""
    wanted = cfg.guard_precision if cfg.guard_precision is not None else needs_guard(plan)
    if not wanted or plan.precision == "fp32" or plan.strategy == "fsdp":  # FSDP fixes its dtypes when it shards
        return None
    first = next(iter(make_loader(workload.train_data, plan.replace(num_workers=0), start_step=step, pin_memory=False)))
    return PrecisionGuard(to_device(first, device, False), workload.loss_fn)


def now(device: torch.device) -> float:
    """The clock, read after the device finished what is queued (or GPU time queued behind us is not counted)."""
    synchronize(device)
    return time.perf_counter()


def _settings(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's settings, without its provenance (notes on where it came from, which a TOML round trip or
    a later tuning may word differently) and its name (the default plan tuned keeps its settings)."""
    return {k: v for k, v in plan.items() if k not in ("provenance", "name")}


def prepare(workload: Workload, plan: Plan | None, cfg: RunConfig, hw: Any, dist: DistInfo) -> Training:
    """Build everything the loop needs; see the module docstring for the order."""
    device_type = torch.device(hw.torch_device).type
    notes: list[str] = []
    world = dist.world_size
    run_dir, refused = None, None
    if dist.is_main:
        try:
            run_dir = prepare_run_dir(cfg.run_dir, cfg.resume, workload)
            lock_run_dir(run_dir)  # one run per folder; held until train() returns
            remove_stale_temporaries(run_dir)  # of a process killed mid-write (an export, say): ours now
        except SaturateError as e:
            refused = e
    run_dir, why = broadcast_object((run_dir, str(refused) if refused else None))
    if refused is not None:
        raise refused
    if why is not None:  # every rank refuses with rank 0's reason, rather than wait for it
        raise ConfigError(why)
    if not dist.is_main:  # rank 0 chose it (a default name has a timestamp); the others check they can write
        run_dir = prepare_run_dir(run_dir, cfg.resume, workload)
    if cfg.resume:  # the run's cadence (--log-every …) where this session sets none, as for its workload flags
        recorded = recorded_cadence(run_dir)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in recorded.items() if getattr(cfg, k) is None})
    cfg = dataclasses.replace(cfg, log_every=cfg.log_every or 10, keep_checkpoints=cfg.keep_checkpoints or 3)
    ckpts = CheckpointManager(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    state = load_resume_state(ckpts, dist) if cfg.resume else None
    if state is None and ckpts.checkpoints():
        raise CheckpointError(f"run folder {run_dir} already holds checkpoints; pass --resume to continue "
                              "it or choose another --run-dir")
    plan_given = plan is not None
    plan = choose_plan(plan, state, workload, hw, cfg.use_tuned, notes, world)
    strategy, note = resolve_strategy(plan.strategy, world)
    if note:
        notes.append(note)
        plan = plan.replace(strategy=strategy)
    if strategy == "fsdp" and not dist.active:  # FSDP in one process: a process group of one
        dist = init_distributed(device_type, one_process_group=True, stuck_after=cfg.stuck_after)
    device = rank_device(device_type, dist) if dist.active else torch.device(hw.torch_device)
    effective = plan.samples_per_step(world)
    fingerprint = {**workload.fingerprint(), "effective_batch": str(effective)}
    if state is not None:
        check_fingerprint(state, fingerprint, workload.identity, world)
        check_optimization(state, workload.optim)

    optim = workload.optim
    torch.manual_seed(cfg.seed)  # the same on every rank: FSDP ranks build identical models, then shard
    random.seed(cfg.seed)
    lr = scaled_lr(optim.lr, optim.effective_batch, effective)
    if effective != optim.effective_batch:
        notes.append(f"effective batch {effective} differs from the workload's {optim.effective_batch}: "
                     f"learning rate scaled linearly {optim.lr:g} -> {lr:g}")
    if note := data_note(workload.train_data, effective, cfg.steps or optim.steps):  # a batch far beyond the data
        notes.append(note)
    if not lr <= FLOAT32_MAX:
        raise ConfigError(f"the learning rate scaled to the effective batch, {lr:g}, is beyond float32's range")
    stepper = Stepper(workload, plan, device, lr, notes=notes, compile=False, dist=dist)
    if world > 1:  # after the (identical) build: each rank its own stream, as for dropout on its own data
        torch.manual_seed(cfg.seed + dist.rank)
        random.seed(cfg.seed + dist.rank)
    schedule = WarmupCosine(lr, optim.warmup_steps, cfg.steps or optim.steps, lr * optim.min_lr_ratio)
    step, elapsed_before = 0, 0.0
    if state is not None:
        step, elapsed_before = state["step"], state["train_seconds"]
        restore(state, stepper, schedule, cfg.steps, dist, notes)
        if plan_given and _settings(state["plan"]) != _settings(plan.to_dict()):
            notes.append("resumed with a different plan than the checkpoint's (same effective batch)")
    stepper.compile_model()  # after loading: the compile probe restores the RNG it uses
    stepper.steps_done = step  # so an OOM adaptation names the global step
    pin = plan.pin_memory and device.type == "cuda"
    if plan.pin_memory and not pin:
        notes.append(f"pin_memory has no effect on {device.type}; not used")
    peak, peak_label = mfu_peak(hw, plan)
    if peak is not None and world > 1:
        peak, peak_label = peak * world, f"{world} × {peak_label}"  # MFU of all the devices together

    total_steps = schedule.total_steps
    eval_every = cfg.eval_every or optim.eval_every
    ckpt_every = cfg.ckpt_every or eval_every
    settings = run_settings(cfg, workload.name, plan.to_dict(), cfg.device or device.type, eval_every, ckpt_every,
                            total_steps)
    early_stop = EarlyStop.parse(cfg.early_stop) if cfg.early_stop else None
    if early_stop is not None and workload.val_data is None:
        raise ConfigError(f"--early-stop watches validation, and workload {workload.name} has no validation data")
    if early_stop is not None and state is not None:
        early_stop.load_state_dict(state.get("early_stop"))
    console = ConsoleSink(total_steps, start_step=step, enabled=dist.is_main, live=cfg.progress, quiet=cfg.quiet)
    sinks = Sinks([], warn=lambda text: (notes.append(text), console.note(text)))
    if dist.is_main:  # trackers start here, before any step: one that cannot is one line, not a lost run
        sinks.sinks = make_sinks(run_dir, step if state is not None else None, cfg.log_to, cfg.tensorboard, settings)
    sinks.sinks.append(console)
    if dist.is_main:
        write_run_toml(run_dir / "run.toml", settings)
        # summary.json describes a finished session (a requeue script reads its "stopped_by"): never a stale one
        (run_dir / "summary.json").unlink(missing_ok=True)
        plan.save(run_dir / "plan.toml")
        write_json(run_dir / "run.json", {
            "workload": workload.name, "info": workload.info, "fingerprint": fingerprint,
            "effective_batch": effective, "lr": lr, "total_steps": total_steps, "seed": cfg.seed,
            "device": str(device), "processes": world, "strategy": stepper.strategy,
            "hardware": hw.fingerprint(), "notes": notes, "source": cfg.source,
            "pid": os.getpid()})  # `saturate monitor` finds a live run by it
    for n in notes:
        console.note(n)
    console.start(workload, plan, hw, effective, total_steps, resumed_from=step if state else None,
                  processes=world)

    loader = make_loader(workload.train_data, plan, start_step=step, pin_memory=pin, rank=dist.rank,
                         world_size=world, timeout=stuck_after_s())
    # Built once, so persistent workers really persist between validations.
    val_loader = eval_loader(workload.val_data, plan, pin, stuck_after_s()) if workload.val_data is not None else None
    return Training(
        workload=workload, cfg=cfg, dist=dist, device=device, run_dir=run_dir, ckpts=ckpts, plan=plan,
        stepper=stepper, schedule=schedule, effective=effective, fingerprint=fingerprint, peak=peak,
        peak_label=peak_label, pin=pin, sinks=sinks, console=console,
        watch=TrainingWatch(device, console.note, enabled=cfg.telemetry and dist.is_main),
        guard=HostMemoryGuard() if cfg.host_memory_guard else None,
        stop=StopFlag(coalesce_s=2.0 if world > 1 else 0.0), val_loader=val_loader, batches=iter(loader),
        step=step, start_step=step, total_steps=total_steps, elapsed_before=elapsed_before,
        eval_every=eval_every, ckpt_every=ckpt_every, early_stop=early_stop,
        deadline=time.monotonic() + cfg.minutes * 60 if cfg.minutes else None,
        size_schedule_at=step + 5 if (cfg.minutes and cfg.steps is None and state is None) else None,
        precision_guard=_precision_guard(workload, plan, cfg, step, device),
        notes=notes, window_start=now(device), hw=hw,
    )
