"""The ts-lstm preset: synthetic or CSV series, windows by global index, evaluation with one host transfer."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from conftest import cli_env, saturate_cmd
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError, DataError
from saturate.plan import Plan
from saturate.run.flow import reference_plans
from saturate.workloads import build_workload, preset_names
from saturate.workloads.custom import count_flops
from saturate.workloads.timeseries import LSTMForecaster, read_csv, synthetic_series, ts_lstm_workload

TINY = {"window": 8, "hidden": 8, "layers": 1, "n_series": 3, "length": 400, "effective_batch": 16,
        "eval_windows": 32}


def write_csv(path, rows: int, header: str = "load,temp", bad: dict | None = None) -> None:
    lines = [header] if header else []
    for i in range(rows):
        cells = [f"{np.sin(i / 5):.4f}", f"{np.cos(i / 7):.4f}"]
        lines.append(",".join((bad or {}).get(i, cells)))
    path.write_text("\n".join(lines) + "\n")


def test_synthetic_signal_is_fixed_by_its_seed():
    a, b = synthetic_series(300, 4, seed=1), synthetic_series(300, 4, seed=1)
    assert a.shape == (300, 4) and a.dtype == np.float32 and np.array_equal(a, b)
    assert not np.array_equal(a, synthetic_series(300, 4, seed=2))


def test_windows_are_a_function_of_the_index_and_targets_follow_them():
    w = ts_lstm_workload(**TINY)
    x, y = w.train_data[5]
    assert x.shape == (8, 3) and y.shape == (3,)
    again = ts_lstm_workload(**TINY).train_data[5]
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    s = w.train_data.start(5)
    assert torch.equal(y, w.train_data.values[s + 8])  # the row right after the window
    starts = {w.train_data.start(i) for i in range(2000)}
    assert max(starts) + 8 < 400 - 40  # training windows and their targets stay in the training rows
    assert "ts-lstm" in preset_names() and build_workload("ts-lstm", **TINY).name == "ts-lstm"


def test_flops_per_sample_match_the_flop_counter():
    w = ts_lstm_workload(**{**TINY, "hidden": 32, "layers": 2})
    batch = tuple(torch.stack(t) for t in zip(*[w.train_data[i] for i in range(4)], strict=True))
    counted = count_flops(w.build_model(), w.loss_fn, batch) / 4
    # The formula counts the backward as 2× forward everywhere; the first layer needs no input gradient.
    assert 0.9 < counted / w.flops_per_sample <= 1.0


def test_training_on_a_csv_reports_forecast_errors_in_data_units(tmp_path, cpu):
    path = tmp_path / "series.csv"
    write_csv(path, 300)
    w = ts_lstm_workload([str(path)], **{**TINY, "n_series": 99})  # a CSV brings its own columns
    assert w.info["series"] == 2 and w.info["columns"] == "load, temp"
    result = train(w, Plan(micro_batch=8, grad_accum=2), RunConfig(run_dir=tmp_path / "run", steps=3,
                                                                   progress=False, tensorboard=False), hardware=cpu)
    assert set(result.metrics) == {"val/mse", "val/mae", "val/mae_last_value"}
    assert all(np.isfinite(v) and v > 0 for v in result.metrics.values())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"] == result.metrics and summary["mfu"] > 0
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/mae" in r and r["step"] == 3 for r in logged)


def test_evaluation_moves_predictions_to_the_host_once(monkeypatch):
    w = ts_lstm_workload(**TINY)
    model = w.build_model()
    calls = {"cpu": 0, "item": 0}
    real_cpu, real_item = torch.Tensor.cpu, torch.Tensor.item

    def counting_cpu(self, *a, **k):
        calls["cpu"] += 1
        return real_cpu(self, *a, **k)

    def counting_item(self, *a, **k):
        calls["item"] += 1
        return real_item(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    metrics = w.evaluate(model, torch.device("cpu"), 4)  # 32 windows in batches of 4: 8 forward passes
    assert calls == {"cpu": 1, "item": 0}
    assert metrics["val/mae"] > 0 and model.training


def test_time_series_runs_compare_with_the_guide_plans():
    w = ts_lstm_workload(**TINY)
    labels = [label for label, _ in reference_plans(w, "cpu")]
    assert labels == ["naive", "guide: timeseries-before", "guide: timeseries-after"]


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = LSTMForecaster(3, 8, 2)
    x = torch.randn(4, 8, 3)
    model(x).pow(2).mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_activation_checkpointing(True)
    model(x).pow(2).mean().backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


@pytest.mark.parametrize("rows, header, bad, message", [
    (300, "load,date", {3: ["0.1", "2024-01-01"]},
     "column 'date' is not numeric: row 5 is not a number ('2024-01-01')"),
    (300, "load,temp", {7: ["0.1", ""]}, "column 'temp' is not numeric: row 9 is empty"),
    (300, "load,temp", {2: ["0.1"]}, "row 4 has 1 fields, the header has 2"),
    (300, "load,temp", {2: ["0.1", "nan"]}, "column 'temp', row 4 is nan; fill missing values"),
    (12, "load,temp", None, "has 12 rows, fewer than one window of 8"),
    (0, "load,temp", None, "has a header but no data rows"),
])
def test_bad_csv_is_one_line_naming_the_file(tmp_path, rows, header, bad, message):
    path = tmp_path / "bad.csv"
    write_csv(path, rows, header, bad)
    with pytest.raises(DataError) as e:
        ts_lstm_workload([str(path)], **TINY)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_headerless_csv_and_other_refusals(tmp_path):
    path = tmp_path / "plain.csv"
    write_csv(path, 100, header="")
    values, names = read_csv(path)
    assert values.shape == (100, 2) and names == ["column 1", "column 2"]
    with pytest.raises(DataError, match="reads one .csv file"):
        ts_lstm_workload([str(path), str(path)], **TINY)
    with pytest.raises(DataError, match="does not exist"):
        ts_lstm_workload([str(tmp_path / "none.csv")], **TINY)
    with pytest.raises(ConfigError, match="ts-lstm: unknown parameter 'hiden'"):
        ts_lstm_workload(hiden=3)
    with pytest.raises(ConfigError, match="window must be a positive integer"):
        ts_lstm_workload(window=0)


@pytest.mark.slow
def test_cli_refuses_a_non_numeric_csv_before_training(tmp_path):
    path = tmp_path / "data.csv"
    write_csv(path, 200, "when,load", {0: ["monday", "1.0"]})
    out = subprocess.run(saturate_cmd("train", "--preset", "ts-lstm", "--data", str(path), "--run-dir", "r"),
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"saturate: error: {path}: column 'when' is not numeric: row 2")
    assert not (tmp_path / "r").exists()


def test_a_date_column_is_skipped_with_columns_and_a_semicolon_csv_is_read(tmp_path):
    path = tmp_path / "dated.csv"
    lines = ["date;load;temp"] + [f"2024-01-{1 + i % 28:02d};{np.sin(i / 5):.4f};{np.cos(i / 7):.4f}"
                                  for i in range(200)]
    path.write_text("\n".join(lines) + "\n")
    values, names = read_csv(path, ["load", "3"])  # by name, or by 1-based number
    assert names == ["load", "temp"] and values.shape == (200, 2) and values[1, 0] == pytest.approx(np.sin(0.2), 1e-3)
    w = ts_lstm_workload([str(path)], columns="load,temp", **TINY)
    assert w.info["series"] == 2 and w.identity["data"]["columns"] == ["load", "temp"]
    with pytest.raises(DataError, match="column 'date' is not numeric.*--param columns="):
        ts_lstm_workload([str(path)], **TINY)
    with pytest.raises(DataError, match="unknown column 'lod' \\(did you mean 'load'\\?\\)"):
        read_csv(path, ["lod"])
    with pytest.raises(ConfigError, match="synthetic series have none"):
        ts_lstm_workload(columns="load", **TINY)


def test_a_separator_that_cannot_be_sniffed_is_named_in_the_error(tmp_path):
    path = tmp_path / "odd.csv"
    path.write_text("load\n" + "".join(f"{i}:{i + 1}\n" for i in range(50)))  # ':' is no separator saturate knows
    with pytest.raises(DataError, match="separator was read as ','"):
        read_csv(path)
