import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, IterableDataset

SHARD = os.environ.get("SHARD") == "1"

class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        info = None
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            time.sleep(0.004)
            g = torch.Generator().manual_seed(i)
            yield i, torch.randn(16, generator=g), torch.randn(1, generator=g)

steps = int(sys.argv[1])
ids_file = sys.argv[2] if len(sys.argv) > 2 else None
loader = DataLoader(Stream(16 * steps), batch_size=16, num_workers=0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = []
for i, x, y in loader:
    seen.extend(i.tolist())
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
if ids_file:
    with open(ids_file, "w") as f:
        f.write(" ".join(map(str, seen)))
print("trained", len(seen), "samples")
