"""The policy floor: every threshold saturate decides with (`POLICY`, policy/thresholds.py) and the one judgement of a
machine's load (`Load`, policy/load.py). It sits beside `stats/` and imports nothing of saturate but the errors.

`SATURATE_POLICY=FILE.toml` overrides fields for an experiment, read once as saturate is imported (and by each
process of a user's command, which inherits the variable):

    [load]
    same_cores = 0.3
    [gains]
    min_gain = 0.05

A file that cannot be read, or names an unknown field, is refused in one line.
"""

from __future__ import annotations

from saturate.policy.active import ENV, POLICY, check, load_policy, overridden, policy_record
from saturate.policy.fields import rule
from saturate.policy.load import Load
from saturate.policy.thresholds import Policy, reasons

__all__ = ["ENV", "POLICY", "Load", "Policy", "check", "load_policy", "overridden", "policy_record", "reasons", "rule"]
