"""GPT pretraining written the way the A6000 guide's job was before tuning: micro-batch 12 ×
accumulation 10, `num_workers=0`, fp32, text encoded inside `__getitem__`. It never imports saturate:

    python train.py --mode pretrain --config small
    saturate doctor -- python train.py --mode pretrain --config small      # why is it slow?

Data: the text files under --data (default: some of the Python standard library's source).
"""

import argparse
import math
import os
import random
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from config import get_config
from torch.utils.data import DataLoader, Dataset


class TextWindows(Dataset):
    """Random windows of a text, encoded to bytes on every read (as many first scripts do)."""

    def __init__(self, text: str, block_size: int, length: int = 1_000_000) -> None:
        self.text, self.block_size, self.length = text, block_size, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        start = random.Random(i).randrange(len(self.text) - 4 * self.block_size)
        ids = list(self.text[start:start + 4 * self.block_size].encode("utf-8", "replace")[:self.block_size + 1])
        x = torch.tensor(ids[:-1], dtype=torch.long)
        y = torch.tensor(ids[1:], dtype=torch.long)
        return x, y


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def read_text(paths: list[str]) -> str:
    if not paths:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        paths = [str(p) for p in sorted(stdlib.glob("*.py"))[:40]]
    return "\n".join(Path(p).read_text(errors="replace") for p in paths)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="pretrain", choices=["pretrain"])
    parser.add_argument("--config", default="small")
    parser.add_argument("--data", nargs="*", default=[])
    parser.add_argument("--out-dir")
    parser.add_argument("--max-steps", type=int, help="override the config's max_steps")
    args = parser.parse_args()
    cfg = get_config(args.config)
    if args.max_steps:
        cfg.max_steps = args.max_steps
    out_dir = args.out_dir or cfg.out_dir
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    loader = DataLoader(TextWindows(read_text(args.data), cfg.block_size), batch_size=cfg.batch_size, shuffle=True,
                        num_workers=cfg.num_workers)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    batches = iter(loader)
    for step in range(cfg.max_steps):
        lr = cfg.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / cfg.max_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(cfg.grad_accum):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / cfg.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item() * cfg.grad_accum:.3f}")
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "model.pt"))
    print(f"saved {out_dir}/model.pt")


if __name__ == "__main__":
    main()
