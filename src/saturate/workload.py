"""Workload: what to train — model, data, loss, and the optimisation the user asked for.

A Workload is plain data plus three callables, so a preset and a user's own model go through
the same engine. Presets live in one registry; a variant copies an entry and changes fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn
from torch.utils.data import Dataset

from saturate.errors import ConfigError


@dataclass
class Optimization:
    """The optimisation the user wants. Plans never change it, except the scaled learning rate."""

    effective_batch: int  # samples per optimizer step the learning rate was chosen for
    lr: float  # peak learning rate at `effective_batch`
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr × this
    weight_decay: float = 0.1  # on matrices only, not on norms, biases or embeddings' positions
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0  # max global gradient norm; None disables clipping
    steps: int = 1000  # optimizer steps of a default run
    eval_every: int = 100  # optimizer steps between validations
    eval_samples: int = 64  # fixed validation samples, the same for every plan

    def __post_init__(self) -> None:
        if self.effective_batch < 1:
            raise ConfigError(f"effective_batch must be >= 1, got {self.effective_batch}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.steps < 1:
            raise ConfigError(f"warmup_steps must be >= 0 and steps >= 1, got {self.warmup_steps}, {self.steps}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip must be > 0 or None, got {self.grad_clip}")


@dataclass
class Workload:
    name: str
    build_model: Callable[[], nn.Module]  # a fresh model on the CPU, in fp32
    train_data: Dataset  # map-style; sample i for any global index i >= 0 (see data/windows.py)
    val_data: Dataset | None  # finite, fixed evaluation samples
    loss_fn: Callable[[nn.Module, Any], Any]  # (model, batch on device) -> mean loss over the batch
    optim: Optimization
    tokens_per_sample: int = 1  # for tokens/s; 1 for data that is not tokens
    flops_per_sample: float | None = None  # model FLOPs (fwd+bwd) per sample, for MFU
    identity: dict[str, Any] = field(default_factory=dict)  # what resume must match: model config, data
    info: dict[str, Any] = field(default_factory=dict)  # shown to the user (parameters, corpus size…)
    # Extra metrics at the end of a run: (eval model, device, batch size) -> {"val/…": value}; None for none.
    evaluate: Callable[[nn.Module, Any, int], dict[str, float]] | None = None
    guide_plans: tuple[str, ...] = ()  # reference plans of the guide this job comes from, for before/after
    # Files written beside the exported model.safetensors so it opens in its own library (a Transformers
    # config.json and tokenizer): (trained model, folder) -> the paths written; None for none.
    export_extras: Callable[[nn.Module, Path], list[Path]] | None = None

    def fingerprint(self) -> dict[str, str]:
        """Short hashes of each part of the identity, so a mismatch can be named."""
        return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
                for k, v in self.identity.items()}


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


# Presets that are not GPTs: name -> (the "module:function" building its Workload, imported on use; description).
OTHER_PRESETS: dict[str, tuple[str, str]] = {
    "ts-lstm": ("saturate.timeseries:ts_lstm_workload",
                "an LSTM forecasting the next step of several series (synthetic, or a CSV via --data)"),
}


def preset_names() -> list[str]:
    return [*PRESETS, *OTHER_PRESETS]


def preset_with(preset: str, overrides: dict[str, Any]) -> tuple[GPTPreset, Optimization]:
    """A GPT preset with shape overrides applied, and its Optimization with the other overrides."""
    try:
        p = PRESETS[preset]
    except KeyError:
        raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(preset_names())})") from None
    shape_keys = ("n_layer", "n_head", "n_embd", "seq_len")
    shape = {k: v for k, v in overrides.items() if k in shape_keys}
    rest = {k: v for k, v in overrides.items() if k not in shape_keys}
    known = [*shape_keys, *(f.name for f in dataclasses.fields(Optimization))]
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"preset {preset}: {k} must be a positive integer, got {v!r}")
    try:
        return dataclasses.replace(p, **shape), dataclasses.replace(p.optim, **rest)
    except TypeError as e:
        raise ConfigError(f"bad override for preset {preset}: {e} (known: {', '.join(known)})") from None


def build_workload(
    preset: str = "gpt-tiny",
    *,
    data: Sequence[str] | None = None,
    tokenizer: str = "byte",
    text_field: str = "text",
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """A preset's Workload on the embedded corpus (data=None) or on the user's files.

    `overrides` replace fields of the preset's Optimization (e.g. steps=50, effective_batch=64) or of
    its model shape (n_layer, n_head, n_embd, seq_len).
    """
    from saturate.data.shards import prepare_corpus
    from saturate.data.windows import FixedWindows, RandomWindows
    from saturate.models.gpt import GPT, GPTConfig, flops_per_token, lm_loss

    if preset in OTHER_PRESETS:
        import importlib

        module, _, function = OTHER_PRESETS[preset][0].partition(":")
        return getattr(importlib.import_module(module), function)(data=data, seed=seed, **overrides)
    p, optim = preset_with(preset, overrides)
    corpus = prepare_corpus(data, tokenizer=tokenizer, seq_len=p.seq_len, text_field=text_field)
    cfg = GPTConfig(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, seq_len=p.seq_len,
                    vocab_size=corpus.vocab_size)
    info = {"preset": preset, "corpus_files": corpus.n_files, "corpus_tokens": corpus.n_tokens,
            "tokenizer": corpus.tokenizer.name, "vocab_size": corpus.vocab_size,
            "corpus_cached": corpus.cached}
    return Workload(
        name=preset,
        build_model=lambda: GPT(cfg),
        train_data=RandomWindows(corpus.train, cfg.seq_len, seed=seed),
        val_data=FixedWindows(corpus.val, cfg.seq_len, n=optim.eval_samples),
        loss_fn=lm_loss,
        optim=optim,
        tokens_per_sample=cfg.seq_len,
        flops_per_sample=flops_per_token(cfg) * cfg.seq_len,
        identity={"model": cfg.to_dict(), "data": {"corpus": corpus.fingerprint, "seed": seed}},
        info=info,
    )
