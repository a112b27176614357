"""The one place that decides the autocast dtype, whether a GradScaler exists, TF32, and the attention kernel
(`plan.attention`: the scaled-dot-product-attention backend every forward runs under, None for torch's choice)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from saturate.errors import ConfigError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _backend(name: str) -> torch.nn.attention.SDPBackend:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


@contextlib.contextmanager
def _both(cast: contextlib.AbstractContextManager, attention: str) -> Iterator[None]:
    from torch.nn.attention import sdpa_kernel

    with cast, sdpa_kernel(_backend(attention)):
        yield


@dataclass
class Precision:
    name: str  # "fp32", "bf16" or "fp16"
    device_type: str  # torch device type: "cuda", "cpu", "mps"
    scaler: torch.amp.GradScaler | None  # only for fp16, whose small range needs loss scaling
    attention: str | None = None  # plan.attention: the SDPA backend forwards run under; None: torch's choice

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        """What a forward runs under: autocast to the lower precision, and the attention backend, where set."""
        cast = contextlib.nullcontext() if self.name == "fp32" else torch.autocast(device_type=self.device_type,
                                                                                     dtype=self.dtype)
        return cast if self.attention is None else _both(cast, self.attention)


def make_precision(name: str, device_type: str, attention: str | None = None) -> Precision:
    if name not in _DTYPES:
        raise ConfigError(f"plan.precision must be one of {', '.join(_DTYPES)}; got {name!r}")
    if name == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("plan.precision = 'bf16' but this GPU does not support bfloat16; use fp16 or fp32")
    if name == "fp16" and device_type == "mps":
        scaler = None  # GradScaler has no MPS implementation; fp16 on MPS trains unscaled
    else:
        scaler = torch.amp.GradScaler(device_type) if name == "fp16" else None
    return Precision(name=name, device_type=device_type, scaler=scaler, attention=attention)


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions (a no-op on devices without it)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
