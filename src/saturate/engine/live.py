"""Never silent for long (issue 31): a live status line for each long stage of a command, or a plain line.

    with stage(console, "probing the machine") as say:   # a long stage: probing, a trial, a measurement
        ...
        say("probing the machine: matmul peaks")          # what it is doing now (the line's text)

On a terminal the line is rich's spinner with the stage and its elapsed seconds, redrawn several times a second and
gone when the stage ends (the lines printed meanwhile stay above it). Off a terminal (a log, a pipe, CI) each stage
prints one plain line when it starts, "probing the machine …", and each `say` another. Nothing on a quiet console
(another rank; `Console(quiet=True)`), nor under `silenced()` (the CLI's -q); under --json the console writes to
stderr, so stdout keeps only the JSON document.

Stages nest: an inner stage on a console that shows one already changes that line's text, and gives the outer
text back when it ends (rich allows one live display per console).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

_SILENT: contextvars.ContextVar[bool] = contextvars.ContextVar("saturate_live_silent", default=False)
_SHOWN: weakref.WeakKeyDictionary[Console, _Line] = weakref.WeakKeyDictionary()  # the live line of each console


class _Line:
    """The text a live status shows: the stage and its elapsed seconds, worked out each time rich redraws it. A text
    too long for the terminal is cut, never the seconds."""

    def __init__(self, text: str) -> None:
        self.text, self.started = text, time.monotonic()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        seconds = f" ({time.monotonic() - self.started:.0f} s)"
        room = max(1, options.max_width - len(seconds))
        text = self.text if len(self.text) <= room else self.text[:room - 1] + "…"
        yield Text(text + seconds, no_wrap=True, overflow="ellipsis")


@contextlib.contextmanager
def silenced(silent: bool = True) -> Iterator[None]:
    """No stage lines inside the block when `silent` (the CLI's -q: results and errors only)."""
    token = _SILENT.set(silent)
    try:
        yield
    finally:
        _SILENT.reset(token)


def _enabled(console: Console) -> bool:
    return not console.quiet and not _SILENT.get()


@contextlib.contextmanager
def stage(console: Console | None, text: str, plain: bool = True) -> Iterator[Callable[[str], None]]:
    """A long stage of `text` on `console` (module docstring); yields `say(text)`, which says what it does now.
    `plain=False`: nothing off a terminal (the caller prints lines of its own there)."""
    if console is None or not _enabled(console) or not (plain or console.is_terminal):
        yield lambda _: None
        return
    if not console.is_terminal:
        console.print(f"[dim]{text} …[/dim]", highlight=False)

        def plain(now: str) -> None:
            console.print(f"[dim]{now} …[/dim]", highlight=False)

        yield plain
        return
    shown = _SHOWN.get(console)
    if shown is not None:  # a stage inside another: the outer one's line says this one, then its own again
        outer = shown.text, shown.started
        shown.text, shown.started = text, time.monotonic()
        try:
            yield _update(shown)
        finally:
            shown.text, shown.started = outer
        return
    line = _Line(text)
    _SHOWN[console] = line
    try:
        with console.status(line):
            yield _update(line)
    finally:
        _SHOWN.pop(console, None)


def _update(line: _Line) -> Callable[[str], None]:
    def say(now: str) -> None:
        line.text, line.started = now, time.monotonic()

    return say


class Announced:
    """A tuner's measurer whose every trial is a stage: "tuning: compile trial, 32×1 fp32 fused compiled (12 s)" while
    it runs (a compile trial was 46 s of silence). Everything else is the measurer's own: attributes read and set go
    through to it (the search sets `window_cap_s` and `deadline` on it). Not numbered: a paired trial is two rows of
    the trials table, and a number here would disagree with that table's."""

    def __init__(self, measurer: Any, console: Console | None, describe: Callable[[Any], str] = repr) -> None:
        object.__setattr__(self, "_inner", measurer)
        object.__setattr__(self, "_console", console)
        object.__setattr__(self, "_describe", describe)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def _stage(self, what: str) -> contextlib.AbstractContextManager[Callable[[str], None]]:
        return stage(self._console, f"  tuning: {what}")

    def model_trial(self, plan: Any, stage_name: str, **kw: Any) -> Any:
        with self._stage(f"{stage_name} trial, {self._describe(plan)}"):
            return self._inner.model_trial(plan, stage_name, **kw)

    def loader_trial(self, plan: Any) -> Any:
        with self._stage(f"loader trial, {plan.num_workers} worker{'' if plan.num_workers == 1 else 's'}"):
            return self._inner.loader_trial(plan)

    def verify(self, plan: Any) -> Any:
        with self._stage(f"verifying {self._describe(plan)}"):
            return self._inner.verify(plan)

    def paired(self, a: Any, b: Any, stage_name: str, **kw: Any) -> Any:
        with self._stage(f"{stage_name}: {self._describe(a.plan)} against {self._describe(b.plan)}, in alternating "
                         "windows"):
            return self._inner.paired(a, b, stage_name, **kw)
