"""Training samples by global index, and the loader that feeds them in plan order.

Every sample has a global index: optimizer step s uses indices [s·E, (s+1)·E) for an effective
batch E, whatever the micro-batch, accumulation or process count. So the data a step sees is a
function of the step alone: resume only needs the step number, a 4×2 split sees the same samples
as 8×1, and ranks read disjoint slices of the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from saturate.plan import Plan

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A counter-based hash (SplitMix64): the same index gives the same number, in any order."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


class MappedTokens:
    """Pickles a memory-mapped token array as its file and offset, not its contents.

    DataLoader workers started with spawn (macOS, Windows) unpickle the dataset; without this each
    worker would receive a full copy of the corpus instead of mapping the same file.
    """

    tokens: np.ndarray

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        t = self.tokens
        if isinstance(t, np.memmap) and t.filename is not None:
            state["tokens"] = ("memmap", t.filename, t.offset, t.dtype.str, t.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "memmap":
            _, filename, offset, dtype, shape = t
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
        self.__dict__.update(state)


class RandomWindows(MappedTokens, Dataset):
    """Sample i is a window of seq_len+1 tokens at a pseudo-random offset fixed by (seed, i).

    Returns (inputs, targets), each (seq_len,) int64, targets shifted by one token.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot hold a window of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_starts = len(tokens) - seq_len  # valid start offsets
        self.distinct_samples = max(1, len(tokens) // seq_len)  # windows that do not overlap
        self._seed_key = _splitmix64(np.array([seed], dtype=np.uint64))  # hashed once, mixed into every index

    def __len__(self) -> int:
        return 2**62  # indices are unbounded: windows are drawn, not enumerated

    def start(self, index: int) -> int:
        key = np.array([index], dtype=np.uint64) ^ self._seed_key
        return int(_splitmix64(key)[0] % np.uint64(self.n_starts))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.start(index)
        window = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class FixedWindows(MappedTokens, Dataset):
    """Evaluation windows: n evenly spaced, non-overlapping where the split allows, always the same."""

    def __init__(self, tokens: np.ndarray, seq_len: int, n: int) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot hold a window of {seq_len + 1}")
        last = len(tokens) - seq_len - 1
        self.starts = np.linspace(0, last, num=max(1, n)).astype(np.int64)
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[index])
        window = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class StepSampler(Sampler[list[int]]):
    """Yields one micro-batch of global sample indices at a time, from `start_step` on.

    Global batch of step s: [s·E, (s+1)·E), E = micro·accum·world. Micro-step k of rank r takes
    the slice starting at s·E + (k·world + r)·micro.
    """

    def __init__(
        self, micro_batch: int, grad_accum: int, start_step: int = 0, rank: int = 0, world_size: int = 1,
        stop_step: int | None = None,
    ) -> None:
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.start_step = start_step
        self.stop_step = stop_step
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[list[int]]:
        b, w = self.micro_batch, self.world_size
        step_size = b * self.grad_accum * w
        step = self.start_step
        while self.stop_step is None or step < self.stop_step:
            base = step * step_size
            for k in range(self.grad_accum):
                first = base + (k * w + self.rank) * b
                yield list(range(first, first + b))
            step += 1

    def __len__(self) -> int:
        if self.stop_step is None:
            raise TypeError("an open-ended StepSampler has no length")
        return (self.stop_step - self.start_step) * self.grad_accum


def make_loader(
    dataset: Dataset, plan: Plan, *, start_step: int = 0, stop_step: int | None = None,
    rank: int = 0, world_size: int = 1, pin_memory: bool | None = None, timeout: float = 0,
) -> DataLoader:
    """A DataLoader that honours the plan's workers, prefetch, pinning and persistence.

    With workers, `timeout` > 0 seconds bounds the wait for a batch: a worker that hangs (stopped, stuck in
    a read) raises "DataLoader timed out" instead of stalling the run forever."""
    sampler = StepSampler(plan.micro_batch, plan.grad_accum, start_step, rank, world_size, stop_step)
    workers = plan.num_workers
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        prefetch_factor=plan.prefetch_factor if workers > 0 else None,
        pin_memory=plan.pin_memory if pin_memory is None else pin_memory,
        persistent_workers=plan.persistent_workers if workers > 0 else False,
        timeout=timeout if workers > 0 else 0,
    )


def eval_loader(dataset: Dataset, plan: Plan, pin_memory: bool, timeout: float = 0) -> DataLoader:
    """Evaluation batches at the plan's micro-batch; workers only when they persist (else startup dominates)."""
    workers = plan.num_workers if plan.persistent_workers else 0
    return DataLoader(
        dataset, batch_size=plan.micro_batch, shuffle=False, num_workers=workers,
        prefetch_factor=plan.prefetch_factor if workers > 0 else None,
        pin_memory=pin_memory, persistent_workers=workers > 0, timeout=timeout if workers > 0 else 0,
    )
