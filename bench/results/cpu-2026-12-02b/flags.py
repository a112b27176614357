import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--batch_size", type=int, default=4)
p.add_argument("--grad_accum", type=int, default=8)
p.add_argument("--steps", type=int, default=100000)
args = p.parse_args()
torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
it = iter(loader)
for _step in range(args.steps):
    for _ in range(args.grad_accum):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = nn.functional.mse_loss(model(x), y) / args.grad_accum
        loss.backward()
    opt.step()
    opt.zero_grad()
