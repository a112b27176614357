"""The stages of `tune -- CMD` every script has, whatever trains it: the host allocator on a CPU, its DataLoaders'
workers (past the cores while the data wait remains), prefetch and pinning, and torch's intra-op threads on a busy
CPU. Each trial goes through the search (`consider`, tune_script.py: kept only when measured faster)."""

from __future__ import annotations

from typing import Any

from saturate.policy import POLICY, Load
from saturate.policy.threads import Skip, threads_to_try
from saturate.script.overrides import Overrides


def alloc_stage(search: Any, device: str) -> None:
    """On a CPU whose as-written run faulted pages in at `FAULTS_WORTH_TRYING` a second or more, glibc's malloc
    thresholds raised in the script's environment (engine/host_alloc.py: a step's buffers reused instead of mapped
    afresh each step); kept only when measured faster. Tried first: it changes nothing in the training, and every
    later trial then runs with it."""
    from saturate.engine.host_alloc import FAULTS_WORTH_TRYING, left_alone

    decisions, faults = search.result.decisions, search.result.baseline.faults_per_s
    if device != "cpu":
        decisions.append(f"host allocator: not tried on {device} (its steps' buffers are the device's)")
    elif (why := left_alone()) is not None:
        decisions.append(f"host allocator: not tried ({why})")
    elif faults is None or faults < FAULTS_WORTH_TRYING:
        seen = "not read" if faults is None else f"{faults:,.0f} a second"
        decisions.append(f"host allocator: not tried (the script's minor page faults while timed: {seen}, under the "
                         f"{FAULTS_WORTH_TRYING:,} that could cost {100 * POLICY.gains.min_gain:.0f} % of a step)")
    else:
        search.consider("host allocator", search.with_overrides(Overrides(host_alloc=True)))


def threads_stage(search: Any, cores: int) -> None:
    """On a CPU that other processes kept busy during the trials, fewer intra-op threads than torch's (the
    preset tuner's threads stage, tune/search.py: one thread preempted by a neighbour stalls the others at every
    parallel region); kept only when measured faster. A quiet machine keeps the script's count untried."""
    result = search.result
    using = result.baseline.threads
    busy = max((t.other_cores for t in result.trials if t.other_cores is not None), default=0.0)
    choice = threads_to_try(result.device_type, 1, using, Load(busy, cores))  # the preset tuner's rule too
    if choice.skip in (Skip.NOT_CPU, Skip.UNKNOWN):
        why = "not on a CPU" if choice.skip is Skip.NOT_CPU else "the script reported no thread count"
        result.decisions.append(f"threads: not tried ({why})")
        return
    if choice.skip is Skip.QUIET:
        result.decisions.append(f"threads: the script's {using} (other processes kept under half a core busy "
                                "during the trials)")
        return
    free = choice.left
    if choice.skip is Skip.ENOUGH:
        result.decisions.append(f"threads: the script's {using} (other processes kept {busy:.1f} of {cores} "
                                f"cores busy, leaving {free})")
        return
    t = search.consider(f"{free} threads", search.with_overrides(Overrides(threads=free)))
    result.decisions.append(f"threads: {free} of {using} {t.outcome} (other processes kept {busy:.1f} of {cores} "
                            "cores busy: a setting for a machine this busy — on a quiet one, tune again)")

def _past_the_cores(search: Any, workers: int, cores: int) -> str | None:
    """Why not try `workers` loader workers, more than the `cores` usable cores, or None: past the cores only
    while the best run still waits for data (a dataset that waits on I/O, not on a core: 4 ms of sleep per
    sample ran 4× at 8 workers on 2 cores, issue 29) and each worker could hold as much host memory as the
    training process at its peak without using more than `POLICY.stages.worker_memory_share` of what is available."""
    best = search.result.best
    if best.data_share < POLICY.stages.input_share_min:
        return (f"the best so far waits for data {100 * best.data_share:.0f} % of its step, under "
                f"{100 * POLICY.stages.input_share_min:.0f} %")
    peak = best.host_peak or 0
    available = _host_memory_available()
    if peak and workers * peak > POLICY.stages.worker_memory_share * available:
        return (f"{workers} workers at up to {peak / 2**30:.1f} GiB each would use more than half of the "
                f"{available / 2**30:.1f} GiB of host memory available")
    return None

def loader_stages(search: Any, cores: int) -> None:
    result = search.result
    base = result.baseline
    loader = result.loaders[0] if result.loaders else None
    if loader is None:
        result.decisions.append("loader settings: no DataLoader in the timed steps; not tried")
        return
    if base.data_share < POLICY.stages.input_share_min:
        result.decisions.append(f"loader settings: waiting for data is {100 * base.data_share:.0f} % of the "
                                f"step as written; more workers cannot gain more than that; not tried")
        return
    written = loader.get("num_workers") or 0
    counts = [w for w in _powers_of_two(max(1, cores) * POLICY.stages.workers_per_core) if w != written]
    tried: list[int] = []
    stopped = ""
    for w in counts:
        if w > cores and (why := _past_the_cores(search, w, cores)):
            stopped = f"; not {w}: {why}"
            break
        tried.append(w)
        t = search.consider(f"{w} workers", search.with_overrides(Overrides(loader={
            "num_workers": w, "persistent_workers": True})))
        if not search.kept(t) and w > 1:  # one worker only overlaps loading with the step: 2 is the first test
            break
    workers = result.best.overrides.loader.get("num_workers", written)
    result.decisions.append(f"loader workers: {workers} (as written {written}; tried "
                            f"{', '.join(map(str, tried))}{stopped})")
    if workers:
        search.consider("prefetch 4", search.with_overrides(Overrides(loader={"prefetch_factor": 4})))
    if result.device_type == "cuda" and not loader.get("pin_memory"):
        search.consider("pinned memory", search.with_overrides(Overrides(loader={"pin_memory": True})))


def _host_memory_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _powers_of_two(limit: int) -> list[int]:
    out, w = [], 1
    while w <= limit:
        out.append(w)
        w *= 2
    return out
