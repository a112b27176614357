"""torch.distributed under torchrun: the process group, each rank's device, and the few collectives
that keep ranks' decisions identical.

Everything here is a no-op in one process, so the single-process path walks the same code. The
process group is PyTorch's own (`init_process_group` with torchrun's env:// rendezvous): NCCL
(RCCL on ROCm) for CUDA tensors, with gloo beside it for the small CPU tensors that carry
decisions (an OOM flag, a stop request), so agreeing on a decision never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from saturate.errors import ConfigError

_created_here = False  # whether init_distributed made the process group (then teardown destroys it)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group is up, so collectives are real (also for an FSDP run of one process)."""
        return dist.is_available() and dist.is_initialized()


def dist_info() -> DistInfo:
    """Read RANK / LOCAL_RANK / WORLD_SIZE as torchrun sets them (defaults: one process)."""
    try:
        return DistInfo(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    except ValueError as e:
        raise ConfigError(f"RANK / LOCAL_RANK / WORLD_SIZE must be integers: {e}") from None


def init_distributed(device_type: str, *, one_process_group: bool = False) -> DistInfo:
    """Join torchrun's process group (idempotent) and bind this rank to its GPU.

    `device_type` is "cuda" (ROCm too), "cpu" or "mps". With WORLD_SIZE 1 nothing happens, unless
    `one_process_group` asks for a group of one (FSDP in a single process, for its CPU offload and
    mixed-precision policy). Returns the ranks as the group sees them.
    """
    global _created_here
    info = dist_info()
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), info.local_rank, dist.get_world_size())
    if info.world_size == 1 and not one_process_group:
        return info
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; it cannot run several processes")
    if device_type == "mps":
        raise ConfigError("torch.distributed has no MPS backend: run DDP/FSDP on CUDA/ROCm GPUs or on the CPU")
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if info.local_rank >= count:
            raise ConfigError(f"LOCAL_RANK {info.local_rank} but only {count} GPU(s) are visible: start at most "
                              f"{count} processes per node (torchrun --nproc_per_node={count})")
        torch.cuda.set_device(info.local_rank)
        backend = "cuda:nccl,cpu:gloo"  # NCCL/RCCL for gradients, gloo for CPU decision flags
    else:
        backend = "gloo"
    if info.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)  # env:// rendezvous set up by torchrun
    _created_here = True
    return DistInfo(dist.get_rank(), info.local_rank, dist.get_world_size())


def teardown_distributed() -> None:
    """Destroy the process group if init_distributed created it (a caller's own group is left alone)."""
    global _created_here
    if _created_here and dist.is_available() and dist.is_initialized():
        # DDP's reducer and DCP's planners sit in reference cycles that hold the group's work objects;
        # freed only at interpreter exit, after the group, they abort the process (std::terminate).
        gc.collect()
        dist.destroy_process_group()
    _created_here = False


@contextlib.contextmanager
def distributed_session(device_type: str, *, one_process_group: bool = False) -> Iterator[DistInfo]:
    """init_distributed for the block, teardown after it (also when it raises)."""
    info = init_distributed(device_type, one_process_group=one_process_group)
    try:
        yield info
    finally:
        teardown_distributed()


def rank_device(device_type: str, info: DistInfo) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under torchrun, else the device type itself."""
    if device_type == "cuda" and info.active:
        return torch.device("cuda", info.local_rank)
    return torch.device(device_type)


# --- collectives for decisions (CPU tensors: no device sync) ---------------------------------------

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "mean": "SUM"}


def all_reduce_scalar(value: float, op: str = "mean") -> float:
    """Reduce one number over all ranks ("sum", "mean", "max" or "min"); identity in one process.

    For the tuner's trial results (each rank measures; all must pick the same plan) and the like.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]))
    out = float(t[0])
    return out / dist.get_world_size() if op == "mean" else out


def agree_any(flag: bool) -> bool:
    """True on every rank when it is true on any rank: the way ranks decide to shrink, skip or stop together."""
    return all_reduce_scalar(1.0 if flag else 0.0, "max") > 0


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s value of a small picklable object, on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))
    return box[0]


def barrier() -> None:
    """Wait for every rank (over gloo, so it never depends on which GPU a rank has bound)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1))


def all_reduce_mean_(tensor: torch.Tensor) -> torch.Tensor:
    """In place: the mean of `tensor` over ranks (on its own device's backend)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(dist.get_world_size())
    return tensor


def resolve_strategy(strategy: str, world_size: int) -> tuple[str, str | None]:
    """The strategy to run with for a plan's `strategy` at `world_size` processes, and a note when it changed.

    - "single" under torchrun with several processes becomes "ddp": ranks training alone would each
      fit a different model; the effective batch stays micro × accumulation × processes.
    - "ddp" in one process becomes "single" (with a note, not an error): a replica of one needs no
      wrapper, and a DDP plan or checkpoint stays usable on one device (a resume on fewer GPUs).
    - "fsdp" stays "fsdp" at any count: in one process it still gives FSDP2's mixed-precision
      policy and CPU offload, for a model that does not fit on the device.
    """
    if strategy == "single" and world_size > 1:
        return "ddp", (f"plan.strategy 'single' with {world_size} processes under torchrun: training with DDP "
                       "(set strategy = \"ddp\" or \"fsdp\" in the plan to choose)")
    if strategy == "ddp" and world_size == 1:
        return "single", ("plan.strategy 'ddp' with one process: training single-process; launch with "
                          "`torchrun --nproc_per_node=N -m saturate train ...` to use N processes")
    return strategy, None


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's value of a small picklable object, in rank order, on every rank ([obj] in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
