"""saturate: make PyTorch training use its hardware fully.

    probe()                      -> Hardware
    train(workload, plan, cfg)   -> RunResult
    build_workload("gpt-tiny")   -> Workload
    custom_workload(name, model=…, dataset=…, loss=…, effective_batch=…, lr=…) -> Workload
    tune(workload)               -> TuneResult (a measured, verified Plan and its evidence)
    diagnose(workload, plan)     -> Diagnosis   (the doctor; Profiler for a loop of your own)
    load_model(run_dir)          -> the trained model of a finished run, weights loaded
    Sink                         the metrics sink protocol: write(record), close(); RunConfig(log_to=[…])
"""

from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.doctor.findings import Diagnosis
from saturate.doctor.profiler import Profiler
from saturate.engine.metrics import Sink
from saturate.engine.trainer import RunConfig, RunResult, train
from saturate.errors import SaturateError
from saturate.hardware import Hardware, probe
from saturate.plan import REFERENCE_PLANS, Plan, default_plan, reference_plan
from saturate.tune import TuneResult, tune
from saturate.workloads import PRESETS, Optimization, Workload, build_workload, custom_workload, load_workload
from saturate.workloads.reopen import load_model

__all__ = [
    "PRESETS", "REFERENCE_PLANS", "Diagnosis", "DoctorConfig", "Hardware", "Optimization", "Plan", "Profiler",
    "RunConfig", "RunResult", "SaturateError", "Sink", "TuneResult", "Workload", "build_workload", "custom_workload",
    "default_plan", "diagnose", "load_model", "load_workload", "probe", "reference_plan", "train", "tune",
]
__version__ = "0.1.0"
