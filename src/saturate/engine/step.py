"""One optimizer step of a plan, shared by the trainer, the tuner's trials and the doctor.

`Stepper` builds what a plan needs around a workload (activation checkpointing -> model on the
device -> AdamW -> torch.compile, proven on one micro-batch) and runs one step: the step's
loader batches are split into micro-batches, each forward/backward adds its share of the mean
loss, then the optimizer steps. No host sync happens inside a step.

An out-of-memory error inside forward/backward halves the micro-batch and doubles the
accumulation, then retries the same samples, so the step's result is unchanged (`adapt_oom`).
An OOM anywhere else (the optimizer step, the copy to the device) is raised.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import default_collate

from saturate.engine.precision import Precision, make_precision, set_tf32
from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.workload import Workload

# torch.OutOfMemoryError is new in 2.5; torch.cuda.OutOfMemoryError is the same class there and older.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# timer(phase) -> context manager around each phase: "data", "h2d", "forward", "backward", "optimizer".
Timer = Callable[[str], contextlib.AbstractContextManager]
_NULL = contextlib.nullcontext()


def _no_timer(phase: str) -> contextlib.AbstractContextManager:
    return _NULL


class MicroBatchOOM(SaturateError):
    """Out of memory in forward/backward at micro-batch 1: nothing smaller is left to try."""


@dataclass
class Adaptation:
    step: int  # the optimizer step that was retried
    micro_batch: int  # the new micro-batch
    grad_accum: int  # the new accumulation (per loader batch × loader batches per step)
    reason: str


class Stepper:
    """Model, optimizer and precision for one plan, and `step()` to run one optimizer step."""

    def __init__(self, workload: Workload, plan: Plan, device: torch.device, lr: float, *,
                 notes: list[str] | None = None, compile: bool = True, adapt_oom: bool = True) -> None:
        self.workload, self.plan, self.device = workload, plan, device
        self.notes = notes if notes is not None else []
        self.adapt_oom = adapt_oom
        set_tf32(plan.tf32)
        self.precision: Precision = make_precision(plan.precision, device.type)
        model = workload.build_model()
        if plan.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model: nn.Module = model.to(device)
        self.optimizer, fused = build_optimizer(model, workload.optim, lr, plan.fused_optimizer, device)
        if plan.fused_optimizer and not fused:
            self.notes.append(f"fused AdamW is not available on {device.type}; using the foreach implementation")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_model: nn.Module = model
        if compile:
            self.compile_model()
        self.micro_batch = plan.micro_batch  # may shrink on OOM; the loader keeps plan.micro_batch
        self.loss_sum = torch.zeros((), device=device)  # sum of per-step mean losses since the last read
        self.grad_norm: torch.Tensor | None = None  # pre-clip global norm of the last step (clipping on)
        self.adaptations: list[Adaptation] = []
        self.steps_done = 0

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step at the current micro-batch."""
        return self.plan.grad_accum * self.plan.micro_batch // self.micro_batch

    def current_plan(self) -> Plan:
        """The plan as it now runs (after any OOM adaptation)."""
        if self.micro_batch == self.plan.micro_batch:
            return self.plan
        return self.plan.replace(micro_batch=self.micro_batch, grad_accum=self.grad_accum)

    def step(self, batches: Iterator[Any], timer: Timer | None = None) -> None:
        """One optimizer step over `plan.grad_accum` loader batches of `plan.micro_batch` samples."""
        timer = timer or _no_timer
        fetched: list[Any] = []
        while True:
            try:
                step_loss = self._forward_backward(batches, fetched, timer)
                break
            except OutOfMemoryError as e:
                if not self.adapt_oom:
                    raise
                message = str(e).strip().splitlines()[0][:160] if str(e).strip() else "out of memory"
            self._recover_from_oom(message)  # outside the except block, so the failed frames are freed
        with timer("optimizer"):
            self.grad_norm = optimizer_step(self.optimizer, self.precision, self.params, self.workload.optim.grad_clip)
        self.loss_sum += step_loss
        self.steps_done += 1

    def take_loss_sum(self) -> torch.Tensor:
        """The summed per-step losses since the last call (still on the device); resets the sum."""
        total, self.loss_sum = self.loss_sum, torch.zeros((), device=self.device)
        return total

    # --- internals ------------------------------------------------------------------------------

    def _forward_backward(self, batches: Iterator[Any], fetched: list[Any], timer: Timer) -> torch.Tensor:
        """Forward/backward over the step's samples; `fetched` keeps host batches for an OOM retry."""
        plan, micro = self.plan, self.micro_batch
        total_micro = self.grad_accum
        step_loss = torch.zeros((), device=self.device)
        for k in range(plan.grad_accum):
            if k == len(fetched):
                with timer("data"):
                    fetched.append(next(batches))
            with timer("h2d"):
                on_device = to_device(fetched[k], self.device, plan.non_blocking)
            chunks = [on_device] if micro == plan.micro_batch else split_batch(on_device, micro)
            for chunk in chunks:
                with timer("forward"), self.precision.autocast():
                    loss = self.workload.loss_fn(self.step_model, chunk) / total_micro
                with timer("backward"):
                    if self.precision.scaler is not None:
                        self.precision.scaler.scale(loss).backward()
                    else:
                        loss.backward()
                step_loss += loss.detach()
        return step_loss

    def _recover_from_oom(self, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # drop the partial step's gradients
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.micro_batch == 1:
            raise MicroBatchOOM(f"out of memory in forward/backward even at micro-batch 1 ({message}); enable "
                                "activation_checkpointing or use a device with more memory")
        old = self.micro_batch
        self.micro_batch = largest_divisor_below(self.plan.micro_batch, old)
        reason = f"out of memory at micro-batch {old} ({message})"
        self.adaptations.append(Adaptation(self.steps_done, self.micro_batch, self.grad_accum, reason))
        self.notes.append(f"step {self.steps_done + 1}: {reason}; retrying the same samples at micro-batch "
                          f"{self.micro_batch} × {self.grad_accum} accumulation (effective batch unchanged)")

    def compile_model(self) -> None:
        """torch.compile the model, proving it on one micro-batch; on any failure fall back to eager."""
        self.step_model = self._compile(self.model)

    def _compile(self, model: nn.Module) -> nn.Module:
        plan = self.plan
        if plan.compile == "none":
            return model
        compiled = torch.compile(model, mode=None if plan.compile == "default" else plan.compile)
        rng = rng_state()  # the trial must not shift the run's random stream
        data = self.workload.train_data
        batch = to_device(default_collate([data[i] for i in range(plan.micro_batch)]), self.device, False)
        try:
            with self.precision.autocast():
                self.workload.loss_fn(compiled, batch).backward()
        except Exception as e:  # compilation errors come in many types (BackendCompilerFailed, …)
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            self.notes.append(f"torch.compile(mode={plan.compile!r}) failed ({type(e).__name__}: {first}); "
                              "training in eager mode")
            compiled = model
        finally:
            model.zero_grad(set_to_none=True)
            set_rng_state(rng)
        return compiled


def largest_divisor_below(n: int, below: int) -> int:
    """The largest divisor of n that is <= below // 2 (at least 1): the next micro-batch after an OOM."""
    target = max(1, below // 2)
    return max(d for d in range(1, target + 1) if n % d == 0)


def split_batch(batch: Any, size: int) -> list[Any]:
    """Split a batch (tensor, tuple/list or dict of tensors) along dim 0 into chunks of `size`."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(b, size) for b in batch]
        return [type(batch)(p) for p in zip(*parts, strict=True)]
    if isinstance(batch, dict):
        keys = list(batch)
        parts = [split_batch(batch[k], size) for k in keys]
        return [dict(zip(keys, p, strict=True)) for p in zip(*parts, strict=True)]
    raise ConfigError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def enable_activation_checkpointing(model: nn.Module) -> None:
    if hasattr(model, "set_activation_checkpointing"):
        model.set_activation_checkpointing(True)
    elif hasattr(model, "gradient_checkpointing_enable"):  # Hugging Face models
        model.gradient_checkpointing_enable()
    else:
        raise ConfigError(f"plan.activation_checkpointing: {type(model).__name__} has no way to enable it")


def build_optimizer(model: nn.Module, o: Any, lr: float, fused: bool,
                    device: torch.device) -> tuple[torch.optim.Optimizer, bool]:
    """AdamW with weight decay on matrices only; returns (optimizer, whether it is the fused kernel)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=o.betas, fused=True), True
        except (RuntimeError, TypeError):
            pass  # this device/dtype has no fused kernel
    return torch.optim.AdamW(groups, lr=lr, betas=o.betas, foreach=device.type != "mps"), False


def optimizer_step(optimizer: torch.optim.Optimizer, precision: Precision, params: list[torch.Tensor],
                   grad_clip: float | None) -> torch.Tensor | None:
    """Unscale (fp16), clip, step, clear. Returns the pre-clip gradient norm, left on the device."""
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip is not None else None
    if scaler is not None:
        scaler.step(optimizer)  # skips the step when the gradients overflowed
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
