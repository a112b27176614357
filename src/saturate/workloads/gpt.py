"""The GPT presets (gpt-tiny, gpt-small, gpt-medium): a GPT in the nanoGPT mould (pre-norm blocks,
PyTorch SDPA attention, tied embeddings) trained on a text corpus.

FLOPs per token (forward + backward), the PaLM/nanoGPT estimate:

    6·N + 12·L·H·Q·T

N counts every parameter except the position embedding (the tied token embedding is counted
once, as the language-model head's matmul), L is layers, H heads, Q head size, T the sequence
length; the second term is the attention score and value matmuls. Activation checkpointing
recomputes the forward but these are *model* FLOPs, so MFU does not reward recomputation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from saturate.errors import ConfigError, unknown_name
from saturate.workloads.base import Optimization, Workload
from saturate.workloads.chunked_loss import chunk_rows, linear_cross_entropy


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
        self.loss_chunk: int | None = None  # plan.loss_chunk: the loss over this many rows of logits at a time
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

    def set_loss_chunk(self, chunk: int | None) -> None:
        """With targets, the loss over `chunk` rows of logits at a time: the logits never exist whole."""
        self.loss_chunk = chunk

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, padded_vocab); with targets (B, T), the mean next-token cross-entropy
        instead (chunked when `loss_chunk` is set, workloads/chunked_loss.py).

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
        if targets is None:
            return self.lm_head(self.ln_f(x))
        if self.loss_chunk is not None:
            return linear_cross_entropy(self.ln_f(x), self.lm_head.weight, targets, self.loss_chunk)
        logits = self.lm_head(self.ln_f(x))
        # Autocast runs cross_entropy in fp32 by itself; no explicit upcast copy of the logits.
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

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


MODEL_FILE = "model.json"  # beside model.safetensors: what `saturate.load_model` rebuilds the GPT from


def export_config(cfg: GPTConfig, preset: str, tokenizer: str) -> Callable[[nn.Module, Path], list[Path]]:
    """A Workload.export_extras writing the model's config as model.json beside the exported weights."""
    def write(model: nn.Module, out_dir: Path) -> list[Path]:
        from saturate.atomic import atomic_write_bytes

        path = out_dir / MODEL_FILE
        record = {"kind": "saturate-gpt", "preset": preset, "tokenizer": tokenizer, "config": cfg.to_dict()}
        atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
        return [path]

    return write


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch; batch is (inputs, targets), each (B, T)."""
    x, y = batch
    return model(x, targets=y)


# --- the presets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTPreset:
    """A GPT preset: the model's shape and the optimisation it trains with by default."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    optim: Optimization
    description: str


PRESETS: dict[str, GPTPreset] = {
    "gpt-tiny": GPTPreset(
        "gpt-tiny", n_layer=4, n_head=4, n_embd=256, seq_len=128,
        optim=Optimization(effective_batch=32, lr=2e-3, warmup_steps=20, steps=300, eval_every=50),
        description="~3M parameters; the embedded default, trains on a CPU in minutes",
    ),
    "gpt-small": GPTPreset(
        "gpt-small", n_layer=12, n_head=12, n_embd=768, seq_len=1024,
        optim=Optimization(effective_batch=128, lr=6e-4, warmup_steps=100, steps=2000, eval_every=200),
        description="GPT-2 124M shape (85M parameters with the byte tokenizer, 124M with a 50257 BPE)",
    ),
    "gpt-medium": GPTPreset(
        "gpt-medium", n_layer=24, n_head=16, n_embd=1024, seq_len=1024,
        optim=Optimization(effective_batch=128, lr=3e-4, warmup_steps=100, steps=2000, eval_every=200),
        description="GPT-2 350M shape (303M parameters with the byte tokenizer)",
    ),
}


def preset_with(preset: str, overrides: dict[str, Any]) -> tuple[GPTPreset, Optimization]:
    """A GPT preset with shape overrides applied, and its Optimization with the other overrides."""
    try:
        p = PRESETS[preset]
    except KeyError:
        raise ConfigError(unknown_name("GPT preset", preset, PRESETS)) from None
    shape_keys = ("n_layer", "n_head", "n_embd", "seq_len")
    shape = {k: v for k, v in overrides.items() if k in shape_keys}
    rest = {k: v for k, v in overrides.items() if k not in shape_keys}
    known = [*shape_keys, *(f.name for f in dataclasses.fields(Optimization))]
    for k in rest:
        if k not in known:
            raise ConfigError(f"preset {preset}: " + unknown_name("parameter", k, known))
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"preset {preset}: {k} must be a positive integer, got {v!r}")
    return dataclasses.replace(p, **shape), p.optim.with_values(rest, f"preset {preset}")


def gpt_workload(
    preset: str = "gpt-tiny",
    *,
    data: Sequence[str] | None = None,
    tokenizer: str = "byte",
    text_field: str = "text",
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """A GPT preset's Workload on the embedded corpus (data=None) or on the user's files.

    `overrides` replace fields of the preset's Optimization (e.g. steps=50, effective_batch=64) or of
    its model shape (n_layer, n_head, n_embd, seq_len).
    """
    from saturate.data.loaders import FixedWindows, RandomWindows
    from saturate.data.token_cache import prepare_corpus

    p, optim = preset_with(preset, overrides)
    corpus = prepare_corpus(data, tokenizer=tokenizer, seq_len=p.seq_len, text_field=text_field)
    cfg = GPTConfig(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, seq_len=p.seq_len,
                    vocab_size=corpus.vocab_size)
    info = {"preset": preset, "corpus_files": corpus.n_files, "corpus_tokens": corpus.n_tokens,
            "tokenizer": corpus.tokenizer.name, "vocab_size": corpus.vocab_size,
            "corpus_cached": corpus.cached}
    if corpus.skipped:  # not text (binary, a FIFO…): left out, and said so in the run's info
        info["skipped_files"] = "; ".join(corpus.skipped)
    return Workload(
        name=preset,
        build_model=lambda: GPT(cfg),
        train_data=RandomWindows(corpus.train, cfg.seq_len, seed=seed),
        val_data=FixedWindows(corpus.val, cfg.seq_len, n=optim.eval_samples),
        loss_fn=lm_loss,
        optim=optim,
        tokens_per_sample=cfg.seq_len,
        flops_per_sample=flops_per_token(cfg) * cfg.seq_len,
        loss_chunk_rows=chunk_rows(cfg.padded_vocab),
        sdpa=True,
        identity={"model": cfg.to_dict(), "data": {"corpus": corpus.fingerprint, "seed": seed}},
        info=info,
        export_extras=export_config(cfg, preset, corpus.tokenizer.name),
    )
