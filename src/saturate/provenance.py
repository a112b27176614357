"""Where each knob of a plan came from, as data: `Origin`, kept beside the plan's provenance text.

A plan's `provenance` says in words why each knob has its value (what the output and plan.toml show). What a
decision needs of it — was this micro-batch chosen without a memory measurement? were these threads set for the load
before the search? is this precision unchecked? — is recorded here, under `provenance["origins"]`, as codes:

    mark(prov, "threads", Origin.UNDER_LOAD, "the first trial's 1: …")   # the text and its origin, together
    origin(plan.provenance, "threads") is Origin.UNDER_LOAD                # what a decision reads

No decision reads the text (tests/test_layout.py: no branch on provenance text).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

KEY = "origins"  # the provenance table that holds them (a TOML table in plan.toml)


class Origin(str, Enum):
    HARDWARE = "hardware"  # chosen from the probed hardware, not measured (plan.INFORMED)
    NO_MEMORY = "no-memory"  # a micro-batch chosen with no memory measured: its first steps' peak may grow it
    PREDICTED = "predicted"  # within what a measured peak predicts to fit
    UNDER_LOAD = "under-load"  # the first trial's threads, set for the load just before the search
    MEASURED = "measured"  # a trial, the guard or the search measured it
    MODEL = "model"  # kept by the model's batch-coupled layers


def origin(provenance: Mapping[str, Any] | None, knob: str) -> Origin | None:
    """The recorded origin of `knob` (None: none recorded, or one this version does not know)."""
    value = ((provenance or {}).get(KEY) or {}).get(knob)
    try:
        return Origin(value) if value is not None else None
    except ValueError:
        return None


def mark(provenance: dict[str, Any], knob: str, where: Origin, why: str | None = None) -> dict[str, Any]:
    """Record in `provenance` (in place, and returned) that `knob` came from `where`, and its text `why` when given;
    the origins table is copied, never shared with the plan it came from."""
    provenance[KEY] = {**(provenance.get(KEY) or {}), knob: where.value}
    if why is not None:
        provenance[knob] = why
    return provenance


def without(provenance: Mapping[str, Any], knob: str) -> dict[str, Any]:
    """A copy of `provenance` with nothing of `knob`: neither its text nor its origin."""
    out = {k: v for k, v in provenance.items() if k != knob}
    if KEY in out:
        out[KEY] = {k: v for k, v in out[KEY].items() if k != knob}
    return out
