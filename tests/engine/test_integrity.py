"""Damaged and foreign checkpoints, made for real (truncated, emptied, overwritten with random bytes, a few
bits flipped, replaced by a pickle that names code, a DCP shard altered): each is named with its damage in
one line and the resume falls back to the previous good checkpoint, saying so."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from saturate.cli import main
from saturate.engine.checkpoint import CheckpointManager, check_dcp_metadata, load_checkpoint
from saturate.engine.distributed import DistInfo
from saturate.engine.resume import load_resume_state
from saturate.engine.trainer import RunConfig, train
from saturate.errors import CheckpointError
from saturate.plan import Plan
from saturate.workloads import build_workload

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cpu) -> Path:
    """A tiny run with checkpoints at steps 2 and 4 (and its corpus beside it)."""
    from conftest import make_small_corpus

    root = tmp_path_factory.mktemp("integrity")
    corpus = make_small_corpus(root)
    workload = build_workload("gpt-tiny", data=[str(corpus)], effective_batch=4, **TINY)
    train(workload, Plan(micro_batch=4), RunConfig(run_dir=root / "run", steps=4, ckpt_every=2, progress=False,
                                                    tensorboard=False, telemetry=False), hardware=cpu)
    return root / "run"


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this would run",))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_bits(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x21  # inside a tensor's bytes: torch itself would load this without a word
    p.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (_truncate, "is damaged: its content .* does not match the SHA-256 recorded"),
    "emptied": (lambda p: p.write_bytes(b""), "is damaged: it is empty"),
    "random": (lambda p: p.write_bytes(os.urandom(4096)), "is damaged: its content .* does not match"),
    "flipped bits": (_flip_bits, "is damaged: its content .* does not match the SHA-256 recorded"),
    # foreign files dropped in under a checkpoint's name, without a recorded hash
    "code": (lambda p: torch.save({"model": _RunsCode()}, p), r"refers to posix.system, which is not checkpoint data"),
    "an executable": (lambda p: shutil.copyfile(sys.executable, p), r"is not a checkpoint \(not a torch archive\)"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_named_and_the_previous_is_used(kind, trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage, reason = DAMAGE[kind]
    foreign = kind in ("code", "an executable")
    newest = run / "checkpoints" / ("ckpt-00000006.pt" if foreign else "ckpt-00000004.pt")
    damage(newest)

    state = load_resume_state(CheckpointManager(run / "checkpoints"), DistInfo())
    previous = 4 if foreign else 2
    assert state["step"] == previous
    skipped, used = capsys.readouterr().err.splitlines()  # exactly two lines: what was skipped, what is used
    assert re.fullmatch(rf"saturate: warning: (checkpoint )?{re.escape(str(newest))} {reason}.*; skipped", skipped)
    assert "weights_only" not in skipped
    assert used == (f"saturate: warning: resuming from the previous good checkpoint "
                    f"{run / 'checkpoints' / f'ckpt-{previous:08d}.pt'} (step {previous})")


def test_no_good_checkpoint_is_refused_in_one_line(trained, tmp_path, capsys, small_corpus):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for p in (run / "checkpoints").glob("ckpt-*.pt"):  # files that are not checkpoints at all, no hashes
        shutil.copyfile(sys.executable, p)
        p.with_name(p.name + ".sha256").unlink()
    code = main(["train", "--data", str(small_corpus), "--run-dir", str(run), "--resume", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"saturate: error: --resume: no loadable checkpoint in {run / 'checkpoints'} (")
    assert "is not a checkpoint (not a torch archive)" in err[0] and "weights_only" not in err[0]


def test_an_altered_dcp_shard_is_found(tmp_path, small_corpus, cpu, capsys):
    """A DCP folder (FSDP on a group of one) records every shard's hash in manifest.json."""
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, **TINY)
    train(workload, Plan(micro_batch=4, strategy="fsdp"), RunConfig(
        run_dir=tmp_path / "run", steps=4, ckpt_every=2, progress=False, tensorboard=False, telemetry=False),
        hardware=cpu)
    from saturate.engine.distributed import teardown_distributed

    teardown_distributed()
    newest = tmp_path / "run" / "checkpoints" / "ckpt-00000004"
    assert (newest / "manifest.json").is_file()
    _flip_bits(newest / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"ckpt-00000004 is damaged: __0_0.distcp does not match the SHA-256"):
        load_checkpoint(newest)
    state = load_resume_state(CheckpointManager(newest.parent), DistInfo())
    assert state["step"] == 2
    assert "resuming from the previous good checkpoint" in capsys.readouterr().err


def test_dcp_metadata_names_are_checked_before_any_import(tmp_path, monkeypatch):
    """A pickle naming a module outside the allow-list is refused without importing that module."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "side_effect_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass Thing: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    (tmp_path / ".metadata").write_bytes(b"csid" + b"e_effect_module\nThing\n)R.")
    with pytest.raises(CheckpointError, match="side_effect_module.Thing, which is not checkpoint data"):
        check_dcp_metadata(tmp_path)
    assert not (tmp_path / "imported").exists() and "side_effect_module" not in sys.modules
    (tmp_path / ".metadata").write_bytes(pickle.dumps(torch.float32) + b"")
    check_dcp_metadata(tmp_path)  # a dtype is data
