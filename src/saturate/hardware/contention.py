"""What else is using the machine while saturate measures: other processes' share of the CPU cores and GPUs.

A trial timed while another job takes one of two cores is measured at half speed, and a verdict
taken then blames the workload for the neighbour. ``ContentionMeter`` brackets a measurement:
``start()`` before, ``stop()`` after, and the ``Contention`` it returns says how many of our usable
cores other processes kept busy in between (the cores' busy time from /proc/stat through psutil,
minus the CPU time of this job's process tree, children and reaped children included: under torchrun every
local rank's, `job_root`) and which
other processes hold a GPU we use (NVML's compute-process list). Nothing runs in between, so a
meter costs two reads.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from saturate.hardware.cpu import usable_cores
from saturate.hardware.readings import reason
from saturate.policy import Load

# The kernel's CPU time counters (/proc/stat, a process's times) tick every 10 ms (USER_HZ 100): over a shorter
# window than this a reading is a few ticks either way — a 9 ms doctor window once read "2.0 of 2 cores busy" on
# a quiet machine — so the CPU share is not read at all (the GPU's process list still is).
MIN_READ_S = 0.25


def job_root() -> int:
    """The process whose tree is this job, to tell its own CPU use from the neighbours': under torchrun (or a
    launcher built on it, such as `accelerate launch`: `TORCHELASTIC_RUN_ID` is set, or several ranks share the
    machine) the agent that started every local rank, so a sibling rank is this job and never a neighbour;
    otherwise this process."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    if os.environ.get("TORCHELASTIC_RUN_ID") or (local.isdigit() and int(local) > 1):
        return os.getppid()
    return os.getpid()


def _cores_in_use() -> list[int] | None:
    """The CPU indices this process may run on, or None where the affinity mask cannot be read."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def _busy_seconds(cpus: list[int] | None) -> float:
    """Busy (non-idle, non-iowait) seconds summed over these CPUs since boot."""
    per_cpu = psutil.cpu_times(percpu=True)
    chosen = [per_cpu[i] for i in cpus if i < len(per_cpu)] if cpus else per_cpu
    if not chosen:
        chosen = per_cpu
    busy = 0.0
    for t in chosen:
        idle = t.idle + getattr(t, "iowait", 0.0)
        busy += sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return busy


def _tree_cpu_seconds(root_pid: int) -> float:
    """CPU seconds of a process and its living descendants, their reaped children included."""
    total = 0.0
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _tree_pids(root_pid: int) -> set[int]:
    try:
        root = psutil.Process(root_pid)
        return {root_pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return {root_pid}


def other_gpu_processes(root_pid: int | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """Compute processes on this machine's NVIDIA GPUs that are not in our process tree.

    Returns (processes, note). In a container NVML reports the host's PIDs, which do not exist
    here; those are skipped and the note says so rather than count our own job as a neighbour.
    """
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py not installed: GPU neighbours not checked"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable ({exc}): GPU neighbours not checked"
    ours = _tree_pids(root_pid if root_pid is not None else os.getpid())
    found: list[dict[str, Any]] = []
    unmapped = 0
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                pid = int(proc.pid)
                if pid in ours:
                    continue
                if not psutil.pid_exists(pid):
                    unmapped += 1
                    continue
                name = "?"
                with contextlib.suppress(psutil.Error):
                    name = psutil.Process(pid).name()
                used = getattr(proc, "usedGpuMemory", None)
                found.append({"gpu": index, "pid": pid, "name": name,
                              "memory_mib": int(used) // 2**20 if isinstance(used, int) else None})
    except pynvml.NVMLError as exc:
        return found, f"NVML process list unreadable: {reason(exc)}"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    note = (f"{unmapped} GPU process(es) with PIDs outside this container could not be told apart from ours"
            if unmapped else None)
    return found, note


@dataclass
class Contention:
    """Other processes' use of the machine over one measured window."""

    seconds: float
    usable_cores: int
    other_cores: float | None  # mean cores other processes kept busy on our CPUs
    own_cores: float | None  # mean cores our own process tree used
    gpu_neighbours: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def other_share(self) -> float | None:
        """Other processes' busy cores as a share of our usable cores."""
        if self.other_cores is None:
            return None
        return self.other_cores / max(self.usable_cores, 1)

    def significant(self) -> bool:
        """True when the neighbours could move a throughput figure by more than a few percent."""
        if self.gpu_neighbours:
            return True
        if self.other_cores is None:
            return False
        return Load(self.other_cores, self.usable_cores).busy  # POLICY.load: busy_cores, busy_share

    def line(self) -> str:
        """One line for the top of a report: what else was running, measured."""
        parts = []
        if self.other_cores is not None:
            parts.append(f"other processes kept {self.other_cores:.1f} of {self.usable_cores} usable "
                         f"CPU cores busy ({100 * (self.other_share or 0):.0f} %)")
        if self.gpu_neighbours:
            names = ", ".join(f"{p['name']} (pid {p['pid']}, GPU {p['gpu']})" for p in self.gpu_neighbours[:3])
            more = f" and {len(self.gpu_neighbours) - 3} more" if len(self.gpu_neighbours) > 3 else ""
            parts.append(f"other processes on the GPU: {names}{more}")
        if not parts:
            return "contention not measured: " + "; ".join(self.notes or ["no reading"])
        head = "machine busy" if self.significant() else "machine quiet"
        return f"{head}: " + "; ".join(parts) + f" over {self.seconds:.1f} s"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["other_share"] = self.other_share
        out["significant"] = self.significant()
        return out


class _TooShort(Exception):
    """A window too short for the CPU time counters to resolve."""


class ContentionMeter:
    """Brackets a measurement: ``start()`` before it, ``stop()`` after, for what others used meanwhile."""

    def __init__(self, root_pid: int | None = None, *, gpu: bool = True) -> None:
        self.root_pid = job_root() if root_pid is None else root_pid  # whose CPU time is ours: this job's tree
        self.gpu = gpu
        self._cpus = _cores_in_use()
        self._start: tuple[float, float, float] | None = None

    def start(self) -> ContentionMeter:
        self._start = (time.perf_counter(), _busy_seconds(self._cpus), _tree_cpu_seconds(self.root_pid))
        return self

    def stop(self) -> Contention:
        if self._start is None:
            raise RuntimeError("ContentionMeter.stop() before start()")
        t0, busy0, own0 = self._start
        seconds = max(time.perf_counter() - t0, 1e-9)
        cores, _ = usable_cores()
        notes: list[str] = []
        other: float | None
        own: float | None
        try:
            if seconds < MIN_READ_S:
                raise _TooShort(f"a {seconds:.2f} s window is shorter than the {MIN_READ_S:g} s the CPU time "
                                "counters (10 ms ticks) resolve")
            busy = _busy_seconds(self._cpus) - busy0
            own_s = _tree_cpu_seconds(self.root_pid) - own0
            own = max(own_s, 0.0) / seconds
            # Our own threads may run on CPUs outside the mask we read only when the mask changed
            # meanwhile; clamp so rounding never reports negative neighbours.
            other = min(max(busy - own_s, 0.0) / seconds, float(len(self._cpus or []) or cores))
        except _TooShort as exc:
            other = own = None
            notes.append(f"CPU share not read: {exc}")
        except (OSError, psutil.Error) as exc:
            other = own = None
            notes.append(f"CPU times unreadable: {reason(exc)}")
        neighbours: list[dict[str, Any]] = []
        if self.gpu:
            neighbours, note = other_gpu_processes(self.root_pid)
            if note and not note.startswith(("nvidia-ml-py", "NVML unavailable")):  # no GPU: nothing to say
                notes.append(note)
        return Contention(seconds=seconds, usable_cores=cores, other_cores=other, own_cores=own,
                          gpu_neighbours=neighbours, notes=notes)


def measure_contention(seconds: float = 1.0, root_pid: int | None = None) -> Contention:
    """What other processes use over `seconds` of our own idleness (a quick check before measuring)."""
    meter = ContentionMeter(root_pid).start()
    time.sleep(seconds)
    return meter.stop()
