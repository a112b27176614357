"""The compile trial's stake: a run's budget grows for a compilation it has no room for.

A compilation is paid before its steps show what it gains, so what the search found before it cannot be what funds
it (`POLICY.payback.compile_stake`'s reason; measured: bench/results/cpu-2026-11-29c/README.md). So for the compile
trial a run's budget (one that may grow: `SearchSettings.budget_cap_s`) grows by what the compilation lacks, up to
`compile_stake` of the predicted training, plus one trial's length to confirm a gain (the incumbent measured
again), within the cap. Afterwards the stages that follow keep what they had before it: the stake pays only for the
seconds the compile stage ran past its room. When compiling gains nothing, that is what is lost. Nothing is staked
once a trial ran under load: on a busy machine a cold compilation can run past its whole stake (measured:
bench/results/cpu-2026-11-29c/README.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from saturate.policy import POLICY


@contextmanager
def staked(state: Any, what: str, need_s: float) -> Iterator[float | None]:
    """Around the compile stage of `state` (a SearchState): the budget grown so that a compilation of up to
    `need_s` seconds (what it could take and still pay back) has room, up to `POLICY.payback.compile_stake` of the
    predicted training, and a trial more to confirm a gain; settled after. Yields the most the compilation may then
    take (None: the budget was not grown)."""
    s, left = state.s, state.remaining()
    if left is None or s.budget_cap_s is None or not s.training_s or state.budget_spent:
        yield None
        return
    confirm = state.longest()
    room = max(0.0, left - confirm - state.verifying())  # for the compilation, as the budget stands
    stake = POLICY.payback.compile_stake
    want = min(need_s, stake * s.training_s)
    grown = min(s.budget_cap_s, s.budget_s + want - room + confirm)
    if want <= room or grown < s.budget_s + POLICY.payback.least_growth_s:
        yield None
        return
    if s.busy_before or any(t.contended for t in state.trials):  # under load, its length and gain are the load's
        state.skipped.append(f"{what}: no stake, other processes kept the machine busy during the search")
        yield None
        return
    state.decisions.append(
        f"budget: {s.budget_s:.0f} -> {grown:.0f} s for {what}: a compilation is paid before its steps are "
        f"timed, so up to {stake:.0%} of the {s.training_s:.0f} s training (a prediction) is staked on it")
    state.s = dataclasses.replace(s, budget_s=grown)
    started = state.now()
    try:
        yield room + grown - s.budget_s - confirm
    finally:  # what the stake added and the stage did not use goes back (a budget `earn` grew since keeps that)
        unused = max(0.0, grown - s.budget_s - max(0.0, state.now() - started - room))
        state.s = dataclasses.replace(state.s, budget_s=max(s.budget_s, state.s.budget_s - unused))
