"""Which intra-op thread count to measure on a busy CPU, or why none: one rule for the preset tuner's first trial
(tune/start.py `busy_threads`), its threads stage (tune/search.py) and a script's (script/host_stages.py).

torch's threads wait for one another at every parallel region, so one that another process preempts stalls them
all; on a CPU other processes keep busy (`Load.busy`), the cores they leave (`Load.threads_left`) are worth
measuring against the count in use. Each caller measures the candidate its own way (a plan's trial, a run of the
command) and says it in its own words; what to try, and when, is decided here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from saturate.policy.load import Load


class Skip(enum.Enum):
    NOT_CPU = "not on a CPU"
    PROCESSES = "several processes share the cores by another rule"
    UNKNOWN = "no thread count to compare with"
    QUIET = "the machine was quiet"
    ENOUGH = "the cores other processes left are no fewer than the threads in use"


@dataclass(frozen=True)
class ThreadsToTry:
    count: int | None  # the thread count to measure against `using` (None: none, `skip` says why)
    skip: Skip | None
    using: int | None  # the count in use
    left: int | None  # the threads the load leaves (`Load.threads_left`), when judged


def threads_to_try(device_type: str, processes: int, using: int | None, load: Load) -> ThreadsToTry:
    """The thread count worth measuring against `using` (the count in use) under `load`, or why none."""
    if device_type != "cpu":
        return ThreadsToTry(None, Skip.NOT_CPU, using, None)
    if processes > 1:
        return ThreadsToTry(None, Skip.PROCESSES, using, None)
    if not using:
        return ThreadsToTry(None, Skip.UNKNOWN, using, None)
    if not load.busy:
        return ThreadsToTry(None, Skip.QUIET, using, None)
    left = load.threads_left()
    if left >= using:
        return ThreadsToTry(None, Skip.ENOUGH, using, left)
    return ThreadsToTry(left, None, using, left)
