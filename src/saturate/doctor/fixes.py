"""The fixes the doctor's rules propose, with the models that predict what they gain.

The micro-batch fix rests on a cost model of one micro-step calibrated on the run itself (the
batch-scaling probe's linear fit of forward+backward, the loader's measured per-batch and
per-sample costs); the worker fix on the serial time to produce a step's batches, overlapped with
the rest of the step. The figure formatters here are shared with the rules' evidence.
"""

from __future__ import annotations

import math
from typing import Any

from saturate.doctor.findings import Finding, Fix, Measurements, Prediction, ScalingProbe
from saturate.policy import POLICY

_GIB = 1024**3
# Not a decision: two step times within this are one figure, so the smaller micro-batch keeps a float tie.
_TIE_S = 1e-12


def pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def gib(x: float | None) -> str:
    return "?" if x is None else f"{x / _GIB:.2f} GiB"


def ms(x: float) -> str:
    return f"{1000 * x:.1f} ms"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def knob(m: Measurements, field_name: str) -> str:
    """How a plan field is called where the user changes it."""
    if m.context == "loop":
        return {"micro_batch": "DataLoader batch_size", "num_workers": "DataLoader num_workers",
                "prefetch_factor": "DataLoader prefetch_factor", "pin_memory": "DataLoader pin_memory",
                "grad_accum": "accumulation steps", "precision": "precision", "non_blocking": ".to(non_blocking)",
                "compile": "torch.compile", "threads": "torch.set_num_threads"}.get(field_name, field_name)
    return f"plan.{field_name}"


def micro_cost(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """Predicted seconds of one micro-step of `b2` samples, by a model calibrated on this run.

    Forward+backward as timed in this run, scaled by the probe's fit T(b2)/T(b); the data wait
    split into the loader's per-batch cost and `item_s` per sample (without workers; with workers
    the wait per sample is kept); the copy per sample on an accelerator, per micro-step on the CPU
    (a no-op call there); "other" per micro-step. At b2 = b this is the measured micro-step.
    """
    b, accum = m.micro_batch or 1, m.grad_accum or 1
    fb = (m.phases.get("forward", 0.0) + m.phases.get("backward", 0.0)) / accum
    t_b = probe.time_at(b)
    fb2 = fb * probe.time_at(b2) / t_b if t_b > 0 else probe.time_at(b2)
    data = m.phases.get("data", 0.0) / accum
    if not m.num_workers and m.item_s is not None:
        data2 = max(0.0, data - m.item_s * b) + m.item_s * b2
    else:
        data2 = data * b2 / b
    h2d = m.phases.get("h2d", 0.0) / accum
    h2d2 = h2d * b2 / b if m.accelerator else h2d
    return fb2 + data2 + h2d2 + m.phases.get("other", 0.0) / accum


def _micro_step_model(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """Predicted seconds per optimizer step at micro-batch `b2`, the effective batch kept."""
    effective = (m.micro_batch or 1) * (m.grad_accum or 1)
    return m.phases.get("optimizer", 0.0) + (effective // b2) * micro_cost(m, probe, b2)


def step_at(m: Measurements, probe: ScalingProbe, b2: int) -> float:
    """The measured step time moved by the model's difference between micro-batch b2 and the current one."""
    return m.step_s - _micro_step_model(m, probe, m.micro_batch or 1) + _micro_step_model(m, probe, b2)


def micro_batch_fix(m: Measurements, probe: ScalingProbe, why: str) -> Fix | None:
    """The best larger micro-batch at the same effective batch, if the probe predicts a gain."""
    b, accum = m.micro_batch, m.grad_accum
    if not b or not accum or accum <= 1:
        return None
    effective = b * accum
    best: tuple[float, int] | None = None
    for b2 in divisors(effective):
        if b2 <= b:
            continue
        if m.accelerator:
            mem = probe.memory_at(b2)
            if mem is None or m.device_mem_total is None or mem > POLICY.doctor.memory_target * m.device_mem_total:
                continue
        step = step_at(m, probe, b2)
        if best is None or step < best[0] - _TIE_S:
            best = (step, b2)
    if best is None or best[0] >= m.step_s:
        return None
    step, b2 = best
    mem_note = ""
    if m.accelerator and (mem := probe.memory_at(b2)) is not None:
        mem_note = f"; predicted device memory {gib(mem)} of {gib(m.device_mem_total)}"
    item = (f", {1e6 * m.item_s:.0f} µs to read and collate a sample" if m.item_s is not None and not m.num_workers
            else "")
    basis = (f"forward+backward as timed, scaled by a fit over micro-batch {probe.micro_batches[0]} and "
             f"{probe.micro_batches[1]} ({ms(probe.fixed_s)} fixed + {ms(probe.per_sample_s)} per sample); the "
             f"loader, copy and other costs per micro-step as measured{item}{mem_note}")
    return Fix(f"micro-batch {b} → {b2}, accumulation {accum} → {effective // b2} (same effective batch)",
               {"micro_batch": b2, "grad_accum": effective // b2},
               Prediction("step_s", m.step_s, step, basis), why)


def worker_fix(m: Measurements) -> Fix | None:
    """More loader workers, with the step time they are predicted to give."""
    data = m.phases.get("data", 0.0)
    rest = m.step_s - data
    workers = m.num_workers or 0
    if data <= 0 or rest <= 0:
        return None
    # The serial time to produce one step's batches: the whole wait without workers; with W
    # workers keeping up at the limit, wait ≈ P/W - rest, so P ≈ W·(wait + rest).
    production = data if workers == 0 else workers * (data + rest)
    cpu_bound = m.data_cpu_share is not None and m.data_cpu_share >= POLICY.doctor.cpu_bound_share
    cores = max(1, m.cpu_cores)
    if not m.accelerator:
        cap = cores  # training on the CPU: more workers than cores only fight the training for them
    elif cpu_bound:
        cap = max(1, cores - 1)  # one core keeps launching the GPU's work
    else:
        cap = max(2 * cores, 8)  # waiting on I/O, not CPU: workers can outnumber cores

    def predicted(w: int) -> float:
        usable = min(w, cap)
        if not m.accelerator and cpu_bound:
            # The training itself keeps the cores busy: workers share them, so their CPU time adds up.
            return max(rest + production / cores, production / usable)
        return max(rest, production / usable)

    best = None
    for w in range(workers + 1, cap + 1):
        best = w
        if production / min(w, cap) <= POLICY.doctor.worker_headroom * rest:
            break
    if best is None:
        return None
    after = predicted(best)
    if after >= m.step_s:
        return None
    kind = "CPU-bound" if cpu_bound else ("not CPU-bound" if m.data_cpu_share is not None else "of unknown CPU use")
    share = f", {pct(m.data_cpu_share)} CPU while waiting" if m.data_cpu_share is not None else ""
    basis = (f"one step's batches take {ms(production)} to produce ({kind}{share}); {best} workers "
             f"overlap that with the other {ms(rest)} of the step")
    if not m.accelerator and cpu_bound:
        basis += f", sharing {cores} cores with the training"
    changes: dict[str, Any] = {"num_workers": best}
    if m.context == "plan":
        changes.update(prefetch_factor=2, persistent_workers=True)
    return Fix(f"{knob(m, 'num_workers')} {workers} → {best}", changes, Prediction("step_s", m.step_s, after, basis),
               "batches are then produced in parallel while the model trains")


def bf16_fix(m: Measurements) -> tuple[Fix | None, str | None]:
    """bf16 autocast for an fp32 step on a device with native bf16, and an evidence line on how much of the step it
    can reach. A faster precision speeds forward and backward only, so the step gains at most 1 / (1 − their share)
    even if they took no time (the share's highest window, the cautious side). Below POLICY.doctor.gain_min it is not
    proposed: the time is elsewhere. Without forward/backward phases (not hooked) the bound is unknown and the fix
    stands."""
    if m.precision != "fp32" or not m.supports_bf16:
        return None, None
    title, basis = "precision fp32 → bf16 autocast", "not predicted: needs a trial (--apply measures it)"
    why = "the device has native bf16 matrix units; the loss is then compared against fp32"
    if m.phases.get("forward", 0.0) + m.phases.get("backward", 0.0) <= 0:
        return Fix(title, {"precision": "bf16"}, Prediction("step_s", m.step_s, None, basis), why), None
    share = m.share_range("forward", "backward")[1]
    ceiling = 1 / (1 - share) if share < 1 else math.inf
    line = f"forward and backward {pct(m.share('forward', 'backward'))} of the step"
    if ceiling < POLICY.doctor.gain_min:
        return None, (f"{line}: a faster precision could make the step at most {ceiling:.2f}× faster, so bf16 is "
                      "not proposed")
    if math.isfinite(ceiling):
        basis += f"; at most {ceiling:.2f}×, were forward and backward to take no time"
    return Fix(title, {"precision": "bf16"}, Prediction("step_s", m.step_s, None, basis), why), line


def rank_fixes(fixes: list[Fix]) -> list[Fix]:
    """Fixes by predicted gain, most first; those not predicted last."""

    def key(f: Fix) -> tuple[int, float]:
        gain = f.prediction.gain
        return (0, -gain) if gain is not None else (1, 0.0)

    return sorted(fixes, key=key)


def best_gain(f: Finding) -> float:
    """The largest predicted step-time gain among a finding's fixes that keep the training the same (1 when none)."""
    gains = [x.prediction.gain for x in f.fixes
             if x.same_training and x.prediction.metric == "step_s" and x.prediction.gain is not None]
    return max(gains, default=1.0)
