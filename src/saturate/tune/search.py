"""The search: which plan is fastest, decided by measurement, one knob family at a time.

Order: precision (with a loss check against fp32) -> memory fit -> micro-batch (hill climb over
the micro-batches that keep the effective batch exact) -> activation checkpointing (only when
memory stopped the climb) -> DDP or FSDP2 (under torchrun) -> fused optimizer -> torch.compile
(only when it pays back its compile time within the planned run) -> input pipeline (cheapest
loader that comfortably outruns the model within the host-RAM budget) -> verification with real
training and validation steps.

Everything here talks to a `Measurer`, so the logic is tested with a deterministic fake. A plan is
only ever reported with figures from a trial that ran it; predictions are labelled.

Over 400 lines because `_Search` is one algorithm, its stages reading and narrowing the same
state (the best trial, the memory fit, the budget) in order; split up, each stage would lose sight
of the others. Its settings and result types are in results.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from saturate.errors import ConfigError, SaturateError
from saturate.plan import Plan
from saturate.tune.decide import check_verification, compare, keep_candidate
from saturate.tune.noise import rate_text
from saturate.tune.results import MemoryFit, SearchResult, SearchSettings, fit_memory
from saturate.tune.trial import OVER_BUDGET, BudgetTooSmall, LoaderTrial, Measurer, Trial


def search(measurer: Measurer, base: Plan, s: SearchSettings,
           on_trial: Callable[[Trial | LoaderTrial], None] | None = None, started: float | None = None) -> SearchResult:
    """Run every stage; `on_trial` sees each trial as it finishes (for progress lines). The budget counts from
    `started` (a time.monotonic() reading; default: now), so time spent before the search counts too."""
    return _Search(measurer, base, s, on_trial, started).run()


def _rate(t: Trial) -> str:
    return rate_text(t.samples_per_s, t.spread)


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


class _Search:
    def __init__(self, measurer: Measurer, base: Plan, s: SearchSettings,
                 on_trial: Callable[[Trial | LoaderTrial], None] | None = None, started: float | None = None) -> None:
        self.on_trial = on_trial or (lambda t: None)
        if s.effective_batch % s.world_size:
            raise ConfigError(f"effective batch {s.effective_batch} is not divisible by {s.world_size} processes")
        self.m, self.base, self.s = measurer, base, s
        self.local = s.effective_batch // s.world_size
        self.trials: list[Trial] = []
        self.loader_trials: list[LoaderTrial] = []
        self.decisions: list[str] = []
        self.skipped: list[str] = []
        self.warnings: list[str] = []  # what the user must know about the result (an inconsistent verification)
        self.started = time.monotonic() if started is None else started
        self.budget_spent = False  # a trial stopped after its first step: it would have ended past the budget
        self.all_agree: Callable[[bool], bool] = getattr(measurer, "all_agree", lambda flag: flag)
        self.discard_compiled: Callable[[], None] = getattr(measurer, "discard_compiled", lambda: None)

    # --- helpers --------------------------------------------------------------------------------

    def candidates(self) -> list[int]:
        """Micro-batches that keep the effective batch exact (and larger ones when it may grow)."""
        if self.s.fixed_micro_batch:  # batch-coupled layers (workloads/coupling.py): not searched
            return [self.s.fixed_micro_batch]
        out = [d for d in range(1, self.local + 1) if self.local % d == 0]
        if self.s.allow_batch_change:
            out += [self.local * k for k in (2, 4, 8)]
        return out

    def at(self, plan: Plan, micro: int) -> Plan:
        return plan.replace(micro_batch=micro, grad_accum=max(1, self.local // micro))

    def remaining(self) -> float | None:
        budget = self.s.search_budget()
        return None if budget is None else budget - (time.monotonic() - self.started)

    def longest(self) -> float:
        """The longest model trial so far: the prediction for the next one."""
        return max((t.seconds for t in self.trials), default=0.0)

    def verifying(self) -> float:
        """The time kept for the verification: a quarter more than the longest model trial (it adds the real
        loader and a validation pass)."""
        return 1.25 * self.longest()

    def affordable(self, what: str, loader: bool = False) -> bool:
        """Whether the budget still holds one more trial as long as the longest of its kind so far, and
        then the verification (predicted as long as the longest model trial)."""
        left = self.remaining()
        if left is None:
            return True
        need = max((t.seconds for t in self.loader_trials), default=0.0) if loader else self.longest()
        # Several processes: each rank's clock decides, and all must take the same branch.
        if self.all_agree(not self.budget_spent and left >= need + self.verifying()):
            return True
        self.skipped.append(f"{what}: not tried, the budget had {max(left, 0):.0f} s left; a trial takes up to "
                            f"{need:.0f} s and verifying the plan ~{self.verifying():.0f} s (predicted from the "
                            "trials)")
        return False

    def deadline(self) -> float | None:
        """When a model trial must end (time.monotonic()): the budget's end less the time kept for verification;
        before any trial, half the budget (the verification will take about as long as the first trial)."""
        budget = self.s.search_budget()
        if budget is None:
            return None
        return self.started + (budget - self.verifying() if self.trials else budget / 2)

    def trial(self, plan: Plan, stage: str, **kw: Any) -> Trial:
        if hasattr(self.m, "deadline"):  # the measurer stops a trial whose first step predicts an overrun
            self.m.deadline = self.deadline()
        t = self.m.model_trial(plan, stage, **kw)
        self.trials.append(t)
        self.on_trial(t)
        if t.status == OVER_BUDGET:
            self.budget_spent = True
        nothing = not any(x.ok for x in self.trials)  # no plan measured yet: nothing to choose from
        if self.s.budget_s is not None and ((t.status == OVER_BUDGET and nothing)
                                            or (len(self.trials) == 1 and t.seconds > self.s.budget_s)):
            why = (f"{t.error}, with the verification (about as long) still to come" if t.status == OVER_BUDGET
                   else f"alone took {t.seconds:.1f} s")
            raise BudgetTooSmall(f"tuning budget {self.s.budget_s:g} s is too small: the first trial (micro-batch "
                                 f"{plan.micro_batch}, {plan.precision}) {why}; give --budget "
                                 f"{max(60, int(10 * t.seconds))} or more")
        return t

    # --- the stages -----------------------------------------------------------------------------

    def run(self) -> SearchResult:
        best = self.precision()
        fit = self.memory(best)
        best = self.micro_batch(best, fit)
        best = self.activation_checkpointing(best, fit)
        best = self.strategy(best)
        best = self.fused(best)
        best = self.compile(best)
        plan = self.loader(best)
        chosen = self.consistent(self.verify(plan), best)
        effective = chosen.plan.samples_per_step(self.s.world_size)
        if effective != self.s.effective_batch:
            self.decisions.append(f"effective batch: {self.s.effective_batch} -> {effective} (allowed); training "
                                  "rescales the learning rate linearly")
        return SearchResult(plan=chosen.plan, trials=self.trials, loader_trials=self.loader_trials, fit=fit,
                            decisions=self.decisions, seconds=time.monotonic() - self.started, chosen=chosen,
                            skipped=self.skipped, warnings=self.warnings)

    def precision(self) -> Trial:
        s = self.s
        m0 = max(m for m in self.candidates() if m <= max(1, min(s.probe_micro, self.local)))
        ref_plan = self.at(self.base, m0).replace(precision="fp32", tf32=False, compile="none",
                                                   activation_checkpointing=False, fused_optimizer=False)
        ref = self.trial(ref_plan, "precision")
        smaller = [m for m in self.candidates() if m < m0]
        while ref.status == "oom" and smaller:  # even the probe micro-batch does not fit: back off
            ref.verdict = "out of memory"
            ref = self.trial(self.at(ref_plan, smaller.pop()), "precision")
        if ref.status == "oom":
            ref.verdict = "out of memory"
            ref = self.trial(ref.plan.replace(activation_checkpointing=True), "precision")
            if ref.status == "oom":
                ref.verdict = "out of memory"
                fsdp = (" or shard it over the processes with strategy = \"fsdp\" (and cpu_offload) in the plan"
                        if ref.plan.strategy == "ddp" else "")
                raise SaturateError("the model does not fit at micro-batch 1, even with activation checkpointing "
                                    f"(tried {len(self.trials)} trials; last error: {ref.error}); use a device with "
                                    f"more memory or a smaller model{fsdp}")
            self.decisions.append("activation checkpointing: on, because the model does not fit at micro-batch 1 "
                                  "without it")
        if not ref.ok:
            raise SaturateError(f"the workload fails to train at fp32, micro-batch {ref.plan.micro_batch}: {ref.error}")

        options = []
        if s.supports.get("bf16"):
            options.append(ref.plan.replace(precision="bf16", tf32=bool(s.supports.get("tf32"))))
        elif s.supports.get("fp16") and self.m.device_type == "cuda":
            options.append(ref.plan.replace(precision="fp16", tf32=bool(s.supports.get("tf32"))))
        if s.supports.get("tf32") and self.m.device_type == "cuda":
            options.append(ref.plan.replace(tf32=True))
        best = ref
        for plan in options:
            label = _precision_label(plan)
            if not self.affordable(f"precision {label}"):
                break
            t = self.trial(plan, "precision")
            if not t.ok:
                t.verdict = f"{t.status}: {t.error}"
                continue
            drift = loss_drift(t.losses, ref.losses)
            if drift > s.loss_tolerance:
                t.verdict = f"losses differ from fp32 by up to {100 * drift:.1f} % (> {100 * s.loss_tolerance:.0f} %)"
                self.decisions.append(f"precision: {label} rejected, its first {len(t.losses)} losses differ from "
                                      f"fp32 by up to {100 * drift:.1f} %")
                continue
            t.loss_drift = drift
            take, c = keep_candidate(t, best, s.min_gain)
            if take:
                best.verdict = f"{label}: {c.text()}" + ("" if c.faster else ", the simpler is kept")
                best = t
            else:
                t.verdict = f"{c.text()} vs {_precision_label(best.plan)}" + ("" if c.slower else
                                                                              ", the simpler is kept")
        if best is ref:
            why = ("no lower precision is native here" if not options else
                   "; ".join(f"{_precision_label(t.plan)} {t.verdict}" for t in self.trials[-len(options):]
                             if t.ok and t.samples_per_s))
            self.decisions.append(f"precision: fp32 ({why or 'no lower precision could be used'}; "
                                  f"{ref.samples_per_s:.1f} samples/s at micro-batch {ref.plan.micro_batch})")
        else:
            drift = best.loss_drift or 0.0
            self.decisions.append(
                f"precision: {_precision_label(best.plan)}, {best.samples_per_s / ref.samples_per_s:.2f}× fp32 "
                f"samples/s at micro-batch {best.plan.micro_batch} ({compare(best, ref, s.min_gain).text()}); its "
                f"first {len(best.losses)} losses are within {100 * drift:.2f} % of fp32's")
        return best

    def memory(self, best: Trial) -> MemoryFit | None:
        """Peak memory at two or three small micro-batches, fitted with a line."""
        cands = self.candidates()
        want = [m for m in cands if m < best.plan.micro_batch][:2]
        if len(want) < 2:
            want += [m for m in cands if m > best.plan.micro_batch][: 2 - len(want)]
        points = [(best.plan.micro_batch, best.peak_memory_bytes)] if best.peak_memory_bytes is not None else []
        for m in want:
            if not self.affordable(f"memory at micro-batch {m}"):
                break
            t = self.trial(self.at(best.plan, m), "memory", steps=1)
            if t.peak_memory_bytes is not None and t.ok:
                points.append((m, t.peak_memory_bytes))
                t.verdict = "memory point"
            else:
                t.verdict = f"{t.status}: {t.error}"
        points.sort()
        if len(points) < 2:
            self.skipped.append("memory fit: fewer than two measured points")
            return None
        fit = fit_memory(points, self.m.memory_capacity, self.s.headroom, self.m.memory_kind)
        if fit.slope <= 0:
            self.decisions.append(f"memory: peak {self.m.memory_kind} memory did not grow with the micro-batch "
                                  f"({', '.join(f'{m}: {_gib(b)}' for m, b in points)}); no limit predicted")
        else:
            top = max((m for m in cands if fit.fits(m)), default=None)
            self.decisions.append(
                f"memory: measured {', '.join(f'{m} -> {_gib(b)}' for m, b in points)}; fit {_gib(fit.intercept)} + "
                f"{_gib(fit.slope)} per sample; limit {_gib(fit.limit)} ({100 * self.s.headroom:.0f} % of "
                f"{_gib(fit.capacity)}); largest micro-batch predicted to fit: {top} (a prediction)")
        return fit

    def micro_batch(self, best: Trial, fit: MemoryFit | None) -> Trial:
        cands = self.candidates()
        m0 = best.plan.micro_batch
        too_big = [m for m in cands if fit is not None and not fit.fits(m)]
        for m in too_big:
            self.skipped.append(f"micro-batch {m}: not tried, predicted {_gib(fit.predict(m))} > "
                                f"limit {_gib(fit.limit)}")
        fitting = [m for m in cands if m not in too_big]
        self.memory_capped = bool(too_big)
        stop = ""
        for m in [c for c in fitting if c > m0]:
            if not self.affordable(f"micro-batch {m}"):
                stop = "the tuning budget ran out"
                break
            t = self.trial(self.at(best.plan, m), "micro-batch")
            if not t.ok:
                t.verdict = f"{t.status}: {t.error}"
                self.memory_capped = self.memory_capped or t.status == "oom"
                stop = f"{m} ran out of memory" if t.status == "oom" else f"{m}: {t.status}"
                break
            c = compare(t, best, self.s.min_gain)
            if c.faster:
                best.verdict = f"{m}: {c.text()}"
                best = t
                continue
            t.verdict = f"{c.text()} vs {best.plan.micro_batch}: not enough to grow"
            stop = f"{m} measured {c.text()}"
            self.memory_capped = False
            break
        else:
            stop = "the largest micro-batch that fits" if self.memory_capped else "the largest candidate"
        if best.plan.micro_batch == m0:  # nothing above helped: try below
            for m in reversed([c for c in fitting if c < m0]):
                if not self.affordable(f"micro-batch {m}"):
                    break
                t = self.trial(self.at(best.plan, m), "micro-batch")
                c = compare(t, best, self.s.min_gain) if t.ok else None
                if c is not None and c.faster:
                    best.verdict = f"{m}: {c.text()}"
                    best = t
                    continue
                t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()} vs {best.plan.micro_batch}"
                break
        p = best.plan
        self.decisions.append(f"micro-batch: {p.micro_batch} × {p.grad_accum} accumulation "
                              f"({_rate(best)} measured; stopped because {stop})")
        return best

    def activation_checkpointing(self, best: Trial, fit: MemoryFit | None) -> Trial:
        if best.plan.activation_checkpointing:
            return best  # forced on by the precision stage: the model does not fit without it
        bigger = [m for m in self.candidates() if m > best.plan.micro_batch]
        if not (self.memory_capped and bigger):
            self.decisions.append("activation checkpointing: off (the micro-batch search was not limited by memory)")
            return best
        start = best
        for m in bigger:
            if not self.affordable(f"activation checkpointing at micro-batch {m}"):
                break
            t = self.trial(self.at(best.plan, m).replace(activation_checkpointing=True), "activation-checkpointing")
            c = compare(t, best, self.s.min_gain) if t.ok else None
            if c is not None and c.faster:
                best.verdict = f"checkpointing at {m}: {c.text()}"
                best = t
                continue
            t.verdict = f"{t.status}: {t.error}" if c is None else c.text()
            break
        if best is start:
            self.decisions.append("activation checkpointing: off (tried; larger micro-batches with recompute "
                                  f"measured no faster: {t.verdict})")
        else:
            self.decisions.append(f"activation checkpointing: on, micro-batch {best.plan.micro_batch} with recompute "
                                  f"is {compare(best, start, self.s.min_gain).text()} vs {start.plan.micro_batch} "
                                  "without")
        return best

    def strategy(self, best: Trial) -> Trial:
        """Several processes: DDP (replicas) against FSDP2 (shards) at the chosen micro-batch, the faster wins.

        FSDP is tried only where DDP already ran: sharding needs less memory than replicas, and an FSDP
        trial that ran out of memory could not be recovered in lock-step (its gathers are collectives).
        """
        if best.plan.strategy != "ddp":
            return best
        if not self.affordable("FSDP"):
            return best
        t = self.trial(best.plan.replace(strategy="fsdp"), "strategy")
        c = compare(t, best, self.s.min_gain) if t.ok else None
        if c is not None and c.faster:
            best.verdict = f"FSDP: {c.text()}"
            self.decisions.append(f"strategy: FSDP2 ({c.text()} samples/s per process vs DDP at micro-batch "
                                  f"{t.plan.micro_batch})")
            return t
        t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()} vs DDP"
        self.decisions.append(f"strategy: DDP (FSDP2 measured {t.verdict})")
        return best

    def fused(self, best: Trial) -> Trial:
        if not self.s.fused_available:
            self.decisions.append(f"fused optimizer: off (no fused AdamW on {self.m.device_type})")
            return best
        if not self.affordable("fused optimizer"):
            return best
        t = self.trial(best.plan.replace(fused_optimizer=True), "fused-optimizer")
        c = compare(t, best, self.s.min_gain) if t.ok else None
        if c is not None and c.faster:
            best.verdict = f"fused: {c.text()}"
            self.decisions.append(f"fused optimizer: on ({c.text()} samples/s)")
            return t
        t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()}; unfused is simpler"
        self.decisions.append(f"fused optimizer: off ({t.verdict})")
        return best

    def compile(self, best: Trial) -> Trial:
        s = self.s
        if not s.try_compile:
            self.skipped.append("torch.compile: not tried (turned off)")
            return best
        # The most compile could save: the planned run at `compile_speedup_bound`× speed. A compile that takes
        # longer than that cannot pay back, so it is the trial's time limit: the compilation is stopped there.
        limit = s.planned_steps * best.step_s * (1 - 1 / s.compile_speedup_bound)
        left = self.remaining()
        if left is not None:  # the compilation, then a trial's steps, then the verification
            limit = min(limit, left - self.longest() - self.verifying())
        if not self.affordable("torch.compile"):
            return best
        if limit <= 0:
            self.skipped.append(f"torch.compile: not tried, the budget had {max(left or 0, 0):.0f} s left")
            return best
        t = self.trial(best.plan.replace(compile=s.compile_mode), "compile", compile_limit_s=limit)
        # A stopped or failed trial was discarded by the measurer; a rejected one is discarded below.
        if t.status == OVER_BUDGET:
            t.verdict = f"{t.status}: {t.error}"
            self.decisions.append(f"compile: none (the tuning budget ran out: {t.error})")
            return best
        if t.status == "timeout":
            t.verdict = f"{t.error}: a longer compilation cannot pay back over {s.planned_steps} steps"
            self.decisions.append(f"compile: none ({t.verdict})")
            return best
        if not t.ok:
            t.verdict = f"{t.status}: {t.error}"
            self.decisions.append(f"compile: none (torch.compile failed: {t.error}; eager is used)")
            return best
        saved = s.planned_steps * (best.step_s - t.step_s)
        c = compare(t, best, s.min_gain)
        # `limit` may hold each rank's own clock (the budget left): all ranks must reach one verdict.
        if not self.all_agree(t.compile_s is None or t.compile_s <= limit):
            t.verdict = f"compiling took {t.compile_s:.1f} s, over the {limit:.1f} s limit"
        elif not c.faster:
            t.verdict = f"{c.text()} steady state; eager is simpler"
        elif saved <= (t.compile_s or 0.0):
            t.verdict = (f"{c.text()} steady state; over {s.planned_steps} steps "
                         f"saves {saved:.1f} s < {t.compile_s or 0:.1f} s to compile")
        else:
            best.verdict = f"compiled saves {saved:.0f} s over the run"
            self.decisions.append(f"compile: {s.compile_mode} ({c.text()} steady "
                                  f"state; saves ~{saved:.0f} s over {s.planned_steps} steps against "
                                  f"{t.compile_s or 0:.1f} s to compile — a prediction from the trial)")
            return t
        self.decisions.append(f"compile: none ({t.verdict})")
        self.discard_compiled()  # every rank reached this verdict: all discard alike
        return best

    def loader(self, best: Trial) -> Plan:
        """The cheapest loader setting that feeds `loader_margin`× the model's rate within the RAM budget."""
        s, m = self.s, self.m
        need = s.loader_margin * best.samples_per_s
        ladder = sorted({0, *[w for w in (1, 2, 4, 8, 16, 32) if w <= m.cores], m.cores})
        cuda = m.device_type == "cuda"
        base = best.plan.replace(pin_memory=False, non_blocking=False, persistent_workers=False,
                                 prefetch_factor=None)

        def setting(w: int, pf: int | None, pin: bool) -> Plan:
            return base.replace(num_workers=w, prefetch_factor=pf if w else None, persistent_workers=w > 0,
                                pin_memory=pin, non_blocking=pin)

        def refused(t: LoaderTrial) -> str:
            """Why a setting is out of bounds whatever its speed ("" when it is within them)."""
            if not t.ok:
                return f"{t.status}: {t.error}"
            if t.worker_memory_bytes and t.worker_memory_bytes > m.ram_budget:
                return f"workers use {_gib(t.worker_memory_bytes)} > RAM budget {_gib(m.ram_budget)}"
            if t.swap_grew_bytes > 0:
                return f"swap grew by {_gib(t.swap_grew_bytes)}"
            return ""

        def slow(t: LoaderTrial) -> str:
            return f"{t.samples_per_s:.0f} samples/s < {need:.0f} needed" if (t.samples_per_s or 0) < need else ""

        measured: list[tuple[Plan, LoaderTrial]] = []

        def measure(plan: Plan) -> LoaderTrial:
            t = m.loader_trial(plan)
            self.loader_trials.append(t)
            self.on_trial(t)
            measured.append((plan, t))
            return t

        for w in ladder:  # the whole worker ladder at the default prefetch: it is cheap and plotted
            if not self.affordable(f"loader with {w} workers", loader=True):
                break
            measure(setting(w, 2, False))
        for p, t in list(measured):  # deeper prefetch only where the default did not feed the model
            if p.num_workers and not refused(t) and slow(t) and self.affordable(f"loader prefetch 4, {p.num_workers}",
                                                                                          loader=True):
                measure(setting(p.num_workers, 4, False))
        within = [(p, t) for p, t in measured if not refused(t)]
        feeding = [(p, t) for p, t in within if not slow(t)]
        ct: LoaderTrial | None
        if feeding:
            chosen, ct = min(feeding, key=lambda pt: (pt[0].num_workers, pt[0].prefetch_factor or 0))
            why = (f"{ct.samples_per_s:.0f} samples/s alone, ≥ {s.loader_margin:g}× the model's "
                   f"{best.samples_per_s:.0f}; the cheapest setting that does")
        elif within:
            chosen, ct = max(within, key=lambda pt: pt[1].samples_per_s or 0)
            why = (f"the fastest within the RAM budget, {ct.samples_per_s:.0f} samples/s, under the "
                   f"{need:.0f} wanted: this run will be input-bound")
        elif not measured:
            chosen, ct = setting(0, None, False), None
            why = "not measured: the tuning budget ran out first; loading in the training process"
        else:
            chosen, ct = setting(0, None, False), None
            why = "no loader setting could be measured within the RAM budget; loading in the training process"
        for _p, t in measured:
            t.verdict = "chosen" if t is ct else (refused(t) or slow(t) or "costlier than the chosen setting")
        if cuda and ct is not None and self.affordable("pinned memory", loader=True):
            pinned_plan = setting(chosen.num_workers, chosen.prefetch_factor, True)
            pt = measure(pinned_plan)
            if not refused(pt) and not slow(pt):
                pt.verdict = "chosen: pinned batches let the copy to the GPU overlap compute"
                ct.verdict = "pinned is preferred when it still feeds the model"
                chosen = pinned_plan
            else:
                pt.verdict = refused(pt) or slow(pt)
        self.decisions.append(f"loader: {chosen.num_workers} workers, prefetch {chosen.prefetch_factor or '-'}, "
                              f"pinned {'yes' if chosen.pin_memory else 'no'} ({why})")
        return chosen

    def verify(self, plan: Plan) -> Trial:
        """Real steps through the real loader plus validation; back off on OOM."""
        smaller = [m for m in self.candidates() if m < plan.micro_batch]
        while True:
            t = self.m.verify(plan)
            self.trials.append(t)
            self.on_trial(t)
            if t.ok:
                return t
            if t.status != "oom" or not smaller:
                raise SaturateError(f"the tuned plan failed its verification run ({t.error}); tried "
                                    f"{len(self.trials)} trials, none written")
            t.verdict = f"out of memory: {t.error}; backing off"
            self.decisions.append(f"verification: micro-batch {plan.micro_batch} ran out of memory with the real "
                                  f"loader and validation; backed off to {smaller[-1]}")
            plan = self.at(plan, smaller.pop())


    def consistent(self, chosen: Trial, model: Trial) -> Trial:
        """The verification against the chosen plan's own model trial (decide.check_verification)."""
        def again(plan: Plan) -> Trial | None:
            if not self.affordable("re-measuring the verification"):
                return None
            t = self.m.verify(plan)
            self.trials.append(t)
            self.on_trial(t)
            return t

        chosen, warning = check_verification(chosen, model, self.s.verify_tolerance, again)
        if warning:
            self.decisions.append(f"verification: {warning}")
            self.warnings.append(warning)
        return chosen


def _precision_label(plan: Plan) -> str:
    if plan.precision == "fp32":
        return "fp32+tf32" if plan.tf32 else "fp32"
    return plan.precision


def loss_drift(losses: list[float], reference: list[float]) -> float:
    """Largest per-step difference between two loss curves, as a share of the loss's scale.

    The scale at a step is the larger of the reference's loss there and its first loss: early on
    this is the relative difference, and once the loss has fallen near zero (a ResNet at ~0.1 from
    2.3) a difference of 0.04 counts as 0.04 / 2.3 = 1.7 %, not as 40 % of a tiny number — both
    runs learned the same thing. A lower precision that diverges (its loss stops falling or grows)
    differs by a large share of the first loss and is still caught; a non-finite loss is infinite.
    """
    n = min(len(losses), len(reference))
    if n == 0:
        return float("inf")
    if not all(math.isfinite(x) for x in losses[:n]):
        return float("inf")
    first = abs(reference[0])
    return max(abs(a - b) / max(abs(b), first, 1e-8) for a, b in zip(losses[:n], reference[:n], strict=True))
