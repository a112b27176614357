"""The search: which plan is fastest, decided by measurement, one knob family at a time.

Order: precision (with a loss check against fp32) -> memory fit -> micro-batch (hill climb over
the micro-batches that keep the effective batch exact) -> activation checkpointing (only when
memory stopped the climb) -> DDP or FSDP2 (under torchrun) -> fused optimizer -> torch.compile
(only when it pays back its compile time within the planned run) -> input pipeline (cheapest
loader that feeds the model beyond the noise, within the host-RAM budget) -> verification with
real training and validation steps (left to the caller when it measures the plan again anyway:
`SearchSettings.verify`).

Everything here talks to a `Measurer`, so the logic is tested with a deterministic fake. A plan is
only ever reported with figures from a trial that ran it; predictions are labelled. The state the
stages share and the budget are in state.py; the batch-sizing stages in batch.py, the loader's in
loader_stage.py; the settings and result types in results.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from saturate.errors import SaturateError
from saturate.plan import Plan
from saturate.stats.comparison import compare
from saturate.tune import batch
from saturate.tune.decide import check_verification, complexity, keep_candidate
from saturate.tune.loader_stage import ladder, loader
from saturate.tune.results import SearchResult, SearchSettings
from saturate.tune.state import SearchState
from saturate.tune.trial import OVER_BUDGET, LoaderTrial, Measurer, Trial


def search(measurer: Measurer, base: Plan, s: SearchSettings,
           on_trial: Callable[[Trial | LoaderTrial], None] | None = None, started: float | None = None) -> SearchResult:
    """Run every stage; `on_trial` sees each trial as it finishes (for progress lines). The budget counts from
    `started` (a time.monotonic() reading; default: now), so time spent before the search counts too."""
    return _Search(measurer, base, s, on_trial, started).run()


class _Search(SearchState):
    def run(self) -> SearchResult:
        self.planned = self.expected_trials()
        self.loader_settings = len(ladder(self.m.cores))
        best = self.earn(self.precision())
        fit = batch.memory(self, best)
        best = self.earn(batch.micro_batch(self, best, fit))
        best = self.earn(batch.activation_checkpointing(self, best, fit))
        best = self.earn(self.strategy(best))
        best = self.earn(self.fused(best))
        best = self.earn(self.compile(best))
        best = self.threads_again(best)
        plan = loader(self, best)
        if self.s.verify:
            chosen = self.consistent(self.verify(plan), best)
        else:  # the caller measures the plan again (saturate run's side-by-side): its model trial stands for it
            best.verdict = "chosen (not verified here: measured again by the caller)"
            chosen = dataclasses.replace(best, plan=plan)
            self.decisions.append("verification: left to the caller, which measures the plan again")
        effective = chosen.plan.samples_per_step(self.s.world_size)
        if effective != self.s.effective_batch:
            self.decisions.append(f"effective batch: {self.s.effective_batch} -> {effective} (allowed); training "
                                  "rescales the learning rate linearly")
        return SearchResult(plan=chosen.plan, trials=self.trials, loader_trials=self.loader_trials, fit=fit,
                            decisions=self.decisions, seconds=self.now() - self.started, chosen=chosen,
                            skipped=self.skipped, warnings=self.warnings, budget_s=self.s.budget_s)

    def expected_trials(self) -> int:
        """The model trials the stages are expected to run (the budget is shared out by it): the precisions,
        two steps of the micro-batch climb, FSDP, the fused optimizer and compile where they apply, and one
        incumbent measured again to confirm a small gain (`SearchState.beats`)."""
        s, cands = self.s, self.candidates()
        probe = max(m for m in cands if m <= max(1, min(s.probe_micro, self.local)))
        precisions = 1 + bool(s.supports.get("bf16") or s.supports.get("fp16")) + bool(
            s.supports.get("tf32") and self.m.device_type == "cuda")
        return (precisions + min(2, len([m for m in cands if m > probe])) + (s.world_size > 1)
                + s.fused_available + s.try_compile + 1)

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
        ref_losses = ref.losses  # fp32's own losses, from its first steps (a paired trial's start later; threads
        ref = self.threads(ref)  # change no maths beyond the order of sums)

        options = []
        if s.supports.get("bf16"):
            options.append(ref.plan.replace(precision="bf16", tf32=bool(s.supports.get("tf32"))))
        elif s.supports.get("fp16") and self.m.device_type == "cuda":
            options.append(ref.plan.replace(precision="fp16", tf32=bool(s.supports.get("tf32"))))
        if s.supports.get("tf32") and self.m.device_type == "cuda":
            options.append(ref.plan.replace(tf32=True))
        best, tried = ref, []
        checked, vs_ref = 0, None  # over how many steps the kept precision's losses were checked; its comparison
        for plan in options:
            label = _precision_label(plan)
            if not self.affordable(f"precision {label}"):
                break
            t = self.trial(plan, "precision")
            tried.append(t)
            if not t.ok:
                t.verdict = f"{t.status}: {t.error}"
                continue
            drift = loss_drift(t.losses, ref_losses)
            if drift > s.loss_tolerance:
                t.verdict = f"losses differ from fp32 by up to {100 * drift:.1f} % (> {100 * s.loss_tolerance:.0f} %)"
                self.decisions.append(f"precision: {label} rejected, its first {len(t.losses)} losses differ from "
                                      f"fp32 by up to {100 * drift:.1f} %")
                continue
            t.loss_drift, steps = drift, min(len(t.losses), len(ref_losses))
            take, c = keep_candidate(t, best, s.min_gain)
            if not c.slower:  # not decisive alone (beats): a small gain confirmed, or both timed in pairs
                was = best
                faster, c, best, t = self.beats(t, best)
                take = faster or (not c.slower and complexity(t.plan) < complexity(best.plan))
                ref = best if was is ref else ref  # the figures the decision line compares with: the latest
                tried[-1] = t
            if take:
                best.verdict = f"{label}: {c.text()}" + ("" if c.faster else ", the simpler is kept")
                vs_ref = c if best is ref else None
                best, checked = t, steps
            else:
                t.verdict = f"{c.text()} vs {_precision_label(best.plan)}" + ("" if c.slower else
                                                                              ", the simpler is kept")
        if best is ref:
            why = ("no lower precision is native here" if not options else
                   "; ".join(f"{_precision_label(t.plan)} {t.verdict}" for t in tried if t.ok and t.samples_per_s))
            self.decisions.append(f"precision: fp32 ({why or 'no lower precision could be used'}; "
                                  f"{ref.samples_per_s:.1f} samples/s at micro-batch {ref.plan.micro_batch})")
        else:
            drift = best.loss_drift or 0.0
            self.decisions.append(
                f"precision: {_precision_label(best.plan)}, {best.samples_per_s / ref.samples_per_s:.2f}× fp32 "
                f"samples/s at micro-batch {best.plan.micro_batch} ({(vs_ref or compare(best, ref, s.min_gain)).text()}"
                f"); its first {checked} losses are within {100 * drift:.2f} % of fp32's")
        return best

    def threads_again(self, best: Trial) -> Trial:
        """The threads stage once more, at the end, when the first trial saw a quiet machine and a later one did not:
        a count kept in a quiet moment must not stay when the load returns and it collapses (issue 28). The load
        read is the latest busy trial's; the comparison is the stage's own (paired on a CPU)."""
        if self.m.device_type != "cpu" or self.s.world_size > 1 or best.plan.threads is not None:
            return best
        if any(t.stage == "threads" for t in self.trials) or not self.trials or self.trials[0].contended:
            return best  # the stage measured already, or it was busy from the first trial (the stage saw it)
        busy = next((t for t in reversed(self.trials) if t.ok and t.contended and t.busy_cores), None)
        if busy is None:
            return best
        seen = dataclasses.replace(best, contended=True, busy_cores=busy.busy_cores)
        kept = self.threads(seen, again=True)
        return best if kept is seen else kept

    def threads(self, ref: Trial, again: bool = False) -> Trial:
        """On a CPU that other processes keep busy, fewer intra-op threads than cores: torch's threads wait for each
        other at every parallel region, so one preempted by another process stalls them all (gpt-tiny on 2 cores
        with a busy loop on one: 15-23 samples/s with 2 threads, 38 with 1; bench/trust.py, 2026-11-23). Tried at
        the first trial's settings only when that trial saw the machine busy; the rest of the search keeps the
        count taken. In one process only (several ranks share the cores by another rule)."""
        if self.m.device_type != "cpu" or self.s.world_size > 1 or ref.plan.threads is not None:
            return ref
        using = torch.get_num_threads()  # the process's count (the search's plans have none of their own)
        if not (ref.contended and ref.busy_cores):
            self.decisions.append(f"threads: torch's {using} (the machine was quiet during the first trial)")
            return ref
        head = "threads, again (the load came after the first trial)" if again else "threads"
        free = max(1, self.m.cores - math.ceil(ref.busy_cores - 0.25))  # the cores other processes left
        if free >= using:
            self.decisions.append(f"{head}: torch's {using} (other processes kept {ref.busy_cores:.1f} cores busy, "
                                  f"leaving {free})")
            return ref
        if not self.affordable(f"{free} thread{'s' if free > 1 else ''}"):
            return ref
        t = self.trial(ref.plan.replace(threads=free), "threads")
        taken, c, ref, t = self.beats(t, ref) if t.ok else (False, None, ref, t)
        busy = f"other processes kept {ref.busy_cores or t.busy_cores or 0:.1f} of {self.m.cores} cores busy"
        if taken:
            ref.verdict = f"{free} thread{'s' if free > 1 else ''}: {c.text()}"
            self.decisions.append(f"{head}: {free} of {using} ({busy}; {c.text()}); a plan for a machine this "
                                  "busy — on a quiet one, tune again")
            t.plan.provenance["threads"] = f"chosen while {busy}"
            return t
        t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()} vs {using} threads"
        self.decisions.append(f"{head}: torch's {using} ({busy}; {free} measured {t.verdict})")
        return ref

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
        taken, c, best, t = self.beats(t, best) if t.ok else (False, None, best, t)
        if taken:
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
        taken, c, best, t = self.beats(t, best) if t.ok else (False, None, best, t)
        if taken:
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

        def pays_back(eager: Trial) -> bool:
            return s.planned_steps * (eager.step_s - t.step_s) > (t.compile_s or 0.0)

        # `limit` may hold each rank's own clock (the budget left): all ranks must reach one verdict.
        within = self.all_agree(t.compile_s is None or t.compile_s <= limit)
        faster, c = False, compare(t, best, s.min_gain)
        if within and c.faster and pays_back(best):  # only then is a small gain worth confirming (eager again)
            faster, c, best, t = self.beats(t, best)
        saved = s.planned_steps * (best.step_s - t.step_s)
        if not within:
            t.verdict = f"compiling took {t.compile_s:.1f} s, over the {limit:.1f} s limit"
        elif not c.faster:
            t.verdict = f"{c.text()} steady state; eager is simpler"
        elif not (faster and pays_back(best)):
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

    def verify(self, plan: Plan) -> Trial:
        """Real steps through the real loader plus validation; back off on OOM."""
        smaller = [m for m in self.candidates() if m < plan.micro_batch]
        while True:
            t = self.measure(lambda p=plan: self.m.verify(p))
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
            return self.measure(lambda: self.m.verify(plan))

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
