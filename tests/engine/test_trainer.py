"""The training engine in-process: accumulation maths, learning, checkpoints, refusals."""

from __future__ import annotations

import dataclasses
import errno
import time
from pathlib import Path

import pytest
import torch

from saturate.engine import checkpoint as ckpt_module
from saturate.engine.checkpoint import CheckpointManager, load_checkpoint
from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.errors import CheckpointError
from saturate.plan import Plan
from saturate.workloads import build_workload


def run(tmp_path: Path, corpus: Path, plan: Plan, hw, name: str = "run", model: dict | None = None, **cfg):
    """gpt-tiny (`model`: its parameters, e.g. one block where the test is of the engine, not the model) trained."""
    workload = build_workload("gpt-tiny", data=[str(corpus)], effective_batch=8, warmup_steps=2, **(model or {}))
    cfg.setdefault("steps", 4)
    config = RunConfig(run_dir=tmp_path / name, progress=False, tensorboard=False, log_every=1, **cfg)
    return workload, train(workload, plan, config, hardware=hw)


ONE_BLOCK = {"n_layer": 1}
SMALL_BLOCK = {"n_layer": 1, "n_embd": 32, "n_head": 2}  # where bf16 is emulated (an AVX2 CPU) it is ~50× slower


def final_weights(result) -> dict[str, torch.Tensor]:
    return load_checkpoint(result.checkpoint)["model"]


def test_accumulation_matches_one_big_batch(tmp_path, small_corpus, cpu):
    """4 × 2 accumulation gives the same update as 8 × 1: same samples, loss divided by accum."""
    _, a = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, "a", steps=2)
    _, b = run(tmp_path, small_corpus, Plan(micro_batch=8, grad_accum=1), cpu, "b", steps=2)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    # Adam turns an update into about ±lr per element (2e-3 here) and amplifies rounding on
    # near-zero gradients, so "the same update within float tolerance" is 1 % of one update.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=2e-5, msg=k)
    la = [r["train/loss"] for r in read_jsonl(a.run_dir / "metrics.jsonl") if "train/loss" in r]
    lb = [r["train/loss"] for r in read_jsonl(b.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert la == pytest.approx(lb, rel=1e-5)


@pytest.mark.slow
def test_loss_falls_on_gpt_tiny(tmp_path, small_corpus, cpu):
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=8, grad_accum=1), cpu, steps=40, eval_every=20)
    losses = [r["train/loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(257) at initialisation
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    assert result.val_loss is not None and result.val_loss < losses[0] - 2.0
    assert result.weights is not None and result.weights.exists()
    assert result.tokens_per_s and result.tokens_per_s > 0
    assert result.mfu is None or 0 < result.mfu <= 1  # never above the peak (see the test below)
    assert result.mfu_note


@pytest.mark.parametrize(("peak", "shown"), [(1e30, True), (1.0, False)])
def test_mfu_is_a_figure_below_the_peak_and_never_above_it(tmp_path, small_corpus, cpu, peak, shown):
    """The denominator is given, so the outcome does not depend on how busy the machine is."""
    hw = dataclasses.replace(cpu, measured_peak_flops={"fp32": peak}, measured_peak_source={"fp32": "given"})
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=8, grad_accum=1), hw, steps=2)
    summary = __import__("json").loads((result.run_dir / "summary.json").read_text())
    logged = [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/loss" in r]
    if shown:
        assert 0 < result.mfu < 1 and result.mfu_note.endswith("(given)") and summary["mfu"] == result.mfu
        assert all("throughput/mfu" in r for r in logged)
    else:
        assert result.mfu is None and summary["mfu"] is None
        assert summary["mfu_note"].startswith("MFU n/a: measured throughput exceeds the peak estimate (peak ")
        assert all("throughput/mfu" not in r and r["throughput/achieved_over_peak"] > 1 for r in logged)


def test_lr_scaled_when_effective_batch_differs(tmp_path, small_corpus, cpu):
    workload, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1), cpu, steps=3)
    assert any("scaled linearly" in n for n in result.notes)
    base = workload.optim.lr
    lrs = [r["train/lr"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/lr" in r]
    assert max(lrs) == pytest.approx(base * 4 / 8)  # warm-up of 2 reaches the scaled peak


@pytest.mark.slow
def test_checkpoints_keep_last_k_and_hold_every_piece(tmp_path, small_corpus, cpu):
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=6,
                    ckpt_every=1, keep_checkpoints=2)
    steps = [s for s, _ in CheckpointManager(result.run_dir / "checkpoints").checkpoints()]
    assert steps == [5, 6]
    state = load_checkpoint(result.checkpoint)
    assert state["step"] == 6
    for key in ("model", "optimizer", "schedule", "rng", "plan", "fingerprint", "train_seconds"):
        assert key in state
    assert state["plan"]["micro_batch"] == 4
    assert not list((result.run_dir / "checkpoints").glob(".*tmp*"))


def test_full_disk_during_checkpoint_keeps_previous(tmp_path, small_corpus, cpu, monkeypatch):
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"disk is full.*step 2\) is kept"):
        run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=6, ckpt_every=2)
    monkeypatch.setattr(ckpt_module.torch, "save", real_save)
    folder = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in CheckpointManager(folder).checkpoints()] == [2]
    assert load_checkpoint(folder / "ckpt-00000002.pt")["step"] == 2
    assert not list(folder.glob(".*tmp*"))  # the partial file was removed


def test_resume_refuses_other_data_or_effective_batch(tmp_path, small_corpus, cpu):
    run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=2)
    with pytest.raises(CheckpointError, match=r"effective batch 8 -> 4"):
        run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1), cpu, steps=4, resume=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text((small_corpus / "difflib.py").read_text()[:30000])
    with pytest.raises(CheckpointError, match=r"different data \(corpus '"):
        run(tmp_path, other, Plan(micro_batch=4, grad_accum=2), cpu, steps=4, resume=True)


@pytest.mark.slow
def test_resume_allows_another_split_of_the_same_effective_batch(tmp_path, small_corpus, cpu):
    run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=2)
    _, resumed = run(tmp_path, small_corpus, Plan(micro_batch=2, grad_accum=4), cpu, steps=4, resume=True)
    assert resumed.steps == 4
    assert any("different plan" in n for n in resumed.notes)


def test_run_dir_with_checkpoints_needs_resume(tmp_path, small_corpus, cpu):
    run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=1)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=1)


def test_compile_failure_falls_back_to_eager(tmp_path, small_corpus, cpu, monkeypatch):
    def broken_compile(model, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("backend exploded\nwith details")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2, compile="default"), cpu, steps=2)
    assert result.steps == 2
    assert any("torch.compile(mode='default') failed (RuntimeError: backend exploded)" in n for n in result.notes)


@pytest.mark.slow
def test_compile_probe_leaves_the_run_unchanged(tmp_path, small_corpus, cpu):
    """A real torch.compile on the CPU: same losses as eager (the trial step leaves no trace)."""
    _, eager = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1), cpu, "eager", steps=2, model=SMALL_BLOCK)
    _, compiled = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1, compile="default"), cpu,
                      "compiled", steps=2, model=SMALL_BLOCK)
    assert not any("failed" in n for n in compiled.notes), compiled.notes
    le = [r["train/loss"] for r in read_jsonl(eager.run_dir / "metrics.jsonl") if "train/loss" in r]
    lc = [r["train/loss"] for r in read_jsonl(compiled.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert lc == pytest.approx(le, rel=1e-4)


@pytest.mark.slow
def test_time_budget_stops_the_run_and_checkpoints(tmp_path, small_corpus, cpu):
    started = time.monotonic()
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1), cpu, steps=None, minutes=0.15)
    assert time.monotonic() - started < 0.15 * 60 + 30  # stops near the budget (validation, saving on top)
    state = load_checkpoint(result.checkpoint)
    assert state["step"] == result.steps >= 1
    assert state["schedule"]["total_steps"] == result.total_steps
    assert not result.interrupted
    if result.steps > 5:  # after 5 measured steps the schedule is sized to the budget (a prediction)
        assert result.total_steps != 300


def test_steps_for_budget_predicts_from_measured_step_time():
    from saturate.engine.summary import steps_for_budget

    class Quiet:
        def note(self, text):
            self.text = text

    console = Quiet()
    total = steps_for_budget(5, 0.5, time.monotonic() + 10.0, console)
    assert 5 + 18 <= total <= 5 + 20
    assert "prediction" in console.text


@pytest.mark.slow
def test_bf16_autocast_trains(tmp_path, small_corpus, cpu):
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1, precision="bf16"), cpu, steps=3,
                    model=SMALL_BLOCK)
    assert result.train_loss is not None and result.train_loss < 6.0
    assert "bf16" in result.peak_label or "measured" in result.peak_label


@pytest.mark.slow
def test_fp16_uses_a_grad_scaler_whose_state_is_checkpointed(tmp_path, small_corpus, cpu):
    _, result = run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=1, precision="fp16"), cpu, steps=2,
                    model=ONE_BLOCK)  # fp16 matmuls are slow on a CPU: one block is enough for the scaler
    scaler = load_checkpoint(result.checkpoint)["scaler"]
    assert scaler is not None and scaler["scale"] > 0


def test_non_finite_loss_stops_with_a_clear_error(tmp_path, small_corpus, cpu):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=1, lr=1e6)
    with pytest.raises(Exception, match=r"loss became (nan|inf)"):
        train(workload, Plan(micro_batch=4, grad_accum=1), RunConfig(run_dir=tmp_path / "r", progress=False,
              tensorboard=False, log_every=1, steps=30, ckpt_every=1000), hardware=cpu)


def test_tensorboard_events_are_written(tmp_path, small_corpus, cpu):
    pytest.importorskip("tensorboard")
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=1)
    result = train(workload, Plan(micro_batch=4, grad_accum=1), RunConfig(run_dir=tmp_path / "tb", progress=False,
                   log_every=1, steps=2), hardware=cpu)
    events = list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_resume_without_a_plan_takes_the_checkpoints(tmp_path, small_corpus, cpu):
    run(tmp_path, small_corpus, Plan(micro_batch=2, grad_accum=2, name="mine"), cpu, steps=2)
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2)
    resumed = train(workload, None, RunConfig(run_dir=tmp_path / "run", resume=True, steps=3, progress=False,
                                              tensorboard=False), hardware=cpu)
    assert resumed.steps == 3
    assert (resumed.plan.name, resumed.plan.micro_batch, resumed.plan.grad_accum) == ("mine", 2, 2)


def test_without_a_plan_a_fresh_run_keeps_the_workloads_effective_batch(tmp_path, small_corpus, cpu):
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=12, warmup_steps=1)
    result = train(workload, None, RunConfig(run_dir=tmp_path / "d", steps=1, progress=False, tensorboard=False),
                   hardware=cpu)
    assert result.plan.name == "default"
    assert result.plan.micro_batch * result.plan.grad_accum == 12
    assert not any("scaled" in n for n in result.notes)


def test_resume_refuses_another_model_and_names_the_field(tmp_path, small_corpus, cpu):
    from saturate.workloads.gpt import PRESETS, GPTPreset

    run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=1)
    tiny = PRESETS["gpt-tiny"]
    wider = GPTPreset("gpt-tiny", n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=128, seq_len=tiny.seq_len,
                      optim=tiny.optim, description="a variant")
    PRESETS["gpt-tiny"] = wider
    try:
        with pytest.raises(CheckpointError, match=r"different model \(n_embd 256 -> 128\)"):
            run(tmp_path, small_corpus, Plan(micro_batch=4, grad_accum=2), cpu, steps=2, resume=True)
    finally:
        PRESETS["gpt-tiny"] = tiny


def test_every_checkpoint_and_validation_closes_a_timed_window(tmp_path, small_corpus, cpu):
    """With log_every 4 but checkpoints every 3 steps, logs also land on 3, 6: no window spans a save."""
    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=1)
    config = RunConfig(run_dir=tmp_path / "w", steps=8, log_every=4, ckpt_every=3, eval_every=5, progress=False,
                       tensorboard=False)
    result = train(workload, Plan(micro_batch=4, grad_accum=1), config, hardware=cpu)
    logged = [r["step"] for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert logged == [3, 4, 5, 6, 8]
    assert config.run_dir == tmp_path / "w"  # the caller's config is not changed
    assert sum(r["time/step_s"] * n for r, n in zip(
        [r for r in read_jsonl(result.run_dir / "metrics.jsonl") if "train/loss" in r], [3, 1, 1, 1, 2],
        strict=True)) == pytest.approx(result.train_seconds, rel=1e-6)


def test_jsonl_corpus_with_a_local_bpe_trains(tmp_path, small_corpus, cpu):
    import json

    text = (small_corpus / "difflib.py").read_text()
    records = [{"body": text[i : i + 2000], "id": i} for i in range(0, len(text), 2000)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    workload = build_workload("gpt-tiny", data=[str(data)], text_field="body", tokenizer="bpe:600",
                              effective_batch=4, warmup_steps=1)
    assert workload.info["tokenizer"].startswith("bpe-") and 300 <= workload.info["vocab_size"] <= 600
    result = train(workload, Plan(micro_batch=4, grad_accum=1), RunConfig(run_dir=tmp_path / "bpe", steps=3,
                   log_every=1, progress=False, tensorboard=False), hardware=cpu)
    assert result.steps == 3 and result.train_loss is not None
    assert load_checkpoint(result.checkpoint)["model"]["wte.weight"].shape[0] % 64 == 0


@pytest.mark.slow
def test_gpt_small_preset_takes_a_training_step_on_cpu(tmp_path, small_corpus, cpu):
    """The GPT-2 124M shape end to end (85M parameters with the byte tokenizer), one sequence."""
    workload = build_workload("gpt-small", data=[str(small_corpus)], effective_batch=1, warmup_steps=1,
                              eval_samples=1)
    result = train(workload, Plan(micro_batch=1, grad_accum=1), RunConfig(run_dir=tmp_path / "s", steps=1,
                   log_every=1, progress=False, tensorboard=False, export_weights=False), hardware=cpu)
    assert result.steps == 1 and 4.0 < result.train_loss < 7.0  # ~ln(257) at initialisation
    assert workload.tokens_per_sample == 1024


@pytest.mark.slow
def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path, small_corpus, cpu):
    """A killed run may log past its last checkpoint; JSONL and TensorBoard keep one record per step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workload = build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=4, warmup_steps=1)
    config = RunConfig(run_dir=tmp_path / "r", steps=4, log_every=1, ckpt_every=2, keep_checkpoints=5,
                       progress=False)
    train(workload, Plan(micro_batch=4, grad_accum=1), config, hardware=cpu)
    (tmp_path / "r" / "checkpoints" / "ckpt-00000004.pt").unlink()  # as if killed after logging step 4
    train(workload, Plan(micro_batch=4, grad_accum=1), dataclasses.replace(config, resume=True), hardware=cpu)
    steps = [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
