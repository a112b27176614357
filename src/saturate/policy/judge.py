"""One judge: a candidate against the incumbent, from what was measured and under which load, to a `Decision`.

    judge(comparison, Evidence.TRIALS, Load(1.0), Load(1.0))   -> Decision(KEPT, Reason.FASTER, …)

Every verb that keeps or drops a change asks this: the preset tuner (tune/state.py `SearchState.decide`), the
script tuner (script/tune_script.py, its paired and its lone trials), `run -- CMD`'s side-by-side
(script/run_script.py `confirmed`). How the figures compare is `stats.comparison` (beyond both spreads and
`POLICY.gains.min_gain`); what the judge adds is whether that comparison may decide *alone*, given how it was
measured (`Evidence`) and the load each side saw (`policy.Load`):

- two separate trials (`TRIALS`) decide a gain alone only when it is decisive — at least `gains.confirm_below` and
  `gains.decisive_noise` times the noise — and the machine was quiet for both, or both saw the same load
  (`Load.same_as`); two trials under an uneven load (`Load.uneven_with`) are not compared at all; a gain on a lone
  window (its noise not measured) is never kept alone. Otherwise a gain is `CONFIRM`: measure again, as the caller
  can (pairs in alternating windows, or the incumbent again right after);
- one process's alternating windows (`PAIRS`, tune/paired.py) decide alone: both plans shared every stretch;
- two live runs in alternating windows (`RUN_PAIRS`, script/gated.py) decide a gain alone only from
  `gains.again_below` up, and only while the best run's speed held (`aged`): a run's speed has a part that stays
  with its process, so a smaller gain is timed again on a fresh pair of runs;
- a side-by-side in interleaved rounds (`ROUNDS`, stats/rounds.py) keeps what was faster in every round.

A `Decision` is data (an outcome, a reason, the gain and its interval, the loads); its text is rendered from it
(`Decision.text`), so no caller reads a decision back out of prose.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from saturate.policy.active import POLICY
from saturate.policy.load import Load
from saturate.stats.comparison import Comparison, Verdict
from saturate.stats.rounds import Ratio


class Evidence(enum.Enum):
    TRIALS = "separate trials"
    PAIRS = "alternating windows in one process"
    RUN_PAIRS = "alternating windows of two live runs"
    RUN_PAIRS_AGAIN = "alternating windows of two pairs of live runs"  # a gain timed again on a fresh pair
    ROUNDS = "interleaved rounds"


class Outcome(enum.Enum):
    KEPT = "kept"
    NOT_KEPT = "not kept"
    CONFIRM = "to be confirmed"  # a gain the evidence cannot decide alone: measure again
    UNDECIDED = "not decided"  # nothing to decide on (no comparison: a run ended before its pairs)


class Reason(enum.Enum):
    FASTER = "faster beyond the noise"
    SLOWER = "slower beyond the noise"
    WITHIN_NOISE = "within noise"
    UNDER_MIN_GAIN = "under the minimum gain"
    SMALL_GAIN = "a gain too small to decide alone"
    COULD_GAIN = "a worthwhile gain within the noise"
    BUSY = "measured while other processes kept the machine busy, unevenly"
    UNEVEN_LOAD = "measured under loads too different to compare"
    ONE_WINDOW = "one window: its noise not measured"
    DRIFTED = "the best run's speed moved since it was first paired"
    NO_COMPARISON = "no comparison"


_FROM_VERDICT = {Verdict.FASTER: Reason.FASTER, Verdict.SLOWER: Reason.SLOWER,
                 Verdict.WITHIN_NOISE: Reason.WITHIN_NOISE, Verdict.UNDER_MIN_GAIN: Reason.UNDER_MIN_GAIN}


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: Reason
    evidence: Evidence
    gain: float | None = None  # candidate / incumbent - 1
    noise: float | None = None  # the gain is known to about ± this
    loads: tuple[float | None, float | None] = (None, None)  # other processes' cores: candidate's, incumbent's
    comparison: Comparison | None = field(default=None, compare=False, repr=False)

    @property
    def kept(self) -> bool:
        return self.outcome is Outcome.KEPT

    @property
    def to_confirm(self) -> bool:
        return self.outcome is Outcome.CONFIRM

    def text(self) -> str:
        """The figures and the reason, e.g. "+8.0 %, beyond noise (±2.0 %) (separate trials): to be confirmed, a
        gain too small to decide alone"."""
        figures = self.comparison.text() if self.comparison is not None else "no comparison"
        return f"{figures} ({self.evidence.value}): {self.outcome.value}, {self.reason.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "reason": self.reason.value, "evidence": self.evidence.value,
                "gain": self.gain, "noise": self.noise, "loads": list(self.loads)}


def judge(c: Comparison | None, evidence: Evidence, candidate: Load | None = None, incumbent: Load | None = None,
          *, busy: tuple[bool, bool] | None = None, one_window: bool = False, aged: bool = False) -> Decision:
    """What `c` (the candidate against the incumbent) decides, measured as `evidence` says, under the loads each
    side saw (`candidate`, `incumbent`: None, not read). `busy`: whether each side saw the machine busy (default:
    from the loads; a caller whose meter also counts a GPU's other processes says so); `one_window`: a side was
    timed in a single window; `aged`: the live best run's speed moved since its first paired windows
    (script/drift.py). A `CONFIRM` on separate trials that is not faster asks for more only where a load could
    have hidden a gain, or a worthwhile one lies within the noise; a caller that can only measure the incumbent
    again does so for a gain alone."""
    a, b = candidate or Load(None), incumbent or Load(None)
    loads = (a.other_cores, b.other_cores)

    def decided(outcome: Outcome, reason: Reason) -> Decision:
        return Decision(outcome, reason, evidence, None if c is None else c.gain, None if c is None else c.noise,
                        loads, c)

    if c is None:
        return decided(Outcome.UNDECIDED, Reason.NO_COMPARISON)
    plain = Outcome.KEPT if c.faster else Outcome.NOT_KEPT
    if evidence in (Evidence.PAIRS, Evidence.ROUNDS, Evidence.RUN_PAIRS_AGAIN):
        return decided(plain, _FROM_VERDICT[c.verdict])
    g = POLICY.gains
    if evidence is Evidence.RUN_PAIRS:
        if c.faster and aged:
            return decided(Outcome.CONFIRM, Reason.DRIFTED)
        if c.faster and c.gain < g.again_below:
            return decided(Outcome.CONFIRM, Reason.SMALL_GAIN)
        return decided(plain, _FROM_VERDICT[c.verdict])
    # Separate trials: a burst that spanned one of them whole moves its figure without widening its spread.
    busy_a, busy_b = (a.busy, b.busy) if busy is None else busy
    loaded = busy_a or busy_b
    alike = busy_a and busy_b and c.noise_known and a.same_as(b)  # both under load, and the same
    uneven = Reason.UNEVEN_LOAD if a.uneven_with(b) else Reason.BUSY
    if c.faster and (alike or not loaded) and not (one_window and not c.noise_known) \
            and c.gain >= max(g.confirm_below, g.decisive_noise * c.noise):
        return decided(Outcome.KEPT, Reason.FASTER)
    if loaded and not alike:
        return decided(Outcome.CONFIRM, uneven)  # a load could have made, or hidden, the difference
    if c.faster:
        return decided(Outcome.CONFIRM, Reason.ONE_WINDOW if one_window and not c.noise_known else Reason.SMALL_GAIN)
    if c.gain + g.decisive_noise * c.noise > c.min_gain:
        return decided(Outcome.CONFIRM, Reason.COULD_GAIN)  # a worthwhile gain within the noise
    return decided(Outcome.NOT_KEPT, _FROM_VERDICT[c.verdict])


def judge_rounds(r: Ratio | None) -> Decision:
    """What a side-by-side in interleaved rounds decides (`Evidence.ROUNDS`): kept when faster in every round."""
    if r is None:
        return Decision(Outcome.UNDECIDED, Reason.NO_COMPARISON, Evidence.ROUNDS)
    reason = Reason.FASTER if r.faster else Reason.SLOWER if r.slower else Reason.WITHIN_NOISE
    return Decision(Outcome.KEPT if r.faster else Outcome.NOT_KEPT, reason, Evidence.ROUNDS, r.median - 1,
                    max(r.median - r.low, r.high - r.median))


def confirms(again: Comparison) -> bool:
    """Whether the candidate against the incumbent measured again right after (`again`) confirms a gain the
    first comparison could not decide alone: faster beyond the noise a second time."""
    return again.faster
