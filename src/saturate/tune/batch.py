"""The stages that size the batch: the memory fit, the micro-batch climb, activation checkpointing.

Memory first: a line fitted to the peak memory at two or three micro-batches predicts which larger
ones fit, unless even the largest candidate fits with memory growing in proportion to the
micro-batch (peak = fixed + per-sample × micro-batch, both ≥ 0, so the proportional figure is an
upper bound) — then no memory trial is spent. The micro-batch climbs from the starting plan's
(the informed one's, as its first trial ran) while each step up is faster beyond the noise (a step
up that is faster within the noise is passed over: the next one is compared with the best so far),
then tries below when nothing above helped — both directions around it; checkpointing is tried only
when memory stopped a climb that was still gaining.
"""

from __future__ import annotations

from saturate.engine.grow import largest_proportional
from saturate.stats.comparison import compare
from saturate.tune.results import MemoryFit, fit_memory
from saturate.tune.state import SearchState, gib, rate
from saturate.tune.trial import Trial

FIT_POINTS = 2  # the micro-batches measured beside the best one for the memory fit: a line needs two more points


def proportional_bound(st: SearchState, best: Trial, top: int) -> str | None:
    """The decision line when micro-batch `top` fits even with peak memory proportional to the micro-batch from
    `best`'s measured peak (no fit needed); None when that bound does not fit or nothing was measured."""
    m0, peak = best.plan.micro_batch, best.peak_memory_bytes
    limit = int(st.m.memory_capacity * st.s.headroom)
    if peak is None or peak <= 0:
        return None
    bound = peak * max(top, m0) / m0
    if max(top, m0) > largest_proportional(peak, m0, limit):
        return None
    return (f"memory: {gib(peak)} peak {st.m.memory_kind} at micro-batch {m0}; even in proportion to the "
            f"micro-batch, {max(top, m0)} would use at most {gib(bound)} ≤ limit {gib(limit)} "
            f"({100 * st.s.headroom:.0f} % of {gib(st.m.memory_capacity)}): every candidate fits, no memory "
            "trial run (a prediction)")


def memory(st: SearchState, best: Trial) -> MemoryFit | None:
    """Peak memory at two or three small micro-batches, fitted with a line; not measured when even the largest
    candidate fits with memory growing in proportion to the micro-batch (`proportional_bound`)."""
    cands = st.candidates()
    if (said := proportional_bound(st, best, max(cands))) is not None:
        st.decisions.append(said)
        return None
    want = [m for m in cands if m < best.plan.micro_batch][:FIT_POINTS]
    if len(want) < FIT_POINTS:
        want += [m for m in cands if m > best.plan.micro_batch][: FIT_POINTS - len(want)]
    points = [(best.plan.micro_batch, best.peak_memory_bytes)] if best.peak_memory_bytes is not None else []
    for m in want:
        if not st.affordable(f"memory at micro-batch {m}"):
            break
        t = st.trial(st.at(best.plan, m), "memory", steps=1)
        if t.peak_memory_bytes is not None and t.ok:
            points.append((m, t.peak_memory_bytes))
            t.verdict = "memory point"
        else:
            t.verdict = f"{t.status}: {t.error}"
    points.sort()
    if len(points) < FIT_POINTS:
        st.skipped.append("memory fit: fewer than two measured points")
        return None
    fit = fit_memory(points, st.m.memory_capacity, st.s.headroom, st.m.memory_kind)
    if fit.slope <= 0:
        st.decisions.append(f"memory: peak {st.m.memory_kind} memory did not grow with the micro-batch "
                            f"({', '.join(f'{m}: {gib(b)}' for m, b in points)}); no limit predicted")
    else:
        top = max((m for m in cands if fit.fits(m)), default=None)
        st.decisions.append(
            f"memory: measured {', '.join(f'{m} -> {gib(b)}' for m, b in points)}; fit {gib(fit.intercept)} + "
            f"{gib(fit.slope)} per sample; limit {gib(fit.limit)} ({100 * st.s.headroom:.0f} % of "
            f"{gib(fit.capacity)}); largest micro-batch predicted to fit: {top} (a prediction)")
    return fit


def micro_batch(st: SearchState, best: Trial, fit: MemoryFit | None) -> Trial:
    cands = st.candidates()
    m0 = best.plan.micro_batch
    too_big = [m for m in cands if fit is not None and not fit.fits(m)]
    for m in too_big:
        st.skipped.append(f"micro-batch {m}: not tried, predicted {gib(fit.predict(m))} > "
                          f"limit {gib(fit.limit)}")
    fitting = [m for m in cands if m not in too_big]
    st.memory_capped = bool(too_big)
    stop, ran = "", len(st.trials)
    for m in [c for c in fitting if c > m0]:
        if not st.affordable(f"micro-batch {m}"):
            stop = "the tuning budget ran out"
            break
        t = st.trial(st.at(best.plan, m), "micro-batch")
        if not t.ok:
            t.verdict = f"{t.status}: {t.error}"
            st.memory_capped = st.memory_capped or t.status == "oom"
            stop = f"{m} ran out of memory" if t.status == "oom" else f"{m}: {t.status}"
            break
        taken, c, best, t = st.beats(t, best)
        if taken:
            best.verdict = f"{m}: {c.text()}"
            best = t
            continue
        if c.gain > 0 and m != max(fitting):  # faster, but not beyond the noise: a larger one may be, against best
            t.verdict = f"{c.text()} vs {best.plan.micro_batch}: not enough alone; a larger one is tried"
            continue
        t.verdict = f"{c.text()} vs {best.plan.micro_batch}: not enough to grow"
        stop = f"{m} measured {c.text()}"
        st.memory_capped = False
        break
    else:
        stop = "the largest micro-batch that fits" if st.memory_capped else "the largest candidate"
    if best.plan.micro_batch == m0:  # nothing above helped: try below
        for m in reversed([c for c in fitting if c < m0]):
            if not st.affordable(f"micro-batch {m}"):
                break
            t = st.trial(st.at(best.plan, m), "micro-batch")
            taken, c, best, t = st.beats(t, best) if t.ok else (False, None, best, t)
            if taken:
                best.verdict = f"{m}: {c.text()}"
                best = t
                continue
            t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()} vs {best.plan.micro_batch}"
            break
    p = best.plan
    st.decisions.append(f"micro-batch: {p.micro_batch} × {p.grad_accum} accumulation "
                        f"({rate(best)} measured; stopped because {stop})")
    if len(st.trials) > ran:  # a trial measured another micro-batch (else the starting one stands as it was)
        kept = p.micro_batch == st.base.micro_batch
        st.measured("micro_batch", f"{'' if kept else f'{p.micro_batch} × {p.grad_accum}: '}{rate(best)}; the "
                    f"micro-batch search stopped because {stop}", kept=kept)
    return best


def activation_checkpointing(st: SearchState, best: Trial, fit: MemoryFit | None) -> Trial:
    if best.plan.activation_checkpointing:
        return best  # forced on by the precision stage: the model does not fit without it
    bigger = [m for m in st.candidates() if m > best.plan.micro_batch]
    if not (st.memory_capped and bigger):
        st.decisions.append("activation checkpointing: off (the micro-batch search was not limited by memory)")
        return best
    start, without = best, best  # `without`: the incumbent's latest trial without recompute (measured again or not)
    outcome = "the budget had no room for a trial"
    for m in bigger:
        if not st.affordable(f"activation checkpointing at micro-batch {m}"):
            break
        t = st.trial(st.at(best.plan, m).replace(activation_checkpointing=True), "activation-checkpointing")
        taken, c, best, t = st.beats(t, best) if t.ok else (False, None, best, t)
        without = best if not best.plan.activation_checkpointing else without
        if taken:
            best.verdict = f"checkpointing at {m}: {c.text()}"
            best = t
            continue
        t.verdict = outcome = f"{t.status}: {t.error}" if c is None else c.text()
        break
    if not best.plan.activation_checkpointing:
        st.decisions.append("activation checkpointing: off (tried; larger micro-batches with recompute "
                            f"measured no faster: {outcome})")
    else:
        vs = compare(best, without, st.s.min_gain).text()
        st.measured("micro_batch", f"{best.plan.micro_batch} × {best.plan.grad_accum} with activation "
                    f"checkpointing: {vs} vs {start.plan.micro_batch} without")
        st.decisions.append(f"activation checkpointing: on, micro-batch {best.plan.micro_batch} with recompute "
                            f"is {compare(best, without, st.s.min_gain).text()} vs {start.plan.micro_batch} "
                            "without")
    return best
