"""`saturate doctor -- CMD`: why a user's own training script is slow, with no edit to it.

The command runs with saturate's hooks (`command.run_instrumented`) for a warm-up, a few counted
steps and the timed steps, then is stopped; its measurements go through the same rules as every
other diagnosis (`doctor.rules.decide`), and each fix is also said in the script's own terms: the
`DataLoader(...)` call at `train.py:123` and its `num_workers=`, the optimizer's constructor, the
autocast to add; a Transformers `Trainer`'s `TrainingArguments` fields, a Lightning `Trainer`'s
`precision=` and `accumulate_grad_batches=` (also in each fix's title).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from saturate.data.fingerprint import replayed, shard_edit
from saturate.doctor.findings import Diagnosis, Fix, Measurements
from saturate.doctor.report import render
from saturate.doctor.rules import decide
from saturate.doctor.trace import TRACE_STEPS, TraceFiles
from saturate.engine.console import tidy_console
from saturate.policy import POLICY
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun, run_instrumented
from saturate.script.isolation import notice
from saturate.script.loop_split import split_flags
from saturate.script.overrides import from_changes

LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
# a fix's knob -> the TrainingArguments field of a Transformers Trainer (the rest: `trainer_arguments`)
SHOWN_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "dataloader_num_workers",
                "torch_compile", "gradient_checkpointing", "optim")
TRAINER_TERMS = {"num_workers": "dataloader_num_workers", "pin_memory": "dataloader_pin_memory",
                 "prefetch_factor": "dataloader_prefetch_factor", "persistent_workers": "dataloader_persistent_workers",
                 "tf32": "tf32"}


def doctor_command(command: Sequence[str], *, warmup: int = 2, steps: int = 10, count_steps: int = 2,
                   first_step_timeout: float = POLICY.windows.first_step_timeout_s,
                   quiet_stdout: bool = False, trace: Path | None = None) -> tuple[Diagnosis, ScriptRun]:
    """Run `command` instrumented, stop it after its measured steps, and diagnose what was measured; with `trace`
    (a folder), the few steps after the timed ones traced there (doctor/trace.py), every rank."""
    settings = ChildSettings(mode="doctor", warmup=warmup, count_steps=count_steps, steps=steps, stop=True,
                             trace_steps=TRACE_STEPS if trace is not None else 0)
    run = run_instrumented(command, settings, first_step_timeout=first_step_timeout, quiet_stdout=quiet_stdout,
                           trace_to=trace)
    assert run.report is not None  # run_instrumented raises without one
    m = Measurements.from_dict(run.report["measurements"])
    if trace is not None and (files := TraceFiles.from_dict(m.trace)) is not None:
        m.trace = files.moved(trace, run.report.get("world_size", 1)).to_dict()  # from the removed run folder
    if not run.report["loaders"]:
        m.notes.append("no DataLoader was iterated in the timed steps: loader settings do not apply, and "
                       "preparing batches (a get_batch() of your own) is part of \"everything else\", the "
                       "host's share of the step")
    if run.report.get("model") is None:
        m.notes.append("no model owning the optimizer's parameters was seen in a forward: forward and backward "
                       "are part of \"everything else\"")
    for note in (_replayed(run.report), loader_starts(run.report, m)):
        if note:
            m.notes.append(note)
    d = decide(m)
    framework = bool(run.report.get("trainer") or run.report.get("lightning"))
    for fix in d.fixes:
        fix.title = in_your_terms(fix, run.report, m.device_type)
        fix.prediction.basis = fix.prediction.basis.replace(  # what measures it, for a command
            "(--apply measures it)", trial_for(fix.changes, framework, m.device_type))
    return d, run


def _replayed(report: dict[str, Any]) -> str | None:
    """A note when the script's own stream is replayed by each of its loader workers (its fingerprint's first
    batches repeat): every sample trained on that many times."""
    loader = report["loaders"][0] if report["loaders"] else {}
    times = replayed(loader.get("fingerprint"))
    if times is None or not loader.get("num_workers"):
        return None
    return (f"the training loader's first batches repeat {times} times: each of its {loader['num_workers']} workers "
            f"yields the whole stream, so every sample is trained on {loader['num_workers']} times an epoch; "
            f"{shard_edit(loader['fingerprint'])}")


def loader_starts(report: dict[str, Any], m: Measurements) -> str | None:
    """A note on the training loader's first batch (measured: from asking for its iterator to the batch): where its
    workers start again every epoch (not persistent) and that wait is `POLICY.doctor.restart_share` of an epoch or
    more at the measured step time, the wait an epoch (a prediction) and the edit; else, a first batch that took
    `POLICY.doctor.first_batch_s` or more, once a run."""
    loader = report["loaders"][0] if report["loaders"] else {}
    starts = loader.get("starts") or []
    if not starts:
        return None
    first, workers, n = starts[0], loader.get("num_workers") or 0, loader.get("epoch_batches")
    waited = f"the training loader's first batch came {first:.2f} s after it was asked for (measured"
    again = f"; later epochs' first batches: {', '.join(f'{s:.2f}' for s in starts[1:])} s" if starts[1:] else ""
    if workers and not loader.get("persistent_workers") and n and m.step_s > 0:
        epoch_s = n / (m.grad_accum or 1) * m.step_s
        if first / (epoch_s + first) >= POLICY.doctor.restart_share:
            at = f"{loader['site']}: " if loader.get("site") else ""
            return (f"{waited}, its {workers} workers starting{again}); without persistent_workers they start again "
                    f"every epoch of {n} batches: about {first:.2f} s an epoch, {100 * first / (epoch_s + first):.0f} "
                    f"% of it at the measured step time (a prediction); {at}DataLoader(..., persistent_workers=True) "
                    "keeps them")
    if first >= POLICY.doctor.first_batch_s:
        return f"{waited}{again}): paid once a run" + (f", with its {workers} workers starting" if workers else "")
    return None


def trial_for(changes: dict[str, Any], framework: bool, device_type: str = "cpu") -> str:
    """What measures a fix no model predicts, for a command: `--apply` where saturate sets it from outside
    (`overrides.from_changes`), else `saturate tune -- CMD` where that tries it (precision; a Trainer's knobs), else
    a run of your own."""
    if from_changes(changes, framework, device_type) is not None:
        return "(--apply measures it)"
    if "precision" in changes or framework:
        return "(`saturate tune -- CMD` measures it)"
    return "(a run of your own with the change measures it: it needs your training code)"


def trainer_arguments(changes: dict[str, Any], trainer: dict[str, Any],
                      device_type: str = "cuda") -> tuple[dict[str, Any], dict[str, Any]]:
    """Fix or tuning `changes` as `TrainingArguments` fields (for a Transformers `Trainer`), and what has none.

    The effective batch is kept: a micro-batch without an accumulation gets the accumulation that keeps
    `per_device_train_batch_size × gradient_accumulation_steps` as written, when it divides exactly.
    """
    changes = dict(changes)
    written = trainer.get("args") or {}
    fields: dict[str, Any] = {}
    for knob, name in TRAINER_TERMS.items():
        if knob in changes:
            fields[name] = changes.pop(knob)
    if "micro_batch" in changes:
        micro = changes.pop("micro_batch")
        fields["per_device_train_batch_size"] = micro
        accum = changes.pop("grad_accum", None)
        effective = (written.get("per_device_train_batch_size") or 0) * \
            (written.get("gradient_accumulation_steps") or 1)
        if accum is None and micro and effective and effective % micro == 0:
            accum = effective // micro
        if accum is not None:
            fields["gradient_accumulation_steps"] = accum
    elif "grad_accum" in changes:
        fields["gradient_accumulation_steps"] = changes.pop("grad_accum")
    if "precision" in changes:
        precision = changes.pop("precision")
        fields["bf16"], fields["fp16"] = precision == "bf16", precision == "fp16"
        for name in ("bf16", "fp16"):  # only what changes from the script's own
            if not fields[name] and not written.get(name):
                del fields[name]
        if fields.get("bf16") and device_type == "cpu" and not written.get("use_cpu"):
            fields["use_cpu"] = True  # the Trainer takes bf16 on a CPU only when told to use the CPU
    if "compile" in changes:
        mode = changes.pop("compile")
        fields["torch_compile"] = bool(mode)
        if mode not in (True, False, None, "default"):
            fields["torch_compile_mode"] = mode
    if "activation_checkpointing" in changes:
        fields["gradient_checkpointing"] = changes.pop("activation_checkpointing")
    if "fused" in changes:
        fields["optim"] = "adamw_torch_fused" if changes.pop("fused") else "adamw_torch"
    if changes.pop("non_blocking", False):
        fields["dataloader_pin_memory"] = True
        fields["accelerator_config"] = {"non_blocking": True}
    return fields, changes


def lightning_arguments(changes: dict[str, Any], lightning: dict[str, Any]) -> dict[str, Any]:
    """The `Trainer(...)` arguments of a Lightning Trainer for a fix's `changes` (taking them out of `changes`):
    precision and accumulation; the loader's and the optimizer's knobs stay with their own calls."""
    fields: dict[str, Any] = {}
    if "precision" in changes:
        fields["precision"] = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(changes.pop("precision"), "32-true")
    if "grad_accum" in changes:
        fields["accumulate_grad_batches"] = changes.pop("grad_accum")
    return fields


def in_your_terms(fix: Fix, report: dict[str, Any] | None, device_type: str) -> str:
    """A fix's title naming the knobs where the user sets them, as written → as fixed: a Transformers Trainer's
    `TrainingArguments` fields, a Lightning Trainer's arguments (and its DataLoader's batch_size); else the
    doctor's own title (already in loop terms)."""
    report = report or {}
    if report.get("trainer"):
        fields, _ = trainer_arguments(fix.changes, report["trainer"], device_type)
        written = report["trainer"].get("args") or {}
    elif report.get("lightning"):
        changes = dict(fix.changes)
        fields = lightning_arguments(changes, report["lightning"])
        written = dict(report["lightning"].get("args") or {})
        if fields and "micro_batch" in changes and report.get("loaders"):
            fields = {"DataLoader batch_size": changes["micro_batch"], **fields}
            written["DataLoader batch_size"] = report["loaders"][0].get("batch_size")
    else:
        return fix.title
    if not fields:
        return fix.title
    return ", ".join(f"{k} {written[k]!r} → {v!r}" if k in written else f"{k}={v!r}" for k, v in fields.items())


def trainer_edit(fields: dict[str, Any], trainer: dict[str, Any]) -> str:
    """`train.py:LINE: TrainingArguments(..., field=value)`: the edit at the script's own arguments; for arguments
    its `HfArgumentParser` read from the command line, the flags to give (`--bf16 --per_device_train_batch_size 8`)."""
    site = trainer.get("args_site") or trainer.get("site")
    if trainer.get("args_from_command_line"):
        flags = " ".join(command_line_flag(k, v) for k, v in fields.items())
        parsed = f" (the script parses its {trainer.get('args_class') or 'TrainingArguments'} from the command line" \
                 f"{' at ' + site if site else ''})"
        return f"on the command line: {flags}{parsed}"
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"{site + ': ' if site else ''}{trainer.get('args_class') or 'TrainingArguments'}(..., {args})"


def command_line_flag(name: str, value: Any) -> str:
    """A TrainingArguments field as HfArgumentParser reads it: `--bf16` for True, `--bf16 False`, `--optim adamw`."""
    if value is True:
        return f"--{name}"
    return f"--{name} {value}"


def in_your_script(fix: Fix, report: dict[str, Any], device_type: str) -> list[str]:
    """Where and how to make `fix` in the user's own script, as far as the hooks saw it: in a Transformers
    `Trainer`'s `TrainingArguments` when the script has one; a Lightning `Trainer(...)`'s arguments for
    precision and accumulation; else (and for the rest) at its DataLoader, optimizer and model."""
    changes = dict(fix.changes)
    lines: list[str] = []
    if threads := changes.pop("threads", None):
        lines.append(f"torch.set_num_threads({threads}) before training, or OMP_NUM_THREADS={threads} in the script's "
                     "environment")
    if report.get("trainer"):
        fields, rest = trainer_arguments(changes, report["trainer"], device_type)
        return lines + ([trainer_edit(fields, report["trainer"])] if fields else []) \
            + [f"{k} = {v!r}" for k, v in rest.items()]
    if report.get("lightning"):
        lightning = report["lightning"]
        fields = lightning_arguments(changes, lightning)
        if fields:
            site = f"{lightning['site']}: " if lightning.get("site") else ""
            lines.append(f"{site}{lightning.get('class') or 'Trainer'}(..., "
                         f"{', '.join(f'{k}={v!r}' for k, v in fields.items())})")
    if {"micro_batch", "grad_accum"} <= set(changes) and (
            flags := split_flags(report, changes["micro_batch"], changes["grad_accum"])):
        del changes["micro_batch"], changes["grad_accum"]
        lines.append(f"on its command line: {flags} (the flags that hold its split)")
    loader = report["loaders"][0] if report["loaders"] else None
    loader_args = {k: changes.pop(k) for k in LOADER_KNOBS if k in changes}
    if "micro_batch" in changes:
        loader_args["batch_size"] = changes.pop("micro_batch")
    if loader_args.get("num_workers") and loader and ((loader.get("fingerprint") or {}).get("dataset") or {}).get(
            "shards") is False:  # a stream that does not shard: workers would each replay it
        lines.append(f"first, {shard_edit(loader['fingerprint'])} (its __iter__ never calls get_worker_info(): "
                     "without that, each worker yields the whole stream)")
    if loader_args:
        args = ", ".join(f"{k}={v!r}" for k, v in loader_args.items())
        at = f"{loader['site']}: " if loader and loader.get("site") else ""
        lines.append(f"{at}DataLoader(..., {args})")
    if "grad_accum" in changes:
        n = changes.pop("grad_accum")
        lines.append(f"accumulate {n} micro-batches per optimizer step (your accumulation setting), so the effective "
                     "batch stays the same" if n > 1 else "no accumulation: one micro-batch per optimizer step (your "
                     "accumulation setting), the effective batch as before")
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


def trainer_syncs(m: Measurements, trainer: dict[str, Any] | None) -> str | None:
    """For a Transformers Trainer whose host reads were counted inside its own training loop while it filters
    non-finite losses (`logging_nan_inf_filter`, on by default: `torch.isnan(loss) or torch.isinf(loss)` on every
    micro-step, two reads each), the flag that removes them — one line, or None."""
    if not trainer or not (trainer.get("in_force") or trainer.get("args") or {}).get("logging_nan_inf_filter"):
        return None
    inside = {k: v for k, v in m.syncs_by_site.items() if _nan_inf_check(k)}
    if not inside:
        return None
    reads = sum(inside.values())
    return (f"its Trainer reads {reads:g} values per step inside its loop ({', '.join(inside)}), two per micro-step "
            "to skip a nan/inf loss (logging_nan_inf_filter, on by default); each waits for a GPU: "
            f"{trainer_edit({'logging_nan_inf_filter': False}, trainer)} removes them (a prediction)")


def _nan_inf_check(site: str) -> bool:
    """Whether `transformers/trainer.py:LINE (from …)` is the Trainer's nan/inf check (the lines around LINE, in the
    Transformers installed here, test `isnan`/`isinf`)."""
    import importlib.util
    import linecache

    where = site.split(" ", 1)[0]
    if not where.startswith("transformers/trainer.py:"):
        return False
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "trainer.py")
    line = int(where.rsplit(":", 1)[1])
    lines = (linecache.getline(path, n) for n in range(line, line + 5))
    return any("isnan" in text or "isinf" in text for text in lines)


WRITES_SHOWN = 3  # the files a run wrote that its line names; the rest are counted


def writes_line(run: ScriptRun) -> str:
    """Where a doctor run's or a trial's writes went, in one line."""
    if run.written is None:
        return notice(run.command)
    if not run.written:
        return "none to your folders"
    shown = run.written[:WRITES_SHOWN]
    names = ", ".join(shown) + (f" and {len(run.written) - len(shown)} more" if run.written[len(shown):] else "")
    return f"{names} — kept in a scratch layer and removed: your folders are as they were"


def render_script(d: Diagnosis, run: ScriptRun, console: Console | None = None) -> None:
    """The doctor's report, then what the hooks found in the script and each fix in its terms."""
    console = console or tidy_console(highlight=False)
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
    trainer = report.get("trainer")
    if trainer:
        made = f" at {trainer['site']}" if trainer.get("site") else ""
        args_at = f" at {trainer['args_site']}" if trainer.get("args_site") else ""
        fields = ", ".join(f"{k}={v!r}" for k, v in (trainer.get("args") or {}).items() if k in SHOWN_FIELDS)
        console.print(Text(f"  Transformers {trainer['class']}{made}; {trainer.get('args_class')}{args_at}: {fields}"))
        if trainer.get("redirected", {}).get("output_dir"):
            console.print(Text(f"  its output_dir {trainer['args'].get('output_dir')!r} was not written: saturate "
                               "pointed it to a scratch folder for this run"))
    lightning = report.get("lightning")
    if lightning:
        made = f" at {lightning['site']}" if lightning.get("site") else ""
        shown = [f"{k}={v!r}" for k, v in (lightning.get("args") or {}).items() if v is not None]
        if (lightning.get("args") or {}).get("precision") is None and lightning.get("precision_in_force"):
            shown.insert(0, f"precision={lightning['precision_in_force']!r} (Lightning's default)")
        console.print(Text(f"  Lightning {lightning['class']}{made}: {', '.join(shown)}"))
        if lightning.get("redirected"):
            console.print(Text("  its default_root_dir was not written: saturate pointed it to a scratch folder "
                               "for this run"))
    for i, loader in enumerate(report.get("loaders", [])):
        role = ("the Trainer's DataLoader" if trainer else "training DataLoader") if i == 0 else "DataLoader"
        console.print(f"  {role} at {loader.get('site') or '?'}: batch_size={loader['batch_size']}, "
                      f"num_workers={loader['num_workers']}, pin_memory={loader['pin_memory']}"
                      + (f", {loader['batches']} batches in the timed steps" if loader.get("batches") else ""))
    if report.get("world_size", 1) > 1:
        console.print(f"  {report['world_size']} processes; rank 0 measured")
    if (line := trainer_syncs(d.measurements, trainer)) is not None:
        console.print(Text(f"  {line}"))
    console.print(Text(f"  its writes: {writes_line(run)}"))
    own = report.get("instrumentation") or {}
    if own.get("per_step_s") is not None and own.get("share_of_step") is not None:
        console.print(f"  saturate's hooks: {1e3 * own['per_step_s']:.3f} ms per timed step inside their own code "
                      f"({100 * own['share_of_step']:.2f} % of the step; measured, not counting torch's calls to them)")
    for i, fix in enumerate(d.fixes, 1):
        where = in_your_script(fix, report, d.measurements.device_type)
        if where:
            console.print(Text(f"  fix {i} ({fix.title}):", style="bold"))
            for line in where:
                console.print(Text(f"    {line}"))
