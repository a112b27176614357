"""When a tune cannot answer, no change: the plan the user had is kept, and the reason is said.

A budget too small to hold one trial (or a machine so busy that the first trial alone outran it) measures
nothing to compare, so it is no evidence for any other plan. Failing with an error (what `tune` did before) left
the user with no plan file and the impression that something broke; choosing from one trial would be a change
not measured. What the user had stays: the plan cached for this job (what `train` and `run` use), or else the
informed starting plan (chosen from the hardware, not measured). `tune` writes it to its `--out` folder with the
trials it did measure, so a script that reads `plan.toml` goes on, and the cache is left as it was.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from saturate import plan_cache
from saturate.atomic import atomic_write_bytes
from saturate.plan import Plan
from saturate.tune.trial import BudgetTooSmall
from saturate.workloads.base import Workload
from saturate.workloads.coupling import workload_default_plan

NO_CHANGE = "no change measured"


def plan_the_user_had(workload: Workload, hw: Any, world: int, use_cache: bool = True) -> tuple[Plan, str]:
    """The plan `train` would use for this job now, and how to name it: the cached one (unless `use_cache` is
    False: a tune told to leave the cache alone), else the informed one."""
    cached, _ = plan_cache.lookup(workload, hw.fingerprint(), world) if use_cache else (None, [])
    if cached is not None:
        return cached, f"the plan cached for this job ({cached!r}), which `train` and `run` use"
    plan, _ = workload_default_plan(workload, hw, world)
    return plan, f"the informed starting plan ({plan!r}: chosen from the hardware, not measured)"


def keep(e: BudgetTooSmall, workload: Workload, hw: Any, world: int, out_dir: Path, console: Console,
         started: float, settings: dict[str, Any], is_main: bool = True,
         use_cache: bool = True) -> tuple[Plan, str, str]:
    """When `e` ended the search: the plan the user had, written (rank 0) as `plan.toml` with the trials
    measured in `tune.json`; (the plan, why nothing changed, what was kept)."""
    plan, what = plan_the_user_had(workload, hw, world, use_cache)
    why = f"{NO_CHANGE}: {e}"
    trials = [t.to_dict() for t in e.trials]
    plan_path, json_path = out_dir / "plan.toml", out_dir / "tune.json"
    if is_main:
        console.print(f"[yellow]{why}; kept {what}[/yellow]", highlight=False)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(json_path, (json.dumps({
            "workload": workload.name, "hardware": hw.to_dict(), "settings": settings, "changed": False,
            "why": why, "kept": what, "trials": trials, "seconds": round(time.monotonic() - started, 1),
            "plan": plan.to_dict() | {"provenance": None},
        }, indent=2, default=str) + "\n").encode())
        plan.save(plan_path)
        console.print(f"kept plan: {plan_path} (evidence: {json_path})")
    return plan, why, what
