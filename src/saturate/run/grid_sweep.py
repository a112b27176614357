"""`saturate sweep`: a grid over workload parameters, each point tuned for its own model, then trained.

    saturate sweep --preset ts-lstm --grid hidden=128,256 window=30,60,90 --steps 300 --budget 60

Every point is a workload built with its parameters (a preset's shape or window, or a keyword of
the user's `--workload` function); it is tuned first, so the micro-batch fits that point's model
and memory, then trained with the tuned plan. Results: a table on the console, `sweep.png` (the
validation loss and the training throughput of every point) and `sweep.json`.

`sweep.json` is also the sweep's state, rewritten atomically after every point: run the same
command with the same `--out` and the points already done are skipped; a point interrupted while
training resumes from its last checkpoint, and one interrupted after tuning reuses its tuned plan.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from saturate.atomic import atomic_path, atomic_write_bytes
from saturate.engine.console import tidy_console
from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.workloads.base import Workload

STATE_FORMAT = 1


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """["hidden=128,256", "window=30,60,90"] -> {"hidden": [128, 256], "window": [30, 60, 90]}."""
    from saturate.workloads.source import parse_value

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,… with KEY a parameter name (e.g. hidden=128,256)")
        if key in grid:
            raise ConfigError(f"--grid: {key} is given twice")
        parsed = [parse_value(v) for v in values.split(",") if v.strip()]
        if not parsed:
            raise ConfigError(f"--grid {item!r}: no values")
        if len(set(map(repr, parsed))) != len(parsed):
            raise ConfigError(f"--grid {item!r}: a value is repeated")
        grid[key] = parsed
    if not grid:
        raise ConfigError("--grid needs at least one KEY=V1,V2,…")
    return grid


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination, the first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]


def point_key(params: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


class Sweep:
    """The state of one sweep folder: settings, and each point's outcome."""

    def __init__(self, out_dir: Path, settings: dict[str, Any]) -> None:
        self.out_dir, self.path = out_dir, out_dir / "sweep.json"
        self.state: dict[str, Any] = {"format": STATE_FORMAT, "settings": settings, "points": {}}
        if self.path.exists():
            try:
                old = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{self.path} cannot be read ({e}); use another --out") from None
            if old.get("settings") != settings:
                differ = sorted(k for k in set(settings) | set(old.get("settings", {}))
                                if settings.get(k) != old.get("settings", {}).get(k))
                raise ConfigError(f"{out_dir} holds a sweep with other settings ({', '.join(differ)}); rerun it with "
                                  "the same arguments to resume it, or choose another --out")
            self.state["points"] = old.get("points", {})

    def done(self, key: str) -> bool:
        return self.state["points"].get(key, {}).get("status") == "done"

    def record(self, key: str, entry: dict[str, Any]) -> None:
        self.state["points"][key] = entry
        self.save()

    def save(self, extra: dict[str, Any] | None = None) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {**self.state, **(extra or {})}
        atomic_write_bytes(self.path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def sweep(make_workload: Callable[[dict[str, Any]], Workload], grid: Mapping[str, Sequence[Any]],
          hardware: Any = None, *, out_dir: Path, steps: int | None = None, budget_s: float | None = None,
          try_compile: bool = True, allow_batch_change: bool = False, seed: int = 0, progress: bool = False,
          console: Console | None = None, measurer_factory: Callable[[Workload, Any], Any] | None = None,
          settings: Mapping[str, Any] | None = None, wide: bool = False) -> dict[str, Any]:
    """Tune then train every grid point; returns the sweep's JSON (also written to out_dir/sweep.json).

    `settings` are what else defines the sweep (the workload source, fixed parameters) for the resume
    check. Every point's workload is built before anything is tuned, so a bad parameter fails first.
    """
    from saturate.engine.checkpoint import CheckpointManager
    from saturate.engine.trainer import RunConfig, train
    from saturate.hardware import probe
    from saturate.tune import tune

    console = console or tidy_console()
    hw = hardware or probe(measure_peaks=False)
    out_dir = Path(out_dir)
    state = Sweep(out_dir, {"grid": {k: list(v) for k, v in grid.items()}, "steps": steps, "budget_s": budget_s,
                            "try_compile": try_compile, "allow_batch_change": allow_batch_change, "seed": seed,
                            **dict(settings or {})})
    points = grid_points(grid)
    todo = [(i, p) for i, p in enumerate(points) if not state.done(point_key(p))]
    workloads = {i: make_workload(p) for i, p in todo}  # a bad parameter fails here, before any trial
    state.save()
    console.print(f"[bold]saturate sweep[/bold]: {len(points)} points ({len(points) - len(todo)} already done) in "
                  f"{out_dir}; each is tuned, then trained. Interrupted? Run the same command to resume.")
    interrupted, stop_signal = False, None
    for i, params in todo:
        key, w = point_key(params), workloads[i]
        folder = out_dir / "points" / f"{i:02d}-{_safe(key)}"
        console.print(f"[bold]point {i + 1}/{len(points)}[/bold] {key}")
        started = time.monotonic()
        entry: dict[str, Any] = {"index": i, "params": params, "folder": str(folder)}
        try:
            plan_path = folder / "tune" / "plan.toml"
            if plan_path.exists():  # tuned before an interruption: the verified plan is reused
                plan = Plan.load(plan_path)
                console.print(f"  reusing the plan tuned before the interruption ({plan_path})")
            else:
                tuned = tune(w, hw, budget_s=budget_s, planned_steps=steps, allow_batch_change=allow_batch_change,
                             out_dir=folder / "tune", seed=seed, try_compile=try_compile, console=console,
                             measurer=measurer_factory(w, hw) if measurer_factory else None)
                plan = tuned.plan
            tune_s = time.monotonic() - started
            run_dir = folder / "run"
            resume = bool(CheckpointManager(run_dir / "checkpoints").checkpoints())
            if run_dir.exists() and not resume:
                shutil.rmtree(run_dir)  # a start that never reached a checkpoint: nothing to keep
            result = train(w, None if resume else plan,
                           RunConfig(steps=steps, run_dir=run_dir, resume=resume, seed=seed, device=hw.torch_device,
                                     progress=progress), hardware=hw)
        except SaturateError as e:  # this point cannot train (no fit at micro-batch 1, …): the others still can
            state.record(key, {**entry, "status": "failed", "error": str(e)})
            console.print(f"  [red]failed:[/red] {e}")
            continue
        entry.update({
            "status": "interrupted" if result.interrupted else "done", "plan": _plan_summary(result.plan),
            "samples_per_s": result.samples_per_s, "tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
            "val_loss": result.val_loss, "train_loss": result.train_loss, "metrics": result.metrics,
            "steps": result.steps, "train_seconds": result.train_seconds, "tune_seconds": tune_s,
            "resumed": resume, "peak_memory_bytes": result.peak_memory_bytes, "memory_kind": result.memory_kind,
        })
        state.record(key, entry)
        if result.interrupted:
            interrupted, stop_signal = True, result.stop_signal
            break
    rows = [state.state["points"][point_key(p)] for p in points if point_key(p) in state.state["points"]]
    done = [r for r in rows if r.get("status") == "done"]
    best = min(done, key=_score, default=None) if done else None
    plot_path = _plot(rows, list(grid), out_dir / "sweep.png") if done else None
    summary = {"best": best and point_key(best["params"]), "plot": str(plot_path) if plot_path else None,
               "interrupted": interrupted, "stop_signal": stop_signal}
    state.save(summary)
    console.print(results_table(rows, list(grid), best, wide=wide))
    if interrupted:
        console.print(f"[yellow]interrupted[/yellow]: run the same command with --out {out_dir} to resume")
    console.print(f"sweep folder: {out_dir} (sweep.json" + (f", {plot_path.name}" if plot_path else "") + ")")
    return {**state.state, **summary}


def _score(row: dict[str, Any]) -> float:
    v = row.get("val_loss") if row.get("val_loss") is not None else row.get("train_loss")
    return float("inf") if v is None else float(v)


def _safe(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", key)[:80]


def _plan_summary(plan: Plan) -> dict[str, Any]:
    return {"micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum, "precision": plan.precision,
            "tf32": plan.tf32, "num_workers": plan.num_workers, "compile": plan.compile,
            "activation_checkpointing": plan.activation_checkpointing}


def results_table(rows: list[dict[str, Any]], keys: list[str], best: dict[str, Any] | None,
                  wide: bool = False) -> RenderableType:
    """One row per point. At 80 columns: the parameters, the split, samples/s, validation loss and status;
    `wide` adds precision, workers, the workload's own metrics and the training time (all are in sweep.json).
    A failed point's error is said under the table, not squeezed into a cell."""
    extra = sorted({k for r in rows for k in (r.get("metrics") or {})}) if wide else []
    t = Table(title="sweep results (measured in each point's training run)", box=box.SIMPLE_HEAVY,
              title_justify="left")
    cols = [*keys, "micro×accum", *(["precision", "workers"] if wide else []), "samples/s", "val loss", *extra,
            *(["train s"] if wide else []), "status"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("precision", "status") else "right", overflow="fold")
    failures = []
    for r in rows:
        p = r.get("plan") or {}
        status = r.get("status", "?") + (" (best)" if best is not None and r is best else "")
        if r.get("status") == "failed":
            failures.append(r)
            status = f"failed [{len(failures)}]"
        t.add_row(*[str(r["params"].get(k)) for k in keys],
                  f"{p['micro_batch']}×{p['grad_accum']}" if p else "-",
                  *([p.get("precision", "-"), str(p.get("num_workers", "-"))] if wide else []),
                  _f(r.get("samples_per_s"), "{:,.1f}"), _f(r.get("val_loss"), "{:.4f}"),
                  *[_f((r.get("metrics") or {}).get(k), "{:.4g}") for k in extra],
                  *([_f(r.get("train_seconds"), "{:.1f}")] if wide else []), status)
    if not failures:
        return t
    lines = [f"[{i}] {point_key(r['params'])}: {r.get('error', '')}" for i, r in enumerate(failures, 1)]
    return Group(t, *(Text(line) for line in lines))


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _plot(rows: list[dict[str, Any]], keys: list[str], path: Path) -> Path | None:
    """Validation loss and training samples/s per point: x is the first grid key, one line per value of the rest."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = [r for r in rows if r.get("status") == "done"]
    x_key, rest = keys[0], keys[1:]
    numeric = all(isinstance(r["params"][x_key], (int, float)) for r in done)
    xs = sorted({r["params"][x_key] for r in done}, key=lambda v: (str(type(v)), v))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in done:
        groups.setdefault(", ".join(f"{k}={r['params'][k]}" for k in rest) or "all", []).append(r)
    for label, members in groups.items():
        members = sorted(members, key=lambda r: xs.index(r["params"][x_key]))
        pos = [r["params"][x_key] if numeric else xs.index(r["params"][x_key]) for r in members]
        ax1.plot(pos, [_score(r) for r in members], "o-", label=label)
        ax2.plot(pos, [r.get("samples_per_s") or 0 for r in members], "o-", label=label)
    for ax, ylabel, title in ((ax1, "validation loss", "Loss per point"),
                              (ax2, "samples/s (training, measured)", "Throughput per point (tuned plan)")):
        ax.set(xlabel=x_key, ylabel=ylabel, title=title)
        if not numeric:
            ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        if rest:
            ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
