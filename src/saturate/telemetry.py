"""Telemetry: GPU and host readings, once or in a background thread.

GPUs are read through NVML (``nvidia-ml-py``) or AMD SMI (``amdsmi``, when installed); the host
and the training process tree through ``psutil`` and ``/proc``. A reading that cannot be taken
(no GPU, NVML missing or failing, a sensor the driver does not expose, a permission error, a
worker that exited mid-read) is left as ``None`` with the reason in ``missing``: nothing here is
ever estimated or filled in.

The sampler costs a fraction of a millisecond per reading of GPU and host counters (see
docs/benchmarks.md); per-process proportional memory (``/proc/PID/smaps_rollup``) costs a few
milliseconds per process, so it is only read when asked for (the doctor asks, training does not).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

_MIB = 1024**2


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Readings


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
# GPU sources


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
            names[index] = f"{kind} {index} (name unreadable: {_reason(e)})"
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
            take = _sensor_reader(r, Exception, lambda e: f"AMD SMI: {_reason(e)}")

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
        from saturate.hardware import _normalise_uuid, _uuid_of

        by_uuid = {_normalise_uuid(_text(pynvml.nvmlDeviceGetUUID(h))): h for h in all_handles}
        chosen, notes = [], []
        for i in torch_indices:
            uuid = _uuid_of(props[i]) if i < len(props) else None
            handle = by_uuid.get(_normalise_uuid(uuid)) if uuid else None
            if handle is None:
                notes.append(f"NVML has no device matching cuda:{i} (a MIG slice?)")
            else:
                chosen.append((i, handle))
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
        return GpuSource(f"AMD SMI unavailable ({_reason(e)})")
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
# Host and process tree


def read_host(prime_cpu: bool = False) -> HostReading:
    """System RAM, swap and CPU. `cpu_pct` covers the time since the previous psutil CPU read."""
    missing: dict[str, str] = {}
    vm = psutil.virtual_memory()
    cpu: float | None = None
    try:
        cpu = psutil.cpu_percent(interval=None)
        if prime_cpu:
            cpu = None
            missing["cpu_pct"] = "first reading (CPU use is measured between two readings)"
    except (OSError, psutil.Error) as e:
        missing["cpu_pct"] = _reason(e)
    swap_total = swap_used = 0
    swap_in: int | None = None
    swap_out: int | None = None
    try:
        sw = psutil.swap_memory()
        swap_total, swap_used = int(sw.total), int(sw.used)
        if sys.platform.startswith("linux"):
            swap_in, swap_out = int(sw.sin), int(sw.sout)
        else:
            missing["swap_in"] = missing["swap_out"] = "swap traffic is only counted on Linux"
    except (OSError, psutil.Error, RuntimeError) as e:
        missing["swap"] = _reason(e)
    return HostReading(
        cpu_pct=cpu, cpu_count=psutil.cpu_count() or 1, ram_total=int(vm.total), ram_used=int(vm.total - vm.available),
        ram_available=int(vm.available), swap_total=swap_total, swap_used=swap_used, swap_in=swap_in,
        swap_out=swap_out, missing=missing,
    )


def _smaps_rollup(pid: int) -> dict[str, int]:
    """Pss / Private_* / Rss of one process in bytes, from /proc/PID/smaps_rollup (Linux ≥ 4.14)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def read_process_tree(pid: int, proportional: bool = False) -> ProcessReading:
    """Memory and CPU time of process `pid` and its children.

    proportional=True reads PSS (main, and summed over the tree) and each child's private
    memory (USS), which counts pages shared by fork or a memory-mapped corpus once; otherwise
    RSS, cheap but counting shared pages in every process.
    """
    missing: dict[str, str] = {}
    try:
        main = psutil.Process(pid)
        children = main.children(recursive=True)
    except psutil.NoSuchProcess:
        return ProcessReading(pid, "rss", None, {}, None, None, missing={"process": f"process {pid} has ended"})
    except psutil.AccessDenied as e:
        return ProcessReading(pid, "rss", None, {}, None, None, missing={"process": f"access denied: {_reason(e)}"})
    kind = "pss" if proportional and os.path.exists(f"/proc/{pid}/smaps_rollup") else "rss"
    if proportional and kind == "rss":
        missing["pss"] = "no /proc/PID/smaps_rollup on this system; RSS counts shared pages in every process"
    main_bytes: int | None = None
    total: int | None = 0
    cpu: float | None = 0.0
    per_child: dict[int, int] = {}
    children_cpu = 0.0
    for proc in [main, *children]:
        try:
            if kind == "pss":
                smaps = _smaps_rollup(proc.pid)
                own = smaps.get("Pss", 0)
                private = smaps.get("Private_Clean", 0) + smaps.get("Private_Dirty", 0)
            else:
                own = private = int(proc.memory_info().rss)
            times = proc.cpu_times()
            if cpu is not None:
                cpu += times.user + times.system
            if proc.pid != pid:
                children_cpu += times.user + times.system
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            if proc.pid == pid:
                return ProcessReading(pid, kind, None, {}, None, None, missing={"process": f"process {pid} has ended"})
            missing[f"child {proc.pid}"] = "ended during sampling"  # a worker that finished: not counted
            continue
        except (psutil.AccessDenied, PermissionError) as e:
            missing[f"pid {proc.pid}"] = f"access denied: {_reason(e)}"
            total = None if proc.pid == pid else total
            continue
        if proc.pid == pid:
            main_bytes = own
        else:
            per_child[proc.pid] = private
        if total is not None:
            total += own
    return ProcessReading(pid, kind, main_bytes, per_child, total if main_bytes is not None else None, cpu,
                          children_cpu, missing)


# ---------------------------------------------------------------------------------------------
# The sampler


class Sampler:
    """Readings every `interval` seconds in a daemon thread, kept in a bounded history.

    gpu: a GpuSource, or None to open one for `torch_indices` (or every GPU when those are None).
    process_pid: also read this process tree (`proportional` memory: see read_process_tree).
    """

    def __init__(self, interval: float = 1.0, *, gpu: GpuSource | None = None,
                 torch_indices: Sequence[int] | None = None, process_pid: int | None = None,
                 proportional: bool = False, history: int = 3600) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
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
        read_host(prime_cpu=True)  # psutil's CPU percentage needs a previous call
        self._cpu_read_at = time.monotonic()

    def read_once(self) -> Snapshot:
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
            self.errors.append(f"GPU read failed: {_reason(e)}")
        proc = read_process_tree(self.process_pid, self.proportional) if self.process_pid is not None else None
        snap = Snapshot(time.monotonic(), time.time(), host, gpus, self.gpu.note, proc)
        with self._lock:
            self.snapshots.append(snap)
        self.read_seconds += time.thread_time() - start
        self.reads += 1
        return snap

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.read_once()
            except Exception as e:  # never let a sensor kill the thread (or the training with it)
                self.errors.append(_reason(e))
            self._stop.wait(self.interval)

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


# ---------------------------------------------------------------------------------------------
# The host memory a job may use


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, current usage) of this process's memory cgroup in bytes, or Nones where none is set."""
    limit = _read_int("/sys/fs/cgroup/memory.max")  # v2; "max" reads as None
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory.current")
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1; "no limit" is a huge number
    if limit is not None and limit < 2**60:
        return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return None, None


def host_memory_budget(own_bytes: int) -> tuple[int, str]:
    """The host memory a job using `own_bytes` now may grow to without pushing anything into swap.

    The RAM available now plus what the job already holds, capped by a container's memory limit.
    """
    available = int(psutil.virtual_memory().available)
    budget, source = own_bytes + available, "RAM available at the start plus what this job already used"
    limit, usage = cgroup_memory()
    if limit is not None:
        others = max(0, (usage or 0) - own_bytes)
        if limit - others < budget:
            budget, source = limit - others, "the container's memory limit (cgroup) less what other processes in it use"
    return budget, source
