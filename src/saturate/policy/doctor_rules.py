"""The doctor's thresholds: the shares of a step, of memory and of a machine its verdicts and fixes rest on."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule


@dataclass(frozen=True)
class DoctorRules:
    """When the doctor calls a verdict, proposes a fix, or trusts a probe."""

    gain_min: float = rule(1.10, "a fix is proposed only when predicted at least this many times as fast (ratio)",
                           "doctor/fixes.py; docs/doctor.md")
