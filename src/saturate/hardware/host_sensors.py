"""Host sensors: RAM, swap and CPU of the machine, memory and CPU time of a process tree, the memory a job may use.

Read through ``psutil``, ``/proc`` and the cgroup files. Per-process proportional memory
(``/proc/PID/smaps_rollup``) costs a few milliseconds per process, so it is only read when asked
for (the doctor asks, training does not). A reading that cannot be taken (a permission error, a
worker that exited mid-read) is left as None with the reason in ``missing``.
"""

from __future__ import annotations

import os
import sys

import psutil

from saturate.hardware.readings import HostReading, ProcessReading, reason


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
        missing["cpu_pct"] = reason(e)
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
        missing["swap"] = reason(e)
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
        return ProcessReading(pid, "rss", None, {}, None, None, missing={"process": f"access denied: {reason(e)}"})
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
            missing[f"pid {proc.pid}"] = f"access denied: {reason(e)}"
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
