"""A recurrent model (GRU) as your own workload: does a noisy sequence drift up or down?

    saturate train --workload examples/rnn.py:workload --steps 50
"""

import torch
import torch.nn as nn

import saturate


class Drifts(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 48, seed: int = 0) -> None:
        self.n, self.length, self.seed = n, length, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        up = int(torch.randint(2, (1,), generator=g))
        steps = torch.randn(self.length, 1, generator=g) + (0.3 if up else -0.3)
        return steps.cumsum(0) / self.length**0.5, up


class GRUClassifier(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 1) -> (B, 2)
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def workload(hidden: int = 32, steps: int = 200) -> saturate.Workload:
    return saturate.custom_workload(
        "gru-drift", model=lambda: GRUClassifier(hidden), dataset=Drifts(8192), val_dataset=Drifts(256, seed=1),
        loss=nn.CrossEntropyLoss(), effective_batch=64, lr=3e-3, steps=steps, eval_every=50,
    )
