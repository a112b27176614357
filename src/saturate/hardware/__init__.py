"""The hardware: what the machine is, what it can do at peak, and how its sensors are read.

    machine       probe() -> Hardware (devices, dtype support, host, peaks); render_hardware
    cpu           the host CPU: name, native bf16/fp16, usable cores
    peaks         the cited datasheet table, measure_matmul_peak, synchronize
    readings      what a GPU, host or process-tree reading holds
    gpu_sensors   NVML and AMD SMI: live GPU sources, and what probe() reads through NVML
    host_sensors  RAM, swap, CPU, a process tree's memory, the memory a job may use
    contention    what other processes use of our CPU cores and GPUs while we measure
    kernels       which fused kernels (AdamW) this torch has for a device
"""

from saturate.hardware.cpu import usable_cores
from saturate.hardware.machine import DeviceInfo, Hardware, probe, render_hardware
from saturate.hardware.peaks import (
    DATASHEET_PEAK_FLOPS,
    PEAK_DTYPES,
    DatasheetRow,
    datasheet_peaks,
    measure_matmul_peak,
    synchronize,
)

__all__ = [
    "DATASHEET_PEAK_FLOPS", "PEAK_DTYPES", "DatasheetRow", "DeviceInfo", "Hardware", "datasheet_peaks",
    "measure_matmul_peak", "probe", "render_hardware", "synchronize", "usable_cores",
]
