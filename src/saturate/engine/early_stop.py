"""Early stopping on a validation metric: `--early-stop val/loss:PATIENCE[:MIN_DELTA]`.

After each validation the metric (lower is better) either improves on the best so far by more than
MIN_DELTA (default 0), or counts one validation without improvement; PATIENCE of those in a row stop the run,
with a checkpoint at that step. The counter and the best value are saved in every checkpoint, so a resumed run
stops where an uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from saturate.errors import ConfigError

METRICS = ("val/loss",)  # what every validation measures (a workload's evaluate runs only at the end)


@dataclass
class EarlyStop:
    metric: str
    patience: int
    min_delta: float = 0.0
    best: float = math.inf
    best_step: int | None = None
    bad: int = 0  # validations in a row without improvement

    @classmethod
    def parse(cls, spec: str) -> EarlyStop:
        """'val/loss:5' or 'val/loss:5:0.01'."""
        parts = spec.split(":")
        usage = f"--early-stop {spec!r}: expected METRIC:PATIENCE[:MIN_DELTA], e.g. val/loss:5 or val/loss:5:0.01"
        if len(parts) not in (2, 3):
            raise ConfigError(usage)
        metric = parts[0].strip()
        if metric not in METRICS:
            raise ConfigError(f"--early-stop: {metric!r} is not measured at each validation (early stopping "
                              f"watches: {', '.join(METRICS)})")
        try:
            patience = int(parts[1])
            min_delta = float(parts[2]) if len(parts) == 3 else 0.0
        except ValueError:
            raise ConfigError(usage) from None
        if patience < 1 or not (min_delta >= 0 and math.isfinite(min_delta)):
            raise ConfigError(f"--early-stop {spec!r}: PATIENCE must be >= 1 and MIN_DELTA a number >= 0")
        return cls(metric, patience, min_delta)

    @property
    def spec(self) -> str:
        return f"{self.metric}:{self.patience}" + (f":{self.min_delta:g}" if self.min_delta else "")

    def update(self, step: int, value: float) -> str | None:
        """Count one validation; the reason to stop, or None to go on."""
        if value < self.best - self.min_delta:
            self.best, self.best_step, self.bad = value, step, 0
            return None
        self.bad += 1
        if self.bad < self.patience:
            return None
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        return (f"early stop: {self.metric} did not improve{by} for {self.patience} validation"
                f"{'s' if self.patience > 1 else ''} (best {self.best:.4f} at step {self.best_step})")

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's counter, when it watched the same metric (another patience keeps the best and count)."""
        if state and state.get("spec", "").split(":")[0] == self.metric:
            self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]
