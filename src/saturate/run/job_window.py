"""The default plan's first steps timed to size the job (first_steps.py): a `WindowWatch` on train's windows.

`POLICY.job.size_steps` steps after the session's first `size_after` (cold, the precision guard's checks) are timed;
while other processes kept the machine busy over them and two windows disagree, another window, `size_tries` at
most: a neighbour only slows the figure, so the fastest window counts. Then `decide(step, seconds_per_step)` says
whether to pause the run there (its reason) or train on (None). The training loop knows nothing of this: it closes
a window where asked and passes on the answer (engine/trainer.py `WindowWatch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from saturate.engine.trainer import Window
from saturate.hardware.contention import ContentionMeter
from saturate.policy import POLICY


@dataclass
class JobWindows:
    """Times the job over its first steps, again while the machine is busy; `decide` on the fastest window."""

    decide: Callable[[int, float], str | None]
    start: int = 0  # the step that opens the window being timed
    end: int = 0  # the step that closes it
    steps: int = 0  # steps seen in it so far (the loop may close windows inside it: logs, validations)
    seconds: float = 0.0
    best: float = math.inf  # seconds per step, the fastest window so far
    last: float | None = None  # the window before's
    tries: int = 0
    meter: ContentionMeter | None = None  # other processes' load over the window

    def first(self, step: int) -> int:
        self.start = self.end = step + POLICY.job.size_after
        return self.start

    def closed(self, window: Window) -> tuple[int | None, str | None]:
        if window.step == self.start:
            return self._open(window.step), None
        self.steps, self.seconds = self.steps + window.steps, self.seconds + window.seconds
        if window.step != self.end:
            return self.end, None
        p = POLICY.job
        per_step = self.seconds / self.steps
        steady = self.last is not None and abs(per_step - self.last) <= p.size_agree * min(per_step, self.last)
        self.best, self.last, self.tries = min(self.best, per_step), per_step, self.tries + 1
        busy = self.meter is not None and self.meter.stop().significant() and not steady
        if busy and self.tries < p.size_tries and window.step + p.size_steps <= window.total_steps:
            return self._open(window.step), None
        return None, self.decide(window.step, self.best)

    def _open(self, step: int) -> int:
        self.start, self.end, self.steps, self.seconds = step, step + POLICY.job.size_steps, 0, 0.0
        self.meter = ContentionMeter().start()
        return self.end
