"""Whole-or-nothing file writes: a temporary name in the same folder, fsync, then rename.

Every file saturate writes that a later run reads (checkpoints, token shards, plans, weights)
goes through here, so a crash, a SIGKILL or a full disk never leaves a half-written file under a
real name; at most a `.NAME.tmp-*` file that the next run can delete.

A full disk is recognised however the writer reports it (an `OSError` with ENOSPC or EDQUOT; torch's
zip writer raises a `RuntimeError` over that OSError; safetensors' Rust writer says "os error 28") and
becomes a `DiskFullError`: one line naming the folder, the space needed and the space free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from saturate.errors import SaturateError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (f"os error {errno.ENOSPC}", f"os error {errno.EDQUOT}", os.strerror(errno.ENOSPC),
               os.strerror(errno.EDQUOT))


class DiskFullError(SaturateError):
    """A write failed because the disk (or the user's quota) is full; nothing half-written was left."""


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from or during, is a full disk or quota."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(t in str(e) for t in _FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def full_disk_reason(folder: Path, needed: int | None = None, written: int | None = None) -> str:
    """'the disk is full: about 12.0 MiB needed in DIR, 1.1 MiB free' (what is known of it)."""
    try:
        free = f", {_size(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = ""
    if needed:
        need = f"about {_size(needed)} needed"
    elif written:
        need = f"more than {_size(written)} needed"
    else:
        need = "more space needed"
    return f"the disk is full: {need} in {folder}{free}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def temporary_name(path: Path) -> Path:
    # pid and a random suffix keep concurrent writers (torchrun ranks, threads) apart.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is fsynced and renamed onto `path`.

    On any failure the temporary is removed; a full disk becomes a DiskFullError naming the folder and
    the space `needed` (bytes, when the caller knows it; else what was written before the disk filled).
    """
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
    except BaseException as e:
        written = tmp.stat().st_size if tmp.exists() else None
        tmp.unlink(missing_ok=True)
        if isinstance(e, Exception) and not isinstance(e, DiskFullError) and is_disk_full(e):
            raise DiskFullError(f"could not write {path.name}: "
                                f"{full_disk_reason(path.parent, needed, written)}") from e
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object],
                 needed: int | None = None) -> None:
    """Call write(file) on a temporary file, then make it `path` atomically."""
    with atomic_path(path, needed) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data), needed=len(data))


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
