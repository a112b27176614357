"""What the doctor measures inside a step: time per phase, and host-device synchronisations.

Phases are marked at their boundaries. On CUDA each mark records an event on the current stream,
so a phase's duration is device time, including the time the device sat idle waiting for the
host inside that phase (waiting for data, a sync, slow kernel launches). On the CPU a mark reads
``time.perf_counter``. Time between explicit phases is "other".

Synchronisations: on CUDA, PyTorch's sync debug mode warns at every synchronising call and the
warnings are counted. The CPU has no such thing (nothing is asynchronous), so there the counter
intercepts the calls that read a tensor's value into Python (``item``, ``float``, ``bool``,
``tolist``, ``numpy``, …): exactly the calls that synchronise a GPU — when the tensor would be on the
GPU. On the CPU every tensor is, so the counter tells them apart the way the GPU run would: a tensor
that requires grad (the parameters, the activations) or came out of an op on one (a loss, a logged
``loss.detach()``, an accuracy from the logits) is the model's, on the device; one that did not (the
index tensors of a ``get_batch``, a dataset's own values) stays on the host there too, and reading
it waits for nothing. Reads inside ``optimizer.step`` are not counted there, because optimizers read
their own CPU-resident step counters, which are no sync on a GPU either.

Each counted sync is put to its place in the user's code (`SyncCounter.site`, set by a script's
hooks: ``train.py:323``), so a fix can name the line.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

PHASES = ("data", "h2d", "forward", "backward", "optimizer", "other")
SYNC_WARNING = "called a synchronizing CUDA operation"
# Tensor methods that hand a value to Python: each one waits for the device on a GPU.
_HOST_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
                         "__complex__", "__format__", "__array__"})


class PhaseClock:
    """Boundary marks -> seconds per phase for each step (device time on CUDA, host time elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type == "cuda"
        self.kind = "device time (CUDA events)" if self.events else "host time (perf_counter)"
        self._marks: list[tuple[str, Any]] = []  # (phase that starts here, event or perf_counter time)
        self._steps: list[tuple[int, int]] = []  # (first mark, last mark) of each finished step
        self._step_start: int | None = None

    def mark(self, phase: str) -> None:
        if self._step_start is None:
            return  # outside a timed step
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self._marks.append((phase, ev))
        else:
            self._marks.append((phase, time.perf_counter()))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.mark(name)
        try:
            yield
        finally:
            self.mark("other")

    def begin_step(self) -> None:
        self._step_start = len(self._marks)
        self.mark("other")

    def end_step(self) -> None:
        if self._step_start is None:
            return
        self.mark("end")
        self._steps.append((self._step_start, len(self._marks) - 1))
        self._step_start = None

    def per_step(self) -> list[dict[str, float]]:
        """Seconds per phase of every finished step. Synchronises the device (call after the window)."""
        if self.events:
            torch.cuda.synchronize(self.device)
        out = []
        for first, last in self._steps:
            split = dict.fromkeys(PHASES, 0.0)
            for i in range(first, last):
                phase, a = self._marks[i]
                _, b = self._marks[i + 1]
                seconds = a.elapsed_time(b) / 1000.0 if self.events else b - a
                split[phase if phase in split else "other"] += seconds
            out.append(split)
        return out


_ON_DEVICE = "_saturate_on_device"  # set on a tensor made from the model's tensors (see the module's docstring)


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None or hasattr(t, _ON_DEVICE))


class _HostReadCounter(TorchFunctionMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _HOST_READS:
            if args and _on_device(args[0]):
                self.owner._count()
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if any(_on_device(a) for a in tree_leaves((args, kwargs))):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not hasattr(t, _ON_DEVICE):
                    with contextlib.suppress(AttributeError, RuntimeError):
                        setattr(t, _ON_DEVICE, True)
        return out


class SyncCounter:
    """Counts synchronisations while active, per phase (set `phase` as the step moves on).

    `method` names what is counted. Counting is paused in the "data" phase on the CPU, where a
    dataset reading its own tensors is not a device sync, and inside the optimizer step (optimizers
    read their CPU step counters: no sync on a GPU either). Not usable with a compiled model on
    the CPU (the function mode would interpose on compiled code); `available` says so.
    """

    # `file.py:line` of the user's code that made a counted read (None: not placed); a script's hooks set it
    site: Callable[[], str | None] | None = None

    def __init__(self, device: torch.device, compiled: bool = False, optimizer_phase: bool = False) -> None:
        self.device = device
        self.sites: dict[str, int] = {}
        # True when the step's optimizer phase is marked (the Stepper, a Profiler given the optimizer): reads
        # inside it are paused by the phase. Otherwise global optimizer-step hooks pause counting, added at
        # start() and removed at stop(), which must then not run inside an optimizer hook (it would change
        # torch's hook dictionaries while they are iterated).
        self.optimizer_phase = optimizer_phase
        self.cuda = device.type == "cuda"
        self.counts: dict[str, int] = {}
        self.phase = "other"
        self._paused = False
        self._active = False
        self._stack: contextlib.ExitStack | None = None
        self.missing: str | None = None
        if self.cuda:
            self.method = "CUDA sync debug mode"
        elif device.type == "cpu":
            self.method = "host reads of tensor values (item, float, bool, tolist, …), each a sync on a GPU"
            if compiled:
                self.missing = ("not counted: the model is compiled, and counting on the CPU would intercept "
                                "compiled code")
        else:
            self.method = "none"
            self.missing = f"not counted: no synchronisation counter for {device.type}"

    @property
    def available(self) -> bool:
        return self.missing is None

    def _count(self) -> None:
        if self._active and not self._paused and not (not self.cuda and self.phase in ("data", "optimizer")):
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
            if SyncCounter.site is not None and (where := SyncCounter.site()):
                self.sites[where] = self.sites.get(where, 0) + 1

    def start(self) -> None:
        if not self.available or self._stack is not None:
            return
        stack = contextlib.ExitStack()
        if self.cuda:
            previous = torch.cuda.get_sync_debug_mode()
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("always", UserWarning)
            original = warnings.showwarning

            def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                     line: Any = None) -> None:
                if SYNC_WARNING in str(message):
                    self._count()
                else:
                    original(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        else:
            if not self.optimizer_phase:
                from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

                pre = register_optimizer_step_pre_hook(lambda *a: setattr(self, "_paused", True))
                post = register_optimizer_step_post_hook(lambda *a: setattr(self, "_paused", False))
                stack.callback(post.remove)
                stack.callback(pre.remove)
            stack.enter_context(_HostReadCounter(self))
        self._stack = stack
        self._active = True

    def stop(self) -> None:
        self._active = False
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def __enter__(self) -> SyncCounter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def total(self) -> int:
        return sum(self.counts.values())
