"""A GPT in the nanoGPT mould: pre-norm blocks, PyTorch SDPA attention, tied embeddings.

FLOPs per token (forward + backward), the PaLM/nanoGPT estimate:

    6·N + 12·L·H·Q·T

N counts every parameter except the position embedding (the tied token embedding is counted
once, as the language-model head's matmul), L is layers, H heads, Q head size, T the sequence
length; the second term is the attention score and value matmuls. Activation checkpointing
recomputes the forward but these are *model* FLOPs, so MFU does not reward recomputation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from saturate.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    seq_len: int = 256  # the context length (block size)
    vocab_size: int = 257  # the tokenizer's; the embedding is padded up to a multiple of 64
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2 had them; slightly slower)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab(self) -> int:
        # A multiple of 64 keeps the embedding/head matmuls on fast tensor-core tile sizes.
        return math.ceil(self.vocab_size / 64) * 64

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, Q)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(  # mask: (B, 1, T, T) for packed sequences, else plain causal
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, counted once
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2L) so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in backward instead of keeping its activations."""
        self.activation_checkpointing = enabled

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, padded_vocab).

        position_ids (B, T), optional: packed sequences, each restarting at 0; attention then stays
        inside each sequence (a block-diagonal causal mask), so a packed row equals its parts alone.
        """
        _, T = idx.shape
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        mask = None
        if position_ids is None:
            pos = torch.arange(T, device=idx.device)
        else:
            pos = position_ids
            seq = (position_ids == 0).cumsum(-1)  # (B, T): which packed sequence each token belongs to
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted for FLOPs: all but the position embedding (tied weights once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


def flops_per_token(cfg: GPTConfig) -> float:
    """Model FLOPs per trained token, 6N + 12·L·H·Q·T (see the module docstring)."""
    C, L = cfg.n_embd, cfg.n_layer
    V = cfg.padded_vocab
    # N without building the model: token embedding/head V·C, per block 12·C² (+ LayerNorm
    # weights 2·C), final LayerNorm C. Biases add a little more when enabled.
    per_block = 12 * C * C + 2 * C
    if cfg.bias:
        per_block += 3 * C + C + 4 * C + C + 2 * C  # qkv, proj, fc, proj, the two LayerNorms
    n = V * C + L * per_block + C + (C if cfg.bias else 0)
    return 6.0 * n + 12.0 * L * C * cfg.seq_len  # H·Q = C


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch; batch is (inputs, targets), each (B, T)."""
    x, y = batch
    logits = model(x)
    # Autocast runs cross_entropy in fp32 by itself; no explicit upcast copy of the logits.
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
