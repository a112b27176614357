"""A small CNN on synthetic images, as your own workload:

    saturate train --workload examples/cnn.py:workload --steps 50
    saturate tune  --workload examples/cnn.py:workload --param width=32
"""

import torch
import torch.nn as nn

import saturate


class Blobs(torch.utils.data.Dataset):
    """Image i: noise plus a bright square whose position is its class; a function of i alone."""

    def __init__(self, n: int, classes: int = 10, size: int = 32, seed: int = 0) -> None:
        self.n, self.classes, self.size, self.seed = n, classes, size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(self.classes, (1,), generator=g))
        x = 0.5 * torch.randn(3, self.size, self.size, generator=g)
        r, c = divmod(label, 4)
        x[:, 8 * r : 8 * r + 6, 8 * c : 8 * c + 6] += 1.0
        return x, label


def cnn(width: int) -> nn.Module:
    # The class is where the square is, so the head keeps a coarse 4 × 4 map: a global average pool
    # would discard the position and the model could not learn (the loss stays at ln 10 ≈ 2.30).
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(2 * width * 16, 10),
    )


def workload(width: int = 16, n: int = 4096, steps: int = 200) -> saturate.Workload:
    return saturate.custom_workload(
        "cnn-blobs",
        model=lambda: cnn(width),          # a fresh model per call
        dataset=Blobs(n),                  # map-style; read in epochs, reshuffled by seed
        val_dataset=Blobs(256, seed=1),
        loss=nn.CrossEntropyLoss(),        # applied as loss(model(x), y) to batches (x, y)
        effective_batch=64, lr=3e-3, steps=steps, eval_every=50,
    )
