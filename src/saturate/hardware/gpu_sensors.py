"""GPU sensors: NVML (``nvidia-ml-py``) and AMD SMI (``amdsmi``, when installed), the one place they are read.

``open_gpu_source`` gives a source the telemetry sampler and the monitor read once a second
(utilisation, memory, power, clocks, temperature); ``nvml_readings`` is what ``probe()`` reads
once (driver version, free memory per torch device). A sensor that cannot be read (no GPU, NVML
missing or failing, a sensor the driver does not expose, a permission error) is left as None
with the reason in ``missing`` or a note: nothing here is ever estimated or filled in.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from saturate.hardware.readings import GpuReading, reason

_MIB = 1024**2


class GpuSource:
    """No GPU telemetry; `note` says why. The vendor sources below override `read`."""

    name = "none"

    def __init__(self, note: str | None) -> None:
        self.note = note
        self._closed = False

    def read(self) -> list[GpuReading]:
        return []

    def _shutdown(self) -> None:
        """The vendor library's shutdown call."""

    def close(self) -> None:
        """Shut the library down once; a failure there is not worth reporting (nothing is read after it)."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._shutdown()


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


class NvmlSource(GpuSource):
    """NVIDIA GPUs through NVML; `handles` pairs the index to report with each NVML handle."""

    name = "nvml"

    def __init__(self, pynvml: Any, handles: list[tuple[int, Any]], note: str | None = None) -> None:
        super().__init__(note)
        self.nv = pynvml
        self.handles = handles  # (reported index, NVML handle)
        self.names = _device_names(handles, lambda h: _text(pynvml.nvmlDeviceGetName(h)), pynvml.NVMLError, "GPU")

    def read(self) -> list[GpuReading]:
        nv = self.nv
        out = []
        for index, h in self.handles:
            r = GpuReading(index=index, name=self.names[index])
            # NotSupported (MIG, some boards), NoPermission, GpuIsLost, …
            take = _sensor_reader(r, nv.NVMLError, lambda e: f"NVML: {e}")

            util = take(["util_pct"], lambda h=h: nv.nvmlDeviceGetUtilizationRates(h))
            if util is not None:
                r.util_pct = float(util.gpu)
            mem = take(["mem_used", "mem_total"], lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            if mem is not None:
                r.mem_used, r.mem_total = int(mem.used), int(mem.total)
            power = take(["power_w"], lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
            if power is not None:
                r.power_w = power / 1000.0  # milliwatts
            limit = take(["power_limit_w"], lambda h=h: nv.nvmlDeviceGetEnforcedPowerLimit(h))
            if limit is not None:
                r.power_limit_w = limit / 1000.0
            sm = take(["sm_clock_mhz"], lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            if sm is not None:
                r.sm_clock_mhz = float(sm)
            memclk = take(["mem_clock_mhz"], lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
            if memclk is not None:
                r.mem_clock_mhz = float(memclk)
            temp = take(["temp_c"], lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            if temp is not None:
                r.temp_c = float(temp)
            out.append(r)
        return out

    def _shutdown(self) -> None:
        self.nv.nvmlShutdown()


def _device_names(handles: list[tuple[int, Any]], read: Callable[[Any], str],
                  errors: type[BaseException] | tuple[type[BaseException], ...], kind: str) -> dict[int, str]:
    """Each device's name by its reported index; an unreadable name says so (the readings still go on)."""
    names = {}
    for index, handle in handles:
        try:
            names[index] = read(handle)
        except errors as e:
            names[index] = f"{kind} {index} (name unreadable: {reason(e)})"
    return names


def _sensor_reader(r: GpuReading, errors: type[BaseException] | tuple[type[BaseException], ...],
                   why: Callable[[BaseException], str]) -> Callable[[Sequence[str], Callable[[], Any]], Any]:
    """`take(fields, read)`: the reading, or None with each field marked missing and why (never a made-up value)."""

    def take(fields: Sequence[str], read: Callable[[], Any]) -> Any:
        try:
            return read()
        except errors as e:
            for f in fields:
                r.missing[f] = why(e)
            return None

    return take


def _amd_number(value: Any) -> float | None:
    # AMD SMI answers "N/A" (a string) for a sensor the board does not expose.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class AmdSmiSource(GpuSource):
    """AMD GPUs through the `amdsmi` Python package (ROCm 6+ dict shapes: VRAM in MiB, power in W).

    Written against AMD SMI's documented interface; not yet run on AMD hardware in this project.
    """

    name = "amdsmi"

    def __init__(self, amdsmi: Any, handles: list[tuple[int, Any]], note: str | None = None) -> None:
        super().__init__(note)
        self.smi = amdsmi
        self.handles = handles
        self.names = _device_names(handles, lambda h: str(amdsmi.amdsmi_get_gpu_asic_info(h)["market_name"]),
                                   Exception, "AMD GPU")

    def read(self) -> list[GpuReading]:
        smi = self.smi
        out = []
        for index, h in self.handles:
            r = GpuReading(index=index, name=self.names[index])
            # AmdSmiLibraryException and friends; the class moved between releases
            take = _sensor_reader(r, Exception, lambda e: f"AMD SMI: {reason(e)}")

            def number(name: str, value: Any, r: GpuReading = r) -> float | None:
                v = _amd_number(value)
                if v is None and name not in r.missing:
                    r.missing[name] = f"AMD SMI reports {value!r}"
                return v

            activity = take(["util_pct"], lambda h=h: smi.amdsmi_get_gpu_activity(h))
            if activity is not None:
                r.util_pct = number("util_pct", activity.get("gfx_activity"))
            vram = take(["mem_used", "mem_total"], lambda h=h: smi.amdsmi_get_gpu_vram_usage(h))
            if vram is not None:
                used, total = number("mem_used", vram.get("vram_used")), number("mem_total", vram.get("vram_total"))
                r.mem_used = None if used is None else int(used * _MIB)
                r.mem_total = None if total is None else int(total * _MIB)
            power = take(["power_w", "power_limit_w"], lambda h=h: smi.amdsmi_get_power_info(h))
            if power is not None:
                current = _amd_number(power.get("current_socket_power"))
                r.power_w = current if current is not None else number("power_w", power.get("average_socket_power"))
                r.power_limit_w = number("power_limit_w", power.get("power_limit"))
            for name, kind in (("sm_clock_mhz", "GFX"), ("mem_clock_mhz", "MEM")):
                clk = take([name], lambda h=h, kind=kind: smi.amdsmi_get_clock_info(
                    h, getattr(smi.AmdSmiClkType, kind)))
                if clk is not None:
                    setattr(r, name, number(name, clk.get("clk")))
            temp = take(["temp_c"], lambda h=h: smi.amdsmi_get_temp_metric(
                h, smi.AmdSmiTemperatureType.EDGE, smi.AmdSmiTemperatureMetric.CURRENT))
            if temp is not None:
                r.temp_c = number("temp_c", temp)
            out.append(r)
        return out

    def _shutdown(self) -> None:
        self.smi.amdsmi_shut_down()


def _torch_gpus() -> tuple[int, bool, list[Any]]:
    """(visible torch GPUs, is ROCm, their properties); (0, …) when torch has none or is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:  # the monitor does not import torch just to count GPUs; NVML sees them anyway
        return 0, False, []
    try:
        if not torch.cuda.is_available():
            return 0, torch.version.hip is not None, []
        n = torch.cuda.device_count()
        return n, torch.version.hip is not None, [torch.cuda.get_device_properties(i) for i in range(n)]
    except Exception:
        return 0, False, []


def normalise_uuid(uuid: str) -> str:
    """A UUID as NVML and torch can both be matched by."""
    # NVML says "GPU-1a2b...", torch's device properties say "1a2b..."; MIG slices say "MIG-...".
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix) :]
    return uuid


def uuid_of(props: Any) -> str | None:
    """A torch device's UUID (str() of torch's _CUuuid is the bare hex), None where this torch build lacks it."""
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


def _match_by_uuid(pynvml: Any, handles: list[Any], uuids: dict[int, str | None]) -> dict[int, Any]:
    """The NVML handle of each torch device index, matched by UUID; an index NVML has no device for is left out.

    CUDA numbers devices fastest-first and after CUDA_VISIBLE_DEVICES, NVML by PCI bus, so index 0
    in torch need not be index 0 in NVML; a MIG slice is not an NVML device of its own.
    """
    by_uuid = {normalise_uuid(_text(pynvml.nvmlDeviceGetUUID(h))): h for h in handles}
    matched = {}
    for index, uuid in uuids.items():
        handle = by_uuid.get(normalise_uuid(uuid)) if uuid else None
        if handle is not None:
            matched[index] = handle
    return matched


def _open_nvml(torch_indices: Sequence[int] | None, props: list[Any]) -> GpuSource:
    try:
        import pynvml
    except ImportError as e:
        return GpuSource(f"NVML unavailable ({e})")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, NoPermission, …
        return GpuSource(f"NVML unavailable ({e})")
    try:
        count = pynvml.nvmlDeviceGetCount()
        all_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        if torch_indices is None:
            if not all_handles:
                pynvml.nvmlShutdown()
                return GpuSource("NVML found no GPU")
            return NvmlSource(pynvml, list(enumerate(all_handles)))
        uuids = {i: uuid_of(props[i]) if i < len(props) else None for i in torch_indices}
        matched = _match_by_uuid(pynvml, all_handles, uuids)
        chosen = [(i, matched[i]) for i in torch_indices if i in matched]
        notes = [f"NVML has no device matching cuda:{i} (a MIG slice?)" for i in torch_indices if i not in matched]
        if not chosen:
            pynvml.nvmlShutdown()
            return GpuSource("; ".join(notes) or "NVML found no GPU")
        return NvmlSource(pynvml, chosen, "; ".join(notes) or None)
    except pynvml.NVMLError as e:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return GpuSource(f"NVML query failed ({e})")


def _open_amdsmi(torch_indices: Sequence[int] | None) -> AmdSmiSource | GpuSource:
    try:
        import amdsmi
    except ImportError:
        return GpuSource("AMD SMI unavailable (the amdsmi package is not installed)")
    try:
        amdsmi.amdsmi_init()
        handles = list(amdsmi.amdsmi_get_processor_handles())
    except Exception as e:
        return GpuSource(f"AMD SMI unavailable ({reason(e)})")
    indexed = list(enumerate(handles))
    note = None
    if torch_indices is not None:
        # AMD SMI enumerates by PCI address like HIP without HIP_VISIBLE_DEVICES; with it, the
        # order can differ, so the mapping is by position and said to be.
        indexed = [(i, handles[i]) for i in torch_indices if i < len(handles)]
        if os.environ.get("HIP_VISIBLE_DEVICES") or os.environ.get("ROCR_VISIBLE_DEVICES"):
            note = "GPUs matched to torch devices by position; HIP_VISIBLE_DEVICES may reorder them"
    return AmdSmiSource(amdsmi, indexed, note)


def open_gpu_source(torch_indices: Sequence[int] | None = None) -> GpuSource:
    """A source for every GPU (`torch_indices` None, the monitor) or for these torch devices.

    NVIDIA: NVML, devices matched to torch by UUID (torch and NVML number them differently).
    AMD: AMD SMI when the `amdsmi` package is installed. Anything else: a source that reads
    nothing and says why. With `torch_indices` None torch is not consulted (the monitor must
    not touch the GPUs it watches).
    """
    if torch_indices is None:
        source = _open_nvml(None, [])
        if source.name != "none":
            return source
        amd = _open_amdsmi(None)
        if amd.name != "none" and amd.handles:
            return amd
        amd.close()
        return GpuSource(f"no GPU found: {source.note}; {amd.note}")
    n, rocm, props = _torch_gpus()
    if n == 0:
        return GpuSource("no GPU: torch sees no CUDA or ROCm device")
    source = _open_amdsmi(torch_indices) if rocm else _open_nvml(torch_indices, props)
    if source.name == "none":
        source.note = f"GPU telemetry unavailable: {source.note}"
    return source



# ---------------------------------------------------------------------------------------------
# NVML at probe time



@dataclass
class NvmlReadings:
    """What probe() reads through NVML: the driver version and free memory per torch device."""

    driver_version: str | None = None
    memory_free: dict[int, int] = field(default_factory=dict)  # torch device index -> bytes


def nvml_readings(uuids: dict[int, str | None]) -> tuple[NvmlReadings, list[str]]:
    """Driver version and free memory per torch device index, read through NVML.

    Devices are matched by UUID, not index: CUDA numbers devices fastest-first and after
    CUDA_VISIBLE_DEVICES, NVML by PCI bus, so index 0 in torch need not be index 0 in NVML.
    Never raises for NVML trouble; what is missing comes back as a note.
    """
    readings = NvmlReadings()
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
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        matched = _match_by_uuid(pynvml, handles, uuids)
        for index in uuids:
            if index not in matched:
                # A MIG slice is not an NVML device of its own; its parent's free memory would
                # be wrong, so torch reads this one.
                notes.append(f"NVML has no device matching cuda:{index} (MIG slice?); free memory via torch")
                continue
            readings.memory_free[index] = int(pynvml.nvmlDeviceGetMemoryInfo(matched[index]).free)
    except pynvml.NVMLError as exc:
        notes.append(f"NVML query failed: {exc}; free memory read through torch")
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return readings, notes

