"""A character-level language model of your own, with a step function and tokens per sample:

    saturate train --workload examples/lm.py:workload --steps 50
"""

import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import saturate

SEQ = 64


class Chars(torch.utils.data.Dataset):
    """Non-overlapping windows of SEQ + 1 bytes of a text file."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.data[i * SEQ : i * SEQ + SEQ + 1].long()
        return {"inputs": chunk[:-1], "targets": chunk[1:]}


class TinyLM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, dropout=0.0)
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, 256)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.layer(self.embed(x), src_mask=mask, is_causal=True))


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["inputs"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def workload(width: int = 64, steps: int = 200) -> saturate.Workload:
    text = Path(sysconfig.get_paths()["stdlib"], "difflib.py").read_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(0.9 * len(data))
    return saturate.custom_workload(
        "char-lm", model=lambda: TinyLM(width), dataset=Chars(data[:cut]), val_dataset=Chars(data[cut:]),
        step=step, tokens_per_sample=SEQ, effective_batch=32, lr=2e-3, steps=steps, eval_every=50,
    )
