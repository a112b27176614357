"""saturate's own time inside a training step it instruments: the hook bodies, timed from inside.

Every hook body saturate runs per step in a loop it did not write (the Profiler's forward, backward and
optimizer hooks and its batch wrapper; in a user's unchanged script also the optimizer-step hook and the
DataLoader iterator wrapper of `script/child/hooks.py`) is decorated with `own`: `perf_counter_ns` at
entry and at exit, added to one process-wide total. A hook called from inside another is counted once
(the outer one), and the script's or torch's own code that a hook calls (the batch a wrapper fetches, the
DataLoader being made) is taken out with `foreign`.

What this cannot see is the cost outside the bodies: torch's dispatch to a hook, a module's slower call
path once it has hooks, caches the hooks disturb. `bench/script_overhead.py` measures the whole cost by
A/B, the script with and without the hooks.

Hooks run in the training's thread (on CUDA, backward hooks run in autograd's device thread while the
training's thread waits in `backward()`), so the total is kept without a lock.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_now = time.perf_counter_ns
_ns = 0  # nanoseconds spent inside saturate's hook bodies in this process, the script's own code taken out
_calls = 0  # outermost hook bodies entered
_inside = False  # a hook body is running (a hook it calls is part of it)
_start = 0  # when the running body was entered
METHOD = "perf_counter_ns around saturate's hook bodies (not torch's dispatch to them)"


def own(fn: F) -> F:
    """Decorate a hook body: the time spent in it (less `foreign` calls) counts as saturate's."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        global _ns, _calls, _inside, _start
        if _inside:
            return fn(*args, **kwargs)
        _inside = True
        _calls += 1
        _start = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            _ns += _now() - _start
            _inside = False

    return timed  # type: ignore[return-value]


def foreign(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the script's or torch's code from inside a hook body: its time is not saturate's (hooks it fires
    meanwhile count on their own)."""
    global _ns, _inside, _start
    if not _inside:
        return fn(*args, **kwargs)
    _inside, outer = False, _start
    start = _now()
    try:
        return fn(*args, **kwargs)
    finally:
        # the enclosing body counts from its entry to its exit: take this call out (hooks fired inside it
        # counted themselves, and set _start: put the enclosing body's back)
        _ns -= _now() - start
        _inside, _start = True, outer


def mark() -> tuple[int, int]:
    """(nanoseconds inside hook bodies, hook bodies entered) in this process so far, the running body's time
    up to now included (a window's edges are marked from inside a hook)."""
    return _ns + (_now() - _start if _inside else 0), _calls


def summary(marks: list[tuple[int, int]], step_s: list[float]) -> dict[str, Any]:
    """The hooks' own time in each step between consecutive `mark()`s (one per step boundary), beside the steps'
    own durations `step_s`: in all, the median step's and the range over steps, hook bodies per step, and the
    share of each step, median and range. Medians, because a step in which another process took the core
    while a hook ran counts that time as the hook's."""
    own = [(b[0] - a[0]) / 1e9 for a, b in zip(marks, marks[1:], strict=False)]
    shares = [o / s for o, s in zip(own, step_s, strict=False) if s > 0]
    out: dict[str, Any] = {"hook_s": sum(own), "steps": len(own), "method": METHOD}
    if own:
        out["calls_per_step"] = (marks[-1][1] - marks[0][1]) / len(own)
        out["per_step_s"], out["per_step_range_s"] = statistics.median(own), [min(own), max(own)]
    if shares:
        out["share_of_step"], out["share_range"] = statistics.median(shares), [min(shares), max(shares)]
    return out


def totals() -> dict[str, Any]:
    """The hooks' own time in this process so far, and how many hook bodies ran."""
    ns, calls = mark()
    return {"hook_s": ns / 1e9, "calls": calls, "method": METHOD}
