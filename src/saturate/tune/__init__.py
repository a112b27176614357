"""The tuner: find the fastest plan by measurement (`tune`); `saturate run` and `sweep` build on it (saturate.run)."""

from saturate.tune.api import TuneResult, tune

__all__ = ["TuneResult", "tune"]
