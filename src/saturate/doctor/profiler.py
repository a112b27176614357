"""The doctor in a training loop saturate did not write: three added lines.

    from saturate import Profiler
    prof = Profiler(model, optimizer)          # model and optimizer are optional
    for x, y in prof.data(loader):             # was: for x, y in loader:
        ...                                    # the user's step, unchanged
        prof.step()                            # once per optimizer step

After `warmup + count_steps + steps` steps (and `trace_steps` more traced, given `trace=FOLDER`: doctor/trace.py)
the diagnosis is printed (and kept as `prof.diagnosis`); the hooks are then removed and the loop runs on uninstrumented.

What is timed: waiting for the loader (the wrapper), the model's forward (module hooks), its
backward (a hook on the output's autograd node and an end-of-backward callback), the
optimizer step (optimizer hooks), and everything else as "other" (the copy to the device, the
loss, the user's own code). Without a model or optimizer those phases are part of "other".

The Profiler times the steps it was asked for, no more (a user's loop, or a script saturate stops after
them); they are split into up to five windows afterwards (`doctor.phase_windows.split`), and the shares' ranges
and the step-time spread the rules use are over those windows.
The hooks' own time over the timed steps (`selftime`) is kept as `prof.instrumentation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from saturate.doctor import selftime
from saturate.doctor.findings import Diagnosis, Measurements
from saturate.doctor.instrument import Instrument, device_facts, loader_worker_pids
from saturate.doctor.loop_facts import batch_len, device_of, grad_nodes, is_compiled, precision_of
from saturate.doctor.rules import decide
from saturate.doctor.trace import TRACE_NAME, TRACE_STEPS, PhaseTrace
from saturate.errors import SaturateError
from saturate.hardware.contention import ContentionMeter
from saturate.policy import POLICY

T = TypeVar("T")


class Profiler:
    """Phase split, syncs, telemetry and a verdict for a user's own training loop."""

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 warmup: int = 3, count_steps: int = 2, steps: int = 20, device: str | torch.device | None = None,
                 report: bool = True, host_memory_budget: int | None = None, interval: float = 0.25,
                 probe_scaling: bool = False, trace: str | Path | None = None, trace_steps: int = TRACE_STEPS,
                 trace_name: str = TRACE_NAME) -> None:
        for name, v, low in (("warmup", warmup, 0), ("count_steps", count_steps, 0), ("steps", steps, 1),
                             ("trace_steps", trace_steps, 1)):
            if v < low:
                raise SaturateError(f"Profiler: {name} must be >= {low}, got {v}")
        self.warmup, self.count_steps, self.steps = warmup, count_steps, steps
        # a folder: the `trace_steps` steps after the timed ones traced there (doctor/trace.py), then the diagnosis
        self.trace, self.trace_steps, self.trace_name = (Path(trace) if trace else None), trace_steps, trace_name
        self.report = report
        self.model = model
        self.device = device_of(model, device)
        compiled = model is not None and is_compiled(model)
        self.instrument = Instrument(self.device, compiled=compiled, interval=interval, host_budget=host_memory_budget,
                                     optimizer_phase=optimizer is not None)
        self.diagnosis: Diagnosis | None = None
        self.instrumentation: dict[str, Any] | None = None  # the hooks' own time over the timed steps
        self._own: list[tuple[int, int]] = []  # selftime marks at the timed steps' boundaries
        self._step = 0  # steps finished
        self._precision: str | None = None  # what the first forward ran in: fp32, or autocast's bf16/fp16
        self._handles: list[Any] = []
        self._loader: Any = None
        self._iterator: Any = None
        self._batches = 0  # loader batches fetched in the timed window
        self._samples = 0
        self._done = False
        # probe_scaling: after the window, the model's forward+backward at its micro-batch and twice it on the
        # inputs last seen (loop_probe.py) — extra passes through the user's model, so only where the run stops
        # right after (a script's doctor run)
        self.probe_scaling = probe_scaling and model is not None
        self._inputs: tuple[tuple, dict, torch.dtype | None] | None = None
        if self.probe_scaling:
            self._handles.append(model.register_forward_pre_hook(self._capture, with_kwargs=True))
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._forward_begin))
            self._handles.append(model.register_forward_hook(self._forward_end))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._step_begin))
            self._handles.append(optimizer.register_step_post_hook(lambda *a: self._leave("optimizer")))
        self._stage_for(0)

    # --- the three lines ----------------------------------------------------------------------

    def data(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate `loader`, timing each wait for the next batch."""
        iterator = iter(loader)
        while True:
            try:
                batch = self.next_batch(iterator, loader)
            except StopIteration:
                return
            yield batch

    @selftime.own
    def next_batch(self, iterator: Iterator[T], loader: Any = None, fetch: Callable[[Any], T] = next) -> T:
        """One batch from `iterator` (`fetch(iterator)`), the wait timed as waiting for data. The body of
        `data()`; saturate's hooks in a user's unchanged script call it from the DataLoader iterator."""
        if loader is not None:
            self._loader = loader
        if self._done:
            return selftime.foreign(fetch, iterator)
        if iterator is not self._iterator:
            self._iterator = iterator
            self.instrument.worker_pids |= loader_worker_pids(iterator)
        entered = self.instrument.enter("data")
        try:
            batch = selftime.foreign(fetch, iterator)
        finally:
            if entered:
                self.instrument.leave()
        if self.instrument.mode == "time":
            self._batches += 1
            self._samples += batch_len(batch)
        return batch

    @selftime.own
    def step(self) -> None:
        """Mark the end of one optimizer step."""
        if self._done:
            return
        if self.instrument.mode == "time":
            self._own.append(selftime.mark())
        self.instrument.end_step()
        self._step += 1
        if self.diagnosis is not None:  # the steps traced after the timed ones
            if self.instrument.traced is not None:
                self.finish()
            return
        self._stage_for(self._step)

    @property
    def finished(self) -> bool:  # the diagnosis made and, where asked, the steps after it traced: the hooks gone
        return self._done

    # --- stages -------------------------------------------------------------------------------

    def _stage_for(self, step: int) -> None:
        inst = self.instrument
        counting_from, timing_from = self.warmup, self.warmup + self.count_steps
        if step == counting_from and self.count_steps > 0:
            inst.begin_count()
        if step == timing_from:
            if inst.mode == "count":
                inst.end_count(self.count_steps)
            inst.begin_timing()
            self._own = [selftime.mark()]
        if step == timing_from + self.steps:
            if self.trace is None:
                self.finish()
                return
            self._diagnose()  # the hooks stay for the steps traced next
            inst.begin_trace(PhaseTrace(self.device, self.trace, self.trace_steps, self.trace_name))
            return
        inst.begin_step()

    def finish(self) -> Diagnosis:
        """The diagnosis from the steps timed so far (called by itself when the window, and the trace after it where
        one was asked for, are complete); a trace cut short by the loop's end is written as far as it got."""
        if self._done:
            assert self.diagnosis is not None
            return self.diagnosis
        try:
            diagnosis = self.diagnosis or self._diagnose()
            if (files := self.instrument.end_trace()) is not None:
                diagnosis.measurements.trace = files.to_dict()
        finally:
            self._done = True
            self._remove_hooks()  # a no-op when _diagnose removed them
        if self.report:
            from saturate.doctor.report import render

            render(diagnosis)
        return diagnosis

    def _diagnose(self) -> Diagnosis:
        inst = self.instrument
        if self.trace is None:  # the hooks off before the probe's passes, as the loop runs on without them
            self._done = True
            self._remove_hooks()
        if inst.mode == "time":
            inst.end_timing()
        inst.close()
        if inst.timed_steps < 1:
            raise SaturateError(f"Profiler: only {self._step} step(s) ran; the diagnosis needs at least "
                                f"{self.warmup + self.count_steps + 1} (warm-up {self.warmup}, counted "
                                f"{self.count_steps}, then at least one timed step)")
        loader = self._loader
        steps = inst.timed_steps
        self.instrumentation = {**selftime.summary(self._own, [sum(s.values()) for s in inst.clock.per_step()]),
                                "sampler_cpu_s": inst.sampler.read_seconds if inst.sampler is not None else None}
        context: dict[str, Any] = {"context": "loop"}
        if self._batches:
            context["grad_accum"] = round(self._batches / steps)
            context["samples_per_step"] = self._samples / steps if self._samples else None
        if loader is not None:
            context["micro_batch"] = getattr(loader, "batch_size", None) or \
                getattr(getattr(loader, "batch_sampler", None), "batch_size", None)  # Accelerate's, a Trainer's
            context["num_workers"] = getattr(loader, "num_workers", None)
            context["prefetch_factor"] = getattr(loader, "prefetch_factor", None)
            context["pin_memory"] = getattr(loader, "pin_memory", None)
        if self._precision is not None:
            context["precision"] = self._precision
        context.update(device_facts(self.device))  # the name and native bf16 as probe() says, like `saturate doctor`
        m = inst.measurements(**context)
        if self.probe_scaling:
            self._probe(m)
        self.diagnosis = decide(m)
        return self.diagnosis

    # --- hooks --------------------------------------------------------------------------------

    @selftime.own
    def _enter(self, phase: str) -> None:
        if not self._done:
            self.instrument.enter(phase)

    @selftime.own
    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.instrument.mode == "time" or self._inputs is None:  # the timed window's last forward, at the end
            autocast = None
            with contextlib.suppress(TypeError, RuntimeError):
                if torch.is_autocast_enabled(self.device.type):
                    autocast = torch.get_autocast_dtype(self.device.type)
            self._inputs = (args, kwargs, autocast)

    def _probe(self, m: Measurements) -> None:
        """The batch-scaling probe on the last inputs seen (`m.scaling`), or a note saying why there is none."""
        from saturate.doctor.loop_probe import again_on_one_thread, one_thread, probe_from_inputs, time_thread_counts

        if self._inputs is None:
            return
        args, kwargs, autocast = self._inputs
        self._inputs = None
        model = self.model
        assert model is not None
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            m.notes.append("batch-scaling probe skipped: several processes (a replayed backward would wait for the "
                           "others' gradients)")
            return
        if type(model).__name__ == "OptimizedModule":
            m.notes.append("batch-scaling probe skipped: the model is compiled (a new batch size recompiles it)")
            return
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()), None)
        micro = m.micro_batch or (int(first.shape[0]) if first is not None else None)
        if not micro:
            return
        meter = ContentionMeter().start()
        probe, why = probe_from_inputs(model, args, kwargs, micro, self.device, autocast)
        measured = (m.phases.get("forward", 0.0) + m.phases.get("backward", 0.0)) / max(1, m.grad_accum or 1)
        busy = bool((m.contention or {}).get("significant"))
        ratio = probe.seconds[0] / measured if probe is not None and measured > 0 else None
        # The replay against the script's own micro-step, within POLICY.doctor.probe_slower and probe_faster (no
        # bound on faster when the machine was busy: a load only slows the script's figure)
        slower, faster = POLICY.doctor.probe_slower, POLICY.doctor.probe_faster
        stands = probe is not None and (ratio is None or ratio <= slower and (busy or ratio >= 1 / faster))
        if probe is not None and not stands:
            why = (f"batch-scaling probe left out: its replayed forward+backward at micro-batch {micro} took "
                   f"{1e3 * probe.seconds[0]:.3g} ms, the script's own {1e3 * measured:.3g} ms per micro-step: the "
                   "replay does not stand for the script's step (or the load moved one of them)")
        elif probe is not None and ratio is not None and ratio < 1 / faster:
            m.notes.append(f"batch-scaling probe's replayed forward+backward at micro-batch {micro} took "
                           f"{1e3 * probe.seconds[0]:.3g} ms, the script's own {1e3 * measured:.3g} ms per micro-step "
                           "while other processes kept the machine busy: a load only slows, so that is not read as "
                           "the replay not standing for the step")
        if stands:
            m.scaling, m.micro_batch = probe, micro
        elif why:
            m.notes.append(why)
        # On a busy CPU, the probe again on one thread and the thread counts timed against each other — the latter
        # also when the replay was left out: it times the model's own forward+backward under the load either way
        if probe is not None and again_on_one_thread(self.device, busy or meter.stop().significant()):
            threads = torch.get_num_threads()
            ratios: list[float] = []
            with one_thread():
                single, why = probe_from_inputs(
                    model, args, kwargs, micro, self.device, autocast,
                    also=lambda step: ratios.extend(time_thread_counts(step, micro, threads, self.device)))
            m.scaling_one_thread = single if stands else None
            m.threads_ratios = tuple(ratios)
            if why:
                m.notes.append(f"on one thread, {why}")

    @selftime.own
    def _step_begin(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The optimizer step begins — or, for `step(closure)` (Lightning runs `training_step` and `backward` that
        way, LBFGS calls it several times), it begins once the closure has returned: the closure is handed on
        wrapped so that its forward and backward are timed as theirs, not as the optimizer's."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if self._done or not callable(closure):
            self._enter("optimizer")
            return None

        def timed_closure() -> Any:
            self._leave("optimizer")
            try:
                return closure()
            finally:
                self._enter("optimizer")

        if "closure" in kwargs:
            return args, {**kwargs, "closure": timed_closure}
        return (args[0], timed_closure, *args[2:]), kwargs

    @selftime.own
    def _leave(self, phase: str) -> None:
        if not self._done and self.instrument.phase == phase:
            self.instrument.leave()

    @selftime.own
    def _forward_begin(self, module: nn.Module, args: Any) -> None:
        if self._precision is None:
            self._precision = precision_of(module, self.device)
        self._enter("forward")  # ignored inside backward (activation checkpointing re-runs forward there)

    @selftime.own
    def _forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._done or self.instrument.phase != "forward":
            return
        self.instrument.leave()
        if self.instrument.mode == "idle":
            return
        nodes: list[Any] = []
        grad_nodes(output, nodes)
        if nodes:
            fired = [False]

            def begin(grad_outputs: Any) -> None:
                self._backward_begin(fired)

            for node in nodes:
                node.register_prehook(begin)

    @selftime.own
    def _backward_begin(self, fired: list[bool]) -> None:
        """The first of the forward output's autograd nodes to run: backward begins (once per forward)."""
        if fired[0]:
            return
        fired[0] = True
        if self.instrument.enter("backward"):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._leave("backward"))

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
