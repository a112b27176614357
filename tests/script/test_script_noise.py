"""A script trial's noise (`saturate tune -- CMD`): the child's timed windows stop when they agree or at a cap
(raised on a busy machine), and the tuning keeps a setting only when its gain is beyond both trials' spreads.
The decisions run on a fake machine: a runner that answers each trial with windows of a set noise."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from saturate.script.boundary import ChildSettings
from saturate.script.child.trial_windows import StepWindows
from saturate.script.command import ScriptRun
from saturate.script.script_trial import ScriptTrial, window_rule
from saturate.script.tune_script import tune_command
from saturate.script.tuning import ScriptTuning, edits, render

# --- the child's windows ------------------------------------------------------------------------


class Clock:
    """A fake clock advanced by the test: each step takes the next of `durations` (cycled)."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.i = 100.0, durations, 0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.durations[self.i % len(self.durations)]
        self.i += 1


SLOW_FAST = [0.125] * 4 + [0.5] * 4  # windows of 4 steps (the first lasts 0.5 s), fast and slow in turn


def run_windows(w: StepWindows, clock: Clock, limit: int = 10_000) -> int:
    """Steps until the windows are done (the first call is the end of the Profiler's last step)."""
    assert w.step() is False
    for n in range(1, limit):
        clock.tick()
        if w.step():
            return n
    raise AssertionError("the windows never ended")


def test_windows_stop_once_the_last_ones_agree():
    clock = Clock([0.125])
    busy_reads: list[int] = []
    w = StepWindows({"window_s": 0.5, **vars(window_rule())}, clock=clock,
                    busy=lambda: busy_reads.append(1) or (False, 0.0))
    steps = run_windows(w, clock)
    assert steps == 12 and w.rates == pytest.approx([8.0] * 3)  # 3 windows of 4 steps (0.5 s), all alike
    record = w.record()
    assert record["agreed"] is True and record["steps"] == 12 and not busy_reads  # contention not needed


def test_the_windows_count_the_pages_the_process_faulted_in_per_second(monkeypatch):
    from saturate.script.child import trial_windows

    faults = iter([1_000, 13_000])  # when the windows begin, when they are recorded
    monkeypatch.setattr(trial_windows, "_minor_faults", lambda: next(faults))
    clock = Clock([0.125])
    w = StepWindows({"window_s": 0.5, **vars(window_rule())}, clock=clock, busy=lambda: (False, 0.0))
    run_windows(w, clock)
    assert w.record()["minor_faults_per_s"] == pytest.approx(12_000 / 1.5)  # 12 000 over the 3 windows' 1.5 s


def test_windows_that_disagree_stop_at_the_cap_and_a_busy_machine_doubles_it():
    rule = {**vars(window_rule(max_seconds=1000.0)), "max_windows": 6}
    quiet_clock = Clock(SLOW_FAST)  # windows of 4 steps alternate in speed: they never agree
    quiet = StepWindows({"window_s": 0.5, **rule}, clock=quiet_clock, busy=lambda: (False, 0.1))
    run_windows(quiet, quiet_clock)
    assert len(quiet.rates) == 6 and quiet.record()["agreed"] is False and quiet.record()["busy"] is False
    busy_clock = Clock(SLOW_FAST)
    reads: list[int] = []
    busy = StepWindows({"window_s": 0.5, **rule}, clock=busy_clock, busy=lambda: reads.append(1) or (True, 1.5))
    run_windows(busy, busy_clock)
    assert len(busy.rates) == 12 and reads == [1]  # read once, at the first cap; then the cap is twice as far
    assert busy.record()["busy"] is True and busy.record()["other_cores"] == 1.5


def test_windows_stop_at_the_seconds_cap():
    clock = Clock(SLOW_FAST)
    w = StepWindows({"window_s": 0.5, **vars(window_rule(max_seconds=2.0))}, clock=clock, busy=lambda: (False, None))
    run_windows(w, clock)
    assert len(w.rates) == 2  # 0.5 s, then 2 s: the seconds, not the windows, ended it


def test_several_processes_time_a_fixed_number_of_fixed_windows():
    clock = Clock(SLOW_FAST)
    w = StepWindows({"window_s": 0.5, "window_steps": 4, **vars(window_rule())}, world=2, clock=clock,
                    busy=lambda: (False, None))
    assert run_windows(w, clock) == 12 and len(w.rates) == 3  # every rank stops at the same step
    assert w.record()["fixed"] is True


def test_no_windows_asked_is_done_at_once():
    w = StepWindows(None)
    assert w.step() is True and w.record() is None and w.cut_short() is None


# --- decisions on a fake machine ----------------------------------------------------------------


class NoisyMachine:
    """A plain script (no Trainer) whose step takes `step_s`, `gain` faster with loader workers (and
    `fused_gain` with the fused optimizer); every trial's windows spread ± `noise` around its rate."""

    def __init__(self, gain: float, noise: float, fused_gain: float = 0.0, optimizer: str = "SGD",
                 fused: bool | None = None, ends: bool = False) -> None:
        self.gain, self.noise, self.fused_gain, self.ends = gain, noise, fused_gain, ends
        self.optimizer = {"class": optimizer, "site": "train.py:20", "fused": fused, "foreach": None}
        self.settings: list[ChildSettings] = []

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        self.settings.append(settings)
        over = settings.overrides.to_dict()
        rate = 10.0 * (1 + (self.gain if over.get("loader", {}).get("num_workers") else 0.0))
        rate *= 1 + (self.fused_gain if over.get("optimizer", {}).get("fused") else 0.0)
        rates = [rate * (1 - self.noise), rate * (1 + self.noise), rate]
        report = {"measurements": {"step_s": 1 / rate, "samples_per_step": 8, "phases": {"data": 0.5 / rate},
                                   "steps": 10, "device_type": "cpu"},
                  "loaders": [{"site": "train.py:12", "num_workers": 0, "batch_size": 8}],
                  "optimizer": self.optimizer, "first_step_s": 2.0,
                  "windows": {"rates": rates, "steps": 15, "seconds": 1.5, "agreed": False, "busy": False,
                              "script_ended": self.ends}}
        return ScriptRun(list(command), 0, report, None, 30, 1.0)


def tune(machine: NoisyMachine) -> ScriptTuning:
    return tune_command(["python", "train.py"], runner=machine, cores=1)


def test_a_small_gain_within_the_noise_is_not_kept():
    tuning = tune(NoisyMachine(gain=0.03, noise=0.10))
    trial = tuning.trials[1]
    assert trial.name == "1 workers" and trial.spread == pytest.approx(0.10)
    assert tuning.best is tuning.baseline and not tuning.best.overrides
    assert trial.outcome == "not kept: +3.0 %, within noise (±20.0 %) against the best so far"
    assert tuning.to_dict()["gain"] is None


def test_a_large_gain_beyond_the_noise_is_kept_and_the_windows_are_asked_of_every_trial():
    machine = NoisyMachine(gain=0.40, noise=0.10)
    tuning = tune(machine)
    assert tuning.best.name == "1 workers" and tuning.best.outcome.startswith("kept: +40.0 %, beyond noise (±20.0 %)")
    assert tuning.to_dict()["gain"]["noise"] == pytest.approx(0.20)
    assert all(s.windows["max_seconds"] == 10.0 and s.windows["target"] == 0.02 for s in machine.settings)


def test_a_gain_measured_exactly_still_needs_the_minimum():
    tuning = tune(NoisyMachine(gain=0.02, noise=0.0))
    assert tuning.best is tuning.baseline and "under the 3 % a change must gain" in tuning.trials[1].outcome


def test_the_table_shows_each_trial_as_median_and_spread_within_80_columns():
    console = Console(width=80, record=True)
    render(tune(NoisyMachine(gain=0.03, noise=0.10)), console)
    text = console.export_text()
    assert "80.0 ±10.0 %" in text and "within noise (±20.0 %)" in text  # 10 steps/s × 8 samples
    assert "no setting measured faster than the script as written beyond the noise" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_fused_adamw_is_tried_for_a_plain_script_and_said_at_its_line():
    tuning = tune(NoisyMachine(gain=0.0, noise=0.01, fused_gain=0.3, optimizer="AdamW"))
    assert tuning.best.overrides.optimizer == {"fused": True}
    assert any(d.startswith("fused optimizer: AdamW(fused=True) kept: +30.0 %") for d in tuning.decisions)
    assert "train.py:20: AdamW(..., fused=True)" in edits(tuning)
    assert not any("fused optimizer: need" in d for d in tuning.decisions)
    console = Console(width=200, record=True)
    render(tuning, console)
    assert console.export_text().count("kept: +30.0 %") == 1  # the trial's outcome is said once, not twice


def test_fused_is_not_tried_where_it_cannot_be():
    sgd = tune(NoisyMachine(gain=0.0, noise=0.01, optimizer="SGD"))
    assert "fused optimizer: not tried (SGD has no fused variant saturate tries; Adam and AdamW do)" in sgd.decisions
    fused = tune(NoisyMachine(gain=0.0, noise=0.01, optimizer="AdamW", fused=True))
    assert "fused optimizer: not tried (the script's AdamW is already fused)" in fused.decisions
    assert not any(t.overrides.optimizer for t in sgd.trials + fused.trials)


def test_fused_is_not_tried_on_a_device_without_the_kernel(monkeypatch):
    from saturate.tune import api

    monkeypatch.setattr(api, "fused_adamw_available", lambda device: False)
    tuning = tune(NoisyMachine(gain=0.0, noise=0.01, optimizer="Adam"))
    assert "fused optimizer: not tried (this torch has no fused Adam on cpu)" in tuning.decisions


def test_a_report_without_windows_is_the_profilers_window_with_no_spread():
    run = ScriptRun(["python"], 0, {"measurements": {"step_s": 0.5, "samples_per_step": 4, "phases": {},
                                                     "steps": 10, "device_type": "cpu"}}, None, 12, 1.0)
    t = ScriptTrial.of("as written", {}, run)
    assert t.step_s == 0.5 and t.spread is None and t.windows == 0 and t.samples_per_s == 8.0


def test_a_script_that_ends_during_its_trials_is_warned_about():
    assert not any(d.startswith("warning") for d in tune(NoisyMachine(gain=0.4, noise=0.1)).decisions)
    tuning = tune(NoisyMachine(gain=0.4, noise=0.1, ends=True))
    assert all(t.ran_to_end for t in tuning.trials)
    assert tuning.decisions[-1].startswith(f"warning: the script ran to its end during {len(tuning.trials)} "
                                           "trial(s) (as written, …): the trials timed all of its steps")


def test_the_child_says_when_the_script_ended_during_its_windows():
    clock = Clock([0.125])
    w = StepWindows({"window_s": 0.5}, clock=clock, busy=lambda: (False, 0.0))
    for _ in range(6):  # the Profiler's last step, then one window of 4 steps and 1 step of the next
        w.step()
        clock.tick()
    assert w.record()["script_ended"] is False
    assert w.cut_short() and w.record()["script_ended"] is True


class IOBoundMachine(NoisyMachine):
    """A dataset that waits on I/O (no core): each worker adds a loader, up to `saturates` workers; the wait for data
    is what the workers cannot yet hide. `peak` is the training process's host memory."""

    def __init__(self, saturates: int, peak: int = 2**30) -> None:
        super().__init__(gain=0.0, noise=0.01)
        self.saturates, self.peak = saturates, peak

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        run = super().__call__(command, settings, **kw)
        workers = settings.overrides.loader.get("num_workers", 0)
        rate = 10.0 * min(max(workers, 1), self.saturates)
        m = run.report["measurements"]
        data = max(0.0, 1 - min(max(workers, 1), self.saturates) / self.saturates) * 0.9
        m.update(step_s=1 / rate, phases={"data": data / rate}, main_peak=self.peak)
        run.report["windows"]["rates"] = [rate * 0.99, rate * 1.01, rate]
        return run


def test_workers_climb_past_the_cores_while_the_data_wait_remains():
    tuning = tune_command(["python", "train.py"], runner=IOBoundMachine(saturates=8), cores=2)
    assert tuning.best.overrides.loader["num_workers"] == 8  # 4 per core, on 2 cores
    line = next(d for d in tuning.decisions if d.startswith("loader workers"))
    assert line == "loader workers: 8 (as written 0; tried 1, 2, 4, 8)"
    early = tune_command(["python", "train.py"], runner=IOBoundMachine(saturates=2), cores=2)
    assert early.best.overrides.loader["num_workers"] == 2 and "not 4: the best so far waits for data 0 %" in next(
        d for d in early.decisions if d.startswith("loader workers"))


def test_workers_past_the_cores_stop_where_host_memory_would_run_short(monkeypatch):
    import saturate.script.host_stages as host_stages

    monkeypatch.setattr(host_stages, "_host_memory_available", lambda: 10 * 2**30)
    tuning = tune_command(["python", "train.py"], runner=IOBoundMachine(saturates=8, peak=2 * 2**30), cores=2)
    assert tuning.best.overrides.loader["num_workers"] == 2
    assert "not 4: 4 workers at up to 2.0 GiB each would use more than half of the 10.0 GiB" in next(
        d for d in tuning.decisions if d.startswith("loader workers"))


class BusyThreads(NoisyMachine):
    """A plain script on 2 cores with 2 threads; other processes keep `busy` cores busy during every trial; with
    `fewer` threads it runs `speedup`× as fast."""

    def __init__(self, busy: float, speedup: float) -> None:
        super().__init__(gain=0.0, noise=0.01)
        self.busy, self.speedup = busy, speedup

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        run = super().__call__(command, settings, **kw)
        threads = settings.overrides.threads or 2
        rate = 10.0 * (self.speedup if threads < 2 else 1.0)
        run.report["measurements"].update(step_s=1 / rate, phases={"data": 0.0})
        run.report["windows"].update(rates=[rate * 0.99, rate * 1.01, rate], busy=self.busy >= 0.5,
                                     other_cores=self.busy)
        run.report["threads"] = {"in_force": threads, "asked_by_script": None}
        return run


def test_a_busy_cpu_tries_fewer_threads_for_a_script_and_says_the_edit():
    tuning = tune_command(["python", "train.py"], runner=BusyThreads(busy=1.0, speedup=2.0), cores=2)
    assert tuning.best.overrides.threads == 1
    line = next(d for d in tuning.decisions if d.startswith("threads"))
    assert line.startswith("threads: 1 of 2 kept") and "1.0 of 2 cores busy" in line
    assert "at start-up: torch.set_num_threads(1)" in edits(tuning)
    quiet = tune_command(["python", "train.py"], runner=BusyThreads(busy=0.0, speedup=2.0), cores=2)
    assert quiet.best.overrides.threads is None and "threads: the script's 2" in next(
        d for d in quiet.decisions if d.startswith("threads"))
    slower = tune_command(["python", "train.py"], runner=BusyThreads(busy=1.0, speedup=0.8), cores=2)
    assert slower.best.overrides.threads is None


def test_without_samples_counted_the_spread_goes_with_the_step_time():
    tuning = tune(NoisyMachine(gain=0.03, noise=0.10))
    for trial in tuning.trials:
        trial.samples_per_s = None  # a loop with no DataLoader: steps are timed, samples not counted
    console = Console(width=80, record=True)
    render(tuning, console)
    text = console.export_text()
    assert "- (no DataLoader)" in text and " ±10.0 %" in text
    assert not any(line.split()[2:3] == ["±10.0"] for line in text.splitlines() if line.startswith("as written"))


class GpuMachine(NoisyMachine):
    """NoisyMachine on a GPU, the script as written using `peak_gib` of an 80-GiB device."""

    def __init__(self, peak_gib: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.peak_gib = peak_gib

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        run = super().__call__(command, settings, **kw)
        run.report["measurements"].update(device_type="cuda", device_mem_peak=int(self.peak_gib * 2**30),
                                          device_mem_total=80 * 2**30)
        return run


def test_on_a_gpu_a_small_script_is_paired_and_a_candidate_out_of_memory_beside_the_parked_run_is_tried_alone(
        monkeypatch):
    from saturate.script import tune_script
    from saturate.script.command import ScriptFailed

    opened, closed, alive = [], [], set()

    class OneRunFits:  # one run alone fits the GPU; a second beside a parked one runs out of its memory
        def __init__(self, name: str, overrides: Any, *a: Any, **kw: Any) -> None:
            self.name, self.overrides = name, overrides

        def open(self) -> ScriptTrial:
            opened.append(self.name)
            if alive:
                raise ScriptFailed("torch.OutOfMemoryError: CUDA out of memory", out_of_memory=True)
            alive.add(self)
            return ScriptTrial(self.name, self.overrides, 0.1, None, 0.5, 10)

        def close(self) -> None:
            closed.append(self.name)
            alive.discard(self)

    monkeypatch.setattr(tune_script, "Gated", OneRunFits)
    tuning = tune_command(["python", "train.py"], runner=GpuMachine(1.0, gain=0.40, noise=0.0), cores=1,
                          paired=True, confirm=False, supports={})
    assert tuning.paired is None  # 1 GiB of 80: gated
    workers = next(t for t in tuning.trials if t.name == "1 workers")
    assert opened[:2] == ["as written", "1 workers"] and "as written" in closed  # the parked run let go first
    assert workers.outcome.startswith("kept: +40.0 %") and "so tried alone" in workers.outcome
    assert tuning.best.overrides.loader.get("num_workers")

    big = tune_command(["python", "train.py"], runner=GpuMachine(20.0, gain=0.40, noise=0.0), cores=1,
                       paired=True, confirm=False, supports={})
    assert "more than 1/8" in big.paired and big.best.name != "as written"  # alone, as before


class FakeGated:
    """A run as `tune_script` drives a `gated.Gated` one (open, settle, windows, trial, close), no process behind it:
    each run's windows come from `next_window` (None: the script ended)."""

    rate = 10.0

    def __init__(self, name: str, overrides: Any, *a: Any, **kw: Any) -> None:
        from saturate.script.gated import Window

        self.name, self.overrides, self.parked = name, overrides, True
        self.windows: list[Window] = []

    def open(self) -> ScriptTrial:
        return self.trial([])

    def close(self) -> None:
        pass

    def __enter__(self) -> FakeGated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def settle(self, cap_s: float) -> list:
        return []

    def window(self) -> Any:
        w = self.next_window()
        if w is None:
            self.parked = False
            return None
        self.windows.append(w)
        return w

    def next_window(self) -> Any:
        raise NotImplementedError

    def trial(self, windows: list) -> ScriptTrial:
        return ScriptTrial(self.name, self.overrides, 1 / self.rate, None, 0.5, 10, ran_to_end=not self.parked)


def test_a_small_gain_is_timed_again_on_fresh_runs_before_it_is_kept_and_a_large_one_is_not(monkeypatch):
    # Each process keeps a speed of its own (where its memory landed): the first "1 workers" run reads +4.4 %, as a
    # data-bound loop's bf16 autocast once did in 6 of 6 pairs (2026-11-28); a fresh one reads as written.
    from saturate.script import tune_script
    from saturate.script.gated import Window

    made: list[str] = []
    short = False

    class OwnSpeed(FakeGated):
        def __init__(self, name: str, overrides: Any, *a: Any, **kw: Any) -> None:
            super().__init__(name, overrides)
            workers = overrides.loader.get("num_workers", 0)
            first = name not in made
            made.append(name)
            self.rate = 10.0 * (2.0 if workers >= 2 else 1.044 if workers == 1 and first else 1.0)
            self.limit = 2 if workers == 1 and not first and short else 24  # `short`: a fresh run ends early

        def next_window(self) -> Window | None:
            return Window(self.rate, 10, 0.0) if len(self.windows) < self.limit else None

    monkeypatch.setattr(tune_script, "Gated", OwnSpeed)
    tuning = tune_command(["python", "train.py"], runner=NoisyMachine(gain=0.0, noise=0.0), cores=1, paired=True,
                          confirm=False, supports={})
    one = next(t for t in tuning.trials if t.name == "1 workers")
    assert one.outcome.startswith("not kept") and "over two pairs of runs: 1.044× and 1.000×" in one.outcome
    assert made.count("1 workers") == 2  # timed again on a fresh pair
    assert tuning.best.name == "2 workers" and made.count("2 workers") == 1  # 2×: one pair of runs is enough

    # The fresh pair's runs end before their windows decide anything: one pair of runs' +4.4 % is not kept.
    made.clear()
    short = True
    tuning = tune_command(["python", "train.py"], runner=NoisyMachine(gain=0.0, noise=0.0), cores=1, paired=True,
                          confirm=False, supports={})
    one = next(t for t in tuning.trials if t.name == "1 workers")
    assert one.outcome.startswith("not kept: +4.4 %, within noise (±4.4 %)") and "ended before" in one.outcome


def test_a_gain_against_a_live_run_whose_speed_moved_with_its_age_is_timed_again_on_fresh_runs(monkeypatch):
    # word_language_model's AdamW at lr 20 diverges and its run slows as it goes (10 → 3 steps/s): beside the live
    # "as written" run, hundreds of steps along, a fresh run of any setting reads faster (fused AdamW: 2.2× in 6 of
    # 6 pairs, twice, 2026-11-28). Here no setting changes the speed; only a run's age does.
    from saturate.script import tune_script
    from saturate.script.gated import Window

    class Ageing(FakeGated):
        def next_window(self) -> Window:
            return Window(10.0 / (1 + len(self.windows) / 8), 10, 0.0)  # slower with every window

    monkeypatch.setattr(tune_script, "Gated", Ageing)
    tuning = tune_command(["python", "train.py"], runner=NoisyMachine(gain=0.0, noise=0.0), cores=1, paired=True,
                          confirm=False, supports={})
    later = [t for t in tuning.trials if t.pair is not None][1:]  # paired with a live run already timed
    assert later and all(not t.outcome.startswith("kept") for t in later), [t.outcome for t in later]
    assert any("timed again on a fresh pair of runs: the best so far's run timed" in t.outcome for t in later)
    assert tuning.best.name == "as written"


def test_trials_timed_apart_under_different_loads_are_not_compared():
    # nanoGPT under the bursty neighbour (2026-11-28): its as-written trial was timed in a burst (1.0 of 2 cores
    # taken), its fused AdamW run ended before a pair decided and fell back on trials one after another, quiet:
    # "+262.2 %, beyond noise (±129.2 %)".
    from saturate.script.overrides import NONE

    written = ScriptTrial("as written", NONE, 0.0337, None, 0.0, 14, spread=1.236, other_cores=1.0)
    fused = ScriptTrial("AdamW(fused=True)", NONE, 0.0093, None, 0.0, 3, spread=0.056, other_cores=0.0)
    c = fused.against(written)
    assert not c.faster and c.within_noise and c.gain == pytest.approx(0.0337 / 0.0093 - 1)
    assert c.text().endswith("timed apart while other processes kept 1.0 and then 0.0 cores busy: not the same "
                             "conditions, so not compared")
    # The same load on both (a steady neighbour), or the load not read: compared by their spreads, as before.
    steady = ScriptTrial("as written", NONE, 0.0337, None, 0.0, 14, spread=0.05, other_cores=1.0)
    assert ScriptTrial("fused", NONE, 0.0093, None, 0.0, 3, spread=0.05, other_cores=0.8).against(steady).faster
    unread = ScriptTrial("as written", NONE, 0.0337, None, 0.0, 14, spread=0.05)
    assert ScriptTrial("fused", NONE, 0.0093, None, 0.0, 3, spread=0.05, other_cores=0.0).against(unread).faster


def test_the_confirmation_takes_a_fresh_best_run_when_the_live_one_reaches_its_scripts_end(monkeypatch):
    # run_clm.py, 200 steps, under the bursty neighbour (2026-11-28): the live best run had timed most of its script
    # in the stages before, ended during the confirmation, and a gain it had measured at 1.46× was not kept.
    from saturate.script import tune_script
    from saturate.script.gated import Window

    made: list[str] = []

    class Ending(FakeGated):
        short = 0

        def __init__(self, name: str, overrides: Any, *a: Any, **kw: Any) -> None:
            super().__init__(name, overrides)
            self.rate = 20.0 if overrides.loader.get("num_workers", 0) >= 2 else 10.0
            # the first one ends early (and the first `short` fresh ones after it end at once)
            early = made.count(name) if name == "2 workers" else 99
            self.limit = 20 if early == 0 else 2 if early <= Ending.short else 100
            made.append(name)

        def next_window(self) -> Window | None:
            return Window(self.rate, 10, 0.0) if len(self.windows) < self.limit else None

    monkeypatch.setattr(tune_script, "Gated", Ending)
    tuning = tune_command(["python", "train.py"], runner=NoisyMachine(gain=0.0, noise=0.0), cores=1, paired=True,
                          confirm=True, supports={})
    assert tuning.best.name == "2 workers", tuning.decisions
    assert any(d.startswith("confirmed against the script as written, paired: 2× (") for d in tuning.decisions)
    assert made.count("2 workers") >= 2  # a fresh best run took over from the one that ended

    # The fresh one ends before its pairs decide too (a 3-s script whose pairs fell across bursts: run_clm's 8 × 1,
    # 2026-11-29): another is started, FRESH_TRIES in all.
    made.clear()
    Ending.short = 1

    tuning = tune_command(["python", "train.py"], runner=NoisyMachine(gain=0.0, noise=0.0), cores=1, paired=True,
                          confirm=True, supports={})
    assert tuning.best.name == "2 workers", tuning.decisions
    assert made.count("2 workers") >= 3


def test_a_gain_read_from_one_window_is_not_kept_and_a_loss_still_counts():
    # nanoGPT under the bursty neighbour (2026-11-28): fused AdamW's run ended after one window and fell back on
    # trials one after another: "kept: +6.9 % (noise not measured: one window)"; its confirmation: within noise.
    from saturate.script.overrides import NONE

    written = ScriptTrial("as written", NONE, 0.0107, None, 0.0, 224, spread=0.019, windows=4)
    fused = ScriptTrial("AdamW(fused=True)", NONE, 0.0100, None, 0.0, 60, spread=None, windows=1)
    c = fused.against(written)
    assert not c.faster and not c.slower and c.gain == pytest.approx(0.0107 / 0.0100 - 1)
    assert c.text() == "+7.0 % (noise not measured: one window); no gain is kept on one window alone"
    assert ScriptTrial("bf16", NONE, 0.0122, None, 0.0, 49, spread=None, windows=1).against(written).slower
    # With its windows' spread measured, the same gain is a gain.
    assert ScriptTrial("fused", NONE, 0.0100, None, 0.0, 240, spread=0.01, windows=4).against(written).faster
