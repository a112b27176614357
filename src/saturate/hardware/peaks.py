"""What the hardware can do at peak: the cited datasheet table and a measured matmul peak.

(The measured peak is kept per hardware on disk and capped by the CPU's instruction-set bound in
``peak_store``; ``mfu`` divides by it.)

``DATASHEET_PEAK_FLOPS`` is the one table of constants in saturate, cited row by row and only
used for a device whose name and multiprocessor count both match the datasheet part (see
``datasheet_peaks``); anything else gets the peak ``measure_matmul_peak`` measures.
``synchronize`` is the wait for queued device work that every clock reading here needs.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

# Precision names used across saturate. "tf32" is fp32 storage with TF32 tensor-core matmuls.
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16")
TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DatasheetRow:
    """Dense (non-sparse) peak FLOP/s of one part, per torch device, with where it came from."""

    source: str  # the vendor document the figures are taken from
    multiprocessors: int  # SMs (NVIDIA) or CUs (AMD) of one torch device of this part
    flops: dict[str, float]  # dtype name -> dense FLOP/s


# Keyed by a device-name fragment, matched case-insensitively as a whole word (so "L4" is not
# "L40S"), longest key first. Datasheets print sparse tensor figures (2x dense) with an asterisk;
# those are halved here. A row only applies when the device's SM/CU count equals the full part's,
# which keeps MIG slices, MI300X CPX partitions and cut-down variants on the measured peak.
# "tf32" is absent where the part has no TF32 path torch uses (Volta, Turing, AMD under ROCm).
DATASHEET_PEAK_FLOPS: dict[str, DatasheetRow] = {
    "H200 NVL": DatasheetRow(
        "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL (sparse tensor figures halved)",
        132,
        {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    ),
    "H200": DatasheetRow(
        "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM (sparse tensor figures halved)",
        132,
        {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    ),
    "H100 NVL": DatasheetRow(
        "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL per GPU (sparse tensor figures halved)",
        132,
        {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    ),
    "H100 PCIe": DatasheetRow(
        "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe (sparse tensor figures halved)",
        114,
        {"fp32": 51e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12},
    ),
    # torch names the SXM part "NVIDIA H100 80GB HBM3"; PCIe and NVL are matched above.
    "H100": DatasheetRow(
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM (sparse tensor figures halved)",
        132,
        {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    ),
    "A100": DatasheetRow(
        "NVIDIA A100 Tensor Core GPU datasheet, SXM and PCIe (dense figures)",
        108,
        {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    ),
    "L40S": DatasheetRow(
        "NVIDIA L40S datasheet (dense figures)",
        142,
        {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12},
    ),
    "L4": DatasheetRow(
        "NVIDIA L4 Tensor Core GPU datasheet (sparse tensor figures halved)",
        58,
        {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    ),
    "RTX A6000": DatasheetRow(
        "NVIDIA Ampere GA102 GPU Architecture whitepaper, RTX A6000 (dense, FP32 accumulate)",
        84,
        {"fp32": 38.7e12, "tf32": 77.4e12, "bf16": 154.8e12, "fp16": 154.8e12},
    ),
    # GeForce parts run FP16/BF16 tensor math at half rate with FP32 accumulation, which is what
    # autocast matmuls use, so these are the "FP32 accumulate" columns.
    "RTX 4090": DatasheetRow(
        "NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090 (dense, FP32 accumulate)",
        128,
        {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
    ),
    "RTX 3090": DatasheetRow(
        "NVIDIA Ampere GA102 GPU Architecture whitepaper, GeForce RTX 3090 (dense, FP32 accumulate)",
        82,
        {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
    ),
    "V100-SXM2": DatasheetRow(
        "NVIDIA Tesla V100 GPU datasheet, V100 SXM2", 80, {"fp32": 15.7e12, "fp16": 125e12}
    ),
    "V100-PCIE": DatasheetRow(
        "NVIDIA Tesla V100 GPU datasheet, V100 PCIe", 80, {"fp32": 14e12, "fp16": 112e12}
    ),
    "T4": DatasheetRow(
        "NVIDIA T4 Tensor Core GPU datasheet (FP16/FP32 mixed precision)", 40, {"fp32": 8.1e12, "fp16": 65e12}
    ),
    # fp32 is the matrix-core figure: ROCm's fp32 GEMMs run on the matrix cores (vector: 81.7 TF).
    "MI300X": DatasheetRow(
        "AMD Instinct MI300X datasheet (dense, matrix FP32)",
        304,
        {"fp32": 163.4e12, "bf16": 1307.4e12, "fp16": 1307.4e12},
    ),
    # The MI250X package holds two GCDs and torch sees each as its own device, so the package
    # figures (95.7 TF fp32 matrix, 383 TF bf16/fp16) are halved. An MI250 reports the same name
    # but 104 CUs per GCD, so the multiprocessor check keeps it off this row.
    "MI250X": DatasheetRow(
        "AMD Instinct MI250X datasheet (dense, matrix FP32; package figures halved per GCD)",
        110,
        {"fp32": 47.85e12, "bf16": 191.5e12, "fp16": 191.5e12},
    ),
}

# A matched key followed by one of these words is a different part (an RTX 3090 Ti is not an RTX
# 3090), and a name with any of the others anywhere is a mobile part: neither takes the row.
_VARIANT_WORDS = {"ti", "super", "d"}
_MOBILE_WORDS = ("laptop", "mobile", "max-q")


# ---------------------------------------------------------------------------------------------
# Datasheet lookup


def match_datasheet(name: str) -> tuple[str, DatasheetRow] | None:
    """(key, row) of the datasheet row a device name names; None for no row, a variant or a mobile part."""
    lowered = name.lower()
    if any(word in lowered for word in _MOBILE_WORDS):
        return None
    for key in sorted(DATASHEET_PEAK_FLOPS, key=len, reverse=True):
        for match in re.finditer(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", lowered):
            following = re.match(r"[\s/_]*([a-z0-9]+)", lowered[match.end() :])
            if following is None or following.group(1) not in _VARIANT_WORDS:
                return key, DATASHEET_PEAK_FLOPS[key]
    return None


def datasheet_peaks(name: str, multiprocessors: int | None = None) -> dict[str, tuple[float, str]]:
    """Dense datasheet peaks for a device name: dtype -> (FLOP/s, source); empty when no row fits.

    With ``multiprocessors`` given, a row whose part has a different SM/CU count is refused: the
    name alone cannot tell a MIG slice or partition from the whole GPU.
    """
    matched = match_datasheet(name)
    if matched is None:
        return {}
    _, row = matched
    if multiprocessors is not None and multiprocessors != row.multiprocessors:
        return {}
    return {dtype: (flops, row.source) for dtype, flops in row.flops.items()}


# ---------------------------------------------------------------------------------------------
# Measured peaks


def synchronize(device: torch.device) -> None:
    """Wait for queued device work: call before reading a clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextmanager
def _tf32_matmuls(enabled: bool) -> Iterator[None]:
    """Set TF32 for CUDA matmuls for the block and put the caller's setting back after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _time_matmuls(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, reps: int) -> float:
    device = out.device
    synchronize(device)  # nothing queued before the clock starts
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b, out=out)
    synchronize(device)  # GPU matmuls are asynchronous; the clock must wait for the last one
    return time.perf_counter() - start


def measure_matmul_peak(
    device: str, dtype: torch.dtype, seconds: float = 0.2, *, tf32: bool = False, repeats: int = 5
) -> float:
    """Achieved FLOP/s of square ``n x n`` matmuls on ``device`` in ``dtype``: the best of ``repeats``
    timed runs of ~``seconds`` each (see ``matmul_peak_runs``)."""
    return max(matmul_peak_runs(device, dtype, seconds, tf32=tf32, repeats=repeats))


def matmul_peak_runs(
    device: str, dtype: torch.dtype, seconds: float = 0.2, *, tf32: bool = False, repeats: int = 5
) -> list[float]:
    """FLOP/s of each of ``repeats`` timed runs of square matmuls, each ~``seconds`` long.

    A peak is the best of several runs, not one reading: another process taking the cores for part
    of a run lowers that run only, so the best run is the nearest to what the hardware can do.
    ``n`` starts at 4096 on a GPU and 1024 on a CPU and is doubled or halved until one matmul
    takes a few milliseconds: long enough that launch overhead and clock resolution vanish, short
    enough that the probe stays quick. ``tf32=True`` lets CUDA fp32 matmuls use TF32 tensor cores;
    fp32 without it is measured with TF32 off whatever the caller had set.
    """
    dev = torch.device(device)
    on_gpu = dev.type in ("cuda", "mps")
    n, n_min, n_max = (4096, 1024, 16384) if on_gpu else (1024, 256, 4096)
    fast, slow = 2e-3, 50e-3  # target window for one matmul, seconds
    element = torch.empty((), dtype=dtype).element_size()

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        return a, b, torch.empty(size, size, device=dev, dtype=dtype)

    def fits(size: int) -> bool:
        if dev.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(dev)
        return 3 * size * size * element < free // 2  # leave room for whatever else lives there

    def warmed(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        a, b, out = operands(size)
        _time_matmuls(a, b, out, 1)  # warm-up: kernel selection, cuBLAS/oneDNN handles, clocks
        return a, b, out, _time_matmuls(a, b, out, 1)

    tf32_setting = _tf32_matmuls(tf32) if dev.type == "cuda" else nullcontext()
    with tf32_setting, torch.no_grad():
        a, b, out, one = warmed(n)
        while one < fast and n < n_max and fits(n * 2):
            n *= 2
            del a, b, out  # free before allocating the larger operands
            a, b, out, one = warmed(n)
        while one > slow and n > n_min:
            n //= 2
            a, b, out, one = warmed(n)
        # A short batch gives a steadier per-matmul time than one call to size the main run.
        calibration = max(1, int(0.05 * seconds / one))
        one = _time_matmuls(a, b, out, calibration) / calibration
        reps = max(3, math.ceil(seconds / one))
        runs = [2.0 * n**3 * reps / _time_matmuls(a, b, out, reps) for _ in range(max(1, repeats))]
        del a, b, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # hand the benchmark's memory back before training allocates
    return runs
