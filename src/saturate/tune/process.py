"""What a trial needs from the process around it: a time limit on compilation, peak memory over
a block, memory given back between trials, the loader workers' memory, the ranks on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch

from saturate.engine.distributed import DistInfo


class PeerFailed(RuntimeError):
    """Another rank's trial failed; this rank stopped with it."""


class CompileTimeLimit(Exception):
    """A compilation ran past its time limit and was stopped."""


def local_processes(info: DistInfo) -> int:
    """How many of the job's processes share this machine (torchrun's LOCAL_WORLD_SIZE)."""
    if info.world_size == 1:
        return 1
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)))
    except ValueError:
        return info.world_size


@contextlib.contextmanager
def time_limit(seconds: float | None, *, interrupt: bool = True) -> Iterator[Callable[[], bool]]:
    """Interrupt the block after `seconds` (SIGALRM) where `interrupt` and the process allows; yields a
    function saying whether time ran out."""
    state = {"expired": False}
    usable = (interrupt and seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        started = time.perf_counter()
        yield lambda: seconds is not None and time.perf_counter() - started > seconds
        return

    def on_alarm(signum: int, frame: Any) -> None:
        state["expired"] = True
        raise CompileTimeLimit(f"compiling was stopped at the {seconds:.3g} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield lambda: state["expired"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def workers_uss() -> int:
    """Unique memory of this process's children (DataLoader workers); RSS where USS is unavailable."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            info = child.memory_full_info()
            total += getattr(info, "uss", info.rss)
        except (psutil.Error, OSError):
            continue
    return total


def release(device: torch.device) -> None:
    """Collect garbage and give freed memory back (the CUDA cache, or the C heap), between trials."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def _malloc_trim() -> None:
    """Give freed heap back to the OS (glibc), so the next trial's RSS growth is its own."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(name).malloc_trim(0)


class PeakMemory:
    """Peak memory over a block: the CUDA allocator's peak, or host RSS growth sampled every 5 ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        release(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            proc = psutil.Process()
            self._base = proc.memory_info().rss
            self._max = self._base

            def sample() -> None:
                while not self._stop.wait(0.005):
                    self._max = max(self._max, proc.memory_info().rss)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._max = max(self._max, psutil.Process().memory_info().rss)
            self.peak = int(self._max - self._base)
