"""The distributed pieces in one process: strategy and plan rules, DCP checkpoint folders, FSDP of one.

The two-process behaviour (DDP/FSDP equal to one process, resume, OOM agreement) is in
test_torchrun.py; here is what can be checked without starting processes.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from saturate.engine.checkpoint import (
    CheckpointManager,
    check_dcp_metadata,
    load_checkpoint,
    restore_model_and_optimizer,
)
from saturate.engine.distributed import (
    DistInfo,
    agree_any,
    all_reduce_scalar,
    broadcast_object,
    distributed_session,
    gather_objects,
    resolve_strategy,
)
from saturate.engine.resume import checkpoint_plan
from saturate.engine.trainer import RunConfig, train
from saturate.engine.wrap import build_optimizer, repeated_blocks
from saturate.errors import CheckpointError, ConfigError
from saturate.hardware import probe
from saturate.plan import Plan, default_plan, fit_to_world
from saturate.workloads import Optimization, build_workload
from saturate.workloads.gpt import GPT, GPTConfig


def test_strategy_follows_the_process_count():
    assert resolve_strategy("single", 1) == ("single", None)
    assert resolve_strategy("ddp", 4) == ("ddp", None)
    assert resolve_strategy("fsdp", 1) == ("fsdp", None)  # FSDP of one: offload and mixed precision
    strategy, note = resolve_strategy("single", 2)
    assert strategy == "ddp" and "2 processes under torchrun" in note
    strategy, note = resolve_strategy("ddp", 1)
    assert strategy == "single" and "torchrun --nproc_per_node=N" in note


def test_fit_to_world_keeps_the_effective_batch():
    plan = Plan(micro_batch=4, grad_accum=4)
    assert fit_to_world(plan, 16, 1) is plan
    assert fit_to_world(plan, 16, 2).grad_accum == 2
    assert fit_to_world(plan, 16, 4).grad_accum == 1
    with pytest.raises(ConfigError, match="effective batch 16 does not split into micro-batch 4 × 3 process"):
        fit_to_world(plan, 16, 3)
    with pytest.raises(ConfigError):
        fit_to_world(plan, 16, 8)  # 4 × 8 = 32 > 16


def test_default_plan_is_global_over_processes():
    one = default_plan(32, "cuda", {"bf16": True})
    two = default_plan(32, "cuda", {"bf16": True}, world_size=2)
    assert one.samples_per_step(1) == two.samples_per_step(2) == 32
    assert (one.strategy, two.strategy) == ("single", "ddp")
    assert default_plan(32, "cuda", {}, world_size=3).samples_per_step(3) == 33  # the nearest share: 11 each


def test_cpu_offload_needs_fsdp():
    with pytest.raises(ConfigError, match="cpu_offload needs plan.strategy = 'fsdp'"):
        Plan(cpu_offload=True)
    assert Plan(strategy="fsdp", cpu_offload=True).cpu_offload


def test_resume_at_another_process_count_refits_or_refuses_naming_both():
    state = {"plan": Plan(micro_batch=4, grad_accum=1, strategy="ddp").to_dict(), "world_size": 2,
             "path": "ckpt-00000006"}
    notes: list[str] = []
    assert checkpoint_plan(state, 1, notes).grad_accum == 2
    assert "2 process(es) with 1: grad_accum 1 -> 2 keeps the effective batch 8" in notes[0]
    refused = r"written by 2 process\(es\), with 3: .*micro_batch × grad_accum × 3 = 8"
    with pytest.raises(CheckpointError, match=refused):
        checkpoint_plan(state, 3, [])


def test_collectives_are_identities_in_one_process():
    assert not DistInfo().active
    assert all_reduce_scalar(2.5, "mean") == 2.5
    assert all_reduce_scalar(3, "max") == 3.0
    assert agree_any(True) and not agree_any(False)
    assert broadcast_object({"a": 1}) == {"a": 1}
    assert gather_objects("x") == ["x"]
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce_scalar(1.0, "median")


def test_repeated_blocks_are_the_transformer_blocks():
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=16))
    assert repeated_blocks(model) == list(model.blocks)
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


# --- DCP checkpoint folders --------------------------------------------------------------------------


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64))
    optimizer, _ = build_optimizer(model, Optimization(effective_batch=8, lr=1e-3), 1e-3, False, torch.device("cpu"))
    return model, optimizer


def _one_step(model, optimizer):
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    model(x).logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_dcp_folder_round_trip_and_atomic_commit(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _one_step(model, optimizer)
    ckpts = CheckpointManager(tmp_path / "checkpoints", keep=2)
    meta = {"format": 1, "step": 5, "world_size": 1, "plan": Plan().to_dict()}
    path = ckpts.save_sharded(5, model, optimizer, meta, {"rng": {"torch": torch.get_rng_state()}})
    assert path.name == "ckpt-00000005" and (path / ".metadata").is_file() and (path / "meta.pt").is_file()
    assert not list(ckpts.folder.glob("*.tmp"))

    # A killed save leaves only a temporary folder: never listed, removed on resume.
    (ckpts.folder / "ckpt-00000009.tmp").mkdir()
    (ckpts.folder / "ckpt-00000009.tmp" / "__0_0.distcp").write_bytes(b"half")
    assert [s for s, _ in ckpts.checkpoints()] == [5]
    ckpts.remove_stale_temporaries()
    assert not (ckpts.folder / "ckpt-00000009.tmp").exists()

    state = load_checkpoint(path)
    assert state["step"] == 5 and state["sharded"] and state["rng"] is not None
    fresh, fresh_optimizer = _model_and_optimizer(1)
    restore_model_and_optimizer(state, path, fresh, fresh_optimizer, sharded_model=False)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _one_step(model, optimizer)
    _one_step(fresh, fresh_optimizer)  # the optimizer state came back too: the next step is the same
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    # Keep the newest 2 (folders are pruned whole).
    for step in (6, 7):
        ckpts.save_sharded(step, model, optimizer, {**meta, "step": step}, {"rng": None})
    assert [s for s, _ in ckpts.checkpoints()] == [6, 7]
    assert not (ckpts.folder / "ckpt-00000005").exists()


class _Evil:
    def __reduce__(self):
        return (print, ("this would run",))


def test_dcp_metadata_that_names_code_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="builtins.print, which is not checkpoint data"):
        check_dcp_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="no .metadata"):
        check_dcp_metadata(tmp_path / "missing")


def test_checkpoint_of_another_model_is_refused_clearly(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _one_step(model, optimizer)
    path = CheckpointManager(tmp_path).save_sharded(1, model, optimizer, {"step": 1}, {"rng": None})
    torch.manual_seed(0)
    other = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=16, vocab_size=64))
    other_optimizer, _ = build_optimizer(other, Optimization(effective_batch=8, lr=1e-3), 1e-3, False,
                                         torch.device("cpu"))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        restore_model_and_optimizer(load_checkpoint(path), path, other, other_optimizer, sharded_model=False)


# --- train() in one process with a distributed strategy -----------------------------------------------


@pytest.fixture
def tiny(small_corpus):
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2)


def _train(tmp_path, name, workload, plan):
    hw = probe(measure_peaks=False, device="cpu")
    config = RunConfig(run_dir=tmp_path / name, steps=2, progress=False, tensorboard=False, log_every=1,
                       eval_every=2)
    return train(workload, plan, config, hardware=hw)


def test_ddp_plan_in_one_process_trains_single_with_a_note(tmp_path, tiny):
    result = _train(tmp_path, "ddp1", tiny, Plan(micro_batch=4, grad_accum=2, strategy="ddp"))
    assert result.steps == 2 and result.plan.strategy == "single"
    assert any("plan.strategy 'ddp' with one process: training single-process" in n for n in result.notes)
    assert (result.run_dir / "checkpoints" / "ckpt-00000002.pt").is_file()  # the one-process file form


@pytest.mark.slow
def test_fsdp_in_one_process_matches_single_and_leaves_no_group(tmp_path, tiny):
    single = _train(tmp_path, "single", tiny, Plan(micro_batch=4, grad_accum=2))
    fsdp = _train(tmp_path, "fsdp1", tiny, Plan(micro_batch=4, grad_accum=2, strategy="fsdp"))
    assert not dist.is_initialized()  # the process group of one was made and destroyed by train()
    assert fsdp.plan.strategy == "fsdp" and (fsdp.run_dir / "checkpoints" / "ckpt-00000002" / ".metadata").is_file()
    assert fsdp.train_loss == pytest.approx(single.train_loss, rel=1e-5)
    assert fsdp.val_loss == pytest.approx(single.val_loss, rel=1e-5)


def test_distributed_session_is_a_no_op_in_one_process():
    with distributed_session("cpu") as info:
        assert info == DistInfo() and not dist.is_initialized()
