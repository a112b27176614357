"""Metrics are computed once in the trainer and sent to sinks: JSONL, TensorBoard, the console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from saturate.atomic import DiskFullError, atomic_write_bytes, full_disk_reason, is_disk_full


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": N, "train/loss": ..., ...}."""

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

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = json.dumps({"step": step, **metrics}) + "\n"
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


class TensorBoardSink:
    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # purge_step hides events a killed run wrote past its last checkpoint, like the JSONL cut.
        purge = resume_step + 1 if resume_step is not None else None
        self._w = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._w.add_scalar(key, value, step)

    def close(self) -> None:
        self._w.close()


def tensorboard_sink(folder: Path, resume_step: int | None = None) -> TensorBoardSink | None:
    """A TensorBoard sink when tensorboard is installed, else None (JSONL is always written)."""
    try:
        return TensorBoardSink(folder, resume_step)
    except ImportError:
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
