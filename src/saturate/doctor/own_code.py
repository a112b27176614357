"""The verdict "own-code-bound": a step of the user's own loop spent mostly outside what saturate times in it.

A step's phases are the wait for data, the copy to the device, the model's forward, the backward and the
optimizer step; the rest is "other" — the loss, and whatever the script's own code does between them: an
environment stepped one action at a time (a reinforcement-learning loop), metrics, logging, a hand-made batch.
When that rest is `POLICY.doctor.own_code_share` (40 %) of the step or more over its whole range across the
timed windows, no knob saturate turns reaches it (each speeds up the phases), so the verdict says where the time
goes, names the host reads made in it (the lines that call `.item()`, on a GPU each a wait), and its fix is the
script's to make, with an upper bound: the step shrunk to its phases. A range that holds the threshold is a note.
It is the verdict only where no other rule holds (rules.decide), else a further finding: a fix inside the phases (a
larger micro-batch) may shrink that time too, and its bound counts all of it.
Only for a script's own loop (`Measurements.context == "loop"`): a preset's steps are saturate's code.
"""

from __future__ import annotations

from saturate.doctor.busy import UNDECIDED
from saturate.doctor.findings import VERDICTS, Finding, Fix, Measurements, Prediction, sites_line
from saturate.doctor.fixes import ms, pct
from saturate.policy import POLICY


def past(low: float, high: float, threshold: float) -> bool | None:
    """Whether a measured range is past a threshold: True when all of it is, False when none of it is, None when
    the threshold lies inside it (within the measurement's noise)."""
    return True if low >= threshold else False if high < threshold else None


def within_noise(what: str, low: float, high: float, threshold: float, verdict: str) -> Finding:
    """The note for a figure whose range straddles a threshold: nothing is called from it, no fix proposed."""
    return Finding("note", [
        f"{what} is {UNDECIDED} ({100 * low:.0f}..{100 * high:.0f} % vs {pct(threshold)}) of "
        f"{VERDICTS[verdict]} over the timed windows: not called either way and no fix proposed from it (a "
        "quieter machine or a longer measurement would decide)"])


def check_own_code(m: Measurements) -> Finding | None:
    """The finding when the step's "other" time is past `own_code_share` (module docstring), a note when within
    noise of it, else None."""
    if m.context != "loop" or not m.step_s:
        return None
    low, high = m.share_range("other")
    threshold = POLICY.doctor.own_code_share
    if (crossed := past(low, high, threshold)) is not True:
        return None if crossed is False else within_noise("the time outside the timed phases", low, high, threshold,
                                                        "own-code-bound")
    other = m.phases.get("other", 0.0)
    timed = ", ".join(f"{p} {pct(m.share(p))}" for p in ("data", "forward", "backward", "optimizer")
                      if m.phases.get(p))
    evidence = [f"{pct(m.share('other'))} of each step ({ms(other)} of {ms(m.step_s)}) is spent outside the data "
                f"wait, the forward, the backward and the optimizer step ({timed or 'none timed'}): in the loss "
                "and the script's own code between them" + (f" ({100 * low:.0f}..{100 * high:.0f} % over "
                                                              f"{len(m.window_shares)} timed windows)"
                                                              if len(m.window_shares) > 1 else "")]
    if m.syncs_by_site:
        evidence.append(f"it reads {m.syncs_per_step:g} values a step back to the host there "
                        f"({sites_line(m.syncs_by_site, seen=m.syncs_seen)})")
    fix = Fix("move the script's own per-step work off the step (batch it: a vectorised environment, metrics "
              "every N steps)", {},
              Prediction("step_s", m.step_s, m.step_s - other, "upper bound: the step shrinks to its timed phases"),
              "saturate's knobs speed up the phases it times; this time is in the script's own code (find it with "
              "`python -m cProfile -s cumtime` on the script)")
    return Finding("own-code-bound", evidence, [fix])
