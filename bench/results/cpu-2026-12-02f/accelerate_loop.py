import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--per_device_train_batch_size", type=int, default=1)
parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
parser.add_argument("--max_train_steps", type=int, default=3000)
args = parser.parse_args()
accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=True)
set_seed(0)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(data, batch_size=args.per_device_train_batch_size, shuffle=True)
model, opt, loader = accelerator.prepare(model, opt, loader)
step = 0
while step < args.max_train_steps:
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step >= args.max_train_steps:
                break
print("done", step)
