"""The verdict: a pure function of measurements -> one verdict, its evidence, ranked fixes.

Nothing here measures or reads the machine, so every rule is testable on constructed numbers.
The rules, each threshold a field of `POLICY.doctor` (policy/doctor_rules.py), its default given:

1. at risk of OOM        device memory peak ≥ oom_share (92 %) of the device, or all processes'
                         ≥ oom_used_share (95 %) (accelerators)
2. host-memory-bound     swapping (≥ swap_bytes) during the run, host RAM under host_free_min (5 %)
                         free, or the job's processes over budget_share (90 %) of its budget
3. input-bound           waiting for data (plus, on an accelerator, host-to-device copies)
                         ≥ input_share (15 %) of the step
4. synchronisation-bound ≥ 1 host-device sync per step while the device is idle ≥ idle_share (15 %)
                         of the time (accelerators; a sync costs nothing on a CPU, where reads are
                         reported as a note, never as the verdict)
5. launch/overhead-bound the fixed cost of a micro-step (from the batch-scaling probe) is
                         ≥ fixed_share (50 %) of its forward+backward over the whole range the probe's
                         timing spread allows (a range across it is a note, not a verdict, so two runs
                         of the same job do not flip between this and compute-bound), or, without a
                         probe, the device is idle ≥ idle_no_probe (40 %) with no data wait or sync
6. device memory under-used  peak < memory_low (50 %) of the device and a larger micro-batch that
                         fits is predicted gain_min (1.10×) as fast
7. own-code-bound        a script's own loop spends ≥ own_code_share (40 %) of the step outside the
                         data wait, forward, backward and optimizer (doctor/own_code.py); the verdict
                         only where no rule above holds (else a further finding)
8. compute-bound (healthy), when none of the above holds; bf16 where the device has it, unless forward
                         and backward are too small a share of the step for it to gain gain_min
9. contended             other processes kept a significant share of our cores busy (or held our
                         GPU) while we measured (hardware.contention): the timings are partly the
                         neighbours', so no fix is proposed from a finding their load could have
                         produced (a fixed-cost share, a predicted micro-batch gain, workers racing
                         the step); the rules that held are still listed. A finding the load cannot
                         cause stands, labelled with how busy the machine was (`stands_under_load`):
                         the memory risks, a wait for data inside the training process's own loader
                         (no workers: a neighbour slows loading and computing alike), host syncs on
                         an accelerator (counted, not timed), a fixed-cost share on a CPU bounded
                         from the probe taken again on one thread (busy.py); and contended's own fix,
                         one thread, when measured faster under the load itself. (Our own loader
                         workers and torch threads oversubscribing a CPU run's cores is a note.)

Thresholds respect the noise. The timed steps are measured in windows (doctor.phase_windows), and a
timed figure (the wait for data, the device's idle time, the probe's fixed share) crosses its
threshold only when its whole range over the windows is past it; a range that holds the threshold
gives a note, "within noise of the threshold (x..y % vs z %)", no verdict and no fix (so two runs
of the same job do not flip between a verdict and compute-bound). A sync count crosses one per
step only when every counted step synced. The memory figures (1, 2, 6) are peaks and floors of
what was allocated, read by sampling rather than timed, and are compared as they are.

The memory risks (1, 2) win whenever they hold, then, on a busy machine, a finding that stands under load,
then contention. Otherwise, of the rules that hold, the verdict is the one whose best fix (keeping the
training the same) is predicted to gain the most, ties going to the order above: a tiny model at micro-batch
1 also waits a little for each of its many batches, but it is the per-micro-step cost, not the data, that a
fix removes. The other rules that hold are listed as further findings.

Predictions are labelled as such and say how they were made; a fix with no model behind it carries no number
("not predicted"). The types are in findings.py, the fix builders and their cost models in fixes.py.
"""

from __future__ import annotations

import math

from saturate.doctor.busy import (
    check_contention,
    compute_under_load,
    fixed_cost_line,
    fixed_share_read,
    from_one_thread,
    nothing_but_load,
    one_thread_line,
    stands_under_load,
    under_load,
)
from saturate.doctor.findings import (
    Diagnosis,
    Finding,
    Fix,
    Measurements,
    Prediction,
    sites_line,
)
from saturate.doctor.fixes import (
    best_gain,
    bf16_fix,
    divisors,
    gib,
    knob,
    micro_batch_fix,
    micro_cost,
    ms,
    pct,
    rank_fixes,
    step_at,
    worker_fix,
)
from saturate.doctor.own_code import check_own_code
from saturate.doctor.own_code import past as _past
from saturate.doctor.own_code import within_noise as _within_noise
from saturate.policy import POLICY


def _check_oom(m: Measurements) -> Finding | None:
    if not m.accelerator or not m.device_mem_total:
        return None
    share = (m.device_mem_peak or 0) / m.device_mem_total
    used = (m.device_mem_used_peak or 0) / m.device_mem_total
    if share < POLICY.doctor.oom_share and used < POLICY.doctor.oom_used_share:
        return None
    evidence = [f"device memory peak {gib(m.device_mem_peak)} reserved by this process = {pct(share)} of "
                f"{gib(m.device_mem_total)}"]
    if m.device_mem_used_peak is not None:
        evidence.append(f"all processes on the device: {gib(m.device_mem_used_peak)} at peak ({pct(used)})")
    fixes = []
    b, accum = m.micro_batch, m.grad_accum
    if b and accum and b > 1:
        effective = b * accum
        smaller = max(d for d in divisors(effective) if d <= b // 2) if b // 2 >= 1 else 1
        mem = m.scaling.memory_at(smaller) if m.scaling else None
        step = None
        basis = "not predicted: no batch-scaling probe"
        if m.scaling:
            step = step_at(m, m.scaling, smaller)
            basis = "linear fits of memory and time over the probed micro-batches"
        before = float(m.device_mem_peak or 0)
        fixes.append(Fix(f"micro-batch {b} → {smaller}, accumulation {accum} → {effective // smaller}",
                         {"micro_batch": smaller, "grad_accum": effective // smaller},
                         Prediction("device_bytes", before, mem, basis),
                         "halves the activations held at once; the effective batch is unchanged"
                         + (f" (predicted step time {ms(step)})" if step else "")))
    fixes.append(Fix("activation checkpointing", {"activation_checkpointing": True},
                     Prediction("device_bytes", float(m.device_mem_peak or 0), None, "not predicted: needs a trial"),
                     "recomputes each block's activations in backward: less memory for ~30 % more compute"))
    return Finding("oom-risk", evidence, fixes)


def _check_host_memory(m: Measurements) -> Finding | None:
    reasons = []
    if m.swap_bytes is not None and m.swap_bytes >= POLICY.doctor.swap_bytes:
        reasons.append(f"{m.swap_bytes / 1024**2:.0f} MiB swapped in and out during the run")
    if m.host_ram_total and m.host_ram_available_min is not None:
        free = m.host_ram_available_min / m.host_ram_total
        if free < POLICY.doctor.host_free_min:
            reasons.append(f"host RAM available fell to {gib(m.host_ram_available_min)} ({pct(free)} of "
                           f"{gib(m.host_ram_total)})")
    over_budget = (m.tree_peak is not None and m.host_budget is not None
                   and m.tree_peak > POLICY.doctor.budget_share * m.host_budget)
    if over_budget:
        reasons.append(f"the job's processes peaked at {gib(m.tree_peak)} ({m.memory_kind.upper()}) against a "
                       f"host-memory budget of {gib(m.host_budget)} ({m.host_budget_source})")
    if not reasons:
        return None
    evidence = list(reasons)
    if m.workers_seen and m.worker_peak is not None:
        evidence.append(f"{m.workers_seen} loader worker(s), the largest holding {gib(m.worker_peak)} of its own; "
                        f"the training process {gib(m.main_peak)}")
    fixes = []
    workers = m.num_workers or 0
    if workers > 1 and m.worker_peak and m.tree_peak is not None:
        target = POLICY.doctor.budget_share * m.host_budget if m.host_budget else 0.5 * m.tree_peak
        # What each worker holds of its own is what it adds; the rest of the tree stays. With no
        # workers the dataset's work moves into the training process, so fewer than one worker
        # saves nothing more: the floor is one.
        base = m.tree_peak - workers * m.worker_peak
        fit = max(1, min(workers - 1, math.floor((target - base) / m.worker_peak)))
        after = base + fit * m.worker_peak
        fixes.append(Fix(f"{knob(m, 'num_workers')} {workers} → {fit}", {"num_workers": fit},
                         Prediction("host_bytes", float(m.tree_peak), float(after),
                                    f"the job's memory less {workers - fit} × the largest worker's own memory "
                                    f"({gib(m.worker_peak)})"),
                         "each worker holds its own copy of what the dataset builds; fewer workers, less RAM"
                         + (" (the data wait may grow: --apply measures it)"
                            if m.share('data') > POLICY.doctor.data_wait_share else "")))
    fixes.append(Fix("keep the dataset's data in memory-mapped files (saturate's token shards do) instead of "
                     "per-process Python objects", {},
                     Prediction("host_bytes", float(m.tree_peak or 0), None, "not predicted: a code change"),
                     "pages of a memory-mapped file are shared by every worker; Python objects are copied on access"))
    return Finding("host-memory-bound", evidence, fixes)



def _check_input(m: Measurements) -> Finding | None:
    phases = ("data", "h2d") if m.accelerator else ("data",)  # a CPU "copy" is a no-op call
    low, high = m.share_range(*phases)
    threshold = POLICY.doctor.input_share
    if (past := _past(low, high, threshold)) is not True:
        return None if past is False else _within_noise("the wait for data", low, high, threshold, "input-bound")
    evidence = [f"{pct(m.share('data'))} of each step ({ms(m.phases.get('data', 0.0))} of {ms(m.step_s)}) "
                f"waiting for the next batch with {m.num_workers if m.num_workers is not None else '?'} loader workers"
                + (f" ({100 * low:.0f}..{100 * high:.0f} % over {len(m.window_shares)} timed windows)"
                   if len(m.window_shares) > 1 else "")]
    if m.accelerator and m.phases.get("h2d", 0.0) > 0:
        evidence.append(f"{pct(m.share('h2d'))} copying batches to the device")
    fixes = []
    if (fix := worker_fix(m)) is not None:
        fixes.append(fix)
    h2d = m.phases.get("h2d", 0.0)
    if m.device_type == "cuda" and h2d / m.step_s >= POLICY.doctor.h2d_share and not (m.pin_memory and m.non_blocking):
        fixes.append(Fix("pin_memory and non_blocking copies", {"pin_memory": True, "non_blocking": True},
                         Prediction("step_s", m.step_s, m.step_s - h2d,
                                    "upper bound: the copy overlaps compute entirely"),
                         "pinned host batches copy asynchronously, overlapping the previous step's compute"))
    if not fixes:
        fixes.append(Fix("make each sample cheaper to produce (pre-tokenise, cache, memory-map)", {},
                         Prediction("step_s", m.step_s, m.step_s - m.phases.get("data", 0.0),
                                    "upper bound: no wait for data at all"),
                         "the workers cannot be raised further on this machine"))
    return Finding("input-bound", evidence, fixes)


def _sync_where(m: Measurements) -> str:
    parts = [f"{v:g} in {k}" for k, v in sorted(m.syncs_by_phase.items(), key=lambda kv: -kv[1]) if v > 0]
    return ", ".join(parts)


def _sites(m: Measurements) -> str:
    return sites_line(m.syncs_by_site, seen=m.syncs_seen)


def _check_sync(m: Measurements) -> Finding | None:
    syncs = m.syncs_range()
    if syncs is None or syncs[1] < 1:
        return None
    where = _sync_where(m)
    at = f" at {_sites(m)}" if m.syncs_by_site else ""
    if not m.accelerator:
        return Finding("note", [
            f"{m.syncs_per_step:g} host read(s) of a tensor value per step ({where}){at}: free on a CPU, but each "
            "would make a GPU wait (read losses every N steps instead, as saturate's trainer does)"])
    idle_range = m.idle_range()
    if syncs[0] < 1:  # some counted steps read nothing: the count per step straddles one
        return Finding("note", [f"{syncs[0]:g}..{syncs[1]:g} host-device synchronisations per counted step "
                                f"({where}): not every step syncs, so synchronisation-bound is not called"])
    if idle_range is None or (past := _past(*idle_range, POLICY.doctor.idle_share)) is False:
        return None
    if past is None:
        return _within_noise("the device's idle time", *idle_range, POLICY.doctor.idle_share, "sync-bound")
    idle = 1 - (m.device_util.mean or 0) / 100
    evidence = [f"{m.syncs_per_step:g} host-device synchronisation(s) per step ({where}), counted with {m.sync_method}",
                f"the device was idle {pct(idle)} of the time (utilisation {m.device_util.mean:.0f} % mean over "
                f"{m.device_util.samples} samples)"]
    after = m.step_s * (1 - idle)
    basis = "upper bound: the step shrinks to the time the device was busy"
    fixes = []
    h2d_syncs = m.syncs_by_phase.get("h2d", 0)
    if h2d_syncs and not (m.pin_memory and m.non_blocking):
        fixes.append(Fix("pin_memory and non_blocking copies", {"pin_memory": True, "non_blocking": True},
                         Prediction("step_s", m.step_s, m.step_s * (1 - idle * h2d_syncs / m.syncs_per_step),
                                    basis + ", in proportion to the syncs removed"),
                         "a copy from pageable memory blocks the host until the device has drained its queue"))
    if m.syncs_by_phase.get("optimizer") and m.precision == "fp16" and m.supports_bf16:
        fixes.append(Fix("precision fp16 → bf16 (no GradScaler)", {"precision": "bf16"},
                         Prediction("step_s", m.step_s, None, "not predicted: needs a trial"),
                         "the GradScaler reads its overflow check every step; bf16 needs no scaler"))
    other = m.syncs_per_step - h2d_syncs
    if other >= 1:
        fixes.append(Fix("keep losses and metrics on the device; read them every N steps", {},
                         Prediction("step_s", m.step_s, after, basis),
                         "each .item()/float()/print of a device tensor stops the host until the device catches up"
                         + (f"; the reads are at {_sites(m)}" if m.syncs_by_site else "")))
    return Finding("sync-bound", evidence, fixes)


def _check_overhead(m: Measurements) -> Finding | None:
    probe = m.scaling
    if probe is not None and m.micro_batch:
        probe, low, high, how = fixed_share_read(m)  # on a busy CPU, maybe from the probe on one thread
        if high < POLICY.doctor.fixed_share:
            return None
        if low < POLICY.doctor.fixed_share:  # the threshold lies inside the measurement's spread: say so, call nothing
            return _within_noise(f"the fixed part of a micro-step (the batch-scaling probe's timings{how})", low,
                                 high, POLICY.doctor.fixed_share, "overhead-bound")
        evidence = [f"a micro-step costs {ms(probe.fixed_s)} whatever its size plus {ms(probe.per_sample_s)} per "
                    f"sample: at micro-batch {m.micro_batch} the fixed part is {pct(probe.fixed_share(m.micro_batch))}"
                    f" of it (measured at micro-batch {probe.micro_batches[0]} and {probe.micro_batches[1]}{how})"]
        evidence += [one_thread_line(m)] if how else []
    elif m.accelerator and (idle_range := m.idle_range()) is not None:
        idle = 1 - (m.device_util.mean or 0) / 100
        # Not when the data or a sync could be to blame (even only within the noise of their thresholds).
        if m.share_range("data", "h2d")[1] >= POLICY.doctor.input_share or (m.syncs_per_step or 0) >= 1:
            return None
        if (past := _past(*idle_range, POLICY.doctor.idle_no_probe)) is not True:
            return None if past is False else _within_noise("the device's idle time with no data wait or sync",
                                                            *idle_range, POLICY.doctor.idle_no_probe, "overhead-bound")
        evidence = [f"the device was idle {pct(idle)} of the time with no data wait and no sync to blame: the host "
                    "cannot launch work as fast as the device runs it"]
    else:
        return None
    fixes = []
    if probe is not None and (fix := micro_batch_fix(m, probe, "fewer, larger micro-steps pay the fixed cost "
                                                                "fewer times per optimizer step")) is not None:
        fixes.append(fix)
    if m.compile in (None, "none"):
        mode = "reduce-overhead" if m.device_type == "cuda" else "default"
        fixes.append(Fix(f"torch.compile (mode {mode})", {"compile": mode},
                         Prediction("step_s", m.step_s, None, "not predicted: needs a trial (--apply measures it)"),
                         "fuses small kernels" + (" and replays them as CUDA graphs" if mode == "reduce-overhead"
                                                  else "")))
    if probe is not None and (m.grad_accum or 1) == 1 and m.micro_batch:
        b = m.micro_batch
        big = 4 * b
        mem = probe.memory_at(big)
        fits = not m.accelerator or (mem is not None and m.device_mem_total is not None
                                     and mem <= POLICY.doctor.memory_target * m.device_mem_total)
        if fits:
            # One micro-step either way, of b samples now and 4b then; the optimizer step is unchanged.
            after = m.step_s - micro_cost(m, probe, b) + micro_cost(m, probe, big)
            fixes.append(Fix(f"a larger effective batch: micro-batch {b} → {big} (changes the optimisation; "
                             "learning rate scaled linearly)", {"micro_batch": big},
                             Prediction("sample_s", m.step_s / b, after / big, "seconds per sample, from the "
                                        "linear fit of forward+backward time over micro-batch size"),
                             "only if a larger batch suits the training: every micro-batch pays the fixed cost once",
                             same_training=False))
    return Finding("overhead-bound", evidence, from_one_thread(fixes, m))


def _check_memory_underused(m: Measurements) -> Finding | None:
    if not m.accelerator or not m.device_mem_total or m.device_mem_peak is None or m.scaling is None:
        return None
    share = m.device_mem_peak / m.device_mem_total
    if share >= POLICY.doctor.memory_low:
        return None
    fix = micro_batch_fix(m, m.scaling, "larger matrix multiplications use the device more efficiently")
    if fix is None or (fix.prediction.gain or 0) < POLICY.doctor.gain_min:
        return None
    evidence = [f"device memory peak {gib(m.device_mem_peak)} = {pct(share)} of {gib(m.device_mem_total)}",
                f"a larger micro-batch is predicted {fix.prediction.gain:.2f}× faster"]
    return Finding("device-memory-underused", evidence, [fix])


def _compute_bound(m: Measurements) -> Finding:
    low, high = m.share_range("data")
    evidence = [f"waiting for data {pct(m.share('data'))} of the step"
                + (f" ({100 * low:.0f}..{100 * high:.0f} % over {len(m.window_shares)} timed windows)"
                   if len(m.window_shares) > 1 else "")]
    if m.syncs_per_step is not None:
        evidence.append(f"{m.syncs_per_step:g} synchronisation(s) per step")
    if (line := fixed_cost_line(m)) is not None:
        evidence.append(line)
    if m.device_util.mean is not None:
        evidence.append(f"device utilisation {m.device_util.mean:.0f} % mean")
    fix, line = bf16_fix(m)
    if line is not None:
        evidence.append(line)
    return Finding("compute-bound", evidence, [fix] if fix is not None else [])


def decide(m: Measurements) -> Diagnosis:
    """One verdict from the measurements, with its evidence and fixes ranked by predicted gain."""
    checks = (_check_oom, _check_host_memory, _check_input, _check_sync, _check_overhead, _check_memory_underused,
              check_own_code, check_contention)
    findings = [f for check in checks if (f := check(m)) is not None]
    verdicts = [f for f in findings if f.verdict != "note"]
    notes = [f for f in findings if f.verdict == "note"]
    safety = [f for f in verdicts if f.verdict in ("oom-risk", "host-memory-bound")]
    contended = [f for f in verdicts if f.verdict == "contended"]
    if contended:  # on a busy machine only the findings the load cannot cause keep their fixes
        verdicts = [under_load(f, m) for f in verdicts]
        safety = [f for f in verdicts if f.verdict in ("oom-risk", "host-memory-bound")]
    standing = [f for f in verdicts if stands_under_load(f, m) is not None]  # contended: one thread, measured
    if contended and nothing_but_load(verdicts, notes, m):
        verdicts.append(compute_under_load(_compute_bound(m), m))
        standing.append(verdicts[-1])
    if safety:
        main = safety[0]
    elif contended and standing:
        order = {f.verdict: i for i, f in enumerate(standing)}
        main = max(standing, key=lambda f: (best_gain(f), -order[f.verdict]))
    elif contended:
        main = contended[0]
    elif verdicts:
        # the time outside the phases is the verdict only where nothing in them is (else listed beside it): its
        # bound counts all of that time, which a fix in the phases (a larger micro-batch) may also shrink
        ranked = [f for f in verdicts if f.verdict != "own-code-bound"] or verdicts
        order = {f.verdict: i for i, f in enumerate(ranked)}
        main = max(ranked, key=lambda f: (best_gain(f), -order[f.verdict]))
    else:
        main = _compute_bound(m)
    others = [f for f in verdicts if f is not main]
    fixes = rank_fixes(main.fixes)
    seen = {f.title for f in fixes}
    kept = [o for o in others if not contended or o in standing]  # busy: no fix from what the load could produce
    for f in rank_fixes([x for o in kept for x in o.fixes]):
        if f.title not in seen:
            fixes.append(f)
            seen.add(f.title)
    return Diagnosis(main.verdict, main.evidence, fixes, [main, *others, *notes], m)
