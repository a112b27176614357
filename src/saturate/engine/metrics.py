"""Metrics are computed once in the trainer and sent to sinks: JSONL (always), TensorBoard, CSV, and the
trackers of `trackers.py` (Weights & Biases, MLflow), and the console.

A sink is anything with the two methods of `Sink` (it is public: `saturate.Sink`); pass your own in
`RunConfig(log_to=[…])`. A record is one flat dict: {"step": N, "train/loss": …, "throughput/…": …} for a
logged window, {"step": N, "val/loss": …} for a validation, and the workload's own end-of-run metrics.
`Sinks` sends each record to every sink and drops one that fails (a full disk, a tracker's error) with one
warning, so a sink never stops training.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from saturate.atomic import DiskFullError, atomic_write_bytes, full_disk_reason, is_disk_full


@runtime_checkable
class Sink(Protocol):
    """Where metric records go. `write` gets each record as it is logged (rank 0 only, in step order; a
    resumed run starts again after its checkpoint's step); `close` is called once when training ends, however
    it ends. An exception from either is reported once and the sink dropped; training goes on."""

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """A record's metrics without its step (what a tracker takes as scalars)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class Sinks:
    """Every sink of a run behind one `write`: a sink that raises is dropped with one note (`warn`)."""

    def __init__(self, sinks: Iterable[Sink], warn: Callable[[str], None]) -> None:
        self.sinks = list(sinks)
        self._warn = warn

    def write(self, record: dict[str, Any]) -> None:
        for s in list(self.sinks):
            try:
                s.write(record)
            except Exception as e:  # a metrics sink never stops training
                self._drop(s, f"at step {record.get('step')}", e)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                self._drop(s, "while closing", e)
        self.sinks = []

    def _drop(self, sink: Sink, when: str, e: Exception) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._warn(f"metrics sink {sink_name(sink)} failed {when} ({text}); dropped, training goes on")


def sink_name(sink: Any) -> str:
    return getattr(sink, "name", None) or type(sink).__name__


class JsonlSink:
    """One JSON object per line: {"step": N, "train/loss": ..., ...}."""

    name = "metrics.jsonl"

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            self._truncate_after(resume_step)
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - held open for the run, closed by close()
        self._failed = False

    def _truncate_after(self, step: int) -> None:
        # A killed run may have logged steps past its last checkpoint; the resumed run logs
        # them again, so drop them to keep one record per step.
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
        atomic_write_bytes(self.path, "".join(k + "\n" for k in kept).encode())

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        try:
            self._f.write(line)
        except OSError as e:
            self._failed = True
            if is_disk_full(e):
                reason = full_disk_reason(self.path.parent, len(line.encode()))
                raise DiskFullError(f"could not append to {self.path.name}: {reason}") from None
            raise

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            if not self._failed:  # the line that failed was already reported
                raise


class CsvSink:
    """metrics.csv: a row per record, a column per metric (blank where a record lacks it). A metric first seen
    mid-run (val/loss at the first validation) rewrites the file once with the wider header."""

    name = "metrics.csv"

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self._columns: list[str] = ["step"]
        rows: list[dict[str, str]] = []
        if resume_step is not None and path.exists():  # keep the rows up to the checkpoint, as for the JSONL
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or ["step"])
                rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, self._columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(self.path, text.getvalue().encode())
        self._f = open(self.path, "a", newline="", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        new = [k for k in record if k not in self._columns]
        if new:
            self._f.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self._columns += new
            self._rewrite(rows)
        csv.DictWriter(self._f, self._columns, restval="").writerow(record)

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (a dependency)

        # purge_step hides events a killed run wrote past its last checkpoint, like the JSONL cut.
        purge = resume_step + 1 if resume_step is not None else None
        self._w = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in numeric(record).items():
            self._w.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._w.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
