"""Early stopping on val/loss: the counter, the stop with its checkpoint and reason, and a resume that stops
where the uninterrupted run did (the counter travels in the checkpoint)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from saturate.engine.checkpoint import load_checkpoint
from saturate.engine.early_stop import EarlyStop
from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError
from saturate.plan import Plan
from saturate.workloads import build_workload

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}
# min_delta 100: only the first validation (from +inf) counts as an improvement, so the stop falls at a known step
STOP = "val/loss:2:100"


def test_counts_validations_without_improvement():
    e = EarlyStop.parse("val/loss:2:0.1")
    assert e.update(10, 3.0) is None and e.best == 3.0
    assert e.update(20, 2.95) is None and e.bad == 1  # better, but not by more than 0.1
    assert e.update(30, 2.5) is None and e.bad == 0 and e.best_step == 30
    assert e.update(40, 2.6) is None
    assert e.update(50, 2.45) == ("early stop: val/loss did not improve by more than 0.1 for 2 validations "
                                  "(best 2.5000 at step 30)")


@pytest.mark.parametrize("spec, message", [
    ("val/loss", "expected METRIC:PATIENCE"),
    ("val/loss:x", "expected METRIC:PATIENCE"),
    ("val/loss:0", "PATIENCE must be >= 1"),
    ("val/loss:3:-1", "MIN_DELTA a number >= 0"),
    ("train/loss:3", "'train/loss' is not measured at each validation"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(early_stop=spec)


def tiny_run(tmp_path, corpus, hw, name, resume=False, on_log=None):
    workload = build_workload("gpt-tiny", data=[str(corpus)], effective_batch=4, warmup_steps=1, **TINY)
    config = RunConfig(run_dir=tmp_path / name, steps=20, eval_every=2, log_every=1, early_stop=STOP, resume=resume,
                       progress=False, tensorboard=False, telemetry=False)
    return train(workload, Plan(micro_batch=4), config, hardware=hw, on_log=on_log)


def test_early_stop_checkpoints_says_why_and_resumes_to_the_same_stop(tmp_path, small_corpus, cpu):
    ref = tiny_run(tmp_path, small_corpus, cpu, "ref")
    # validations at 2 (best), 4 and 6 (no improvement by more than 100): stop at 6 with a checkpoint there
    assert ref.steps == 6 and ref.finished and ref.stopped_early and not ref.interrupted
    assert ref.stop_reason == "early stop: val/loss did not improve by more than 100 for 2 validations " \
                              f"(best {ref_val(ref, 2):.4f} at step 2)"
    assert load_checkpoint(ref.checkpoint)["step"] == 6 and ref.weights is not None
    summary = json.loads((ref.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == ref.stop_reason and summary["steps"] == 6

    def interrupt_at_3(record):  # Ctrl-C after step 3: the run stops at 4 with a checkpoint (counter: 1 bad)
        if record["step"] == 3 and "train/loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    cut = tiny_run(tmp_path, small_corpus, cpu, "cut", on_log=interrupt_at_3)
    assert cut.steps == 4 and cut.interrupted and cut.stop_reason == "stopped by SIGINT" and not cut.finished
    resumed = tiny_run(tmp_path, small_corpus, cpu, "cut", resume=True)
    assert resumed.steps == 6 and resumed.stop_reason == ref.stop_reason  # not 10, as with a fresh counter
    for key in ("train/loss", "val/loss"):
        expected = {r["step"]: r[key] for r in read_jsonl(ref.run_dir / "metrics.jsonl") if key in r}
        assert {r["step"]: r[key] for r in read_jsonl(resumed.run_dir / "metrics.jsonl") if key in r} == expected
        assert len(expected) == (6 if key == "train/loss" else 3)
    a, b = load_checkpoint(ref.checkpoint)["model"], load_checkpoint(resumed.checkpoint)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-exact


def ref_val(result, step: int) -> float:
    return next(r["val/loss"] for r in read_jsonl(result.run_dir / "metrics.jsonl")
                if r["step"] == step and "val/loss" in r)
