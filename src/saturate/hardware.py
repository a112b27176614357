"""probe(): what we run on — devices, memory, dtype support, host CPU/RAM/swap, and matmul peaks.

Every number here is read from the system or measured in this probe. The one table of
constants, ``DATASHEET_PEAK_FLOPS``, is cited row by row and only used for a device whose name
and multiprocessor count both match the datasheet part; anything else gets the measured peak,
and what could not be read is said in ``Hardware.notes`` rather than filled in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.errors import SaturateError

# Precision names used across saturate. "tf32" is fp32 storage with TF32 tensor-core matmuls.
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16")
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_GIB = 1024**3


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


@dataclass
class DeviceInfo:
    """One accelerator as torch numbers it."""

    index: int
    name: str
    memory_total: int  # bytes
    memory_free: int | None  # bytes, None if it could not be read
    compute_capability: str | None  # "9.0" for CUDA; gfx arch for ROCm; None when unknown
    multiprocessors: int | None  # SMs (NVIDIA) or CUs (AMD)


@dataclass
class Hardware:
    """What we run on, as read and measured by ``probe()``."""

    device_type: str  # "cuda", "rocm", "mps" or "cpu"
    torch_device: str  # the torch device string: "cuda", "cuda:N", "mps" or "cpu" (ROCm is "cuda")
    devices: list[DeviceInfo]  # every visible accelerator; empty for cpu
    supports: dict[str, bool]  # "bf16", "fp16", "tf32": native hardware fast path on torch_device
    cpu_name: str
    cpu_cores: int  # cores this process may run on
    host_ram_total: int  # bytes
    host_ram_available: int
    swap_total: int
    swap_used: int
    torch_version: str
    cuda_version: str | None  # torch.version.cuda
    hip_version: str | None  # torch.version.hip
    driver_version: str | None  # from NVML where present
    telemetry: str  # "nvml", "torch" or "none": how GPU memory figures were read
    # dtype -> FLOP/s measured by a matmul benchmark in this probe
    measured_peak_flops: dict[str, float] = field(default_factory=dict)
    # dtype -> (dense FLOP/s, source) when the device matched a DATASHEET_PEAK_FLOPS row
    datasheet_peak_flops: dict[str, tuple[float, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what could not be read or measured, and why

    def peak_flops(self, dtype: str) -> tuple[float | None, str]:
        """The MFU denominator for a precision, and where it came from.

        ``dtype`` is "fp32", "bf16" or "fp16"; pass "tf32" for fp32 with TF32 matmuls enabled.
        The datasheet dense peak wins when a row matched ("datasheet: <source>"), then the
        matmul peak measured in this probe ("measured"), else ``(None, "unknown")``.
        """
        if dtype not in PEAK_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(PEAK_DTYPES)}, got {dtype!r}")
        if dtype == "tf32" and not self.supports.get("tf32", False):
            dtype = "fp32"  # allowing TF32 changes nothing where there are no TF32 tensor cores
        if dtype in self.datasheet_peak_flops:
            value, source = self.datasheet_peak_flops[dtype]
            return float(value), f"datasheet: {source}"
        if dtype in self.measured_peak_flops:
            return float(self.measured_peak_flops[dtype]), "measured"
        return None, "unknown"

    def fingerprint(self) -> str:
        """A short hash of what decides whether a tuned plan transfers to this machine.

        Free memory, RAM availability and measured peaks move from run to run, so they are left
        out; a plan tuned on one H200 box applies to another with the same parts and torch.
        """
        key = {
            "device_type": self.device_type,
            "devices": [d.name for d in self.devices],
            "memory_total": [d.memory_total for d in self.devices],
            "cpu_name": self.cpu_name,
            "cpu_cores": self.cpu_cores,
            "torch_version": self.torch_version,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (the datasheet tuples become lists)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Datasheet lookup


def _match_datasheet(name: str) -> tuple[str, DatasheetRow] | None:
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
    matched = _match_datasheet(name)
    if matched is None:
        return {}
    _, row = matched
    if multiprocessors is not None and multiprocessors != row.multiprocessors:
        return {}
    return {dtype: (flops, row.source) for dtype, flops in row.flops.items()}


# ---------------------------------------------------------------------------------------------
# Host CPU


def _parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo text; x86 says "flags", arm64 "Features"."""
    name: str | None = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "model name" and name is None and value.strip():
            name = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return name, flags


def _cpu_supports(flags: set[str]) -> dict[str, bool]:
    """Native (not emulated) reduced-precision matmul on the CPU.

    Without these instructions torch still runs bf16/fp16 on the CPU, but by converting in
    software, which is far slower than fp32; that is why only the flags count. arm64 "bf16" is
    the Armv8.6 BFloat16 extension (BFMMLA), used by oneDNN/ACL the same way.
    """
    return {
        "bf16": bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}),
        "fp16": bool(flags & {"avx512_fp16", "amx_fp16"}),
        "tf32": False,
    }


def _read_cpuinfo() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None  # macOS, Windows, or a sandbox without /proc


def _cpu_name(model_name: str | None) -> str:
    if model_name:
        return model_name
    if sys.platform == "darwin":
        try:
            brand = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2
            ).stdout.strip()
            if brand:
                return brand
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> tuple[int, str | None]:
    """Cores this process may use, and a note when a container CPU quota lowered the figure."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS/Windows
        cores = os.cpu_count() or 1
    # A cgroup v2 quota ("200000 100000" = 2 CPUs) caps throughput below the affinity mask in
    # containers; sizing loader workers by the mask alone oversubscribes them.
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            limit = max(1, math.ceil(int(quota) / int(period)))
            if limit < cores:
                return limit, f"CPU quota (cgroup cpu.max) limits this process to {limit} of {cores} cores"
    except (OSError, ValueError):
        pass
    return max(1, cores), None


# ---------------------------------------------------------------------------------------------
# GPU telemetry


@dataclass
class _NvmlReadings:
    driver_version: str | None = None
    memory_free: dict[int, int] = field(default_factory=dict)  # torch device index -> bytes


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


def _normalise_uuid(uuid: str) -> str:
    # NVML says "GPU-1a2b...", torch's device properties say "1a2b..."; MIG slices say "MIG-...".
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix) :]
    return uuid


def _nvml_readings(uuids: dict[int, str | None]) -> tuple[_NvmlReadings, list[str]]:
    """Driver version and free memory per torch device index, read through NVML.

    Devices are matched by UUID, not index: CUDA numbers devices fastest-first and after
    CUDA_VISIBLE_DEVICES, NVML by PCI bus, so index 0 in torch need not be index 0 in NVML.
    Never raises for NVML trouble; what is missing comes back as a note.
    """
    readings = _NvmlReadings()
    try:
        import pynvml
    except ImportError as exc:
        return readings, [f"NVML unavailable: {exc}; free memory read through torch"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return readings, [f"NVML unavailable: {exc}; free memory read through torch"]
    notes: list[str] = []
    try:
        readings.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        handles = {}
        for nvml_index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            handles[_normalise_uuid(_text(pynvml.nvmlDeviceGetUUID(handle)))] = handle
        for index, uuid in uuids.items():
            handle = handles.get(_normalise_uuid(uuid)) if uuid else None
            if handle is None:
                # A MIG slice is not an NVML device of its own; its parent's free memory would
                # be wrong, so torch reads this one.
                notes.append(f"NVML has no device matching cuda:{index} (MIG slice?); free memory via torch")
                continue
            readings.memory_free[index] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except pynvml.NVMLError as exc:
        notes.append(f"NVML query failed: {exc}; free memory read through torch")
    finally:
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return readings, notes


def _uuid_of(props: Any) -> str | None:
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


def _probe_gpus(rocm: bool) -> tuple[list[DeviceInfo], str | None, str, list[str]]:
    """(devices, driver version, telemetry, notes) for every visible CUDA/ROCm device."""
    notes: list[str] = []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    driver: str | None = None
    free: dict[int, int] = {}
    if rocm:
        # NVML does not see AMD GPUs; torch's HIP runtime is the telemetry source there.
        notes.append("driver version not read on ROCm (NVML is NVIDIA-only)")
    else:
        # str() of torch's _CUuuid is the bare hex UUID; None where this torch build lacks it.
        uuids = {i: _uuid_of(p) for i, p in enumerate(props)}
        readings, nvml_notes = _nvml_readings(uuids)
        notes += nvml_notes
        driver, free = readings.driver_version, dict(readings.memory_free)
    from_nvml = bool(free)
    for i in range(len(props)):
        if i in free:
            continue
        try:
            # Creates a context on device i; only reached when NVML could not answer for it.
            free[i] = int(torch.cuda.mem_get_info(i)[0])
        except RuntimeError as exc:
            notes.append(f"free memory of cuda:{i} unreadable: {_first_line(exc)}")
    telemetry = "nvml" if from_nvml else ("torch" if free else "none")
    devices = []
    for i, p in enumerate(props):
        if rocm:
            arch = getattr(p, "gcnArchName", "") or ""
            capability = arch.split(":")[0] or None  # "gfx90a:sramecc+:xnack-" -> "gfx90a"
        else:
            capability = f"{p.major}.{p.minor}"
        sms = int(p.multi_processor_count)
        devices.append(DeviceInfo(i, p.name, int(p.total_memory), free.get(i), capability, sms))
    return devices, driver, telemetry, notes


def _cuda_supports(index: int, rocm: bool) -> dict[str, bool]:
    try:
        # including_emulation=False: newer torch otherwise says True for bf16 emulated on Volta/Turing.
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before the parameter existed
        bf16 = torch.cuda.is_bf16_supported()
    if rocm:
        return {"bf16": bool(bf16), "fp16": True, "tf32": False}
    major, _ = torch.cuda.get_device_capability(index)
    return {"bf16": bool(bf16) and major >= 8, "fp16": major >= 7, "tf32": major >= 8}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def _mps_bf16_works() -> bool:
    # Older macOS/torch combinations reject bf16 on MPS outright; a 2x2 matmul finds out.
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device="mps")
        (x @ x).cpu()
        return True
    except (RuntimeError, TypeError):
        return False


def _probe_mps(cpu_name: str, ram_total: int) -> tuple[list[DeviceInfo], list[str]]:
    notes = ["MPS free memory is not reported by macOS; memory_total is Metal's recommended working set"]
    try:
        total = int(torch.mps.recommended_max_memory())
    except (AttributeError, RuntimeError):
        total = ram_total  # unified memory: the GPU can address host RAM
        notes[0] = "MPS memory figures unavailable in this torch; memory_total is host RAM (unified memory)"
    return [DeviceInfo(0, f"Apple GPU ({cpu_name})", total, None, None, None)], notes


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
    device: str, dtype: torch.dtype, seconds: float = 0.25, *, tf32: bool = False
) -> float:
    """Achieved FLOP/s of square ``n x n`` matmuls on ``device`` in ``dtype``, timed for ~``seconds``.

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
        elapsed = _time_matmuls(a, b, out, reps)
        del a, b, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # hand the benchmark's memory back before training allocates
    return 2.0 * n**3 * reps / elapsed


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# probe()


def _resolve_device(device: str | None) -> tuple[str, str]:
    """(device_type, torch_device) for a requested device, or the best available one."""
    rocm = torch.version.hip is not None
    if device is None:
        if torch.cuda.is_available():
            return ("rocm" if rocm else "cuda"), "cuda"
        if _mps_available():
            return "mps", "mps"
        return "cpu", "cpu"
    kind, _, index = device.strip().lower().partition(":")
    if kind == "cpu" and not index:
        return "cpu", "cpu"
    if kind in ("cuda", "rocm"):
        if kind == "rocm" and not rocm:
            raise SaturateError(f"device {device!r} requested but this torch build is not a ROCm build")
        if not torch.cuda.is_available():
            build = "ROCm" if rocm else ("CUDA" if torch.version.cuda else "CPU-only")
            raise SaturateError(f"device {device!r} requested but no GPU is usable (torch build: {build})")
        if not index:
            return ("rocm" if rocm else "cuda"), "cuda"
        count = torch.cuda.device_count()
        if not index.isdigit() or int(index) >= count:
            raise SaturateError(f"device {device!r} does not exist: {count} GPU(s) visible")
        return ("rocm" if rocm else "cuda"), f"cuda:{int(index)}"
    if kind == "mps" and not index:
        if not _mps_available():
            raise SaturateError(f"device {device!r} requested but MPS is not available on this machine")
        return "mps", "mps"
    raise SaturateError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps")


def probe(measure_peaks: bool = True, device: str | None = None) -> Hardware:
    """Read the machine and, unless ``measure_peaks`` is False, measure matmul peaks (~1-2 s).

    ``device`` None picks CUDA/ROCm, then MPS, then CPU; "cpu", "cuda", "cuda:N" or "mps" force
    one and raise SaturateError when it is not there.
    """
    device_type, torch_device = _resolve_device(device)
    notes: list[str] = []
    cpuinfo = _read_cpuinfo()
    model_name, cpu_flags = _parse_cpuinfo(cpuinfo) if cpuinfo is not None else (None, set())
    cpu_name = _cpu_name(model_name)
    cpu_cores, cores_note = _usable_cores()
    if cores_note:
        notes.append(cores_note)
    ram, swap = psutil.virtual_memory(), psutil.swap_memory()

    devices: list[DeviceInfo] = []
    driver: str | None = None
    telemetry = "none"
    datasheet: dict[str, tuple[float, str]] = {}
    if device_type in ("cuda", "rocm"):
        rocm = device_type == "rocm"
        devices, driver, telemetry, gpu_notes = _probe_gpus(rocm)
        notes += gpu_notes
        index = torch.device(torch_device).index
        index = torch.cuda.current_device() if index is None else index
        supports = _cuda_supports(index, rocm)
        if len({d.name for d in devices}) > 1:
            notes.append(f"devices differ; datasheet and measured peaks are for cuda:{index} only")
        used = devices[index]
        datasheet = datasheet_peaks(used.name, used.multiprocessors)
        matched = _match_datasheet(used.name)
        if matched is None:
            notes.append(f"no datasheet row for {used.name!r}; MFU uses the measured peak")
        elif not datasheet:
            key, row = matched
            notes.append(
                f"{used.name!r} has {used.multiprocessors} multiprocessors, not the {row.multiprocessors} "
                f"of a full {key} (MIG slice or partition?); MFU uses the measured peak"
            )
    elif device_type == "mps":
        devices, mps_notes = _probe_mps(cpu_name, ram.total)
        notes += mps_notes
        telemetry = "torch"
        supports = {"bf16": _mps_bf16_works(), "fp16": True, "tf32": False}
        notes.append("no datasheet table for Apple GPUs; MFU uses the measured peak")
    else:
        supports = _cpu_supports(cpu_flags)
        if cpuinfo is None:
            notes.append("/proc/cpuinfo unreadable: native CPU bf16/fp16 assumed absent")
        notes.append("CPUs have no datasheet row; MFU uses the measured peak")

    measured: dict[str, float] = {}
    if measure_peaks:
        for name in PEAK_DTYPES:
            if name != "fp32" and not supports[name]:
                if name != "tf32":
                    notes.append(f"{name} not native on {torch_device}; its matmul peak was not measured")
                continue
            try:
                measured[name] = measure_matmul_peak(torch_device, _TORCH_DTYPES[name], tf32=name == "tf32")
            except RuntimeError as exc:  # out of memory, or a dtype the backend rejects
                notes.append(f"{name} matmul peak not measured: {_first_line(exc)}")
    else:
        notes.append("matmul peaks not measured (measure_peaks=False)")

    return Hardware(
        device_type=device_type,
        torch_device=torch_device,
        devices=devices,
        supports=supports,
        cpu_name=cpu_name,
        cpu_cores=cpu_cores,
        host_ram_total=int(ram.total),
        host_ram_available=int(ram.available),
        swap_total=int(swap.total),
        swap_used=int(swap.used),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        hip_version=torch.version.hip,
        driver_version=driver,
        telemetry=telemetry,
        measured_peak_flops=measured,
        datasheet_peak_flops=datasheet,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# Rendering


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def render_hardware(hw: Hardware, console: Console) -> None:
    """Print what ``probe()`` found as one table (the ``saturate probe`` command)."""
    table = Table(title="saturate probe", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")

    def row(label: str, value: str) -> None:
        table.add_row(label, Text(value))  # Text: device names and notes may contain "[...]"

    if hw.devices:
        row("device", f"{hw.device_type} (torch device {hw.torch_device!r}), {len(hw.devices)} visible")
    else:
        row("device", "cpu (no GPU visible to torch)")
    for d in hw.devices:
        detail = [f"{_gib(d.memory_total)} total", f"{_gib(d.memory_free)} free"]
        if d.compute_capability:
            detail.append(f"capability {d.compute_capability}")
        if d.multiprocessors:
            detail.append(f"{d.multiprocessors} multiprocessors")
        row(f"  [{d.index}]", f"{d.name}: " + ", ".join(detail))
    row("native", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in hw.supports.items()))
    row("cpu", f"{hw.cpu_name}, {hw.cpu_cores} usable cores")
    row("host RAM", f"{_gib(hw.host_ram_available)} available of {_gib(hw.host_ram_total)}")
    row("swap", f"{_gib(hw.swap_used)} used of {_gib(hw.swap_total)}")
    versions = [f"torch {hw.torch_version}"]
    versions += [f"{label} {v}" for label, v in (("CUDA", hw.cuda_version), ("HIP", hw.hip_version)) if v]
    if hw.driver_version:
        versions.append(f"driver {hw.driver_version}")
    row("versions", ", ".join(versions))
    row("telemetry", hw.telemetry)
    for dtype in PEAK_DTYPES:
        if dtype in hw.measured_peak_flops:
            row(f"peak {dtype}", f"{hw.measured_peak_flops[dtype] / 1e12:.3g} TFLOP/s (measured)")
        if dtype in hw.datasheet_peak_flops:
            value, source = hw.datasheet_peak_flops[dtype]
            row(f"peak {dtype}", f"{value / 1e12:.4g} TFLOP/s (datasheet: {source})")
    row("fingerprint", hw.fingerprint())
    for note in hw.notes:
        row("note", note)
    console.print(table)
