"""`saturate env`: what a bug report needs, as plain text to paste (or `--json`), like `accelerate env`.

Versions of saturate, Python, torch (its CUDA/HIP build), the GPU driver (NVML), numpy and the
optional libraries saturate works with; the devices torch sees; the OS, CPU and usable cores. Nothing
is measured, nothing is downloaded: it answers in about the time `import torch` takes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

OPTIONAL = ("transformers", "accelerate", "lightning", "pytorch-lightning", "tensorboard", "wandb", "mlflow",
            "nvidia-ml-py", "amdsmi")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("env", help="versions, devices and drivers, to paste into a bug report")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_env)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The facts `saturate env` prints; a value is None where it does not apply or could not be read."""
    import torch

    from saturate import __version__
    from saturate.hardware import cpu

    cores, why = cpu.usable_cores()
    cpuinfo = cpu.read_cpuinfo()
    model_name, flags = cpu.parse_cpuinfo(cpuinfo) if cpuinfo is not None else (None, set())
    devices: list[str] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps (Apple GPU)")
    return {
        "saturate": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "hip (torch build)": getattr(torch.version, "hip", None),
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
        "gpu driver": _driver_version(),
        "numpy": _version("numpy"),
        **{name: _version(name) for name in OPTIONAL},
        "devices": devices or ["cpu only (no GPU visible to torch)"],
        "os": platform.platform(),
        "cpu": cpu.cpu_name(model_name) + (" (bf16: avx512_bf16/amx)" if flags & {"avx512_bf16", "amx_bf16"} else ""),
        "cores": f"{cores} usable of {os.cpu_count()}" + (f" ({why})" if why else ""),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                                 "SATURATE_CACHE", "SATURATE_STUCK_AFTER", "PYTORCH_CUDA_ALLOC_CONF")},
    }


def _driver_version() -> str | None:
    """The NVIDIA driver through NVML (None without NVML or an NVIDIA GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library, no driver, no GPU: nothing to report
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def render(env: dict[str, Any]) -> str:
    """Plain text, one `- key: value` line each, as bug templates ask for (no colour, no table borders)."""
    lines = []
    for key, value in env.items():
        if isinstance(value, list):
            value = "; ".join(value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "(none set)"
        missing = "not installed" if key in OPTIONAL or key == "numpy" else "none"
        lines.append(f"- {key}: {missing if value is None else value}")
    return "\n".join(lines)


def cmd_env(args: argparse.Namespace) -> int:
    env = environment()
    print(json.dumps(env, indent=2) if args.json else render(env))
    return 0
