"""Two runs of a user's script alive at once, timed in alternating windows: a comparison a busy machine cannot flip.

Trials run one after another are minutes apart; a neighbour's burst during one of them reads as a gain or a loss
of any size (pytorch/examples' word_language_model: fused AdamW "+1093 %" under load, +8 % quiet; issue 28). So
the script tuner compares two settings the way the preset tuner compares two plans (tune/paired.py): both runs
of the command are started, each runs its warm-up and the doctor's Profiler window, then waits at a gate
(`child/trial_windows.py`); from there saturate lets them run one window each in turn (which one first drawn at
random for each pair: stats/pairs.py), each pair giving the ratio B ÷ A of two windows a second apart, under the
same load. The decision rests on the median of those ratios and its distribution-free interval (stats/pairs.py),
exactly as for a preset.

A fresh run is let run alone until it stops getting faster before its first pair (`Gated.settle`): a run's first
seconds are often slower (the allocator, caches, a Trainer's own warm-up), and a live incumbent is already past them.

Why two live runs rather than short runs repeated A B A B: a run's start-up (importing torch, building the model
and the data, the warm-up and the Profiler's steps) costs seconds to minutes and is paid once per run here, against
once per repetition; and a live incumbent is reused for the next comparison (`Arena`), so a tuning of n settings
starts n + 1 runs — one more than trials run one after another.

The run that waits is stopped (SIGSTOP, its whole process group: its loader workers would otherwise go on
preparing batches on the cores the other run is being timed on) and continued (SIGCONT) for its next window.
Each window's load from other processes is read by the parent (`ContentionMeter`: both runs are saturate's own
children, so neither counts as a neighbour); a pair whose two windows saw an uneven load (`Load.uneven_with`: a
burst began or ended between them) is left out of the decision while `MIN_PAIRS` even pairs remain.

Used for a command of one process (a launcher of one rank too; several ranks wait in collectives for each other), on
a CPU, and on a GPU when the script as written used at most 1/8 of the device's memory (`can_gate`): two runs hold
it at once, and a candidate may need several times as much (a larger micro-batch). On a GPU each window ends with
the device's queue drained (`child/trial_windows.device_sync`), so a parked run's kernels do not run during the
other's window; a candidate that runs out of device memory beside the parked run is tried again alone
(`tune_script`). Why pair on a GPU too: the first H100 tuning of guide 1's script (2026-11-27, one process per
trial, quiet machine) read fused AdamW -22 % "beyond noise (±1.6 %)" in one tuning and +15 % "beyond noise (±3.6 %)"
in the next; the script as written read 0.093 and 0.107 s/step: a sync-bound run's speed moves with the process,
which one trial per setting cannot see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from saturate.errors import SaturateError
from saturate.hardware.contention import ContentionMeter
from saturate.hardware.cpu import usable_cores
from saturate.policy import POLICY, Load
from saturate.script.boundary import GATE, GATE_GO, GATE_READY, GATE_STOP, REPORT, ChildSettings, read_json
from saturate.script.command import Child, ScriptRun, check_command
from saturate.script.isolation import remove, run_folder
from saturate.script.overrides import Overrides
from saturate.script.script_trial import ScriptTrial
from saturate.stats.comparison import Comparison
from saturate.stats.noise import WindowRule, summarize
from saturate.stats.pairs import MAX_PAIRS, MIN_PAIRS, ended_comparison, pair_order, paired_comparison, settled

WINDOW_FIELDS = ("seconds", "steps")  # what a run sends back for each window it was timed in


def can_gate(command: Sequence[str], device_type: str, world_size: int, *, device_peak: int | None = None,
             device_total: int | None = None) -> str | None:
    """Why the command's runs cannot be timed in alternating windows here, or None when they can. On a GPU two runs
    hold its memory at once: they are gated only when the script as written used at most 1/`POLICY.stages.gpu_share`
    of it (`device_peak` of `device_total` bytes), room for a candidate that needs several times as much beside it."""
    if world_size > 1:  # a launcher of one rank is paired as a plain command: its whole process group is parked
        return f"a command of {world_size} processes: its ranks wait for each other, so cannot be parked one at a time"
    if device_type == "cpu":
        return None
    if device_peak is None or not device_total:
        return f"on {device_type} two runs at once could exceed the device's memory (the script's use was not read)"
    if device_peak * POLICY.stages.gpu_share > device_total:
        return (f"on {device_type} two runs at once could exceed the device's memory: the script as written used "
                f"{device_peak / 2**30:.2f} GiB of {device_total / 2**30:.2f} GiB, more than "
                f"1/{POLICY.stages.gpu_share}")
    return None


@dataclass
class Window:
    """One timed window of a gated run: its steps per second, steps, and the cores other processes kept busy."""

    rate: float
    steps: int
    other_cores: float | None
    alone: bool = False  # timed alone while the run settled (`Gated.settle`), not in a pair


class Gated:
    """One run of the command with `overrides`, parked at its gate between windows. `open()` starts it and waits
    for the gate (returning the Profiler's trial); `window()` times one window; `close()` ends it."""

    def __init__(self, name: str, overrides: Overrides, command: Sequence[str], settings: ChildSettings,
                 rule: WindowRule, *, first_step_timeout: float = POLICY.windows.first_step_timeout_s,
                 quiet_stdout: bool = False, timeout: float | None = None) -> None:
        self.name, self.overrides, self.rule = name, overrides, rule
        self.first_step_timeout = first_step_timeout
        self.timeout = timeout  # stopped (SaturateError) when it has not reached its gate within these seconds
        self.folder = run_folder("saturate-gated-", command)
        self.path = self.folder / GATE
        windows = dict(settings.windows or {})
        windows["gate"] = str(self.path)
        settings = dataclasses.replace(settings, windows=windows)
        self.child = Child(check_command(command), settings, self.folder, quiet_stdout)
        self.profile: ScriptTrial | None = None  # the Profiler's trial, read at the gate
        self.windows: list[Window] = []  # every window this run was timed in
        self.ended = False  # the script ended (or failed) while parked or timed
        self.settled = False  # its speed has settled (`settle`)
        self._server: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._file = None

    def open(self) -> ScriptTrial:
        """Start the run and wait until it reaches the gate: its trial from the Profiler's report, the run parked
        (`parked`). A run that ended before the gate gives its trial as a trial run alone would (`parked` False);
        one that failed raises as `run_instrumented` does."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.path))
        server.listen(1)
        server.settimeout(0.1)
        self._server = server
        self.child.start()
        while self._conn is None:
            try:
                self._conn, _ = server.accept()
            except TimeoutError:
                if not self.child.alive():
                    return self._ended_before_gate()
                self.child.check(self.first_step_timeout, self.timeout)
        self._conn.settimeout(self.first_step_timeout)
        self._file = self._conn.makefile("rw")
        if self._read() != GATE_READY:
            return self._ended_before_gate()
        self.child.signal(signal.SIGSTOP)
        report = read_json(self.folder, REPORT)
        if report is None:
            raise SaturateError("the script reached saturate's gate without its report")
        run = ScriptRun(self.child.cmd, 0, report, None, report.get("optimizer_steps", 0),
                        time.monotonic() - self.child.started)
        self.profile = ScriptTrial.of(self.name, self.overrides, run, self.rule)
        return self.profile

    @property
    def parked(self) -> bool:
        return self.profile is not None and not self.ended

    def _ended_before_gate(self) -> ScriptTrial:
        self.ended = True
        self.child.wait(self.first_step_timeout)
        run = self.child.result()
        self.profile = ScriptTrial.of(self.name, self.overrides, run, self.rule)
        return self.profile

    def _read(self) -> str:
        try:
            return self._file.readline().strip() if self._file is not None else ""
        except OSError:
            return ""

    def window(self) -> Window | None:
        """Let the run time one window (continued, then parked again); None when it ended instead."""
        if not self.parked:
            return None
        meter = ContentionMeter(gpu=False).start()
        self.child.signal(signal.SIGCONT)
        try:
            assert self._file is not None
            self._file.write(GATE_GO + "\n")
            self._file.flush()
            self._conn.settimeout(POLICY.windows.window_timeout_s)  # type: ignore[union-attr]
            line = self._read()
        except OSError:
            line = ""
        seen = meter.stop()
        parts = line.split()
        if len(parts) != len(WINDOW_FIELDS):  # the script ended (or the socket closed) during the window
            self.ended = True
            return None
        self.child.signal(signal.SIGSTOP)
        w = Window(float(parts[0]), int(parts[1]), seen.other_cores)
        self.windows.append(w)
        return w

    def settle(self, cap_s: float) -> list[Window]:
        """Time windows alone until the run has stopped getting faster (`rule.warmed`: its newest window no faster
        than its fastest earlier one, beyond the target), or `rule.max_windows` or `cap_s` timed seconds: a fresh run
        is often slower for its first seconds (a Transformers `Trainer` read 25 then 44 steps/s), and paired with a
        run already warm it would read slower than it is. Done once per run; the windows are not part of any pair."""
        if self.settled or not self.parked:
            return []
        timed, own = 0.0, []
        while not self.rule.warmed([w.rate for w in own]) and len(own) < self.rule.max_windows and timed < cap_s:
            w = self.window()
            if w is None:
                break
            w.alone = True
            own.append(w)
            timed += w.steps / w.rate
        self.settled = True
        return own

    def trial(self, windows: Sequence[Window]) -> ScriptTrial:
        """This run's trial over `windows` (the Profiler's phases and losses, the windows' steps per second)."""
        assert self.profile is not None
        rates = [w.rate for w in windows]
        if not rates:
            return self.profile
        summary = summarize(rates)
        t = dataclasses.replace(self.profile, window_steps_per_s=rates, windows=len(rates),
                                steps=sum(w.steps for w in windows), ran_to_end=self.ended)
        t.step_s = 1 / summary.median
        t.spread = summary.spread if len(rates) > 1 else None
        t.samples_per_s = t.samples_per_step / t.step_s if t.samples_per_step else None
        loads = [w.other_cores for w in windows if w.other_cores is not None]
        t.busy = bool(loads) and Load(max(loads), usable_cores()[0]).busy
        t.other_cores = statistics.median(loads) if loads else None
        return t

    def close(self) -> None:
        """End the run: told to stop at its gate (it writes its last report and exits), else stopped."""
        with contextlib.suppress(OSError, ValueError):
            if self._file is not None and not self.ended:
                self.child.signal(signal.SIGCONT)
                self._file.write(GATE_STOP + "\n")
                self._file.flush()
                deadline = time.monotonic() + 5
                while self.child.alive() and time.monotonic() < deadline:
                    time.sleep(0.02)
        self.child.stop()
        for f in (self._file, self._conn, self._server):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        remove(self.folder)

    def __enter__(self) -> Gated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()




@dataclass
class PairedTrials:
    """What alternating windows measured: each run's trial over them, the per-pair ratios B ÷ A (even pairs: their
    windows under the same load: not `Load.uneven_with`), the pairs left out, and the decision."""

    a: ScriptTrial
    b: ScriptTrial
    ratios: list[float] = field(default_factory=list)
    uneven: list[float] = field(default_factory=list)  # ratios of pairs the load changed within, left out
    loads: list[tuple[float | None, float | None]] = field(default_factory=list)  # each pair's (A, B) neighbour cores
    comparison: Comparison | None = None  # None: fewer pairs than a decision rests on (a run ended first)
    seconds: float = 0.0
    runs: list[float] = field(default_factory=list)  # each pair of runs' median ratio, when two were timed (`again`)
    more: list[tuple[ScriptTrial, ScriptTrial]] = field(default_factory=list)  # the later pairs' trials (A, B)

    def busy(self) -> float | None:
        """Other processes' median use of the cores over the pairs' windows (None: not read)."""
        xs = [x for pair in self.loads for x in pair if x is not None]
        return statistics.median(xs) if xs else None

    def load_note(self, threads: bool = False) -> str | None:
        """What the ratio holds for, when other processes kept the machine busy while it was measured: the two
        runs shared the same load, so the decision stands, but its size is that load's — fewer torch threads
        above all, which gain from not stalling behind a preempted thread (a quiet machine gains far less, or
        loses: measured 5–6× under load for a small GPT-2 step on 2 cores, 2026-11-26)."""
        busy = self.busy()
        cores = usable_cores()[0]
        if busy is None or not Load(busy, cores).busy:  # a ratio measured on a busy machine is labelled the load's
            return None
        return (f"measured while other processes kept {busy:.1f} of {cores} cores busy: the ratio is this load's"
                + ("; fewer threads gain mostly from it (a thread the neighbour preempts stalls the others), so "
                   "on a quiet machine the gain is smaller and the script's own threads may be faster" if threads
                   else ", and may be smaller on a quiet machine"))

    def to_dict(self) -> dict[str, object]:
        c = self.comparison
        return {"ratios": self.ratios, "uneven": self.uneven, "loads": self.loads, "seconds": self.seconds,
                "busy_cores": self.busy(), "load_note": self.load_note(), "run_pairs": self.runs,
                "gain": None if c is None else c.gain, "noise": None if c is None else c.noise,
                "verdict": None if c is None else c.verdict.value, "text": None if c is None else c.text()}


def time_pairs(a: Gated, b: Gated, min_gain: float, *, min_pairs: int = MIN_PAIRS, cap_s: float | None = None,
               rng: random.Random | None = None) -> PairedTrials:
    """Time two parked runs in alternating windows until the pairs are settled (stats/pairs.py: decisive at one of
    its checks, or `cap_s` timed seconds, doubled once other processes kept a core busy in any window; `min_pairs`
    at least; `MAX_PAIRS` at most) or a run ends — then its 3 to 5
    pairs under the same load decide only when they are one-sided and tight (`stats.pairs.ended_comparison`), else
    there is no comparison. A run not yet timed is first let run alone until its speed settles (`Gated.settle`).
    Each pair's order is drawn from `rng` (`stats.pairs.pair_order`; None: a fresh generator)."""
    started = time.monotonic()
    rng = rng if rng is not None else random.Random()
    for side in (a, b):  # each at its steady speed before the first pair
        side.settle(cap_s if cap_s is not None else POLICY.windows.window_timeout_s)
    mine: dict[int, list[Window]] = {id(a): [], id(b): []}
    all_ratios: list[float] = []
    even: list[float] = []
    uneven: list[float] = []
    loads: list[tuple[float | None, float | None]] = []
    timed, ended = 0.0, False
    for _ in range(MAX_PAIRS):
        got: dict[int, Window] = {}
        for side in pair_order((a, b), rng):
            w = side.window()
            if w is None:
                break
            got[id(side)] = w
            mine[id(side)].append(w)
            timed += w.steps / w.rate
        if len(got) < len((a, b)):  # a run ended before its window
            ended = True
            break
        wa, wb = got[id(a)], got[id(b)]
        ratio = wb.rate / wa.rate
        all_ratios.append(ratio)
        loads.append((wa.other_cores, wb.other_cores))
        if Load(wa.other_cores).uneven_with(Load(wb.other_cores)):
            uneven.append(ratio)
        else:
            even.append(ratio)
        deciding = even if len(even) >= min_pairs else all_ratios
        busy = any(Load(x, usable_cores()[0]).busy for pair in loads for x in pair)
        # doubled on a busy machine, as a trial's is; doubled again while pairs the load changed within keep the
        # even ones under `min_pairs`: under bursts half the pairs can be uneven, and a decision on every pair lets
        # a burst in one window count (run_clm's 4 × 2 confirmed at 1.98× in 7 pairs, 3 of them uneven: 0.70–5.09×)
        cap = None if cap_s is None else cap_s * (2 if busy else 1) * (2 if uneven and deciding is all_ratios else 1)
        if settled(deciding, min_gain, min_pairs=min_pairs, timed_s=timed, cap_s=cap):
            break
    deciding = even if len(even) >= min_pairs else all_ratios
    left_out = uneven if deciding is even else []
    out = PairedTrials(a.trial(mine[id(a)]), b.trial(mine[id(b)]), deciding, left_out, loads,
                       seconds=time.monotonic() - started)
    if len(deciding) >= min_pairs:  # fewer pairs decide nothing (stats/pairs.py: MIN_PAIRS)
        c = paired_comparison(deciding, min_gain)
        if left_out:
            c = c.said(f"{c.note}; {len(left_out)} pair(s) left out: the load from other processes changed by "
                       f"{POLICY.load.uneven_cores:g} core or more between their two windows")
        out.comparison = c
    elif ended and (c := ended_comparison(even, min_gain)) is not None:  # a script too short for MIN_PAIRS
        if uneven:
            c = c.said(f"{c.note}; {len(uneven)} pair(s) left out: the load changed between their two windows")
        out.ratios, out.uneven, out.comparison = even, uneven, c
    return out


def again(first: PairedTrials, fresh: Callable[[], tuple[Gated, Gated]], min_gain: float, *,
          cap_s: float | None = None) -> PairedTrials:
    """A gain `first` found, timed once more on a fresh pair of runs (`fresh()`: A and B, not yet open), and the two
    pairs of runs taken together (`joined`). Why: the windows of one pair of runs agree with each other more than
    two pairs of runs do — a run's speed has a part that stays with the process (where its memory landed, which
    core its threads took): fused AdamW on a small MLP measured 2.41× and 1.34× on two pairs of runs, quiet, against
    2.04× (1.76–2.22) over rounds of fresh runs (2026-11-26), while each pair's interval was a few percent wide. So
    one pair's interval overstates what is known, and its ratio can be off by a third. Only a gain is timed again
    (nothing else is acted on). When a run of the second pair ends before its pairs of windows decide anything, a
    fresh pair is taken again (`POLICY.windows.fresh_tries` in all); when every one ends so, the gain stands on one
    pair of runs, which is not enough: the result has no comparison (as when the first pair's run ended), and the
    caller keeps what the user had."""
    if first.comparison is None or not first.comparison.faster:
        return first
    ended: list[tuple[ScriptTrial, ScriptTrial]] = []
    for _ in range(POLICY.windows.fresh_tries):
        a, b = fresh()
        with a, b:
            a.open()
            b.open()
            second = time_pairs(a, b, min_gain, cap_s=cap_s)
        if second.comparison is not None:
            both = joined(first, second, min_gain)
            return dataclasses.replace(both, more=[*first.more, *ended, (second.a, second.b)])
        ended.append((second.a, second.b))
    return dataclasses.replace(first, comparison=None, more=[*first.more, *ended])


def joined(first: PairedTrials, second: PairedTrials, min_gain: float) -> PairedTrials:
    """Two pairs of runs as one result: the gain is the median of all their pairs of windows; the interval reaches
    at least to the lower pair of runs' median (for a gain; the higher for a loss), so the change counts as faster
    only when each pair of runs measured it faster, and the text names both pairs' medians."""
    ratios = first.ratios + second.ratios
    runs = [statistics.median(first.ratios), statistics.median(second.ratios)]
    c = paired_comparison(ratios, min_gain)
    med = 1 + c.gain
    noise = max(c.noise, med - min(runs)) if med >= 1 else max(c.noise, max(runs) - med)
    left = len(first.uneven) + len(second.uneven)
    c = dataclasses.replace(c, noise=noise, note=(
        f"{c.note}; over two pairs of runs: {runs[0]:.3f}× and {runs[1]:.3f}× (a run's speed has a part that stays "
        "with the process)" + (f"; {left} pair(s) of windows left out: the load changed between their two windows"
                               if left else "")))
    return PairedTrials(first.a, first.b, ratios, first.uneven + second.uneven, first.loads + second.loads, c,
                        first.seconds + second.seconds, runs, [*first.more, (second.a, second.b)])
