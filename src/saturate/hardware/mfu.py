"""Model FLOPs utilisation: the one function every MFU saturate prints or records goes through.

MFU = achieved model FLOP/s ÷ the peak FLOP/s of the devices the job runs on. A figure above 100 %
is not a fast run: the denominator is wrong (a peak measured while the machine was busy, a bound
too low) or the FLOPs are over-counted. Such a figure is never shown: ``Mfu.value`` is None, the
text says "MFU n/a: measured throughput exceeds the peak estimate (peak X, achieved Y)" and
``to_dict`` records both figures so the JSON keeps the evidence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def flops_text(value: float) -> str:
    """FLOP/s for people: "1.23 TFLOP/s", "456 GFLOP/s"."""
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e6:.3g} MFLOP/s"


@dataclass(frozen=True)
class Mfu:
    """One MFU figure, or why there is none."""

    value: float | None  # the fraction of the peak; None when unknown or above the peak
    achieved: float | None  # model FLOP/s achieved (per process)
    peak: float | None  # the peak FLOP/s divided by (per process)
    source: str  # where the peak came from
    reason: str | None = None  # why value is None

    @property
    def exceeds_peak(self) -> bool:
        return self.value is None and self.achieved is not None and self.peak is not None \
            and self.achieved > self.peak

    def text(self) -> str:
        """A report line: "12.3 % of 1.2 TFLOP/s (source)", or the reason there is no figure."""
        if self.value is None:
            return self.reason or "MFU unknown"
        assert self.peak is not None
        return f"{100 * self.value:.1f} % of {flops_text(self.peak)} ({self.source})"

    def cell(self) -> str:
        """A table cell: "12.3 %", "n/a" above the peak, "-" when unknown."""
        if self.value is not None:
            return f"{100 * self.value:.1f} %"
        return "n/a" if self.exceeds_peak else "-"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exceeds_peak": self.exceeds_peak}


def mfu(achieved_flops: float | None, peak: float | None, source: str, processes: int = 1) -> Mfu:
    """The MFU of ``achieved_flops`` (model FLOP/s of the whole job) against ``peak`` FLOP/s per process."""
    if peak is None or peak <= 0:
        return Mfu(None, None, None, source, "MFU unknown: no peak FLOP/s for this device (no datasheet row, "
                   "none measured)")
    if achieved_flops is None or achieved_flops <= 0:
        return Mfu(None, None, peak, source, "MFU unknown: no model FLOPs counted for this workload")
    per_process = achieved_flops / max(1, processes)
    if per_process > peak:
        return Mfu(None, per_process, peak, source,
                   f"MFU n/a: measured throughput exceeds the peak estimate (peak {flops_text(peak)}, achieved "
                   f"{flops_text(per_process)}; {source})")
    return Mfu(per_process / peak, per_process, peak, source)
