"""The search's first stages: the starting plan measured, then the precision measured around it.

The search starts from the informed plan (`plan.default_plan`: what an expert would pick from the hardware
alone — bf16 where native, TF32 on Ampere and later, the fused optimizer where torch has the kernel, the
micro-batch from the rule or the memory model), measured as the first trial, and each stage measures the
alternative to the choice it holds rather than climbing from naive: where the starting plan has bf16, fp32 is
measured against it (and gives the reference losses bf16's are checked against); where it has fp32, the native
lower precision is measured (fp16 only on a CUDA GPU without bf16); on a CUDA device with TF32 tensor cores, the
other TF32 setting once fp32 is kept. An alternative replaces the incumbent only when faster beyond the noise
(`SearchState.beats`): within noise the incumbent stays, since it was chosen for a reason and changing it would
be a change no measurement supports. A lower precision whose first losses differ from fp32's by more than
`loss_tolerance` is rejected whatever its speed, the starting plan's too.

With a naive base (fp32, unfused: the tests' `Plan()`), this is the climb it always was.
"""

from __future__ import annotations

from saturate.engine.precision_guard import loss_drift  # the tuner's check, shared with training's guard
from saturate.engine.step import own_threads
from saturate.errors import SaturateError
from saturate.plan import Plan
from saturate.policy import Load
from saturate.policy.threads import threads_to_try
from saturate.provenance import Origin, mark, without
from saturate.tune.state import SearchState
from saturate.tune.trial import Trial


def precision_label(plan: Plan) -> str:
    if plan.precision == "fp32":
        return "fp32+tf32" if plan.tf32 else "fp32"
    return plan.precision




def busy_threads(st: SearchState, plan: Plan) -> Plan:
    """`plan` at the threads other processes left, when they kept the CPU busy just before the search
    (`SearchSettings.busy_before`): with torch's count, a thread the neighbour preempts stalls the rest at every
    parallel region, and a step can slow so much that a short budget holds no trial at all (measured:
    bench/results/cpu-2026-11-26c/README.md). torch's count is measured against it next (`all_threads`). On a CPU,
    in one process, for a plan without a count of its own."""
    busy = st.s.busy_before
    if busy is None or plan.threads is not None:
        return plan
    using = own_threads()
    choice = threads_to_try(st.m.device_type, st.s.world_size, using, Load(busy, st.m.cores))  # the stages' rule
    if choice.count is None:
        return plan
    free = choice.count
    said = f"other processes kept {busy:.1f} of {st.m.cores} cores busy just before it"
    st.decisions.append(f"threads: the first trial at {free} of torch's {using} ({said}); torch's count is measured "
                        "against it")
    return plan.replace(threads=free, provenance=mark(dict(plan.provenance), "threads", Origin.UNDER_LOAD,
                                                      f"the first trial's {free}: {said}"))


def all_threads(st: SearchState, ref: Trial) -> Trial:
    """torch's own thread count measured against a first trial that ran at fewer (`busy_threads`): the fewer are
    kept only when faster than torch's count beyond the noise — torch's count is what the user had, and what stays
    when the comparison cannot tell (as in `_Search.threads`). Under a bursty neighbour the two counts trade places
    with each burst (one thread far faster than torch's count under a steady load, slower on a quiet machine), and
    with the fewer as the incumbent, tunes kept them within noise of torch's count (measured:
    bench/results/cpu-2026-11-26d/README.md, bench/results/cpu-2026-11-26g/README.md)."""
    using, fewer = own_threads(), ref.plan.threads
    plain = without(ref.plan.provenance, "threads")
    if not st.affordable(f"torch's {using} threads"):
        mark(ref.plan.provenance, "threads", Origin.MEASURED, f"chosen while other processes kept the machine busy "
             f"(torch's {using} not measured: the budget)")
        return ref
    t = st.trial(ref.plan.replace(threads=None, provenance=plain), "threads")
    if not t.ok:
        t.verdict = f"{t.status}: {t.error}"
        st.decisions.append(f"threads: {fewer} of {using} (torch's {using} failed: {t.error}); a plan for a machine "
                            "this busy — on a quiet one, tune again")
        mark(ref.plan.provenance, "threads", Origin.MEASURED, "chosen while other processes kept the machine busy")
        return ref
    taken, c, t, ref = st.beats(ref, t)  # the fewer against torch's count: within the noise, torch's stays
    busy = f"other processes kept {ref.busy_cores or t.busy_cores or st.s.busy_before or 0:.1f} of {st.m.cores} " \
           "cores busy"
    plural = "s" if fewer > 1 else ""
    if not taken:
        t.verdict = f"torch's {using} threads: {fewer} thread{plural} measured {c.text()}"
        st.decisions.append(f"threads: torch's {using} ({busy}; {fewer} thread{plural} measured {c.text()} against "
                            "it)")
        return t
    st.leave_threads(fewer)
    ref.verdict = f"{fewer} thread{plural}: {c.text()}"
    st.decisions.append(f"threads: {fewer} of {using} ({busy}; {c.text()} against torch's {using}); a plan for a "
                        "machine this busy — on a quiet one, tune again")
    mark(ref.plan.provenance, "threads", Origin.MEASURED, f"chosen while {busy}")
    return ref


def start(st: SearchState) -> Trial:
    """The first trial: the starting plan at its micro-batch (the largest candidate within it), eager, without
    recompute. Out of memory: smaller micro-batches, then activation checkpointing. Failing otherwise: the
    simplest settings (fp32, unfused) before giving up."""
    s = st.s
    cands = st.candidates()
    m0 = max((m for m in cands if m <= max(1, min(st.base.micro_batch, st.local))), default=min(cands))
    plan = busy_threads(st, st.at(st.base, m0).replace(compile="none", activation_checkpointing=False,
                                                       fused_optimizer=st.base.fused_optimizer and s.fused_available))
    first = st.trial(plan, "precision")
    smaller = [m for m in cands if m < first.plan.micro_batch]
    while first.status == "oom" and smaller:  # even the starting micro-batch does not fit: back off
        first.verdict = "out of memory"
        first = st.trial(st.at(plan, smaller.pop()), "precision")
    if first.status == "oom":
        first.verdict = "out of memory"
        first = st.trial(first.plan.replace(activation_checkpointing=True), "precision")
        if first.status == "oom":
            first.verdict = "out of memory"
            fsdp = (" or shard it over the processes with strategy = \"fsdp\" (and cpu_offload) in the plan"
                    if first.plan.strategy == "ddp" else "")
            raise SaturateError("the model does not fit at micro-batch 1, even with activation checkpointing "
                                f"(tried {len(st.trials)} trials; last error: {first.error}); use a device with "
                                f"more memory or a smaller model{fsdp}")
        st.decisions.append("activation checkpointing: on, because the model does not fit at micro-batch 1 "
                            "without it")
    if first.plan.micro_batch != m0:
        st.measured("micro_batch", f"{m0} ran out of memory in the first trial; {first.plan.micro_batch} fits")
    simplest = first.plan.replace(precision="fp32", tf32=False, fused_optimizer=False)
    if not first.ok and first.plan.knobs() != simplest.knobs():
        first.verdict = f"{first.status}: {first.error}"
        st.decisions.append(f"start: the starting plan failed ({first.error}); the search starts from fp32 with "
                            "the unfused optimizer instead")
        for knob in ("precision", "tf32", "fused_optimizer"):
            st.measured(knob, f"the starting plan failed in its first trial ({first.error})")
        first = st.trial(simplest, "precision")
    if not first.ok:
        raise SaturateError(f"the workload fails to train at {precision_label(first.plan)}, micro-batch "
                            f"{first.plan.micro_batch}: {first.error}")
    return first


def _alternatives(st: SearchState, incumbent: Trial) -> list[Plan]:
    """The other precisions worth measuring against the incumbent's (module docstring), its TF32 kept."""
    s, p = st.s, incumbent.plan
    tf32 = p.tf32 if p.precision != "fp32" else bool(s.supports.get("tf32"))  # a lower precision gets TF32
    native = ["bf16"] if s.supports.get("bf16") else (
        ["fp16"] if s.supports.get("fp16") and st.m.device_type == "cuda" else [])
    if p.precision == "fp32":
        return [p.replace(precision=x, tf32=tf32) for x in native]
    return [p.replace(precision="fp32")] + [p.replace(precision=x) for x in native if x != p.precision]


def precision(st: SearchState, first: Trial, first_losses: list[float]) -> Trial:
    """The precision around the first trial's (module docstring); returns the incumbent's latest trial."""
    s = st.s
    best, start_label = first, precision_label(first.plan)
    ref_losses = first_losses if first.plan.precision == "fp32" else None  # fp32's own, from its first steps
    said: list[str] = []  # what each alternative measured, for the decision line
    start_t = first  # the starting plan's latest trial (measured again, or timed in pairs, by `beats`)
    # Why a lower starting precision is not checked against fp32's losses ("" once it is, or when it is fp32).
    unchecked = "the budget had no room for an fp32 trial" if first.plan.precision != "fp32" else ""
    for plan in _alternatives(st, first):
        label = precision_label(plan)
        if not st.affordable(f"precision {label}"):
            break
        t = st.trial(plan, "precision")
        if not t.ok:
            t.verdict = f"{t.status}: {t.error}"
            said.append(f"{label} {t.verdict}")
            if plan.precision == "fp32" and unchecked:
                unchecked = f"its fp32 trial failed ({t.error})"
            continue
        if plan.precision == "fp32" and ref_losses is None:
            ref_losses, unchecked = t.losses, ""
            drift = loss_drift(first_losses, ref_losses)
            if drift > s.loss_tolerance:  # the starting precision fails the check: fp32, whatever the speeds
                differ = (f"first {len(first_losses)} losses differ from fp32's by up to {100 * drift:.1f} % "
                          f"(> {100 * s.loss_tolerance:.0f} %)")
                why = best.verdict = f"{start_label}'s {differ}"
                st.decisions.append(f"precision: {start_label} (chosen from the hardware) rejected, its {differ}")
                said.append(f"{start_label} rejected: {why}")
                best = t
                continue
            best.loss_drift = first.loss_drift = drift
        elif plan.precision != "fp32":
            drift = loss_drift(t.losses, ref_losses or [])
            if drift > s.loss_tolerance:
                t.verdict = f"losses differ from fp32 by up to {100 * drift:.1f} % (> {100 * s.loss_tolerance:.0f} %)"
                st.decisions.append(f"precision: {label} rejected, its first {len(t.losses)} losses differ from "
                                    f"fp32 by up to {100 * drift:.1f} %")
                said.append(f"{label} rejected (losses)")
                continue
            t.loss_drift = drift
        was, holding = precision_label(best.plan), best is start_t
        taken, c, best, t = st.beats(t, best)
        start_t = best if holding else start_t  # the starting plan's latest trial: what the line compares with
        if taken:
            best.verdict = f"{label}: {c.text()}"
            said.append(f"{label} {c.text()} vs {was}: taken")
            best = t
        else:
            t.verdict = f"{c.text()} vs {was}" + ("" if c.slower else f", {was} is kept")
            said.append(f"{label} {t.verdict}")
    best = tf32(st, best, said)
    label = precision_label(best.plan)
    drift = best.loss_drift
    checked = (f"; its first losses are within {100 * drift:.2f} % of fp32's"
               if drift is not None and best.plan.precision != "fp32" else "")
    if unchecked and best.plan.precision != "fp32":
        warning = f"{start_label} (chosen from the hardware) was not checked against fp32's losses: {unchecked}"
        st.warnings.append(warning)
        st.decisions.append(f"precision: {label} ({warning})")
    elif said:
        moved = (f", {best.samples_per_s / start_t.samples_per_s:.2f}× {start_label} samples/s"
                 if label != start_label and best.samples_per_s and start_t.ok and start_t.samples_per_s else
                 " (the starting plan's)" if label == start_label else "")
        st.decisions.append(f"precision: {label}{moved} at micro-batch {best.plan.micro_batch} "
                            f"({'; '.join(said)}){checked}")
        kept = best.plan.precision == st.base.precision
        st.measured("precision", f"{'' if kept else label + ': '}{'; '.join(said)}{checked}", kept=kept)
    else:
        native = "no lower precision is native here" if not _alternatives(st, first) else "the budget had no room"
        st.decisions.append(f"precision: {label} ({native}; {best.samples_per_s:.1f} samples/s at micro-batch "
                            f"{best.plan.micro_batch})")
    return best


def tf32(st: SearchState, best: Trial, said: list[str]) -> Trial:
    """On a CUDA device with TF32 tensor cores and fp32 kept: the other TF32 setting against the incumbent's."""
    if not (st.s.supports.get("tf32") and st.m.device_type == "cuda" and best.plan.precision == "fp32"):
        return best
    plan = best.plan.replace(tf32=not best.plan.tf32)
    label, was = precision_label(plan), precision_label(best.plan)
    if not st.affordable(f"precision {label}"):
        return best
    t = st.trial(plan, "precision")
    taken, c, best, t = st.beats(t, best) if t.ok else (False, None, best, t)
    if taken:
        best.verdict = f"{label}: {c.text()}"
        said.append(f"{label} {c.text()} vs {was}: taken")
        st.measured("tf32", f"{'on' if plan.tf32 else 'off'}: {c.text()} vs {was}")
        return t
    t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()} vs {was}" + (
        "" if c.slower else f", {was} is kept")
    said.append(f"{label} {t.verdict}")
    if c is not None:
        kept = best.plan.tf32 == st.base.tf32
        st.measured("tf32", f"{'' if kept else ('on' if best.plan.tf32 else 'off') + ': '}{label} measured "
                    f"{c.text()}", kept=kept)
    return best
