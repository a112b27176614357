"""A DataLoader's fingerprint, taken by the child's real loader hooks, and what comparing two runs' finds."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from saturate.data.fingerprint import Same, compare, dataset_record, replayed, sample_rows
from saturate.script.child import found, loader_hooks
from saturate.script.child.patches import Patches
from saturate.script.overrides import Overrides


class Table(Dataset):
    """Sample i is a function of i alone; `noisy`: plus a random draw (an augmentation)."""

    def __init__(self, n: int = 64, noisy: bool = False) -> None:
        self.n, self.noisy = n, noisy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.full((4,), float(i))
        return (x + torch.randn(4) if self.noisy else x), torch.tensor([i % 3])


class Unsharded(IterableDataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.full((4,), float(i))


class Sharded(IterableDataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield torch.full((4,), float(i))


def prints(make, epochs: bool = False, seed: int = 0, passes: int = 1, whole: bool = False) -> dict:
    """The fingerprint of the loader `make()` builds, through the child's real DataLoader hooks (a full run's
    path: no Profiler): its first batches, or (`epochs`) all of them, `passes` times; `whole`: all the hooks
    recorded of the loader, not only its fingerprint."""
    script = types.SimpleNamespace(overrides=Overrides(), loaders={}, patches=Patches(), profile=False,
                                   profiler=None, samples=0, done=False, optimizer_steps=0, batch_rows=None)
    loader_hooks.install(script)
    try:
        torch.manual_seed(seed)
        loader = make()
        for _ in range(passes):
            for i, _ in enumerate(loader):
                if not epochs and i == 9:
                    break
        record = found.live_loaders(script.loaders)[0]
        return record if whole else record["fingerprint"]
    finally:
        script.patches.detach()


def test_the_same_map_style_data_through_workers_is_the_same_batches():
    written = prints(lambda: DataLoader(Table(), batch_size=4, shuffle=True))
    workers = prints(lambda: DataLoader(Table(), batch_size=4, shuffle=True, num_workers=2))
    assert written["indices"][:8] != list(range(8)) and len(written["digests"]) == 8  # shuffled, 8 batches kept
    assert compare(written, workers).same is Same.SAME
    other = prints(lambda: DataLoader(Table(), batch_size=4, shuffle=True), seed=1)  # another shuffle
    check = compare(written, other)
    assert check.same is Same.OTHER_SAMPLES and check.changed and "from sample 0" in check.detail


def test_random_augmentation_in_workers_is_the_same_samples_with_other_draws():
    written = prints(lambda: DataLoader(Table(noisy=True), batch_size=4, shuffle=True))
    workers = prints(lambda: DataLoader(Table(noisy=True), batch_size=4, shuffle=True, num_workers=2))
    check = compare(written, workers)
    assert check.same is Same.SAME_SAMPLES and not check.changed


def test_a_stream_each_worker_replays_is_caught_with_the_edit_that_shards_it():
    written = prints(lambda: DataLoader(Unsharded(), batch_size=4))
    workers = prints(lambda: DataLoader(Unsharded(), batch_size=4, num_workers=2))
    assert written["indices"] is None and written["dataset"]["stream"] and written["dataset"]["shards"] is False
    check = compare(written, workers)
    assert check.same is Same.REPEATED and check.changed and check.times == 2
    assert "Unsharded.__iter__" in check.edit and "get_worker_info()" in check.edit
    assert check.edit.startswith("tests/data/test_fingerprint.py:") or "test_fingerprint.py:" in check.edit
    assert replayed(workers) == 2 and replayed(written) is None
    whole = [prints(lambda w=w: DataLoader(Unsharded(), batch_size=4, num_workers=w), epochs=True) for w in (0, 2)]
    assert whole[0]["epoch"] == [16, 64] and whole[1]["epoch"] == [32, 128]
    assert compare(*whole).same is Same.OTHER_EPOCH and compare(*whole, seeded=False).same is Same.OTHER_EPOCH


def test_a_stream_that_shards_itself_keeps_its_workers():
    written = prints(lambda: DataLoader(Sharded(), batch_size=4))
    workers = prints(lambda: DataLoader(Sharded(), batch_size=4, num_workers=2))
    assert written["dataset"]["shards"] is True
    check = compare(written, workers)
    assert check.same is Same.SHARDED_STREAM and not check.changed
    whole = [prints(lambda w=w: DataLoader(Sharded(), batch_size=4, num_workers=w), epochs=True) for w in (0, 2)]
    assert whole[0]["epoch"] == whole[1]["epoch"] == [16, 64]


def test_another_split_of_the_same_samples_compares_sample_by_sample():
    small = prints(lambda: DataLoader(Table(), batch_size=4))
    large = prints(lambda: DataLoader(Table(), batch_size=8))
    assert compare(small, large).same is Same.SAME
    per_step = compare(small, large, samples_per_step=(32.0, 16.0))
    assert per_step.same is Same.OTHER_STEP and per_step.changed


def test_nothing_seen_is_said_and_a_full_run_compares_only_what_no_seed_changes():
    written = prints(lambda: DataLoader(Table(), batch_size=4, shuffle=True))
    other = prints(lambda: DataLoader(Table(), batch_size=4, shuffle=True), seed=3)
    assert compare(written, None).same is Same.NOT_SEEN and not compare(None, written).changed
    assert compare(written, other, seeded=False).same is Same.ALIKE


def test_samples_of_any_kind_get_a_digest_each():
    batch = {"ids": torch.arange(6).reshape(3, 2), "text": ["a", "b", "c"], "scale": torch.tensor(2.0)}
    rows = sample_rows(batch, rows=256, elements=256)
    assert len(rows) == 3 and len(set(rows)) == 3
    assert sample_rows(batch, rows=2, elements=256) == rows[:2]
    assert sample_rows([torch.zeros(2, 3, dtype=torch.bfloat16)], rows=8, elements=2)[0] == \
        sample_rows([torch.zeros(2, 3, dtype=torch.bfloat16)], rows=8, elements=2)[1]


@pytest.mark.parametrize("dataset, stream, shards", [(Table(), False, None), (Unsharded(), True, False),
                                                     (Sharded(), True, True)])
def test_a_dataset_is_read_as_a_stream_that_shards_or_not(dataset, stream, shards):
    record = dataset_record(dataset)
    assert (record["stream"], record["shards"]) == (stream, shards)
    lines = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith(f"class {type(dataset).__name__}("))
    assert record["class"] == type(dataset).__name__ and record["defined_at"].endswith(f"test_fingerprint.py:{line}")


def slow_start(_: int) -> None:
    import time

    time.sleep(0.2)  # a worker opening its files


def test_each_iterations_first_batch_wait_is_kept_with_the_epochs_length():
    record = prints(lambda: DataLoader(Table(16), batch_size=4, num_workers=2, worker_init_fn=slow_start),
                    epochs=True, passes=2, whole=True)
    assert record["epoch_batches"] == 4 and len(record["starts"]) == 2 and min(record["starts"]) >= 0.2
    assert "asked" not in record and record["fingerprint"]["epoch"] == [4, 16]
