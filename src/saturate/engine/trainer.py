"""train(workload, plan) -> RunResult: everything built first (`session.prepare`), then a short loop.

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
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from saturate.data.loaders import eval_loader
from saturate.engine.checkpoint import state_is_finite
from saturate.engine.distributed import (
    agree_any,
    all_reduce_mean_,
    all_reduce_scalar,
    barrier,
    broadcast_object,
    gather_objects,
    init_distributed,
    stuck_after_s,
    teardown_distributed,
)
from saturate.engine.grow import grow_micro_batch
from saturate.engine.hostmem import relieve
from saturate.engine.metrics import Sinks
from saturate.engine.precision import Precision, make_precision
from saturate.engine.resume import optimization_record, release_run_dirs, snapshot
from saturate.engine.session import RunConfig, Training, now, prepare
from saturate.engine.step import to_device
from saturate.engine.summary import (
    RunResult,
    export_weights,
    fill_summary,
    step_metrics,
    steps_for_budget,
)
from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.workloads.base import Workload

__all__ = ["RunConfig", "RunResult", "Window", "WindowWatch", "train"]


Callback = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Window:
    """A timing window the loop closed (train(on_window=…)): its last step, its steps and their seconds."""

    step: int
    steps: int
    seconds: float
    total_steps: int  # the schedule's length at that step


class WindowWatch(Protocol):
    """train(on_window=…): told, in rank 0, of every timing window the loop closes while it has asked for one; it
    names the step at which it wants the next closed and, there, may pause the run (run/job_window.py times the job
    this way)."""

    def first(self, step: int) -> int | None:
        """The first step at which to close a window, for a session starting at `step` (None: none)."""

    def closed(self, window: Window) -> tuple[int | None, str | None]:
        """After each window: the next step to close one at (None: no more) and a reason to pause the run there (None:
        go on). The answer counts only for a window closed at the step asked for; every rank learns rank 0's."""


def train(workload: Workload, plan: Plan | None = None, config: RunConfig | None = None,
          hardware: Any = None, *, on_log: Callback | None = None, on_validation: Callback | None = None,
          on_window: WindowWatch | None = None,
          on_stopped: Callable[[RunResult], None] | None = None) -> RunResult:
    """Train `workload` with `plan`; resume from the run folder when config.resume is set.

    plan=None means the checkpoint's plan when resuming, else the seed plan (`default_plan`).
    on_log(record) is called with each record the sinks get ({"step": N, "train/loss": …}, validations, the
    workload's end-of-run metrics); on_validation(record) after each validation ({"step": N, "val/loss": …}),
    and returning True stops the run there, with a checkpoint. Both run in rank 0 only; an exception from
    either ends the run (unlike a failing sink).
    on_window is told of the timing windows the loop closes (`WindowWatch`, rank 0) and closes one where it asks; a
    reason it returns pauses the run there, with a checkpoint and without exporting anything (`RunResult.stop_reason`
    says it), to be continued with `resume` (with another plan of the same effective batch, say). on_stopped(result) on
    every rank when a signal stopped the run, then a barrier (torchrun stops every rank once the first exits).
    Under torchrun, joins the process group and, if it made it, destroys it at the end (after an
    error, `saturate.engine.distributed.teardown_distributed()` does, once the error is handled).
    """
    from saturate.hardware import probe
    from saturate.plan_cache import workload_mismatch

    cfg = config or RunConfig()
    if plan is not None and (why := workload_mismatch(plan, workload)) is not None:
        raise ConfigError(why)  # before anything is probed or written
    hw = hardware or probe(measure_peaks=False, device=cfg.device)
    device_type = torch.device(hw.torch_device).type
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dist = init_distributed(device_type, stuck_after=cfg.stuck_after)  # joins torchrun's group; no-op in one process
    try:
        t = prepare(workload, plan, cfg, hw, dist)
        t.on_log, t.on_validation = on_log, on_validation
        if on_window is not None:
            t.on_window = on_window
            t.window_due = broadcast_object(on_window.first(t.step) if t.dist.is_main else None)
        result = _loop(t)
        if result.interrupted and on_stopped is not None:
            on_stopped(result)
            barrier()
    finally:  # the run folder's lock, taken by prepare (rank 0)
        release_run_dirs()
    # On an error the group is left up: the traceback holds DDP/DCP objects to free first (the CLI tears it down).
    if made_group:
        teardown_distributed()
    return result


def _loop(t: Training) -> RunResult:
    """The training loop: a step, then whatever is due at its end (log, validate, checkpoint)."""
    t.model.train()
    with t.stop.installed(), _closing(t.sinks), t.watch:
        stopping = False  # decided once per step, below: the loop never reads the signal flag directly
        while t.step < t.total_steps and not stopping:
            for group in t.stepper.optimizer.param_groups:
                group["lr"] = t.schedule.lr(t.step)
            if t.precision_guard is not None:
                _guard_precision(t)
            adapted = len(t.stepper.adaptations)
            t.stepper.step(t.batches, timer=t.watch.timer)  # the watch times only the wait for data
            if len(t.stepper.adaptations) > adapted:
                _absorbed_oom(t)
            t.step += 1
            if t.step == t.start_step + POLICY.job.grow_after:
                grow_micro_batch(t)  # the informed plan's on a GPU, from its measured peak (grow.py)
            t.window_steps += 1
            t.console.advance(t.step)  # host-only: moves the bar and ETA, reads nothing from the device
            stopping = _stop_due(t)

            step = t.step
            eval_due = t.val_loader is not None and (step % t.eval_every == 0 or step == t.total_steps)
            ckpt_due = step % t.ckpt_every == 0 or step == t.total_steps or stopping
            # Log before every validation and checkpoint too: the timing window then never spans
            # them, and no checkpoint is written for a step whose loss was not checked.
            asked = step == t.window_due
            if step % t.cfg.log_every == 0 or step == t.size_schedule_at or eval_due or ckpt_due or asked:
                steps_in_window = t.window_steps
                seconds = _log_window(t)
                if step == t.size_schedule_at:
                    _size_schedule(t, seconds / 5)
                if t.window_due is not None and _window_closed(t, Window(step, steps_in_window, seconds,
                                                                        t.total_steps), asked):
                    stopping = ckpt_due = True
                _relieve_host_memory(t)
            if eval_due:
                stopping = _validate(t) or stopping  # early stopping, or the on_validation callback
            if ckpt_due or stopping:
                _checkpoint(t)
        if t.workload.evaluate is not None and _done(t) and t.step > t.start_step:
            t.extra_metrics = t.workload.evaluate(t.model, t.device, t.plan.micro_batch)  # the workload's own
            _emit(t, {"step": t.step, **t.extra_metrics})
    return _finish(t)


# --- what the loop calls ----------------------------------------------------------------------


def _done(t: Training) -> bool:
    """The run is over: its schedule ran out, or it stopped on purpose (early stop, a callback)."""
    return t.paused is None and (t.step >= t.total_steps or t.stop_reason is not None)


def _emit(t: Training, record: dict[str, Any]) -> None:
    """A record to every sink and to the on_log callback (rank 0)."""
    if t.dist.is_main:
        t.sinks.write(record)
        if t.on_log is not None:
            t.on_log(dict(record))


def _stop_due(t: Training) -> bool:
    """Whether to stop after this step, decided once per step and agreed by every rank.

    Read once: a signal landing later in this step is seen at the next one, never between the
    checkpoint decision and the loop test (which would stop without a checkpoint, or, with several
    ranks, stop one rank a step before the others). A budget is not an interruption.
    """
    budget_out = t.deadline is not None and time.monotonic() >= t.deadline
    if t.world == 1:
        return t.stop.requested or budget_out
    # A signal or a budget seen by one rank stops all of them at this same step, for the same reason:
    # one all-reduce (max) of 2 × the signal's code + the budget flag.
    mine = 2 * t.stop.code + int(budget_out)
    agreed = int(all_reduce_scalar(float(mine), "max"))
    t.stop.adopt(agreed // 2)
    return agreed > 0


def _log_window(t: Training) -> float:
    """Close the timing window: read the loss (one host sync), check it, log the window's metrics.
    Returns the window's seconds."""
    seconds = now(t.device) - t.window_start  # now() synchronises the device first
    t.train_seconds += seconds
    # deliberate sync: logging; the mean over ranks, so every rank sees the same value
    t.train_loss = loss = all_reduce_mean_(t.stepper.take_loss_sum()).item() / t.window_steps
    if not math.isfinite(loss):  # every rank raises: they stop together
        raise SaturateError(f"training loss became {loss} at step {t.step}; lower the learning "
                            "rate or use fp32/bf16 (the last checkpoint is kept)")
    t.recheck_peak(t.window_steps, seconds)  # before the line: every MFU it and later lines print uses it
    if t.dist.is_main:
        metrics = step_metrics(t.workload, t.plan, t.effective, t.window_steps, seconds, loss,
                               t.stepper.grad_norm, t.schedule.lr(t.step - 1), t.peak, t.device)
        metrics.update(t.watch.window_metrics())  # telemetry means over the same window
        _emit(t, {"step": t.step, **metrics})
    t.window_steps, t.window_start = 0, now(t.device)
    return seconds


def _window_closed(t: Training, window: Window, asked: bool) -> bool:
    """train(on_window=…): rank 0's watch told of the window; at a step it asked for, its answer for every rank.
    Whether to pause here."""
    answer = t.on_window.closed(window) if t.dist.is_main else None  # type: ignore[union-attr]
    if not asked:
        return False
    t.window_due, t.paused = broadcast_object(answer)
    return t.paused is not None


def _guard_precision(t: Training) -> None:
    """Before each of the first steps: the lower precision's loss against fp32's at these weights; after the last
    check, the plan goes on in its precision or in fp32 (precision_guard.py), said in a note and plan.toml."""
    guard = t.precision_guard
    guard.check(t.model, t.stepper.precision)  # type: ignore[union-attr]
    if guard.due():  # type: ignore[union-attr]
        return
    t.precision_guard = None
    t.plan, line = guard.verdict(t.plan)  # type: ignore[union-attr]
    if t.plan.precision != t.stepper.precision.name:
        t.stepper.precision = make_precision(t.plan.precision, t.device.type, t.plan.attention)
    # the precision only: the Stepper's plan is the loader's (its micro-batch may have changed since: `current_plan`)
    t.stepper.plan = t.stepper.plan.replace(precision=t.plan.precision)
    t.save_plan()
    t.notes.append(line)
    t.console.note(line)


def _size_schedule(t: Training, seconds_per_step: float) -> None:
    """A --minutes run without --steps: size the schedule to the budget from the first steps' time."""
    total = steps_for_budget(t.step, seconds_per_step, t.deadline, t.console) if t.dist.is_main else None
    t.total_steps = t.schedule.total_steps = broadcast_object(total)


def _absorbed_oom(t: Training) -> None:
    """The Stepper halved the micro-batch after an OOM: record the plan now in force."""
    t.plan = t.stepper.current_plan()
    t.save_plan()
    t.console.note(t.notes[-1])
    if t.val_loader is not None:  # validation runs at the smaller micro-batch too
        t.val_loader = eval_loader(t.workload.val_data, t.plan, t.pin, stuck_after_s())


def _relieve_host_memory(t: Training) -> None:
    """When host RAM runs short or swap grows (agreed over ranks, which share a node's RAM), lower the
    loader's prefetch, then its workers, and restart the loaders at this step boundary."""
    if t.guard is None:
        return
    why = t.guard.pressure()
    if t.world > 1 and agree_any(why is not None):
        why = next(w for w in gather_objects(why) if w is not None)
    if not why or (eased := relieve(t.plan)) is None:
        return
    t.plan, change = eased
    t.stepper.plan = t.plan
    t.restart_loaders()
    t.save_plan()
    t.notes.append(f"step {t.step}: {why}; lowered {change} and restarted the loader")
    t.console.note(t.notes[-1])


def _validate(t: Training) -> bool:
    """Validate, log it, count it for early stopping; whether to stop here (agreed: rank 0's decision)."""
    # eager module, no recompile; every rank evaluates all of it (FSDP needs all ranks in a forward)
    t.val_loss = _evaluate(t.model, t.val_loader, t.workload, t.plan, t.stepper.precision, t.device)
    record = {"step": t.step, "val/loss": t.val_loss}
    _emit(t, record)
    reason = t.early_stop.update(t.step, t.val_loss) if t.early_stop is not None else None
    if t.dist.is_main and t.on_validation is not None and t.on_validation(dict(record)) is True and reason is None:
        reason = f"the on_validation callback stopped the run at step {t.step}"
    t.stop_reason = broadcast_object(reason)
    t.window_start = now(t.device)  # validation time is not training throughput
    t.watch.reset()
    return t.stop_reason is not None


def _checkpoint(t: Training) -> None:
    # A diverging step can leave NaN or infinite state behind a finite loss: never save it, so the newest
    # checkpoint is always one a resume can continue from.
    if not state_is_finite(t.model, t.stepper.optimizer, t.stepper.grad_norm):
        kept = t.ckpts.checkpoints()
        kept_text = f"the last finite checkpoint (step {kept[-1][0]}) is kept" if kept else "no checkpoint was written"
        raise SaturateError(f"the model or optimizer state became non-finite (nan or inf) by step {t.step}, so it "
                            f"was not saved; lower the learning rate; {kept_text}")
    state = snapshot(t.step, t.stepper, t.stepper.precision, t.schedule, t.plan, t.fingerprint,
                     t.workload.identity, t.elapsed_before + t.train_seconds, t.cfg.seed, t.world,
                     optimization_record(t.workload.optim),
                     t.early_stop.state_dict() if t.early_stop is not None else None)
    with t.stop.deferred():  # a signal during the write is held until the checkpoint is whole
        if t.stepper.strategy == "single":
            t.last_ckpt = t.ckpts.save(t.step, state)
        else:
            rng = state.pop("rng")
            t.last_ckpt = t.ckpts.save_sharded(t.step, t.model, t.stepper.optimizer, state, {"rng": rng})
    t.window_start = now(t.device)
    t.watch.reset()


def _finish(t: Training) -> RunResult:
    """Export the weights of a finished run, write summary.json, print the summary."""
    weights = None
    if t.cfg.export_weights and _done(t):
        weights = export_weights(t.model, t.run_dir, t.workload, t.stepper.strategy, t.dist)
    result = RunResult(
        run_dir=t.run_dir, plan=t.plan, steps=t.step, total_steps=t.total_steps, train_seconds=t.train_seconds,
        tokens_per_s=None, samples_per_s=None, mfu=None, peak_label=t.peak_label,
        peak_memory_bytes=None, memory_kind="device" if t.device.type == "cuda" else "host RSS",
        train_loss=t.train_loss, val_loss=t.val_loss, checkpoint=t.last_ckpt, weights=weights,
        stopped_early=t.step < t.total_steps, interrupted=t.stop.interrupted,
        stop_signal=t.stop.signal_name, notes=t.notes, stop_reason=_stop_reason(t), finished=_done(t),
        metrics=t.extra_metrics, paused=t.paused is not None,
    )
    steps = t.step - t.start_step
    t.recheck_peak(steps, t.train_seconds)  # the whole session's rate, where no window's out-ran the peak
    result.peak_label = t.peak_label
    fill_summary(result, t.workload, t.effective, steps, t.peak, t.device, t.run_dir, t.dist)
    t.console.finish(result)
    return result


def _stop_reason(t: Training) -> str | None:
    if t.paused is not None:
        return t.paused
    if t.stop_reason is not None or t.step >= t.total_steps:
        return t.stop_reason
    if t.stop.interrupted:
        return f"stopped by {t.stop.signal_name}"
    return "the --minutes budget ran out" if t.deadline is not None else None


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


@contextlib.contextmanager
def _closing(sinks: Sinks) -> Iterator[None]:
    """Close every sink however the loop ends, so an error never leaves a live progress display."""
    try:
        yield
    finally:
        sinks.close()

