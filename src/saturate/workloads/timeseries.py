"""ts-lstm: an LSTM forecasting the next step of several series, over windows of a signal or a CSV.

The time-series guide's job (shared/GUIDES.md §4): a recurrent model over windows of length
30/60/90 with a grid over the hidden size. Here the signal is either synthetic (a deterministic
mix of periodic components, trend and AR(1) noise per series, fixed by `data_seed`) or the numeric
columns of the user's CSV. The last tenth of the rows is the validation split; each column is
standardised with the training split's mean and deviation.

Training sample i is the window at an offset drawn by a counter-based hash of (seed, i), like the
text windows, so a step's data depends on the step alone. Evaluation (`evaluate`) keeps every
prediction on the device and moves them to the host once, at the end, as the guide's "after" does.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from saturate.data.loaders import _splitmix64
from saturate.errors import ConfigError, DataError, unknown_name
from saturate.workloads.base import Optimization, Workload


@dataclass(frozen=True)
class TSConfig:
    """The ts-lstm workload's parameters (each one a --param / sweep grid key)."""

    window: int = 60  # time steps the model sees before predicting the next one
    hidden: int = 128  # LSTM hidden size
    layers: int = 2  # stacked LSTM layers
    n_series: int = 8  # synthetic series (a CSV brings its own columns)
    length: int = 20_000  # synthetic rows
    data_seed: int = 0  # the synthetic signal (the run's --seed draws the windows and the weights)
    val_fraction: float = 0.1  # the last rows, for validation
    eval_windows: int = 512  # validation windows, evenly spaced over the validation rows
    columns: str = ""  # a CSV's columns to read, "a,b" by header name (or 1-based number); "" for all

    def __post_init__(self) -> None:
        for name in ("window", "hidden", "layers", "n_series", "length", "eval_windows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ts-lstm: {name} must be a positive integer, got {v!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"ts-lstm: val_fraction must be between 0 and 1, got {self.val_fraction!r}")
        if not isinstance(self.columns, (str, int)) or isinstance(self.columns, bool):
            raise ConfigError(f"ts-lstm: columns must be names separated by commas, got {self.columns!r}")


# The guide's "after" batch (256) is the default effective batch; tuning keeps it exactly.
DEFAULT_OPTIM = Optimization(effective_batch=256, lr=2e-3, warmup_steps=20, steps=300, eval_every=50,
                             weight_decay=0.01)
GUIDE_PLANS = ("timeseries-before", "timeseries-after")


# --- data -----------------------------------------------------------------------------------------


def synthetic_series(length: int, n_series: int, seed: int = 0) -> np.ndarray:
    """(length, n_series) float32: per series a mix of shared periodic components, a trend and AR(1) noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(length, dtype=np.float64)
    periods = np.array([24.0, 168.0, *rng.uniform(8, 400, size=4)])
    phases = rng.uniform(0, 2 * np.pi, size=len(periods))
    components = np.sin(2 * np.pi * t[:, None] / periods + phases)  # (length, K)
    mix = rng.normal(0, 1, size=(len(periods), n_series))
    signal = components @ mix
    signal += t[:, None] * rng.normal(0, 2.0 / length, size=n_series)  # a slow trend
    noise = rng.normal(0, 0.3, size=(length, n_series))
    for i in range(1, length):  # AR(1): noise with memory, so recent steps help the forecast
        noise[i] += 0.7 * noise[i - 1]
    return (signal + noise).astype(np.float32)


def read_csv(path: str | Path, columns: Sequence[str] = ()) -> tuple[np.ndarray, list[str]]:
    """The numeric columns of a CSV as (rows, columns) float32, and the column names.

    The separator is sniffed (",", ";", tab or "|"). A first row that is not all numbers is the header.
    `columns` keeps only those (header names, or 1-based numbers), so a date or label column can be
    skipped. Anything else that is not a number — a text column, an empty cell, a row of another width —
    is a DataError naming the file, row and column.
    """
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            sample = f.read(64 * 1024)
            f.seek(0)
            try:
                dialect: Any = csv.Sniffer().sniff(sample, delimiters=",;\t|")
            except csv.Error:  # one column, or nothing to tell: the standard comma
                dialect = csv.excel
            rows = [r for r in csv.reader(f, dialect) if any(cell.strip() for cell in r)]
    except FileNotFoundError:
        raise DataError(f"CSV file {path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a folder; ts-lstm reads one CSV file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"cannot read CSV file {path}: {e}") from None
    if not rows:
        raise DataError(f"CSV file {path} is empty")
    first = 1
    header = rows[0]
    if all(_is_number(c) for c in header):
        header, first = [f"column {i + 1}" for i in range(len(rows[0]))], 0
    names = [h.strip() or f"column {i + 1}" for i, h in enumerate(header)]
    if first == 1 and len(rows) == 1:
        raise DataError(f"CSV file {path} has a header but no data rows")
    if columns:
        keep = [_column_index(path, c, names) for c in columns]
        rows = [rows[0]] * first + [[r[i] if i < len(r) else "" for i in keep] for r in rows[first:]]
        names = [names[i] for i in keep]
    values = np.empty((len(rows) - first, len(names)), dtype=np.float32)
    for r, row in enumerate(rows[first:]):
        line = r + first + 1
        if len(row) != len(names):
            raise DataError(f"{path}: row {line} has {len(row)} fields, the header has {len(names)}")
        for c, cell in enumerate(row):
            try:
                v = float(cell)
            except ValueError:
                what = "is empty" if not cell.strip() else f"is not a number ({cell.strip()[:30]!r})"
                sep = (f" (the separator was read as {dialect.delimiter!r}; is the file separated by another?)"
                       if len(names) == 1 else "")
                raise DataError(f"{path}: column {names[c]!r} is not numeric: row {line} {what}{sep}; ts-lstm reads "
                                "numeric columns only: choose them with --param columns=NAME,NAME") from None
            if not math.isfinite(v):
                raise DataError(f"{path}: column {names[c]!r}, row {line} is {cell.strip()}; fill missing values")
            values[r, c] = v
    return values, names


def _column_index(path: Path, column: str, names: list[str]) -> int:
    if column in names:
        return names.index(column)
    if column.isdigit() and 1 <= int(column) <= len(names):
        return int(column) - 1
    raise DataError(f"{path}: " + unknown_name("column", column, names))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class SeriesWindows(Dataset):
    """Training sample i: the `window` rows at an offset fixed by a hash of (seed, i) in [lo, hi), and the
    row after them. Returns (inputs (window, series), target (series,)), float32."""

    def __init__(self, values: torch.Tensor, window: int, lo: int, hi: int, seed: int = 0) -> None:
        self.values, self.window, self.lo, self.seed = values, window, lo, seed
        self.n_starts = hi - lo - window  # the target row must be inside [lo, hi)
        self.distinct_samples = self.n_starts  # one per target row
        if self.n_starts < 1:
            raise DataError(f"{hi - lo} rows cannot hold a window of {window} and its next step")
        self._seed_key = _splitmix64(np.array([seed], dtype=np.uint64))

    def __len__(self) -> int:
        return 2**62

    def start(self, index: int) -> int:
        key = np.array([index], dtype=np.uint64) ^ self._seed_key
        return self.lo + int(_splitmix64(key)[0] % np.uint64(self.n_starts))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.start(index)
        return self.values[s : s + self.window], self.values[s + self.window]


class FixedSeriesWindows(Dataset):
    """Validation windows evenly spaced over [lo, hi), always the same."""

    def __init__(self, values: torch.Tensor, window: int, lo: int, hi: int, n: int) -> None:
        last = hi - window - 1
        if last < lo:
            raise DataError(f"{hi - lo} rows cannot hold a window of {window} and its next step")
        self.values, self.window = values, window
        self.starts = np.unique(np.linspace(lo, last, num=max(1, n)).astype(np.int64))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[index])
        return self.values[s : s + self.window], self.values[s + self.window]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All windows at once: inputs (n, window, series) and targets (n, series)."""
        idx = torch.from_numpy(self.starts)[:, None] + torch.arange(self.window + 1)
        rows = self.values[idx]  # (n, window + 1, series)
        return rows[:, :-1], rows[:, -1]


# --- model ----------------------------------------------------------------------------------------


class LSTMForecaster(nn.Module):
    """(B, window, series) -> the next step (B, series), from the last hidden state of a stacked LSTM."""

    def __init__(self, n_series: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(n_series, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, n_series)
        self.activation_checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute the LSTM in backward instead of keeping its activations."""
        self.activation_checkpointing = enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training:
            out, _ = checkpoint(self.lstm, x, use_reentrant=False)
        else:
            out, _ = self.lstm(x)  # (B, W, H)
        return self.head(out[:, -1])


def flops_per_sample(cfg: TSConfig, n_series: int) -> float:
    """Model FLOPs (forward + backward ≈ 3 × forward) of one window: per step and layer, the four gates'
    input and recurrent matmuls 2·4·H·(in + H); then the head 2·H·S."""
    h = cfg.hidden
    per_step = sum(2 * 4 * h * ((n_series if layer == 0 else h) + h) for layer in range(cfg.layers))
    return 3.0 * (cfg.window * per_step + 2 * h * n_series)


def forecast_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the next step, in standardised units."""
    x, y = batch
    return F.mse_loss(model(x).float(), y)


class ForecastMetrics:
    """The workload's evaluate(): errors in the data's own units on every validation window.

    Predictions are written into one tensor on the device and moved to the host once, at the end
    (the guide's "before" moved them every batch, a host sync each time).
    """

    def __init__(self, val: FixedSeriesWindows, std: np.ndarray) -> None:
        self.val, self.std = val, std

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device, batch_size: int) -> dict[str, float]:
        inputs, targets = self.val.stacked()
        was_training = model.training
        model.eval()
        predictions = torch.empty(targets.shape, device=device)  # stays on the device until the end
        for start in range(0, len(inputs), batch_size):
            x = inputs[start : start + batch_size].to(device, non_blocking=True)
            predictions[start : start + len(x)] = model(x).float()
        model.train(was_training)
        pred = predictions.cpu().numpy()  # deliberate sync: the one transfer of the evaluation
        truth, last = targets.numpy(), inputs[:, -1].numpy()
        scale = self.std[None, :]
        err = (pred - truth) * scale
        return {"val/mse": float(np.mean(err**2)), "val/mae": float(np.mean(np.abs(err))),
                "val/mae_last_value": float(np.mean(np.abs((last - truth) * scale)))}  # the naive forecast


# --- the workload ---------------------------------------------------------------------------------


def ts_lstm_workload(data: Sequence[str] | None = None, *, seed: int = 0, **params: Any) -> Workload:
    """The ts-lstm preset: synthetic series (data=None) or one CSV file; `params` are TSConfig fields or
    Optimization fields (window=90, hidden=256, effective_batch=512, lr=1e-3, …)."""
    ts_keys = {f.name for f in dataclasses.fields(TSConfig)}
    optim_keys = {f.name for f in dataclasses.fields(Optimization)}
    unknown = sorted(set(params) - ts_keys - optim_keys)
    if unknown:
        raise ConfigError("ts-lstm: " + unknown_name("parameter", unknown[0], [*sorted(ts_keys), *sorted(optim_keys)]))
    cfg = TSConfig(**{k: v for k, v in params.items() if k in ts_keys})
    optim = DEFAULT_OPTIM.with_values({k: v for k, v in params.items() if k in optim_keys}, "ts-lstm")

    if data:
        if len(data) != 1 or Path(data[0]).suffix.lower() != ".csv":
            raise DataError(f"ts-lstm reads one .csv file; got {', '.join(map(str, data))}")
        path = Path(data[0]).expanduser()
        raw, names = read_csv(path, [c.strip() for c in str(cfg.columns).split(",") if c.strip()])
        source = {"csv": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
                  **({"columns": names} if cfg.columns else {})}
        where = f"{path}"
    else:
        if cfg.columns:
            raise ConfigError("ts-lstm: columns picks columns of a CSV (--data FILE.csv); synthetic series have none")
        raw = synthetic_series(cfg.length, cfg.n_series, cfg.data_seed)
        names = [f"series {i + 1}" for i in range(cfg.n_series)]
        source = {"synthetic": {"length": cfg.length, "n_series": cfg.n_series, "data_seed": cfg.data_seed}}
        where = "the synthetic signal"
    rows, n_series = raw.shape
    n_val = max(math.ceil(rows * cfg.val_fraction), cfg.window + 1)
    n_train = rows - n_val
    if n_train < cfg.window + 1:
        need = 2 * (cfg.window + 1)
        raise DataError(f"{where} has {rows} rows, fewer than one window of {cfg.window} (+1 to predict) for "
                        f"training and one for validation ({need} rows at least, or a smaller --param window)")
    mean = raw[:n_train].mean(axis=0)
    std = raw[:n_train].std(axis=0)
    std[std == 0] = 1.0
    values = torch.from_numpy((raw - mean) / std)
    val = FixedSeriesWindows(values, cfg.window, n_train, rows, cfg.eval_windows)
    model_cfg = {"kind": "lstm-forecaster", "n_series": n_series, "hidden": cfg.hidden, "layers": cfg.layers,
                 "window": cfg.window}
    return Workload(
        name="ts-lstm",
        build_model=lambda: LSTMForecaster(n_series, cfg.hidden, cfg.layers),
        train_data=SeriesWindows(values, cfg.window, 0, n_train, seed=seed),
        val_data=val,
        loss_fn=forecast_loss,
        optim=optim,
        tokens_per_sample=1,
        flops_per_sample=flops_per_sample(cfg, n_series),
        identity={"model": model_cfg, "data": {**source, "rows": rows, "val_rows": n_val, "seed": seed}},
        info={"preset": "ts-lstm", "series": n_series, "rows": rows, "window": cfg.window, "hidden": cfg.hidden,
              "layers": cfg.layers, "data": source.get("csv", "synthetic"),
              "columns": ", ".join(names[:4]) + (" …" if len(names) > 4 else "")},
        evaluate=ForecastMetrics(val, std),
        guide_plans=GUIDE_PLANS,
    )
