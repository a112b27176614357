"""One instrumented stretch of training: phases, syncs and telemetry, turned into Measurements.

Shared by the doctor's run of a preset (which hands `Instrument.timer` to the Stepper) and by
`Profiler` in a user's own loop (which calls `enter`/`leave` from hooks). A stretch has three
parts: warm-up (nothing measured), a few counted steps (syncs counted, nothing timed: the CPU
counter interposes on every torch call, which would distort the clock), then the timed steps.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from saturate.doctor.findings import Measurements
from saturate.doctor.phase_windows import per_window, split
from saturate.doctor.phases import PHASES, PhaseClock, SyncCounter
from saturate.doctor.trace import PhaseTrace, TraceFiles
from saturate.doctor.value_reads import ValueReads
from saturate.hardware import synchronize
from saturate.hardware.contention import Contention, ContentionMeter
from saturate.telemetry import Sampler, Snapshot, Stat, gpu_stat, host_memory_budget, host_stat, swap_traffic

SAMPLER_CPU_SHARE = 0.005  # the telemetry thread reads (smaps_rollup: ms) within 0.5 % of the CPU time


class Instrument:
    def __init__(self, device: torch.device, *, compiled: bool = False, interval: float = 0.25,
                 host_budget: int | None = None, telemetry: bool = True, optimizer_phase: bool = False) -> None:
        self.device = device
        self.clock = PhaseClock(device)
        self.counter = SyncCounter(device, compiled, optimizer_phase)
        # Reads every N steps, which the few counted steps miss, seen over the timed steps (not under compile: the
        # wrapped Tensor methods would be traced into the graph)
        self.reads = ValueReads(device, lambda: self.phase) if self.counter.available and not compiled else None
        self.mode = "idle"  # "idle", "count", "time" or "trace" (after the timed steps: trace.py)
        self.trace: PhaseTrace | None = None
        self.traced: TraceFiles | None = None  # what the trace wrote, once it ended
        self.phase = "other"
        self.interval = interval
        self.host_budget = host_budget
        self.telemetry = telemetry
        self.counted_steps = 0
        self.count_totals: list[int] = []  # syncs counted so far at the end of each counted step
        self.timed_steps = 0
        self.window_ends: list[int] = []  # timed steps at each window's end (doctor.phase_windows); empty: split after
        self.data_wall = 0.0
        self.data_cpu = 0.0
        self._data_start: tuple[float, float] | None = None
        self.sampler: Sampler | None = None
        self.snapshots: list[Snapshot] = []
        self.window_s = 0.0
        self._t0 = 0.0
        self.worker_pids: set[int] = set()
        self.notes: list[str] = []
        self._budget: tuple[int, str] | None = None
        self._mem_peak: int | None = None
        self._meter: ContentionMeter | None = None
        self.contention: Contention | None = None  # what other processes used over the timed window

    # --- phases ---------------------------------------------------------------------------------

    def enter(self, phase: str) -> bool:
        """Start `phase`; False (and nothing done) when another phase is already running."""
        if self.phase != "other":
            return False
        self.phase = phase
        self.counter.phase = phase
        if self.trace is not None:
            self.trace.enter(phase)
        if self.mode == "time":
            self.clock.mark(phase)
            if phase == "data":
                self._data_start = (time.perf_counter(), time.thread_time())
        return True

    def leave(self) -> None:
        if self.mode == "time":
            if self.phase == "data" and self._data_start is not None:
                wall, cpu = self._data_start
                self.data_wall += time.perf_counter() - wall
                self.data_cpu += time.thread_time() - cpu
                self._data_start = None
            self.clock.mark("other")
        if self.trace is not None:
            self.trace.leave()
        self.phase = "other"
        self.counter.phase = "other"

    @contextlib.contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """The Stepper's hook: `with timer("forward"): ...`."""
        entered = self.enter(phase)
        try:
            yield
        finally:
            if entered:
                self.leave()

    # --- stages -------------------------------------------------------------------------------

    def begin_count(self) -> None:
        self.mode = "count"
        self.counter.start()

    def end_count(self, steps: int) -> None:
        self.counter.stop()
        self.counted_steps = steps
        self.mode = "idle"

    def begin_timing(self) -> None:
        pid = os.getpid()
        if self.telemetry:
            index = self.device.index if self.device.index is not None else (
                torch.cuda.current_device() if self.device.type == "cuda" else None)
            self.sampler = Sampler(self.interval, torch_indices=[index] if index is not None else [],
                                   process_pid=pid, proportional=True, max_cpu_share=SAMPLER_CPU_SHARE)
            first = self.sampler.read_once()
            own = first.process.total_bytes if first.process and first.process.total_bytes else 0
            self._budget = ((self.host_budget, "given") if self.host_budget is not None
                            else host_memory_budget(own))
            self.sampler.start()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        synchronize(self.device)
        self.mode = "time"
        if self.reads is not None:
            self.reads.start()
        self._meter = ContentionMeter().start()
        self._t0 = time.perf_counter()

    def begin_step(self) -> None:
        if self.mode == "time":
            self.clock.begin_step()

    def begin_trace(self, trace: PhaseTrace) -> None:
        """After the timed steps: the next ones under torch.profiler, the phases as ranges, until `trace.steps`."""
        self.trace, self.mode = trace.start(), "trace"

    def end_trace(self) -> TraceFiles | None:
        """The trace ended (its steps done, or the run ended first) and written; None when none was taken."""
        if self.trace is not None:
            self.traced, self.trace, self.mode = self.trace.stop(), None, "idle"
        return self.traced

    def end_step(self) -> None:
        if self.mode == "trace" and self.trace is not None and self.trace.end_step():
            self.end_trace()
        if self.mode == "count":
            self.count_totals.append(self.counter.total())
        if self.mode == "time":
            self.clock.end_step()
            self.timed_steps += 1
            if self.reads is not None:
                self.reads.step += 1

    def step_seconds(self) -> list[float]:
        """Seconds of every timed step so far (synchronises the device)."""
        return [sum(s.values()) for s in self.clock.per_step()]

    def end_timing(self) -> None:
        if self.reads is not None:
            self.reads.stop()
        synchronize(self.device)
        self.window_s = time.perf_counter() - self._t0
        self.mode = "idle"
        if self._meter is not None:
            self.contention = self._meter.stop()
        if self.device.type == "cuda":
            self._mem_peak = int(torch.cuda.max_memory_reserved(self.device))
        if self.sampler is not None:
            self.sampler.read_once()
            self.sampler.stop()
            self.snapshots = list(self.sampler.snapshots)
            self.notes += self.sampler.errors

    def close(self) -> None:
        self.counter.stop()
        if self.reads is not None:
            self.reads.stop()
        if self.sampler is not None:
            self.sampler.stop()

    def _fold_reads(self, m: Measurements) -> None:
        """A line the timed steps read at a higher rate than the counted steps did (a read every N steps, which
        the counted ones fell between) counted at the timed steps' rate, with the steps that made one; reads no
        line was given for (a loop outside a script's hooks) against the counted steps' unplaced ones."""
        steps = self.timed_steps
        if self.reads is None or not steps:
            return
        assert m.syncs_per_step is not None
        unplaced = max(0.0, m.syncs_per_step - sum(m.syncs_by_site.values()))
        for site, (rate, made) in self.reads.by_site(steps).items():
            counted = m.syncs_by_site.get(site, 0.0) if site is not None else unplaced
            if rate <= counted:
                continue
            if site is not None:
                m.syncs_by_site[site] = rate
                m.syncs_seen[site] = (made, steps)
            m.syncs_per_step += rate - counted
            for phase, share in self.reads.phases_of(site).items():
                m.syncs_by_phase[phase] = m.syncs_by_phase.get(phase, 0.0) + share * (rate - counted)
        m.syncs_by_site = dict(sorted(m.syncs_by_site.items(), key=lambda kv: -kv[1]))

    # --- results -------------------------------------------------------------------------------

    def measurements(self, **context: Any) -> Measurements:
        """Measurements of the timed window; `context` fills the plan/loop fields (micro_batch, …)."""
        steps = self.timed_steps
        if steps < 1:
            raise ValueError("no timed step finished")
        per_step = self.clock.per_step()
        phases = {p: sum(s[p] for s in per_step) / steps for p in PHASES}
        ends = [e for e in self.window_ends if e <= len(per_step)] or split(len(per_step))
        window_shares, step_spread = per_window(per_step, ends)
        dev = self.device
        name = context.pop("device_name", None) or (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                                    else dev.type)
        device_type = context.pop("device_type", "rocm" if dev.type == "cuda" and torch.version.hip else dev.type)
        m = Measurements(device_type=device_type, device_name=name, timing=self.clock.kind, steps=steps,
                         step_s=self.window_s / steps, phases=phases, cpu_cores=_cores(),
                         cpu_threads=torch.get_num_threads(), window_shares=window_shares, step_spread=step_spread,
                         **context)
        # Synchronisations
        m.sync_method = self.counter.method
        if not self.counter.available:
            m.sync_missing = self.counter.missing
        elif self.counted_steps > 0:
            m.syncs_per_step = self.counter.total() / self.counted_steps
            m.syncs_by_phase = {k: v / self.counted_steps for k, v in self.counter.counts.items()}
            m.syncs_by_site = {k: v / self.counted_steps
                               for k, v in sorted(self.counter.sites.items(), key=lambda kv: -kv[1])}
            m.syncs_each_step = [float(b - a) for a, b in zip([0, *self.count_totals], self.count_totals, strict=False)]
            self._fold_reads(m)
        else:
            m.sync_missing = "no counted steps"
        # Telemetry
        snaps = self.snapshots
        if dev.type == "cuda":
            m.device_mem_peak = self._mem_peak
            m.device_mem_total = int(torch.cuda.get_device_properties(dev).total_memory)
            if snaps:
                m.device_util = gpu_stat(snaps, "util_pct")
                m.window_util = window_means(snaps, len(window_shares))
                used = gpu_stat(snaps, "mem_used")
                m.device_mem_used_peak = None if used.peak is None else int(used.peak)
            else:
                m.device_util = Stat(missing="telemetry off")
        elif dev.type == "cpu":
            m.device_util = Stat(missing="no GPU: the CPU is the device (see host CPU)")
        else:
            m.device_util = Stat(missing=f"no utilisation counter for {dev.type}")
        if snaps:
            m.host_cpu = host_stat(snaps, "cpu_pct")
            if m.host_cpu.samples == 1:  # a window too short for two readings: one reading is not a measurement
                m.host_cpu = Stat(missing=f"one reading in a {self.window_s:.2g} s window: too short to measure "
                                          "CPU use")
            m.host_ram_total = snaps[-1].host.ram_total
            m.host_ram_available_min = min(s.host.ram_available for s in snaps)
            m.swap_bytes, m.swap_missing = swap_traffic(snaps)
            self._fill_processes(m, snaps)
        else:
            m.swap_missing = "telemetry off"
        # Data production: the main thread's CPU use while it waited, or the workers' own.
        if m.phases.get("data", 0.0) > 0:
            workers = context.get("num_workers") or 0
            if workers == 0 and self.data_wall > 0:
                m.data_cpu_share = min(1.0, self.data_cpu / self.data_wall)
            elif workers > 0 and len(with_tree := [s for s in snaps if s.process is not None]) > 1:
                a, b = with_tree[0].process, with_tree[-1].process
                if a and b and a.children_cpu_seconds is not None and b.children_cpu_seconds is not None:
                    span = with_tree[-1].time - with_tree[0].time
                    if span > 0:
                        busy = b.children_cpu_seconds - a.children_cpu_seconds
                        m.data_cpu_share = min(1.0, busy / (span * workers))
        m.contention = contention_record(self.contention) if self.contention is not None else None
        m.notes += self.notes
        return m

    def _fill_processes(self, m: Measurements, snaps: list[Snapshot]) -> None:
        procs = [s.process for s in snaps if s.process is not None]
        totals = [p.total_bytes for p in procs if p.total_bytes is not None]
        if not totals:
            reasons = [r for p in procs for r in p.missing.values()]
            m.notes.append(f"the job's memory was not measured ({reasons[0] if reasons else 'no readings'})")
            return
        m.memory_kind = procs[-1].kind
        m.tree_peak = max(totals)
        mains = [p.main_bytes for p in procs if p.main_bytes is not None]
        m.main_peak = max(mains) if mains else None
        workers = [v for p in procs for pid, v in p.children_bytes.items() if pid in self.worker_pids]
        m.worker_peak = max(workers) if workers else None
        m.workers_seen = max((sum(pid in self.worker_pids for pid in p.children_bytes) for p in procs), default=0)
        if self._budget is not None:
            m.host_budget, m.host_budget_source = self._budget


def window_means(snaps: list[Snapshot], windows: int) -> list[float]:
    """The device's mean utilisation in each window: the samples cut into `windows` runs of consecutive samples
    (windows hold equal step counts, so about equal times; the sampler reads at a steady interval)."""
    if windows <= 1 or len(snaps) < windows:  # one window has no range
        return []
    size = len(snaps) / windows
    chunks = [snaps[round(i * size):round((i + 1) * size)] for i in range(windows)]
    return [v for c in chunks if (v := gpu_stat(c, "util_pct").mean) is not None]


def contention_record(c: Contention) -> dict[str, Any]:
    """A Contention as Measurements keeps it: plain JSON, with the line the report prints first."""
    return {**c.to_dict(), "line": c.line()}


def _cores() -> int:
    from saturate.hardware import usable_cores

    return usable_cores()[0]


def loader_worker_pids(iterator: Any) -> set[int]:
    """The process ids of a DataLoader iterator's workers (empty without workers)."""
    return {w.pid for w in getattr(iterator, "_workers", []) if getattr(w, "pid", None)}


def device_facts(dev: torch.device, hw: Any = None) -> dict[str, Any]:
    """What the doctor says about the device, as probe() sees it (the CLI doctor and the Profiler alike):
    its name (the GPU's, or the CPU's model) and whether it has native bf16 (a CPU with AVX-512 BF16/AMX too)."""
    if hw is None:
        from saturate.hardware import probe

        hw = probe(measure_peaks=False, device=str(dev))
    name = hw.devices[dev.index or 0].name if hw.devices and dev.type != "cpu" else hw.cpu_name
    return {"device_name": name, "supports_bf16": bool(hw.supports.get("bf16"))}
