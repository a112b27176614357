import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def init(_):
    time.sleep(0.5)  # each worker opens its files
data = TensorDataset(torch.randn(320, 16), torch.randn(320, 1))
loader = DataLoader(data, batch_size=8, num_workers=2, worker_init_fn=init)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _epoch in range(20):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.002)
