"""`saturate tune -- CMD`'s Trainer stages on a fake machine: a runner that answers each trial from its
overrides, so every decision (losses checked, the effective batch kept, memory, compile's pay-back) is
tested without running a script."""

from __future__ import annotations

from typing import Any

from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptFailed, ScriptRun
from saturate.script.overrides import Overrides
from saturate.script.tune_script import ScriptTrial, tune_command
from saturate.script.tuning import ScriptTuning, edits

WRITTEN = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "bf16": False, "fp16": False,
           "optim": "adamw_torch", "torch_compile": False, "gradient_checkpointing": False, "max_steps": 1000}
LOSSES = [5.0, 4.8, 4.6, 4.5, 4.4]


class FakeMachine:
    """Step time falls with the micro-batch up to `fits` (twice that with activation checkpointing), above
    which a trial runs out of memory; bf16 and
    the fused optimizer each save a share; bf16's losses drift by `bf16_drift`; compile saves `compile_gain`
    per step and costs `compile_s` at start-up."""

    def __init__(self, device: str = "cpu", fits: int = 16, bf16_drift: float = 0.001, compile_gain: float = 0.5,
                 compile_s: float = 60.0, written: dict[str, Any] | None = None) -> None:
        self.device, self.fits, self.bf16_drift = device, fits, bf16_drift
        self.compile_gain, self.compile_s = compile_gain, compile_s
        self.written = written or WRITTEN
        self.runs: list[dict[str, Any]] = []
        self.penalty_above: int | None = None  # micro-batches above this are twice as slow per sample
        self.optimizer_share: float | None = None  # the optimizer phase's share of the step (None: not timed)
        self.step_at: dict[int, float] = {}  # a micro-batch's step time per micro-step, in place of the formula's

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:

        over = settings.overrides.trainer
        self.runs.append(over)
        args = {**self.written, **over}
        micro, accum = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
        if micro > self.fits * (2 if args.get("gradient_checkpointing") else 1):
            raise ScriptFailed("the script failed before its first optimizer step (exit code 1: "
                               "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)",
                               out_of_memory=True)
        step = accum * self.step_at.get(micro, 0.1 + 0.4 / micro * micro ** 0.5)  # fixed + sublinear in the batch
        if self.penalty_above is not None and micro > self.penalty_above:
            step *= 4
        losses = list(LOSSES)
        if args.get("bf16"):
            step *= 0.6
            losses = [x * (1 + self.bf16_drift) for x in losses]
        if args.get("optim") == "adamw_torch_fused":
            step *= 0.9
        if args.get("gradient_checkpointing"):
            step *= 1.2
        first = 5.0
        if args.get("torch_compile"):
            step *= self.compile_gain
            first += self.compile_s
        phases = {"data": 0.0} if self.optimizer_share is None else {"data": 0.0, "optimizer": self.optimizer_share
                                                                     * step}
        report = {"measurements": {"step_s": step, "samples_per_step": micro * accum, "phases": phases,
                                   "steps": 3, "device_type": self.device},
                  "loaders": [], "first_step_s": first,
                  "trainer": {"class": "Trainer", "site": "train.py:82", "args_class": "TrainingArguments",
                              "args_site": "train.py:65", "args": self.written, "planned_steps": 1000,
                              "losses": losses, "error": None}}
        return ScriptRun(list(command), 0, report, None, 5, 1.0)


def tune(machine: FakeMachine, supports: dict[str, bool] | None = None) -> ScriptTuning:
    return tune_command(["python", "train.py"], runner=machine, supports=supports or {"bf16": True})


def by_name(tuning: ScriptTuning) -> dict[str, ScriptTrial]:
    return {t.name: t for t in tuning.trials}


def splits_tried(tuning: ScriptTuning) -> list[tuple[int, int]]:
    return [(t.overrides.trainer["per_device_train_batch_size"], t.overrides.trainer[
        "gradient_accumulation_steps"]) for t in tuning.trials if t.name.startswith("micro-batch")]


def test_every_split_keeps_the_effective_batch_and_the_climb_goes_up_while_it_gains():
    tuning = tune(FakeMachine())
    assert splits_tried(tuning) == [(8, 2), (16, 1)]  # upwards over the exact splits of 4 × 4, each one gaining
    assert all(t.samples_per_step == 16 for t in tuning.trials)
    best = tuning.best.overrides.trainer
    assert (best["per_device_train_batch_size"], best["gradient_accumulation_steps"]) == (16, 1)


def test_the_climb_stops_at_the_first_split_that_does_not_gain_and_goes_one_down_when_none_above_helped():
    machine = FakeMachine(written={**WRITTEN, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 16})
    machine.penalty_above = 2  # larger micro-batches are slower on this machine
    tuning = tune(machine)
    assert splits_tried(tuning) == [(4, 8), (1, 32)]  # one up (slower: the climb stops), then one down
    assert "micro-batch: 2 × accumulation 16 (as written 2 × 16; the effective batch 32 kept; tried: 4 × 8, " \
           "1 × 32)" in tuning.decisions


def test_the_climb_goes_one_split_past_a_level_one_and_no_further():
    machine = FakeMachine(written={**WRITTEN, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8})
    # per micro-step; the step is accumulation × this: 4 × 4 times as 2 × 8 does (a plateau), 8 × 2 twice as fast
    machine.step_at = {2: 0.1, 4: 0.2, 8: 0.2, 16: 0.4}
    tuning = tune(machine)
    assert splits_tried(tuning) == [(4, 4), (8, 2), (16, 1)]  # past the level 4 × 4; 16 × 1 level again: it stops
    assert by_name(tuning)["micro-batch 4 × 4"].verdict in ("within noise", "under the minimum gain")
    best = tuning.best.overrides.trainer
    assert (best["per_device_train_batch_size"], best["gradient_accumulation_steps"]) == (8, 2)
    machine.step_at = {2: 0.1, 4: 0.21, 8: 0.05}  # 4 × 4 slower, by less than the minimum gain: no further
    assert splits_tried(tune(machine)) == [(4, 4), (1, 16)]


def test_a_split_within_the_noise_either_way_is_level_and_one_slower_beyond_it_is_not():
    from saturate.script.trainer_stages import _level

    def trial(verdict: str, gain: float) -> ScriptTrial:
        return ScriptTrial("micro-batch 4 × 2", Overrides(), 0.1, None, 0.0, 4, verdict=verdict, gain=gain)

    assert _level(trial("within noise", -0.354)) and _level(trial("within noise", 0.178))  # run_clm's 4 × 2
    assert _level(trial("under the minimum gain", 0.01)) and not _level(trial("under the minimum gain", -0.02))
    assert not _level(trial("slower", -0.2)) and not _level(ScriptTrial.failed("micro-batch 8 × 1", Overrides(), "x"))


def test_bf16_is_kept_when_its_losses_stay_close_and_refused_when_they_drift():
    close = tune(FakeMachine(bf16_drift=0.001))
    assert close.best.overrides.trainer["bf16"] is True and close.best.overrides.trainer["use_cpu"] is True
    assert "losses within 0.10 %" in by_name(close)["bf16=True, use_cpu=True"].outcome
    far = tune(FakeMachine(bf16_drift=0.05))  # 40 % faster, but its losses are 5 % off the script's own
    trial = by_name(far)["bf16=True, use_cpu=True"]
    assert "bf16" not in far.best.overrides.trainer
    assert trial.outcome.startswith("not kept: its first 5 losses differ from the script's own by up to 5.0 %")


def test_no_native_lower_precision_is_said_and_not_tried():
    machine = FakeMachine()
    tuning = tune(machine, supports={"bf16": False, "fp16": False})
    assert "precision: fp32 (no lower precision is native on cpu)" in tuning.decisions
    assert len(machine.runs) > 1 and not any("bf16" in o or "fp16" in o for o in machine.runs)


def test_on_a_gpu_memory_that_stops_the_climb_gets_checkpointing_tried_at_that_micro_batch():
    machine = FakeMachine(device="cuda", fits=8)
    tuning = tune(machine)
    names = by_name(tuning)
    assert names["micro-batch 16 × 1"].outcome.startswith("failed:") and "out of memory" in names[
        "micro-batch 16 × 1"].outcome
    assert names["gradient_checkpointing at micro-batch 16"].outcome.startswith("kept:")
    best = tuning.best.overrides.trainer
    assert (best["per_device_train_batch_size"], best["gradient_accumulation_steps"]) == (16, 1)
    assert best["gradient_checkpointing"] is True
    without = tune(FakeMachine(device="cuda", fits=16))  # nothing ran out of memory: recompute only costs
    assert any(d.startswith("gradient_checkpointing: not tried (no larger micro-batch ran out of memory")
               for d in without.decisions)


def test_checkpointing_and_compile_are_not_tried_on_a_cpu():
    machine = FakeMachine()
    tuning = tune(machine)
    assert len(machine.runs) > 1
    assert not any("gradient_checkpointing" in o or "torch_compile" in o for o in machine.runs)
    assert any(d.startswith("gradient_checkpointing: not tried on cpu") for d in tuning.decisions)
    assert any(d.startswith("torch_compile: not tried on cpu") for d in tuning.decisions)


def test_compile_is_kept_only_when_the_planned_steps_pay_back_its_compile_time():
    pays = tune(FakeMachine(device="cuda", compile_gain=0.5, compile_s=10.0))
    assert pays.best.overrides.trainer.get("torch_compile") is True
    slow = tune(FakeMachine(device="cuda", compile_gain=0.9, compile_s=10_000.0))
    assert "torch_compile" not in slow.best.overrides.trainer
    assert "less than the 10000 s compile" in by_name(slow)["torch_compile=True"].outcome


def test_the_fused_optimizer_is_tried_only_where_the_script_uses_unfused_adamw():
    tuning = tune(FakeMachine())
    assert tuning.best.overrides.trainer["optim"] == "adamw_torch_fused"
    already = tune(FakeMachine(written={**WRITTEN, "optim": "adamw_torch_fused"}))
    assert "optim=\"adamw_torch_fused\"" not in by_name(already)
    assert "fused optimizer: not tried (optim='adamw_torch_fused' is already fused)" in already.decisions


def test_the_fused_optimizer_is_not_tried_where_the_optimizer_step_is_too_small_a_share_to_gain():
    small = FakeMachine()
    small.optimizer_share = 0.008  # another kernel could gain at most 0.8 %: under half the 3 % a change must
    tuning = tune(small)
    assert "optim=\"adamw_torch_fused\"" not in by_name(tuning) and "optim" not in tuning.best.overrides.trainer
    assert "fused optimizer: not tried (the optimizer step took 0.8 % of the step (measured): another kernel can " \
           "gain at most 0.8 %, under 50% of the 3 % a change must gain)" in tuning.decisions
    large = FakeMachine()
    large.optimizer_share = 0.2
    assert tune(large).best.overrides.trainer["optim"] == "adamw_torch_fused"


def test_the_tuned_settings_are_said_as_one_training_arguments_edit():
    tuning = tune(FakeMachine())
    workers = Overrides(loader={"num_workers": 2, "persistent_workers": True})
    tuning.best.overrides = tuning.best.overrides.merged(workers)
    assert edits(tuning) == ["train.py:65: TrainingArguments(..., bf16=True, use_cpu=True, "
                             "per_device_train_batch_size=16, gradient_accumulation_steps=1, "
                             "optim='adamw_torch_fused', dataloader_num_workers=2, "
                             "dataloader_persistent_workers=True)"]


class FakeLoop:
    """A plain loop (no Trainer): `compute` of its step in forward and backward, which bf16 autocast runs 1.6× as
    fast; bf16's losses drift by `drift`."""

    def __init__(self, compute: float = 0.8, drift: float = 0.001, windows: list[float] | None = None) -> None:
        self.compute, self.drift, self.windows = compute, drift, windows or []
        self.runs: list[Overrides] = []

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        over = settings.overrides
        self.runs.append(over)
        bf16 = over.bf16_autocast is not None
        step = (1 - self.compute) + self.compute / (1.6 if bf16 else 1.0)
        losses = [x * (1 + self.drift) for x in LOSSES] if bf16 else list(LOSSES)
        phases = {"data": 0.0, "forward": step * 0.4 * self.compute, "backward": step * 0.6 * self.compute}
        report = {"measurements": {"step_s": step, "samples_per_step": 16, "phases": phases, "steps": 3,
                                   "device_type": "cpu",
                                   "window_shares": [{"forward": 0.4 * c, "backward": 0.6 * c} for c in self.windows]},
                  "loaders": [], "first_step_s": 5.0, "model": {"class": "Net"}, "trainer": None,
                  "loop": {"bf16_autocast": over.bf16_autocast, "own_autocast": None, "losses": losses}}
        return ScriptRun(list(command), 0, report, None, 5, 1.0)


def test_a_plain_loop_keeps_bf16_autocast_only_when_faster_and_its_losses_stay_close():
    kept = tune_command(["python", "loop.py"], runner=FakeLoop(), supports={"bf16": True})
    assert kept.best.overrides.bf16_autocast == "cpu"
    assert "losses within 0.10 %" in by_name(kept)["bf16 autocast"].outcome
    far = tune_command(["python", "loop.py"], runner=FakeLoop(drift=0.05), supports={"bf16": True})
    assert far.best.overrides.bf16_autocast is None
    assert by_name(far)["bf16 autocast"].outcome.startswith("not kept: its first 5 losses differ")


def test_a_plain_loop_whose_compute_is_a_sliver_of_its_step_or_without_bf16_gets_no_precision_trial():
    bound = FakeLoop(compute=0.01)  # input-bound: forward and backward 1 % of the step
    tuning = tune_command(["python", "loop.py"], runner=bound, supports={"bf16": True})
    assert [o.bf16_autocast for o in bound.runs] == [None]
    line = next(d for d in tuning.decisions if d.startswith("precision:"))
    assert line.startswith("precision: bf16 autocast not tried (forward and backward took 1.0 % of the step")
    # one of four timed windows slowed in its forward (a neighbour's burst): the mean over the stretch reads 4.6 %,
    # the median of the windows what the loop's compute takes
    burst = FakeLoop(compute=0.046, windows=[0.005, 0.006, 0.006, 0.17])
    tuning = tune_command(["python", "loop.py"], runner=burst, supports={"bf16": True})
    assert [o.bf16_autocast for o in burst.runs] == [None]
    line = next(d for d in tuning.decisions if d.startswith("precision:"))
    assert "took 0.6 % of the step (measured, the median of 4 timed windows)" in line, line
    plain = FakeLoop()
    tuning = tune_command(["python", "loop.py"], runner=plain, supports={"bf16": False})
    assert [o.bf16_autocast for o in plain.runs] == [None]
    assert "precision: fp32 (bf16 is not native on cpu)" in tuning.decisions
