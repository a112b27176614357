"""The informed prior's loader: the workers an expert would give a training job before measuring anything.

    informed_workers("cuda", cores=16, world_size=2)            -> (4, "…")
    informed_workers("cpu", cores=2, data_share=0.4)             -> (2, "…")  # a trial saw it wait for data

One rule for the default plan (`plan.default_plan`) and a script too short to tune (`script/short_job.py`): on a GPU,
workers from the cores each process has, one kept for the training process, at most `POLICY.stages.prior_workers`;
on a CPU, where workers take cores from the step, none — unless a trial measured the step waiting for data at least
`POLICY.doctor.input_share` of its time, then `POLICY.stages.prior_cpu_workers` (when there are cores to spare).
"""

from __future__ import annotations

from saturate.policy import POLICY


def informed_workers(device_type: str, cores: int | None, world_size: int = 1,
                     data_share: float | None = None) -> tuple[int, str]:
    """(Loader workers, why, in words) for a job on `device_type` with `cores` usable cores over `world_size`
    processes; `data_share`: the share of a measured step spent waiting for data (None: nothing measured)."""
    s = POLICY.stages
    if device_type in ("cuda", "rocm"):
        if cores is None:
            return 0, "the cores are unknown"
        n = min(s.prior_workers, max(0, cores // max(1, world_size) - 1))
        return n, f"from {cores} usable cores over {world_size} process(es), one kept for training"
    waits = POLICY.doctor.input_share
    if data_share is not None and data_share >= waits and (cores or 1) > 1:
        return (min(s.prior_cpu_workers, cores or 1),
                f"the first trial waited for data {100 * data_share:.0f} % of its step")
    return 0, "the step uses every core"
