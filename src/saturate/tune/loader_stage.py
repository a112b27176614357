"""The input pipeline's stage: the cheapest DataLoader setting that feeds the model, within the RAM budget.

Every worker count of a ladder is measured at the default prefetch (loader trials are cheap, and
plotted), deeper prefetch only where that did not feed the model, pinned memory on CUDA last.

A setting feeds the model when its rate is `loader_margin`× the model's beyond both figures'
noise: the ratio loader ÷ (margin × model) is known to ± the two spreads added (stats/comparison.py),
and its lower bound must pass 1. A setting whose figure passes the need but whose lower bound does
not is "within noise" of it: chosen only when none feeds beyond the noise, and said so. How a
setting fits the need is a value (`Fit`, with the text that explains it), and the choice branches
on the value, never on its text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from saturate.plan import Plan
from saturate.stats.comparison import Comparison, compare
from saturate.stats.noise import rate_text
from saturate.tune.state import SearchState, gib
from saturate.tune.trial import LoaderTrial, Trial


@dataclass(frozen=True)
class Need:
    """What the loader must deliver: `loader_margin`× the model's rate, known to the model's spread."""

    samples_per_s: float
    spread: float | None


class Fit(enum.Enum):
    """How a loader setting's measured rate fits the need."""

    FEEDS = "feeds"  # passes the need beyond both figures' noise
    WITHIN_NOISE = "within noise"  # short of that, but the need is within the noise of its rate
    TOO_SLOW = "too slow"  # below the need beyond the noise
    NOT_MEASURED = "not measured"  # no rate to compare


@dataclass(frozen=True)
class Fitted:
    """A setting's fit and what explains it ("" when it feeds: nothing to say)."""

    fit: Fit
    text: str = ""


def ladder(cores: int) -> list[int]:
    """The worker counts measured: none, powers of two up to the cores, and the cores."""
    return sorted({0, *[w for w in (1, 2, 4, 8, 16, 32) if w <= cores], cores})


def against_need(t: LoaderTrial, need: Need) -> Comparison:
    """The loader's rate against the need (both figures' spreads are the noise)."""
    return compare(t, need, 0.0)


def feeds(c: Comparison) -> bool:
    """The loader's rate passes the need beyond the noise (its lower bound passes it)."""
    return c.gain - c.noise >= 0


def fit(t: LoaderTrial, need: Need) -> Fitted:
    """How the setting's rate fits the need, with why it does not feed the model beyond the noise."""
    if not t.samples_per_s:
        return Fitted(Fit.NOT_MEASURED, "not measured")
    if not need.samples_per_s:
        return Fitted(Fit.FEEDS)  # nothing needed (the model was not measured): any rate feeds it
    c = against_need(t, need)
    if feeds(c):
        return Fitted(Fit.FEEDS)
    head = f"{rate_text(t.samples_per_s, t.spread)} vs {need.samples_per_s:.0f} needed"
    if c.within_noise:
        return Fitted(Fit.WITHIN_NOISE, f"{head}: within noise (±{100 * c.noise:.1f} %)")
    return Fitted(Fit.TOO_SLOW, f"{head}: too slow")


def loader(st: SearchState, best: Trial) -> Plan:
    """The cheapest loader setting that feeds the model (module docstring), within the RAM budget."""
    s, m = st.s, st.m
    need = Need(s.loader_margin * (best.samples_per_s or 0.0), best.spread)
    wanted = (f"{need.samples_per_s:.0f} samples/s ({s.loader_margin:g}× the model's "
              f"{rate_text(best.samples_per_s, best.spread)})")
    cuda = m.device_type == "cuda"
    base = best.plan.replace(pin_memory=False, non_blocking=False, persistent_workers=False, prefetch_factor=None)

    def setting(w: int, pf: int | None, pin: bool) -> Plan:
        return base.replace(num_workers=w, prefetch_factor=pf if w else None, persistent_workers=w > 0,
                            pin_memory=pin, non_blocking=pin)

    def refused(t: LoaderTrial) -> str:
        """Why a setting is out of bounds whatever its speed ("" when it is within them)."""
        if not t.ok:
            return f"{t.status}: {t.error}"
        if t.worker_memory_bytes and t.worker_memory_bytes > m.ram_budget:
            return f"workers use {gib(t.worker_memory_bytes)} > RAM budget {gib(m.ram_budget)}"
        if t.swap_grew_bytes > 0:
            return f"swap grew by {gib(t.swap_grew_bytes)}"
        return ""

    measured: list[tuple[Plan, LoaderTrial]] = []

    def measure(plan: Plan) -> LoaderTrial:
        t = m.loader_trial(plan)
        st.loader_trials.append(t)
        st.on_trial(t)
        measured.append((plan, t))
        return t

    for w in ladder(m.cores):  # the whole worker ladder at the default prefetch: it is cheap and plotted
        if not st.affordable(f"loader with {w} workers", loader=True):
            break
        measure(setting(w, 2, False))
    for p, t in list(measured):  # deeper prefetch only where the default did not feed the model
        if (p.num_workers and not refused(t) and fit(t, need).fit is not Fit.FEEDS
                and st.affordable(f"loader prefetch 4, {p.num_workers}", loader=True)):
            measure(setting(p.num_workers, 4, False))
    within = [(p, t) for p, t in measured if not refused(t)]
    feeding = [(p, t) for p, t in within if fit(t, need).fit is Fit.FEEDS]
    maybe = [(p, t) for p, t in within if fit(t, need).fit is Fit.WITHIN_NOISE]

    def cheapest(options: list[tuple[Plan, LoaderTrial]]) -> tuple[Plan, LoaderTrial]:
        return min(options, key=lambda pt: (pt[0].num_workers, pt[0].prefetch_factor or 0))

    ct: LoaderTrial | None
    if feeding:
        chosen, ct = cheapest(feeding)
        why = (f"{rate_text(ct.samples_per_s, ct.spread)} alone, ≥ the {wanted} beyond both figures' noise; the "
               "cheapest setting that does")
    elif maybe:
        chosen, ct = cheapest(maybe)
        why = (f"{rate_text(ct.samples_per_s, ct.spread)} alone against the {wanted}: within noise, so it may not "
               "always keep up; the cheapest setting that may")
    elif within:
        chosen, ct = max(within, key=lambda pt: pt[1].samples_per_s or 0)
        why = (f"the fastest within the RAM budget, {rate_text(ct.samples_per_s, ct.spread)}, under the "
               f"{wanted}: this run will be input-bound")
    elif not measured:  # the starting plan's loader stays (chosen from the cores and the device, or none)
        chosen, ct = best.plan, None
        why = ("not measured: the tuning budget ran out first; " + (
            "the starting plan's setting is kept" if best.plan.num_workers or best.plan.pin_memory
            else "loading in the training process"))
    else:
        chosen, ct = setting(0, None, False), None
        why = "no loader setting could be measured within the RAM budget; loading in the training process"
    for _p, t in measured:
        t.verdict = "chosen" if t is ct else (refused(t) or fit(t, need).text or "costlier than the chosen setting")
    if cuda and ct is not None and st.affordable("pinned memory", loader=True):
        pinned_plan = setting(chosen.num_workers, chosen.prefetch_factor, True)
        pt = measure(pinned_plan)
        if not refused(pt) and fit(pt, need).fit is not Fit.TOO_SLOW:
            pt.verdict = "chosen: pinned batches let the copy to the GPU overlap compute"
            ct.verdict = "pinned is preferred when it still feeds the model"
            chosen = pinned_plan
        else:
            pt.verdict = refused(pt) or fit(pt, need).text
    if measured:
        st.measured("loader", f"{chosen.num_workers} worker(s), pinned {'yes' if chosen.pin_memory else 'no'}: {why}")
    st.decisions.append(f"loader: {chosen.num_workers} workers, prefetch {chosen.prefetch_factor or '-'}, "
                        f"pinned {'yes' if chosen.pin_memory else 'no'} ({why})")
    return chosen

