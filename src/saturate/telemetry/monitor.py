"""`saturate monitor`: GPUs and host live, plus the running saturate job's own numbers.

Like `watch nvidia-smi`, refreshed about once a second: per GPU utilisation, memory used/total,
power against its limit, SM and memory clocks, temperature; the host's CPU, RAM and swap; and,
when a saturate training runs from this folder (its run.json names a live process), its step,
tokens/s and loss from metrics.jsonl. A figure that cannot be read is shown as "n/a" with the
reason listed under the table; nothing is filled in.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from saturate.hardware.gpu_sensors import GpuSource, open_gpu_source
from saturate.hardware.host_sensors import read_host
from saturate.hardware.readings import GpuReading, HostReading

_GIB = 1024**3


# --- the running job --------------------------------------------------------------------------


def _alive(pid: Any, started_before: float) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        # A recycled pid belongs to a process started after the run wrote run.json.
        return proc.is_running() and proc.create_time() <= started_before + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _last_record(path: Path, key: str, tail: int = 65536) -> dict[str, Any] | None:
    """The last JSON line of `path` holding `key` (only the file's last `tail` bytes are read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the first, cut line of the tail, or a line being written
        if isinstance(record, dict) and key in record:
            return record
    return None


def running_job(root: Path = Path("runs")) -> dict[str, Any] | None:
    """The newest saturate run under `root` whose training process is alive, with its latest numbers."""
    found = []
    for run_json in root.glob("*/run.json"):
        try:
            info = json.loads(run_json.read_text())
            mtime = run_json.stat().st_mtime
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(info, dict) and _alive(info.get("pid"), mtime):
            found.append((mtime, run_json.parent, info))
    if not found:
        return None
    _, run_dir, info = max(found, key=lambda f: f[0])
    job: dict[str, Any] = {"run_dir": str(run_dir), "pid": info.get("pid"), "workload": info.get("workload"),
                           "total_steps": info.get("total_steps")}
    metrics = run_dir / "metrics.jsonl"
    record = _last_record(metrics, "throughput/tokens_per_s")
    if record is None:
        job["note"] = "no training metrics logged yet"
        return job
    job.update(step=record.get("step"), tokens_per_s=record.get("throughput/tokens_per_s"),
               loss=record.get("train/loss"), mfu=record.get("throughput/mfu"))
    with contextlib.suppress(OSError):
        job["logged_s_ago"] = max(0.0, time.time() - metrics.stat().st_mtime)
    return job


# --- one reading ------------------------------------------------------------------------------


def reading(source: GpuSource, root: Path) -> dict[str, Any]:
    """One reading of every GPU, the host and the job, as plain JSON types."""
    host = read_host()
    gpus = source.read()
    return {
        "time": time.time(),
        "gpu_source": source.name,
        "gpu_note": source.note,
        "gpus": [asdict(g) for g in gpus],
        "host": asdict(host),
        "job": running_job(root),
    }


# --- rendering --------------------------------------------------------------------------------


def _na(r: GpuReading, field: str, text: str | None, notes: list[str]) -> str:
    if text is not None:
        return text
    why = r.missing.get(field, "not reported")
    if why not in notes:
        notes.append(why)
    return f"n/a[{notes.index(why) + 1}]"


def _with_unit(value: float | None, unit: str) -> str | None:
    return None if value is None else f"{value:.0f}{unit}"


def render(data: dict[str, Any], wide: bool = False) -> Group:
    """The monitor's screen for one reading (see `reading`): fits 80 columns; `wide` adds the clocks and
    the memory share."""
    gpus = [GpuReading(**g) for g in data["gpus"]]
    host = HostReading(**data["host"])
    notes: list[str] = []
    parts: list[Any] = []
    if gpus:
        t = Table(box=None, padding=(0, 1))
        clocks = ["SM clock", "mem clock"] if wide else []
        for col in ("GPU", "name", "util", "memory used/total", "power/limit", *clocks, "temp"):
            t.add_column(col, justify="left" if col in ("GPU", "name") else "right",
                         overflow="fold", no_wrap=col != "name")
        for r in gpus:
            mem = None
            if r.mem_used is not None and r.mem_total:
                share = f" ({100 * r.mem_used / r.mem_total:.0f} %)" if wide else ""
                mem = f"{r.mem_used / _GIB:.1f}/{r.mem_total / _GIB:.1f} GiB{share}"
            power = None
            if r.power_w is not None:
                limit = _na(r, "power_limit_w", _with_unit(r.power_limit_w, ""), notes)
                power = f"{r.power_w:.0f}/{limit} W"
            clock_cells = [_na(r, "sm_clock_mhz", _with_unit(r.sm_clock_mhz, " MHz"), notes),
                           _na(r, "mem_clock_mhz", _with_unit(r.mem_clock_mhz, " MHz"), notes)] if wide else []
            t.add_row(str(r.index), Text(r.name),
                      _na(r, "util_pct", _with_unit(r.util_pct, " %"), notes),
                      _na(r, "mem_used", mem, notes),
                      _na(r, "power_w", power, notes),
                      *clock_cells,
                      _na(r, "temp_c", _with_unit(r.temp_c, " °C"), notes))
        parts.append(t)
        if data.get("gpu_note"):
            parts.append(Text(f"note: {data['gpu_note']}", style="yellow"))
    else:
        parts.append(Text(data.get("gpu_note") or "no GPU found", style="yellow"))
    cpu = f"{host.cpu_pct:.0f} %" if host.cpu_pct is not None else f"n/a ({host.missing.get('cpu_pct', '?')})"
    swap = (f"{host.swap_used / _GIB:.1f} / {host.swap_total / _GIB:.1f} GiB" if host.swap_total
            else "none configured")
    parts.append(Text(f"host: CPU {cpu} of {host.cpu_count} cores · RAM {host.ram_used / _GIB:.1f} / "
                      f"{host.ram_total / _GIB:.1f} GiB ({100 * host.ram_used / host.ram_total:.0f} %) · swap {swap}"))
    job = data.get("job")
    if job is None:
        parts.append(Text("job: no saturate training running from this folder (runs/*/run.json)", style="dim"))
    elif "step" not in job:
        parts.append(Text(f"job: {job['run_dir']} (pid {job['pid']}): {job.get('note', '')}"))
    else:
        bits = [f"step {job['step']}/{job.get('total_steps') or '?'}"]
        if job.get("tokens_per_s") is not None:
            bits.append(f"{job['tokens_per_s']:,.0f} tokens/s")
        if job.get("mfu") is not None:
            bits.append(f"MFU {100 * job['mfu']:.1f} %")
        if job.get("loss") is not None:
            bits.append(f"loss {job['loss']:.4f}")
        if job.get("logged_s_ago") is not None:
            bits.append(f"logged {job['logged_s_ago']:.0f} s ago")
        parts.append(Text(f"job: {job['run_dir']} (pid {job['pid']}): " + " · ".join(bits)))
    for i, n in enumerate(notes, 1):
        parts.append(Text(f"[{i}] {n}", style="dim"))
    return Group(*parts)


def run_monitor(*, once: bool = False, as_json: bool = False, interval: float = 1.0, root: Path = Path("runs"),
                console: Console | None = None, max_updates: int | None = None, wide: bool = False) -> int:
    """The `saturate monitor` command: a live view, or JSON lines with `as_json`; `once` reads once.

    `max_updates` bounds the number of refreshes (for tests); Ctrl-C ends the view.
    """
    console = console or Console(highlight=False)
    source = open_gpu_source(None)
    try:
        read_host(prime_cpu=True)
        time.sleep(min(interval, 0.5))  # CPU use is measured between two readings
        updates = 0
        if once or as_json:
            while True:
                data = reading(source, root)
                if as_json:
                    print(json.dumps(data, indent=2 if once else None), flush=True)
                else:
                    console.print(render(data, wide))
                updates += 1
                if once or (max_updates is not None and updates >= max_updates):
                    return 0
                time.sleep(interval)
        with Live(render(reading(source, root), wide), console=console, refresh_per_second=4) as live:
            while max_updates is None or updates < max_updates:
                time.sleep(interval)
                live.update(render(reading(source, root), wide))
                updates += 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        source.close()
