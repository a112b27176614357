"""Tuned plans cached per workload and hardware: `train` reuses them, and flags one tuned elsewhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from saturate.data.token_cache import cache_root
from saturate.errors import ConfigError
from saturate.plan import Plan
from saturate.workloads.base import Workload


def workload_key(workload: Workload, effective_batch: int | None = None) -> str:
    """A short hash of what a tuned plan depends on in the workload: model, data, effective batch."""
    key = {"name": workload.name, "fingerprint": workload.fingerprint(),
           "effective_batch": effective_batch or workload.optim.effective_batch}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def plans_dir() -> Path:
    return cache_root() / "plans"


def cached_plan_path(workload: Workload, hardware_fingerprint: str, world_size: int = 1) -> Path:
    """Where the plan tuned for `workload` on this hardware at `world_size` processes is kept."""
    procs = f"-{world_size}p" if world_size > 1 else ""
    return plans_dir() / f"{workload.name}-{workload_key(workload)}-{hardware_fingerprint}{procs}.toml"


def store(plan: Plan, workload: Workload, hardware_fingerprint: str, world_size: int = 1) -> Path:
    path = cached_plan_path(workload, hardware_fingerprint, world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def lookup(workload: Workload, hardware_fingerprint: str, world_size: int = 1) -> tuple[Plan | None, list[str]]:
    """The cached tuned plan for this workload on this hardware, and notes about others found.

    The plan tuned at `world_size` processes is preferred; else the one-process plan; else one tuned
    at another process count (the caller re-splits its effective batch, `provenance["world_size"]`).
    A plan tuned for this workload on other hardware is never used silently: it is named in a note.
    A cached file that no longer loads is reported and ignored (tuning again replaces it).
    """
    notes: list[str] = []
    here = cached_plan_path(workload, hardware_fingerprint, world_size)
    if not here.exists():
        here = cached_plan_path(workload, hardware_fingerprint)
    if not here.exists():  # tuned here at another process count: re-split by the caller
        here = next(iter(sorted(plans_dir().glob(f"{here.stem}-*p.toml"))), here)
    plan = None
    if here.exists():
        try:
            plan = Plan.load(here)
        except ConfigError as e:
            notes.append(f"ignored the cached tuned plan ({e}); run `saturate tune` again")
    else:
        others = sorted(plans_dir().glob(f"{workload.name}-{workload_key(workload)}-*.toml"))
        if others:
            notes.append(f"a plan tuned for this workload on other hardware exists ({others[0]}); not used here — "
                         "run `saturate tune` on this machine")
    return plan, notes


def workload_mismatch(plan: Plan, workload: Workload) -> str | None:
    """Why `plan` may not train `workload`: it records (its provenance) that it was tuned for another one.

    Its measured choices (micro-batch against memory, compile, precision) belong to that model, and its
    effective batch would silently rescale this one's learning rate. A plan with no provenance (written by
    hand, a reference plan) says nothing and is taken as it is.
    """
    tuned: Any = plan.provenance.get("workload") if plan.provenance else None
    if tuned and tuned != workload.name:
        return (f"the plan was tuned for {tuned}, not {workload.name}: tune {workload.name} (`saturate tune`), "
                "or delete the plan's [provenance] table to train with its settings anyway")
    return None


def hardware_mismatch(plan: Plan, hardware_fingerprint: str) -> str | None:
    """A warning when `plan` says it was tuned on hardware other than this."""
    tuned: Any = plan.provenance.get("hardware") if plan.provenance else None
    if tuned and tuned != hardware_fingerprint:
        where = plan.provenance.get("hardware_description", tuned)
        return (f"this plan was tuned on other hardware ({where}); its measured choices may not hold here — "
                "`saturate tune` measures this machine")
    return None
