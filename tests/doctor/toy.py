"""Small constructed workloads for the doctor's verdict cases (each runs in seconds on a CPU)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from saturate.workloads import Optimization, Workload


class Samples(Dataset):
    """Regression samples by index; `delay` seconds of sleep per sample stands for slow decoding or I/O."""

    def __init__(self, features: int = 16, delay: float = 0.0) -> None:
        self.features, self.delay = features, delay
        self.x = torch.randn(4096, features, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[i % 4096], self.y[i % 4096]


class Hungry(Samples):
    """Each process that reads a sample first builds its own `mib` MiB table (a per-worker cache,
    or Python objects duplicated by copy-on-access): workers multiply the host memory."""

    def __init__(self, mib: int, features: int = 16) -> None:
        super().__init__(features)
        self.mib = mib
        self._table: np.ndarray | None = None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is None:
            self._table = np.ones(self.mib * 2**20 // 8)  # written, so the pages are really held
        return super().__getitem__(i)


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def mlp_loss_read_every_step(model: nn.Module, batch) -> torch.Tensor:
    loss = mlp_loss(model, batch)
    mlp_loss_read_every_step.last = loss.item()  # the classic: the loss read to the host every step
    return loss


def mlp_workload(data: Dataset, effective_batch: int, hidden: int = 64, features: int = 16,
                 loss_fn=mlp_loss) -> Workload:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    return Workload(name="toy-mlp", build_model=build, train_data=data, val_data=None, loss_fn=loss_fn,
                    optim=Optimization(effective_batch=effective_batch, lr=1e-3, warmup_steps=0, steps=1000))


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads stall at every barrier
    whenever anything else runs (a loader worker, another test suite), which makes small models'
    timings swing tenfold. The doctor notes that contention itself (test_rules.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def neighbours_ignored(monkeypatch):
    """The verdict of the workload itself, on a test machine that other jobs share.

    On a busy machine the doctor's verdict is "contended" (the timings are partly the neighbours'),
    which test_rules.py checks on constructed measurements; tests that check what a workload's own
    timings lead to measure contention as usual but do not let it decide the verdict.
    """
    from saturate.hardware.contention import Contention

    monkeypatch.setattr(Contention, "significant", lambda self: False)
