"""A time-series model with a grid search, written the way the time-series guide's job was before
tuning: batch 128, 4 loader workers, no prefetch setting, fp32, the predictions moved to the host
every batch. It never imports saturate:

    python train.py --hidden 64 128 --window 30 60 90
    saturate doctor -- python train.py --hidden 64 128          # why is it slow? (the first grid point)

Data: a synthetic multi-series signal (or --csv FILE of numeric columns).
"""

import argparse
import csv
import math

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


def synthetic(length: int = 20000, n_series: int = 4, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(length)[:, None]
    periods = rng.uniform(20, 200, n_series)
    return (np.sin(2 * math.pi * t / periods) + 0.1 * rng.standard_normal((length, n_series))).astype(np.float32)


def read_csv(path: str) -> np.ndarray:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return np.array([[float(v) for v in row] for row in rows[1:]], dtype=np.float32)


class Windows(Dataset):
    def __init__(self, series: np.ndarray, window: int) -> None:
        self.series, self.window = series, window

    def __len__(self) -> int:
        return len(self.series) - self.window - 1

    def __getitem__(self, i: int):
        x = torch.from_numpy(self.series[i:i + self.window])
        y = torch.from_numpy(self.series[i + self.window])
        return x, y


class Forecaster(nn.Module):
    def __init__(self, n_series: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(n_series, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, n_series)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def train_one(series: np.ndarray, hidden: int, window: int, args: argparse.Namespace, device: str) -> float:
    loader = DataLoader(Windows(series, window), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.num_workers)
    model = Forecaster(series.shape[1], hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(args.epochs):
        predictions = []
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            predictions.append(out.detach().cpu().numpy())  # to the host every batch
        mse = float(np.mean([np.mean(p) for p in predictions]) ** 2)
        print(f"hidden {hidden} window {window} epoch {epoch}: loss {loss.item():.4f} ({mse:.3g})")
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--window", type=int, nargs="+", default=[30, 60, 90])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--length", type=int, default=20000)
    parser.add_argument("--csv")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    series = read_csv(args.csv) if args.csv else synthetic(args.length)
    results = {}
    for hidden in args.hidden:
        for window in args.window:
            results[(hidden, window)] = train_one(series, hidden, window, args, device)
    best = min(results, key=results.get)
    print(f"best: hidden {best[0]}, window {best[1]} (loss {results[best]:.4f})")


if __name__ == "__main__":
    main()
