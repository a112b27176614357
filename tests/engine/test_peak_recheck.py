"""The MFU's denominator measured again when a run's steps out-ran it: a measured peak that read low."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from saturate.engine import summary
from saturate.engine.summary import SUSPECT_MFU, recheck_peak
from saturate.hardware import peak_store
from saturate.plan import Plan

G = 1e9


def hardware(datasheet: float | None = None):
    return SimpleNamespace(supports={"bf16": True}, peak_flops=lambda dtype: (datasheet, "datasheet"))


@pytest.fixture
def measured(monkeypatch):
    calls = []

    def again(hw, dtype, refresh=False):
        calls.append((dtype, refresh))
        return 400 * G, "bf16 matmul peak (measured now; …)", []

    monkeypatch.setattr(peak_store, "matmul_peak", again)
    return calls


def test_a_run_over_the_suspect_share_of_a_measured_peak_measures_it_again(measured):
    plan = Plan(precision="bf16")
    peak, label, note = recheck_peak(hardware(), plan, 209 * G, "bf16 matmul peak (stored)", 182 * G)  # 87 %
    assert measured == [("bf16", True)] and peak == 400 * G and label.startswith("bf16 matmul peak (measured now")
    assert note.startswith("the bf16 matmul peak read at the start (209 GFLOP/s) was below what a peak must be") \
        and "182 GFLOP/s (87 % of it)" in note and "measured again: 400 GFLOP/s, the MFU's denominator" in note


@pytest.mark.parametrize(("achieved", "datasheet"), [
    (SUSPECT_MFU * 209 * G, None),  # at the share, not over it: a fast step, not a low peak
    (182 * G, 989.5e12),  # a datasheet's peak is not measured again
])
def test_a_plausible_mfu_or_a_datasheet_peak_is_left_as_it_is(measured, achieved, datasheet):
    assert recheck_peak(hardware(datasheet), Plan(precision="bf16"), 209 * G, "label", achieved) == (209 * G, "label",
                                                                                                   None)
    assert measured == []


def test_a_second_reading_no_higher_changes_nothing(monkeypatch):
    monkeypatch.setattr(peak_store, "matmul_peak", lambda hw, dtype, refresh=False: (200 * G, "lower", []))
    assert recheck_peak(hardware(), Plan(precision="bf16"), 209 * G, "label", 190 * G) == (209 * G, "label", None)
    assert summary.SUSPECT_MFU < 1


def _train(tmp_path, monkeypatch, *, raise_peak: bool, steps: int, log_every: int | None = None):
    """train() on a model whose every step out-runs any real peak, with summary.recheck_peak replaced: it returns
    twice what it is given (`raise_peak`) or the peak as it was; the achieved rates it was called with, the result."""
    import torch

    from saturate.engine import session
    from saturate.engine.trainer import RunConfig, train
    from saturate.workloads import custom_workload

    seen = []

    def again(hw, plan, peak, label, achieved):
        seen.append(achieved)
        return (2 * achieved, "measured again", "the peak read low (a test)") if raise_peak else (peak, label, None)

    monkeypatch.setattr(session, "recheck_peak", again)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    workload = custom_workload("tiny", model=lambda: torch.nn.Linear(4, 1), dataset=data,
                               loss=torch.nn.functional.mse_loss, effective_batch=8, lr=1e-3, flops_per_sample=FLOPS)
    result = train(workload, Plan(micro_batch=8, grad_accum=1), RunConfig(
        steps=steps, log_every=log_every, run_dir=tmp_path / "run", progress=False, quiet=True))
    return seen, result


FLOPS = 1e15  # a sample's model FLOPs: any step out-runs any real peak


def test_train_divides_by_the_peak_measured_again_and_says_so(tmp_path, monkeypatch):
    seen, result = _train(tmp_path, monkeypatch, raise_peak=True, steps=4)
    assert len(seen) == 1 and seen[0] == pytest.approx(result.samples_per_s * FLOPS)  # one window: the run's rate
    assert result.mfu == pytest.approx(0.5) and result.peak_label == "measured again"
    assert "the peak read low (a test)" in result.notes


def test_the_peak_is_measured_again_at_the_first_window_that_out_ran_it_and_once(tmp_path, monkeypatch):
    from saturate.engine.metrics import read_jsonl

    seen, result = _train(tmp_path, monkeypatch, raise_peak=True, steps=12, log_every=4)
    lines = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "throughput/samples_per_s" in r]
    assert len(lines) == 3 and len(seen) == 1  # measured at the first window, not again at the end
    assert seen[0] == pytest.approx(lines[0]["throughput/samples_per_s"] * FLOPS)
    # Every line from the first on divides by what was measured (the first window's own: 50 % of it).
    assert lines[0]["throughput/mfu"] == pytest.approx(0.5)
    assert all("throughput/mfu" in r or "throughput/achieved_over_peak" in r for r in lines)
    assert result.peak_label == "measured again" and result.notes.count("the peak read low (a test)") == 1


def test_a_peak_measured_again_no_higher_is_not_measured_at_every_window(tmp_path, monkeypatch):
    seen, result = _train(tmp_path, monkeypatch, raise_peak=False, steps=12, log_every=4)
    assert len(seen) == 1 and result.steps == 12  # once a run, though every window out-ran the peak
