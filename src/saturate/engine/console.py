"""What the user sees while training: a start line, a rich progress bar on a terminal (plain lines otherwise),
notes, and the summary at the end. Without live progress the start line, notes and summary still print
(a long run is never silent); quiet leaves the summary alone. The summary fits 80 columns."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text


def _within(path: Path, folder: Path) -> str:
    try:
        return f"(run folder)/{path.relative_to(folder)}"
    except ValueError:
        return str(path)


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


# The spaces at a line's end, with the colour codes among them (on a terminal a styled cell's padding is followed
# by its reset code): the spaces go, the codes stay.
_END_SPACES = re.compile(r"(?:[ \t]|\x1b\[[0-9;]*m)+(?=\r?\n)")
_CODES = re.compile(r"\x1b\[[0-9;]*m")


def _codes_only(m: re.Match[str]) -> str:
    return "".join(_CODES.findall(m.group(0)))


class _Tidy:
    """A console's stream (stdout or stderr, looked up at each write: --json redirects stdout) that leaves no space
    at the end of a line — rich keeps the space a wrapped line broke at."""

    def __init__(self, stderr: bool) -> None:
        self.stderr = stderr

    @property
    def stream(self) -> TextIO:
        stream = sys.stderr if self.stderr else sys.stdout
        # While a live line is up, rich puts a proxy in sys.stdout that prints through the console: the console
        # must write to the stream under it (as rich's own Console.file does), or each write loops back for ever.
        return getattr(stream, "rich_proxied_file", stream)

    def write(self, text: str) -> int:
        return self.stream.write(_END_SPACES.sub(_codes_only, text))

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"


_HANGING = re.compile(r"\s*(?:[•–] |note: |warning: )")  # a line whose wrapped rest lines up after this


class _HangingConsole(Console):
    """A Console whose one-paragraph bullets and notes ("  • precision: …", "note: …") wrap with a hanging indent:
    their continuation lines start under the text, not at column 0."""

    def print(self, *objects: Any, **kw: Any) -> None:
        if len(objects) == 1 and not kw.get("soft_wrap") and kw.get("end", "\n") == "\n":
            obj = objects[0]
            text = (self.render_str(obj, markup=kw.get("markup"), highlight=kw.get("highlight"), emoji=kw.get("emoji"))
                    if isinstance(obj, str) else obj if isinstance(obj, Text) else None)
            m = _HANGING.match(text.plain) if text is not None else None
            if m and "\n" not in text.plain and text.cell_len > self.width and self.width - m.end() >= 20:
                # The first line as rich would wrap it (full width), the rest under the text.
                first = text.wrap(self, self.width)[0]
                rest = text[len(first.plain):]
                rest = rest[len(rest.plain) - len(rest.plain.lstrip()):]
                indent = " " * m.end()
                first.rstrip()
                lines = [first, *rest.wrap(self, self.width - m.end())]
                objects = (Text("\n" + indent).join(lines),)
        super().print(*objects, **kw)


def tidy_console(stderr: bool = False, **kw: Any) -> Any:
    """A rich Console on stdout (or stderr) whose lines never end in a space, and whose bullets and notes wrap
    with a hanging indent."""
    return _HangingConsole(file=_Tidy(stderr), **kw)  # type: ignore[arg-type]


class _TwoLines(Progress):
    """The progress bar on one line (step, bar, ETA) and the window's figures under it: on one line together they
    overflowed 80 columns, and rich cut the step counter and the ETA to "…"."""

    def get_renderables(self) -> Any:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.description:
                yield Text(task.description)


class ConsoleSink:
    """A metrics sink that renders step, loss, tokens/s, MFU, memory and ETA."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True,
                 console: Console | None = None, live: bool = True, quiet: bool = False) -> None:
        self.enabled = enabled  # False: nothing at all (a rank other than 0)
        self.live = enabled and live  # the progress bar or per-window lines
        self.chatty = enabled and not quiet  # the start line and notes
        self.console = console or tidy_console(highlight=False)
        self.total = total_steps
        self.start_step = start_step
        self.processes = 1
        self.tokens = True  # False for a workload whose samples are not tokens: rates in samples/s
        self._progress: Progress | None = None
        self._task: Any = None

    def note(self, text: str) -> None:
        if self.chatty:
            self.console.print(f"[yellow]note:[/] {text}")

    def start(self, workload: Any, plan: Any, hw: Any, effective: int, total_steps: int,
              resumed_from: int | None, processes: int = 1) -> None:
        self.total = total_steps
        self.processes = processes
        self.tokens = workload.tokens_per_sample > 1
        if not self.chatty:
            return
        info = ", ".join(f"{k} {v}" for k, v in workload.info.items())
        where = f"resuming at step {resumed_from}" if resumed_from is not None else "starting"
        split = f"{plan.micro_batch} × {plan.grad_accum} accumulation"
        if processes > 1:
            split += f" × {processes} processes ({plan.strategy})"
        self.console.print(f"[bold]{workload.name}[/] on {hw.torch_device} ({info}); {where}, "
                           f"{total_steps} steps of {effective} samples = {split}; precision {plan.precision}, "
                           f"workers {plan.num_workers}, compile {plan.compile}")
        if self.live and self.console.is_terminal:
            self._progress = _TwoLines(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._task = self._progress.add_task("", total=total_steps, completed=self.start_step)
            self._progress.start()

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def write(self, record: dict[str, Any]) -> None:
        """The Sink interface: a record is {"step": N, metric: value, …}."""
        self.log(record["step"], {k: v for k, v in record.items() if k != "step"})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.live:
            return
        if "train/loss" not in metrics:  # validation, or the workload's own end-of-run metrics
            text = f"step {step}: " + ", ".join(f"{k.removeprefix('val/').replace('_', ' ')} {v:.4g}"
                                                for k, v in metrics.items())
            if "val/loss" in metrics:
                text = f"step {step}: val loss {metrics['val/loss']:.4f}"
            (self._progress.console if self._progress else self.console).print(text)
            return
        rate = (f"{_fmt_rate(metrics['throughput/tokens_per_s'])} tok/s" if self.tokens
                else f"{_fmt_rate(metrics['throughput/samples_per_s'])} samples/s")
        parts = [f"loss {metrics['train/loss']:.4f}", rate]
        if "throughput/mfu" in metrics:
            parts.append(f"MFU {100 * metrics['throughput/mfu']:.1f}%")
        elif "throughput/achieved_over_peak" in metrics:
            parts.append("MFU n/a")  # above the peak estimate: the summary says why
        if "memory/peak_gib" in metrics:
            parts.append(f"mem {metrics['memory/peak_gib']:.2f} GiB")
        else:
            parts.append(f"RSS {metrics['memory/host_peak_rss_gib']:.2f} GiB")  # host peak: fits 80 columns
        if "gpu/util_pct" in metrics:  # telemetry (engine/watch.py): means over the same window
            parts.append(f"GPU {metrics['gpu/util_pct']:.0f}%")
        elif "cpu/util_pct" in metrics:
            parts.append(f"CPU {metrics['cpu/util_pct']:.0f}%")
        if "host/ram_used_pct" in metrics:
            parts.append(f"RAM {metrics['host/ram_used_pct']:.0f}%")
        text = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, total=self.total, description=text)
        else:
            self.console.print(f"step {step}/{self.total}  {text}")

    def finish(self, result: Any) -> None:
        """The summary table; the trainer has already closed this sink (the progress bar is gone)."""
        if not self.enabled:
            return
        if getattr(result, "paused", False):  # to be continued in this process: one line, no summary
            self.console.print(f"paused at step {result.steps} of {result.total_steps} "
                               f"({result.train_seconds:.1f} s in steps), checkpointed")
            return
        t = Table(title="run summary (measured in this run)", show_header=False)
        t.add_column(no_wrap=True)
        t.add_column(overflow="fold")  # a long path breaks onto the next line, never cut to "…"
        early = " (stopped early)" if result.stopped_early else ""
        t.add_row("steps", f"{result.steps} / {result.total_steps}{early}")
        if getattr(result, "stop_reason", None):
            t.add_row("stopped", result.stop_reason)
        t.add_row("time in steps", f"{result.train_seconds:.1f} s (this session)")
        if result.tokens_per_s is not None:
            t.add_row("throughput", f"{_fmt_rate(result.tokens_per_s)} tokens/s, {result.samples_per_s:.1f} samples/s"
                      if self.tokens else f"{result.samples_per_s:,.1f} samples/s")
        if result.mfu_note:
            t.add_row("MFU", Text(result.mfu_note))  # its peak's source may hold "[/proc/…]": not markup
        if result.peak_memory_bytes is not None:
            t.add_row(f"peak memory ({result.memory_kind})", f"{result.peak_memory_bytes / 2**30:.2f} GiB")
        if result.train_loss is not None:
            t.add_row("train loss (last window)", f"{result.train_loss:.4f}")
        if result.val_loss is not None:
            t.add_row("validation loss", f"{result.val_loss:.4f}")
        for name, value in getattr(result, "metrics", {}).items():
            t.add_row(name, f"{value:.4g}")
        t.add_row("run folder", str(result.run_dir))
        for label, path in (("checkpoint", result.checkpoint), ("weights", result.weights)):
            if path:  # inside the run folder: said relative to it, so the row stays short
                t.add_row(label, _within(Path(path), Path(result.run_dir)))
        self.console.print(t)
        if result.stopped_early and not getattr(result, "finished", False):
            launch = (f"torchrun --nproc_per_node={self.processes} -m saturate" if self.processes > 1
                      else "saturate")
            self.console.print(f"resume with: {launch} train --resume --run-dir {result.run_dir}")

    def close(self) -> None:
        if self._progress is not None:  # an error ended the loop: leave the terminal usable
            self._progress.stop()
            self._progress = None


def say_stopped(result: Any) -> None:
    """A stopped run's line, from rank 0 before the ranks part (`train(on_stopped=)`: torchrun stops the other ranks
    once one exits, so a line said after `train` returns may never be said)."""
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return
    saved = f"checkpoint {result.checkpoint} written" if result.checkpoint else "no checkpoint written"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launch = f"torchrun --nproc_per_node={world} -m saturate" if world > 1 else "saturate"
    print(f"saturate: stopped by {result.stop_signal} at step {result.steps}; {saved}; resume with: "
          f"{launch} train --resume --run-dir {result.run_dir}", file=sys.stderr, flush=True)
