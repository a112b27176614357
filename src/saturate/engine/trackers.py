"""The sinks a run writes, chosen by name (`--log-to tensorboard,csv,wandb,mlflow`; metrics.jsonl always), and
the two experiment trackers: Weights & Biases and MLflow, each an optional package (`saturate[wandb]`,
`saturate[mlflow]`).

A tracker starts before the first step: a missing package or a tracker that cannot start (no W&B login, an
MLflow store it cannot open) is one line and no training. A resumed run continues the same tracker run (its id
is kept in the run folder: `wandb-run-id`, `mlflow-run-id`). Each gets the run's settings (run.toml, flattened)
as its config/params.

    W&B      project $WANDB_PROJECT (default saturate); files under $WANDB_DIR, else the run folder;
             WANDB_MODE=offline writes them without network (`wandb sync` uploads them later)
    MLflow   tracking URI $MLFLOW_TRACKING_URI (default: MLflow's own), experiment $MLFLOW_EXPERIMENT_NAME
             (default saturate); metrics logged with their step
"""

from __future__ import annotations

import importlib
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from saturate.atomic import atomic_write_bytes
from saturate.engine.metrics import CsvSink, JsonlSink, Sink, TensorBoardSink, numeric
from saturate.errors import ConfigError

TRACKERS = ("tensorboard", "csv", "wandb", "mlflow")


def parse_log_to(text: str) -> tuple[str, ...]:
    """'tensorboard,wandb' -> ("tensorboard", "wandb"); an unknown name is one line naming the known ones."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    for n in names:
        if n not in TRACKERS and n != "jsonl":
            raise ConfigError(f"--log-to: unknown sink {n!r} (known: {', '.join(TRACKERS)}; jsonl is always written)")
    return tuple(dict.fromkeys(n for n in names if n != "jsonl"))


def make_sinks(run_dir: Path, resume_step: int | None, log_to: Sequence[Any], tensorboard: bool,
               settings: dict[str, Any]) -> list[Sink]:
    """metrics.jsonl, then TensorBoard (when `tensorboard` or named), then each named sink, then the user's own
    Sink objects in `log_to`, in order."""
    names = [n for n in log_to if isinstance(n, str)]
    parse_log_to(",".join(names))  # the same check as the flag's, for the Python API
    for s in log_to:
        if not isinstance(s, (str, Sink)):
            raise ConfigError(f"log_to: {s!r} is neither a sink name nor a Sink (an object with write(record) "
                              "and close())")
    sinks: list[Sink] = []
    try:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step))
        if tensorboard or "tensorboard" in names:
            _module("tensorboard", "tensorboard")
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
        if "csv" in names:
            sinks.append(CsvSink(run_dir / "metrics.csv", resume_step))
        if "wandb" in names:
            sinks.append(WandbSink(run_dir, resume_step, settings))
        if "mlflow" in names:
            sinks.append(MlflowSink(run_dir, resume_step, settings))
    except BaseException:
        for made in sinks:  # the ones already open, closed before the error is reported
            made.close()
        raise
    return sinks + [s for s in log_to if not isinstance(s, str)]


def flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"plan": {"micro_batch": 8}} -> {"plan.micro_batch": 8}; lists as text."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
    return out


def _module(name: str, extra: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"--log-to {name} needs the {name} package: pip install 'saturate[{extra}]'") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _kept_id(run_dir: Path, name: str, resume_step: int | None) -> str | None:
    path = run_dir / name
    if resume_step is not None and path.is_file():
        return path.read_text().strip() or None
    return None


class WandbSink:
    """A W&B run: each record logged at its step (a validation at the same step joins that step's row)."""

    name = "wandb"

    def __init__(self, run_dir: Path, resume_step: int | None, settings: dict[str, Any]) -> None:
        wandb = _module("wandb", "wandb")
        run_id = _kept_id(run_dir, "wandb-run-id", resume_step) or secrets.token_hex(4)  # W&B ids: [a-z0-9]
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "saturate"), name=run_dir.name,
                                   id=run_id, resume="allow", config=flatten(settings),
                                   dir=None if os.environ.get("WANDB_DIR") else str(run_dir))
        except Exception as e:  # no login, a bad mode, no network when online: said before any step
            raise ConfigError(f"--log-to wandb: could not start a W&B run ({_first_line(e)}); run `wandb login`, "
                              "or set WANDB_MODE=offline to write it locally") from None
        atomic_write_bytes(run_dir / "wandb-run-id", run_id.encode())

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(numeric(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run in experiment $MLFLOW_EXPERIMENT_NAME: params from the run's settings, metrics per step."""

    name = "mlflow"

    def __init__(self, run_dir: Path, resume_step: int | None, settings: dict[str, Any]) -> None:
        _module("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        try:
            self._client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI") or None)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "saturate")
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
            self._run_id = _kept_id(run_dir, "mlflow-run-id", resume_step)
            if self._run_id is None:
                self._run_id = self._client.create_run(experiment_id, run_name=run_dir.name).info.run_id
                params = [Param(k, str(v)[:6000]) for k, v in flatten(settings).items()]
                self._client.log_batch(self._run_id, params=params)
            else:
                self._client.update_run(self._run_id, status="RUNNING")
        except Exception as e:
            raise ConfigError(f"--log-to mlflow: could not start an MLflow run ({_first_line(e)}); set "
                              "MLFLOW_TRACKING_URI to a store it can open") from None
        atomic_write_bytes(run_dir / "mlflow-run-id", self._run_id.encode())

    def write(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), now, record["step"]) for k, v in numeric(record).items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)
