"""When tuning pays for itself: the shares of a job a search, a side-by-side or a compilation may spend."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule


@dataclass(frozen=True)
class PaybackRules:
    """What share of a job's predicted training the tuning, the side-by-side and a compilation may cost."""

    saving_share: float = rule(0.5, "the share of a found saving the search may spend on finding more; the rest is "
                               "the user's (the side-by-side spends no more than the search left of it)",
                               "tune/state.py SearchState.earn; run/sizing.py least_allowance")
