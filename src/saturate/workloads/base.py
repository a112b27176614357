"""Workload: what to train — model, data, loss, and the optimisation the user asked for.

A Workload is plain data plus three callables, so a preset, a Hugging Face model and a user's own
model all go through the same engine. The kinds that build one live beside this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn
from torch.utils.data import Dataset

from saturate.errors import ConfigError, unknown_name

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


    def with_values(self, changes: dict[str, Any], where: str) -> Optimization:
        """A copy with `changes` (from --param or a preset's overrides), each value checked against its field:
        one ConfigError naming the field (`where`: "preset gpt-tiny", …), never a Python internal."""
        kinds = {"effective_batch": int, "warmup_steps": int, "steps": int, "eval_every": int, "eval_samples": int}
        known = [f.name for f in dataclasses.fields(self)]
        for key, value in changes.items():
            if key not in known:
                raise ConfigError(f"{where}: " + unknown_name("option", key, known))
            if key == "betas":
                ok = (isinstance(value, (tuple, list)) and len(value) == 2
                      and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value))
                want = "two numbers"
            elif key == "grad_clip" and value is None:
                ok, want = True, ""
            else:
                kind = kinds.get(key, float)
                ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
                want = "an integer" if kind is int else "a number"
            if not ok:
                raise ConfigError(f"{where}: {key} must be {want}, got {value!r}")
        return dataclasses.replace(self, **{k: tuple(v) if k == "betas" else v for k, v in changes.items()})


@dataclass
class Workload:
    name: str
    build_model: Callable[[], nn.Module]  # a fresh model on the CPU, in fp32
    train_data: Dataset  # map-style; sample i for any global index i >= 0 (see data/loaders.py)
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
    # Rows of logits per chunk for this workload's chunked loss (`plan.loss_chunk`, workloads/chunked_loss.py): the
    # tuner measures it when a micro-batch holds more rows than one chunk. None: its model has no chunked loss.
    loss_chunk_rows: int | None = None
    sdpa: bool = False  # its attention is torch's scaled_dot_product_attention (plan.attention picks the kernel)

    def fingerprint(self) -> dict[str, str]:
        """Short hashes of each part of the identity, so a mismatch can be named."""
        return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
                for k, v in self.identity.items()}


MANY_PASSES = 100  # reading the data more often than this in one run is said (overfitting, wasted compute)


def distinct_samples(dataset: Any) -> int | None:
    """How many different samples a training dataset holds: its `distinct_samples` (windows drawn from a
    corpus or a series say theirs), else its length when finite; None when unknown."""
    n = getattr(dataset, "distinct_samples", None)
    if n is None:
        try:
            n = len(dataset)
        except TypeError:
            return None
    return int(n) if 0 < n < 2**62 else None


def data_note(dataset: Any, effective: int, steps: int) -> str | None:
    """A warning when the effective batch is far beyond the data: larger than it, or read many times over."""
    n = distinct_samples(dataset)
    if n is None:
        return None
    if effective > n:
        return (f"the effective batch ({effective}) is larger than the training data ({n} distinct samples): "
                "every step repeats samples; a smaller --effective-batch or more data")
    passes = effective * steps / n
    if passes > MANY_PASSES:
        return (f"{steps} steps × {effective} samples read the training data ({n} distinct samples) about "
                f"{passes:.0f} times over: expect overfitting; fewer --steps or more data")
    return None
