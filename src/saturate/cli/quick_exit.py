"""The end of the `saturate` process: what must happen at exit happens, Python's teardown of every module does not.

A process that imported torch spends most of a second after its last line tearing its modules down, more with
Transformers — a few percent of a short job's wall time, spent on nothing the user keeps (measured:
bench/results/cpu-2026-11-27e/README.md). Here the exit handlers still run (logging's, multiprocessing's reaping of
loader workers, TensorBoard's, anything a user's `--hf` model registered), Python's and C's output buffers are
flushed, and then the process ends with `os._exit`. A thread still running that is not a daemon gets Python's
ordinary exit, which waits for it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading


def exit_now(code: int | None) -> None:
    """End the process with `code` (None → 0) after the exit handlers and a flush of every output buffer."""
    code = int(code or 0)
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_handlers is None or _other_threads():
        sys.exit(code)  # the ordinary way: Python waits for the threads, then runs the handlers itself
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed pipe: nothing more can reach it
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C's stdio buffers too (a library's printf to a pipe)
    os._exit(code)


def _other_threads() -> bool:
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate())
