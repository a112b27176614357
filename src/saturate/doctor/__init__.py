"""The doctor: why a run is slow, measured, with a verdict and ranked fixes.

    diagnose(workload, plan)   -> Diagnosis   an instrumented stretch of a saturate workload
    Profiler(model, optimizer) -> .data(loader), .step()   the same for a user's own loop
    decide(measurements)       -> Diagnosis   the verdict rules alone (a pure function)
"""

from saturate.doctor.findings import VERDICTS, Diagnosis, Fix, Measurements, Prediction, ScalingProbe
from saturate.doctor.profiler import Profiler
from saturate.doctor.rules import decide

__all__ = ["VERDICTS", "Diagnosis", "Fix", "Measurements", "Prediction", "Profiler", "ScalingProbe", "decide"]
