"""Host-memory pressure while training: lower the loader's prefetch, then its workers, and say so.

The tuner sizes the loader within a measured RAM budget; this guard covers what changes after it
(other processes, a growing page cache, a leak in a user's dataset). Pressure means available RAM
under a floor, or swap in use growing since the run started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil

from saturate.plan import Plan

MiB = 2**20


class HostMemoryGuard:
    def __init__(self, min_available_bytes: int | None = None, swap_growth_bytes: int = 64 * MiB,
                 read: Callable[[], tuple[Any, Any]] | None = None) -> None:
        self._read = read or (lambda: (psutil.virtual_memory(), psutil.swap_memory()))
        vm, swap = self._read()
        # The floor: 5 % of RAM, at least 512 MiB.
        self.min_available = min_available_bytes if min_available_bytes is not None else max(vm.total // 20,
                                                                                            512 * MiB)
        self.swap_growth = swap_growth_bytes
        self.swap_start = swap.used

    def pressure(self) -> str | None:
        """Why host memory is under pressure now, or None."""
        vm, swap = self._read()
        if vm.available < self.min_available:
            return (f"host RAM available {vm.available / 2**30:.2f} GiB is under the "
                    f"{self.min_available / 2**30:.2f} GiB floor")
        grown = swap.used - self.swap_start
        if grown > self.swap_growth:
            return f"swap in use grew by {grown / 2**30:.2f} GiB since the run started"
        return None


def relieve(plan: Plan) -> tuple[Plan, str] | None:
    """The plan with one step less loader memory (prefetch first, then workers), or None if none is left."""
    if plan.num_workers == 0:
        return None
    pf = plan.prefetch_factor or 2
    if pf > 1:
        new_pf = max(1, pf // 2)
        return plan.replace(prefetch_factor=new_pf), f"prefetch_factor {pf} -> {new_pf}"
    workers = plan.num_workers // 2
    if workers == 0:
        return (plan.replace(num_workers=0, prefetch_factor=None, persistent_workers=False),
                f"num_workers {plan.num_workers} -> 0 (loading in the training process)")
    return plan.replace(num_workers=workers), f"num_workers {plan.num_workers} -> {workers}"
