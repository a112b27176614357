"""Atomic checkpoints: write to a temporary name in the same folder, fsync, rename, keep the last K.

A crash (even SIGKILL) during a write leaves at most a stray temporary file, never a
half-written checkpoint under a real name, so the newest `ckpt-*.pt` is always complete.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import torch

from saturate.atomic import atomic_write
from saturate.errors import CheckpointError

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointManager:
    def __init__(self, folder: Path, keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep_checkpoints must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        path = self.folder / f"ckpt-{step:08d}.pt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: torch.save(state, f))
        except OSError as e:
            previous = [s for s, _ in self.checkpoints() if s != step]
            kept = f"the previous checkpoint (step {previous[-1]}) is kept" if previous else "no earlier checkpoint"
            reason = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise CheckpointError(
                f"could not write checkpoint for step {step} in {self.folder}: {reason}; {kept}") from e
        for _, old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def remove_stale_temporaries(self) -> None:
        """Temporary files left by a process killed mid-write; only called when resuming."""
        if self.folder.is_dir():
            for p in self.folder.glob(".ckpt-*.pt.tmp-*"):
                p.unlink(missing_ok=True)

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads; a damaged one is skipped with its reason kept."""
        self.skipped: list[str] = []
        for _, path in reversed(self.checkpoints()):
            try:
                return load_checkpoint(path, map_location), path
            except CheckpointError as e:
                self.skipped.append(str(e))
        return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    try:
        # weights_only: a checkpoint is data, never code to run.
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as e:  # torch raises several types for a damaged archive
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {type(e).__name__}: {e}") from None
