"""Whether a checkpoint can be trusted before it is used: a content hash of every file, recorded when it is
written and checked when it is read, and loading that treats a checkpoint as data, never code.

- A file checkpoint `ckpt-<step>.pt` has its SHA-256 in `ckpt-<step>.pt.sha256`, written (atomically)
  before the checkpoint gets its name, so a checkpoint under its name always has its hash.
- A DCP folder holds `manifest.json`: the SHA-256 of every file in it (each rank hashes the shards it
  wrote; rank 0 writes the manifest before the folder is renamed). On load the ranks share the checking.
- `torch_load` reads with weights_only=True and turns torch's failures into one line: an empty file, a
  file that is not a torch archive at all, a truncated archive, or one naming code (`posix.system`) are
  each said plainly, without torch's advice to load with weights_only=False.
- DCP reads `.metadata` with plain pickle: `check_dcp_metadata` unpickles it first admitting only DCP's
  own data classes, checking each class's name against the allow-list before anything is imported.

A checkpoint written before hashes were recorded (no `.sha256`, no manifest) loads unverified.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch

from saturate.atomic import atomic_write_bytes
from saturate.errors import CheckpointError

HASH_SUFFIX = ".sha256"
MANIFEST = "manifest.json"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive is a zip
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + HASH_SUFFIX)


def record_hash(checkpoint: Path, written: Path) -> None:
    """Record the hash of `written` (the checkpoint under its temporary name) for `checkpoint`."""
    atomic_write_bytes(hash_path(checkpoint), (file_sha256(written) + "\n").encode())


def verify_file(path: Path) -> None:
    """Raise a CheckpointError naming the file and the damage when its content is not what was written."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is damaged: it is empty (0 bytes)")
    recorded = hash_path(path)
    if recorded.is_file():
        want = recorded.read_text().strip()
        if file_sha256(path) != want:
            raise CheckpointError(f"checkpoint {path} is damaged: its content ({size} bytes) does not match the "
                                  "SHA-256 recorded when it was written")


def files_written_by(folder: Path, rank: int) -> list[Path]:
    """The files of a DCP folder that `rank` wrote: its shards (`__<rank>_*.distcp`) and RNG state, and for
    rank 0 also DCP's `.metadata` and saturate's `meta.pt`."""
    mine = [p for p in folder.iterdir() if p.is_file() and (p.name.startswith(f"__{rank}_")
                                                           or p.name == f"rank-{rank:05d}.pt")]
    if rank == 0:
        mine += [p for p in (folder / ".metadata", folder / "meta.pt") if p.is_file()]
    return mine


def write_manifest(folder: Path, hashes: dict[str, str]) -> None:
    atomic_write_bytes(folder / MANIFEST, (json.dumps(hashes, indent=1, sort_keys=True) + "\n").encode())


def verify_folder_part(folder: Path, rank: int, world: int) -> str | None:
    """Check this rank's share of a DCP folder's manifest (every world-th file); the damage found, or None."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None  # written before manifests were recorded
    try:
        hashes = json.loads(manifest.read_text())
        if not isinstance(hashes, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        return f"checkpoint {folder} is damaged: its {MANIFEST} is unreadable ({e})"
    for i, name in enumerate(sorted(hashes)):
        if i % world != rank:
            continue
        path = folder / name
        if not path.is_file():
            return f"checkpoint {folder} is damaged: {name} is missing"
        if file_sha256(path) != hashes[name]:
            return f"checkpoint {folder} is damaged: {name} does not match the SHA-256 recorded when it was written"
    return None


def torch_load(path: Path, map_location: str | torch.device) -> dict[str, Any]:
    """torch.load with weights_only=True; every failure one line naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e.strerror or e}") from None
    if not head:
        raise CheckpointError(f"checkpoint {path} is damaged: it is empty (0 bytes)")
    if head != _ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a checkpoint (not a torch archive); refused")
    try:
        # weights_only: a checkpoint is data, never code to run.
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"refers to {named.group(1)}, which is not checkpoint data" if named else "holds objects that are not " \
            "checkpoint data"
        raise CheckpointError(f"{path} {what}; refused (a checkpoint is data, never code)") from None
    except Exception as e:  # torch raises RuntimeError and others for a damaged archive
        first = str(e).strip().split(". ")[0].splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is damaged: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a saturate checkpoint (it holds a {type(state).__name__})")
    return state


def check_dcp_metadata(folder: Path) -> None:
    """Refuse a DCP folder whose `.metadata` pickle names anything but DCP's own data classes.

    DCP unpickles `.metadata` with plain pickle; checked first with a restricted unpickler, a
    checkpoint folder, like a checkpoint file (weights_only=True), is data and never code to run.
    """
    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no .metadata (not a complete DCP checkpoint)") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {folder} has unreadable metadata: {type(e).__name__}: {e}") from None


_DCP_PACKAGE = "torch.distributed.checkpoint."
_ALLOWED = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"),
            # DCP records the checkpoint's path
            *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # The name is checked before anything is imported: a module outside the allow-list is never loaded.
        refused = CheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not checkpoint data")
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":  # torch.Size and the dtype, layout and memory-format constants (torch is loaded)
            obj = getattr(sys.modules["torch"], name, None) if name.isidentifier() else None
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
            raise refused
        if not module.startswith(_DCP_PACKAGE) or not all(part.isidentifier() for part in module.split(".")):
            raise refused
        obj = super().find_class(module, name)  # a module of torch's own DCP package
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        raise refused
