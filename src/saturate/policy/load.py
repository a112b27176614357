"""`Load`: what other processes kept busy during one measurement, judged once for every verb.

    load = Load(other_cores=1.0, usable_cores=2)
    load.busy                       # a machine this busy: the thread stages, the doctor's "contended"
    load.same_as(other)             # the same load, trusted as such (a loaded trial taken without confirming)
    load.uneven_with(other)         # not the same load (a pair of windows left out)
    load.threads_left()             # intra-op threads for the cores the neighbours left, at least one

Its thresholds are `POLICY.load` (policy/thresholds.py); an unknown reading (None) is never busy, never the same as
another and never uneven with one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from saturate.policy.active import POLICY
from saturate.policy.thresholds import LoadRules


@dataclass(frozen=True)
class Load:
    other_cores: float | None  # other processes' mean CPU use, in cores (None: not read)
    usable_cores: int = 1  # the cores this process may use
    rules: LoadRules = POLICY.load

    @property
    def busy(self) -> bool:
        """Other processes kept the machine busy: at least `busy_cores`, or `busy_share` of the usable cores."""
        r = self.rules
        return self.other_cores is not None and self.other_cores >= max(r.busy_share * self.usable_cores,
                                                                          r.busy_cores)

    def same_as(self, other: Load) -> bool:
        """Both read, within `same_cores` of each other: the same load."""
        a, b = self.other_cores, other.other_cores
        return a is not None and b is not None and abs(a - b) <= self.rules.same_cores

    def uneven_with(self, other: Load) -> bool:
        """Both read, `uneven_cores` or more apart: not the same load."""
        a, b = self.other_cores, other.other_cores
        return a is not None and b is not None and abs(a - b) >= self.rules.uneven_cores

    def threads_left(self, cores: int | None = None) -> int:
        """Intra-op threads for the cores (`cores`, default the usable ones) the neighbours left: their reading less
        `forgiven_cores`, rounded up, taken away; at least one."""
        n = self.usable_cores if cores is None else cores
        busy = self.other_cores or 0.0
        return max(1, n - math.ceil(busy - self.rules.forgiven_cores))
