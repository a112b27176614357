"""Metric sinks: the public Sink protocol, CSV, W&B (offline) and MLflow (a local file store) read back for
real, a sink that fails mid-run dropped with one warning, and train()'s on_log / on_validation callbacks."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest

import saturate
from saturate.cli import main
from saturate.engine.metrics import CsvSink, Sinks, read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError
from saturate.plan import Plan
from saturate.workloads import build_workload

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}


def tiny(corpus: Path):
    return build_workload("gpt-tiny", data=[str(corpus)], effective_batch=4, warmup_steps=1, **TINY)


def run(tmp_path: Path, corpus: Path, hw, name: str = "run", callbacks: dict | None = None, **cfg):
    cfg.setdefault("steps", 4)
    config = RunConfig(run_dir=tmp_path / name, progress=False, tensorboard=False, log_every=1, telemetry=False,
                       **cfg)
    return train(tiny(corpus), Plan(micro_batch=4), config, hardware=hw, **(callbacks or {}))


def jsonl_losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if key in r}


def test_csv_sink_widens_its_header_and_cuts_back_on_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    sink = CsvSink(path)
    for step in (1, 2, 3):
        sink.write({"step": step, "train/loss": 1.0 / step})
    sink.write({"step": 3, "val/loss": 0.25})  # a column first seen mid-run
    sink.close()
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["1", "2", "3", "3"]
    assert float(rows[1]["train/loss"]) == 0.5 and rows[1]["val/loss"] == "" and float(rows[3]["val/loss"]) == 0.25
    resumed = CsvSink(path, resume_step=2)  # a killed run's rows past its checkpoint go
    resumed.write({"step": 3, "train/loss": 0.3})
    resumed.close()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"]) for r in rows] == [("1", "1.0"), ("2", "0.5"), ("3", "0.3")]


class Failing:
    """A sink whose second write fails (a tracker's error)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def write(self, record: dict) -> None:
        if len(self.records) == 1:
            raise RuntimeError("tracker unreachable\nsecond line")
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def test_sinks_drop_a_failing_sink_once_and_keep_the_others(tmp_path):
    warnings: list[str] = []
    good, bad = CsvSink(tmp_path / "m.csv"), Failing()
    sinks = Sinks([bad, good], warn=warnings.append)
    for step in (1, 2, 3):
        sinks.write({"step": step, "train/loss": float(step)})
    sinks.close()
    assert warnings == ["metrics sink Failing failed at step 2 (tracker unreachable); dropped, training goes on"]
    assert len(bad.records) == 1 and not bad.closed  # never called again
    assert [r["step"] for r in csv.DictReader((tmp_path / "m.csv").open())] == ["1", "2", "3"]
    assert isinstance(good, saturate.Sink) and isinstance(bad, saturate.Sink)  # the public protocol


def test_a_sink_failing_mid_run_does_not_stop_training(tmp_path, small_corpus, cpu):
    bad = Failing()
    result = run(tmp_path, small_corpus, cpu, log_to=[bad, "csv"])
    assert result.steps == 4 and result.weights is not None
    assert [n for n in result.notes if "metrics sink" in n] == [
        "metrics sink Failing failed at step 2 (tracker unreachable); dropped, training goes on"]
    rows = list(csv.DictReader((result.run_dir / "metrics.csv").open()))
    losses = jsonl_losses(result.run_dir)
    assert {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]} == losses
    assert sorted(losses) == [1, 2, 3, 4]


def test_callbacks_get_every_record_and_a_validation_can_stop_the_run(tmp_path, small_corpus, cpu):
    logged, validations = [], []

    def on_validation(record: dict) -> bool:
        validations.append(record)
        return record["step"] >= 4  # stop at the second validation

    result = run(tmp_path, small_corpus, cpu, steps=10, eval_every=2,
                 callbacks={"on_log": logged.append, "on_validation": on_validation})
    assert logged == read_jsonl(result.run_dir / "metrics.jsonl")  # the same records the sinks got
    assert [v["step"] for v in validations] == [2, 4] and all(set(v) == {"step", "val/loss"} for v in validations)
    assert result.steps == 4 and result.finished and result.checkpoint.name == "ckpt-00000004.pt"
    assert result.stop_reason == "the on_validation callback stopped the run at step 4"
    assert result.weights is not None  # a run stopped on purpose is finished: its weights are exported


def test_unknown_sink_and_missing_tracker_package_are_one_line(tmp_path, small_corpus, capsys, monkeypatch):
    with pytest.raises(ConfigError, match=r"--log-to: unknown sink 'tensorbord' \(known: tensorboard, csv, wandb"):
        RunConfig(log_to="csv,tensorbord")
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    argv = ["train", "--data", str(small_corpus), *[f"--param={k}={v}" for k, v in TINY.items()],
            "--effective-batch", "4", "--steps", "1", "--no-progress", "--run-dir", str(tmp_path / "r"),
            "--log-to", "csv,wandb"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["saturate: error: --log-to wandb needs the wandb package: pip install 'saturate[wandb]'"]
    assert not list((tmp_path / "r").glob("checkpoints/*"))  # refused before the first step


def wandb_history(folder: Path) -> list[dict[str, float]]:
    """The history records of an offline W&B run file (run-ID.wandb: LevelDB-style log blocks of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(folder.rglob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payload, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return out


@pytest.fixture
def wandb_service():
    """W&B's service process (wandb-core) lives as long as the process that started it: here the test session's,
    where it would keep running beside every later test; ended after the test."""
    wandb = pytest.importorskip("wandb")
    yield
    wandb.teardown()


def test_wandb_offline_writes_the_runs_metrics(tmp_path, small_corpus, cpu, monkeypatch, wandb_service):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    result = run(tmp_path, small_corpus, cpu, log_to=["wandb"], eval_every=2)
    assert not [n for n in result.notes if "metrics sink" in n]
    history = wandb_history(tmp_path / "wandb")
    logged = {int(h["_step"]): h["train/loss"] for h in history if "train/loss" in h}
    assert logged == jsonl_losses(result.run_dir)
    assert {int(h["_step"]): h["val/loss"] for h in history if "val/loss" in h} == jsonl_losses(result.run_dir,
                                                                                                 "val/loss")
    assert (result.run_dir / "wandb-run-id").read_text() in next((tmp_path / "wandb").rglob("run-*.wandb")).name


def test_mlflow_file_store_reads_back_the_runs_metrics(tmp_path, small_corpus, cpu, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    result = run(tmp_path, small_corpus, cpu, log_to=["mlflow"], eval_every=2)
    assert not [n for n in result.notes if "metrics sink" in n]
    client = MlflowClient(uri)
    run_id = (result.run_dir / "mlflow-run-id").read_text()
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == jsonl_losses(result.run_dir)
    mlrun = client.get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["plan.micro_batch"] == "4"
    assert mlrun.data.params["workload.name"] == "gpt-tiny"
