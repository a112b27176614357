"""The batch-scaling probe for a user's own loop: its model's forward+backward at the micro-batch it ran and at
twice that, on the inputs it last saw, so the doctor can say whether a micro-step's fixed cost dominates
(overhead-bound) for a script as it does for a preset (`diagnose.scaling_probe`).

    probe = probe_from_inputs(model, args, kwargs, micro_batch=8, device=dev, autocast=None)

The doubled batch is every input whose first dimension is the micro-batch, concatenated with itself; what is
back-propagated is the output's `loss` when it has one (a Transformers model given labels), else the sum of the
means of its floating tensors that require grad — the same graph back to the parameters, so the same backward
work as the script's own loss to within its last few ops. Run only where its side effects cannot matter: the
doctor's run of a script, which is stopped right after (the model's gradients are restored; extra forwards still
move BatchNorm's running statistics and the random generators).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from saturate.doctor.findings import ScalingProbe
from saturate.hardware import synchronize
from saturate.policy import POLICY

# A timing's rounds, least length and most repeats: POLICY.doctor.probe_rounds, probe_min_timing_s and
# probe_max_repeats. A call shorter than the least length is repeated within the timing (as `timeit`'s autorange
# does) and its mean taken.


def seconds_per_call(call: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Mean seconds of `call()` over `repeats` calls back to back, the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return (time.perf_counter() - t0) / repeats


def time_two_sizes(step: Callable[[int], None], sizes: tuple[int, int], device: torch.device, rounds: int,
                   min_s: float = POLICY.doctor.probe_min_timing_s
                   ) -> tuple[dict[int, list[float]], dict[int, int | None]]:
    """Seconds per call of `step(b)` (forward+backward, gradients cleared) for both sizes, interleaved in `rounds`
    rounds after one that warms up each shape (a compiled model compiles it there) and reads the peak device
    memory; each timing repeats the call until it lasts `min_s` (the repeat count set from the small size's
    second call, the same for both sizes). Raises what `step` raises (torch.OutOfMemoryError)."""
    times: dict[int, list[float]] = {b: [] for b in sizes}
    memory: dict[int, int | None] = {}

    def timed(b: int, repeats: int) -> float:
        return seconds_per_call(lambda: step(b), repeats, device)

    for b in sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timed(b, 1)
        memory[b] = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    once = timed(sizes[0], 1)
    most = POLICY.doctor.probe_max_repeats
    repeats = max(1, min(most, math.ceil(min_s / once))) if once > 0 else most
    for _ in range(rounds):
        for b in sizes:
            times[b].append(timed(b, repeats))
    return times, memory


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block, then set back (the probe again on a busy CPU: busy.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def again_on_one_thread(device: torch.device, busy: bool) -> bool:
    """Whether to take the probe again on one thread: a CPU run on several intra-op threads, the machine busy while
    it was measured. A neighbour that preempts one of several threads stalls every parallel region whatever the
    micro-batch, which reads as a fixed part; a lone thread it only slows, both sizes alike."""
    return busy and device.type == "cpu" and torch.get_num_threads() > 1


def time_thread_counts(step: Callable[[int], None], size: int, threads: int, device: torch.device,
                       rounds: int = POLICY.doctor.probe_rounds,
                       min_s: float = POLICY.doctor.probe_min_timing_s) -> tuple[float, ...]:
    """Per round, seconds of `step(size)` on `threads` intra-op threads ÷ on one, the two timed back to back (so a
    neighbour's load is about the same on both), after one call of each; each timing repeated to last `min_s`.
    Leaves torch on the threads it found."""
    before = torch.get_num_threads()

    def timed(n: int, repeats: int) -> float:
        torch.set_num_threads(n)
        return seconds_per_call(lambda: step(size), repeats, device)

    try:
        timed(threads, 1)
        once = timed(1, 1)
        most = POLICY.doctor.probe_max_repeats
        repeats = max(1, min(most, math.ceil(min_s / once))) if once > 0 else most
        ratios = []
        for _ in range(rounds):
            many, alone = timed(threads, repeats), timed(1, repeats)
            if alone > 0:
                ratios.append(many / alone)
        return tuple(ratios)
    finally:
        torch.set_num_threads(before)


def probe_of(sizes: tuple[int, int], times: dict[int, list[float]],
             memory: dict[int, int | None]) -> ScalingProbe:
    """The probe from `time_two_sizes`' timings: the small size at its fastest, the large one at that times the
    median of the rounds' large ÷ small ratios (a burst of load spanning a round moves both of its timings alike;
    the fastest of each alone could come from different moments), and the ratios themselves."""
    small, large = sizes
    ratios = tuple(t2 / t1 for t1, t2 in zip(times[small], times[large], strict=True) if t1 > 0)
    fastest = min(times[small])
    seconds = (fastest, fastest * statistics.median(ratios) if ratios else min(times[large]))
    spread = [(max(times[b]) - min(times[b])) / min(times[b]) if min(times[b]) > 0 else 0.0 for b in sizes]
    return ScalingProbe((small, large), seconds, (memory[small], memory[large]), (spread[0], spread[1]), ratios)


def _surrogate_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum()
    if isinstance(output, dict):
        output = list(output.values())
    leaves = [t for t in tree_flatten(output)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return sum((t.float().mean() for t in leaves), torch.zeros((), device=leaves[0].device)) if leaves else None


class _NoLoss(Exception):
    """The model's output has nothing to back-propagate."""


def probe_from_inputs(model: nn.Module, args: tuple, kwargs: dict, micro_batch: int, device: torch.device,
                      autocast: torch.dtype | None, rounds: int = POLICY.doctor.probe_rounds,
                      also: Callable[[Callable[[int], None]], None] | None = None
                      ) -> tuple[ScalingProbe | None, str | None]:
    """(the probe, None) or (None, why not, in one line). `also`, when given, is called with the replayed step
    (`step(b)` at the micro-batch or twice it) after the probe, before the gradients are restored."""
    doubled = [False]

    def double(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == micro_batch:
            doubled[0] = True
            return torch.cat([t, t])
        return t

    large = tree_map(double, (args, kwargs))
    if not doubled[0]:
        return None, (f"batch-scaling probe skipped: no input of the model has the micro-batch ({micro_batch}) "
                      "as its first dimension")
    inputs = {micro_batch: (args, kwargs), 2 * micro_batch: large}
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]

    def step(b: int) -> None:
        a, k = inputs[b]
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = _surrogate_loss(model(*a, **k))
        if loss is None:
            raise _NoLoss
        loss.backward()
        for p in params:
            p.grad = None

    try:
        times, memory = time_two_sizes(step, (micro_batch, 2 * micro_batch), device, rounds)
        if also is not None:
            also(step)
    except _NoLoss:
        return None, "batch-scaling probe skipped: the model's output holds no tensor that requires grad"
    except torch.OutOfMemoryError:
        return None, f"batch-scaling probe: micro-batch {2 * micro_batch} does not fit in device memory"
    except Exception as e:  # a model whose forward the captured inputs cannot be replayed through
        return None, f"batch-scaling probe skipped: replaying the model's forward failed ({type(e).__name__}: {e})"
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return probe_of((micro_batch, 2 * micro_batch), times, memory), None
