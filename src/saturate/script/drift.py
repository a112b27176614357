"""Whether a live run's speed still stands for its setting beside a fresh run.

The script tuner keeps the best run so far alive and pairs it with each new candidate (`gated.py`), so the two
runs of a comparison are of different ages: the incumbent may be hundreds of steps further into its training.
Most scripts run at one speed once warm, and then age does not matter. Some do not: pytorch/examples'
word_language_model with AdamW at its default learning rate of 20 diverges, its loss going from 10 to 780 in its
first steps, and its run slowed to a third of its speed as it did; beside it, a fresh run read a gain that two
fresh runs side by side did not (measured: bench/results/cpu-2026-11-28f/README.md). A schedule that grows
the sequence length, or a cache that fills, moves a run's speed the same way.

So before a gain against a live run is kept on one pair of runs, the live run's speed in this comparison is set
against its speed in its own first paired windows: when it moved by more than `POLICY.gains.drift`, or the load
from other processes differed too much between the two stretches to tell, the gain is timed again on a fresh pair
of runs of the same age (`gated.again`). The check cannot tell age from a load the meter does not see; either way the
gain is retimed, at the cost of one more pair of runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Protocol

from saturate.policy import POLICY, Load
from saturate.stats.pairs import MIN_PAIRS as FIRST  # its first paired windows: its speed when young


class Timed(Protocol):
    rate: float
    other_cores: float | None
    alone: bool


def moved(windows: Sequence[Timed], since: int) -> str | None:
    """Why the live run whose timed `windows` from index `since` are this comparison's cannot be compared as it is
    with a fresh run (said as why the gain is timed again), or None: it was fresh for this comparison (no paired
    window before it), or its speed held."""
    earlier = [w for w in windows[:since] if not w.alone][:FIRST]
    now = [w for w in windows[since:] if not w.alone]
    if not earlier or not now:
        return None
    load_then = statistics.median(w.other_cores or 0.0 for w in earlier)
    load_now = statistics.median(w.other_cores or 0.0 for w in now)
    again = "timed again on a fresh pair of runs: "
    if Load(load_now).uneven_with(Load(load_then)):  # a load this different between the two stretches: not known
        return (f"{again}other processes kept {load_then:.1f} cores busy in the best so far's first paired windows "
                f"and {load_now:.1f} in these, so whether its speed held since is not known")
    then, later = statistics.median(w.rate for w in earlier), statistics.median(w.rate for w in now)
    if abs(later / then - 1) <= POLICY.gains.drift:
        return None
    return (f"{again}the best so far's run timed {then:.3g} steps/s in its first paired windows and {later:.3g} in "
            "these: a run whose speed moved (with its progress, or with a load the meter does not see) is not "
            "compared with a fresh run as it is")
