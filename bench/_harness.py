"""What the benchmarks share: options, timing a train() run after its warm-up, interleaved rounds,
per-round ratios and their summaries, tables, JSON and the environment they were measured in.

Not a benchmark itself (the leading underscore). Each bench/*.py script imports it by name
(``import _harness as bench``), which works because Python puts the script's own folder first on
sys.path.

How a train() run is timed: ``RunConfig(log_every=warmup)`` makes the trainer synchronise the
device and read the clock at the end of the warm-up (step ``warmup``) and at the last step, and
write each window's ``time/step_s`` to metrics.jsonl. The windows after the first are the timed
steps, measured by the trainer's own clock (the one behind ``RunResult.train_seconds``, which
leaves out validation and checkpointing). One run gives the figure, with no subtraction of two
noisy runs; with ``warmup >= steps`` there is exactly one timed window, so no extra host sync
falls inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, RunResult, train
from saturate.plan import Plan
from saturate.stats.rounds import interleaved  # noqa: F401 - re-exported: the benchmarks' round order
from saturate.workloads import Workload, build_workload

NEVER = 10**9  # an eval/checkpoint interval no benchmark reaches (the last step still checkpoints)

K = TypeVar("K", bound=Hashable)  # a competitor's name
T = TypeVar("T")  # what one measurement of it returns


@dataclass
class Timed:
    """One measurement: `steps` optimizer steps after the warm-up, and what they cost."""

    steps: int
    seconds: float
    tokens_per_s: float
    loss: float  # mean training loss over the timed steps (a check that both sides did the same work)
    peak_memory_bytes: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tokens_per_s(runs: Sequence[Timed]) -> list[float]:
    return [t.tokens_per_s for t in runs]


def bench_workload(preset: str, seed: int) -> Workload:
    """A preset's workload without validation data: no validation pass (it falls outside the timing anyway, but
    costs time)."""
    return dataclasses.replace(build_workload(preset, seed=seed), val_data=None)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_config(*, warmup: int, steps: int, run_dir: Path, seed: int = 0, **overrides: Any) -> RunConfig:
    """train()'s settings for a timed run of warmup + steps steps (see the module doc): logs split at the warm-up,
    no validation or checkpoint before the last step, no console, TensorBoard or exported weights."""
    return RunConfig(
        steps=warmup + steps, run_dir=run_dir, seed=seed, log_every=warmup, eval_every=NEVER, ckpt_every=NEVER,
        keep_checkpoints=1, progress=False, tensorboard=False, export_weights=False, **overrides,
    )


def train_windows(workload: Workload, plan: Plan, *, warmup: int, steps: int, hardware: Any, run_dir: Path,
                  seed: int = 0, **overrides: Any) -> tuple[list[dict[str, Any]], RunResult]:
    """Run train() under run_config() on `hardware`'s device; its read_windows() and its result. The run folder
    is removed afterwards."""
    config = run_config(warmup=warmup, steps=steps, run_dir=run_dir, seed=seed, device=hardware.torch_device,
                        **overrides)
    try:
        result = train(workload, plan, config, hardware=hardware)
        windows = read_windows(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of gpt-small are ~1 GB each
    return windows, result


def read_windows(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl that close a timing window (those with time/step_s)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step_s" in r]


def timed_window(windows: Sequence[dict[str, Any]], *, warmup: int, steps: int) -> tuple[float, float]:
    """Seconds and mean training loss of the `steps` steps after step `warmup`, from the time/step_s windows."""
    seconds = loss = 0.0
    timed, previous = 0, 0
    for r in windows:
        n = r["step"] - previous
        previous = r["step"]
        if r["step"] > warmup:
            seconds += r["time/step_s"] * n
            loss += r["train/loss"] * n
            timed += n
    if timed != steps or not any(r["step"] == warmup for r in windows):
        logged = [r["step"] for r in windows]
        raise RuntimeError(f"metrics.jsonl windows end at steps {logged}, not split at step {warmup}")
    return seconds, loss / steps


def timed_train(workload: Workload, plan: Plan, *, warmup: int, steps: int, hardware: Any, run_dir: Path,
                seed: int = 0) -> tuple[Timed, RunResult]:
    """Run saturate's train() for warmup + steps optimizer steps; time the last `steps` (see module doc)."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup and steps must be >= 1, got {warmup} and {steps}")
    release_memory(torch.device(hardware.torch_device))
    windows, result = train_windows(workload, plan, warmup=warmup, steps=steps, hardware=hardware,
                                    run_dir=run_dir, seed=seed)
    if result.steps != warmup + steps:
        raise RuntimeError(f"train() stopped at step {result.steps} of {warmup + steps}")
    seconds, loss = timed_window(windows, warmup=warmup, steps=steps)
    tokens = steps * plan.samples_per_step() * workload.tokens_per_sample
    return Timed(steps, seconds, tokens / seconds, loss, result.peak_memory_bytes, tuple(result.notes)), result


def run_rounds(names: Sequence[K], rounds: int, run: Callable[[K, Path], T],
               line: Callable[[int, K, T], str] | None = None) -> dict[K, list[T]]:
    """Measure every competitor once a round, interleaved(); each one's measurements in round order.

    run(name, run_dir) measures `name` once; run_dir is a fresh path (not created) in a temporary folder that
    is removed at the end. line(round, name, measurement), when given, is printed after each run.
    """
    results: dict[K, list[T]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="saturate-bench-") as tmp:
        for r, name in interleaved(names, rounds):
            measured = run(name, Path(tmp) / f"round{r}-{names.index(name)}")
            results[name].append(measured)
            if line is not None:
                print(line(r, name, measured), flush=True)
    return results


def train_rounds(workload: Workload, plans: Mapping[str, Plan], hardware: Any, args: argparse.Namespace,
                 line: Callable[[int, str, Timed], str] | None = None) -> dict[str, list[Timed]]:
    """run_rounds() of timed_train(): every plan trained through train() once a round, with the rounds, steps,
    warm-up and seed of add_run_args()'s options."""
    return run_rounds(list(plans), args.rounds, lambda name, run_dir: timed_train(
        workload, plans[name], warmup=args.warmup, steps=args.steps, hardware=hardware, run_dir=run_dir,
        seed=args.seed)[0], line)


@dataclass
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(math.nan, math.nan, math.nan)
        return cls(statistics.median(values), min(values), max(values))

    def fmt(self, spec: str, scale: float = 1.0, unit: str = "") -> str:
        """'median (low..high)' with each figure multiplied by `scale`."""
        m, lo, hi = (format(v * scale, spec) for v in (self.median, self.low, self.high))
        return f"{m}{unit} ({lo}..{hi})"

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


def ratios(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
    """Round by round, top ÷ bottom: each figure against the same round's baseline, so that a drift of the
    machine moves both sides of a ratio together."""
    return [a / b for a, b in zip(top, bottom, strict=True)]


def ratios_to(figures: Mapping[str, Sequence[float]], base: str) -> dict[str, Spread]:
    """Every competitor's per-round ratio to `base`, summarised."""
    return {name: Spread.of(ratios(values, figures[base])) for name, values in figures.items()}


def device_label(hardware: Any) -> str:
    """'cuda:0 (NVIDIA H200)' or 'cpu (AMD EPYC ...)'."""
    if not hardware.devices:
        return f"{hardware.torch_device} ({hardware.cpu_name})"
    index = torch.device(hardware.torch_device).index or 0
    return f"{hardware.torch_device} ({hardware.devices[index].name})"


def environment(hardware: Any) -> dict[str, Any]:
    """What the numbers were measured on, for the JSON result."""
    return {
        "device": hardware.torch_device,
        "device_names": [d.name for d in hardware.devices],
        "cpu": hardware.cpu_name,
        "cpu_cores": hardware.cpu_cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def no_cuda(json_path: str | None, benchmark: str) -> bool:
    """True (after saying "no CUDA device: skipped" and writing a JSON that says so) when there is no CUDA device."""
    if torch.cuda.is_available():
        return False
    print("no CUDA device: skipped")
    write_json(json_path, {"benchmark": benchmark, "skipped": "no CUDA device"})
    return True


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
                footer: Sequence[str] = ()) -> None:
    # A fixed width: these run over ssh and in CI, where rich would otherwise assume 80 columns.
    console = Console(width=120, highlight=False)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in footer:
        console.print(line, markup=False)


def add_run_args(ap: argparse.ArgumentParser, *, steps: int | None, warmup: int | None, rounds: int) -> None:
    """The options every benchmark shares: timed steps, warm-up, rounds, seed, JSON output."""
    ap.add_argument("--steps", type=int, default=steps, help=f"timed optimizer steps per run (default: {steps})")
    ap.add_argument("--warmup", type=int, default=warmup, help=f"excluded steps per run (default: {warmup})")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default: {rounds})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")


def require_positive(ap: argparse.ArgumentParser, **values: int) -> None:
    """ap.error() unless every value is >= 1, naming them as options: require_positive(ap, micro=8, steps=0)."""
    if min(values.values()) < 1:
        names = [f"--{name.replace('_', '-')}" for name in values]
        listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
        ap.error(f"{listed} must be >= 1")


def tuning_footer(tuned: Any) -> list[str]:
    """Table footer lines for a tune() result: how long tuning took and its decisions."""
    return [f"tuning took {tuned.search.seconds:.0f} s; decisions:", *[f"  {d}" for d in tuned.search.decisions]]


def tuning_json(tuned: Any) -> dict[str, Any]:
    return {"tuning_seconds": tuned.search.seconds, "decisions": tuned.search.decisions}


NEIGHBOUR = Path(__file__).resolve().parents[2] / "shared" / "tools" / "neighbour.py"


@contextlib.contextmanager
def neighbour(profile: str, seed: int, duration: float = 1800.0) -> Iterator[None]:
    """The shared seeded neighbour for the duration, stopped after. Started through a shell that exits at once, so
    it is not our descendant (saturate counts its own process tree as its own use: a neighbour that is our child
    would be measured as the workload)."""
    if not NEIGHBOUR.exists():
        raise SystemExit(f"{NEIGHBOUR} not found: the neighbour lives in the shared folder beside the repository")
    cmd = (f"{sys.executable} {NEIGHBOUR} --profile {profile} --seed {seed} --duration {duration} "
           ">/dev/null 2>&1 & echo $!")
    pid = int(subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout.strip())
    try:
        time.sleep(1.0)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # it takes its workers with it
