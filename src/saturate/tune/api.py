"""tune(workload) -> TuneResult: measure, choose, verify, then write plan.toml, tune.json and plots."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from saturate import plan_cache
from saturate.atomic import atomic_write_bytes
from saturate.engine.console import tidy_console
from saturate.engine.distributed import barrier, broadcast_object, init_distributed, teardown_distributed
from saturate.engine.live import Announced
from saturate.errors import ConfigError, file_not_folder
from saturate.hardware.contention import ContentionMeter, measure_contention
from saturate.hardware.kernels import fused_adamw_available
from saturate.plan import INFORMED_KNOBS, Plan
from saturate.policy import check as check_policy
from saturate.policy import policy_record
from saturate.tune.evidence import plan_text, plot, print_report, result_dict, trial_line
from saturate.tune.kept import keep as keep_what_the_user_had
from saturate.tune.measure import RealMeasurer
from saturate.tune.results import CUDA_ATTENTION, CUDA_COMPILE_LADDER, SearchResult, SearchSettings
from saturate.tune.search import search
from saturate.tune.trial import BudgetTooSmall, LoaderTrial, Measurer, Trial
from saturate.workloads.base import Workload
from saturate.workloads.coupling import kept_micro_batch, workload_default_plan


@dataclass
class TuneResult:
    plan: Plan  # the verified plan (name "tuned"); where it came from in plan.provenance, its trials in `search`
    search: SearchResult | None  # None: nothing to compare was measured, the plan the user had is kept (kept.py)
    out_dir: Path
    plan_path: Path
    json_path: Path
    plots: list[Path] = field(default_factory=list)
    cached_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    kept: str | None = None  # why nothing changed, when `search` is None


@contextlib.contextmanager
def no_empty_folders(*paths: Path) -> Iterator[None]:
    """On failure or interruption, remove each of `paths` that did not exist before and is empty now (deepest
    first), so a tune or run that wrote nothing useful leaves no folder behind."""
    new = [Path(p) for p in paths if not Path(p).exists()]
    try:
        yield
    except BaseException:
        for path in sorted(new, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty, or already gone: left as it is
                path.rmdir()
        raise


def tune(workload: Workload, hardware: Any = None, *, budget_s: float | None = None,
         planned_steps: int | None = None, allow_batch_change: bool = False, out_dir: Path | None = None,
         measurer: Measurer | None = None, seed: int = 0, try_compile: bool = True, device: str | None = None,
         console: Console | None = None, use_cache: bool = True, wide: bool = False,
         allow_micro_batch_change: bool = False, verify: bool = True, keep: bool = True,
         **settings: Any) -> TuneResult:
    """Find the fastest plan for `workload` on this machine by measurement, and prove it.

    The effective batch is kept exactly unless `allow_batch_change` (the learning rate is then
    rescaled by train()). With batch-coupled layers (BatchNorm) the micro-batch is kept unless
    `allow_micro_batch_change` (workloads/coupling.py). Writes `plan.toml`, `tune.json` and PNG plots
    to `out_dir`, and caches the plan for `train` to reuse on this hardware. `wide`: the tables show
    every figure (default: 80 columns). `verify=False` leaves out the last trial, which runs the chosen plan
    through the real loader and a validation pass: for a caller that measures the plan again anyway (`saturate
    run`'s side-by-side), so the budget goes to the search; the plan then carries its model trial's figure
    (`measured_samples_per_s`), not a verified one. The budget counts from this call: the search stops where its
    next trial and the verification would not fit, and a budget smaller than one trial fails after that
    trial's first step: then nothing is changed (`keep`: the plan the user had — the cached one, else the informed
    one — is written, with why, in `TuneResult.kept`; `keep=False`: `BudgetTooSmall` is raised).
    """
    from saturate.hardware import probe

    started = time.monotonic()
    check_policy()  # a SATURATE_POLICY file that was refused
    if budget_s is not None and budget_s <= 0:
        raise ConfigError(f"budget must be > 0 seconds, got {budget_s:g}")
    if out_dir is not None and (why := file_not_folder(out_dir, "output folder", "--out")) is not None:
        raise ConfigError(why)  # before the search, not after it
    hw = hardware or probe(measure_peaks=False, device=device)
    dev = torch.device(hw.torch_device)
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    dist = init_distributed(dev.type)  # under torchrun every rank measures every trial, together
    world = dist.world_size
    console = console or tidy_console()
    if not dist.is_main:
        console = Console(quiet=True)  # rank 0 reports and writes
    # Every trial a live line (engine/live.py): what it measures, and for how long so far.
    measurer = Announced(measurer or RealMeasurer(workload, hw, seed=seed, dist=dist), console, plan_text)
    steps = planned_steps or workload.optim.steps
    fixed_micro, coupling = kept_micro_batch(workload, world, allow_micro_batch_change)
    s = SearchSettings(fixed_micro_batch=fixed_micro,
                       effective_batch=workload.optim.effective_batch, planned_steps=steps,
                       supports=dict(hw.supports), fused_available=fused_adamw_available(dev),
                       loss_chunk_rows=workload.loss_chunk_rows, rows_per_sample=workload.tokens_per_sample,
                       attention_backends=CUDA_ATTENTION if workload.sdpa and dev.type == "cuda" else (),
                       compile_ladder=CUDA_COMPILE_LADDER if dev.type == "cuda" and world == 1 else (),
                       world_size=world, allow_batch_change=allow_batch_change, budget_s=budget_s,
                       try_compile=try_compile, verify=verify, **settings)
    out_dir = Path(broadcast_object(str(out_dir) if out_dir is not None else str(
        Path("runs") / f"tune-{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}")))  # rank 0's name on every rank
    console.print(f"[bold]saturate tune[/bold] {workload.name} on {_describe(hw)}: effective batch "
                  f"{s.effective_batch}, {steps} planned steps"
                  + (f", budget {round(budget_s, 1):g} s" if budget_s else "")
                  + (f", {world} processes (samples/s and memory are per process)" if world > 1 else "")
                  + "; every figure below is measured")
    if coupling:
        console.print(f"[yellow]{coupling}[/yellow]")

    def progress(t: Trial | LoaderTrial) -> None:
        console.print(f"[dim]  {trial_line(t, workload.tokens_per_sample)}[/dim]", highlight=False)

    # Other processes' use of the machine, said before the first trial (under torchrun the ranks, children of
    # one agent, are not each other's neighbours: hardware.contention.job_root).
    before = measure_contention(0.5)
    s.busy_before = before.other_cores if before.significant() else None  # the first trial's threads (start.py)
    console.print(before.line() + ("; trials are timed longer where their windows disagree"
                                   if before.significant() else ""),
                  style="yellow" if before.significant() else "dim", highlight=False)
    # The search starts from the informed plan (what an expert would pick from the hardware alone: plan.default_plan)
    # and measures around it; naive stays what `run` compares with (its "before") and a plan a user can ask for.
    base, _ = workload_default_plan(workload, hw, world)
    meter = ContentionMeter().start()
    try:
        result = search(measurer, base, s, progress, started)  # raises before anything is written
    except BudgetTooSmall as e:
        meter.stop()
        if not keep:
            raise
        plan, why, what = keep_what_the_user_had(e, workload, hw, world, out_dir, console, started, s.__dict__,
                                                 dist.is_main, use_cache)
        barrier()
        if made_group:
            teardown_distributed()
        return TuneResult(plan=plan, search=None, out_dir=out_dir, plan_path=out_dir / "plan.toml",
                          json_path=out_dir / "tune.json", notes=[f"{why}; kept {what}"], kept=why)
    result.contention = meter.stop()
    if coupling:
        result.decisions.insert(0, coupling)
    if dist.is_main:  # only now: a failed or interrupted search leaves no empty folder behind
        out_dir.mkdir(parents=True, exist_ok=True)

    plan = result.plan = result.plan.replace(name="tuned", provenance=_provenance(
        result, workload, hw, world, out_dir, verify=verify, memory_kind=measurer.memory_kind))
    json_path, plan_path = out_dir / "tune.json", out_dir / "plan.toml"
    plots, notes, cached = (_record(result, workload, hw, s, before, out_dir, console, memory_kind=measurer.memory_kind,
                                    wide=wide, use_cache=use_cache, world=world) if dist.is_main else ([], [], None))
    barrier()  # the plan is on disk before any rank goes on to use it
    if made_group:
        teardown_distributed()
    return TuneResult(plan=plan, search=result, out_dir=out_dir, plan_path=plan_path, json_path=json_path,
                      plots=plots, cached_path=cached, notes=notes)


def _provenance(result: SearchResult, workload: Workload, hw: Any, world: int, out_dir: Path, *, verify: bool,
                memory_kind: str) -> dict[str, Any]:
    """The tuned plan's provenance: where, when and for what it was tuned, its figure, and each knob's origin."""
    return {
        "tuned_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hw.fingerprint(),
        "hardware_description": _describe(hw),
        "workload": workload.name,
        "workload_key": plan_cache.workload_key(workload),
        "effective_batch": result.plan.samples_per_step(world),
        "world_size": world,
        "tuning_seconds": round(result.seconds, 1),
        "measured_samples_per_s": result.chosen.samples_per_s,  # the verification's, or the model trial's
        **({"verified_samples_per_s": result.chosen.samples_per_s,
            "verified_peak_memory_bytes": result.chosen.peak_memory_bytes} if verify else {}),
        "memory_kind": memory_kind,
        "evidence": str(out_dir / "tune.json"),  # the trials and decisions; plan.toml keeps the settings short
        # Why fewer threads (a busy machine); where the search started and, for each knob the informed plan sets,
        # its reason where no trial measured it ("chosen from the hardware, not measured"), else "measured" (the
        # evidence stays in tune.json: plan.toml keeps the settings short).
        **{k: v for k, v in result.plan.provenance.items() if k == "threads"},
        **({"start": result.choices["start"]} if "start" in result.choices else {}),
        **{k: result.choices[k] if k in result.unmeasured else "measured (tune.json: choices)"
           for k in INFORMED_KNOBS if k in result.choices},
    }


def _record(result: SearchResult, workload: Workload, hw: Any, s: SearchSettings, before: Any, out_dir: Path,
            console: Console, *, memory_kind: str, wide: bool, use_cache: bool,
            world: int) -> tuple[list[Path], list[str], Path | None]:
    """Rank 0, after the search: the report, the plots, tune.json and plan.toml, and the plan cached (unless the
    cached one stays: `cached_plan_stays`). Returns the plots, the notes said, and where the plan was cached."""
    plan, hw_fp = result.plan, hw.fingerprint()
    json_path, plan_path = out_dir / "tune.json", out_dir / "plan.toml"
    print_report(console, result, workload.tokens_per_sample, memory_kind, wide=wide)
    plots, plot_note = plot(result, out_dir, s.loader_margin)
    notes = [plot_note] if plot_note else []
    atomic_write_bytes(json_path, (json.dumps({
        "workload": workload.name, "info": workload.info, "hardware": hw.to_dict(), "settings": s.__dict__,
        **result_dict(result), "plan": plan.to_dict() | {"provenance": None},
        "plots": [str(p) for p in plots], "contention_before": before.to_dict(), **policy_record(),
    }, indent=2, default=str) + "\n").encode())
    plan.save(plan_path)
    kept = cached_plan_stays(plan, result, workload, hw_fp, world) if use_cache else None
    if kept:
        notes.append(kept)
    cached = plan_cache.store(plan, workload, hw_fp, world) if use_cache and not kept else None
    console.print(f"tuned plan: {plan_path} (evidence: {json_path}"
                  + (f"; plots: {', '.join(str(p) for p in plots)}" if plots else "") + ")")
    for n in notes:
        console.print(f"[yellow]{n}[/yellow]")
    return plots, notes, cached


def cached_plan_stays(new: Plan, result: SearchResult, workload: Workload, hardware_fingerprint: str,
                      world: int = 1) -> str | None:
    """Why the plan cached for this job stays the one `train` and `run` use (None: `new` replaces it).

    A tune replaces it only when it measured the cached plan's settings itself and chose another — its stages
    compared them under the same conditions — and its verification agreed with its trials. A budget too small to
    reach the cached plan's settings (bf16, say), or a verification that contradicts the trials (a burst of load),
    is no evidence that the new plan is faster: a figure recorded when the cached plan was tuned, minutes or days
    ago, is not compared with one taken now."""
    path = plan_cache.cached_plan_path(workload, hardware_fingerprint, world)
    cached, _ = plan_cache.lookup(workload, hardware_fingerprint, world)
    if cached is None or not path.exists() or cached.knobs() == new.knobs():
        return None
    head = f"the plan cached for this job ({cached!r}, {path}) stays the one `train` and `run` use"
    if result.warnings:
        return f"{head}: this tune's verification contradicted its trials, so its result is uncertain"
    if not any(t.ok and t.plan.knobs() == cached.knobs() for t in result.trials):
        return (f"{head}: this tune did not measure its settings, so it cannot say {new!r} is faster (a larger "
                f"--budget measures both; deleting {path.name} lets this result replace it)")
    return None


def _describe(hw: Any) -> str:
    if hw.devices and hw.device_type != "cpu":
        d = hw.devices[0]
        return f"{len(hw.devices)}× {d.name}" if len(hw.devices) > 1 else d.name
    return f"{hw.cpu_name} ({hw.cpu_cores} cores)"
