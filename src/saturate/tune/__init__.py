"""The tuner: find the fastest plan by measurement (`tune`), and prove it against naive (`run`)."""

from saturate.tune.api import TuneResult, tune

__all__ = ["TuneResult", "tune"]
