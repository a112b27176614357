"""`RealMeasurer`: the tuner's trials run for real on this machine (the `Measurer` of trial.py).

Model trials feed pre-collated batches (cycled), so they time the model alone; loader trials time
the DataLoader alone; `verify` runs real training steps through the real loader plus a validation
pass, so the chosen plan is proven end to end before it is written.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from torch.utils.data import default_collate

from saturate.data.loaders import eval_loader, make_loader
from saturate.engine.distributed import DistInfo, agree_any, all_reduce_scalar, gather_objects, rank_device
from saturate.engine.step import Stepper, Timer, to_device
from saturate.hardware import synchronize
from saturate.hardware.contention import ContentionMeter
from saturate.plan import Plan
from saturate.policy import POLICY
from saturate.stats.noise import WindowRule, default_rule
from saturate.tune.bound import OptimizerClock
from saturate.tune.paired import Pairing
from saturate.tune.process import (
    CompileScope,
    CompileTimeLimit,
    PeakMemory,
    PeerFailed,
    local_processes,
    prepare_compiler,
    release,
    time_limit,
    workers_uss,
)
from saturate.tune.trial import OVER_BUDGET, LoaderTrial, OverBudget, Trial, first_line, is_oom
from saturate.workloads.base import Workload


class RealMeasurer(Pairing):
    """Trials on this machine with saturate's own Stepper (the code that will train).

    Under torchrun (`dist` with several processes) every rank runs every trial together, with the
    plan's DDP/FSDP strategy, and each result is agreed across ranks before the search sees it
    (the slowest rank's step time, the largest peak memory, any rank's failure), so every rank
    takes the same decisions. Samples/s are then per process. Memory capacity, the workers' RAM
    budget and the cores are shared by the ranks on one machine, so each rank gets its share.
    """

    def __init__(self, workload: Workload, hardware: Any, *, seed: int = 0, warmup: int = 1,
                 min_steps: int = 3, min_seconds: float = 0.0, max_steps: int | None = None,
                 window_s: float = 0.25, rule: WindowRule | None = None,
                 memory_headroom_bytes: int | None = None, ram_budget: int | None = None,
                 dist: DistInfo | None = None) -> None:
        """A trial is timed in windows of at least `window_s` (and at least `min_seconds / min_windows`)
        until the `rule` says its throughput is known (stats/noise.py), with at least `min_steps` timed steps
        and `min_seconds`, and at most `max_steps` when given."""
        self.workload, self.hw, self.seed = workload, hardware, seed
        self.warmup, self.min_steps, self.min_seconds, self.max_steps = warmup, min_steps, min_seconds, max_steps
        self.rule = rule or default_rule()
        self.window_s = max(window_s, min_seconds / self.rule.min_windows)
        self.dist = dist or DistInfo()
        self.device = torch.device(hardware.torch_device)
        if self.dist.active:
            self.device = rank_device(self.device.type, self.dist)
        self.device_type = self.device.type
        local = local_processes(self.dist)
        self.cores = max(1, int(hardware.cpu_cores) // local)
        vm = psutil.virtual_memory()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.memory_capacity = int(free + torch.cuda.memory_allocated(self.device))
            self.memory_kind = "device"
        else:
            self.memory_capacity = int(vm.available)
            self.memory_kind = "host RSS"
            self.memory_capacity //= local  # the ranks on this machine share its RAM
        if memory_headroom_bytes is not None:
            self.memory_capacity = max(0, self.memory_capacity - memory_headroom_bytes)
        # Workers may add what is available less a margin (a tenth of RAM, at least 1 GiB), so nothing swaps.
        self.ram_budget = ram_budget if ram_budget is not None else max(0, int(vm.available - max(vm.total / 10,
                                                                                                   2**30))) // local
        if self.dist.world_size > 1:  # each rank read its own sensors a moment apart: agree on the smallest
            self.memory_capacity = int(all_reduce_scalar(self.memory_capacity, "min"))
            self.ram_budget = int(all_reduce_scalar(self.ram_budget, "min"))
            self.cores = int(all_reduce_scalar(self.cores, "min"))
        self._compile_scope: CompileScope | None = None  # what the last compilation started, to end it
        # When a model trial must end (time.monotonic()), set by the search under a budget: a trial whose first
        # step predicts it would end later stops there (status OVER_BUDGET) instead of overrunning the budget.
        self.deadline: float | None = None
        # Timed seconds a trial may take at most, set by the search from the budget left (state.window_cap); the
        # rule's minimum windows are timed whatever it says. None: the rule's caps alone.
        self.window_cap_s: float | None = None

    def all_agree(self, flag: bool) -> bool:
        return not agree_any(not flag)

    def _agreed(self, t: Trial) -> Trial:
        """The trial as every rank sees it: any rank's failure, the slowest step, the largest peak."""
        if self.dist.world_size == 1:
            return t
        views = gather_objects((t.status, t.error, t.window_samples_per_s, t.peak_memory_bytes, t.compile_s,
                                t.seconds, t.steps, t.losses, t.busy_cores, t.contended, t.optimizer_share))
        failures = [v for v in views if v[0] != "ok"]
        own = [v for v in failures if not v[1].startswith(PeerFailed.__name__)]  # the rank that failed first
        failed = (own or failures or [None])[0]
        t.seconds = max(v[5] for v in views)
        t.peak_memory_bytes = max((v[3] for v in views if v[3] is not None), default=None)
        if failed is not None:
            rank = views.index(failed)
            t.status, t.error = failed[0], f"rank {rank}: {failed[1]}"
            t.step_s = t.samples_per_s = t.compile_s = t.spread = None
            return t
        # Each window's rate is the slowest rank's (every rank ran the same steps in it).
        self._summarise(t, t.plan, [min(r) for r in zip(*(v[2] for v in views), strict=True)])
        t.busy_cores = max((v[8] for v in views if v[8] is not None), default=None)
        t.contended = any(v[9] for v in views)
        t.compile_s = max((v[4] for v in views if v[4] is not None), default=None)
        t.steps, t.losses = views[0][6], views[0][7]
        t.optimizer_share = max((v[10] for v in views if v[10] is not None), default=None)
        return t

    # --- model trials ---------------------------------------------------------------------------

    def model_trial(self, plan: Plan, stage: str, *, steps: int | None = None,
                    compile_limit_s: float | None = None) -> Trial:
        """Warm-up, then timed steps on cycled pre-collated batches (the loader is not in the timing).

        `compile_limit_s` stops a compilation that runs longer (status "timeout"), where the process
        can deliver a timer signal (Unix, main thread); elsewhere the limit is checked afterwards.
        """
        trial = Trial(stage=stage, plan=plan)
        started = time.perf_counter()
        batches = self._cycled_batches(plan)
        with PeakMemory(self.device) as mem:
            try:
                self._run(trial, plan, batches, steps, compile_limit_s, self.deadline)
            except CompileTimeLimit as e:
                trial.status, trial.error = "timeout", str(e)
            except OverBudget as e:
                trial.status, trial.error = OVER_BUDGET, str(e)
            except Exception as e:
                trial.status = "oom" if is_oom(e) else "failed"
                trial.error = first_line(e)
        trial.peak_memory_bytes = mem.peak if trial.ok or trial.status == "oom" else None
        trial.seconds = time.perf_counter() - started
        release(self.device)
        trial = self._agreed(trial)
        if plan.compile != "none" and not trial.ok:  # the agreed status: every rank discards alike
            self.discard_compiled()
        return trial

    def discard_compiled(self) -> None:
        """Leave nothing of the last compilation: its kernel builds, worker processes and threads ended, its
        compiled code and caches dropped, so the process runs as fast as a fresh one. For a compilation
        stopped, failed or rejected; local to this process (no collective)."""
        if self._compile_scope is not None:
            self._compile_scope.discard()
            self._compile_scope = None

    def _run(self, trial: Trial, plan: Plan, batches: Iterator[Any], steps: int | None,
             compile_limit_s: float | None = None, deadline: float | None = None) -> None:
        torch.manual_seed(self.seed)  # every trial starts from the same weights: losses are comparable
        notes: list[str] = []
        t0 = time.perf_counter()
        # What the process has before this trial's compilation: what the compilation starts can then be ended.
        # An eager trial leaves the last compilation's record alone: the search may measure the eager plan again
        # (a confirmation) before it decides whether to keep or discard that compilation.
        scope = CompileScope() if plan.compile != "none" else None
        if scope is not None:
            self._compile_scope = scope
        stepper = Stepper(self.workload, plan, self.device, self.workload.optim.lr, notes=notes,
                          compile=False, adapt_oom=False, dist=self.dist)
        if scope is not None:
            prepared = time.perf_counter()
            prepare_compiler(self.device)  # not interruptible; its time counts against the limit
            left = None if compile_limit_s is None else compile_limit_s - (time.perf_counter() - prepared)
            if left is not None and left <= 0 and self.dist.world_size == 1:  # several ranks: agreed below
                raise CompileTimeLimit(f"compiling was stopped at the {compile_limit_s:.3g} s limit")
            # Several ranks: no alarm (it could stop one rank inside a collective); checked afterwards, together.
            with time_limit(left, interrupt=self.dist.world_size == 1, on_alarm=scope.note_processes,
                            limit_s=compile_limit_s) as expired:
                stepper.compile_model()
            if agree_any(expired()):  # the alarm may surface wrapped in a compiler error, or not at all
                raise CompileTimeLimit(f"compiling was stopped at the {compile_limit_s:.3g} s limit")
            if stepper.step_model is stepper.model:  # compilation failed and fell back
                raise RuntimeError(notes[-1])
            trial.compile_s = time.perf_counter() - t0
        losses: list[torch.Tensor] = []
        warm = time.perf_counter()
        for _ in range(self.warmup):
            self._step(stepper, batches)
            losses.append(stepper.take_loss_sum())
        synchronize(self.device)
        if deadline is not None:
            self._check_deadline((time.perf_counter() - warm) / max(1, self.warmup), steps, deadline)
        self._timed_windows(trial, plan, stepper, batches, losses, steps)
        trial.losses = [round(float(v), 5) for v in torch.stack(losses).tolist()]
        if not all(math.isfinite(v) for v in trial.losses):
            raise RuntimeError(f"non-finite training loss {trial.losses}")

    def _timed_windows(self, trial: Trial, plan: Plan, stepper: Stepper, batches: Iterator[Any],
                       losses: list[torch.Tensor], steps: int | None) -> None:
        """Timed windows of equal step counts until the throughput is known (stats/noise.py's rule) or a cap.

        The first window's length in steps (at least `window_s`) is agreed by every rank, so every rank runs the same
        steps; each later window syncs the device once, at its end. The trial's meter of other processes' use raises
        the caps when the windows disagree on a busy machine; its clock, the optimizer step's share (bound.py)."""
        meter = ContentionMeter().start()  # this job's tree: every local rank (hardware.contention.job_root)
        rule, per_step, clock = self.rule, plan.samples_per_step(), OptimizerClock(self.device)
        rates: list[float] = []
        size, n, busy, timed = 0, 0, None, 0.0
        start = time.perf_counter()
        while True:
            w0, k = time.perf_counter(), 0
            while True:
                self._step(stepper, batches, clock)
                losses.append(stepper.take_loss_sum())
                k, n = k + 1, n + 1
                if steps is not None:
                    if n >= steps:
                        break
                elif size:  # a later window: as many steps as the first
                    if k >= size or (self.max_steps is not None and n >= self.max_steps):
                        break
                else:
                    synchronize(self.device)
                    # Every rank runs the same number of steps (each one's all-reduce pairs with the others').
                    if agree_any(time.perf_counter() - w0 >= self.window_s
                                 or (self.max_steps is not None and n >= self.max_steps)):
                        size = k
                        break
            synchronize(self.device)
            timed += (took := time.perf_counter() - w0)
            rates.append(k * per_step / took)
            elapsed = time.perf_counter() - start
            agreed = rule.agreed(rates) and n >= self.min_steps and elapsed >= self.min_seconds
            if not agreed and busy is None and rule.capped(rates, elapsed):
                busy = meter.stop().significant()  # read once, when the windows failed to agree in time
            done = (steps is not None or agreed or rule.capped(rates, elapsed, bool(busy))
                    or (self.window_cap_s is not None and len(rates) >= rule.min_windows
                        and elapsed >= self.window_cap_s)
                    or (self.max_steps is not None and n >= self.max_steps))
            if not agree_any(not done):  # every rank is done
                break
        seen = meter.stop()
        trial.busy_cores, trial.contended = seen.other_cores, seen.significant()
        self._summarise(trial, plan, rates)
        trial.steps, trial.optimizer_share = n, clock.seconds / timed if timed > 0 else None

    def _summarise(self, trial: Trial, plan: Plan, rates: list[float]) -> None:
        """The trial's figures from its windows' throughputs (a single window has no spread)."""
        summary = self.rule.result(rates)
        trial.window_samples_per_s = rates
        trial.windows = summary.windows
        trial.samples_per_s = summary.median
        trial.spread = summary.spread if len(rates) > 1 else None
        trial.step_s = plan.samples_per_step() / summary.median

    def _check_deadline(self, step_s: float, steps: int | None, deadline: float) -> None:
        """Raise OverBudget when the timed steps, predicted from the warm-up's step time, would end past `deadline`
        (every rank together)."""
        # The shortest a windowed trial can be: `min_windows` windows of `window_s`, or its minimum steps.
        shortest = max(self.min_seconds, self.rule.min_windows * self.window_s)
        n = steps if steps is not None else max(self.min_steps, math.ceil(shortest / max(step_s, 1e-9)))
        if steps is None and self.max_steps is not None:
            n = min(n, self.max_steps)
        left = deadline - time.monotonic()
        if agree_any(n * step_s > left):
            raise OverBudget(f"was stopped after its first step: {n} timed steps of {step_s:.2g} s would end "
                             f"{n * step_s - left:.0f} s past the budget")

    def _step(self, stepper: Stepper, batches: Iterator[Any], timer: Timer | None = None) -> None:
        """One optimizer step; under torchrun every rank learns whether any rank failed in it.

        A rank that fails outside forward/backward (an OOM allocating the optimizer's state, say) would
        otherwise leave the others waiting in the next step's all-reduce: all end the trial together.
        """
        if self.dist.world_size == 1:
            stepper.step(batches, timer)
            return
        error: Exception | None = None
        try:
            stepper.step(batches, timer)
        except Exception as e:
            error = e
        if agree_any(error is not None):
            raise error if error is not None else PeerFailed("another rank failed in this step")

    def _cycled_batches(self, plan: Plan) -> Iterator[Any]:
        """Two optimizer steps' worth of loader batches, collated once, on the host, repeated."""
        data = self.workload.train_data
        m = plan.micro_batch
        n = 2 * plan.grad_accum
        held = [default_collate([data[i] for i in range(j * m, (j + 1) * m)]) for j in range(n)]

        def cycle() -> Iterator[Any]:
            while True:
                yield from held

        return cycle()

    # --- loader trials --------------------------------------------------------------------------

    def loader_trial(self, plan: Plan) -> LoaderTrial:
        """Sustained samples/s of the DataLoader alone (after draining the workers' prefetched batches)."""
        pin = plan.pin_memory and self.device.type == "cuda"
        trial = LoaderTrial(plan.num_workers, plan.prefetch_factor, pin)
        started = time.perf_counter()
        swap_before = psutil.swap_memory().used
        loader = make_loader(self.workload.train_data, plan, start_step=0, pin_memory=pin,
                             rank=self.dist.rank, world_size=self.dist.world_size)
        it = iter(loader)
        try:
            next(it)
            trial.startup_s = time.perf_counter() - started
            buffered = plan.num_workers * (plan.prefetch_factor or 2)
            for _ in range(buffered):  # what the workers prefetched during start-up is not sustained rate
                next(it)
            # Windows until they agree (stats/noise.py) after `target` batches, or a cap: POLICY.windows.loader_*
            t0, n, rates, w = time.perf_counter(), 0, [], POLICY.windows
            target, chunk = max(20, 4 * buffered), max(5, buffered)
            while True:
                w0, k = time.perf_counter(), 0
                while k < chunk or (time.perf_counter() - w0 < w.loader_window_s and n + k < w.loader_max_batches):
                    next(it)
                    k += 1
                n += k
                rates.append(k * plan.micro_batch / (time.perf_counter() - w0))
                elapsed = time.perf_counter() - t0
                if (n >= w.loader_max_batches or self.rule.capped(rates, elapsed)
                        or (n >= target and elapsed >= w.loader_min_s and self.rule.agreed(rates))):
                    break
            summary = self.rule.result(rates)
            trial.samples_per_s, trial.spread, trial.windows = summary.median, summary.spread, summary.windows
            trial.worker_memory_bytes = workers_uss() if plan.num_workers > 0 else 0
        except Exception as e:
            trial.status, trial.error = "failed", first_line(e)
        finally:
            del it, loader
            gc.collect()
        trial.swap_grew_bytes = max(0, psutil.swap_memory().used - swap_before)
        trial.seconds = time.perf_counter() - started
        if self.dist.world_size > 1:  # every rank's loader: the slowest, the hungriest, any failure
            views = gather_objects((trial.status, trial.error, trial.samples_per_s, trial.worker_memory_bytes,
                                    trial.swap_grew_bytes, trial.startup_s, trial.seconds, trial.spread))
            failed = next((v for v in views if v[0] != "ok"), None)
            if failed is not None:
                trial.status, trial.error = failed[0], f"rank {views.index(failed)}: {failed[1]}"
                trial.samples_per_s = None
            else:
                slowest = min(views, key=lambda v: v[2])
                trial.samples_per_s, trial.spread = slowest[2], slowest[7]
                trial.worker_memory_bytes = max(v[3] or 0 for v in views)
                trial.startup_s = max(v[5] for v in views)
            trial.swap_grew_bytes = max(v[4] for v in views)
            trial.seconds = max(v[6] for v in views)
        return trial

    # --- verification ---------------------------------------------------------------------------

    def verify(self, plan: Plan) -> Trial:
        """Real training steps through the real loader, then one validation pass, at this plan."""
        trial = Trial(stage="verify", plan=plan)
        started = time.perf_counter()
        pin = plan.pin_memory and self.device.type == "cuda"
        with PeakMemory(self.device) as mem:
            try:
                loader = make_loader(self.workload.train_data, plan, start_step=0, pin_memory=pin,
                                     rank=self.dist.rank, world_size=self.dist.world_size)
                self._run(trial, plan, iter(loader), None)
                if self.workload.val_data is not None:
                    self._validate(plan, pin)
            except Exception as e:
                trial.status = "oom" if is_oom(e) else "failed"
                trial.error = first_line(e)
        trial.peak_memory_bytes = mem.peak if trial.status != "failed" else None
        trial.seconds = time.perf_counter() - started
        release(self.device)
        return self._agreed(trial)

    def _validate(self, plan: Plan, pin: bool) -> None:
        """A few validation micro-batches at the plan's micro-batch (memory is what is being proven)."""
        model = self.workload.build_model().to(self.device)
        model.eval()
        from saturate.engine.precision import make_precision

        precision = make_precision(plan.precision, self.device.type, plan.attention)
        with torch.no_grad():
            for i, batch in enumerate(eval_loader(self.workload.val_data, plan, pin)):
                with precision.autocast():
                    self.workload.loss_fn(model, to_device(batch, self.device, plan.non_blocking))
                if i + 1 >= POLICY.windows.eval_batches:
                    break

