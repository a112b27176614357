import sys, time, torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 10**7
    def __getitem__(self, i):
        time.sleep(0.002); return torch.randn(16), torch.randn(1)
steps = int(sys.argv[1])
loader = DataLoader(Slow(), batch_size=8, num_workers=2)
model = nn.Linear(16, 1); opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.mse_loss(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
    if step + 1 == steps: break
print(f"trained {steps} steps")
