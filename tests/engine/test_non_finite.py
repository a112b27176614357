"""A diverging learning rate, for real: no checkpoint holding NaN or infinite state is ever written, the
run ends in one line naming the last finite checkpoint, and an absurd learning rate is refused in one line."""

from __future__ import annotations

import pytest
import torch

from saturate.cli import main
from saturate.engine.checkpoint import CheckpointManager, load_checkpoint
from saturate.plan import Plan

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


def argv(corpus, run_dir, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), *TINY, "--effective-batch", "4", "--param", "warmup_steps=0",
            "--steps", "30", "--ckpt-every", "1", "--log-every", "1", "--no-progress", "--run-dir", str(run_dir),
            *extra]


def finite(value) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(finite(v) for v in value)
    return True


@pytest.mark.parametrize("fused", [False, True])
def test_diverging_run_never_checkpoints_non_finite_state(tmp_path, small_corpus, capsys, fused):
    # lr 100 on this model: the loss grows for a few steps, then a gradient overflows to inf while the loss
    # is still finite; the unfused Adam's second moment becomes inf (weights still finite), and the next step is
    # NaN. The fused kernel (the default plan's on a CPU since 2026-11-25) reaches a NaN loss first instead.
    Plan(micro_batch=4, grad_accum=1, fused_optimizer=fused).save(tmp_path / "plan.toml")
    code = main(argv(small_corpus, tmp_path / "run", "--param", "lr=100", "--plan", str(tmp_path / "plan.toml")))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    found = CheckpointManager(tmp_path / "run" / "checkpoints").checkpoints()
    assert found, "the first steps are finite and checkpointed"
    last = found[-1][0]
    state_line = (f"saturate: error: the model or optimizer state became non-finite (nan or inf) by step "
                  f"{last + 1}, so it was not saved; lower the learning rate; the last finite checkpoint "
                  f"(step {last}) is kept")
    if not fused:
        assert err[0] == state_line
    else:
        assert err[0] == state_line or (err[0].startswith("saturate: error: training loss became nan at step ")
                                        and "the last checkpoint is kept" in err[0]), err
    for _, path in found:  # every checkpoint a resume could pick holds finite numbers only
        state = load_checkpoint(path)
        assert finite(state["model"]) and finite(state["optimizer"]), path


def test_absurd_learning_rate_is_one_line(tmp_path, small_corpus, capsys):
    code = main(argv(small_corpus, tmp_path / "run", "--param", "lr=1e300"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["saturate: error: lr must be a finite number below 3.4e+38 (float32's largest), "
                                 "got 1e+300"]
