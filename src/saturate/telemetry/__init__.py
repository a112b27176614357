"""Telemetry: GPU and host readings sampled in a background thread, their statistics, and the monitor.

    sampler   Sampler, Snapshot, Stat and the window statistics (gpu_stat, host_stat, swap_traffic)
    monitor   `saturate monitor`: the live view over the sensors

The sensors themselves are read in ``saturate.hardware`` (``gpu_sensors``, ``host_sensors``); their
names are re-exported here for the code that reads them through telemetry.
"""

from saturate.hardware.gpu_sensors import AmdSmiSource, GpuSource, NvmlSource, open_gpu_source
from saturate.hardware.host_sensors import cgroup_memory, host_memory_budget, read_host, read_process_tree
from saturate.hardware.readings import GpuReading, HostReading, ProcessReading
from saturate.telemetry.sampler import (
    Sampler,
    Snapshot,
    Stat,
    gpu_stat,
    host_stat,
    iter_gpu_indices,
    swap_traffic,
    window_means,
)

__all__ = [
    "AmdSmiSource", "GpuReading", "GpuSource", "HostReading", "NvmlSource", "ProcessReading", "Sampler", "Snapshot",
    "Stat", "cgroup_memory", "gpu_stat", "host_memory_budget", "host_stat", "iter_gpu_indices", "open_gpu_source",
    "read_host", "read_process_tree", "swap_traffic", "window_means",
]
