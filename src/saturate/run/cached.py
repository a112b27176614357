"""`saturate run` and the plan cache: whether a plan is cached for the job, the cached plan as it can be used now,
and the plan a run found faster replacing a cached one."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from saturate import plan_cache
from saturate.engine.resume import threads_for_now
from saturate.plan import Plan
from saturate.workloads.base import Workload


def cache_holds(workload: Workload, hw: Any, world: int, try_compile: bool) -> bool:
    """Whether a plan is cached for this job that `_tune` would reuse (without the load check it then makes)."""
    plan, _ = plan_cache.lookup(workload, hw.fingerprint(), world)
    return plan is not None and int(plan.provenance.get("world_size", 1)) == world and (
        try_compile or plan.compile == "none")


def cached_plan(workload: Workload, hw: Any, world: int, try_compile: bool, notes: list[str]) -> Plan | None:
    """The plan tuned for this workload on this hardware at this process count, if it can be used as it is; a
    thread count it was tuned with for a busy machine checked against the load now, as `train` does."""
    plan, _ = plan_cache.lookup(workload, hw.fingerprint(), world)
    if plan is None or int(plan.provenance.get("world_size", 1)) != world:
        return None
    if not try_compile and plan.compile != "none":
        return None
    return plan if plan.threads is None else threads_for_now(plan, hw, notes, world)


def recache(workload: Workload, hw: Any, world: int, tuned: Plan, faster: Any) -> str:
    """The cache keeps the plan trained instead of the tuned one (measured faster in every round, or the tuned
    plan failed side by side), so that the next `saturate run` of this job does not reuse a plan this run found
    slower; the line that says so."""
    provenance = {**(tuned.provenance or {}), "measured_samples_per_s": faster.samples_per_s,
                  "replaced_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "replaced_because": f"{faster.label}: trained instead (the tuned plan measured slower in every "
                                      "round side by side, or failed there)"}
    provenance.pop("verified_samples_per_s", None)
    path = plan_cache.store(faster.plan.replace(name="tuned", provenance=provenance), workload, hw.fingerprint(), world)
    return f"the cached plan for this job is now {faster.label}'s settings ({path}); --budget tunes again"
