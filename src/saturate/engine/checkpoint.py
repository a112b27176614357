"""Atomic checkpoints: write to a temporary name in the same folder, fsync, rename, keep the last K.

A crash (even SIGKILL) during a write leaves at most a stray temporary, never a half-written
checkpoint under a real name, so the newest checkpoint is always complete. Two forms:

- `ckpt-<step>.pt`, one file (a single process): `torch.save` of every piece's state dict.
- `ckpt-<step>/`, a folder (DDP and FSDP): model and optimizer through `torch.distributed.checkpoint`
  (DCP), each rank writing its own shards, plus `meta.pt` (step, schedule, plan, fingerprint…) and
  one `rank-<r>.pt` of RNG state per rank. All ranks write into `ckpt-<step>.tmp/`; once DCP has
  written its `.metadata` and every rank has finished, rank 0 renames the folder. The rename is the
  commit: a folder under its final name is complete.

Either form resumes at any process count: DCP reshards FSDP's sharded state on load, and a
single-process file is loaded whole into DDP replicas or FSDP shards. Every checkpoint carries the
SHA-256 of its files (`integrity.py`), checked on load: a damaged newest checkpoint is skipped, with its
reason, for the previous good one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from saturate.atomic import DiskFullError, atomic_path, atomic_write, fsync_dir, full_disk_reason, is_disk_full
from saturate.engine.distributed import agree_any, barrier, dist_info, gather_objects
from saturate.engine.integrity import (
    HASH_SUFFIX,
    check_dcp_metadata,
    file_sha256,
    files_written_by,
    hash_path,
    record_hash,
    torch_load,
    verify_file,
    verify_folder_part,
    write_manifest,
)
from saturate.errors import CheckpointError

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
_DIR = re.compile(r"^ckpt-(\d{8})$")
_TMP_DIR = re.compile(r"^ckpt-\d{8}\.tmp$")
META = "meta.pt"


class CheckpointManager:
    def __init__(self, folder: Path, keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep_checkpoints must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (files and DCP folders), oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            if (m := _NAME.match(p.name)) or (m := _DIR.match(p.name)) and (p / META).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        path = self.folder / f"ckpt-{step:08d}.pt"
        needed = state_bytes(state)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(path, needed) as tmp:
                with open(tmp, "wb") as f:
                    torch.save(state, f)
                record_hash(path, tmp)  # before the checkpoint has its name, so a named one always has its hash
        except (OSError, DiskFullError) as e:
            raise self._save_error(step, e, needed) from None
        self._prune()
        return path

    def _save_error(self, step: int, e: BaseException | None, needed: int) -> CheckpointError:
        """One line: what failed, why (for a full disk: the folder, the space needed and free), what is kept."""
        previous = [s for s, _ in self.checkpoints() if s != step]
        kept = f"the previous checkpoint (step {previous[-1]}) is kept" if previous else "no earlier checkpoint"
        if e is None:
            reason = "another rank failed to write its part"
        elif is_disk_full(e) or any(is_disk_full(getattr(c, "exc", c)) for c in getattr(e, "failures", {}).values()):
            reason = full_disk_reason(self.folder, needed)
        else:
            reason = f"{_first_line(e)} (in {self.folder})"
        return CheckpointError(f"could not write checkpoint for step {step}: {reason}; {kept}")

    def save_sharded(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                     rank_state: dict[str, Any]) -> Path:
        """Every rank calls this at the same step: DCP for model and optimizer, committed by a rename."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rank = dist_info().rank if _group_up() else 0
        final = self.folder / f"ckpt-{step:08d}"
        tmp = self.folder / f"ckpt-{step:08d}.tmp"
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed save of this same step
        barrier()
        error: BaseException | None = None
        needed = 0
        hashes: dict[str, str] = {}
        try:
            model_state, optim_state = get_state_dict(model, optimizer)
            needed = state_bytes((model_state, optim_state))  # global sizes: every rank's parts together
            with _single_process_quiet():
                dcp.save({"model": model_state, "optimizer": optim_state},
                         storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
            atomic_write(tmp / f"rank-{rank:05d}.pt", lambda f: torch.save(rank_state, f))
            if rank == 0:
                atomic_write(tmp / META, lambda f: torch.save(meta, f))
            hashes = {p.name: file_sha256(p) for p in files_written_by(tmp, rank)}
        except (OSError, DiskFullError, CheckpointException) as e:  # DCP reports any rank's failure on every rank
            error = e
        except RuntimeError as e:  # torch's writers raise RuntimeError over an OSError
            if not is_disk_full(e):
                raise
            error = e
        every = gather_objects(hashes if error is None else None)
        if rank == 0 and all(h is not None for h in every):
            try:  # the manifest, inside the folder before its rename: a named folder always has one
                write_manifest(tmp, {name: h for part in every for name, h in part.items()})
            except (OSError, DiskFullError) as e:
                error = e
        if agree_any(error is not None):  # also the barrier: every rank has written its part
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._save_error(step, error, needed)
        if rank == 0:
            if final.exists():  # an unloadable checkpoint of this step that the resume skipped
                shutil.rmtree(final)
            os.replace(tmp, final)  # the commit
            fsync_dir(self.folder)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        for _, old in self.checkpoints()[: -self.keep]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
                hash_path(old).unlink(missing_ok=True)

    def remove_stale_temporaries(self) -> None:
        """Temporaries left by a process killed mid-write; only called when resuming (by rank 0)."""
        if self.folder.is_dir():
            for p in self.folder.glob(".ckpt-*.tmp-*"):  # a checkpoint's or its hash's temporary
                p.unlink(missing_ok=True)
            for p in self.folder.glob(f"ckpt-*.pt{HASH_SUFFIX}"):  # a hash whose checkpoint never got its name
                if not p.with_name(p.name.removesuffix(HASH_SUFFIX)).exists():
                    p.unlink(missing_ok=True)
            for p in self.folder.iterdir():
                if _TMP_DIR.match(p.name) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    def load_latest(self, map_location: str | torch.device = "cpu",
                    check: Callable[[dict[str, Any], Path], None] | None = None) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads, matches its recorded hashes and passes `check`; a damaged or
        foreign one is skipped, its reason kept in `skipped` (one line each, newest first)."""
        self.skipped: list[str] = []
        for _, path in reversed(self.checkpoints()):
            try:
                state = load_checkpoint(path, map_location)
                if check is not None:
                    check(state, path)
                return state, path
            except CheckpointError as e:
                self.skipped.append(str(e))
        return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A file checkpoint whole; for a DCP folder, its `meta.pt` plus this rank's RNG state.

    A folder's model and optimizer are read later, into the built model (`restore_model_and_optimizer`).
    """
    path = Path(path)
    if path.is_dir():
        rank, world = (dist_info().rank, dist_info().world_size) if _group_up() else (0, 1)
        damage = [d for d in gather_objects(verify_folder_part(path, rank, world)) if d]  # the ranks share the reading
        if damage:
            raise CheckpointError(damage[0])
        state = torch_load(path / META, map_location)
        state["sharded"] = True
        rank_file = path / f"rank-{dist_info().rank if _group_up() else 0:05d}.pt"
        state["rng"] = torch_load(rank_file, map_location)["rng"] if rank_file.is_file() else None
        return state
    verify_file(path)
    return torch_load(path, map_location)


def restore_model_and_optimizer(state: dict[str, Any], path: Path, model: nn.Module,
                                optimizer: torch.optim.Optimizer, sharded_model: bool) -> None:
    """Load a checkpoint's model and optimizer into a built model, whatever the process count.

    `model` is the module itself (DDP's inner module, or FSDP's root); `sharded_model` is True
    under FSDP. A DCP folder is read with DCP, which reshards to the current ranks; a file is
    the single-process form, loaded as is, or split into FSDP's shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    try:
        if state.get("sharded"):
            import torch.distributed.checkpoint as dcp

            # get_state_dict allocates the optimizer's lazy state, so DCP knows every shape to read.
            model_state, optim_state = get_state_dict(model, optimizer)
            check_dcp_metadata(path)
            with _single_process_quiet():
                dcp.load({"model": model_state, "optimizer": optim_state},
                         storage_reader=dcp.FileSystemReader(str(path)))
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        elif sharded_model:
            optim_state = _optimizer_state_by_name(state["optimizer"], model, optimizer)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state,
                           options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except CheckpointError:
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"checkpoint {path} does not fit this model: {type(e).__name__}: {text}") from None


def _optimizer_state_by_name(saved: dict[str, Any], model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer state dict (parameters numbered in group order) keyed by parameter name instead,
    the form `set_state_dict` takes; the optimizer was built from the same model in the same order."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {order[i]: v for i, v in saved["state"].items()}
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no group is up: here that is the intent."""
    with warnings.catch_warnings():
        if not _group_up():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _first_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def state_is_finite(model: nn.Module, optimizer: torch.optim.Optimizer, *extra: torch.Tensor | None) -> bool:
    """Whether every parameter, buffer and optimizer state tensor (and `extra`: the last gradient norm) is
    finite, on every rank. Checked on the device, one flag per tensor, one host sync; a diverged step can
    leave finite weights beside an infinite Adam second moment, which the next step turns into NaN."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in extra if t is not None),
               *(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
    flags = []
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        if t.is_floating_point() and t.numel():
            flags.append(torch.isfinite(t).all())
    bad = bool(flags) and not bool(torch.stack([f.to(flags[0].device) for f in flags]).all())  # deliberate sync
    return not agree_any(bad)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state: what a checkpoint of it needs on disk, about.
    A DTensor counts its global size (DCP writes every shard, replicated ones once)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0
