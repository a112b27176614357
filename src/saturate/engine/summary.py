"""What a run reports: each logged window's metrics, the MFU denominator, the whole-session summary
(summary.json), and the exported weights (model.safetensors)."""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from saturate.atomic import DiskFullError, atomic_path, atomic_write_bytes
from saturate.engine.checkpoint import state_bytes
from saturate.engine.distributed import DistInfo, all_reduce_scalar
from saturate.errors import CheckpointError
from saturate.hardware.mfu import mfu
from saturate.plan import Plan
from saturate.workloads.base import Workload


@dataclass
class RunResult:
    run_dir: Path
    plan: Plan
    steps: int  # optimizer steps completed (in total, across resumes)
    total_steps: int  # the schedule's length
    train_seconds: float  # wall time spent in steps this session (validation excluded)
    tokens_per_s: float | None
    samples_per_s: float | None
    mfu: float | None  # model FLOPs utilisation against `peak_label`
    peak_label: str
    peak_memory_bytes: int | None  # device peak on GPUs; host peak RSS on CPU
    memory_kind: str  # "device" or "host RSS"
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    weights: Path | None
    stopped_early: bool  # fewer steps than the schedule: a time budget ran out, or Ctrl-C
    interrupted: bool  # a signal (Ctrl-C, SIGTERM, SIGUSR1) asked the run to stop
    stop_signal: str | None = None  # which one ("SIGTERM"); under torchrun, agreed by every rank
    stop_reason: str | None = None  # why it stopped before the schedule's end (early stop, a signal, the budget)
    finished: bool = False  # done: the schedule ran out, or it stopped on purpose (early stop, a callback)
    mfu_note: str | None = None  # the MFU line (hardware.mfu): the figure and its peak, or why there is none
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the workload's own end-of-run metrics (evaluate)
    paused: bool = False  # train(on_window=…) paused it to be continued (stop_reason says why)


def peak_dtype(hw: Any, plan: Plan) -> str:
    """The dtype whose peak is a plan's MFU denominator: its precision's ("tf32" for fp32 with TF32 matmuls, where the
    device has them)."""
    dtype = {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "tf32" if plan.tf32 else "fp32")
    return "fp32" if dtype == "tf32" and not hw.supports.get("tf32") else dtype


def mfu_peak(hw: Any, plan: Plan) -> tuple[float | None, str]:
    """The MFU denominator for a plan's precision: the probe's peak, else the stored (or now measured) one."""
    from saturate.hardware.peak_store import matmul_peak

    dtype = peak_dtype(hw, plan)
    peak, label = hw.peak_flops(dtype)
    if peak is None:
        try:
            peak, label, _ = matmul_peak(hw, dtype)
        except Exception as e:  # a dtype the device cannot multiply: report MFU as unknown
            return None, f"unknown ({type(e).__name__})"
    return peak, label


# A run's matmuls at more than this share of a *measured* peak mean the peak read low (a CPU's peak can read about
# half in some processes; measured: bench/results/cpu-2026-11-27b/README.md): it is measured once more at the end of
# the run and the higher reading kept (peak_store keeps the higher for later runs).
SUSPECT_MFU = 0.75


def recheck_peak(hw: Any, plan: Plan, peak: float | None, label: str,
                 achieved: float) -> tuple[float | None, str, str | None]:
    """(peak, label, note): measured again when `achieved` FLOP/s is over `SUSPECT_MFU` of a measured `peak` (not a
    datasheet's); the note says so. Unchanged otherwise, or when the measurement fails."""
    from saturate.hardware.peak_store import matmul_peak

    dtype = peak_dtype(hw, plan)
    if peak is None or achieved <= SUSPECT_MFU * peak or hw.peak_flops(dtype)[0] is not None:
        return peak, label, None
    try:
        again, again_label, _ = matmul_peak(hw, dtype, refresh=True)
    except Exception:  # noqa: BLE001 - the figure stays as it was, said by its high MFU
        return peak, label, None
    if again <= peak:
        return peak, label, None
    note = (f"the {dtype} matmul peak read at the start ({peak / 1e9:.3g} GFLOP/s) was below what a peak must be: the "
            f"steps ran their model FLOPs at {achieved / 1e9:.3g} GFLOP/s ({100 * achieved / peak:.0f} % of it); "
            f"measured again: {again / 1e9:.3g} GFLOP/s, the MFU's denominator from here on")
    return again, again_label, note


def steps_for_budget(step: int, seconds_per_step: float, deadline: float | None, console: Any) -> int:
    remaining = max(0.0, (deadline or 0) - time.monotonic())
    total = step + max(1, int(remaining / max(seconds_per_step, 1e-9)))
    console.note(f"the time budget fits about {total} steps (a prediction from the first steps' measured "
                 f"{seconds_per_step:.3f} s/step); the schedule is sized to that")
    return total


def step_metrics(workload: Workload, plan: Plan, effective: int, steps: int, seconds: float, loss: float,
                  grad_norm: torch.Tensor | None, lr: float, peak: float | None,
                  device: torch.device) -> dict[str, float]:
    samples_per_s = steps * effective / seconds if seconds > 0 else 0.0
    m = {
        "train/loss": loss,
        "train/lr": lr,
        "throughput/samples_per_s": samples_per_s,
        "throughput/tokens_per_s": samples_per_s * workload.tokens_per_sample,
        "time/step_s": seconds / steps,
        "plan/micro_batch": plan.micro_batch,  # changes only when an OOM was absorbed
    }
    if grad_norm is not None:
        m["train/grad_norm"] = float(grad_norm)  # already synchronised by the loss read above
    if workload.flops_per_sample and peak:
        u = mfu(samples_per_s * workload.flops_per_sample, peak, "")
        if u.value is not None:
            m["throughput/mfu"] = u.value
        elif u.exceeds_peak and u.achieved:  # recorded, never shown as an MFU
            m["throughput/achieved_over_peak"] = u.achieved / peak
    if device.type == "cuda":
        m["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        m["memory/host_peak_rss_gib"] = host_peak_rss() / 2**30
    return m


def host_peak_rss() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # macOS reports bytes, Linux KiB


def export_weights(model: nn.Module, run_dir: Path, workload: Workload, strategy: str, dist: DistInfo) -> Path:
    from safetensors.torch import save_model

    path = run_dir / "model.safetensors"
    if strategy == "fsdp":  # gather the full weights to rank 0 (every rank takes part), into a plain model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.is_main:
            plain = workload.build_model()
            plain.load_state_dict(full)
            model = plain
    if not dist.is_main:
        return path
    try:
        with atomic_path(path, needed=state_bytes(model.state_dict())) as tmp:
            save_model(model, str(tmp))  # save_model de-duplicates the tied embedding/head weight
        if workload.export_extras is not None:
            workload.export_extras(model, run_dir)
    except DiskFullError as e:  # the checkpoints are whole: the export can be redone from the last one
        raise CheckpointError(f"could not export weights to {path.name}: {str(e).split(': ', 1)[1]}; "
                              "the last checkpoint is kept") from None
    except OSError as e:
        raise CheckpointError(f"could not export weights to {path}: {e.strerror or e}") from None
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def fill_summary(result: RunResult, workload: Workload, effective: int, steps_this_session: int,
                  peak: float | None, device: torch.device, run_dir: Path, dist: DistInfo) -> None:
    """Whole-session figures: steps timed in this process over the time they took (all measured).

    Throughput counts the global batch on rank 0's clock; peak memory is the largest over ranks.
    """
    if steps_this_session > 0 and result.train_seconds > 0:
        result.samples_per_s = steps_this_session * effective / result.train_seconds
    if result.samples_per_s:
        result.tokens_per_s = result.samples_per_s * workload.tokens_per_sample
        u = mfu(result.samples_per_s * (workload.flops_per_sample or 0), peak, result.peak_label)
        result.mfu, result.mfu_note = u.value, u.text()
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    else:
        result.peak_memory_bytes = host_peak_rss()
    result.peak_memory_bytes = int(all_reduce_scalar(result.peak_memory_bytes, "max"))
    if not dist.is_main:
        return
    write_json(run_dir / "summary.json", {
        "steps": result.steps, "total_steps": result.total_steps, "train_seconds": result.train_seconds,
        "samples_per_s": result.samples_per_s, "tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
        "mfu_peak": result.peak_label, "mfu_note": result.mfu_note, "peak_memory_bytes": result.peak_memory_bytes,
        "memory_kind": result.memory_kind, "train_loss": result.train_loss, "val_loss": result.val_loss,
        "checkpoint": result.checkpoint, "weights": result.weights, "stopped_early": result.stopped_early,
        "stopped_by": result.stop_signal,
        "stop_reason": result.stop_reason,
        "processes": dist.world_size, "plan": result.plan.to_dict(), "notes": result.notes,
        "metrics": result.metrics})
