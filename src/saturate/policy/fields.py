"""`rule(value, why, see)`: a policy field, its default with its reason and where its measurement is."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def rule(value: Any, why: str, see: str = "") -> Any:
    """A policy field: its default `value`, `why` it is that (one line), and `see`, where its measurement is."""
    return field(default=value, metadata={"why": why, "see": see})
