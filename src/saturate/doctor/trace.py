"""A trace of a few steps after the doctor's timed ones, to open in Perfetto (issue 62).

`torch.profiler` records the steps that follow the timed window — never the timed ones, so the profiler's own cost
colours no figure the verdict rests on — with saturate's phases as named ranges ("saturate: forward", "…: backward",
"…: optimizer", "…: data", "…: h2d") inside one range per step ("saturate: step N"). It is written as a Chrome trace
(`trace.json`; under torchrun `rankR_trace.json`, one per rank), which https://ui.perfetto.dev opens ("Open trace
file"; chrome://tracing too); the ops' own slices sit under the ranges, so a host sync shows as its `aten::item` /
`aten::_local_scalar_dense`. On CUDA the same steps' allocations are recorded too and written as
`trace-memory.pickle`, which https://pytorch.org/memory_viz opens.

A phase entered on another thread than the one that started the trace (the autograd engine's, on a GPU, for a
backward the Profiler's hooks see begin there) is left out as a range: a range must end on the thread it began.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TRACE_STEPS = 3  # optimizer steps traced: a step seen repeating, and a file small enough to open at once
RANGE = "saturate: {}"
TRACE_NAME = "trace"  # trace.json and trace-memory.pickle; under torchrun one per rank: rankR_trace.json, …
MEMORY_ENTRIES = 100_000  # allocation events kept for the snapshot (the recorder's ring buffer)


@dataclass(frozen=True)
class TraceFiles:
    """What a traced stretch wrote: the Chrome trace and, on CUDA, the memory snapshot (`ranks`: how many ranks
    wrote theirs beside these, rank 0's)."""

    trace: str
    steps: int
    memory: str | None = None
    ranks: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "steps": self.steps, "memory": self.memory, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TraceFiles | None:
        return cls(d["trace"], int(d["steps"]), d.get("memory"), int(d.get("ranks", 1))) if d else None

    def moved(self, folder: Path, ranks: int = 1) -> TraceFiles:
        """The same files, found in `folder` (where the parent moved a child's), written by `ranks` ranks."""
        return TraceFiles(str(folder / Path(self.trace).name), self.steps,
                          str(folder / Path(self.memory).name) if self.memory else None, ranks)

    def lines(self) -> list[str]:
        """How to open them, one line each."""
        others = f" (the other {self.ranks - 1} ranks' beside it)" if self.ranks > 1 else ""
        out = [f"trace of {self.steps} steps after the timed ones: {self.trace}{others} — open it in "
               "https://ui.perfetto.dev (Open trace file); saturate's phases are the \"saturate: …\" ranges"]
        if self.memory:
            out.append(f"memory snapshot of the same steps: {self.memory} — open it in https://pytorch.org/memory_viz")
        return out


class PhaseTrace:
    """torch.profiler over `steps` optimizer steps, the phases as ranges; `end_step` says when it is done."""

    def __init__(self, device: torch.device, folder: Path, steps: int = TRACE_STEPS, name: str = TRACE_NAME) -> None:
        self.device, self.folder, self.steps, self.name = device, Path(folder), steps, name
        self.done = 0
        self.files: TraceFiles | None = None
        self._prof: Any = None
        self._step: Any = None  # the open step range
        self._phase: Any = None  # the open phase range
        self._thread = threading.get_ident()
        self._memory = False

    def start(self) -> PhaseTrace:
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        if cuda:
            with contextlib.suppress(Exception):  # a build without the recorder: the trace alone
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
                self._memory = True
        with _quiet_native_stderr():
            self._prof.__enter__()
        self._open_step()
        return self

    def enter(self, phase: str) -> None:
        if self._prof is not None and self._phase is None and threading.get_ident() == self._thread:
            self._phase = record_function(RANGE.format(phase))
            self._phase.__enter__()

    def leave(self) -> None:
        if self._phase is not None and threading.get_ident() == self._thread:
            self._phase.__exit__(None, None, None)
            self._phase = None

    def end_step(self) -> bool:
        """One optimizer step traced; True once all are (the files are then written: `files`)."""
        if self._prof is None:
            return self.files is not None
        self.leave()
        self._step.__exit__(None, None, None)
        self.done += 1
        if self.done >= self.steps:
            self.stop()
            return True
        self._open_step()
        return False

    def stop(self) -> TraceFiles | None:
        """End the trace where it is (all its steps, or fewer when the run ended first) and write it."""
        if self._prof is None:
            return self.files
        self.leave()
        if self._step is not None and self.done < self.steps:
            self._step.__exit__(None, None, None)
        self._step = None
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace, snapshot = self.folder / f"{self.name}.json", self.folder / f"{self.name}-memory.pickle"
        prof.export_chrome_trace(str(trace))
        memory = None
        if self._memory:
            with contextlib.suppress(Exception):
                torch.cuda.memory._dump_snapshot(str(snapshot))
                memory = str(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        self.files = TraceFiles(str(trace), self.done, memory)
        return self.files

    def _open_step(self) -> None:
        self._step = record_function(RANGE.format(f"step {self.done + 1}"))
        self._step.__enter__()


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the profiler's start and stop: torch's profiler library writes a line of
    its own there for each ("USDT: … profiler_start"), which would land in the middle of the user's output."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no descriptor 2 to save: as it is
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
