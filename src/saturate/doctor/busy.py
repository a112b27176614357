"""The doctor on a busy machine: the verdict "contended", and which findings stand whatever the neighbours did.

`check_contention` is the rule: other processes kept a significant share of our cores busy (or held our GPU)
while we measured (`hardware.contention`), so the timings are partly theirs. `decide()` (rules.py) then keeps
the fixes only of the findings `stands_under_load` says the load cannot cause — the memory risks (what was
allocated), a wait for data inside the training process's own loader (no workers: a neighbour slows loading and
computing alike, so the share is the workload's), host syncs on an accelerator (counted, not timed), a fixed-cost
share from the batch-scaling probe's back-to-back rounds (a ratio of two sizes under the same load) on an
accelerator or one CPU thread — each labelled by `under_load` with how busy the machine was. A fixed-cost share
read from the device's idle time or on several CPU threads (`stalls`), or workers racing the step, could be the
neighbours' doing: listed, with no fix. On several CPU threads the doctor therefore takes the probe again on one
(`loop_probe.again_on_one_thread`) when the machine was busy, and the share on several is bounded from it
(`one_thread_bounds`): at least the one thread's, at most what it would be were the per-sample part shared out
perfectly, plus a margin for the threads' own barriers. A floor over the threshold is overhead-bound and stands; a
ceiling under it leaves no fixed-cost finding (the verdict, load apart, is compute-bound); between, nothing is
called. With that second probe, a micro-step is also timed on the run's threads and on one, back to back
(`loop_probe.time_thread_counts`): one thread measured faster beyond the rounds' spread is contended's own fix
(`threads_fix`), for a machine this busy. Our own loader workers and torch threads oversubscribing a CPU run's
cores is a note.

When the load is the only finding — no wait, sync or fixed cost found (on a CPU, the batch-scaling probe ran),
none within noise of its threshold — the verdict is the workload's own, compute-bound, said as measured on a busy
machine (`compute_under_load`), with "contended" listed beside it: what a neighbour adds is time, not a
bottleneck of the workload's, and a verdict that turned on whether a burst overlapped the timed steps read
"contended" or "compute-bound" by chance (measured: bench/results/cpu-2026-11-25/README.md).
"""

from __future__ import annotations

import dataclasses
import statistics

from saturate.doctor.findings import Finding, Fix, Measurements, Prediction, ScalingProbe
from saturate.doctor.fixes import knob
from saturate.policy import POLICY, Load
from saturate.stats.noise import trimmed


def check_contention(m: Measurements) -> Finding | None:
    """Others on our cores or GPU: the verdict "contended". Our own workers and threads oversubscribing: a note."""
    own = None
    if not m.accelerator and m.num_workers and m.cpu_threads is not None \
            and m.cpu_threads + m.num_workers > m.cpu_cores:
        own = (f"{m.num_workers} loader worker(s) and {m.cpu_threads} intra-op threads share {m.cpu_cores} cores: on "
               "a CPU run every worker wake-up can stall the training's threads at a barrier; "
               f"torch.set_num_threads({max(1, m.cpu_cores - m.num_workers)}) leaves the workers a core")
    if m.contention and m.contention.get("significant"):
        fix, measured = threads_fix(m)
        evidence = [m.contention.get("line") or "other processes were using this machine while it was measured",
                    "the timings include the neighbours' share, so they do not describe this workload alone: no fix "
                    "is proposed from a finding their load could have produced (run the doctor again on a quieter "
                    "machine for those)" + ("" if fix is None else
                                            "; the fix here is for the load itself, measured under it")]
        load = Load(m.contention.get("other_cores"), m.contention.get("usable_cores") or m.cpu_cores)
        if not m.accelerator and m.cpu_threads and m.cpu_threads > 1 and load.busy and not own:
            fewer = min(m.cpu_threads - 1, load.threads_left(m.cpu_cores or m.cpu_threads))
            own = (f"torch's {m.cpu_threads} intra-op threads wait for one another at every parallel region, so one "
                   f"that a neighbour preempts stalls them all: on a CPU this busy, fewer threads can be much faster "
                   f"(torch.set_num_threads({fewer}), or `threads = {fewer}` in a plan; `saturate tune` measures it "
                   "when the machine is busy)" + ("" if m.threads_ratios else " — not measured in this run"))
        return Finding("contended", evidence + [x for x in (own, measured) if x], [fix] if fix else [])
    return Finding("note", [own]) if own else None


def threads_fix(m: Measurements) -> tuple[Fix | None, str | None]:
    """On a busy CPU run on several threads, one thread as a fix for the load when the probe's rounds measured a
    micro-step on one faster beyond their spread and by `POLICY.doctor.gain_min` (the rounds: `threads_ratios`),
    with the line saying what they measured; (None, the line) when they did not; (None, None) unmeasured.
    Under a steady neighbour several threads can take many times as long as one (measured:
    bench/results/cpu-2026-11-29/README.md)."""
    r, n = m.threads_ratios, m.cpu_threads or 1
    if m.accelerator or n == 1 or len(r) < POLICY.doctor.min_rounds:
        return None, None
    kept = trimmed(list(r))
    mid = statistics.median(r)
    line = (f"measured: a micro-step's forward and backward took {kept[0]:.2f}–{kept[-1]:.2f}× (median {mid:.2f}×) "
            f"as long on {n} intra-op threads as on one, the two timed back to back in {len(r)} rounds on the "
            "machine as busy as it was")
    if kept[0] < (gain := POLICY.doctor.gain_min):
        return None, f"{line}: not faster on one beyond the rounds' spread and by {100 * (gain - 1):.0f} %"
    fb = m.phases.get("forward", 0.0) + m.phases.get("backward", 0.0)
    after = m.step_s - fb + fb / mid
    return Fix(f"{knob(m, 'threads')} {n} → 1 (while the machine is this busy)", {"threads": 1},
               Prediction("step_s", m.step_s, after, f"forward and backward as timed, divided by the rounds' median "
                          f"ratio ({mid:.2f}×); the rest of the step as measured, though it ran on {n} threads too"),
               "a neighbour that preempts one of several threads stalls every parallel region; a lone thread it only "
               "slows — a setting for a machine this busy: on a quiet one, measure again"), line


def one_thread_bounds(m: Measurements) -> tuple[float, float] | None:
    """The range of the fixed share at the run's micro-batch on its `cpu_threads` threads, from the probe taken again
    on one thread (a busy CPU: `loop_probe.again_on_one_thread`); None without one. On n threads the per-sample work
    is shared out and the fixed part is not: the share there is at least the one thread's (its low end), and at most
    what it would be were the per-sample part n times faster (its high end), plus a margin for the threads' own
    barriers (POLICY.doctor.barrier_margin) — or the run's own probe's high end where that is lower (on several
    threads the load adds a fixed part: see `stalls`). Where the two probes disagree (a floor over the ceiling), the
    range spans both."""
    p, b, n = m.scaling_one_thread, m.micro_batch, m.cpu_threads or 1
    if p is None or m.scaling is None or not b or m.accelerator or n == 1 or len(p.ratios) < POLICY.doctor.min_rounds:
        return None
    low, high = p.fixed_share_range(b)
    ceiling = min(1.0, high / (high + (1 - high) / n) + POLICY.doctor.barrier_margin, m.scaling.fixed_share_range(b)[1])
    return min(low, ceiling), max(low, ceiling)


def fixed_share_read(m: Measurements) -> tuple[ScalingProbe, float, float, str]:
    """The probe a fixed share is read from, the share's range at the run's micro-batch, and how it was timed: from
    the probe on one thread when it bounds the share (`one_thread_bounds`: ", on one thread"), else from the run's
    own probe ("")."""
    assert m.scaling is not None and m.micro_batch
    if (bounds := one_thread_bounds(m)) is not None:
        assert m.scaling_one_thread is not None  # one_thread_bounds needs it
        return m.scaling_one_thread, *bounds, ", on one thread"
    return m.scaling, *m.scaling.fixed_share_range(m.micro_batch), ""


def one_thread_line(m: Measurements) -> str:
    """The evidence line for a fixed share read from the probe on one thread."""
    bounds, p = one_thread_bounds(m), m.scaling_one_thread
    assert bounds is not None and p is not None and m.micro_batch
    low, high = bounds
    return (f"the batch-scaling probe was taken again on one of torch's {m.cpu_threads} intra-op threads, the machine "
            f"being busy: a lone thread a neighbour preempts slows both sizes alike, where one of several stalls every "
            f"parallel region whatever the size; there the fixed part is {100 * p.fixed_share(m.micro_batch):.0f} % "
            f"(rounds {p.kept_ratios()[0]:.2f}–{p.kept_ratios()[-1]:.2f}×), so on {m.cpu_threads} threads, which share "
            f"out only the per-sample work, it is bounded to {100 * low:.0f}..{100 * high:.0f} % (the upper end as if "
            f"they shared it perfectly, plus {100 * POLICY.doctor.barrier_margin:.0f} points for their own barriers, "
            "or the run's own probe where lower: a bound, not a measurement)")


def from_one_thread(fixes: list[Fix], m: Measurements) -> list[Fix]:
    """`fixes`, their predictions said to rest on the probe on one thread when they do (`one_thread_bounds`)."""
    if one_thread_bounds(m) is None:
        return fixes
    said = (f"the fit timed on one thread, where the fixed part's share is the smaller: on {m.cpu_threads} threads "
            "the gain should be larger")
    return [dataclasses.replace(x, prediction=dataclasses.replace(x.prediction, basis=f"{x.prediction.basis}; {said}"))
            for x in fixes]


def fixed_cost_line(m: Measurements) -> str | None:
    """The fixed part of a micro-step for a compute-bound verdict's evidence, or None without a probe."""
    if m.scaling is None or not m.micro_batch:
        return None
    if one_thread_bounds(m) is not None:
        return one_thread_line(m)
    return f"fixed per-micro-step cost {100 * m.scaling.fixed_share(m.micro_batch):.0f} % of a micro-step"


UNDECIDED = "within noise of the threshold"  # a note's words for a figure the doctor called neither way


def nothing_but_load(verdicts: list[Finding], notes: list[Finding], m: Measurements) -> bool:
    """Whether the load is all that was found: every verdict "contended", no figure left undecided near its
    threshold (which the load's scatter could have kept from being called), and on a CPU the fixed part measured
    (the batch-scaling probe ran): without it a fixed cost is not ruled out, and "compute-bound" could propose a
    fix that is slower for an overhead-bound script (measured: bench/results/cpu-2026-11-28g/README.md). A fixed
    share measured under the threshold on a busy CPU stands: the load only adds to it."""
    return (m.accelerator or m.scaling is not None) and all(f.verdict == "contended" for f in verdicts) \
        and not any(UNDECIDED in e for n in notes for e in n.evidence)


def compute_under_load(f: Finding, m: Measurements) -> Finding:
    """The compute-bound finding `f`, said as measured on a busy machine."""
    busy = (m.contention or {}).get("line") or "other processes were using this machine"
    return Finding(f.verdict, [f"measured on a busy machine ({busy}): the steps are slower for it, but nothing in "
                               "them points elsewhere than the computation — the neighbours add time, not a wait "
                               "for data, a sync or a fixed cost", *f.evidence], f.fixes)


def stands_under_load(f: Finding, m: Measurements) -> str | None:
    """Why a finding holds whatever the neighbours did, or None when their load could have produced it."""
    if f.verdict in ("oom-risk", "host-memory-bound"):
        return "what was allocated is not timing"
    if f.verdict == "contended" and f.fixes:  # one thread, measured against several under the load itself
        return "measured under the load itself"
    if f.verdict == "input-bound" and m.num_workers == 0:
        return ("the wait is the training process loading its own batches (no loader workers): a neighbour slows "
                "loading and computing alike, so the share is the workload's")
    if f.verdict == "sync-bound":
        return "host-device syncs are counted, not timed"
    if f.verdict == "overhead-bound" and one_thread_bounds(m) is not None:
        return (f"its floor was timed on one thread, where a neighbour's load slows both micro-batch sizes alike; on "
                f"{m.cpu_threads} threads the share is higher still")
    if f.verdict == "overhead-bound" and m.scaling is not None and len(m.scaling.ratios) >= POLICY.doctor.min_rounds \
            and (m.accelerator or m.cpu_threads == 1):
        return ("the fixed part rests on the ratio of two micro-batch sizes timed back to back, round after round: "
                "a neighbour's load slows both alike")
    return None


def stalls(m: Measurements) -> str | None:
    """Why a fixed part measured on a busy CPU with several intra-op threads may be the load's, or None. A thread a
    neighbour preempts holds up each parallel region by a time slice whatever the micro-batch, which reads as a
    fixed cost. Under a burst the probe's rounds scatter; under a steady load they agree and are still wrong — so
    the rounds' agreement cannot tell, and on several threads the share does not stand — unless the probe taken
    again on one thread bounds it (`one_thread_bounds`; measured: bench/results/cpu-2026-11-28g/README.md)."""
    p = m.scaling
    if m.accelerator or (m.cpu_threads or 1) == 1 or p is None or not (m.contention or {}).get("significant") \
            or one_thread_bounds(m) is not None:
        return None
    kept = p.kept_ratios()
    return (f"this may be the load's: with torch's {m.cpu_threads} intra-op threads, a thread a neighbour preempts "
            "holds up each parallel region by a time slice whatever the micro-batch, which reads as a fixed part "
            f"(the probe's rounds: {kept[0]:.2f}–{kept[-1]:.2f}× from the smaller micro-batch to the larger); no fix "
            "from it (one thread, or a quieter machine, measures it)")


def under_load(f: Finding, m: Measurements) -> Finding:
    """`f` as said on a busy machine: unchanged when the load could have produced it (it keeps no fix: decide()
    leaves those out), else its evidence says how busy and why it stands, its predictions what they rest on."""
    why = None if f.verdict == "contended" else stands_under_load(f, m)
    if why is None:
        if f.verdict == "overhead-bound" and (stall := stalls(m)):
            return Finding(f.verdict, [f"measured on a busy machine; {stall}", *f.evidence], f.fixes)
        return f
    busy = (m.contention or {}).get("line") or "other processes were using this machine"
    fixes = [dataclasses.replace(x, prediction=dataclasses.replace(
        x.prediction, basis=f"{x.prediction.basis}; calibrated on steps timed while the machine was busy"))
        for x in f.fixes]
    return Finding(f.verdict, [f"measured on a busy machine ({busy}); this stands: {why}", *f.evidence], fixes)
