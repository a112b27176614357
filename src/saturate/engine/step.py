"""One optimizer step of a plan, shared by the trainer, the tuner's trials and the doctor.

`Stepper` builds what a plan needs around a workload, in a fixed order: activation checkpointing
-> model on the device -> torch.compile (proven on one micro-batch) -> DDP or FSDP2 -> AdamW. It
runs one step: the step's loader batches are split into micro-batches, each forward/backward adds
its share of the mean loss, then the optimizer steps. No host sync happens inside a step.

An out-of-memory error inside forward/backward halves the micro-batch and doubles the
accumulation, then retries the same samples, so the step's result is unchanged (`adapt_oom`).
An OOM anywhere else (the optimizer step) is raised. The micro-batch may also grow between steps
(`grow`: engine/grow.py, the informed plan on a GPU), several loader batches then joined into one.

Under DDP, gradients are synchronised only in the last micro-step's backward (`no_sync` before
it). Ranks agree on an OOM before that synchronising backward, so all of them shrink and retry
together; see `_forward_backward_ddp` for how the first step at a micro-batch is made safe too.
Under FSDP2, gradient reduce-scatter is skipped on all but the last micro-step
(`set_requires_gradient_sync`); FSDP gathers parameters inside every forward and backward, so an
OOM there cannot be retried in lock-step and ends the run with a clear message.

The wrapping itself (FSDP2, DDP, activation checkpointing, AdamW) is in wrap.py.

Over 400 lines because the Stepper's OOM handling for one process, DDP and FSDP is one state machine
(micro-batch, accumulation, the agreed flag) that reads best in one place.
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

from saturate.engine.distributed import DistInfo, agree_any, gather_objects
from saturate.engine.host_alloc import keep_freed_memory
from saturate.engine.precision import Precision, make_precision, set_tf32
from saturate.engine.wrap import (
    all_reduce_gradients,
    build_optimizer,
    enable_activation_checkpointing,
    enable_chunked_loss,
    repeated_blocks,
    shard_model,
    wrap_ddp,
)
from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.workloads.base import Workload

# torch.OutOfMemoryError is new in 2.5; torch.cuda.OutOfMemoryError is the same class there and older.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# timer(phase) -> context manager around each phase: "data", "h2d", "forward", "backward", "optimizer".
Timer = Callable[[str], contextlib.AbstractContextManager]
_NULL = contextlib.nullcontext()


def _no_timer(phase: str) -> contextlib.AbstractContextManager:
    return _NULL


class MicroBatchOOM(SaturateError):
    """Out of memory in forward/backward at micro-batch 1: nothing smaller is left to try."""


class CannotJoin(SaturateError):
    """Loader batches a grown micro-batch was to join differ in shape or structure (`Stepper.grow`)."""


class DistributedOOM(SaturateError):
    """Out of memory where the other ranks are already inside a collective: it cannot be retried in lock-step."""


@dataclass
class Adaptation:
    step: int  # the optimizer step that was retried
    micro_batch: int  # the new micro-batch
    grad_accum: int  # the new accumulation (per loader batch × loader batches per step)
    reason: str


_threads_before: int | None = None  # the count before a plan set its own, given back to the next plan without one


def use_threads(n: int | None) -> None:
    """torch's intra-op threads for a plan (process-wide, like TF32): `n`; for None, whatever the process had before
    a plan set its own (a count the user set stays untouched)."""
    global _threads_before
    now = torch.get_num_threads()
    if n is not None:
        if _threads_before is None:
            _threads_before = now
        if now != n:
            torch.set_num_threads(n)
    elif _threads_before is not None:
        if now != _threads_before:
            torch.set_num_threads(_threads_before)
        _threads_before = None


def own_threads() -> int:
    """The process's own intra-op thread count: what it had before a plan set its own (a trial at fewer threads
    leaves torch's count set until a plan without one runs), else torch's count now."""
    return _threads_before if _threads_before is not None else torch.get_num_threads()


class Stepper:
    """Model, optimizer and precision for one plan, and `step()` to run one optimizer step."""

    def __init__(self, workload: Workload, plan: Plan, device: torch.device, lr: float, *,
                 notes: list[str] | None = None, compile: bool = True, adapt_oom: bool = True,
                 dist: DistInfo | None = None) -> None:
        """`dist` (with a process group up) is needed for plan.strategy "ddp" and "fsdp"."""
        self.workload, self.plan, self.device = workload, plan, device
        self.notes = notes if notes is not None else []
        self.dist = dist or DistInfo()
        self.strategy = plan.strategy
        if self.strategy != "single" and not self.dist.active:
            raise ConfigError(f"plan.strategy {plan.strategy!r} needs a torch.distributed process group "
                              "(launch with torchrun; saturate.engine.distributed.init_distributed)")
        if self.strategy == "single" and self.dist.world_size > 1:
            raise ConfigError(f"plan.strategy 'single' with {self.dist.world_size} processes: every rank would "
                              "train its own model; use strategy 'ddp' or 'fsdp'")
        self.adapt_oom = adapt_oom
        set_tf32(plan.tf32)
        use_threads(plan.threads)
        if device.type == "cpu" and (said := keep_freed_memory()) not in self.notes:  # process-wide: glibc reuses
            self.notes.append(said)  # the step's buffers (engine/host_alloc.py); said once per run, however rebuilt
        self.precision: Precision = make_precision(plan.precision, device.type, plan.attention)
        model = workload.build_model()
        if plan.activation_checkpointing:
            enable_activation_checkpointing(model)
        if plan.loss_chunk is not None:
            enable_chunked_loss(model, plan.loss_chunk)
        if self.strategy == "fsdp":
            shard_model(model, device, self.precision, plan.cpu_offload, self.notes)  # moves the shards itself
        else:
            model.to(device)
        self.model: nn.Module = model  # the module (DDP's inner one): state dicts, evaluation, export
        self.wrapped: nn.Module = model  # what a training forward goes through
        if self.strategy == "ddp":
            self.wrapped = wrap_ddp(model, device)
        self.optimizer, fused = build_optimizer(model, workload.optim, lr, plan.fused_optimizer, device)
        if plan.fused_optimizer and not fused:
            self.notes.append(f"fused AdamW is not available on {device.type}; using the foreach implementation")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_model: nn.Module = self.wrapped
        self.micro_batch = plan.micro_batch  # may shrink on OOM, or grow (`grow`); the loader keeps plan.micro_batch
        # DDP: the micro-batch at which a whole step ran with optimizer state allocated, so the
        # synchronising backward is known to fit and may overlap its all-reduce (see _forward_backward_ddp).
        self._proven_micro: int | None = None
        self._compiled_unproven = False  # FSDP: compiled per block, first step not yet run
        self.compiled = False  # whether torch.compile is in use (False after a failed proof fell back to eager)
        if compile:
            self.compile_model()
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

    def grow(self, micro: int) -> None:
        """From the next step, `micro` samples per forward/backward: a multiple of the loader's batch
        (`plan.micro_batch`, that many of them joined: `join_batches`) that divides the step's samples. An OOM at it
        halves it as any micro-batch (`_recover_from_oom`)."""
        m, per_step = self.plan.micro_batch, self.plan.micro_batch * self.plan.grad_accum
        if micro <= self.micro_batch or micro % m or per_step % micro:
            raise ValueError(f"micro-batch {micro} is not a larger multiple of {m} within a step of {per_step}")
        self.micro_batch = micro

    def step(self, batches: Iterator[Any], timer: Timer | None = None) -> None:
        """One optimizer step over `plan.grad_accum` loader batches of `plan.micro_batch` samples."""
        use_threads(self.plan.threads)  # process-wide: another plan's Stepper may have run in between (paired.py)
        timer = timer or _no_timer
        fetched: list[Any] = []
        if self.strategy == "ddp":
            while (step_loss := self._forward_backward_ddp(batches, fetched, timer)) is None:
                pass  # every rank recovered from an OOM on some rank; retry the same samples
        elif self.strategy == "fsdp":
            step_loss = self._forward_backward_fsdp(batches, fetched, timer)
        else:
            while True:
                try:
                    step_loss = self._forward_backward(batches, fetched, timer)
                    break
                except OutOfMemoryError as e:
                    if not self.adapt_oom:
                        raise
                    message = _first_line(e)
                except CannotJoin as e:  # a grown micro-batch: back to the loader's, the same samples again
                    self._back_to_loader_batches(str(e))
                    continue
                self._recover_from_oom(message)  # outside the except block, so the failed frames are freed
        with timer("optimizer"):
            grad_norm = optimizer_step(self.optimizer, self.precision, self.params, self.workload.optim.grad_clip)
        # FSDP: the norm is a replicated DTensor; its local value is the global norm.
        self.grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.loss_sum += step_loss
        self.steps_done += 1

    def take_loss_sum(self) -> torch.Tensor:
        """The summed per-step losses since the last call (still on the device); resets the sum."""
        total, self.loss_sum = self.loss_sum, torch.zeros((), device=self.device)
        return total

    # --- internals ------------------------------------------------------------------------------

    def _micro_batches(self, batches: Iterator[Any], fetched: list[Any], timer: Timer) -> Iterator[Any]:
        """The step's micro-batches on the device; `fetched` keeps host batches for an OOM retry."""
        plan, micro = self.plan, self.micro_batch
        join = max(1, micro // plan.micro_batch)  # loader batches per micro-batch: more than one when grown
        for k in range(0, plan.grad_accum, join):
            while len(fetched) < k + join:
                with timer("data"):
                    fetched.append(next(batches))
            with timer("h2d"):
                on_device = [to_device(b, self.device, plan.non_blocking) for b in fetched[k:k + join]]
            if join > 1:
                try:
                    joined = join_batches(on_device)
                except (ConfigError, RuntimeError) as e:  # torch.cat: shapes that differ beyond dim 0
                    raise CannotJoin(_first_line(e)) from None
                yield joined
            else:
                yield from on_device if micro == plan.micro_batch else split_batch(on_device[0], micro)

    def _micro_step(self, chunk: Any, total_micro: int, timer: Timer) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (detached) share of the step's mean loss."""
        with timer("forward"), self.precision.autocast():
            loss = self.workload.loss_fn(self.step_model, chunk) / total_micro
        with timer("backward"):
            if self.precision.scaler is not None:
                self.precision.scaler.scale(loss).backward()
            else:
                loss.backward()
        return loss.detach()

    def _forward_backward(self, batches: Iterator[Any], fetched: list[Any], timer: Timer) -> torch.Tensor:
        """Forward/backward over the step's samples in one process."""
        total_micro = self.grad_accum
        step_loss = torch.zeros((), device=self.device)
        for chunk in self._micro_batches(batches, fetched, timer):
            step_loss += self._micro_step(chunk, total_micro, timer)
        return step_loss

    def _forward_backward_ddp(self, batches: Iterator[Any], fetched: list[Any], timer: Timer) -> torch.Tensor | None:
        """DDP forward/backward; None on every rank when any rank ran out of memory (all have then shrunk).

        No collective runs inside a `no_sync` micro-step, so a rank that runs out of memory there
        just stops, and all ranks meet at one all-reduce of an OOM flag (CPU, no device sync)
        before the synchronising backward. That backward cannot be retried once it has started:
        the other ranks are inside its gradient all-reduce. So the first step at a micro-batch
        (and the second, the first with optimizer state allocated) runs every micro-step under
        no_sync, agrees, then all-reduces the gradients itself; later steps at a proven
        micro-batch let DDP overlap the all-reduce with the last backward.
        """
        total = self.grad_accum
        overlap = self.micro_batch == self._proven_micro
        had_state = bool(self.optimizer.state)
        step_loss = torch.zeros((), device=self.device)
        micro_batches = self._micro_batches(batches, fetched, timer)
        message = None
        try:
            for _ in range(total - 1 if overlap else total):
                chunk = next(micro_batches)
                with self.wrapped.no_sync():
                    step_loss += self._micro_step(chunk, total, timer)
        except OutOfMemoryError as e:
            message = _first_line(e)
        if (total > 1 or not overlap) and agree_any(message is not None):
            culprits = [(r, m) for r, m in enumerate(gather_objects(message)) if m is not None]
            del micro_batches
            rank, text = culprits[0]
            if not self.adapt_oom:  # every rank raises, so a tuner's trial ends the same way on all of them
                self.optimizer.zero_grad(set_to_none=True)
                raise OutOfMemoryError(f"rank {rank}: {text}")
            self._recover_from_oom(f"rank {rank}: {text}")
            return None
        if overlap:
            chunk = next(micro_batches)
            try:
                step_loss += self._micro_step(chunk, total, timer)  # DDP all-reduces gradients in this backward
            except OutOfMemoryError as e:
                raise DistributedOOM(
                    f"out of memory on rank {self.dist.rank} in the gradient-synchronising backward at micro-batch "
                    f"{self.micro_batch} ({_first_line(e)}), a micro-batch that had fitted before; the other ranks "
                    "are inside its all-reduce, so it cannot be retried in lock-step. Lower plan.micro_batch "
                    "(raising grad_accum) and resume") from None
        else:
            all_reduce_gradients(self.params, self.dist.world_size)
            if had_state:
                self._proven_micro = self.micro_batch
        return step_loss

    def _forward_backward_fsdp(self, batches: Iterator[Any], fetched: list[Any], timer: Timer) -> torch.Tensor:
        """FSDP2 forward/backward: gradients are reduce-scattered only in the last micro-step's backward."""
        total = self.grad_accum
        step_loss = torch.zeros((), device=self.device)
        try:
            for i, chunk in enumerate(self._micro_batches(batches, fetched, timer)):
                self.wrapped.set_requires_gradient_sync(i == total - 1)
                step_loss += self._micro_step(chunk, total, timer)
        except OutOfMemoryError as e:
            raise DistributedOOM(
                f"out of memory on rank {self.dist.rank} in forward/backward under FSDP at micro-batch "
                f"{self.micro_batch} ({_first_line(e)}); FSDP gathers parameters inside forward and backward, "
                "so ranks cannot retry in lock-step. Lower plan.micro_batch (raising grad_accum), or enable "
                "activation_checkpointing or cpu_offload") from None
        except Exception as e:
            if self._compiled_unproven and _is_compile_error(e):
                raise ConfigError(f"torch.compile(mode={self.plan.compile!r}) failed under FSDP ({_first_line(e)}); "
                                  "set compile = \"none\" in the plan") from None
            raise
        self._compiled_unproven = False
        return step_loss

    def _back_to_loader_batches(self, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # drop the partial step's gradients
        old, self.micro_batch = self.micro_batch, self.plan.micro_batch
        reason = f"the loader's batches cannot be joined into micro-batch {old} ({message})"
        self.adaptations.append(Adaptation(self.steps_done, self.micro_batch, self.grad_accum, reason))
        self.notes.append(f"step {self.steps_done + 1}: {reason}; retrying the same samples at micro-batch "
                          f"{self.micro_batch} × {self.grad_accum} accumulation (effective batch unchanged)")

    def _recover_from_oom(self, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # drop the partial step's gradients
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.micro_batch == 1:
            raise MicroBatchOOM(f"out of memory in forward/backward even at micro-batch 1 ({message}); enable "
                                "activation_checkpointing or use a device with more memory")
        old, m = self.micro_batch, self.plan.micro_batch
        # a grown micro-batch goes back through the multiples of the loader's batch first, then its divisors
        joined = [d for d in range(2 * m, old // 2 + 1, m) if (m * self.plan.grad_accum) % d == 0]
        self.micro_batch = max(joined) if joined else largest_divisor_below(m, old)
        reason = f"out of memory at micro-batch {old} ({message})"
        self.adaptations.append(Adaptation(self.steps_done, self.micro_batch, self.grad_accum, reason))
        self.notes.append(f"step {self.steps_done + 1}: {reason}; retrying the same samples at micro-batch "
                          f"{self.micro_batch} × {self.grad_accum} accumulation (effective batch unchanged)")

    def compile_model(self) -> None:
        """torch.compile the model, proving it on one micro-batch; on any failure fall back to eager.

        One process: the whole model, wrapped. DDP/FSDP: each repeated block in place (torchtitan's
        way), so DDP's per-bucket all-reduce and FSDP's per-block gathers still overlap compute.
        """
        if self.strategy == "single":
            self.step_model = self._compile(self.model)
            self.compiled = self.step_model is not self.model
            return
        if self.plan.compile == "none":
            return
        self.compiled = True
        mode = None if self.plan.compile == "default" else self.plan.compile
        targets = repeated_blocks(self.model) or [self.model]
        for module in targets:
            module.compile(mode=mode)
        if self.strategy == "fsdp":
            # A proof would run a forward through FSDP's gathers; a failure there could strand other
            # ranks in a collective. The first step is the proof, and a failure is reported clearly.
            self._compiled_unproven = True
            return
        message = self._prove(self.model)  # DDP's inner module: no collectives
        failures = [m for m in gather_objects(message) if m is not None]
        if failures:
            for module in targets:
                module._compiled_call_impl = None  # undo nn.Module.compile: eager again, on every rank
            self.compiled = False
            self.notes.append(f"torch.compile(mode={self.plan.compile!r}) failed ({failures[0]}); "
                              "training in eager mode")

    def _prove(self, model: Callable[..., Any]) -> str | None:
        """One forward/backward of the first micro-batch through `model` (compiled); None if it ran, else why not."""
        rng = rng_state()  # the trial must not shift the run's random stream
        data = self.workload.train_data
        batch = to_device(default_collate([data[i] for i in range(self.plan.micro_batch)]), self.device, False)
        try:
            with self.precision.autocast():
                self.workload.loss_fn(model, batch).backward()
            return None
        except Exception as e:  # compilation errors come in many types (BackendCompilerFailed, …)
            return f"{type(e).__name__}: {_first_line(e, '')}"
        finally:
            self.model.zero_grad(set_to_none=True)
            set_rng_state(rng)

    def _compile(self, model: nn.Module) -> nn.Module:
        plan = self.plan
        if plan.compile == "none":
            return model
        compiled = torch.compile(model, mode=None if plan.compile == "default" else plan.compile)
        failure = self._prove(compiled)
        if failure is not None:
            self.notes.append(f"torch.compile(mode={plan.compile!r}) failed ({failure}); training in eager mode")
            return model
        return compiled


def _first_line(e: BaseException, default: str = "out of memory") -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else default


def _is_compile_error(e: BaseException) -> bool:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(e, TorchDynamoException)


def largest_divisor_below(n: int, below: int) -> int:
    """The largest divisor of n that is <= below // 2 (at least 1): the next micro-batch after an OOM."""
    target = max(1, below // 2)
    return max(d for d in range(1, target + 1) if n % d == 0)


def join_batches(batches: list[Any]) -> Any:
    """Batches of one structure (tensor, tuple/list or dict of tensors) joined along dim 0: `split_batch` undone."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, (list, tuple)):
        return type(first)(join_batches(list(parts)) for parts in zip(*batches, strict=True))
    if isinstance(first, dict):
        return {k: join_batches([b[k] for b in batches]) for k in first}
    raise ConfigError(f"cannot join batches of type {type(first).__name__} into a larger micro-batch")


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
