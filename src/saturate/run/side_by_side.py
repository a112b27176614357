"""Plans measured side by side for `saturate run`: interleaved rounds, per-round ratios, the machine's load.

Every plan is measured the same way (real training steps through its own loader, after a warm-up
step) in this process, in alternating rounds (A B C, C B A, …; stats/rounds.py), so a burst of load
hits them all; a plan's ratio to naive is the median of its per-round ratios, with their range. A
`ContentionMeter` brackets the rounds: when other processes kept a significant share of the cores
(or a GPU) busy, one more round is measured and the report says so first.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import psutil
import torch
from rich.console import Console

from saturate.engine.distributed import DistInfo, agree_any, all_reduce_scalar
from saturate.engine.live import stage
from saturate.engine.summary import mfu_peak
from saturate.errors import SaturateError
from saturate.hardware.contention import Contention, ContentionMeter
from saturate.hardware.mfu import Mfu, mfu
from saturate.plan import LOADER_FIELDS, Plan
from saturate.policy import POLICY
from saturate.policy.judge import judge_rounds
from saturate.stats.noise import WindowRule
from saturate.stats.rounds import Ratio, interleaved
from saturate.tune.trial import Trial
from saturate.workloads.base import Workload

# How each side-by-side measurement runs (sizing.py predicts its cost from these): two warm-up steps after a
# build (after one, the second step still runs slower: bf16 on a CPU, bench/side_by_side.py), then at least
# MIN_WINDOWS timed windows of half the measurement's seconds each, at most MAX_STEPS timed steps.
WARMUP, MIN_WINDOWS, MAX_STEPS = 2, 2, 40
# The loader's fields: a model trial of the search ran without them, so a runner-up takes the chosen plan's.
_LOADER = LOADER_FIELDS


@dataclass
class Row:
    label: str
    plan: Plan
    samples_per_s: float | None  # the median over rounds (the whole job's, under torchrun)
    tokens_per_s: float | None
    step_s: float | None
    peak_memory_bytes: int | None
    utilisation: float | None  # share of the device busy (GPU) or of the usable cores (CPU), measured
    mfu: Mfu | None  # hardware.mfu: the figure, or why there is none (above the peak: never shown)
    status: str = "ok"
    note: str = ""
    rounds: list[float | None] = field(default_factory=list)  # samples/s in each round (None: it failed)
    vs_naive: Ratio | None = None  # median and range of the per-round ratios to naive
    twin: str | None = None  # the label of the row with the same settings, measured once for both (None: its own)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "plan": self.plan.to_dict() | {"provenance": None},
                "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s, "step_s": self.step_s,
                "peak_memory_bytes": self.peak_memory_bytes, "utilisation": self.utilisation,
                "mfu": self.mfu.value if self.mfu else None, "mfu_detail": self.mfu.to_dict() if self.mfu else None,
                "status": self.status, "note": self.note, "rounds_samples_per_s": self.rounds,
                "vs_naive": self.vs_naive.to_dict() if self.vs_naive else None, "twin": self.twin}


@dataclass
class Comparison:
    rows: list[Row]
    rounds: int
    contention: Contention | None = None
    seconds: float = 0.0  # wall time of the rounds
    measure_s: float | None = None  # timed seconds per measurement (None: the measurer's own)

    def row(self, label: str) -> Row | None:
        return next((r for r in self.rows if r.label == label), None)

    def ratio(self, top: str, bottom: str = "naive") -> Ratio | None:
        a, b = self.row(top), self.row(bottom)
        return Ratio.between(a.rounds, b.rounds) if a is not None and b is not None else None

    def faster_than(self, label: str) -> tuple[Row, Ratio] | None:
        """The row measured faster than `label` in every round (the fastest such), with its ratio to it."""
        beaten = [(r, q) for r in self.rows if r.label != label and r.status == "ok"
                  if (q := self.ratio(r.label, label)) is not None and judge_rounds(q).kept]
        return max(beaten, key=lambda rq: rq[1].median, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "seconds": round(self.seconds, 1), "measure_s": self.measure_s,
                "contention": self.contention.to_dict() if self.contention else None}


def at_effective_batch(plan: Plan, effective: int) -> Plan | None:
    """A reference plan measured at the workload's effective batch: its micro-batch kept (or the largest
    divisor below it), accumulation adjusted. None when nothing divides."""
    micro = max((d for d in range(1, min(plan.micro_batch, effective) + 1) if effective % d == 0), default=None)
    if micro is None:
        return None
    return plan.replace(micro_batch=micro, grad_accum=effective // micro)


def knobs(plan: Plan) -> tuple[Any, ...]:
    """What a plan sets other than its loader, name and provenance (`Plan.knobs`)."""
    return plan.knobs()


def same_settings(plans: Sequence[tuple[str, Plan]]) -> dict[str, str]:
    """label -> the earlier label whose plan has exactly the same settings (name and provenance aside)."""
    seen: dict[tuple[Any, ...], str] = {}
    twins: dict[str, str] = {}
    for label, plan in plans:
        key = tuple(getattr(plan, f.name) for f in fields(Plan) if f.name not in ("name", "provenance"))
        if key in seen:
            twins[label] = seen[key]
        else:
            seen[key] = label
    return twins


def runner_up(trials: Sequence[Trial], chosen: Plan, others: Sequence[Plan] = ()) -> Plan | None:
    """The fastest plan the search measured but did not choose (nor one of `others`), with the chosen plan's
    loader. Memory points (one step) and compiled plans (a compilation per round) are left out."""
    seen = {knobs(chosen), *(knobs(p) for p in others)}
    measured = [t for t in trials if t.ok and t.samples_per_s and t.stage not in ("memory", "verify")
                and t.plan.compile == "none" and knobs(t.plan) not in seen]
    best = max(measured, key=lambda t: t.samples_per_s or 0.0, default=None)
    if best is None:
        return None
    return best.plan.replace(name="runner-up", provenance={}, **{k: getattr(chosen, k) for k in _LOADER})


def compare(workload: Workload, hw: Any, plans: list[tuple[str, Plan]], *, seed: int = 0,
            min_seconds: float = POLICY.payback.full_measure_s, rounds: int = POLICY.windows.side_by_side_rounds,
            dist: DistInfo | None = None, console: Console | None = None, measurer: Any = None,
            busy_round: bool = True) -> Comparison:
    """Measure each plan the same way in interleaved rounds in this process (every rank together under
    torchrun; the rows then give the whole job's samples/s and the ranks' mean utilisation). One more
    round when other processes kept the machine busy meanwhile (unless `busy_round` is False: the job cannot
    pay for it). Each measurement times `min_seconds` of training steps, in two windows (or more, when one step
    is longer than a window); the noise reported is between rounds.

    Off a GPU each plan is built once and kept (resident.py): every round times more steps of the same run,
    after one warm-up; on a GPU, where the plans need not fit together, each measurement rebuilds its plan."""
    from saturate.run.resident import ResidentMeasurer
    from saturate.tune.measure import RealMeasurer

    dist = dist or DistInfo()
    console = console or Console(quiet=True)
    if measurer is None:
        kind = RealMeasurer if torch.device(hw.torch_device).type == "cuda" else ResidentMeasurer
        # Training steps only: the verification's validation pass (memory proven already) would add to every one.
        measurer = kind(dataclasses.replace(workload, val_data=None), hw, seed=seed, max_steps=MAX_STEPS, dist=dist,
                        min_seconds=min_seconds, window_s=min(0.25, min_seconds / MIN_WINDOWS),
                        rule=WindowRule(min_windows=MIN_WINDOWS), warmup=WARMUP,
                        min_steps=2 if min_seconds < 1 else 3)  # a short job: shorter measurements
        measurer.window_cap_s = min_seconds  # a measurement's timed seconds: its share of the job
    try:
        cmp = _rounds(workload, hw, plans, rounds, dist, console, measurer, busy_round)
        cmp.measure_s = getattr(measurer, "window_cap_s", None)
        return cmp
    finally:
        if hasattr(measurer, "close"):
            measurer.close()


def gain_between(workload: Workload, hw: Any, before: Plan, after: Plan, *, seed: int = 0,
                 min_seconds: float = 1.0) -> Ratio:
    """After ÷ before samples/s per round, the two plans measured in interleaved rounds in this process (`saturate
    doctor --apply`'s measured gain)."""
    cmp = compare(workload, hw, [("before", before), ("after", after)], seed=seed, min_seconds=min_seconds)
    ratio = cmp.ratio("after", "before")
    if ratio is None:
        notes = [r.note for r in cmp.rows if r.note]
        raise SaturateError("the plans before and after the fix could not be measured side by side: "
                            + (notes[0] if notes else "no round completed"))
    return ratio


def _rounds(workload: Workload, hw: Any, plans: list[tuple[str, Plan]], rounds: int, dist: DistInfo,
            console: Console, measurer: Any, busy_round: bool = True) -> Comparison:
    by_label = dict(plans)
    same = same_settings(plans)  # a plan whose settings an earlier one has is measured once, as that one
    labels = [label for label, _ in plans if label not in same]
    measured: dict[str, list[tuple[Trial, float | None]]] = {label: [] for label in labels}
    meter = ContentionMeter().start()
    started = time.perf_counter()
    total, done = rounds, 0
    with stage(console, "measuring side by side", plain=False) as say:  # off a terminal: a line per round
        while done < total:
            for r, label in interleaved(labels, total):
                if r < done:
                    continue
                say(f"measuring side by side: {_round(r, rounds)} ({label})")
                with _Utilisation(hw, getattr(measurer, "cores", None)) as util:
                    t = measurer.verify(by_label[label])
                value = util.value
                if dist.world_size > 1:
                    value = None if not all_reduce_scalar(value is not None, "min") else all_reduce_scalar(value or 0.0)
                measured[label].append((t, value))
                if label == (labels[0] if r % 2 else labels[-1]):  # the round's last measurement
                    console.print(f"[dim]  {_round(r, rounds)}: " + " · ".join(
                        f"{name} {_f(_sps(measured[name][r][0], dist.world_size), '{:,.1f}')}" for name in labels)
                        + " samples/s[/dim]", highlight=False)
            done = total
            contention = meter.stop()
            if busy_round and total == rounds and agree_any(contention.significant()):
                total += 1  # busy: one more round, so a burst of load weighs less in the median
    contention = meter.stop()
    rows = [_row(label, by_label[label], measured[label], workload, hw, dist.world_size) for label in labels]
    for label, twin in same.items():  # in the order given: the alias after the row it repeats
        row = dataclasses.replace(next(r for r in rows if r.label == twin), label=label, twin=twin,
                                  note=f"the same settings as {twin}: measured once")
        rows.insert(next(i for i, (name, _) in enumerate(plans) if name == label), row)
    naive = next((r for r in rows if r.label == "naive"), None)
    for r in rows:
        twin_of_naive = same.get(r.label) == "naive"  # naive against itself would read as a measured 1.00×
        r.vs_naive = Ratio.between(r.rounds, naive.rounds) if naive is not None and not twin_of_naive else None
    return Comparison(rows, total, contention, time.perf_counter() - started)


def _round(r: int, planned: int) -> str:
    """Round `r` (from 0) of the `planned` ones, or the busy machine's extra round, said as such (not "4/4" after
    "3/3")."""
    return f"round {r + 1}/{planned}" if r < planned else f"round {r + 1} (extra: the machine was busy)"


def _sps(t: Trial, world_size: int) -> float | None:
    return t.samples_per_s * world_size if t.ok and t.samples_per_s else None  # a trial's figure is per process


def _row(label: str, plan: Plan, measured: list[tuple[Trial, float | None]], workload: Workload, hw: Any,
         world_size: int = 1) -> Row:
    """One plan's rounds summarised: medians of what was measured, the largest peak memory."""
    per_round = [_sps(t, world_size) for t, _ in measured]
    ok = [v for v in per_round if v is not None]
    failed = next((t for t, _ in measured if not t.ok), None)
    sps = statistics.median(ok) if ok else None
    utils = [u for t, u in measured if t.ok and u is not None]
    memory = [t.peak_memory_bytes for t, _ in measured if t.peak_memory_bytes is not None]
    return Row(label, plan, sps, sps * workload.tokens_per_sample if sps else None,
               plan.samples_per_step(world_size) / sps if sps else None, max(memory, default=None),
               statistics.median(utils) if utils else None, row_mfu(workload, hw, plan, sps, world_size),
               status=failed.status if failed is not None and not ok else "ok",
               note=failed.error if failed is not None else "", rounds=per_round)


def row_mfu(workload: Workload, hw: Any, plan: Plan, samples_per_s: float | None, world_size: int) -> Mfu:
    """A row's MFU through hardware.mfu (never above 100 %); the peak is one device's, the job has world_size."""
    peak, source = mfu_peak(hw, plan)
    return mfu((samples_per_s or 0) * (workload.flops_per_sample or 0), peak, source, world_size)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


class _Utilisation:
    """Measured busy share over a block: GPU utilisation (NVML, sampled) or process CPU time / (wall × cores)."""

    def __init__(self, hw: Any, cores: int | None = None) -> None:
        self.hw = hw
        self.cores = cores or hw.cpu_cores  # this process's share of the cores (under torchrun)
        self.value: float | None = None

    def __enter__(self) -> _Utilisation:
        self._proc = psutil.Process()
        self._cpu0 = sum(self._proc.cpu_times()[:2])
        self._t0 = time.perf_counter()
        self._gpu = _GpuBusy(self.hw) if self.hw.device_type == "cuda" and torch.cuda.is_available() else None
        if self._gpu is not None:
            self._gpu.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t0
        if self._gpu is not None:
            self.value = self._gpu.stop()
        elif wall > 0:
            self.value = (sum(self._proc.cpu_times()[:2]) - self._cpu0) / (wall * max(1, self.cores))


class _GpuBusy:
    """Mean NVML utilisation of the training GPU, sampled every 100 ms; None if NVML cannot be read."""

    def __init__(self, hw: Any) -> None:
        import threading

        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        index = torch.device(hw.torch_device).index
        self._index = index if index is not None else torch.cuda.current_device()  # torchrun bound this rank's

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self._index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            while not self._stop.wait(0.1):
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # NVML missing or unreadable: utilisation is reported as not measured
            self.samples = []

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=2)
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None


def choose_trained(cmp: Comparison, label: str = "tuned") -> tuple[str, list[str], list[str]]:
    """Which plan trains (the `label` plan, tuned or default, unless another plan was measured faster than it in
    every round), the verdict lines under the table, and a note when it is not that plan."""
    lines, notes, trained = [], [], label
    for r in cmp.rows:
        if r.label != "naive" and r.vs_naive is not None:
            short = (not (r.vs_naive.faster or r.vs_naive.slower) and cmp.measure_s is not None
                     and cmp.measure_s < POLICY.payback.full_measure_s)
            lines.append(f"{r.label} vs naive: {r.vs_naive.verdict()}, median of {r.vs_naive.rounds} interleaved "
                         "rounds (range)" + (f"; each measurement was {cmp.measure_s:.1f} s, sized to the job: too "
                                             "short to resolve a gain this small" if short else ""))
        elif r.twin is not None:
            lines.append(f"{r.label}: {r.note} (nothing to compare)")
    tuned = cmp.row(label)
    beaten = cmp.faster_than(label)
    if tuned is not None and tuned.status != "ok":
        ok = [r for r in cmp.rows if r.status == "ok" and r.samples_per_s]
        if ok:
            trained = max(ok, key=lambda r: r.samples_per_s or 0.0).label
            notes.append(f"the {label} plan failed when measured here ({tuned.note}); training with {trained} "
                         "instead")
    elif beaten is not None:
        trained = beaten[0].label
        notes.append(f"the {label} plan was measured slower than {trained} in every round ({trained} "
                     f"{beaten[1].fmt()} of {label}, beyond the noise); training with {trained} instead")
    return trained, lines, notes
