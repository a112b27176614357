"""Stopping a run cleanly on request: Ctrl-C (SIGINT), and the preemption signals of schedulers (SIGTERM
from SLURM and Kubernetes, SIGUSR1 from SLURM's `--signal=USR1@SECONDS`), ask the loop to stop at the next
step boundary and checkpoint. A second Ctrl-C aborts, except while a checkpoint is being written: signals
arriving then are held until the write is done, so no signal leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
HANDLED = ("SIGINT", *PREEMPTION_SIGNALS)  # index + 1 is a signal's code: ranks agree on the largest (a max)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1 with a checkpoint written; requeue with --resume
EXIT_INTERRUPTED = 130  # Ctrl-C


def stop_exit_code(stop_signal: str | None) -> int:
    """The exit code of a run stopped by `stop_signal`: 75 for a preemption (requeue), 130 for Ctrl-C."""
    return EXIT_PREEMPTED if stop_signal in PREEMPTION_SIGNALS else EXIT_INTERRUPTED


class StopFlag:
    """The first SIGINT, SIGTERM or SIGUSR1 asks the loop to stop at the next step boundary and checkpoint.

    A repeated preemption signal changes nothing (the stop is already on its way; the scheduler's SIGKILL,
    if it comes first, is survived by the last checkpoint). A second Ctrl-C aborts (KeyboardInterrupt),
    unless a checkpoint is being written (`deferred`): then it waits for the write to finish.
    Under torchrun a signal reaches each worker twice (from the terminal or scheduler, then forwarded by
    the launcher): a second one within `coalesce_s` of the first counts as the same one.
    """

    def __init__(self, coalesce_s: float = 0.0) -> None:
        self.requested = False
        self.interrupted = False  # any signal asked for the stop (not a time budget)
        self.signal_name: str | None = None  # the first signal seen ("SIGTERM"), or adopted from another rank
        self.coalesce_s = coalesce_s
        self._first_at = 0.0
        self._deferring = False
        self._abort_pending = False

    @property
    def preempted(self) -> bool:
        return self.signal_name in PREEMPTION_SIGNALS

    @property
    def code(self) -> int:
        """0 for no signal, else the signal's place in HANDLED + 1 (preemption above Ctrl-C): what ranks
        all-reduce (max), so that all stop for the same reason."""
        return HANDLED.index(self.signal_name) + 1 if self.signal_name in HANDLED else 0

    def adopt(self, code: int) -> None:
        """Another rank was signalled (`code` is the largest over ranks): stop here too, for its reason."""
        if code > self.code:
            self.requested = self.interrupted = True
            self.signal_name = HANDLED[code - 1]

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.interrupted:
            self.requested = self.interrupted = True
            self.signal_name = name
            self._first_at = time.monotonic()
            return
        if name in PREEMPTION_SIGNALS or time.monotonic() - self._first_at < self.coalesce_s:
            return
        if self._deferring:  # a second Ctrl-C during a checkpoint write: abort once it is written
            self._abort_pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {name: signal.signal(getattr(signal, name), self._handle) for name in HANDLED}
        try:
            yield
        finally:
            for name, handler in previous.items():
                signal.signal(getattr(signal, name), handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold an abort until the block (a checkpoint write) is done; when the write was the stop's own,
        the run ends right after it anyway, so the abort is dropped and the stop is reported as usual."""
        stopping, self._deferring = self.requested, True
        try:
            yield
        finally:
            self._deferring = False
        if self._abort_pending:
            self._abort_pending = False
            if not stopping:
                raise KeyboardInterrupt


@contextlib.contextmanager
def preemption_raises() -> Iterator[None]:
    """Outside the loop (building the run, exporting), SIGTERM and SIGUSR1 end the command as Ctrl-C does:
    an exception the CLI reports in one line, unwinding through the atomic writes' clean-up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Preempted(signal.Signals(signum).name)

    previous = {name: signal.signal(getattr(signal, name), handler) for name in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for name, h in previous.items():
            signal.signal(getattr(signal, name), h)


class Preempted(BaseException):
    """SIGTERM or SIGUSR1 outside the training loop (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
