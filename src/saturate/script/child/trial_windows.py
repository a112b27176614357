"""Inside a script's trial (the child side): its own steps timed in windows until they agree, or a cap.

`saturate tune -- CMD` asks for this in a trial's settings (`"windows"`: `window_s` and the fields of
`stats.noise.WindowRule`). Once the doctor's `Profiler` has its window (phases, data share) and has detached,
the script's next optimizer steps are timed in windows of whole steps: the first window lasts at least
`window_s`, every later one as many steps as the first. The trial stops when the last windows agree
(`WindowRule.agreed`) or at the cap on windows or timed seconds (`WindowRule.capped`), which is raised by the
rule's `busy_factor` when, at the cap, `hardware.contention` says other processes kept the machine busy —
the preset tuner's rule, read the same way. The record is each window's steps per second; the parent
summarises them with the same rule (`WindowRule.result`: median ± relative half-range).

With several processes (`WORLD_SIZE` > 1) every rank must stop at the same step (a rank that stops early
leaves the others waiting in a collective), so the windows are `window_steps` steps each and there are
exactly `min_windows` of them: the figure still has its spread, only the stopping is not adaptive.

Gated (`"gate"`: a Unix socket's path, `script/gated.py`): the parent decides when each window runs. Before the
first window and after each, the child sends what it measured (`boundary.GATE_*`) and waits for the next `go`;
on `stop`, or when the parent is gone (the socket closes), the windows are done. Two runs of the command, each
parked at its gate in turn, are timed in alternating windows — paired, as the preset tuner's plans are. The
Profiler's report is written when the gate is first reached, so the parent can read it while the run waits.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from saturate.script.boundary import GATE_GO, GATE_READY, GATE_STOP
from saturate.stats.noise import WindowRule


class StepWindows:
    """Timed windows of optimizer steps; `step()` at the end of each step says when they are done."""

    def __init__(self, settings: dict[str, Any] | None, world: int = 1, clock: Callable[[], float] = time.perf_counter,
                 busy: Callable[[], tuple[bool, float | None]] | None = None) -> None:
        """`settings` None: no windows (`step()` is done at once). `busy`: how the machine was used since the
        windows began (significant, other processes' cores); default a `ContentionMeter` started with them."""
        settings = dict(settings or {})
        self.asked = bool(settings)
        self.window_s = float(settings.pop("window_s", 0.5))
        self.fixed = int(settings.pop("window_steps", 0)) if world > 1 else 0
        settings.pop("window_steps", None)
        self.gate: str | None = settings.pop("gate", None)
        self._gate: Any = None  # the connected socket's file, once the first window is asked for
        self.on_gate: Callable[[], None] = lambda: None  # called once, when the gate is first reached
        self.sync: Callable[[], None] = device_sync  # gated: a window ends once its GPU work is done
        self.rule = WindowRule(**settings)
        self.clock, self._busy = clock, busy
        self.rates: list[float] = []  # steps per second, per window
        self.steps = 0
        self.busy: bool | None = None  # read once, when the windows reached the cap without agreeing
        self.other_cores: float | None = None
        self.script_ended = False  # the script finished before the windows did (`cut_short`)
        self._start: float | None = None
        self._window = (0.0, 0)  # when the current window began, its steps so far
        self._size = self.fixed  # steps per window once the first has set it
        self._faults: int | None = None  # the process's minor page faults when the windows began

    def step(self) -> bool:
        """The end of one optimizer step: True when the windows are done (at once when none were asked)."""
        if not self.asked:
            return True
        now = self.clock()
        if self._start is None:  # the end of the Profiler's last step: the windows begin here
            if self.gate is not None:
                self.sync()  # nothing of this run's left queued on the GPU while the other run is timed
                self.on_gate()
                if not self._wait(GATE_READY):
                    return True
                now = self.clock()
            self._begin(now)
            return False
        began, k = self._window
        k += 1
        self.steps += 1
        if (self._size and k < self._size) or (not self._size and now - began < self.window_s):
            self._window = (began, k)
            return False
        if self.gate is not None:
            self.sync()
            now = self.clock()
        self._size = self._size or k
        self.rates.append(k / max(now - began, 1e-9))
        if self.gate is not None:
            if not self._wait(f"{self.rates[-1]!r} {k}"):
                return True
            now = self.clock()
        self._window = (now, 0)
        return self._done(now - self._start)

    def _wait(self, said: str) -> bool:
        """Tell the parent `said` (a line), then wait for its word: True for another window, False to stop (its
        `stop`, or the parent gone)."""
        try:
            if self._gate is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(self.gate)
                self._gate = sock.makefile("rw")
            self._gate.write(said + "\n")
            self._gate.flush()
            word = self._gate.readline().strip()
        except OSError:
            return False
        if word == GATE_GO:
            return True
        if word != GATE_STOP and word:
            raise RuntimeError(f"saturate's gate said {word!r}")
        return False

    def _begin(self, now: float) -> None:
        self._start, self._window = now, (now, 0)
        self._faults = _minor_faults()
        if self._busy is None:
            from saturate.hardware.contention import ContentionMeter

            meter = ContentionMeter().start()

            def busy() -> tuple[bool, float | None]:
                seen = meter.stop()
                return seen.significant(), seen.other_cores

            self._busy = busy

    def _done(self, seconds: float) -> bool:
        rule, rates = self.rule, self.rates
        if self.gate is not None:
            return False  # the parent says when (`_wait`)
        if self.fixed:
            return len(rates) >= rule.min_windows
        done, self.busy = rule.done(rates, seconds, self.busy, self._read_busy)
        return done

    def _read_busy(self) -> bool:
        busy, self.other_cores = self._busy()  # type: ignore[misc]
        return busy

    def record(self) -> dict[str, Any] | None:
        """What the report carries: each window's steps/s and how the windows ended (None when none were asked
        or none completed)."""
        if not self.asked or not self.rates:
            return None
        agreed = not self.fixed and self.rule.agreed(self.rates)
        seconds = self._window[0] - (self._start or 0.0)
        faults = (_minor_faults() - self._faults) / seconds if seconds > 0 and self._faults is not None else None
        return {"rates": self.rates, "steps": self.steps, "seconds": seconds,
                "agreed": agreed, "busy": self.busy, "other_cores": self.other_cores,
                "fixed": bool(self.fixed), "script_ended": self.script_ended, "minor_faults_per_s": faults}

    def cut_short(self) -> str | None:
        """The note for a script that ended while its windows were timed, or None."""
        if not self.asked or self._start is None:
            return None
        self.script_ended = True
        return (f"the script ended during the timed windows, after {len(self.rates)} complete window(s) "
                f"of its steps")


def _minor_faults() -> int | None:
    """This process's minor page faults so far (every thread's): pages the kernel mapped and zeroed on first touch,
    what glibc's malloc thresholds decide for a CPU step's buffers (engine/host_alloc.py)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def device_sync() -> None:
    """Wait for the GPU work this process queued (when it has used CUDA). A gated run's window ends here: its
    kernels would otherwise run on while it is parked, during the other run's window, and count there."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
