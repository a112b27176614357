"""The verdict: a pure function of measurements -> one verdict, its evidence, ranked fixes.

Nothing here measures or reads the machine, so every rule is testable on constructed numbers.
The rules:

1. at risk of OOM        device memory peak ≥ 92 % of the device (accelerators)
2. host-memory-bound     swapping during the run, host RAM under 5 % free, or the job's processes
                         over 90 % of its host-memory budget
3. input-bound           waiting for data (plus, on an accelerator, host-to-device copies) ≥ 15 %
                         of the step
4. synchronisation-bound ≥ 1 host-device sync per step while the device is idle ≥ 15 % of the
                         time (accelerators; a sync costs nothing on a CPU, where reads are
                         reported as a note, never as the verdict)
5. launch/overhead-bound the fixed cost of a micro-step (from the batch-scaling probe) is ≥ 50 %
                         of its forward+backward, or, without a probe, the device is idle ≥ 40 %
                         with no data wait and no sync to blame
6. device memory under-used  peak < 50 % of the device and a larger micro-batch that fits is
                         predicted ≥ 10 % faster
7. compute-bound (healthy), when none of the above holds.

The memory risks (1, 2) win whenever they hold. Otherwise, of the rules that hold, the verdict is
the one whose best fix (keeping the training the same) is predicted to gain the most, ties going
to the order above: a tiny model at micro-batch 1 also waits a little for each of its many
batches, but it is the per-micro-step cost, not the data, that a fix removes. The other rules
that hold are listed as further findings.

Predictions are labelled as such and say how they were made. A fix with no model behind it
carries no number ("not predicted").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from saturate.telemetry import Stat

VERDICTS = {
    "oom-risk": "at risk of OOM",
    "host-memory-bound": "host-memory-bound",
    "input-bound": "input-bound",
    "sync-bound": "synchronisation-bound",
    "overhead-bound": "launch/overhead-bound",
    "device-memory-underused": "device memory under-used",
    "compute-bound": "compute-bound (healthy)",
}

OOM_SHARE = 0.92
HOST_FREE_MIN = 0.05
BUDGET_SHARE = 0.90
SWAP_BYTES = 64 * 1024**2
INPUT_SHARE = 0.15
IDLE_SHARE = 0.15
FIXED_SHARE = 0.50
IDLE_NO_PROBE = 0.40
MEMORY_LOW = 0.50
MEMORY_TARGET = 0.80  # a larger micro-batch is proposed only while predicted peak stays under this
GAIN_MIN = 1.10
_GIB = 1024**3


@dataclass
class ScalingProbe:
    """Forward+backward time (and device memory) of one micro-step at two micro-batch sizes."""

    micro_batches: tuple[int, int]
    seconds: tuple[float, float]
    peak_memory: tuple[int | None, int | None] = (None, None)  # device bytes; None on the CPU

    @property
    def per_sample_s(self) -> float:
        (b1, b2), (t1, t2) = self.micro_batches, self.seconds
        return max(0.0, (t2 - t1) / (b2 - b1))

    @property
    def fixed_s(self) -> float:
        """The part of a micro-step that does not grow with the batch (launches, Python, framework)."""
        return max(0.0, self.seconds[0] - self.per_sample_s * self.micro_batches[0])

    def time_at(self, b: int) -> float:
        return self.fixed_s + self.per_sample_s * b

    def fixed_share(self, b: int) -> float:
        t = self.time_at(b)
        return self.fixed_s / t if t > 0 else 0.0

    def memory_at(self, b: int) -> float | None:
        (b1, b2), (m1, m2) = self.micro_batches, self.peak_memory
        if m1 is None or m2 is None:
            return None
        slope = max(0.0, (m2 - m1) / (b2 - b1))
        return m1 + slope * (b - b1)


@dataclass
class Measurements:
    """Everything one instrumented stretch of training measured. None = not measured (see notes)."""

    device_type: str  # "cpu", "cuda", "rocm", "mps"
    device_name: str
    timing: str  # how phases were timed
    steps: int  # optimizer steps timed
    step_s: float  # wall seconds per optimizer step over the timed window
    phases: dict[str, float]  # seconds per step by phase (sums to about step_s)
    context: str = "plan"  # "plan" (a saturate preset) or "loop" (a user's own loop)
    samples_per_step: float | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None  # micro-steps (loader batches) per optimizer step
    num_workers: int | None = None
    prefetch_factor: int | None = None
    pin_memory: bool | None = None
    non_blocking: bool | None = None
    precision: str | None = None
    compile: str | None = None
    supports_bf16: bool | None = None
    syncs_per_step: float | None = None
    syncs_by_phase: dict[str, float] = field(default_factory=dict)
    sync_method: str = ""
    sync_missing: str | None = None
    device_util: Stat = field(default_factory=lambda: Stat(missing="not sampled"))  # percent
    device_mem_peak: int | None = None  # bytes the process reserved on the device at peak (torch)
    device_mem_total: int | None = None
    device_mem_used_peak: int | None = None  # NVML/AMD SMI: all processes on the device
    host_ram_total: int | None = None
    host_ram_available_min: int | None = None
    host_cpu: Stat = field(default_factory=lambda: Stat(missing="not sampled"))  # percent of all cores
    swap_bytes: int | None = None  # swapped in + out during the window
    swap_missing: str | None = None
    tree_peak: int | None = None  # the training process + workers at peak
    main_peak: int | None = None
    worker_peak: int | None = None  # the largest single worker's own memory at peak
    workers_seen: int = 0
    memory_kind: str = "pss"
    host_budget: int | None = None
    host_budget_source: str = ""
    data_cpu_share: float | None = None  # main-thread CPU time ÷ wall time while waiting for data
    item_s: float | None = None  # seconds per extra sample of a batch read and collated in the training process
    cpu_cores: int = 1
    cpu_threads: int | None = None  # torch intra-op threads of the training process
    scaling: ScalingProbe | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def accelerator(self) -> bool:
        return self.device_type in ("cuda", "rocm", "mps")

    def share(self, *phases: str) -> float:
        return sum(self.phases.get(p, 0.0) for p in phases) / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Prediction:
    """A predicted figure after a fix. `after` None: no model predicts it ("not predicted")."""

    metric: str  # "step_s", "sample_s" (seconds per sample), "host_bytes" or "device_bytes"
    before: float
    after: float | None
    basis: str  # how the prediction was made

    @property
    def gain(self) -> float | None:
        """Speed-up (step_s) or reduction factor (memory): before ÷ after; > 1 is better."""
        if self.after is None or self.after <= 0:
            return None
        return self.before / self.after


@dataclass
class Fix:
    title: str
    changes: dict[str, Any]  # plan fields to change; empty for a change to the user's code
    prediction: Prediction
    why: str
    same_training: bool = True  # False: the fix changes what is learned (e.g. the effective batch)


@dataclass
class Finding:
    verdict: str  # a VERDICTS key, or "note" for something worth saying that is no verdict
    evidence: list[str]
    fixes: list[Fix] = field(default_factory=list)


@dataclass
class Diagnosis:
    verdict: str  # a VERDICTS key
    evidence: list[str]
    fixes: list[Fix]  # ranked: the verdict's fixes by predicted gain, then the other findings'
    findings: list[Finding]  # every rule that held, the verdict's first, plus notes
    measurements: Measurements

    @property
    def label(self) -> str:
        return VERDICTS[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["label"] = self.label
        for fix in out["fixes"]:
            p = fix["prediction"]
            p["gain"] = None if p["after"] in (None, 0) else p["before"] / p["after"]
        return out


# ---------------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _gib(x: float | None) -> str:
    return "?" if x is None else f"{x / _GIB:.2f} GiB"


def _ms(x: float) -> str:
    return f"{1000 * x:.1f} ms"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _knob(m: Measurements, field_name: str) -> str:
    """How a plan field is called where the user changes it."""
    if m.context == "loop":
        return {"micro_batch": "DataLoader batch_size", "num_workers": "DataLoader num_workers",
                "prefetch_factor": "DataLoader prefetch_factor", "pin_memory": "DataLoader pin_memory",
                "grad_accum": "accumulation steps", "precision": "precision", "non_blocking": ".to(non_blocking)",
                "compile": "torch.compile"}.get(field_name, field_name)
    return f"plan.{field_name}"


def _micro_cost(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """Predicted seconds of one micro-step of `b2` samples, by a model calibrated on this run.

    Forward+backward as timed in this run, scaled by the probe's fit T(b2)/T(b); the data wait
    split into the loader's per-batch cost and `item_s` per sample (without workers; with workers
    the wait per sample is kept); the copy per sample on an accelerator, per micro-step on the CPU
    (a no-op call there); "other" per micro-step. At b2 = b this is the measured micro-step.
    """
    b, accum = m.micro_batch or 1, m.grad_accum or 1
    fb = (m.phases.get("forward", 0.0) + m.phases.get("backward", 0.0)) / accum
    t_b = probe.time_at(b)
    fb2 = fb * probe.time_at(b2) / t_b if t_b > 0 else probe.time_at(b2)
    data = m.phases.get("data", 0.0) / accum
    if not m.num_workers and m.item_s is not None:
        data2 = max(0.0, data - m.item_s * b) + m.item_s * b2
    else:
        data2 = data * b2 / b
    h2d = m.phases.get("h2d", 0.0) / accum
    h2d2 = h2d * b2 / b if m.accelerator else h2d
    return fb2 + data2 + h2d2 + m.phases.get("other", 0.0) / accum


def _micro_step_model(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """Predicted seconds per optimizer step at micro-batch `b2`, the effective batch kept."""
    effective = (m.micro_batch or 1) * (m.grad_accum or 1)
    return m.phases.get("optimizer", 0.0) + (effective // b2) * _micro_cost(m, probe, b2)


def _step_at(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """The measured step time moved by the model's difference between micro-batch b2 and the current one."""
    return m.step_s - _micro_step_model(m, probe, m.micro_batch or 1) + _micro_step_model(m, probe, b2)


def _micro_batch_fix(m: Measurements, probe: ScalingProbe, why: str) -> Fix | None:
    """The best larger micro-batch at the same effective batch, if the probe predicts a gain."""
    b, accum = m.micro_batch, m.grad_accum
    if not b or not accum or accum < 2:
        return None
    effective = b * accum
    best: tuple[float, int] | None = None
    for b2 in _divisors(effective):
        if b2 <= b:
            continue
        if m.accelerator:
            mem = probe.memory_at(b2)
            if mem is None or m.device_mem_total is None or mem > MEMORY_TARGET * m.device_mem_total:
                continue
        step = _step_at(m, probe, b2)
        if best is None or step < best[0] - 1e-12:
            best = (step, b2)
    if best is None or best[0] >= m.step_s:
        return None
    step, b2 = best
    mem_note = ""
    if m.accelerator and (mem := probe.memory_at(b2)) is not None:
        mem_note = f"; predicted device memory {_gib(mem)} of {_gib(m.device_mem_total)}"
    item = (f", {1e6 * m.item_s:.0f} µs to read and collate a sample" if m.item_s is not None and not m.num_workers
            else "")
    basis = (f"forward+backward as timed, scaled by a fit over micro-batch {probe.micro_batches[0]} and "
             f"{probe.micro_batches[1]} ({_ms(probe.fixed_s)} fixed + {_ms(probe.per_sample_s)} per sample); the "
             f"loader, copy and other costs per micro-step as measured{item}{mem_note}")
    return Fix(f"micro-batch {b} → {b2}, accumulation {accum} → {effective // b2} (same effective batch)",
               {"micro_batch": b2, "grad_accum": effective // b2},
               Prediction("step_s", m.step_s, step, basis), why)


def _check_oom(m: Measurements) -> Finding | None:
    if not m.accelerator or not m.device_mem_total:
        return None
    share = (m.device_mem_peak or 0) / m.device_mem_total
    used = (m.device_mem_used_peak or 0) / m.device_mem_total
    if share < OOM_SHARE and used < 0.95:
        return None
    evidence = [f"device memory peak {_gib(m.device_mem_peak)} reserved by this process = {_pct(share)} of "
                f"{_gib(m.device_mem_total)}"]
    if m.device_mem_used_peak is not None:
        evidence.append(f"all processes on the device: {_gib(m.device_mem_used_peak)} at peak ({_pct(used)})")
    fixes = []
    b, accum = m.micro_batch, m.grad_accum
    if b and accum and b > 1:
        effective = b * accum
        smaller = max(d for d in _divisors(effective) if d <= b // 2) if b // 2 >= 1 else 1
        mem = m.scaling.memory_at(smaller) if m.scaling else None
        step = None
        basis = "not predicted: no batch-scaling probe"
        if m.scaling:
            step = _step_at(m, m.scaling, smaller)
            basis = "linear fits of memory and time over the probed micro-batches"
        before = float(m.device_mem_peak or 0)
        fixes.append(Fix(f"micro-batch {b} → {smaller}, accumulation {accum} → {effective // smaller}",
                         {"micro_batch": smaller, "grad_accum": effective // smaller},
                         Prediction("device_bytes", before, mem, basis),
                         "halves the activations held at once; the effective batch is unchanged"
                         + (f" (predicted step time {_ms(step)})" if step else "")))
    fixes.append(Fix("activation checkpointing", {"activation_checkpointing": True},
                     Prediction("device_bytes", float(m.device_mem_peak or 0), None, "not predicted: needs a trial"),
                     "recomputes each block's activations in backward: less memory for ~30 % more compute"))
    return Finding("oom-risk", evidence, fixes)


def _check_host_memory(m: Measurements) -> Finding | None:
    reasons = []
    if m.swap_bytes is not None and m.swap_bytes >= SWAP_BYTES:
        reasons.append(f"{m.swap_bytes / 1024**2:.0f} MiB swapped in and out during the run")
    if m.host_ram_total and m.host_ram_available_min is not None:
        free = m.host_ram_available_min / m.host_ram_total
        if free < HOST_FREE_MIN:
            reasons.append(f"host RAM available fell to {_gib(m.host_ram_available_min)} ({_pct(free)} of "
                           f"{_gib(m.host_ram_total)})")
    over_budget = (m.tree_peak is not None and m.host_budget is not None
                   and m.tree_peak > BUDGET_SHARE * m.host_budget)
    if over_budget:
        reasons.append(f"the job's processes peaked at {_gib(m.tree_peak)} ({m.memory_kind.upper()}) against a "
                       f"host-memory budget of {_gib(m.host_budget)} ({m.host_budget_source})")
    if not reasons:
        return None
    evidence = list(reasons)
    if m.workers_seen and m.worker_peak is not None:
        evidence.append(f"{m.workers_seen} loader worker(s), the largest holding {_gib(m.worker_peak)} of its own; "
                        f"the training process {_gib(m.main_peak)}")
    fixes = []
    workers = m.num_workers or 0
    if workers >= 2 and m.worker_peak and m.tree_peak is not None:
        target = BUDGET_SHARE * m.host_budget if m.host_budget else 0.5 * m.tree_peak
        # What each worker holds of its own is what it adds; the rest of the tree stays. With no
        # workers the dataset's work moves into the training process, so fewer than one worker
        # saves nothing more: the floor is one.
        base = m.tree_peak - workers * m.worker_peak
        fit = max(1, min(workers - 1, math.floor((target - base) / m.worker_peak)))
        after = base + fit * m.worker_peak
        fixes.append(Fix(f"{_knob(m, 'num_workers')} {workers} → {fit}", {"num_workers": fit},
                         Prediction("host_bytes", float(m.tree_peak), float(after),
                                    f"the job's memory less {workers - fit} × the largest worker's own memory "
                                    f"({_gib(m.worker_peak)})"),
                         "each worker holds its own copy of what the dataset builds; fewer workers, less RAM"
                         + (" (the data wait may grow: --apply measures it)" if m.share("data") > 0.05 else "")))
    fixes.append(Fix("keep the dataset's data in memory-mapped files (saturate's token shards do) instead of "
                     "per-process Python objects", {},
                     Prediction("host_bytes", float(m.tree_peak or 0), None, "not predicted: a code change"),
                     "pages of a memory-mapped file are shared by every worker; Python objects are copied on access"))
    return Finding("host-memory-bound", evidence, fixes)


def _worker_fix(m: Measurements) -> Fix | None:
    """More loader workers, with the step time they are predicted to give."""
    data = m.phases.get("data", 0.0)
    rest = m.step_s - data
    workers = m.num_workers or 0
    if data <= 0 or rest <= 0:
        return None
    # The serial time to produce one step's batches: the whole wait without workers; with W
    # workers keeping up at the limit, wait ≈ P/W - rest, so P ≈ W·(wait + rest).
    production = data if workers == 0 else workers * (data + rest)
    cpu_bound = m.data_cpu_share is not None and m.data_cpu_share >= 0.5
    cores = max(1, m.cpu_cores)
    if not m.accelerator:
        cap = cores  # training on the CPU: more workers than cores only fight the training for them
    elif cpu_bound:
        cap = max(1, cores - 1)  # one core keeps launching the GPU's work
    else:
        cap = max(2 * cores, 8)  # waiting on I/O, not CPU: workers can outnumber cores

    def predicted(w: int) -> float:
        usable = min(w, cap)
        if not m.accelerator and cpu_bound:
            # The training itself keeps the cores busy: workers share them, so their CPU time adds up.
            return max(rest + production / cores, production / usable)
        return max(rest, production / usable)

    best = None
    for w in range(workers + 1, cap + 1):
        best = w
        if production / min(w, cap) <= 0.8 * rest:
            break
    if best is None:
        return None
    after = predicted(best)
    if after >= m.step_s:
        return None
    kind = "CPU-bound" if cpu_bound else ("not CPU-bound" if m.data_cpu_share is not None else "of unknown CPU use")
    share = f", {_pct(m.data_cpu_share)} CPU while waiting" if m.data_cpu_share is not None else ""
    basis = (f"one step's batches take {_ms(production)} to produce ({kind}{share}); {best} workers "
             f"overlap that with the other {_ms(rest)} of the step")
    if not m.accelerator and cpu_bound:
        basis += f", sharing {cores} cores with the training"
    changes: dict[str, Any] = {"num_workers": best}
    if m.context == "plan":
        changes.update(prefetch_factor=2, persistent_workers=True)
    return Fix(f"{_knob(m, 'num_workers')} {workers} → {best}", changes, Prediction("step_s", m.step_s, after, basis),
               "batches are then produced in parallel while the model trains")


def _check_input(m: Measurements) -> Finding | None:
    share = m.share("data", "h2d") if m.accelerator else m.share("data")  # a CPU "copy" is a no-op call
    if share < INPUT_SHARE:
        return None
    evidence = [f"{_pct(m.share('data'))} of each step ({_ms(m.phases.get('data', 0.0))} of {_ms(m.step_s)}) "
                f"waiting for the next batch with {m.num_workers if m.num_workers is not None else '?'} loader workers"]
    if m.accelerator and m.phases.get("h2d", 0.0) > 0:
        evidence.append(f"{_pct(m.share('h2d'))} copying batches to the device")
    fixes = []
    if (fix := _worker_fix(m)) is not None:
        fixes.append(fix)
    h2d = m.phases.get("h2d", 0.0)
    if m.device_type == "cuda" and h2d / m.step_s >= 0.05 and not (m.pin_memory and m.non_blocking):
        fixes.append(Fix("pin_memory and non_blocking copies", {"pin_memory": True, "non_blocking": True},
                         Prediction("step_s", m.step_s, m.step_s - h2d,
                                    "upper bound: the copy overlaps compute entirely"),
                         "pinned host batches copy asynchronously, overlapping the previous step's compute"))
    if not fixes:
        fixes.append(Fix("make each sample cheaper to produce (pre-tokenise, cache, memory-map)", {},
                         Prediction("step_s", m.step_s, m.step_s - m.phases.get("data", 0.0),
                                    "upper bound: no wait for data at all"),
                         "the workers cannot be raised further on this machine"))
    return Finding("input-bound", evidence, fixes)


def _sync_where(m: Measurements) -> str:
    parts = [f"{v:g} in {k}" for k, v in sorted(m.syncs_by_phase.items(), key=lambda kv: -kv[1]) if v > 0]
    return ", ".join(parts)


def _check_sync(m: Measurements) -> Finding | None:
    if m.syncs_per_step is None or m.syncs_per_step < 1:
        return None
    where = _sync_where(m)
    if not m.accelerator:
        return Finding("note", [
            f"{m.syncs_per_step:g} host read(s) of a tensor value per step ({where}): free on a CPU, but each "
            "would make a GPU wait (read losses every N steps instead, as saturate's trainer does)"])
    idle = None if m.device_util.mean is None else 1 - m.device_util.mean / 100
    if idle is None or idle < IDLE_SHARE:
        return None
    evidence = [f"{m.syncs_per_step:g} host-device synchronisation(s) per step ({where}), counted with {m.sync_method}",
                f"the device was idle {_pct(idle)} of the time (utilisation {m.device_util.mean:.0f} % mean over "
                f"{m.device_util.samples} samples)"]
    after = m.step_s * (1 - idle)
    basis = "upper bound: the step shrinks to the time the device was busy"
    fixes = []
    h2d_syncs = m.syncs_by_phase.get("h2d", 0)
    if h2d_syncs and not (m.pin_memory and m.non_blocking):
        fixes.append(Fix("pin_memory and non_blocking copies", {"pin_memory": True, "non_blocking": True},
                         Prediction("step_s", m.step_s, m.step_s * (1 - idle * h2d_syncs / m.syncs_per_step),
                                    basis + ", in proportion to the syncs removed"),
                         "a copy from pageable memory blocks the host until the device has drained its queue"))
    if m.syncs_by_phase.get("optimizer") and m.precision == "fp16" and m.supports_bf16:
        fixes.append(Fix("precision fp16 → bf16 (no GradScaler)", {"precision": "bf16"},
                         Prediction("step_s", m.step_s, None, "not predicted: needs a trial"),
                         "the GradScaler reads its overflow check every step; bf16 needs no scaler"))
    other = m.syncs_per_step - h2d_syncs
    if other >= 1:
        fixes.append(Fix("keep losses and metrics on the device; read them every N steps", {},
                         Prediction("step_s", m.step_s, after, basis),
                         "each .item()/float()/print of a device tensor stops the host until the device catches up"))
    return Finding("sync-bound", evidence, fixes)


def _check_overhead(m: Measurements) -> Finding | None:
    probe = m.scaling
    if probe is not None and m.micro_batch:
        share = probe.fixed_share(m.micro_batch)
        if share < FIXED_SHARE:
            return None
        evidence = [f"a micro-step costs {_ms(probe.fixed_s)} whatever its size plus {_ms(probe.per_sample_s)} per "
                    f"sample: at micro-batch {m.micro_batch} the fixed part is {_pct(share)} of it (measured at "
                    f"micro-batch {probe.micro_batches[0]} and {probe.micro_batches[1]})"]
    elif m.accelerator and m.device_util.mean is not None:
        idle = 1 - m.device_util.mean / 100
        if idle < IDLE_NO_PROBE or m.share("data", "h2d") >= INPUT_SHARE or (m.syncs_per_step or 0) >= 1:
            return None
        evidence = [f"the device was idle {_pct(idle)} of the time with no data wait and no sync to blame: the host "
                    "cannot launch work as fast as the device runs it"]
    else:
        return None
    fixes = []
    if probe is not None and (fix := _micro_batch_fix(m, probe, "fewer, larger micro-steps pay the fixed cost "
                                                                 "fewer times per optimizer step")) is not None:
        fixes.append(fix)
    if m.compile in (None, "none"):
        mode = "reduce-overhead" if m.device_type == "cuda" else "default"
        fixes.append(Fix(f"torch.compile (mode {mode})", {"compile": mode},
                         Prediction("step_s", m.step_s, None, "not predicted: needs a trial (--apply measures it)"),
                         "fuses small kernels" + (" and replays them as CUDA graphs" if mode == "reduce-overhead"
                                                  else "")))
    if probe is not None and (m.grad_accum or 1) == 1 and m.micro_batch:
        b = m.micro_batch
        big = 4 * b
        mem = probe.memory_at(big)
        fits = not m.accelerator or (mem is not None and m.device_mem_total is not None
                                     and mem <= MEMORY_TARGET * m.device_mem_total)
        if fits:
            # One micro-step either way, of b samples now and 4b then; the optimizer step is unchanged.
            after = m.step_s - _micro_cost(m, probe, b) + _micro_cost(m, probe, big)
            fixes.append(Fix(f"a larger effective batch: micro-batch {b} → {big} (changes the optimisation; "
                             "learning rate scaled linearly)", {"micro_batch": big},
                             Prediction("sample_s", m.step_s / b, after / big, "seconds per sample, from the "
                                        "linear fit of forward+backward time over micro-batch size"),
                             "only if a larger batch suits the training: every micro-batch pays the fixed cost once",
                             same_training=False))
    return Finding("overhead-bound", evidence, fixes)


def _check_memory_underused(m: Measurements) -> Finding | None:
    if not m.accelerator or not m.device_mem_total or m.device_mem_peak is None or m.scaling is None:
        return None
    share = m.device_mem_peak / m.device_mem_total
    if share >= MEMORY_LOW:
        return None
    fix = _micro_batch_fix(m, m.scaling, "larger matrix multiplications use the device more efficiently")
    if fix is None or (fix.prediction.gain or 0) < GAIN_MIN:
        return None
    evidence = [f"device memory peak {_gib(m.device_mem_peak)} = {_pct(share)} of {_gib(m.device_mem_total)}",
                f"a larger micro-batch is predicted {fix.prediction.gain:.2f}× faster"]
    return Finding("device-memory-underused", evidence, [fix])


def _check_cpu_contention(m: Measurements) -> Finding | None:
    """On a CPU run, loader workers and torch's intra-op threads share the same cores."""
    if m.accelerator or not m.num_workers or m.cpu_threads is None:
        return None
    if m.cpu_threads + m.num_workers <= m.cpu_cores:
        return None
    return Finding("note", [
        f"{m.num_workers} loader worker(s) and {m.cpu_threads} intra-op threads share {m.cpu_cores} cores: on a CPU "
        "run every worker wake-up can stall the training's threads at a barrier; "
        f"torch.set_num_threads({max(1, m.cpu_cores - m.num_workers)}) leaves the workers a core"])


def _compute_bound(m: Measurements) -> Finding:
    evidence = [f"waiting for data {_pct(m.share('data'))} of the step"]
    if m.syncs_per_step is not None:
        evidence.append(f"{m.syncs_per_step:g} synchronisation(s) per step")
    if m.scaling is not None and m.micro_batch:
        evidence.append(f"fixed per-micro-step cost {_pct(m.scaling.fixed_share(m.micro_batch))} of a micro-step")
    if m.device_util.mean is not None:
        evidence.append(f"device utilisation {m.device_util.mean:.0f} % mean")
    fixes = []
    if m.precision == "fp32" and m.supports_bf16:
        fixes.append(Fix("precision fp32 → bf16 autocast", {"precision": "bf16"},
                         Prediction("step_s", m.step_s, None, "not predicted: needs a trial (--apply measures it)"),
                         "the device has native bf16 matrix units; the loss is then compared against fp32"))
    return Finding("compute-bound", evidence, fixes)


def _rank(fixes: list[Fix]) -> list[Fix]:
    def key(f: Fix) -> tuple[int, float]:
        gain = f.prediction.gain
        return (0, -gain) if gain is not None else (1, 0.0)

    return sorted(fixes, key=key)


def _best_gain(f: Finding) -> float:
    gains = [x.prediction.gain for x in f.fixes
             if x.same_training and x.prediction.metric == "step_s" and x.prediction.gain is not None]
    return max(gains, default=1.0)


def decide(m: Measurements) -> Diagnosis:
    """One verdict from the measurements, with its evidence and fixes ranked by predicted gain."""
    checks = (_check_oom, _check_host_memory, _check_input, _check_sync, _check_overhead, _check_memory_underused,
              _check_cpu_contention)
    findings = [f for check in checks if (f := check(m)) is not None]
    verdicts = [f for f in findings if f.verdict != "note"]
    notes = [f for f in findings if f.verdict == "note"]
    safety = [f for f in verdicts if f.verdict in ("oom-risk", "host-memory-bound")]
    if safety:
        main = safety[0]
    elif verdicts:
        order = {f.verdict: i for i, f in enumerate(verdicts)}
        main = max(verdicts, key=lambda f: (_best_gain(f), -order[f.verdict]))
    else:
        main = _compute_bound(m)
    others = [f for f in verdicts if f is not main]
    fixes = _rank(main.fixes)
    seen = {f.title for f in fixes}
    for f in _rank([x for o in others for x in o.fixes]):
        if f.title not in seen:
            fixes.append(f)
            seen.add(f.title)
    return Diagnosis(main.verdict, main.evidence, fixes, [main, *others, *notes], m)
