"""What a trial needs from the process around it: a time limit on compilation and nothing left of a
compilation that was stopped, peak memory over a block, memory given back between trials, the loader
workers' memory, the ranks on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import sys
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


# After the limit the alarm rings again every second: compiler code that catches any exception
# (`except Exception: <fall back>`) swallows an interrupt and compiles on; the next one stops it.
_RING_AGAIN_S = 1.0


@contextlib.contextmanager
def time_limit(seconds: float | None, *, interrupt: bool = True,
               on_alarm: Callable[[], None] | None = None,
               limit_s: float | None = None) -> Iterator[Callable[[], bool]]:
    """Interrupt the block after `seconds` (SIGALRM) where `interrupt` and the process allows; yields a
    function saying whether time ran out. `on_alarm` runs in the handler, just before the interrupt.
    `limit_s`: the whole limit the message names, when `seconds` is only what is left of it."""
    state = {"expired": False, "armed": True}
    usable = (interrupt and seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        started = time.perf_counter()
        yield lambda: seconds is not None and time.perf_counter() - started > seconds
        return

    def handler(signum: int, frame: Any) -> None:
        if not state["armed"]:
            return
        state["expired"] = True
        if on_alarm is not None:
            on_alarm()
        named = limit_s if limit_s is not None else seconds
        raise CompileTimeLimit(f"compiling was stopped at the {named:.3g} s limit")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), _RING_AGAIN_S)
    try:
        yield lambda: state["expired"]
    finally:
        while True:  # a ring due now may interrupt the disarming itself: repeat until it is done
            try:
                state["armed"] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except CompileTimeLimit:
                continue


def prepare_compiler(device: torch.device) -> None:
    """What a compilation does once per process and must not be interrupted in, done before its time limit.

    Inductor probes the CPU's vector instructions by building test programs and reads any exception
    there as "not supported", cached for the process: an alarm landing in that probe was swallowed and
    left every later kernel of the process without AVX-512 VNNI. The hash of torch's sources that keys
    the on-disk compile caches swallows it too (the caches are then bypassed). Importing the compiler
    first keeps the alarm out of half-executed module imports.
    """
    from torch._inductor import codecache, compile_fx  # noqa: F401 - compile_fx: the compiler, loaded

    codecache.torch_key()
    if device.type == "cpu":
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()


# A link is left to finish: killed, it leaves a partial library under the name inductor's on-disk
# cache trusts (it checks that the file exists), and every later compilation of that kernel fails.
_LINKERS = frozenset({"collect2", "ld", "ld.bfd", "ld.gold", "ld.lld", "lld", "mold"})


class CompileScope:
    """What a compilation starts, told apart from what the process had before, so it can be ended.

    Inductor builds C++ kernels in g++ processes, started from its pool of compile threads while the
    main thread waits for them. A compilation stopped by the alarm (the exception raised in the main
    thread) leaves that pool building every kernel still queued, two g++ at a time beside whatever the
    process does next: on a 2-core machine the rest of `saturate run` trained 2.5-3x slower (issue 17).
    `discard()` ends them and drops what the compilation holds in memory; `note_processes` (from the
    alarm handler) catches the compiler under a g++ that the interrupted main thread is about to kill,
    which would otherwise run on, orphaned, no longer listed among this process's children.
    """

    def __init__(self) -> None:
        self._children_before = {c.pid for c in psutil.Process().children()}
        self._threads_before = set(threading.enumerate())
        self._noted: dict[int, psutil.Process] = {}

    def note_processes(self) -> None:
        with contextlib.suppress(psutil.Error):  # called from the alarm handler: never raise anything else
            for driver, below in self._jobs():
                for p in (*below, *([driver] if driver is not None else [])):
                    self._noted.setdefault(p.pid, p)

    def discard(self) -> None:
        """End the compiler's processes and threads, and forget its compiled code and in-memory caches."""
        pool = _cancel_kernel_builds()
        if "torch._inductor.async_compile" in sys.modules:
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()  # the worker processes of a GPU (Triton) compilation
        self._end_jobs()
        if pool is not None:
            pool.shutdown(wait=True)  # its threads end once their g++ has
        self._stop_progress_monitor()
        torch._dynamo.reset()  # compiled code and guards of the compilation
        torch._C._dynamo.eval_frame.set_eval_frame(None)  # no frame callback left set by an interrupted exit
        if "torch._inductor.utils" in sys.modules:
            from torch._inductor.utils import clear_caches

            clear_caches()  # in-memory kernel caches, some holding builds that were just cancelled

    def _jobs(self) -> list[tuple[psutil.Process | None, list[psutil.Process]]]:
        """(g++ driver, the compiler/assembler/linker under it) per job started since; noted orphans alone."""
        jobs: list[tuple[psutil.Process | None, list[psutil.Process]]] = []
        listed: set[int] = set()
        for child in psutil.Process().children():
            if child.pid in self._children_before or not _alive(child):
                continue
            with contextlib.suppress(psutil.Error):
                below = [p for p in child.children(recursive=True) if _alive(p)]
                jobs.append((child, below))
                listed.update(p.pid for p in (child, *below))
        jobs += [(None, [p]) for pid, p in self._noted.items() if pid not in listed and _alive(p)]
        return jobs

    def _end_jobs(self, patience_s: float = 10.0) -> None:
        """Kill each job's compiler (its driver then deletes its temporaries and exits), not its linker."""
        deadline = time.monotonic() + patience_s
        while (jobs := self._jobs()) and time.monotonic() < deadline + patience_s:
            late = time.monotonic() > deadline  # then everything, drivers and links too
            for driver, below in jobs:
                if late:
                    targets = [*below, *([driver] if driver is not None else [])]
                elif any(_name(p) in _LINKERS for p in below):
                    continue
                else:
                    targets = below
                for p in targets:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            time.sleep(0.02)

    def _stop_progress_monitor(self) -> None:
        """tqdm's monitor thread, started by the compiler's (disabled) progress bars, when it was not running before."""
        tqdm = sys.modules.get("tqdm.std")
        monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
        if monitor is not None and monitor not in self._threads_before:
            monitor.exit()


def _cancel_kernel_builds() -> Any:
    """Cancel the kernel builds inductor's compile threads have not started; the pool, or None."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None or async_compile.AsyncCompile.pool.cache_info().currsize == 0:
        return None
    pool = async_compile.AsyncCompile.pool()
    pool.shutdown(wait=False, cancel_futures=True)
    async_compile.AsyncCompile.pool.cache_clear()  # a later compilation starts a new pool
    return pool


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


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
