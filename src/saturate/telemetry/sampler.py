"""The telemetry sampler: GPU and host readings in a background thread, and statistics over a window.

A ``Sampler`` reads the GPU sensors and the host (``saturate.hardware.gpu_sensors`` and
``host_sensors``) every ``interval`` seconds into a bounded history of ``Snapshot``s; ``gpu_stat``,
``host_stat`` and ``swap_traffic`` summarise a window of them. A figure not measured stays missing
with its reason, never 0. A reading of GPU and host counters costs a fraction of a millisecond
(see docs/benchmarks.md); a process tree's proportional memory (smaps_rollup) costs milliseconds, so a
sampler given `max_cpu_share` keeps those process readings within that share of the process's own CPU time
(on a busy machine a process gets less CPU per second: they slow down with it). The cheap GPU and host
readings are taken every interval regardless: a CUDA process that mostly waits on the GPU uses little CPU,
and capping its NVML readings with the rest left a doctor's window with too few utilisation samples
(measured: bench/results/h100-2026-11-23/README.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from saturate.hardware.gpu_sensors import GpuSource, open_gpu_source
from saturate.hardware.host_sensors import read_host, read_process_tree
from saturate.hardware.readings import GpuReading, HostReading, ProcessReading, reason


@dataclass
class Snapshot:
    time: float  # time.monotonic()
    wall: float  # time.time()
    host: HostReading
    gpus: list[GpuReading]
    gpu_note: str | None  # why there are no GPU readings, or what limits them
    process: ProcessReading | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The sampler


class Sampler:
    """Readings every `interval` seconds in a daemon thread, kept in a bounded history.

    gpu: a GpuSource, or None to open one for `torch_indices` (or every GPU when those are None).
    process_pid: also read this process tree (`proportional` memory: see read_process_tree).
    max_cpu_share: process-tree readings within this share of the process's CPU time (a snapshot between two
    of them has `process` None); the GPU and host are read every interval.
    """

    def __init__(self, interval: float = 1.0, *, gpu: GpuSource | None = None,
                 torch_indices: Sequence[int] | None = None, process_pid: int | None = None,
                 proportional: bool = False, history: int = 3600, max_cpu_share: float | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
        self.max_cpu_share = max_cpu_share
        self._own_gpu = gpu is None
        self.gpu = gpu if gpu is not None else open_gpu_source(torch_indices)
        self.process_pid = process_pid
        self.proportional = proportional
        self.snapshots: deque[Snapshot] = deque(maxlen=history)
        self.errors: list[str] = []  # unexpected failures of a whole reading (the thread survives them)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.read_seconds = 0.0  # thread CPU time spent reading, for the overhead benchmark
        self.reads = 0
        self.process_read_seconds = 0.0  # of which reading the process tree (what max_cpu_share caps)
        read_host(prime_cpu=True)  # psutil's CPU percentage needs a previous call
        self._cpu_read_at = time.monotonic()

    def read_once(self, process: bool = True) -> Snapshot:
        """One snapshot now; `process`: with the process tree's reading (when the sampler has a process)."""
        start = time.thread_time()
        host = read_host()
        now = time.monotonic()
        if now - self._cpu_read_at < 0.05 and host.cpu_pct is not None:
            # psutil measures CPU use since the previous call: over a few ms that is 0 or 100 %.
            host.cpu_pct = None
            host.missing["cpu_pct"] = "too soon after the previous reading to measure CPU use"
        self._cpu_read_at = now
        try:
            gpus = self.gpu.read()
        except Exception as e:  # a vendor library failing in a way it does not document
            gpus = []
            self.errors.append(f"GPU read failed: {reason(e)}")
        proc = None
        if process and self.process_pid is not None:
            proc_start = time.thread_time()
            proc = read_process_tree(self.process_pid, self.proportional)
            self.process_read_seconds += time.thread_time() - proc_start
        snap = Snapshot(time.monotonic(), time.time(), host, gpus, self.gpu.note, proc)
        with self._lock:
            self.snapshots.append(snap)
        self.read_seconds += time.thread_time() - start
        self.reads += 1
        return snap

    def _run(self) -> None:
        # a reading every `interval`; with max_cpu_share its process-tree part only once the process has used the
        # CPU time that makes those parts so far that share of it (readings taken before start() included)
        cpu_due = time.process_time() + self._cpu_debt(self.process_read_seconds)
        wait = self.interval if self.snapshots else 0.0  # a reading taken just before start() is not repeated
        while not self._stop.wait(wait):
            wait = self.interval
            with_process = time.process_time() >= cpu_due
            spent = self.process_read_seconds
            try:
                self.read_once(process=with_process)
            except Exception as e:  # never let a sensor kill the thread (or the training with it)
                self.errors.append(reason(e))
            if with_process:
                cpu_due = time.process_time() + self._cpu_debt(self.process_read_seconds - spent)

    def _cpu_debt(self, cost: float) -> float:
        """The process CPU seconds that a reading of `cost` CPU seconds must wait for (0 without a share)."""
        return cost / self.max_cpu_share if self.max_cpu_share else 0.0

    def start(self) -> Sampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="saturate-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval))
            self._thread = None
        if self._own_gpu:
            self.gpu.close()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self.snapshots[-1] if self.snapshots else None

    def between(self, start: float, end: float | None = None) -> list[Snapshot]:
        """Snapshots taken in [start, end] (time.monotonic() values)."""
        with self._lock:
            return [s for s in self.snapshots if s.time >= start and (end is None or s.time <= end)]


# ---------------------------------------------------------------------------------------------
# Summaries of a window


@dataclass
class Stat:
    """A measured figure over a window, or why there is none."""

    mean: float | None = None
    peak: float | None = None
    low: float | None = None
    samples: int = 0
    missing: str | None = None

    @classmethod
    def of(cls, values: list[float | None], reasons: list[str]) -> Stat:
        got = [v for v in values if v is not None]
        if not got:
            why = reasons[0] if reasons else "no readings in the window"
            return cls(missing=why)
        return cls(sum(got) / len(got), max(got), min(got), len(got))


def gpu_stat(snaps: list[Snapshot], attr: str, index: int | None = None) -> Stat:
    """A GPU field over the window, for one GPU (its reported index) or the first one read."""
    values, reasons = [], []
    for s in snaps:
        gpus = [g for g in s.gpus if index is None or g.index == index][:1]
        if not gpus:
            reasons.append(s.gpu_note or "no GPU readings")
            continue
        values.append(getattr(gpus[0], attr))
        if attr in gpus[0].missing:
            reasons.append(gpus[0].missing[attr])
    return Stat.of(values, reasons)


def host_stat(snaps: list[Snapshot], attr: str) -> Stat:
    reasons = [s.host.missing[attr] for s in snaps if attr in s.host.missing]
    return Stat.of([getattr(s.host, attr) for s in snaps], reasons)


def swap_traffic(snaps: list[Snapshot]) -> tuple[int | None, str | None]:
    """Bytes swapped in + out between the first and last snapshot, or (None, why)."""
    if len(snaps) < 2:
        return None, "fewer than two readings"
    a, b = snaps[0].host, snaps[-1].host
    if None in (a.swap_in, a.swap_out, b.swap_in, b.swap_out):
        return None, a.missing.get("swap_in") or b.missing.get("swap_in") or "swap counters unreadable"
    return (b.swap_in - a.swap_in) + (b.swap_out - a.swap_out), None  # type: ignore[operator]


def iter_gpu_indices(snaps: list[Snapshot]) -> Iterator[int]:
    seen: list[int] = []
    for s in snaps:
        for g in s.gpus:
            if g.index not in seen:
                seen.append(g.index)
                yield g.index


def window_means(snaps: list[Snapshot]) -> dict[str, float]:
    """Telemetry means over a window of snapshots, as metrics ("gpu/util_pct", "host/cpu_pct", …); a figure
    that was not read is left out."""
    out: dict[str, float] = {}
    if not snaps:
        return out
    gib = 1024**3
    for key, attr, scale in (("gpu/util_pct", "util_pct", 1.0), ("gpu/mem_used_gib", "mem_used", 1 / gib),
                             ("gpu/power_w", "power_w", 1.0), ("gpu/temp_c", "temp_c", 1.0),
                             ("gpu/sm_clock_mhz", "sm_clock_mhz", 1.0)):
        s = gpu_stat(snaps, attr)
        if s.mean is not None:
            out[key] = s.mean * scale
    cpu = host_stat(snaps, "cpu_pct")
    if cpu.mean is not None:
        out["host/cpu_pct"] = cpu.mean
    last = snaps[-1].host
    if last.ram_used is not None and last.ram_total:
        out["host/ram_used_pct"] = 100 * last.ram_used / last.ram_total
    if last.swap_used is not None:
        out["host/swap_used_gib"] = last.swap_used / gib
    return out
