"""A full disk, for real (a small tmpfs filled to its last KiB, see conftest.SmallDisk): every file a run
writes fails in one line naming the folder and the space needed, exit 2, the previous checkpoint kept and
no temporary left. The command line runs in this process (no interpreter start-up per test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import SmallDisk
from saturate.atomic import DiskFullError
from saturate.cli import main
from saturate.engine import trainer
from saturate.engine.checkpoint import CheckpointManager
from saturate.engine.metrics import JsonlSink
from saturate.plan import Plan

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")
FULL = r"the disk is full: (about|more than) [\d.]+ (bytes|[KMG]iB) needed in {folder}(, [\d.]+ (bytes|[KMG]iB) free)?"


def train_argv(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), *TINY, "--effective-batch", "4", "--log-every", "1", "--no-progress",
            "--run-dir", str(run_dir), *extra]


def fill_before(monkeypatch: pytest.MonkeyPatch, module: object, name: str, disk: SmallDisk, call: int) -> None:
    """Fill the disk just before the `call`-th call of module.name (the write under test)."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            disk.fill()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def no_temporaries(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if ".tmp" in p.name], list(folder.rglob("*"))


@pytest.mark.parametrize("strategy", ["single", "fsdp"])  # a checkpoint file, and a DCP folder
def test_checkpoint_on_a_full_disk_keeps_the_previous_one(small_disk, small_corpus, monkeypatch, capsys, strategy):
    run_dir = small_disk.folder / "run"
    plan = small_disk.folder.parent / "plan.toml"
    Plan(micro_batch=4, strategy=strategy).save(plan)
    fill_before(monkeypatch, trainer, "_checkpoint", small_disk, call=2)
    code = main(train_argv(small_corpus, run_dir, "--plan", str(plan), "--steps", "6", "--ckpt-every", "2"))
    line = one_error_line(capsys)
    assert code == 2
    folder = re.escape(str(run_dir / "checkpoints"))
    assert re.fullmatch(rf"saturate: error: could not write checkpoint for step 4: {FULL.format(folder=folder)}; "
                        r"the previous checkpoint \(step 2\) is kept", line), line
    assert [s for s, _ in CheckpointManager(run_dir / "checkpoints").checkpoints()] == [2]
    no_temporaries(run_dir)


def test_export_on_a_full_disk(small_disk, small_corpus, monkeypatch, capsys):
    if not small_disk.mounted:
        pytest.skip("safetensors replaces a /dev/full link with a file of its own: needs a real small tmpfs")
    run_dir = small_disk.folder / "run"
    fill_before(monkeypatch, trainer, "export_weights", small_disk, call=1)
    code = main(train_argv(small_corpus, run_dir, "--steps", "2", "--ckpt-every", "2"))
    line = one_error_line(capsys)
    assert code == 2
    assert re.fullmatch(rf"saturate: error: could not export weights to model.safetensors: "
                        rf"{FULL.format(folder=re.escape(str(run_dir)))}; the last checkpoint is kept", line), line
    assert not (run_dir / "model.safetensors").exists()
    assert [s for s, _ in CheckpointManager(run_dir / "checkpoints").checkpoints()] == [2]
    no_temporaries(run_dir)


def test_plan_and_metrics_on_a_full_disk(small_disk):
    metrics = JsonlSink(small_disk.full_file("metrics.jsonl"))
    small_disk.fill(leave=0)
    folder = re.escape(str(small_disk.folder))
    with pytest.raises(DiskFullError, match=rf"could not write plan.toml: {FULL.format(folder=folder)}$"):
        Plan(provenance={"padding": "x" * 20000}).save(small_disk.folder / "plan.toml")
    with pytest.raises(DiskFullError, match=rf"could not append to metrics.jsonl: {FULL.format(folder=folder)}$"):
        metrics.write({"step": 1, **{f"key/{i}": float(i) for i in range(2000)}})
    metrics.close()  # the failed line is not raised a second time
    assert not (small_disk.folder / "plan.toml").exists()
    no_temporaries(small_disk.folder)
