"""Stopping a run cleanly on request: the first Ctrl-C asks the loop to stop at the next step boundary
and checkpoint; a second aborts."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any


class StopFlag:
    """First Ctrl-C asks the loop to stop at the next step boundary and checkpoint; a second aborts.

    Under torchrun a Ctrl-C reaches each worker twice (from the terminal, then forwarded by the
    launcher): a second SIGINT within `coalesce_s` of the first counts as the same one.
    """

    def __init__(self, coalesce_s: float = 0.0) -> None:
        self.requested = False
        self.interrupted = False
        self.coalesce_s = coalesce_s
        self._first_at = 0.0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.interrupted:
                if time.monotonic() - self._first_at < self.coalesce_s:
                    return
                raise KeyboardInterrupt
            self.requested = self.interrupted = True
            self._first_at = time.monotonic()

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
