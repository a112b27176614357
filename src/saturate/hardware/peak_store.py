"""The measured matmul peak, kept per hardware: measured once, stored, re-used, and capped.

A peak read in a quarter of a second on a busy machine can be a tenth of the real one, and every
MFU divided by it is then ten times too high. So the peak here is the best of several timed runs
(``peaks.matmul_peak_runs``), measured with a ``ContentionMeter`` around it, and stored in
``<cache>/peaks/<hardware fingerprint>.json`` (beside the tuned plans; ``$SATURATE_CACHE`` moves both)
so later runs divide by the same figure instead of measuring again. Other processes can only slow a
run, so the higher of two readings is always kept; a reading taken while they kept the cores busy
is marked so and measured again on the next run until a quiet one is taken. On a CPU the instruction-set
bound (``cpu.instruction_set_bound``: cores x max clock x FLOPs per cycle) is a ceiling: a measured
peak above it is a measuring error, and the bound is used instead, said so.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from saturate.atomic import atomic_write_bytes
from saturate.hardware.contention import ContentionMeter
from saturate.hardware.peaks import TORCH_DTYPES, matmul_peak_runs

Runs = Callable[..., list[float]]


def peaks_dir() -> Path:
    from saturate.data.token_cache import cache_root

    return cache_root() / "peaks"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: measured again and rewritten
    return data if isinstance(data, dict) else {}


def spread_text(runs: list[float]) -> str:
    """"best of N runs, median M, range A-B GFLOP/s" for a list of FLOP/s readings."""
    g = [r / 1e9 for r in runs]
    return (f"best of {len(g)} runs; median {statistics.median(g):.3g}, range {min(g):.3g}-{max(g):.3g} "
            "GFLOP/s")


# Peaks measured by this process, by (store file, device/dtype): a busy reading is measured again by the
# next run, not by every later caller here (a side-by-side asks once per row).
_MEASURED_HERE: dict[tuple[str, str], list[float]] = {}


def matmul_peak(hw: Any, dtype: str, *, measure: Runs = matmul_peak_runs,
                refresh: bool = False) -> tuple[float, str, list[str]]:
    """(FLOP/s, where it came from, notes) of the matmul peak for ``dtype`` on ``hw.torch_device``.

    The stored figure for this hardware when there is one (``refresh`` measures again), else
    measured now; in both cases capped by ``hw.peak_bounds[dtype]`` where the CPU has one.
    Raises what the measurement raises (a dtype the device cannot multiply, out of memory).
    """
    path = peaks_dir() / f"{hw.fingerprint()}.json"
    key = f"{hw.torch_device}/{dtype}"
    stored = _read(path)
    record = stored.get(key)
    if not (isinstance(record, dict) and isinstance(record.get("runs"), list) and record["runs"]):
        record = None
    notes: list[str] = []
    here = _MEASURED_HERE.get((str(path), key))
    if record is not None and not refresh and (not record.get("contended") or here is not None):
        runs = [float(r) for r in record["runs"]]
        origin = f"measured {record.get('date', '?')}, stored for this hardware"
    else:
        meter = ContentionMeter(gpu=torch.device(hw.torch_device).type == "cuda").start()
        runs = measure(hw.torch_device, TORCH_DTYPES[dtype], tf32=dtype == "tf32")
        contention = meter.stop()
        busy = contention.significant()
        origin = "measured now"
        # Contention only ever slows a run, so the higher of two readings is the nearer to the
        # hardware: keep the best so far; a busy reading is measured again next run until a quiet one.
        if record is not None and max(float(r) for r in record["runs"]) > max(runs):
            runs = [float(r) for r in record["runs"]]
            origin = f"measured {record.get('date', '?')}, stored for this hardware; higher than now"
        if busy:
            notes.append(f"{dtype} matmul peak measured on a busy machine ({contention.line()}): the best "
                         "reading so far is used, and measured again next run until the machine is quiet")
        stored[key] = {"runs": runs, "date": time.strftime("%Y-%m-%d"),
                       "contended": busy and bool(record is None or record.get("contended", True)),
                       "contention": contention.to_dict()}
        _MEASURED_HERE[(str(path), key)] = runs
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, (json.dumps(stored, indent=2) + "\n").encode())
        except OSError as e:
            notes.append(f"matmul peak not stored ({e.strerror or e}); measured again next run")
    best = max(runs)
    label = f"{dtype} matmul peak ({origin}; {spread_text(runs)})"
    bound = (getattr(hw, "peak_bounds", None) or {}).get(dtype)
    if bound is not None and best > bound[0]:
        notes.append(f"the measured {dtype} matmul peak ({best / 1e9:.3g} GFLOP/s) is above what the "
                     f"instructions allow ({bound[0] / 1e9:.3g} GFLOP/s): the bound is used")
        return float(bound[0]), f"{dtype} instruction-set bound ({bound[1]})", notes
    return best, label, notes
