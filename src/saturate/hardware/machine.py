"""probe(): what we run on — devices, memory, dtype support, host CPU/RAM/swap, and matmul peaks.

Every number here is read from the system or measured in this probe: the host CPU through
``saturate.hardware.cpu``, GPU free memory and driver through NVML (``gpu_sensors``) or torch,
peaks from the cited datasheet table or measured (``saturate.hardware.peaks``). What could not
be read is said in ``Hardware.notes`` rather than filled in. ``render_hardware`` prints it all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.errors import SaturateError
from saturate.hardware import cpu
from saturate.hardware.gpu_sensors import nvml_readings, uuid_of
from saturate.hardware.peak_store import matmul_peak
from saturate.hardware.peaks import PEAK_DTYPES, datasheet_peaks, match_datasheet

_GIB = 1024**3


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
    # dtype -> FLOP/s of the matmul peak (best of several runs, stored per hardware: peak_store)
    measured_peak_flops: dict[str, float] = field(default_factory=dict)
    measured_peak_source: dict[str, str] = field(default_factory=dict)  # dtype -> how it was measured
    # dtype -> (FLOP/s, how computed): the CPU's instruction-set ceiling for a measured peak
    peak_bounds: dict[str, tuple[float, str]] = field(default_factory=dict)
    # dtype -> (dense FLOP/s, source) when the device matched a DATASHEET_PEAK_FLOPS row
    datasheet_peak_flops: dict[str, tuple[float, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what could not be read or measured, and why
    cpu_isa: str = ""  # the widest matmul instructions by dtype, from the CPU's flags (cpu.isa_text)

    def peak_flops(self, dtype: str) -> tuple[float | None, str]:
        """The MFU denominator for a precision, and where it came from.

        ``dtype`` is "fp32", "bf16" or "fp16"; pass "tf32" for fp32 with TF32 matmuls enabled.
        The datasheet dense peak wins when a row matched ("datasheet: <source>"), then the
        matmul peak (best of several runs, capped by the CPU's instruction-set bound; its label says
        how it was measured), else ``(None, "unknown")``.
        """
        if dtype not in PEAK_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(PEAK_DTYPES)}, got {dtype!r}")
        if dtype == "tf32" and not self.supports.get("tf32", False):
            dtype = "fp32"  # allowing TF32 changes nothing where there are no TF32 tensor cores
        if dtype in self.datasheet_peak_flops:
            value, source = self.datasheet_peak_flops[dtype]
            return float(value), f"datasheet: {source}"
        if dtype in self.measured_peak_flops:
            return float(self.measured_peak_flops[dtype]), self.measured_peak_source.get(dtype, "measured")
        return None, "unknown"

    def fingerprint(self) -> str:
        """A short hash of what decides whether a tuned plan transfers to this machine.

        Free memory, RAM availability and measured peaks move from run to run, so they are left
        out; a plan tuned on one H200 box applies to another with the same parts and torch. The CPU's
        instruction set is in: one name ("AMD EPYC") is a Zen 3 without native bf16 or a Zen 4 with it.
        """
        key = {
            "device_type": self.device_type,
            "devices": [d.name for d in self.devices],
            "memory_total": [d.memory_total for d in self.devices],
            "cpu_name": self.cpu_name,
            "cpu_cores": self.cpu_cores,
            "cpu_isa": self.cpu_isa,
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
# GPUs and MPS


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
        uuids = {i: uuid_of(p) for i, p in enumerate(props)}
        readings, nvml_notes = nvml_readings(uuids)
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
    """Read the machine and, unless ``measure_peaks`` is False, its matmul peaks (stored per hardware:
    a few seconds the first time, read back after).

    ``device`` None picks CUDA/ROCm, then MPS, then CPU; "cpu", "cuda", "cuda:N" or "mps" force
    one and raise SaturateError when it is not there.
    """
    device_type, torch_device = _resolve_device(device)
    notes: list[str] = []
    cpuinfo = cpu.read_cpuinfo()
    model_name, cpu_flags = cpu.parse_cpuinfo(cpuinfo) if cpuinfo is not None else (None, set())
    cpu_name = cpu.cpu_name(model_name)
    cpu_cores, cores_note = cpu.usable_cores()
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
        matched = match_datasheet(used.name)
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
        supports = cpu.cpu_supports(cpu_flags)
        if cpuinfo is None:
            notes.append("/proc/cpuinfo unreadable: native CPU bf16/fp16 assumed absent")
        notes.append("CPUs have no datasheet row; MFU uses the measured peak, capped by the instruction-set bound")

    hw = Hardware(
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
        datasheet_peak_flops=datasheet,
        peak_bounds=_cpu_bounds(cpu_flags, cpu_cores, cpuinfo) if device_type == "cpu" else {},
        cpu_isa=cpu.isa_text(cpu_flags),
        notes=notes,
    )
    if measure_peaks:
        _measure_peaks(hw)
    else:
        notes.append("matmul peaks not measured (measure_peaks=False)")
    return hw


def _cpu_bounds(flags: set[str], cores: int, cpuinfo: str | None) -> dict[str, tuple[float, str]]:
    clock, clock_source = cpu.max_clock_hz(cpuinfo)
    bounds = {}
    for name in ("fp32", "bf16", "fp16"):
        bound = cpu.instruction_set_bound(flags, cores, clock, clock_source, name)
        if bound is not None:
            bounds[name] = bound
    return bounds


def _measure_peaks(hw: Hardware) -> None:
    """Fill hw's measured peaks (stored per hardware, measured where none is stored yet)."""
    for name in PEAK_DTYPES:
        if name != "fp32" and not hw.supports[name]:
            if name != "tf32":
                hw.notes.append(f"{name} not native on {hw.torch_device}; its matmul peak was not measured")
            continue
        try:
            value, source, notes = matmul_peak(hw, name)
        except RuntimeError as exc:  # out of memory, or a dtype the backend rejects
            hw.notes.append(f"{name} matmul peak not measured: {_first_line(exc)}")
            continue
        hw.measured_peak_flops[name], hw.measured_peak_source[name] = value, source
        hw.notes += notes


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
            row(f"peak {dtype}", f"{hw.measured_peak_flops[dtype] / 1e12:.3g} TFLOP/s "
                f"({hw.measured_peak_source.get(dtype, 'measured')})")
        if dtype in hw.peak_bounds:
            value, source = hw.peak_bounds[dtype]
            row(f"bound {dtype}", f"{value / 1e12:.3g} TFLOP/s (ceiling: {source})")
        if dtype in hw.datasheet_peak_flops:
            value, source = hw.datasheet_peak_flops[dtype]
            row(f"peak {dtype}", f"{value / 1e12:.4g} TFLOP/s (datasheet: {source})")
    row("fingerprint", hw.fingerprint())
    for note in hw.notes:
        row("note", note)
    console.print(table)
