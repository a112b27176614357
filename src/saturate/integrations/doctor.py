"""`saturate doctor -- CMD`: why a user's own training script is slow, with no edit to it.

The command runs with saturate's hooks (`command.run_instrumented`) for a warm-up, a few counted
steps and the timed steps, then is stopped; its measurements go through the same rules as every
other diagnosis (`doctor.rules.decide`), and each fix is also said in the script's own terms: the
`DataLoader(...)` call at `train.py:123` and its `num_workers=`, the optimizer's constructor, the
autocast to add.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from saturate.doctor.findings import Diagnosis, Fix, Measurements
from saturate.doctor.report import render
from saturate.doctor.rules import decide
from saturate.integrations.command import ScriptRun, run_instrumented

LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


def doctor_command(command: Sequence[str], *, warmup: int = 2, steps: int = 10, count_steps: int = 2,
                   first_step_timeout: float = 300.0, quiet_stdout: bool = False) -> tuple[Diagnosis, ScriptRun]:
    """Run `command` instrumented, stop it after its measured steps, and diagnose what was measured."""
    settings = {"mode": "doctor", "warmup": warmup, "count_steps": count_steps, "steps": steps, "stop": True}
    run = run_instrumented(command, settings, first_step_timeout=first_step_timeout, quiet_stdout=quiet_stdout)
    assert run.report is not None  # run_instrumented raises without one
    m = Measurements.from_dict(run.report["measurements"])
    if not run.report["loaders"]:
        m.notes.append("no DataLoader was iterated in the timed steps: loader settings do not apply, and "
                       "preparing batches (a get_batch() of your own) is part of \"everything else\", the "
                       "host's share of the step")
    if run.report.get("model") is None:
        m.notes.append("no model owning the optimizer's parameters was seen in a forward: forward and backward "
                       "are part of \"everything else\"")
    return decide(m), run


def in_your_script(fix: Fix, report: dict[str, Any], device_type: str) -> list[str]:
    """Where and how to make `fix` in the user's own script, as far as the hooks saw it."""
    changes = dict(fix.changes)
    lines: list[str] = []
    loader = report["loaders"][0] if report["loaders"] else None
    loader_args = {k: changes.pop(k) for k in LOADER_KNOBS if k in changes}
    if "micro_batch" in changes:
        loader_args["batch_size"] = changes.pop("micro_batch")
    if loader_args:
        args = ", ".join(f"{k}={v!r}" for k, v in loader_args.items())
        at = f"{loader['site']}: " if loader and loader.get("site") else ""
        lines.append(f"{at}DataLoader(..., {args})")
    if "grad_accum" in changes:
        lines.append(f"accumulate {changes.pop('grad_accum')} micro-batches per optimizer step (your accumulation "
                     "setting), so the effective batch stays the same")
    if "non_blocking" in changes:
        changes.pop("non_blocking")
        lines.append("move batches with .to(device, non_blocking=True)")
    if "precision" in changes:
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(changes.pop("precision"), "bfloat16")
        lines.append(f"wrap the forward and the loss in `with torch.autocast({device_type!r}, dtype=torch.{dtype}):`")
    if "compile" in changes:
        mode = changes.pop("compile")
        model = (report.get("model") or {}).get("class", "model")
        arg = "" if mode in (True, "default") else f", mode={mode!r}"
        lines.append(f"model = torch.compile(model{arg}) after building your {model}")
    if "fused" in changes:
        opt = report.get("optimizer") or {}
        at = f"{opt['site']}: " if opt.get("site") else ""
        lines.append(f"{at}{opt.get('class', 'AdamW')}(..., fused={changes.pop('fused')!r})")
    if "activation_checkpointing" in changes:
        changes.pop("activation_checkpointing")
        lines.append("torch.utils.checkpoint.checkpoint around each repeated block's forward")
    lines += [f"{k} = {v!r}" for k, v in changes.items()]
    return lines


def render_script(d: Diagnosis, run: ScriptRun, console: Console | None = None) -> None:
    """The doctor's report, then what the hooks found in the script and each fix in its terms."""
    console = console or Console(highlight=False)
    render(d, console, title=f"saturate doctor -- {shlex.join(run.command)}")
    report = run.report or {}
    console.print()
    console.print(Text("in your script (found by saturate's hooks, nothing edited):", style="bold"))
    model = report.get("model")
    if model:
        wrapped = f", in {' in '.join(model['wrapped_in'])}" if model.get("wrapped_in") else ""
        console.print(f"  model: {model['class']} ({model['parameters'] / 1e6:.2f} M parameters{wrapped})")
    opt = report.get("optimizer") or {}
    console.print(f"  optimizer: {opt.get('class')}" + (f" at {opt['site']}" if opt.get("site") else ""))
    for i, loader in enumerate(report.get("loaders", [])):
        role = "training DataLoader" if i == 0 else "DataLoader"
        console.print(f"  {role} at {loader.get('site') or '?'}: batch_size={loader['batch_size']}, "
                      f"num_workers={loader['num_workers']}, pin_memory={loader['pin_memory']}"
                      + (f", {loader['batches']} batches in the timed steps" if loader.get("batches") else ""))
    if report.get("world_size", 1) > 1:
        console.print(f"  {report['world_size']} processes; rank 0 measured")
    for i, fix in enumerate(d.fixes, 1):
        where = in_your_script(fix, report, d.measurements.device_type)
        if where:
            console.print(Text(f"  fix {i} ({fix.title}):", style="bold"))
            for line in where:
                console.print(Text(f"    {line}"))
