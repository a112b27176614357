"""Workload: what to train — model, data, loss, and the optimisation the user asked for.

A Workload is plain data plus three callables, so a preset, a Hugging Face model and a user's own
model all go through the same engine. The kinds that build one live beside this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn
from torch.utils.data import Dataset

from saturate.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38  # an optimizer's float32 arithmetic: larger learning rates overflow


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
        if not self.lr <= FLOAT32_MAX:  # beyond it the optimizer cannot even represent the update
            raise ConfigError(f"lr must be a finite number below {FLOAT32_MAX:.3g} (float32's largest), got {self.lr}")
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
    # Layers whose output for a sample depends on the other samples of its micro-batch (BatchNorm): True,
    # False, or None to detect them in the model (workloads/coupling.py); `--param batch_coupled=true`.
    batch_coupled: bool | None = None
    # The micro-batch such a model's maths is written for (`--param micro_batch=N`); None: the whole
    # effective batch per process, as in a plain loop over batches of that size.
    micro_batch: int | None = None

    def fingerprint(self) -> dict[str, str]:
        """Short hashes of each part of the identity, so a mismatch can be named."""
        return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
                for k, v in self.identity.items()}
