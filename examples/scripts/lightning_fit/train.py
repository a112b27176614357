"""A small Lightning job written the way many are before tuning: a `LightningModule` and a `LightningDataModule`
whose `train_dataloader()` makes `DataLoader(..., batch_size=4)`, `Trainer(accumulate_grad_batches=8)` (an
effective batch of 32 as many small micro-batches), fp32, plain AdamW, no loader workers. It never imports
saturate:

    python train.py --max-steps 200
    saturate doctor -- python train.py      # why is it slow? fixes as Trainer(...) and DataLoader(...) arguments
    saturate tune -- python train.py        # precision, batch_size × accumulate_grad_batches, fused AdamW, measured
    saturate run -- python train.py         # as written vs tuned, then the whole run with the tuned settings

The task is a regression on synthetic features (a fixed random teacher network; no download). `--width`
sets the model's size (the tests use a small one).
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Teacher(Dataset):
    """`n` samples of `features` random inputs and a fixed random network's output as the target."""

    def __init__(self, n: int, features: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        teacher = nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, 1))
        with torch.no_grad():
            self.y = teacher(self.x)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int, features: int) -> None:
        super().__init__()
        self.batch_size, self.features = batch_size, features

    def setup(self, stage: str) -> None:
        self.train = Teacher(20_000, self.features)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, num_workers=0)


class Regressor(pl.LightningModule):
    def __init__(self, features: int, width: int, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=8)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regressor(args.features, args.width), datamodule=Data(args.batch_size, args.features))
    print(f"trained {trainer.global_step} steps")


if __name__ == "__main__":
    main()
