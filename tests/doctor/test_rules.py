"""The verdict rules on constructed measurements: one case per verdict, predictions, ranking.

These are pure-function tests; the same cases measured for real are in test_diagnose.py and
test_profiler.py (CPU) and test_doctor_gpu.py (GPU only).
"""

from __future__ import annotations

import json

import pytest

from saturate.doctor.findings import Measurements, ScalingProbe
from saturate.doctor.rules import decide
from saturate.telemetry import Stat

GIB = 1024**3


def measured(**kw) -> Measurements:
    """A healthy CPU step unless told otherwise: 100 ms, almost all forward/backward."""
    base = dict(device_type="cpu", device_name="test cpu", timing="host time", steps=10, step_s=0.100,
                phases={"data": 0.002, "h2d": 0.0, "forward": 0.030, "backward": 0.060, "optimizer": 0.006,
                        "other": 0.002},
                micro_batch=8, grad_accum=4, num_workers=0, precision="fp32", compile="none", supports_bf16=False,
                syncs_per_step=0.0, cpu_cores=2, host_ram_total=32 * GIB, host_ram_available_min=20 * GIB,
                swap_bytes=0, tree_peak=1 * GIB, main_peak=1 * GIB, host_budget=20 * GIB)
    base.update(kw)
    return Measurements(**base)


def gpu(**kw) -> Measurements:
    base = dict(device_type="cuda", device_name="test gpu", timing="device time", device_mem_total=80 * GIB,
                device_mem_peak=60 * GIB, device_util=Stat(97.0, 99.0, 95.0, 20))
    base.update(kw)
    return measured(**base)


def test_healthy_step_is_compute_bound():
    d = decide(measured())
    assert d.verdict == "compute-bound"
    assert d.label == "compute-bound (healthy)"
    assert d.fixes == []


def test_bf16_is_offered_but_not_predicted_when_the_device_has_it():
    d = decide(measured(supports_bf16=True))
    assert d.verdict == "compute-bound"
    assert [f.changes for f in d.fixes] == [{"precision": "bf16"}]
    assert d.fixes[0].prediction.after is None  # no model predicts it: no number is made up


def test_bf16_is_bounded_by_the_share_of_forward_and_backward():
    # A tiny step that is mostly the script's own code (the DDP tutorial on a CPU: 78 % "everything else").
    small = {"data": 0.005, "forward": 0.003, "backward": 0.004, "optimizer": 0.003, "other": 0.085}
    d = decide(measured(supports_bf16=True, phases=small))
    assert d.verdict == "compute-bound" and d.fixes == []
    assert "forward and backward 7 % of the step: a faster precision could make the step at most 1.08× faster, " \
           "so bf16 is not proposed" in d.evidence
    # Its highest window decides (the cautious side; from five windows on the extremes are trimmed): one window of
    # four at 20 % keeps the fix, with its bound.
    windows = [{"forward": 0.03, "backward": 0.04}] * 3 + [{"forward": 0.08, "backward": 0.12}]
    kept = decide(measured(supports_bf16=True, phases=small, window_shares=windows))
    assert [f.changes for f in kept.fixes] == [{"precision": "bf16"}]
    assert kept.fixes[0].prediction.basis.endswith("at most 1.25×, were forward and backward to take no time")
    assert "forward and backward 7 % of the step" in kept.evidence
    # Not hooked (no model seen in a forward): the share is unknown and the fix stands unbounded.
    unhooked = decide(measured(supports_bf16=True, phases={"data": 0.01, "optimizer": 0.01, "other": 0.08}))
    assert [f.changes for f in unhooked.fixes] == [{"precision": "bf16"}]
    assert "at most" not in unhooked.fixes[0].prediction.basis


def test_waiting_for_data_is_input_bound_and_workers_are_the_fix():
    # 60 ms of every 100 ms waiting, the main thread idle meanwhile (I/O-like): 2 workers hide it.
    m = measured(phases={"data": 0.060, "forward": 0.013, "backward": 0.025, "optimizer": 0.001, "other": 0.001},
                 data_cpu_share=0.05)
    d = decide(m)
    assert d.verdict == "input-bound"
    top = d.fixes[0]
    assert top.changes["num_workers"] == 2
    # 60 ms of production over 2 workers = 30 ms < the 40 ms of compute: the step becomes 40 ms.
    assert top.prediction.after == pytest.approx(0.040)
    assert top.prediction.gain == pytest.approx(2.5)
    assert "60 %" in d.evidence[0]


def test_cpu_bound_production_shares_the_cores_with_training_on_a_cpu():
    m = measured(phases={"data": 0.060, "forward": 0.013, "backward": 0.025, "optimizer": 0.001, "other": 0.001},
                 data_cpu_share=0.95, cpu_cores=2)
    top = decide(m).fixes[0]
    # The CPU work adds up on two cores: 40 ms + 60 ms / 2.
    assert top.prediction.after == pytest.approx(0.070)
    assert top.changes["num_workers"] <= 2


def test_workers_already_running_estimate_production_from_the_wait():
    # 2 workers, still 30 ms of wait over 40 ms of compute: production ≈ 2 × 70 ms per step.
    m = measured(num_workers=2, phases={"data": 0.030, "forward": 0.015, "backward": 0.025, "other": 0.0},
                 step_s=0.070, data_cpu_share=0.1, cpu_cores=8)
    top = decide(m).fixes[0]
    assert top.changes["num_workers"] > 2
    assert top.prediction.after < 0.070


def test_swapping_is_host_memory_bound_before_anything_else():
    m = measured(swap_bytes=512 * 1024**2,
                 phases={"data": 0.060, "forward": 0.013, "backward": 0.025, "optimizer": 0.001, "other": 0.001})
    d = decide(m)
    assert d.verdict == "host-memory-bound"
    assert "512 MiB swapped" in d.evidence[0]
    assert [f.verdict for f in d.findings][:2] == ["host-memory-bound", "input-bound"]


def test_workers_over_the_budget_are_host_memory_bound_and_fewer_workers_fit():
    # Main 1 GiB + 4 workers × 1 GiB of their own = 5 GiB against a 3 GiB budget.
    m = measured(num_workers=4, tree_peak=5 * GIB, main_peak=1 * GIB, worker_peak=1 * GIB, workers_seen=4,
                 host_budget=3 * GIB, host_budget_source="given")
    d = decide(m)
    assert d.verdict == "host-memory-bound"
    top = d.fixes[0]
    assert top.changes == {"num_workers": 1}  # 1 GiB + 1 × 1 GiB = 2 GiB <= 90 % of 3 GiB; 2 workers would not fit
    assert top.prediction.metric == "host_bytes"
    assert top.prediction.after == pytest.approx(2 * GIB)


def test_a_single_worker_over_budget_gets_no_worker_fix():
    # Without workers the dataset's memory would move into the training process: no saving.
    m = measured(num_workers=1, tree_peak=5 * GIB, main_peak=1 * GIB, worker_peak=4 * GIB, workers_seen=1,
                 host_budget=3 * GIB)
    d = decide(m)
    assert d.verdict == "host-memory-bound"
    assert all("num_workers" not in f.changes for f in d.fixes)


def test_low_free_ram_is_host_memory_bound():
    d = decide(measured(host_ram_available_min=GIB // 2))
    assert d.verdict == "host-memory-bound"


def test_a_fixed_cost_per_micro_step_is_overhead_bound_and_a_larger_micro_batch_is_predicted():
    # Micro-batch 1 × 32: each micro-step 10 ms fixed + 0.5 ms/sample.
    probe = ScalingProbe((1, 4), (0.0105, 0.012))
    m = measured(micro_batch=1, grad_accum=32, step_s=32 * 0.0105 + 0.004,
                 phases={"data": 0.001, "forward": 0.12, "backward": 0.21, "optimizer": 0.003, "other": 0.002},
                 scaling=probe)
    d = decide(m)
    assert d.verdict == "overhead-bound"
    top = d.fixes[0]
    assert top.changes == {"micro_batch": 32, "grad_accum": 1}
    # Forward+backward as timed (0.33 s over 32 micro-steps), scaled by the fit T(32)/T(1); the data
    # wait scales with samples (no item_s), "other" is per micro-step; the optimizer step stays, and
    # so does the part of the step no phase accounts for.
    fb = 0.33 / 32 * probe.time_at(32) / probe.time_at(1)
    unaccounted = m.step_s - sum(m.phases.values())
    assert top.prediction.after == pytest.approx(0.003 + fb + 0.001 + 0.002 / 32 + unaccounted)
    assert top.prediction.gain > 5


def test_a_step_that_scales_with_the_batch_is_not_overhead_bound():
    probe = ScalingProbe((8, 16), (0.0245, 0.0485))  # 0.5 ms fixed of 24.5 ms
    d = decide(measured(scaling=probe))
    assert d.verdict == "compute-bound"
    assert any("fixed per-micro-step cost 2 %" in e for e in d.evidence)


def test_when_data_and_overhead_both_hold_the_bigger_predicted_gain_is_the_verdict():
    # A tiny model at micro-batch 1 waits 20 % of the step for its 32 small batches: both rules
    # hold, but a larger micro-batch removes far more than workers would.
    probe = ScalingProbe((1, 4), (0.00010, 0.00011))
    tiny = measured(micro_batch=1, grad_accum=32, step_s=0.0062, item_s=5e-6, data_cpu_share=0.85, scaling=probe,
                    phases={"data": 0.0012, "h2d": 0.0006, "forward": 0.0013, "backward": 0.0022,
                            "optimizer": 0.0004, "other": 0.0005})
    d = decide(tiny)
    assert d.verdict == "overhead-bound"
    assert [f.verdict for f in d.findings[:2]] == ["overhead-bound", "input-bound"]
    assert d.fixes[0].changes == {"micro_batch": 32, "grad_accum": 1}
    # Slow samples into a tiny model: the data wait dwarfs the per-micro-step cost.
    slow = measured(micro_batch=8, grad_accum=1, step_s=0.042, item_s=0.005, data_cpu_share=0.02,
                    scaling=ScalingProbe((8, 16), (0.0002, 0.00021)),
                    phases={"data": 0.040, "forward": 0.0008, "backward": 0.0008, "optimizer": 0.0003,
                            "other": 0.0001})
    d = decide(slow)
    assert d.verdict == "input-bound"
    assert "overhead-bound" in [f.verdict for f in d.findings]


def test_workers_and_threads_over_the_cores_of_a_cpu_run_get_a_note():
    d = decide(measured(num_workers=2, cpu_threads=2, cpu_cores=2))
    assert any(f.verdict == "note" and "torch.set_num_threads(1)" in f.evidence[0] for f in d.findings)
    assert not [f for f in decide(measured(num_workers=1, cpu_threads=1)).findings if f.verdict == "note"]


def test_reads_to_the_host_on_a_cpu_are_a_note_never_the_verdict():
    d = decide(measured(syncs_per_step=1.0, syncs_by_phase={"other": 1.0}))
    assert d.verdict == "compute-bound"
    notes = [f for f in d.findings if f.verdict == "note"]
    assert notes and "1 host read" in notes[0].evidence[0]


def test_syncs_with_an_idle_gpu_are_sync_bound():
    m = gpu(syncs_per_step=1.0, syncs_by_phase={"other": 1.0}, device_util=Stat(55.0, 70.0, 40.0, 12))
    d = decide(m)
    assert d.verdict == "sync-bound"
    top = d.fixes[0]
    assert top.changes == {}  # a change to the user's code
    assert top.prediction.after == pytest.approx(0.100 * 0.55)  # the busy time: an upper bound


def test_syncs_from_pageable_copies_are_fixed_by_pinning():
    m = gpu(syncs_per_step=4.0, syncs_by_phase={"h2d": 4.0}, device_util=Stat(60.0, 70.0, 50.0, 12),
            pin_memory=False, non_blocking=False)
    d = decide(m)
    assert d.verdict == "sync-bound"
    assert d.fixes[0].changes == {"pin_memory": True, "non_blocking": True}


def test_syncs_on_a_busy_gpu_are_not_the_verdict():
    d = decide(gpu(syncs_per_step=1.0, syncs_by_phase={"other": 1.0}))
    assert d.verdict == "compute-bound"


def test_sync_bound_needs_a_measured_utilisation():
    d = decide(gpu(syncs_per_step=1.0, device_util=Stat(missing="NVML: Not Supported")))
    assert d.verdict != "sync-bound"


def test_memory_near_the_top_is_oom_risk_with_a_smaller_micro_batch():
    probe = ScalingProbe((8, 16), (0.05, 0.10), (70 * GIB, 130 * GIB))
    d = decide(gpu(device_mem_peak=76 * GIB, scaling=probe))
    assert d.verdict == "oom-risk"
    top = d.fixes[0]
    assert top.changes == {"micro_batch": 4, "grad_accum": 8}
    assert top.prediction.metric == "device_bytes"
    assert top.prediction.after == pytest.approx(40 * GIB)


def test_little_memory_and_a_faster_larger_batch_is_device_memory_under_used():
    # 19 % of 80 GiB; a micro-step at 8 is 4 ms fixed + 2 ms per sample (fixed share 20 %: not overhead).
    probe = ScalingProbe((8, 16), (0.020, 0.036), (15 * GIB, 20 * GIB))
    m = gpu(device_mem_peak=15 * GIB, scaling=probe, step_s=0.082,
            phases={"data": 0.0, "forward": 0.026, "backward": 0.054, "optimizer": 0.002, "other": 0.0})
    d = decide(m)
    assert d.verdict == "device-memory-underused"
    top = d.fixes[0]
    assert top.changes == {"micro_batch": 32, "grad_accum": 1}
    # 82 ms - 4 × 20 ms + (4 ms + 32 × 2 ms) = 70 ms; predicted memory 30 GiB, inside 80 % of 80 GiB.
    assert top.prediction.after == pytest.approx(0.070)
    assert probe.memory_at(32) == pytest.approx(30 * GIB)


def test_a_larger_micro_batch_that_would_not_fit_is_not_proposed():
    probe = ScalingProbe((8, 16), (0.020, 0.036), (15 * GIB, 45 * GIB))  # 3.75 GiB per sample: 32 needs 105 GiB
    d = decide(gpu(device_mem_peak=15 * GIB, scaling=probe, step_s=0.082,
                   phases={"forward": 0.026, "backward": 0.054, "optimizer": 0.002}))
    assert all(f.changes.get("micro_batch", 0) <= 16 for f in d.fixes)


def test_under_used_memory_with_no_gain_is_healthy():
    probe = ScalingProbe((8, 16), (0.040, 0.080), (15 * GIB, 20 * GIB))  # no fixed cost: no gain from size
    d = decide(gpu(device_mem_peak=15 * GIB, scaling=probe, step_s=0.162,
                   phases={"forward": 0.05, "backward": 0.11, "optimizer": 0.002}))
    assert d.verdict == "compute-bound"


def test_fixes_are_ranked_by_predicted_gain():
    # Input-bound on a GPU with two fixes: the copy (50 ms, pinning removes it) beats workers (20 ms wait).
    m = gpu(phases={"data": 0.020, "h2d": 0.050, "forward": 0.010, "backward": 0.018, "optimizer": 0.002},
            pin_memory=False, non_blocking=False, data_cpu_share=0.1)
    d = decide(m)
    assert d.verdict == "input-bound"
    assert [next(iter(f.changes)) for f in d.fixes] == ["pin_memory", "num_workers"]
    gains = [f.prediction.gain for f in d.fixes]
    assert gains == sorted(gains, reverse=True)
    assert gains[0] == pytest.approx(0.100 / 0.050)


def test_unpredicted_fixes_come_after_predicted_ones():
    probe = ScalingProbe((1, 4), (0.0105, 0.012))
    m = measured(micro_batch=1, grad_accum=32, step_s=0.34, scaling=probe,
                 phases={"forward": 0.12, "backward": 0.21, "optimizer": 0.01})
    fixes = decide(m).fixes
    predicted = [f.prediction.after is not None for f in fixes]
    assert predicted == sorted(predicted, reverse=True) and True in predicted and False in predicted


def test_diagnosis_serialises_to_plain_json():
    import json

    d = decide(measured(swap_bytes=1024**3))
    text = json.dumps(d.to_dict())
    assert '"verdict": "host-memory-bound"' in text


# --- a verdict that does not flip on a busy machine ------------------------------------------------

LOW = ScalingProbe((8, 16), (0.010, 0.019), ratios=(1.9, 1.9, 1.9))  # a fixed part of 10 % at micro-batch 8


def _busy(other_cores: float = 1.2, cores: int = 2) -> dict:
    from saturate.doctor.instrument import contention_record
    from saturate.hardware.contention import Contention

    return contention_record(Contention(seconds=3.0, usable_cores=cores, other_cores=other_cores, own_cores=0.8))


def test_other_processes_on_our_cores_make_the_verdict_contended_not_the_workload():
    overhead = dict(micro_batch=1, grad_accum=32, step_s=32 * 0.0105 + 0.004,
                    scaling=ScalingProbe((1, 4), (0.0105, 0.012)),
                    phases={"data": 0.001, "forward": 0.12, "backward": 0.21, "optimizer": 0.003, "other": 0.002})
    assert decide(measured(**overhead)).verdict == "overhead-bound"
    d = decide(measured(**overhead, contention=_busy()))
    assert d.verdict == "contended" and d.label.startswith("contended")
    assert d.evidence[0].startswith("machine busy: other processes kept 1.2 of 2 usable CPU cores busy (60 %)")
    assert d.fixes == []  # nothing is proposed from timings the neighbours distorted
    assert "overhead-bound" in [f.verdict for f in d.findings]  # what held is still listed
    assert d.to_dict()["measurements"]["contention"]["significant"] is True
    quiet = decide(measured(**overhead, contention=_busy(other_cores=0.1)))
    assert quiet.verdict == "overhead-bound"


def test_a_busy_cpu_run_is_told_that_fewer_threads_may_help_and_that_it_was_not_measured():
    d = decide(measured(cpu_threads=2, cpu_cores=2, scaling=LOW, contention=_busy(other_cores=1.2)))
    said = [e for f in d.findings if f.verdict == "contended" for e in f.evidence
            if "intra-op threads wait for one another" in e]
    assert d.verdict == "compute-bound" and len(said) == 1  # the workload's verdict; the load listed beside it
    assert "torch.set_num_threads(1)" in said[0] and said[0].endswith("not measured in this run") and d.fixes == []
    one = decide(measured(cpu_threads=1, cpu_cores=2, contention=_busy(other_cores=1.2)))
    assert not any("intra-op threads wait" in e for f in one.findings for e in f.evidence)  # one thread: nothing


def test_a_busy_machine_with_nothing_found_but_the_load_is_still_compute_bound():
    low = LOW  # a fixed part of 10 %: the load only adds to it
    quiet = decide(measured(scaling=low))
    busy = decide(measured(scaling=low, contention=_busy()))
    assert quiet.verdict == busy.verdict == "compute-bound"
    assert busy.evidence[0].startswith("measured on a busy machine (machine busy: other processes kept 1.2 of 2")
    assert busy.evidence[1:] == quiet.evidence and [f.verdict for f in busy.findings] == ["compute-bound", "contended"]
    bf16 = decide(measured(scaling=low, supports_bf16=True, contention=_busy()))  # the hardware's fix: it stands
    assert bf16.verdict == "compute-bound" and [f.title for f in bf16.fixes] == ["precision fp32 → bf16 autocast"]
    # On a CPU with no probe (left out, or not run), a fixed cost is not ruled out: the load's verdict, no fix
    unprobed = decide(measured(supports_bf16=True, contention=_busy()))
    assert unprobed.verdict == "contended" and unprobed.fixes == []
    assert decide(measured(supports_bf16=True)).verdict == "compute-bound"  # quiet: as before
    # A fixed share within noise of its threshold: the load's scatter may have kept it from being called.
    near = ScalingProbe((1, 4), (0.0100, 0.0241), spread=(0.10, 0.10))
    undecided = decide(measured(micro_batch=1, grad_accum=8, scaling=near, contention=_busy()))
    assert undecided.verdict == "contended" and undecided.fixes == []


def test_memory_risks_still_win_over_contention():
    assert decide(measured(swap_bytes=1024**3, contention=_busy())).verdict == "host-memory-bound"


def test_contention_and_our_own_oversubscription_are_said_together():
    d = decide(measured(num_workers=2, cpu_threads=2, cpu_cores=2, contention=_busy()))
    contended = next(f for f in d.findings if f.verdict == "contended")
    assert any("torch.set_num_threads(1)" in e for e in contended.evidence)


def test_a_fixed_share_within_the_spread_of_the_threshold_is_not_called_either_way():
    # Fixed share ~50 %: two runs measuring 48 % and 53 % with 10 % timing spread give the same verdict.
    runs = [ScalingProbe((1, 4), (0.0100, 0.0256), spread=(0.10, 0.10)),  # fixed 4.8 ms of 10 ms: 48 %
            ScalingProbe((1, 4), (0.0100, 0.0241), spread=(0.10, 0.10))]  # fixed 5.3 ms: 53 %
    assert [round(p.fixed_share(1), 2) for p in runs] == [0.48, 0.53]
    verdicts = {decide(measured(micro_batch=1, grad_accum=8, scaling=p)).verdict for p in runs}
    assert verdicts == {"compute-bound"}
    d = decide(measured(micro_batch=1, grad_accum=8, scaling=runs[1]))
    assert any(f.verdict == "note" and "within noise of the threshold (" in f.evidence[0] for f in d.findings)
    # The same 53 % measured tightly is called.
    tight = ScalingProbe((1, 4), (0.0100, 0.0241), spread=(0.01, 0.01))
    assert decide(measured(micro_batch=1, grad_accum=8, scaling=tight)).verdict == "overhead-bound"


def test_the_contention_line_is_printed_first():
    import io

    from rich.console import Console

    from saturate.doctor.report import render

    out = io.StringIO()
    render(decide(measured(scaling=LOW, contention=_busy())), Console(file=out, width=200, color_system=None))
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("machine busy: other processes kept 1.2 of 2")
    assert "verdict: compute-bound" in out.getvalue()
    assert "(also contended) machine busy" in out.getvalue()


def test_measurements_with_contention_and_spread_survive_json():
    import json

    from saturate.doctor.findings import Measurements

    m = measured(contention=_busy(), scaling=ScalingProbe((1, 4), (0.01, 0.02), spread=(0.1, 0.2)))
    back = Measurements.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.contention == m.contention and back.scaling.spread == (0.1, 0.2)


# --- thresholds against the range over the timed windows ---------------------------------------


def windows_of(data: list[float]) -> list[dict[str, float]]:
    return [{"data": d, "forward": 1 - d} for d in data]


def input_case(data: list[float]) -> Measurements:
    mean = sum(data) / len(data)
    return measured(phases={"data": 0.1 * mean, "forward": 0.1 * (1 - mean)}, window_shares=windows_of(data),
                    data_cpu_share=0.05)


def test_a_wait_for_data_across_the_threshold_is_within_noise_with_no_fix():
    d = decide(input_case([0.12, 0.16, 0.18]))  # 12..18 % against 15 %
    assert d.verdict == "compute-bound"
    assert not any(f.changes.get("num_workers") for f in d.fixes)
    notes = [e for f in d.findings if f.verdict == "note" for e in f.evidence]
    assert any("within noise of the threshold (12..18 % vs 15 %)" in e for e in notes)
    assert "12..18 % over 3 timed windows" in d.evidence[0]


def test_a_wait_for_data_past_the_threshold_in_every_window_is_input_bound():
    d = decide(input_case([0.16, 0.18, 0.20]))
    assert d.verdict == "input-bound"
    assert "16..20 % over 3 timed windows" in d.evidence[0]
    assert d.fixes and d.fixes[0].changes.get("num_workers")


def test_a_wait_for_data_under_the_threshold_in_every_window_says_nothing_of_it():
    d = decide(input_case([0.10, 0.12, 0.14]))
    assert d.verdict == "compute-bound"
    assert not any("within noise" in e for f in d.findings for e in f.evidence)


def test_same_job_two_runs_either_side_of_the_threshold_give_one_verdict():
    # One run's mean wait is 14 %, the next one's 16 %: the ranges overlap the threshold both times.
    runs = [input_case([0.11, 0.14, 0.17]), input_case([0.13, 0.16, 0.19])]
    assert {round(m.share("data"), 2) for m in runs} == {0.14, 0.16}
    assert {decide(m).verdict for m in runs} == {"compute-bound"}


def test_device_idle_across_the_sync_threshold_is_within_noise():
    m = gpu(syncs_per_step=3.0, syncs_by_phase={"other": 3.0}, device_util=Stat(85.0, 99.0, 60.0, 20),
            window_util=[80.0, 86.0, 90.0])  # idle 10..20 % against 15 %
    d = decide(m)
    assert d.verdict != "sync-bound"
    assert any("within noise of the threshold (10..20 % vs 15 %)" in e for f in d.findings for e in f.evidence)
    m.window_util = [70.0, 75.0, 80.0]  # idle 20..30 %: every window past it
    assert decide(m).verdict == "sync-bound"


def test_syncs_in_only_some_counted_steps_are_not_sync_bound():
    m = gpu(syncs_per_step=1.0, syncs_each_step=[0.0, 2.0], syncs_by_phase={"other": 1.0},
            device_util=Stat(50.0, 99.0, 10.0, 20))
    d = decide(m)
    assert d.verdict != "sync-bound"
    assert any("not every step syncs" in e for f in d.findings for e in f.evidence)
    m.syncs_each_step = [1.0, 1.0]
    assert decide(m).verdict == "sync-bound"


def test_device_idle_across_the_overhead_threshold_without_a_probe_is_within_noise():
    m = gpu(syncs_per_step=0.0, device_util=Stat(60.0, 99.0, 10.0, 20), window_util=[50.0, 60.0, 70.0])
    d = decide(m)  # idle 30..50 % against 40 %
    assert d.verdict != "overhead-bound"
    assert any("within noise of the threshold (30..50 % vs 40 %)" in e for f in d.findings for e in f.evidence)
    m.window_util = [45.0, 50.0, 55.0]  # idle 45..55 %
    assert decide(m).verdict == "overhead-bound"


def test_a_wait_inside_the_training_process_stands_on_a_busy_machine_with_its_fix_labelled():
    waiting = dict(step_s=0.100, phases={"data": 0.060, "forward": 0.012, "backward": 0.024, "optimizer": 0.003,
                                         "other": 0.001})
    quiet = decide(measured(**waiting))
    assert quiet.verdict == "input-bound" and quiet.fixes
    busy = decide(measured(**waiting, contention=_busy()))
    assert busy.verdict == "input-bound" and [f.title for f in busy.fixes] == [f.title for f in quiet.fixes]
    assert busy.evidence[0].startswith("measured on a busy machine (machine busy: other processes kept 1.2 of 2")
    assert "loading its own batches (no loader workers)" in busy.evidence[0]
    assert all("calibrated on steps timed while the machine was busy" in f.prediction.basis for f in busy.fixes)
    assert "contended" in [f.verdict for f in busy.findings]  # how busy it was is still said
    # with workers the wait is a race between them and the step, which a neighbour can decide: no fix
    racing = decide(measured(**waiting, num_workers=2, cpu_threads=1, contention=_busy()))
    assert racing.verdict == "contended" and racing.fixes == []
    assert "input-bound" in [f.verdict for f in racing.findings]


def test_on_a_busy_machine_only_the_standing_findings_lend_their_fixes():
    # input-bound (no workers: stands) and overhead-bound (a probe's timing: the load could make it) together
    both = dict(micro_batch=1, grad_accum=32, step_s=0.5, scaling=ScalingProbe((1, 4), (0.0105, 0.012)),
                phases={"data": 0.2, "forward": 0.1, "backward": 0.19, "optimizer": 0.005, "other": 0.005})
    quiet = decide(measured(**both))
    assert {"input-bound", "overhead-bound"} <= {f.verdict for f in quiet.findings}
    busy = decide(measured(**both, contention=_busy()))
    assert busy.verdict == "input-bound"
    overhead = next(f for f in busy.findings if f.verdict == "overhead-bound")
    assert not {f.title for f in overhead.fixes} & {f.title for f in busy.fixes}  # listed, its fixes withheld


def test_a_fixed_share_from_back_to_back_rounds_stands_on_a_busy_machine_and_a_burst_round_is_left_out():
    # Five rounds of micro-batch 1 and 4 back to back; the fourth ran in a burst that hit only its large timing.
    rounds = (1.143, 1.140, 1.145, 2.3, 1.142)
    probe = ScalingProbe((1, 4), (0.0105, 0.0105 * 1.143), ratios=rounds)
    low, high = probe.fixed_share_range(1)
    assert high - low < 0.01 and low > 0.9  # the burst's round is left out of the range
    alone = ScalingProbe((1, 4), (0.0105, 0.0105 * 1.143), spread=(0.05, 1.0))  # the same, from the fastest of each
    assert alone.fixed_share_range(1)[0] < low - 0.2
    overhead = dict(micro_batch=1, grad_accum=32, step_s=32 * 0.012 + 0.004, scaling=probe, cpu_threads=1,
                    phases={"data": 0.001, "forward": 0.13, "backward": 0.25, "optimizer": 0.003, "other": 0.002})
    quiet = decide(measured(**overhead))
    busy = decide(measured(**overhead, contention=_busy()))
    assert quiet.verdict == busy.verdict == "overhead-bound"
    assert [f.title for f in busy.fixes] == [f.title for f in quiet.fixes] and busy.fixes
    assert "two micro-batch sizes timed back to back" in busy.evidence[0]
    # Two threads: a preempted one holds up each parallel region whatever the size, which reads as a fixed part,
    # whether the rounds scatter (nanoGPT under the bursty neighbour: 62 % fixed, rounds 0.56–2.05×; 39 % quiet) or
    # agree (these, and Lightning's under the steady one: 92 %, 1.07–1.10×; compute-bound quiet). No fix.
    nano = ScalingProbe((8, 16), (0.0354, 0.0489), ratios=(0.9949, 1.416, 2.046, 1.381, 0.556))
    for p, said in ((nano, "0.99–1.42×"), (probe, "1.14–1.15×")):
        two = dict(overhead, micro_batch=p.micro_batches[0], scaling=p, cpu_threads=2)
        threads = decide(measured(**two, contention=_busy()))
        assert threads.verdict == "contended" and threads.fixes == []
        listed = next(f for f in threads.findings if f.verdict == "overhead-bound")
        assert listed.evidence[0].startswith("measured on a busy machine; this may be the load's: with torch's 2 "
                                             "intra-op threads, a thread a neighbour preempts holds up each parallel")
        assert f"(the probe's rounds: {said} from the smaller micro-batch to the larger)" in listed.evidence[0]
        assert decide(measured(**two)).verdict == "overhead-bound"  # quiet: as measured
    # two rounds only: the fastest of each stands for the probe, which a neighbour could have made: withheld
    few = decide(measured(**{**overhead, "scaling": ScalingProbe((1, 4), (0.0105, 0.012), ratios=(1.14, 1.15))},
                          contention=_busy()))
    assert few.verdict == "contended" and few.fixes == []
    back = Measurements.from_dict(json.loads(json.dumps(measured(scaling=probe).to_dict())))
    assert back.scaling.ratios == rounds


def test_on_a_busy_cpu_with_several_threads_the_probe_on_one_thread_bounds_the_fixed_share():
    """The probe taken again on one thread bounds the share on two: at least its own (the per-sample work is shared
    out, the fixed part is not), at most as if the per-sample part ran twice as fast, plus a margin for barriers."""
    # The run's own probe on two threads, in a burst: 62 % fixed, rounds 0.56–2.05× (nanoGPT, 2026-11-28).
    nano = ScalingProbe((8, 16), (0.0354, 0.0489), ratios=(0.9949, 1.416, 2.046, 1.381, 0.556))
    base = dict(micro_batch=8, grad_accum=1, step_s=0.012, scaling=nano, cpu_threads=2, supports_bf16=True,
                phases={"data": 0.0, "forward": 0.005, "backward": 0.004, "optimizer": 0.001, "other": 0.002})

    def one(*ratios):
        return ScalingProbe((8, 16), (0.010, 0.010 * ratios[2]), ratios=ratios)

    # One thread: 18 % fixed (rounds 1.81–1.83×, as quiet on the Xeon): at most 19/(19 + 81/2) + 10 = 42 % on two.
    low = decide(measured(**base, scaling_one_thread=one(1.69, 1.81, 1.82, 1.83, 1.95), contention=_busy()))
    assert low.verdict == "compute-bound" and [f.title for f in low.fixes] == ["precision fp32 → bf16 autocast"]
    line = next(e for e in low.evidence if "taken again on one of torch's 2 intra-op threads" in e)
    assert "there the fixed part is 18 % (rounds 1.81–1.83×), so on 2 threads, which share out only the " \
           "per-sample work, it is bounded to 17..42 % (the upper end as if they shared it perfectly, plus 10 " \
           "points for their own barriers, or the run's own probe where lower: a bound, not a measurement)" in line
    # One thread: 58 % fixed (run_clm's micro-batch 1, rounds 1.41–1.43×): overhead-bound, and it stands.
    clm = dict(base, micro_batch=1, grad_accum=8, step_s=0.045,
               scaling=ScalingProbe((1, 2), (0.0035, 0.0047), ratios=(1.28, 1.32, 1.33, 1.38, 1.42)),
               phases={"data": 0.001, "forward": 0.020, "backward": 0.015, "optimizer": 0.001, "other": 0.008})
    ovh = ScalingProbe((1, 2), (0.004, 0.004 * 1.42), ratios=(1.36, 1.41, 1.42, 1.43, 1.43))
    stood = decide(measured(**clm, scaling_one_thread=ovh, contention=_busy()))
    assert stood.verdict == "overhead-bound" and stood.fixes[0].title.startswith("micro-batch 1 → 8")
    assert stood.evidence[0].startswith("measured on a busy machine (machine busy")
    assert "this stands: its floor was timed on one thread" in stood.evidence[0]
    assert "(measured at micro-batch 1 and 2, on one thread)" in stood.evidence[1]
    assert stood.fixes[0].prediction.basis.endswith(
        "the fit timed on one thread, where the fixed part's share is the smaller: on 2 threads the gain should be "
        "larger; calibrated on steps timed while the machine was busy")
    # Between (40 % on one thread: 39..68 % on two): nothing called, no fix.
    mid = decide(measured(**base, scaling_one_thread=one(1.58, 1.59, 1.60, 1.61, 1.62), contention=_busy()))
    assert mid.verdict == "contended" and mid.fixes == []
    said = "(the batch-scaling probe's timings, on one thread) is within noise of the threshold (39..68 % vs 50 %)"
    assert any(said in e for f in mid.findings for e in f.evidence)
    # The run's own probe under its threshold caps the range (the load on two threads only adds a fixed part):
    # nanoGPT under the steady neighbour, 12 % on two threads, 34 % on one (rounds 1.56–1.85×), 2026-11-29.
    steady = dict(base, scaling=ScalingProbe((8, 16), (0.010, 0.0188), ratios=(1.86, 1.87, 1.88, 1.89, 1.90)))
    capped = decide(measured(**steady, scaling_one_thread=one(1.56, 1.60, 1.66, 1.70, 1.85), contention=_busy()))
    assert capped.verdict == "compute-bound" and capped.fixes
    said = "on 2 threads, which share out only the per-sample work, it is bounded to 13..30 % (the upper end"
    assert any(said in e for e in capped.evidence)
    # Without it (the probe on one thread failed, or was never taken): as before, the share does not stand.
    assert decide(measured(**base, contention=_busy())).verdict == "contended"
    # A run on one thread: its own probe is read (and stands), the other ignored.
    alone = decide(measured(**{**base, "cpu_threads": 1}, scaling_one_thread=one(1.69, 1.81, 1.82, 1.83, 1.95),
                            contention=_busy()))
    assert alone.verdict == "overhead-bound" and not any("on one thread" in e for e in alone.evidence)
    back = Measurements.from_dict(json.loads(json.dumps(measured(**base, scaling_one_thread=ovh).to_dict())))
    assert back.scaling_one_thread == ovh


def test_on_a_busy_cpu_one_thread_measured_faster_under_the_load_is_the_fix():
    """The probe's rounds time a micro-step on two threads and on one back to back; under the steady neighbour two
    took 3.7–80× as long (2026-11-29). Measured beyond their spread, one thread is contended's fix, and it leads."""
    base = dict(micro_batch=8, grad_accum=1, step_s=0.500, scaling=LOW, cpu_threads=2, supports_bf16=True,
                scaling_one_thread=ScalingProbe((8, 16), (0.010, 0.019), ratios=(1.9,) * 5),
                phases={"data": 0.0, "forward": 0.200, "backward": 0.250, "optimizer": 0.030, "other": 0.020})
    d = decide(measured(**base, threads_ratios=(60.0, 80.0, 85.0, 82.0, 300.0), contention=_busy(other_cores=1.0)))
    assert d.verdict == "contended" and d.fixes[0].title == "plan.threads 2 → 1 (while the machine is this busy)"
    assert d.fixes[0].changes == {"threads": 1}
    assert d.fixes[0].prediction.after == pytest.approx(0.500 - 0.450 + 0.450 / 82.0)
    assert [f.title for f in d.fixes[1:]] == ["precision fp32 → bf16 autocast"]  # the workload's own, after it
    assert [f.verdict for f in d.findings][:2] == ["contended", "compute-bound"]
    said = [e for e in d.evidence if e.startswith("measured: a micro-step's forward and backward took")]
    assert said == ["measured: a micro-step's forward and backward took 80.00–85.00× (median 82.00×) as long on 2 "
                    "intra-op threads as on one, the two timed back to back in 5 rounds on the machine as busy as it "
                    "was"]
    assert not any("not measured in this run" in e for e in d.evidence)
    assert any(e.endswith("machine for those); the fix here is for the load itself, measured under it")
               for e in d.evidence)
    # Rounds that do not show one thread faster beyond their spread: said, no fix; the workload's verdict.
    level = decide(measured(**base, threads_ratios=(0.6, 0.9, 1.3, 2.0, 5.0), contention=_busy(other_cores=1.0)))
    assert level.verdict == "compute-bound" and [f.title for f in level.fixes] == ["precision fp32 → bf16 autocast"]
    assert any(e.endswith("not faster on one beyond the rounds' spread and by 10 %") for f in level.findings
               for e in f.evidence)
    assert not any("for the load itself" in e for f in level.findings for e in f.evidence)
    # Quiet (the rounds only run on a busy machine; were they there): no contended finding, no fix from them.
    quiet = decide(measured(**base, threads_ratios=(60.0, 80.0, 85.0, 82.0, 300.0)))
    assert quiet.verdict == "compute-bound" and all(f.changes != {"threads": 1} for f in quiet.fixes)
    back = Measurements.from_dict(json.loads(json.dumps(measured(threads_ratios=(2.0, 3.0, 4.0)).to_dict())))
    assert back.threads_ratios == (2.0, 3.0, 4.0)


def test_a_loop_mostly_in_its_own_code_is_own_code_bound_and_the_fix_is_the_scripts():
    # reinforce.py's shape: 59 % of the step between the phases (CartPole stepped one action at a time)
    phases = {"data": 0.0, "forward": 0.0063, "backward": 0.0082, "optimizer": 0.0007, "other": 0.022}
    sites = {"reinforce.py:57": 26.0, "reinforce.py:59": 26.0}
    m = measured(context="loop", step_s=0.0372, phases=phases, syncs_per_step=52.0, syncs_by_site=sites,
                 window_shares=[{**{k: v / 0.0372 for k, v in phases.items()}, "other": s} for s in (0.55, 0.6, 0.62)])
    d = decide(m)
    assert d.verdict == "own-code-bound" and d.label.startswith("bound by its own code")
    assert d.evidence[0].startswith("59 % of each step (22.0 ms of 37.2 ms) is spent outside the data wait")
    assert "reinforce.py:57" in d.evidence[1]
    fix = d.fixes[0]
    assert fix.changes == {} and fix.prediction.after == pytest.approx(0.0152)
    assert decide(measured(step_s=0.0372, phases=phases)).verdict == "compute-bound"  # a preset's step: not called
    within = measured(context="loop", step_s=0.0372, phases=phases,
                      window_shares=[{"other": s} for s in (0.3, 0.45, 0.5)])
    assert decide(within).verdict == "compute-bound"
    assert any("the time outside the timed phases is" in e for f in decide(within).findings for e in f.evidence)


def test_own_code_is_the_verdict_only_where_no_other_rule_holds():
    # waiting for data and 45 % outside the phases: input-bound is the verdict, own-code-bound listed beside it
    m = measured(context="loop", phases={"data": 0.040, "forward": 0.007, "backward": 0.007, "optimizer": 0.001,
                                         "other": 0.045}, data_cpu_share=0.05)
    d = decide(m)
    assert d.verdict == "input-bound" and "own-code-bound" in [f.verdict for f in d.findings]
