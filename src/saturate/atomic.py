"""Whole-or-nothing file writes: a temporary name in the same folder, fsync, then rename.

Every file saturate writes that a later run reads (checkpoints, token shards, plans, weights)
goes through here, so a crash, a SIGKILL or a full disk never leaves a half-written file under a
real name; at most a `.NAME.tmp-*` file that the next run can delete.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def temporary_name(path: Path) -> Path:
    # pid and a random suffix keep concurrent writers (torchrun ranks, threads) apart.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is fsynced and renamed onto `path`."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call write(file) on a temporary file, then make it `path` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX); best effort where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
