"""A job too short to tune (`run -- CMD`): when it is, and the settings it gets without measuring.

A tuning costs several runs of the script's first steps; a job that ends inside its first trial, or whose Trainer
plans fewer steps than that tuning could pay back even at 2× faster, is not tuned past that trial. Its full run
takes only the settings that change nothing in the training — workers (not over a stream that does not shard itself
by worker) and pinned memory, as the informed starting plan chooses them (`plan.default_plan`), and on a CPU that
faults pages in fast the host allocator's thresholds — each said as chosen, not measured; precision, micro-batch,
compile, the fused optimizer, TF32 and threads are left as written.
"""

from __future__ import annotations

from typing import Any

from saturate.data.fingerprint import shard_edit
from saturate.policy import POLICY
from saturate.prior import informed_workers
from saturate.script.overrides import NONE, Overrides
from saturate.script.script_trial import ScriptTrial
from saturate.script.tuning import ScriptTuning


def too_short(base: ScriptTrial, trial_s: float, framework: Any, report: dict[str, Any] | None = None) -> str | None:
    """Why the job is too short to tune (one line; its figures predictions from the as-written trial), or None:
    it ran to its end inside that trial, or the steps it plans take less than `POLICY.payback.short_factor` times
    the trials a tuning would run (`trials_framework`, `trials_plain`) — a Trainer's planned steps, or for a plain
    loop the length its settings say (`compile_stage.planned_steps` of the as-written `report`; none read: only the
    first holds for it)."""
    from saturate.script.compile_stage import planned_steps

    if base.ran_to_end:
        return f"the script ran to its end inside its first trial ({trial_s:.0f} s)"
    planned = getattr(framework, "planned_steps", None)
    if framework is None and report is not None and not isinstance(read := planned_steps(report), str):
        planned = read[0]
    if not planned or base.step_s <= 0:
        return None
    job = planned * base.step_s
    p = POLICY.payback
    tuning = (p.trials_framework if framework is not None else p.trials_plain) * trial_s
    if job >= p.short_factor * tuning:
        return None
    return (f"{planned} planned steps take about {job:.0f} s at the as-written speed, a tuning about {tuning:.0f} s "
            f"(predictions from the first trial): it could not pay for itself")


def prior_overrides(result: ScriptTuning, cores: int) -> tuple[Overrides, list[str]]:
    """What a short job gets without measuring: only settings that change nothing in the training — the first
    DataLoader's workers (on a GPU from the cores, one kept for the training process, at most 4, as the informed
    plan takes them; on a CPU, where workers take cores from the step, 2 only when the as-written trial waited
    for data at least `POLICY.doctor.input_share` of its step), pinned memory on a GPU, and on a CPU glibc's allocator
    thresholds when the as-written trial faulted at least `FAULTS_WORTH_TRYING` pages a second (with or without
    a DataLoader). Returns them and one line per decision, each saying it was chosen, not measured."""
    from saturate.engine.host_alloc import FAULTS_WORTH_TRYING, left_alone

    said = []
    changes: dict[str, Any] = {}
    loader = result.loaders[0] if result.loaders else None
    gpu = result.device_type == "cuda"
    if loader is None:
        said.append("loader settings: no DataLoader in the first trial; none applied")
    else:
        written = loader.get("num_workers") or 0
        share, waits = result.baseline.data_share, POLICY.doctor.input_share
        workers, why = informed_workers(result.device_type, cores, data_share=share)  # the informed prior's rule
        stream = (result.baseline.fingerprint or {}).get("dataset") or {}
        if workers > written and stream.get("shards") is False:  # each worker would replay the whole stream
            said.append(f"loader workers: {written} as written (its stream does not shard itself by worker, so each "
                        f"worker would yield all of it; {shard_edit(result.baseline.fingerprint)})")
        elif workers > written:
            changes.update(num_workers=workers, persistent_workers=True)
            said.append(f"loader workers {written} → {workers}: chosen, not measured ({why})")
        else:
            said.append(f"loader workers: {written} as written (waiting for data {100 * share:.0f} % of the step"
                        + ("" if gpu else "; on a CPU workers take cores from the step below "
                           f"{100 * waits:.0f} %") + ")")
        if gpu and not loader.get("pin_memory"):
            changes["pin_memory"] = True
            said.append("pinned memory: chosen, not measured (copies to the GPU can overlap the step)")
    faults = result.baseline.faults_per_s or 0.0
    alloc = not gpu and left_alone() is None and faults >= FAULTS_WORTH_TRYING
    if alloc:
        said.append(f"host allocator thresholds raised: chosen, not measured (the first trial faulted {faults:,.0f} "
                    "pages in a second; glibc then reuses the step's buffers, and nothing in the training changes)")
    said.append("not applied without measuring: precision, micro-batch, compile, the fused optimizer, TF32, threads")
    return (Overrides(loader=changes, host_alloc=alloc) if changes or alloc else NONE), said
