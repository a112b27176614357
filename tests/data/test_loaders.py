"""Global sample indices: what a step reads depends on the step alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from saturate.data.loaders import FixedWindows, RandomWindows, StepSampler, make_loader
from saturate.plan import Plan


def step_indices(micro: int, accum: int, world: int, step: int) -> list[int]:
    """All indices the ranks of one optimizer step read, in order."""
    out: list[int] = []
    for rank in range(world):
        it = iter(StepSampler(micro, accum, start_step=step, rank=rank, world_size=world, stop_step=step + 1))
        out.extend(i for batch in it for i in batch)
    return sorted(out)


@pytest.mark.parametrize("micro,accum,world", [(8, 1, 1), (4, 2, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)])
def test_a_step_reads_the_same_global_batch_for_any_split(micro, accum, world):
    for step in (0, 1, 7):
        assert step_indices(micro, accum, world, step) == list(range(step * 8, step * 8 + 8))


def test_ranks_read_disjoint_slices():
    a = [i for b in StepSampler(2, 3, rank=0, world_size=2, stop_step=4) for i in b]
    b = [i for b in StepSampler(2, 3, rank=1, world_size=2, stop_step=4) for i in b]
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(4 * 12))


def test_resuming_the_sampler_continues_the_sequence():
    whole = list(StepSampler(4, 2, stop_step=6))
    assert list(StepSampler(4, 2, start_step=3, stop_step=6)) == whole[6:]
    assert len(StepSampler(4, 2, start_step=3, stop_step=6)) == 6


def test_random_windows_are_a_function_of_seed_and_index():
    tokens = np.arange(10_000, dtype=np.uint16)
    ds = RandomWindows(tokens, seq_len=16, seed=3)
    x, y = ds[12345]
    assert x.dtype == torch.int64 and x.shape == (16,)
    assert torch.equal(y[:-1], x[1:])  # targets are the inputs shifted by one
    assert torch.equal(ds[12345][0], RandomWindows(tokens, 16, seed=3)[12345][0])
    starts = {ds.start(i) for i in range(2000)}
    assert len(starts) > 1500  # spread over the stream, not a handful of offsets
    assert max(starts) <= len(tokens) - 17
    other = RandomWindows(tokens, seq_len=16, seed=4)
    assert sum(ds.start(i) == other.start(i) for i in range(200)) < 5


def test_fixed_windows_cover_the_split_evenly():
    tokens = np.arange(1000, dtype=np.uint16)
    ds = FixedWindows(tokens, seq_len=10, n=5)
    firsts = [int(ds[i][0][0]) for i in range(len(ds))]
    assert firsts[0] == 0 and firsts[-1] == 1000 - 11
    assert firsts == sorted(set(firsts))


def test_loader_with_workers_yields_what_the_sampler_says():
    tokens = np.arange(5000, dtype=np.uint16)
    ds = RandomWindows(tokens, seq_len=8, seed=0)
    plain = make_loader(ds, Plan(micro_batch=4, grad_accum=2), stop_step=3)
    workers = make_loader(ds, Plan(micro_batch=4, grad_accum=2, num_workers=2, prefetch_factor=2,
                                   persistent_workers=True), stop_step=3)
    assert workers.num_workers == 2 and workers.prefetch_factor == 2 and workers.persistent_workers
    for (xa, ya), (xb, yb) in zip(plain, workers, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_memmapped_windows_pickle_as_a_file_reference(tmp_path):
    import pickle

    from saturate.data.shards import open_shard, write_shard

    write_shard(tmp_path / "t.bin", np.arange(200_000, dtype=np.uint16) % 257,
                {"vocab_size": 257, "tokenizer": "byte", "source_hash": "x"})
    tokens = open_shard(tmp_path / "t.bin").tokens
    for ds in (RandomWindows(tokens, 32, seed=1), FixedWindows(tokens, 32, n=4)):
        blob = pickle.dumps(ds)
        assert len(blob) < 10_000  # not the 400 KB of tokens
        back = pickle.loads(blob)
        assert isinstance(back.tokens, np.memmap)
        assert torch.equal(back[3][0], ds[3][0])
