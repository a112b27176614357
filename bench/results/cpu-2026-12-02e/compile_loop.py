import dataclasses

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


@dataclasses.dataclass
class Config:
    batch_size: int = 32
    max_steps: int = 20000

torch.manual_seed(0)
cfg = Config()
loader = DataLoader(TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1)), batch_size=cfg.batch_size,
                    shuffle=True)
blocks = [m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))]
model = nn.Sequential(*blocks, nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = 0
while step < cfg.max_steps:
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == cfg.max_steps:
            break
