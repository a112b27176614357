"""The search: which plan is fastest, decided by measurement, one knob family at a time.

It starts from the plan it is given — `tune` gives it the informed plan (plan.default_plan: chosen from the
hardware, not measured), measured as the first trial — and each stage measures the alternative to the choice the
incumbent holds (start.py): within noise the incumbent's stays. Each knob the result sets says why, measured or
still as chosen from the hardware (`SearchState.provenance`).

Order: the starting plan -> precision (with a loss check against fp32) -> memory fit -> micro-batch (hill climb over
the micro-batches that keep the effective batch exact) -> activation checkpointing (only when
memory stopped the climb) -> DDP or FSDP2 (under torchrun) -> fused optimizer -> torch.compile
(only when it pays back its compile time within the planned run) -> input pipeline (cheapest
loader that feeds the model beyond the noise, within the host-RAM budget) -> verification with
real training and validation steps (left to the caller when it measures the plan again anyway:
`SearchSettings.verify`).

Everything here talks to a `Measurer`, so the logic is tested with a deterministic fake. A plan is
only ever reported with figures from a trial that ran it; predictions are labelled. The state the
stages share and the budget are in state.py; the start and precision in start.py, the batch-sizing stages in
batch.py, the loader's in
loader_stage.py; the settings and result types in results.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from saturate.engine.step import own_threads
from saturate.errors import SaturateError
from saturate.plan import Plan, informed_summary
from saturate.policy import POLICY, Load
from saturate.policy.threads import Skip, threads_to_try
from saturate.provenance import Origin, mark, origin
from saturate.stats.comparison import compare
from saturate.tune import batch, start
from saturate.tune.bound import bound_text, not_worth
from saturate.tune.decide import check_verification
from saturate.tune.evidence import plan_text
from saturate.tune.loader_stage import ladder, loader
from saturate.tune.results import SearchResult, SearchSettings
from saturate.tune.stake import staked
from saturate.tune.state import SearchState, gib
from saturate.tune.trial import OVER_BUDGET, LoaderTrial, Measurer, Trial


def start_text(plan: Plan) -> str:
    """The first trial's plan, said: the informed one's settings labelled, or "the plan given"."""
    if plan.provenance.get("informed"):
        return f"the informed plan ({informed_summary(plan)})"
    return f"the plan given ({plan_text(plan)})"


def search(measurer: Measurer, base: Plan, s: SearchSettings,
           on_trial: Callable[[Trial | LoaderTrial], None] | None = None, started: float | None = None) -> SearchResult:
    """Run every stage; `on_trial` sees each trial as it finishes (for progress lines). The budget counts from
    `started` (a time.monotonic() reading; default: now), so time spent before the search counts too."""
    return _Search(measurer, base, s, on_trial, started).run()




class _Search(SearchState):
    def run(self) -> SearchResult:
        self.planned = self.expected_trials()
        self.loader_settings = len(ladder(self.m.cores))
        first = start.start(self)  # the starting plan (the informed one), measured: each stage measures around it
        self.decisions.append(f"start: {start_text(first.plan)}, measured first; each stage measures the "
                              "alternative to its choice, and within noise keeps it")
        losses = first.losses  # its own, from its first steps (a paired trial's start later; threads change no
        best = self.earn(start.precision(self, self.threads(first), losses))  # maths beyond the order of sums)
        best = self.earn(self.chunked_loss(best))  # before the memory fit: what it frees, the micro-batch can use
        fit = batch.memory(self, best)
        best = self.earn(batch.micro_batch(self, best, fit))
        best = self.earn(batch.activation_checkpointing(self, best, fit))
        best = self.earn(self.strategy(best))
        best = self.earn(self.fused(best))
        best = self.earn(self.attention(best))
        best = self.earn(self.compile(best))
        best = self.threads_again(best)
        plan = loader(self, best)
        if self.s.verify:
            chosen = self.consistent(self.verify(plan), best)
        else:  # the caller measures the plan again (saturate run's side-by-side): its model trial stands for it
            best.verdict = "chosen (not verified here: measured again by the caller)"
            chosen = dataclasses.replace(best, plan=plan)
            self.decisions.append("verification: left to the caller, which measures the plan again")
        kept = self.unmeasured(chosen.plan)
        choices = {"start": start_text(first.plan), **self.provenance(chosen.plan)}
        chosen.plan.provenance.pop("informed", None)  # the plan is the search's now; each knob says whose it is
        chosen.plan.provenance.update(choices)
        if kept:
            self.decisions.append(f"kept as chosen from the hardware, not measured: {', '.join(kept)}")
        effective = chosen.plan.samples_per_step(self.s.world_size)
        if effective != self.s.effective_batch:
            self.decisions.append(f"effective batch: {self.s.effective_batch} -> {effective} (allowed); training "
                                  "rescales the learning rate linearly")
        return SearchResult(plan=chosen.plan, trials=self.trials, loader_trials=self.loader_trials, fit=fit,
                            decisions=self.decisions, seconds=self.now() - self.started, chosen=chosen,
                            skipped=self.skipped, warnings=self.warnings, budget_s=self.s.budget_s,
                            choices=choices, unmeasured=kept)

    def expected_trials(self) -> int:
        """The model trials the stages are expected to run (the budget is shared out by it): the starting plan and
        the precisions around it, the chunked loss where a starting micro-batch holds more than a chunk, two steps
        of the micro-batch climb, FSDP, the fused optimizer, the attention kernels and compile (with its ladder)
        where they apply, and one incumbent measured again to confirm a small gain (`SearchState.beats`)."""
        s, cands = self.s, self.candidates()
        probe = max((m for m in cands if m <= max(1, min(self.base.micro_batch, self.local))), default=min(cands))
        precisions = 1 + bool(s.supports.get("bf16") or s.supports.get("fp16")) + bool(
            s.supports.get("tf32") and self.m.device_type == "cuda")
        return (precisions + min(2, len([m for m in cands if m > probe])) + (s.world_size > 1)
                + s.fused_available + s.try_compile * (1 + len(s.compile_ladder)) + len(s.attention_backends) + 1
                + (s.loss_chunk_rows is not None and probe * s.rows_per_sample > s.loss_chunk_rows))

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
        other at every parallel region, so one preempted by another process stalls them all (measured:
        bench/results/cpu-2026-11-23d/README.md). Tried at the first trial's settings only when that trial saw the
        machine busy; the rest of the search keeps the count taken. In one process only (several ranks share the
        cores by another rule)."""
        if origin(ref.plan.provenance, "threads") is Origin.UNDER_LOAD:
            return start.all_threads(self, ref)
        if ref.plan.threads is not None:  # a count of the plan's own
            return ref
        using = own_threads()  # the process's count (the search's plans have none of their own)
        load = Load(ref.busy_cores if ref.contended else None, self.m.cores)
        choice = threads_to_try(self.m.device_type, self.s.world_size, using, load)  # a script's rule too
        if choice.skip in (Skip.NOT_CPU, Skip.PROCESSES):
            return ref
        if choice.skip is Skip.QUIET:
            self.decisions.append(f"threads: torch's {using} (the machine was quiet during the first trial)")
            return ref
        head = "threads, again (the load came after the first trial)" if again else "threads"
        free = choice.left or using  # the cores other processes left
        if choice.skip is Skip.ENOUGH:
            self.decisions.append(f"{head}: torch's {using} (other processes kept {ref.busy_cores:.1f} cores busy, "
                                  f"leaving {free})")
            return ref
        if not self.affordable(f"{free} thread{'s' if free > 1 else ''}"):
            return ref
        t = self.trial(ref.plan.replace(threads=free), "threads")
        taken, c, ref, t = self.beats(t, ref) if t.ok else (False, None, ref, t)
        busy = f"other processes kept {ref.busy_cores or t.busy_cores or 0:.1f} of {self.m.cores} cores busy"
        if taken:
            self.leave_threads(free)
            ref.verdict = f"{free} thread{'s' if free > 1 else ''}: {c.text()}"
            self.decisions.append(f"{head}: {free} of {using} ({busy}; {c.text()}); a plan for a machine this "
                                  "busy — on a quiet one, tune again")
            mark(t.plan.provenance, "threads", Origin.MEASURED, f"chosen while {busy}")
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
        """The fused optimizer's other setting against the incumbent's: on where it starts off (naive), off where
        the starting plan chose it on (it has the kernel); within noise the incumbent's stays."""
        if not self.s.fused_available:
            self.decisions.append(f"fused optimizer: off (no fused AdamW on {self.m.device_type})")
            return best
        on = best.plan.fused_optimizer
        other, was = ("unfused", "fused") if on else ("fused", "unfused")
        # The most the other kernel can gain is the incumbent's whole optimizer step (bound.py): the largest share
        # any trial with the incumbent's setting measured.
        share = max((t.optimizer_share for t in self.trials if t.ok and t.optimizer_share is not None
                     and t.plan.fused_optimizer == on), default=None)
        if not_worth(share, self.s.min_gain):
            why = bound_text("optimizer step", share, self.s.min_gain)  # type: ignore[arg-type]
            self.decisions.append(f"fused optimizer: {'on' if on else 'off'} ({other} not tried: {why})")
            self.measured("fused_optimizer", f"{other} not tried, {why}", kept=on == self.base.fused_optimizer)
            self.planned -= 1  # the trial the budget was shared out for
            return best
        if not self.affordable(f"{other} optimizer"):
            return best
        t = self.trial(best.plan.replace(fused_optimizer=not on), "fused-optimizer")
        taken, c, best, t = self.beats(t, best) if t.ok else (False, None, best, t)
        if taken:
            best.verdict = f"{other}: {c.text()}"
            self.decisions.append(f"fused optimizer: {'off' if on else 'on'} ({c.text()} samples/s vs {was})")
            self.measured("fused_optimizer", f"{'off' if on else 'on'}: {other} {c.text()} vs {was}")
            return t
        if c is None:
            t.verdict = f"{t.status}: {t.error}"
        else:
            t.verdict = f"{c.text()}; " + (f"{was} is kept" if on else "unfused is simpler")
            kept = on == self.base.fused_optimizer
            self.measured("fused_optimizer", f"{'' if kept else ('on' if on else 'off') + ': '}{other} measured "
                          f"{c.text()}", kept=kept)
        self.decisions.append(f"fused optimizer: {'on' if on else 'off'} ({other} measured {t.verdict})"
                              if on else f"fused optimizer: off ({t.verdict})")
        return best

    def attention(self, best: Trial) -> Trial:
        """Each SDPA backend of `attention_backends` (cuDNN, flash, memory-efficient) against torch's own choice,
        one after another against the incumbent: kept when faster beyond the noise. A backend that cannot run
        this model's attention (its shape, dtype or mask) fails its trial and is said so."""
        if not self.s.attention_backends or best.plan.attention is not None:
            return best
        said: list[str] = []
        for name in self.s.attention_backends:
            if not self.affordable(f"attention {name}"):
                break
            t = self.trial(best.plan.replace(attention=name), "attention")
            if not t.ok:
                t.verdict = f"{t.status}: {t.error}"
                said.append(f"{name} {t.status}")
                continue
            was = best.plan.attention or "torch's choice"
            taken, c, best, t = self.beats(t, best)
            said.append(f"{name} {c.text()} vs {was}")
            if taken:
                best.verdict = f"attention {name}: {c.text()}"
                best = t
            else:
                t.verdict = f"{c.text()} vs {was}"
        if said:
            chosen = best.plan.attention or "torch's choice"
            self.decisions.append(f"attention: {chosen} ({'; '.join(said)})")
        return best

    def chunked_loss(self, best: Trial) -> Trial:
        """The loss over chunks of logits (plan.loss_chunk) against the whole logits, where the workload has one
        and a micro-batch holds more rows than a chunk; before the memory fit, so the micro-batch search sees
        what it frees. Kept when faster beyond the noise, or when not slower beyond it and its measured peak
        memory is at least `POLICY.stages.chunk_memory_gain` lower (memory a larger micro-batch can use: the reason the
        knob exists); each one's peak memory is said."""
        s, p = self.s, best.plan
        if s.loss_chunk_rows is None or p.loss_chunk is not None:
            return best
        rows = p.micro_batch * s.rows_per_sample
        if rows <= s.loss_chunk_rows:
            self.skipped.append(f"chunked loss: not tried, a micro-batch's {rows} rows of logits fit in one chunk "
                                f"of {s.loss_chunk_rows}")
            return best
        if not self.affordable("chunked loss"):
            return best
        t = self.trial(p.replace(loss_chunk=s.loss_chunk_rows), "loss")
        taken, c, best, t = self.beats(t, best, either_way=True) if t.ok else (False, None, best, t)
        memory = (f"; peak memory {gib(t.peak_memory_bytes)} against {gib(best.peak_memory_bytes)}"
                  if t.peak_memory_bytes and best.peak_memory_bytes else "")
        frees = bool(memory) and t.peak_memory_bytes <= (1 - POLICY.stages.chunk_memory_gain) * best.peak_memory_bytes
        for_memory = c is not None and not taken and not c.slower and frees
        if taken or for_memory:  # the whole logits' trial says what replaced it
            best.verdict = f"chunked loss: {c.text()}" + (", within noise, with less memory" if for_memory else "")
            reason = ": the memory it frees is the reason" if for_memory else ""
            self.decisions.append(f"loss: in chunks of {s.loss_chunk_rows} rows ({c.text()} vs the whole logits"
                                  f"{memory}{reason})")
            return t
        t.verdict = f"{t.status}: {t.error}" if c is None else f"{c.text()}; the whole logits are kept{memory}"
        self.decisions.append(f"loss: the whole logits (chunks of {s.loss_chunk_rows} rows measured {t.verdict})")
        return best

    def compile(self, best: Trial) -> Trial:
        """torch.compile in `compile_mode`; once compiled is kept, each mode of `compile_ladder` in turn (CUDA
        graphs with reduce-overhead, then max-autotune), each against the incumbent under the same rule: faster
        beyond the noise, and paying back its own compile time over the planned steps."""
        if not self.s.try_compile:
            self.skipped.append("torch.compile: not tried (turned off)")
            return best
        best = self._compile(best, self.s.compile_mode)
        for mode in self.s.compile_ladder if best.plan.compile != "none" else ():
            best = self._compile(best, mode)
        return best

    def _compile(self, best: Trial, mode: str) -> Trial:
        s = self.s
        # The most compile could save: the planned run at `compile_speedup_bound`× speed. A compile that takes
        # longer than that cannot pay back, so it is the trial's time limit: the compilation is stopped there.
        payback = s.planned_steps * best.step_s * (1 - 1 / s.compile_speedup_bound)
        what = "torch.compile" if mode == s.compile_mode else f"torch.compile {mode}"
        if mode != s.compile_mode:  # the ladder's modes come after a gain: only compiling at all is staked on
            return self._compile_trial(best, mode, what, payback, None)
        with staked(self, what, payback) as stake:
            return self._compile_trial(best, mode, what, payback, stake)

    def _compile_trial(self, best: Trial, mode: str, what: str, payback: float, stake: float | None) -> Trial:
        s = self.s
        limit, left = payback, self.remaining()
        if left is not None:  # the compilation, then a trial's steps, then the verification
            limit = min(limit, left - self.longest() - self.verifying(), *(() if stake is None else (stake,)))
        if not self.affordable(what):
            return best
        if limit <= 0:
            self.skipped.append(f"{what}: not tried, the budget had {max(left or 0, 0):.0f} s left")
            return best
        was = "eager" if best.plan.compile == "none" else best.plan.compile
        kept = best.plan.compile  # what the decision line says stays, when this mode is not taken
        t = self.trial(best.plan.replace(compile=mode), "compile", compile_limit_s=limit)
        # A stopped or failed trial was discarded by the measurer; a rejected one is discarded below.
        if t.status == OVER_BUDGET:
            t.verdict = f"{t.status}: {t.error}"
            self.decisions.append(f"compile: {kept} (the tuning budget ran out: {t.error})")
            return best
        if t.status == "timeout":  # which limit stopped it: the budget's room, or what compiling could save
            t.verdict = t.error + (f": a longer compilation cannot pay back over {s.planned_steps} steps"
                                   if limit >= payback else
                                   f": what the tuning budget had left for it (compiling could take up to "
                                   f"{payback:.0f} s and still pay back over {s.planned_steps} steps, a prediction "
                                   f"for steps at most {s.compile_speedup_bound:g}× faster)")
            self.decisions.append(f"compile: {kept} ({t.verdict})")
            return best
        if not t.ok:
            t.verdict = f"{t.status}: {t.error}"
            self.decisions.append(f"compile: {kept} ({what} failed: {t.error}; {was} is used)")
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
            t.verdict = f"{c.text()} steady state; {was} is simpler"
        elif not pays_back(best):
            t.verdict = (f"{c.text()} steady state; over {s.planned_steps} steps "
                         f"saves {saved:.1f} s < {t.compile_s or 0:.1f} s to compile")
        elif not faster:  # the confirmation did not hold, or had no room
            t.verdict = f"{c.text()} (steady state)"
        else:
            best.verdict = f"compiled saves {saved:.0f} s over the run"
            self.decisions.append(f"compile: {mode} ({c.text()} steady "
                                  f"state; saves ~{saved:.0f} s over {s.planned_steps} steps against "
                                  f"{t.compile_s or 0:.1f} s to compile — a prediction from the trial)")
            return t
        self.decisions.append(f"compile: {kept} ({t.verdict})" if mode == s.compile_mode else
                              f"compile: {kept} ({mode} {t.verdict})")
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
            self.measured("micro_batch", f"{smaller[-1]}: {plan.micro_batch} ran out of memory in the verification")
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
