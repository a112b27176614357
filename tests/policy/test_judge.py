"""One judge for every verb (`policy.judge`): when a comparison may decide alone, given how it was measured and the
load each side saw; and the script tuner confirming what its lone trials could not decide alone."""

from __future__ import annotations

from typing import Any

import pytest

from saturate.policy import POLICY, Load
from saturate.policy.judge import Evidence, Outcome, Reason, judge
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun
from saturate.script.tune_script import tune_command
from saturate.stats.comparison import Comparison

MIN = POLICY.gains.min_gain


def c(gain: float, noise: float = 0.02, known: bool = True) -> Comparison:
    return Comparison(gain=gain, noise=noise, min_gain=MIN, noise_known=known)


def test_separate_trials_decide_a_gain_alone_only_when_decisive_on_a_quiet_machine_or_under_the_same_load():
    quiet, steady = Load(0.0), Load(1.0)
    d = judge(c(0.30), Evidence.TRIALS, quiet, quiet)
    assert (d.outcome, d.reason, d.gain) == (Outcome.KEPT, Reason.FASTER, 0.30)
    assert judge(c(0.08), Evidence.TRIALS, quiet, quiet).reason is Reason.SMALL_GAIN  # under confirm_below
    assert judge(c(0.20, noise=0.12), Evidence.TRIALS).reason is Reason.SMALL_GAIN  # under twice the noise
    assert judge(c(0.30), Evidence.TRIALS, steady, Load(1.1)).kept  # the same load, on both
    assert judge(c(0.30), Evidence.TRIALS, steady, Load(1.4)).reason is Reason.BUSY  # neither same nor uneven
    assert judge(c(0.30), Evidence.TRIALS, steady, quiet).reason is Reason.UNEVEN_LOAD  # a burst across one
    assert judge(c(0.30, known=False), Evidence.TRIALS, one_window=True).reason is Reason.ONE_WINDOW
    # a loss decides alone, unless a load could have hidden a gain or a worthwhile one lies within the noise
    assert judge(c(-0.20), Evidence.TRIALS).outcome is Outcome.NOT_KEPT
    assert judge(c(-0.20), Evidence.TRIALS, steady, quiet).to_confirm
    assert judge(c(0.01, noise=0.05), Evidence.TRIALS).reason is Reason.COULD_GAIN
    # the flags of a meter that also counts a GPU's neighbours override the CPU loads
    assert judge(c(0.30), Evidence.TRIALS, quiet, quiet, busy=(True, False)).reason is Reason.BUSY


def test_pairs_in_one_process_and_rounds_decide_alone_and_two_live_runs_retime_a_small_gain():
    for evidence in (Evidence.PAIRS, Evidence.ROUNDS, Evidence.RUN_PAIRS_AGAIN):
        assert judge(c(0.05), evidence).kept and judge(c(0.01), evidence).reason is Reason.WITHIN_NOISE
    assert judge(c(0.10), Evidence.RUN_PAIRS).reason is Reason.SMALL_GAIN  # under again_below: a fresh pair
    assert judge(c(POLICY.gains.again_below + 0.05), Evidence.RUN_PAIRS).kept
    assert judge(c(0.50), Evidence.RUN_PAIRS, aged=True).reason is Reason.DRIFTED
    assert judge(None, Evidence.RUN_PAIRS).outcome is Outcome.UNDECIDED


def test_a_decision_is_a_record_and_its_text_is_rendered_from_it():
    d = judge(c(0.08), Evidence.TRIALS, Load(0.0), Load(0.0))
    assert d.to_dict() == {"outcome": "to be confirmed", "reason": "a gain too small to decide alone",
                           "evidence": "separate trials", "gain": 0.08, "noise": 0.02, "loads": [0.0, 0.0]}
    assert d.text().startswith("+8.0 %, beyond noise (±2.0 %) (separate trials): to be confirmed")


class Drifting:
    """A plain script whose loader workers read `gain` faster in their trial; the script as written reads
    `again` faster than at first when it is measured a second time (the machine sped up between trials)."""

    def __init__(self, gain: float, again: float) -> None:
        self.gain, self.again, self.written = gain, again, 0

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        over = settings.overrides.to_dict()
        workers = bool(over.get("loader", {}).get("num_workers"))
        if not over:
            self.written += 1
        rate = 10.0 * (1 + (self.gain if workers else self.again if self.written > 1 else 0.0))
        report = {"measurements": {"step_s": 1 / rate, "samples_per_step": 8, "phases": {"data": 0.5 / rate},
                                   "steps": 10, "device_type": "cpu"},
                  "loaders": [{"site": "train.py:12", "num_workers": 0, "batch_size": 8}],
                  "optimizer": {"class": "SGD", "site": "train.py:20", "fused": None, "foreach": None},
                  "first_step_s": 2.0, "windows": {"rates": [rate * 0.99, rate * 1.01, rate], "steps": 15,
                                                   "seconds": 1.5, "agreed": True, "busy": False}}
        return ScriptRun(list(command), 0, report, None, 30, 1.0)


@pytest.mark.parametrize("again, kept", [(0.0, True), (0.10, False)])
def test_a_lone_trials_small_gain_is_confirmed_against_the_best_measured_again(again, kept):
    tuning = tune_command(["python", "train.py"], runner=Drifting(0.10, again), cores=1)
    workers = next(t for t in tuning.trials if t.name == "1 workers")
    remeasured = next(t for t in tuning.trials if t.name == "again: as written")
    assert workers.decision["reason"] == Reason.SMALL_GAIN.value and remeasured.ok
    assert (tuning.best is workers) is kept and (tuning.best.name == "1 workers") is kept
    assert workers.outcome.startswith("kept:" if kept else "not kept:")


def test_each_row_of_the_trials_table_shows_what_its_decision_rests_on():
    import io

    from rich.console import Console

    from saturate.script.tuning import decided_on, render

    tuning = tune_command(["python", "train.py"], runner=Drifting(0.10, 0.0), cores=1)
    workers = next(t for t in tuning.trials if t.name == "1 workers")
    assert decided_on(workers) == f"{1 + workers.gain:.3f}× vs best" and decided_on(tuning.baseline) == "-"
    out = io.StringIO()
    render(tuning, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "decided on" in text and decided_on(workers) in text
    assert f"not in pairs ({tuning.paired})" in text  # said above the rows whenever trials were not paired
