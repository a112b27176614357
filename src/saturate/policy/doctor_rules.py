"""The doctor's thresholds: the shares of a step, of memory and of a machine its verdicts and fixes rest on."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule

_VERDICTS = "docs/doctor.md (The verdicts and their rules)"
_BUSY = "docs/doctor.md (On a busy machine: contended)"


@dataclass(frozen=True)
class DoctorRules:
    """When the doctor calls a verdict, proposes a fix, or trusts a probe."""

    # --- the verdicts (doctor/rules.py) ---
    oom_share: float = rule(0.92, "at risk of OOM: this process reserved this share of the device's memory at peak",
                            _VERDICTS)
    oom_used_share: float = rule(0.95, "...or all processes on the device (NVML/AMD SMI) used this share at peak",
                                 "doctor/rules.py _check_oom")
    swap_bytes: int = rule(64 * 1024**2, "host-memory-bound: this many bytes swapped in and out during the run",
                           _VERDICTS)
    host_free_min: float = rule(0.05, "host-memory-bound: host RAM available fell under this share of it", _VERDICTS)
    budget_share: float = rule(0.90, "host-memory-bound: the job's processes over this share of its host-memory "
                               "budget (and the share fewer workers aim for)", _VERDICTS)
    input_share: float = rule(0.15, "input-bound: waiting for data (plus copies, on an accelerator) this share of the "
                              "step, over its whole range across the timed windows", _VERDICTS)
    idle_share: float = rule(0.15, "sync-bound: a sync every step with the device idle this share of the time, over "
                             "the whole range across the windows (accelerators)", _VERDICTS)
    fixed_share: float = rule(0.50, "overhead-bound: a micro-step's fixed cost this share of it over the whole range "
                              "the batch-scaling probe allows (a range across it is a note)", _VERDICTS)
    idle_no_probe: float = rule(0.40, "overhead-bound without a probe: the device idle this share with no data wait "
                                "and no sync to blame", _VERDICTS)
    own_code_share: float = rule(0.40, "own-code-bound: a script's own loop spends this share of the step outside "
                                 "the data wait, forward, backward and optimizer, over its whole range across the "
                                 "windows (no knob of saturate's reaches it)", _VERDICTS)
    memory_low: float = rule(0.50, "device memory under-used: a peak under this share of the device (and a larger "
                             "micro-batch predicted gain_min as fast)", _VERDICTS)
    memory_target: float = rule(0.80, "a larger micro-batch is proposed only while its predicted device memory peak "
                                "stays under this share of the device", "doctor/fixes.py micro_batch_fix")
    gain_min: float = rule(1.10, "a fix is proposed only when predicted at least this many times as fast (ratio)",
                           "doctor/fixes.py; docs/doctor.md")
    # --- the fixes (doctor/fixes.py, doctor/rules.py) ---
    h2d_share: float = rule(0.05, "pinned memory and non-blocking copies are proposed for an input-bound CUDA run "
                            "whose copies to the device take this share of the step", "doctor/rules.py _check_input")
    data_wait_share: float = rule(0.05, "fewer workers (host memory) warn that the data wait may grow when the step "
                                  "waits for data more than this share", "doctor/rules.py _check_host_memory")
    cpu_bound_share: float = rule(0.5, "making a step's batches is CPU-bound when the loading thread (or the "
                                  "workers) kept a core busy this share of the wait", "doctor/fixes.py worker_fix")
    worker_headroom: float = rule(0.8, "workers are added until a step's batches take at most this share of the rest "
                                  "of the step to produce (room for their jitter)", "doctor/fixes.py worker_fix")
    restart_share: float = rule(0.02, "a loader whose workers start again every epoch (no persistent_workers) is "
                                "named when its first batch's wait is this share of an epoch or more",
                                "script/doctor_script.py loader_starts")
    first_batch_s: float = rule(1.0, "a loader's first batch that waited this long or more is named, once a run",
                                "script/doctor_script.py loader_starts")
    # --- the probes (doctor/busy.py, doctor/findings.py, doctor/loop_probe.py, doctor/profiler.py) ---
    min_rounds: int = rule(3, "back-to-back rounds a ratio's range rests on: enough for a median and a range "
                           "(fewer: the fixed share's range is the two timings' spreads)", _BUSY)
    barrier_margin: float = rule(0.10, "the fixed share on several threads may exceed the bound from the probe on one "
                                 "thread by this much: their own barriers add a fixed part a lone thread lacks",
                                 "2026-11-29, the 2-vCPU Xeon quiet: 0.01-0.07 above the bound for four public "
                                 "scripts (docs/doctor.md, On a busy machine)")
    probe_slower: float = rule(2.5, "a script's batch-scaling probe is left out when its replayed micro-step is more "
                               "than this many times as slow as the script's own", "doctor/profiler.py Profiler._probe")
    probe_faster: float = rule(4.0, "...or this many times as fast: a replay runs with warm caches and without the "
                               "script's code between calls; no bound on a busy machine, a load only slows the "
                               "script's figure", "a 0.1-ms replay of a 0.2-ms step read 0.46-0.64x quiet, 0.37x "
                               "under the test suite's load; run_clm under the bursty neighbour, 2026-11-29: 52 ms "
                               "a micro-step in a burst, ~3.5 ms quiet")
    probe_rounds: int = rule(5, "rounds of a script's probe: its two sizes (or the run's threads against one) "
                             "timed back to back, interleaved", "doctor/loop_probe.py")
    probe_min_timing_s: float = rule(0.01, "one probe timing lasts at least this long, a short micro-step repeated "
                                     "within it, so one scheduler hiccup cannot move a sub-millisecond step's ratio",
                                     "a busy 2-core machine: ratios 1.6-1.9 for a step nearly all fixed cost "
                                     "(doctor/loop_probe.py)")
    probe_max_repeats: int = rule(100, "the most calls one probe timing repeats", "doctor/loop_probe.py")
