"""What a sensor reading is: one GPU, the host, or a process tree, at one moment.

A field that could not be measured is None, with the reason in ``missing`` (``reason`` words an
exception for it): nothing is ever estimated or filled in. The readers are
``saturate.hardware.gpu_sensors`` and ``saturate.hardware.host_sensors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def reason(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclass
class GpuReading:
    """One GPU at one moment. A None field was not measured; `missing` says why."""

    index: int  # the vendor tool's index (NVML/AMD SMI), or the torch index when mapped to one
    name: str
    util_pct: float | None = None  # share of the last sample period a kernel was running
    mem_used: int | None = None  # bytes, every process on the device
    mem_total: int | None = None  # bytes
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temp_c: float | None = None
    missing: dict[str, str] = field(default_factory=dict)  # field name -> why it was not measured


@dataclass
class HostReading:
    cpu_pct: float | None  # all cores, since the previous reading of this sampler
    cpu_count: int
    ram_total: int
    ram_used: int
    ram_available: int
    swap_total: int
    swap_used: int
    swap_in: int | None  # bytes swapped in since boot (Linux), to measure swapping over a window
    swap_out: int | None
    missing: dict[str, str] = field(default_factory=dict)


@dataclass
class ProcessReading:
    """The training process and its children (DataLoader workers)."""

    pid: int
    kind: str  # "pss" (proportional set size: shared pages split) or "rss" (shared pages counted per process)
    main_bytes: int | None  # the main process
    children_bytes: dict[int, int]  # child pid -> its private memory (USS) under "pss", its RSS under "rss"
    total_bytes: int | None  # the tree: PSS summed, so shared pages are counted once
    cpu_seconds: float | None  # user + system CPU time of the tree so far
    children_cpu_seconds: float | None = None  # the same, of the children (workers) alone
    missing: dict[str, str] = field(default_factory=dict)

