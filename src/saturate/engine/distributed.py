"""torch.distributed under torchrun: the process group, each rank's device, and the few collectives
that keep ranks' decisions identical.

Everything here is a no-op in one process, so the single-process path walks the same code. The
process group is PyTorch's own (`init_process_group` with torchrun's env:// rendezvous): NCCL
(RCCL on ROCm) for CUDA tensors, with gloo beside it for the small CPU tensors that carry
decisions (an OOM flag, a stop request), so agreeing on a decision never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from saturate.errors import ConfigError

_created_here = False  # whether init_distributed made the process group (then teardown destroys it)
_stuck_after: float | None = None  # the collective timeout in force, seconds


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


def stuck_after_default() -> float:
    """Seconds a collective (or a data-loader batch) may take before the run is stopped as stuck:
    $SATURATE_STUCK_AFTER, else 600 (NCCL's own default; long enough for a large checkpoint or compile)."""
    text = os.environ.get("SATURATE_STUCK_AFTER", "600")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"SATURATE_STUCK_AFTER must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ConfigError(f"SATURATE_STUCK_AFTER must be > 0, got {text}")
    return value


def init_distributed(device_type: str, *, one_process_group: bool = False,
                     stuck_after: float | None = None) -> DistInfo:
    """Join torchrun's process group (idempotent) and bind this rank to its GPU.

    `device_type` is "cuda" (ROCm too), "cpu" or "mps". With WORLD_SIZE 1 nothing happens, unless
    `one_process_group` asks for a group of one (FSDP in a single process, for its CPU offload and
    mixed-precision policy). Collectives time out after `stuck_after` seconds (default
    `stuck_after_default()`), and each rank leaves a heartbeat in the rendezvous store so that the
    ranks that time out can name the one that did not answer (`unresponsive_ranks`).
    Returns the ranks as the group sees them.
    """
    global _created_here, _stuck_after
    info = dist_info()
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), info.local_rank, dist.get_world_size())
    _stuck_after = stuck_after  # also in one process: the data loader's timeout
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
    timeout = datetime.timedelta(seconds=stuck_after_s())
    if info.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)  # env:// rendezvous set up by torchrun
        if dist.get_world_size() > 1:
            _Heartbeat.start(dist.get_rank(), stuck_after_s())
    _created_here = True
    return DistInfo(dist.get_rank(), info.local_rank, dist.get_world_size())


class _Heartbeat:
    """A daemon thread writing `saturate/alive/<rank>` = the time, every few seconds, to the rendezvous store
    (its own connection): a rank that is stopped (SIGSTOP), frozen or dead stops writing, which is how the
    ranks whose collective timed out tell which rank did not answer."""

    PREFIX = "saturate/alive/"
    store: Any = None
    interval = 5.0

    @classmethod
    def start(cls, rank: int, stuck_after: float) -> None:
        if cls.store is not None or "MASTER_ADDR" not in os.environ:
            return
        cls.interval = max(0.5, min(5.0, stuck_after / 4))
        try:
            cls.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=datetime.timedelta(seconds=max(5.0, cls.interval)))
        except (RuntimeError, KeyError, ValueError):
            return  # no heartbeat: a timeout is still reported, without naming the rank

        def beat() -> None:
            while True:
                try:
                    cls.store.set(f"{cls.PREFIX}{rank}", f"{time.time():.3f}")
                except Exception:  # the store went away (the job is ending)
                    return
                time.sleep(cls.interval)

        threading.Thread(target=beat, name="saturate-heartbeat", daemon=True).start()


def unresponsive_ranks(world_size: int) -> list[tuple[int, float | None]]:
    """The ranks whose heartbeat is stale (older than three beats), with its age in seconds (None: never seen)."""
    store = _Heartbeat.store
    if store is None:
        return []
    stale = []
    now = time.time()
    for rank in range(world_size):
        try:
            age: float | None = now - float(store.get(f"{_Heartbeat.PREFIX}{rank}").decode())
        except Exception:
            age = None
        if age is None or age > 3 * _Heartbeat.interval:
            stale.append((rank, age))
    return stale


def stuck_after_s() -> float:
    """The timeout in force for collectives and data-loader batches (seconds)."""
    return _stuck_after if _stuck_after is not None else stuck_after_default()


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
