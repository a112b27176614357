"""Inside a user's script, unchanged: find its training step without help and measure it.

Installed by the shim (`shim/sitecustomize.py`) in every Python process of the command once it
imports torch; the parent saturate process passes its settings through the environment and reads
what this writes into `SATURATE_SCRIPT_DIR` (what crosses, both ways: `script/boundary.py`). Nothing
in the user's files is touched.

- Optimizer steps come from PyTorch's global optimizer-step hooks; the first optimizer to step is
  the one followed (a second optimizer's steps are not counted as steps); in a whole run, a later
  optimizer is followed once the one before it was freed (each point of a grid search).
- The model is found without help: until the first optimizer step, global forward hooks note the
  modules called at the top level; the one owning most of the optimizer's parameters is the model.
  The global hooks are then removed (they would cost a call per submodule).
- DataLoaders record where they were made (`train.py:123`; for a library's copy of the script's own
  loader, such as Accelerate's `prepare`, where the script made the original), their settings and their
  fingerprint; waiting for a batch is timed by wrapping the DataLoader iterator's `__next__` (`loader_hooks`).
- Backward passes are counted until the first optimizer step: a script that updates its weights by hand (no
  torch.optim step) is stopped once its model's weights changed between backward passes `HAND_UPDATES` times
  (or at `BACKWARDS_WITHOUT_STEP`), with one line for the parent, in a doctor run or a trial, instead of running
  to its end.
- From the first optimizer step on, the doctor's `Profiler` times phases, counts syncs and samples
  telemetry over warm-up, counted and timed steps, exactly as for a loop that calls it by hand.
  When its window is complete the measurements are written (rank 0) and, in doctor mode, the
  process exits at once (`os._exit`), so none of the script's own code (saving, evaluation) runs
  after saturate stopped it.
- A Transformers `Trainer` is recognised when the script imports Transformers (`trainer_hooks`): its
  arguments, where it was made, its per-step losses; overrides are applied to its `TrainingArguments`
  and, in a trial or a doctor run (not a full run), its output folders point to a scratch folder.
  A Lightning `Trainer` likewise (`lightning_hooks`): where it was made, its arguments, its
  `default_root_dir` pointed to the scratch folder in a trial or doctor run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from saturate.doctor import selftime
from saturate.script.boundary import (
    ENV_DIR,
    ENV_SETTINGS,
    ERROR,
    FIRST_STEP,
    REPORT,
    STATUS,
    SUMMARY,
    TRACE_DIR,
    ChildSettings,
)
from saturate.script.child import found, lightning_hooks, loader_hooks, split_source
from saturate.script.child.found import caller_site
from saturate.script.child.loop_compile import LoopCompile
from saturate.script.child.loop_precision import LoopPrecision
from saturate.script.child.patches import Patches
from saturate.script.child.trainer_hooks import TrainerWatch
from saturate.script.child.trial_windows import StepWindows
from saturate.script.overrides import FUSED_OPTIMIZERS

# Before the first optimizer step, a doctor run or a trial stops the script at this many backward passes (more than
# any accumulation in practice) or weight changes between them (an update by hand)
BACKWARDS_WITHOUT_STEP, HAND_UPDATES = 256, 2

# handed to `imported` by the shim once they have run
WATCHED = ("transformers.training_args", "transformers.trainer", *lightning_hooks.WATCHED)

_script: Script | None = None


def install() -> None:
    """Install the hooks in this process (once); a no-op without saturate's environment."""
    global _script
    if _script is not None or not os.environ.get(ENV_DIR):
        return
    _script = Script(Path(os.environ[ENV_DIR]), ChildSettings.from_json(os.environ.get(ENV_SETTINGS)))
    _script.install()


def imported(name: str, module: Any) -> None:
    """The shim's call when a watched module has run: wrap Transformers' Trainer/TrainingArguments, or
    Lightning's Trainer."""
    if _script is not None:
        _script.patch(name, module)


class Script:
    """The hooks and what they saw in one process."""

    def __init__(self, folder: Path, settings: ChildSettings) -> None:
        self.folder = folder
        self.warmup, self.count_steps, self.steps = settings.warmup, settings.count_steps, settings.steps
        self.stop = settings.stop
        self.trace_steps = settings.trace_steps  # a doctor run's steps traced after the timed ones (0: none)
        self.profile = settings.profile  # False: only count steps and samples (a full run)
        self.overrides = settings.overrides  # what `tune -- CMD` tries or found
        self.step_times: list[float] = []  # without the Profiler: when each optimizer step ended
        self.samples = 0  # without the Profiler: samples fetched from DataLoaders
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.windows = StepWindows(settings.windows, self.world)  # a trial's timed windows, if asked
        self.windows.on_gate = lambda: self._report(final=False)  # gated: the parent reads it while the run waits
        self.optimizer: Any = None  # the optimizer the Profiler follows
        self._followed: weakref.ref | None = None  # without the Profiler: the optimizer whose steps are counted
        self.optimizer_steps = 0
        # backward passes until the first optimizer step; of these, how many found the model's weights changed
        self.backwards, self.hand_updates, self._weight_sample = 0, 0, None  # (`_count_backward`)
        self.in_step = False  # between an optimizer's step pre-hook and its post-hook (a closure's passes)
        self.threads_asked: int | None = None  # what the script gave torch.set_num_threads under a threads override
        self.split_set: dict[str, str] | None = None  # a trial's split: each name set where the loop keeps it, or not
        self.first_rows: int | None = None  # the first top-level forward's leading dimension (a loop's micro-batch)
        self.batch_rows: int | None = None  # the samples in the last batch a DataLoader gave before the first step
        self.configurator: dict[str, Any] | None = None  # a configurator script's split (split_source.configurator)
        self.parsed: dict[str, Any] | None = None  # its argparse flags that say batch or accumulation (the same)
        self.roots: list[weakref.ref] = []  # modules whose forward ran at the top level before the first step
        self._depth = 0
        self._forward_hooks: list[Any] = []
        self.loaders: dict[int, dict[str, Any]] = {}  # id(DataLoader) -> where it was made, settings, batches
        self.profiler: Any = None
        self.patches = Patches()  # what install() changed in torch, undone when the Profiler's window ends
        self.model_info: dict[str, Any] | None = None
        self.done = False
        self.started = time.perf_counter()  # about when torch finished importing
        self.first_step_s: float | None = None  # from then to the end of the first optimizer step
        self.mode = settings.mode  # doctor, trial, apply (a full run with the overrides)
        scratch = None if self.mode == "apply" else folder / "trainer"
        self.trainer = TrainerWatch(self.overrides.trainer, scratch, caller_site)
        self.lightning = lightning_hooks.LightningWatch(self.overrides.lightning, scratch, caller_site)
        self.loop = LoopPrecision(self.overrides.bf16_autocast, keep_losses=self.mode == "trial")  # a plain loop's
        self.compiler = LoopCompile(self.overrides.compile, self.world)  # its model compiled from outside

    # --- installing ---------------------------------------------------------------------------

    def patch(self, name: str, module: Any) -> None:
        (self.lightning if name in lightning_hooks.WATCHED else self.trainer).patch(name, module)

    def install(self) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from saturate.doctor.phases import SyncCounter

        SyncCounter.site = found.read_site  # each counted sync placed at its line (a library's: with the user's call)

        self.patches.hook(register_optimizer_step_post_hook(selftime.own(self._after_step)))
        # an optimizer that runs the script's closure inside its step (LBFGS: forward, backward and a weight update
        # several times a step) is not updating weights by hand: backward passes inside a step are not counted
        self.patches.hook(register_optimizer_step_pre_hook(lambda *a: setattr(self, "in_step", True)))
        self._forward_hooks = [register_module_forward_pre_hook(selftime.own(self._forward_pre)),
                               register_module_forward_hook(selftime.own(self._forward_post))]
        script = self
        optimizer_init = torch.optim.Optimizer.__init__

        for name in WATCHED:  # imported before torch finished importing (a rare order): wrap them now
            if name in sys.modules:
                self.patch(name, sys.modules[name])
        if self.mode == "trial":  # trials start from the same weights and batches even if the script never seeds
            random.seed(0)
            torch.manual_seed(0)
            # torch's warning that the workers outnumber the cores, twice per loader, in every trial of a count
            warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)  # that it is measuring
        if self.overrides.tf32:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if self.overrides.threads is not None:  # kept whatever the script sets: its own call is noted, not done
            torch.set_num_threads(self.overrides.threads)
            self.patches.replace(torch, "set_num_threads", lambda n: setattr(script, "threads_asked", n))
        self._fuse_optimizers()
        self.loop.install(torch, self.patches)

        def optimizer_created(opt: Any, *args: Any, **kwargs: Any) -> None:
            optimizer_init(opt, *args, **kwargs)
            if not hasattr(opt, "_saturate_site"):
                opt._saturate_site = caller_site()

        autograd_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            script.loop.backward(args, kwargs)
            if script.optimizer_steps == 0 and not script.in_step:
                script._count_backward()
            return autograd_backward(*args, **kwargs)

        loader_hooks.install(self)
        split_source.install(self.patches)
        sys.argv.extend(self.overrides.argv())  # flags for its configurator or argparse, read after torch is imported
        patched = [(torch.optim.Optimizer, "__init__", optimizer_created)]
        if self.mode != "apply":  # a doctor run or a trial: nothing on a full run's backward pass
            patched.append((torch.autograd, "backward", backward))  # Tensor.backward calls it
        for owner, name, value in patched:
            self.patches.replace(owner, name, value)
        atexit.register(self._at_exit)

    def _fuse_optimizers(self) -> None:
        """Apply `{"optimizer": {"fused": …}}` to torch's Adam and AdamW as the script makes them."""
        import torch

        for name in FUSED_OPTIMIZERS if self.overrides.optimizer else ():
            cls = getattr(torch.optim, name)
            changes = self.overrides.optimizer_changes(cls)

            def init(opt: Any, *args: Any, _init: Any = cls.__init__, _changes: dict = changes, **kwargs: Any) -> None:
                _init(opt, *args, **{**kwargs, **_changes})

            cls.__init__ = init  # type: ignore[method-assign]

    @property
    def rows(self) -> int | None:
        """A micro-batch's samples: the first forward's leading dimension, else (a forward given only keywords,
        `model(**batch)`) the last DataLoader batch before the first optimizer step."""
        return self.first_rows if self.first_rows is not None else self.batch_rows

    # --- hooks --------------------------------------------------------------------------------

    def _forward_pre(self, module: Any, args: Any) -> None:
        if self._depth == 0 and not any(r() is module for r in self.roots):
            self.roots.append(weakref.ref(module))
        if self._depth == 0 and self.first_rows is None:
            first = next((a for a in args if getattr(a, "ndim", 0)), None)
            self.first_rows = int(first.shape[0]) if first is not None else None
        self._depth += 1

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.in_step = False
        if not self._follows(optimizer):
            return
        self.optimizer_steps += 1
        self.compiler.end_step()
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.started
            self.configurator = split_source.configurator()
            self.parsed = split_source.parsed()
            if self.overrides.flags:
                self.split_set = split_source.flags_set(dict(self.overrides.flags), self.rows, self.backwards)
        self.trainer.end_step()
        self.lightning.end_step()
        self.loop.end_step()
        if not self.profile:
            if self.optimizer_steps == 1:
                self._write(FIRST_STEP, "")
                if self.overrides.compile:
                    self.compiler.apply(found.model_of(optimizer, self.roots)[0])
                for h in self._forward_hooks:  # a full run needs no model: a call per module call, gone
                    h.remove()
            self.step_times.append(time.perf_counter())
            return
        if self.optimizer is None:
            self._start(optimizer)
            return
        self.profiler.step()
        if self.profiler.finished and self.windows.step():  # then a trial's windows, if asked
            self._report()
            self._exit() if self.stop else self.patches.detach(self.profiler.model)  # nothing of saturate stays

    def _count_backward(self) -> None:
        """One more backward pass before any optimizer step: the script (weights updated by hand, `p.data.add_`)
        is stopped with one line once its model's weights changed between passes `HAND_UPDATES` times, or at
        `BACKWARDS_WITHOUT_STEP` passes — not run whole waiting for a step that never comes."""
        self.backwards += 1
        changed, self._weight_sample = found.weights_changed(self.roots, self._weight_sample)
        self.hand_updates += changed
        if self.hand_updates < HAND_UPDATES and self.backwards < BACKWARDS_WITHOUT_STEP:
            return
        how = (f"changed its weights between backward passes {self.hand_updates} times"
               if self.hand_updates >= HAND_UPDATES else f"ran {self.backwards} backward passes")
        self._write(ERROR.format(pid=os.getpid()),
                    f"the script {how} without a torch.optim optimizer step (does it update its weights by hand, "
                    "such as p.data.add_(...)?); saturate times the steps of a torch.optim optimizer, so it "
                    "stopped the script rather than run the whole job")
        self._exit()

    def _follows(self, optimizer: Any) -> bool:
        """Whether `optimizer`'s step is the script's step: the first optimizer to step is followed; in a whole run
        (no Profiler) a later one is, once the one followed before was freed (a grid search's next point)."""
        if self.done:
            return False
        if self.profile:
            return self.optimizer is None or optimizer is self.optimizer
        followed = self._followed() if self._followed is not None else None
        if followed is None:
            self._followed = weakref.ref(optimizer)
            return True
        return followed is optimizer

    def _start(self, optimizer: Any) -> None:
        """After the first optimizer step: the model is known; the Profiler takes over."""
        from saturate.doctor.profiler import Profiler

        self.optimizer = optimizer
        for h in self._forward_hooks:
            h.remove()
        model, self.model_info = found.model_of(optimizer, self.roots)
        self.compiler.apply(model)  # before the Profiler, which must know whether the model is compiled
        self.profiler = Profiler(model, optimizer, warmup=self.warmup, count_steps=self.count_steps,
                                 steps=self.steps, report=False, probe_scaling=self.mode == "doctor" and self.stop,
                                 trace=self.folder / TRACE_DIR if self.trace_steps else None,
                                 trace_steps=max(1, self.trace_steps),
                                 trace_name="trace" if self.world == 1 else f"rank{self.rank}_trace")
        self._write(FIRST_STEP, "")

    # --- what is written ----------------------------------------------------------------------

    def _report(self, note: str | None = None, final: bool = True) -> None:
        """Write the measurements (rank 0); `final` False: written again later (a gated trial's first report)."""
        self.done = self.done or final
        if self.rank != 0:
            return
        d = self.profiler.diagnosis
        m = d.measurements.to_dict()
        if note:
            m["notes"].append(note)
        opt = self.optimizer
        defaults = getattr(opt, "defaults", {})
        self._write(REPORT, json.dumps({
            "world_size": self.world,
            "measurements": m,
            "loaders": found.live_loaders(self.loaders) or found.iterated_loaders(self.loaders),
            "optimizer": {"class": type(opt).__name__, "site": getattr(opt, "_saturate_site", None),
                          "fused": defaults.get("fused"), "foreach": defaults.get("foreach")},
            "model": self.model_info, "optimizer_steps": self.optimizer_steps,
            "first_step_s": self.first_step_s, "windows": self.windows.record(),
            "threads": {"in_force": found.torch_threads(), "asked_by_script": self.threads_asked},
            "split_set": self.split_set,
            "configurator": self.configurator and {**self.configurator, "rows": self.rows, "backwards": self.backwards},
            "argparse": self.parsed and {**self.parsed, "rows": self.rows, "backwards": self.backwards},
            "trainer": self.trainer.report(),
            "lightning": self.lightning.report(),
            "loop": self.loop.report(),
            "compile": self.compiler.report(),
            "instrumentation": self.profiler.instrumentation,
        }, default=str))

    def _write(self, name: str, text: str) -> None:
        tmp = self.folder / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, self.folder / name)

    def _exit(self) -> None:
        """Stop the script now: nothing of its own (saving, evaluating) runs after saturate stopped it."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)

    def _at_exit(self) -> None:
        """The script ended by itself: report the steps timed so far, or how far it got."""
        if not self.profile:
            if self.rank == 0 and self.step_times:
                self._write(SUMMARY, json.dumps({
                    "world_size": self.world, "optimizer_steps": self.optimizer_steps, "samples": self.samples,
                    "loaders": found.iterated_loaders(self.loaders), "lightning": self.lightning.report(),
                    "step_times": self.step_times, "trainer": self.trainer.report(),
                    "compile": self.compiler.report(),
                    "instrumentation": selftime.totals()}))
            return
        if self.done or self.profiler is None:
            return
        inst = self.profiler.instrument
        if self.profiler.diagnosis is not None or (inst.mode == "time" and inst.timed_steps >= 1):
            self.profiler.finish()
            self._report(self.windows.cut_short() or f"the script ended after {inst.timed_steps} timed step(s), "
                         f"fewer than the {self.steps} asked for")
        elif self.rank == 0:
            self._write(STATUS.format(pid=os.getpid()), json.dumps({"optimizer_steps": self.optimizer_steps}))
