"""`saturate tune -- CMD`'s stages for a framework's trainer (a Transformers or a Lightning `Trainer`), by
measurement.

Called by `tune.tune_command` when the as-written run saw a trainer; each stage runs trials through the
search (`consider`: a run of the script with the overrides, kept only when measured faster beyond both
trials' noise and `POLICY.gains.min_gain`) and adds a decision line (`stage`). The stages are the same for every
framework; what a knob is called there, what the script wrote and which overrides set it come from the
framework's adapter (`Framework`, implemented in `frameworks.py`), which says instead why a knob cannot be
set from outside. Order:

1. precision: bf16 where native (else fp16 on CUDA), accepted only when every one of the first steps' losses
   is within the tuner's tolerance of the script's own (trials start from the same seed);
2. micro-batch × accumulation over the exact splits of the effective batch as written: upwards while each
   gains; if none above helped, one step down; not searched when the script's model has batch-coupled layers
   (BatchNorm: the micro-batch is part of its maths, `coupled.py`) unless `--allow-micro-batch-change`;
3. activation checkpointing, only where memory stopped a larger micro-batch, at that micro-batch; not on a CPU;
4. the fused optimizer;
5. compile, not on a CPU; accepted only when faster and when the steps the trainer plans, times the time
   saved per step, exceed the extra start-up the compile cost.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any, Protocol

from saturate.policy import POLICY
from saturate.script.overrides import AUTOCAST_DEVICES, Overrides
from saturate.stats.comparison import Verdict
from saturate.tune.start import loss_drift

Option = tuple[str, Overrides] | str  # a trial's name and overrides, or why the knob is not tried


class Search(Protocol):
    """What the stages need of `tune._Search`."""

    result: Any  # tune.ScriptTuning

    def consider(self, name: str, overrides: Overrides,
                 check: Callable[[Any], str | None] | None = None) -> Any: ...

    def kept(self, t: Any) -> bool: ...

    def with_overrides(self, overrides: Overrides) -> Overrides: ...


class Framework(Protocol):
    """A framework's trainer as the as-written run saw it: its knobs in its own terms."""

    checkpointing_knob: str  # how the decisions name activation checkpointing ("gradient_checkpointing")
    compile_knob: str
    planned_steps: int | None  # optimizer steps the trainer plans (compile's pay-back)

    def lower_precision(self) -> str | None:
        """The lower precision the script already trains in, or None (fp32)."""

    def precision(self, name: str, device: str) -> tuple[str, Overrides]:
        """The trial of precision `name` ("bf16", "fp16")."""

    def split(self) -> tuple[int, int] | str:
        """The micro-batch and accumulation as written, or why they cannot be changed from outside."""

    def split_overrides(self, micro: int, accum: int) -> Overrides: ...

    def checkpointing(self) -> Overrides | str:
        """The overrides that turn activation checkpointing on, or why not."""

    def fused(self) -> Option: ...

    def compile(self) -> Option: ...


def trainer_stages(search: Search, fw: Framework, supports: dict[str, bool], model: dict[str, Any] | None = None,
                   allow_micro_batch_change: bool = False, try_compile: bool = True) -> None:
    """Precision, micro-batch × accumulation, checkpointing, fused optimizer and compile, in that order. `model`:
    the report's model (its batch-coupled layers keep the micro-batch unless `allow_micro_batch_change`)."""
    decisions = search.result.decisions
    device = search.result.device_type
    base = search.result.baseline
    trial = functools.partial(stage, search)

    # 1. precision, checked against the script's own losses
    name = "bf16" if supports.get("bf16") else "fp16" if supports.get("fp16") and device == "cuda" else None
    if (own := fw.lower_precision()) is not None:
        decisions.append(f"precision: the script already trains in {own}")
    elif name is None:
        decisions.append(f"precision: fp32 (no lower precision is native on {device})")
    else:
        trial("precision", fw.precision(name, device), lambda t: _loss_problem(t, base))

    # 2. micro-batch × accumulation at the same effective batch
    memory_stopped = split_stage(search, fw, model, allow_micro_batch_change)

    # 3. activation checkpointing, only where memory stopped a larger micro-batch
    knob = fw.checkpointing_knob
    over = fw.checkpointing()
    if device == "cpu":
        decisions.append(f"{knob}: not tried on cpu (it trades recompute for memory; host memory did not limit "
                         "the micro-batch)")
    elif isinstance(over, str) or memory_stopped is None:
        decisions.append(f"{knob}: {over}" if isinstance(over, str) else f"{knob}: not tried (no larger micro-batch "
                         "ran out of memory, so recomputing activations could only cost time)")
    else:
        micro, effective = memory_stopped
        trial(knob, (f"{knob} at micro-batch {micro}", over.merged(fw.split_overrides(micro, effective // micro))))

    # 4. the fused optimizer, where the optimizer step is a share of the step another kernel could gain on
    trial("fused optimizer", worth_fusing(fw.fused(), search.result))

    # 5. compile, where it can pay back its compile time
    option = fw.compile() if try_compile else "not tried (--no-compile)"
    if device == "cpu" and not isinstance(option, str):
        option = ("not tried on cpu (compiling takes tens of seconds here, more than a trial's steps can show "
                  "back; try it where the model runs on a GPU)")
    best = search.result.best
    trial(fw.compile_knob, option, lambda t: _compile_problem(t, best, fw.planned_steps or 0))


def loop_precision(search: Search, report: dict[str, Any], supports: dict[str, bool]) -> None:
    """A plain loop's precision: bf16 autocast from outside (`Overrides.bf16_autocast`, child/loop_precision.py)
    where bf16 is native on its device, kept only when faster and when its first losses are within the tuner's
    tolerance of the script's own (`report`: the as-written run's, its "loop" the script's own autocast and
    losses) — not tried where its forward and backward take too small a share of the step for any precision to
    gain the minimum gain (tune/bound.py's bound: an input-bound loop)."""
    from saturate.tune.bound import most_gained, not_worth

    decisions, device, loop = search.result.decisions, search.result.device_type, report.get("loop") or {}
    share, over = _compute_share(report)
    if own := loop.get("own_autocast"):
        decisions.append(f"precision: the script already trains in {own} (its own torch.autocast)")
    elif device not in AUTOCAST_DEVICES or not supports.get("bf16"):
        decisions.append(f"precision: fp32 (bf16 is not native on {device})")
    elif not_worth(share, POLICY.gains.min_gain):
        decisions.append(f"precision: bf16 autocast not tried (forward and backward took {100 * share:.1f} % of the "
                         f"step (measured{over}): a lower precision can gain at most {100 * most_gained(share):.1f} %, "
                         f"under {1 / POLICY.stages.bound_margin:.0%} of the {100 * POLICY.gains.min_gain:.0f} % a "
                         "change must gain)")
    elif not loop.get("losses"):
        decisions.append("precision: bf16 autocast not tried (the script's losses were not seen: nothing to check "
                         "a lower precision against)")
    else:
        base = search.result.baseline
        stage(search, "precision", ("bf16 autocast", Overrides(bf16_autocast=device)),
              lambda t: _loss_problem(t, base))


def _compute_share(report: dict[str, Any]) -> tuple[float | None, str]:
    """The share of the step a trial's forward and backward took (None: no model seen, so not split), and how it
    was taken: the median over the Profiler's timed windows where there are several — one window a neighbour's
    burst or a page fault slowed must not make an input-bound loop's compute look large enough to try a precision
    for (a suite run once tried bf16 on such a loop; the likely reading) — else over the whole timed stretch."""
    m = report.get("measurements") or {}
    phases, step = m.get("phases") or {}, m.get("step_s") or 0.0
    if not report.get("model") or step <= 0 or "forward" not in phases:
        return None, ""
    windows = [w.get("forward", 0.0) + w.get("backward", 0.0) for w in m.get("window_shares") or []]
    if len(windows) > 1:
        return statistics.median(windows), f", the median of {len(windows)} timed windows"
    return (phases["forward"] + phases.get("backward", 0.0)) / step, ""


def stage(search: Search, knob: str, option: Option, check: Callable[[Any], str | None] | None = None) -> None:
    """One knob: its trial through the search (kept only when measured faster), or why it is not tried; either
    way a decision line."""
    decisions = search.result.decisions
    if isinstance(option, str):
        decisions.append(f"{knob}: {option}")
        return
    label, over = option
    t = search.consider(label, search.with_overrides(over), check)
    decisions.append(f"{knob}: {t.outcome}" if label.startswith(knob) else f"{knob}: {label} {t.outcome}")


def worth_fusing(option: Option, result: Any) -> Option:
    """`option` (the fused optimizer's trial), or why it is not tried: the script's optimizer step — the Profiler's
    optimizer phase, the largest share of the step any run so far measured — too small for another kernel to gain
    the minimum gain (tune/bound.py)."""
    from saturate.tune.bound import bound_text, not_worth

    if isinstance(option, str):
        return option
    share = max((t.optimizer_share for t in (result.baseline, *result.trials) if t.ok and t.optimizer_share),
                default=None)
    gain = POLICY.gains.min_gain
    return f"not tried ({bound_text('optimizer step', share, gain)})" if not_worth(share, gain) else option


def split_stage(search: Search, fw: Any, model: dict[str, Any] | None = None, allow_change: bool = False,
                check: Callable[[Any], str | None] | None = None) -> tuple[int, int] | None:
    """Climb the exact splits of the effective batch; (the micro-batch, the effective batch) where a larger
    micro-batch ran out of memory, else None. Not with batch-coupled layers in the model, unless allowed. `fw`: a
    `Framework`, or anything with its `split` and `split_overrides` (`loop_split.LoopSplit`); `check`: each trial's
    (`consider`'s)."""
    decisions = search.result.decisions
    written = fw.split()
    if isinstance(written, str):
        decisions.append(f"micro-batch: {written}")
        return None
    micro, accum = written
    keep, line = kept_split(model, micro, accum, allow_change)
    if line:
        decisions.append(line)
    if keep:
        return None
    effective = micro * accum
    splits = [d for d in range(1, effective + 1) if effective % d == 0]
    memory_stopped, chosen, tried = None, (micro, accum), []

    def consider(m: int) -> Any:
        tried.append(f"{m} × {effective // m}")
        t = search.consider(f"micro-batch {m} × {effective // m}", search.with_overrides(
            fw.split_overrides(m, effective // m)), check)
        if search.kept(t):
            nonlocal chosen
            chosen = (m, effective // m)
        return t

    level, unreached = False, False  # level: a split up measured level with the best (the climb goes one past it)
    for m in [d for d in splits if d > micro]:
        t = consider(m)
        if not t.ok and t.out_of_memory:
            memory_stopped = (m, effective)
        if search.kept(t):
            continue
        unreached = bool((t.same or {}).get("changed"))  # the change did not reach the loop as it should: no more
        if level or unreached or not _level(t):
            break
        level = True
    if chosen == written and not unreached and (below := [d for d in splits if d < micro]):
        consider(below[-1])
    decisions.append(f"micro-batch: {chosen[0]} × accumulation {chosen[1]} (as written {micro} × {accum}; the "
                     f"effective batch {effective} kept; tried: {', '.join(tried) or 'no other exact split'})")
    return memory_stopped


def _level(t: Any) -> bool:
    """Whether a trial measured level with the best so far: within the noise (either way: the noise could flip its
    sign), or under the minimum gain and no slower. A split that may sit on a plateau, or whose runs ended before
    its pairs could tell: the climb goes one split past it, since the next may still be faster (measured:
    bench/results/cpu-2026-11-28g/README.md)."""
    return t.ok and (t.verdict == Verdict.WITHIN_NOISE.value
                     or (t.verdict == Verdict.UNDER_MIN_GAIN.value and (t.gain or 0.0) >= 0.0))


def _loss_problem(t: Any, reference: Any) -> str | None:
    """Why a lower precision's first losses are not close enough to the script's own, or None."""
    if not t.losses or not reference.losses:
        return "no per-step losses to compare with the script's own"
    n = min(len(t.losses), len(reference.losses))
    drift = loss_drift(t.losses, reference.losses)
    if drift > POLICY.job.loss_tolerance:
        return (f"its first {n} losses differ from the script's own by up to {100 * drift:.1f} % "
                f"(> {100 * POLICY.job.loss_tolerance:.0f} %)")
    t.note = f"its first {n} losses within {100 * drift:.2f} % of the script's own"
    return None


def _compile_problem(t: Any, best: Any, planned_steps: int) -> str | None:
    """Why a compiled trial does not pay back its compile time within the planned steps, or None."""
    if t.first_step_s is None or best.first_step_s is None or not planned_steps:
        return "its compile time or the planned steps are unknown"
    extra = t.first_step_s - best.first_step_s
    saved = (best.step_s - t.step_s) * planned_steps
    if saved <= extra:
        return f"{planned_steps} planned steps would save {saved:.0f} s, less than the {extra:.0f} s compile"
    return None


def kept_split(model: dict[str, Any] | None, micro: int, accum: int, allow_change: bool) -> tuple[bool, str | None]:
    """(whether the split must be kept, the decision line saying why or what searching it changes; None when
    the report's model has no batch-coupled layers, `child/coupled.py`)."""
    layers = (model or {}).get("batch_coupled")
    if not layers:
        return False, None
    what = f"the model has batch-coupled layers ({', '.join(layers)})"
    if allow_change:
        return False, (f"micro-batch: searched although {what} (--allow-micro-batch-change): another micro-batch "
                       "changes its maths, so the losses differ from the script's own")
    return True, (f"micro-batch: not searched ({what}: the micro-batch is part of its maths; kept at {micro} × "
                  f"accumulation {accum} as written; --allow-micro-batch-change searches it)")
