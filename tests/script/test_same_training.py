"""`tune -- CMD` keeps no change that changes the training: each trial's data fingerprint and first losses against
the script as written's (script/same_training.py), whatever the trial measured."""

from __future__ import annotations

from typing import Any

import pytest

from saturate.data.fingerprint import Same
from saturate.script.boundary import ChildSettings
from saturate.script.command import ScriptRun
from saturate.script.overrides import NONE, Overrides
from saturate.script.same_training import changed_training
from saturate.script.script_trial import ScriptTrial
from saturate.script.tune_script import tune_command
from saturate.script.tuning import ScriptTuning

STREAM = {"class": "Stream", "stream": True, "defined_at": "train.py:6"}


def stream_print(workers: int, shards: bool) -> dict[str, Any]:
    """The first 8 batches of 4 samples of a stream of distinct samples, as `workers` loader workers deliver them
    (round robin): each replaying the whole stream, or (`shards`) each its share."""
    w = max(1, workers)
    samples = [[(k % w) + w * (4 * (k // w) + j) if shards else 4 * (k // w) + j for j in range(4)]
               for k in range(8)]
    return {"indices": None, "sizes": [4] * 8, "digests": [[f"s{i}" for i in batch] for batch in samples],
            "epoch": None, "dataset": {**STREAM, "shards": shards}}


class StreamMachine:
    """An input-bound script over a stream: each worker adds a loader's worth of speed (up to 8)."""

    def __init__(self, shards: bool) -> None:
        self.shards = shards

    def __call__(self, command: list[str], settings: ChildSettings, **kw: Any) -> ScriptRun:
        workers = settings.overrides.loader.get("num_workers", 0)
        rate = 10.0 * min(max(workers, 1), 8)
        report = {"measurements": {"step_s": 1 / rate, "samples_per_step": 4, "phases": {"data": 0.9 / rate},
                                   "steps": 10, "device_type": "cpu", "main_peak": 2**20},
                  "loaders": [{"site": "train.py:20", "num_workers": 0, "batch_size": 4, "batches": 12,
                               "fingerprint": stream_print(workers, self.shards)}],
                  "optimizer": {"class": "SGD", "site": "train.py:22"}, "first_step_s": 1.0,
                  "windows": {"rates": [rate * 0.99, rate * 1.01, rate], "steps": 15, "busy": False}}
        return ScriptRun(list(command), 0, report, None, 30, 1.0)


def test_workers_that_replay_a_stream_are_not_kept_however_fast_and_the_sharding_edit_is_said():
    tuning = tune_command(["python", "train.py"], runner=StreamMachine(shards=False), cores=2)
    assert tuning.best is tuning.baseline  # 2 workers measured 2x: the duplication, not a speed-up
    one, two = tuning.trials[1:3]
    assert one.same["same"] == Same.SAME.name and two.same["same"] == Same.REPEATED.name
    assert two.same["changed"] and two.same["times"] == 2
    assert two.outcome.startswith("not kept: it changes the training: samples repeated (50 % of its first samples")
    assert "train.py:6: in Stream.__iter__, yield only every info.num_workers-th sample" in two.outcome
    assert "loader workers: 0 (as written 0; tried 1, 2)" in tuning.decisions
    assert tuning.to_dict()["trials"][2]["same"]["same"] == "REPEATED"
    assert "digests" not in tuning.to_dict()["trials"][2]["fingerprint"]  # the record, not the digests
    assert tuning.loaders[0]["fingerprint"]["digests"]  # kept in the run, for the comparisons
    assert "digests" not in tuning.to_dict()["loaders"][0]["fingerprint"]  # not in tune.json's loaders either


def test_workers_over_a_stream_that_shards_itself_are_kept_and_say_the_order_changed():
    tuning = tune_command(["python", "train.py"], runner=StreamMachine(shards=True), cores=2)
    assert tuning.best.overrides.loader["num_workers"] == 8
    assert tuning.best.same["same"] == Same.SHARDED_STREAM.name
    assert "the stream in another order: its workers each yield their share" in tuning.best.outcome


def trial(name: str, overrides: Overrides, losses: list[float], fingerprint: dict | None = None) -> ScriptTrial:
    return ScriptTrial(name, overrides, 0.1, None, 0.0, 10, losses=losses, samples_per_step=4,
                       fingerprint=fingerprint)


@pytest.mark.parametrize("noise, drift, kept, said", [
    (0.001, 0.05, False, "its first 3 losses differ from the script's own by up to 5.0 %"),
    (0.001, 0.005, True, ""),
    (None, 0.05, True, "losses not compared (the script's own runs not repeated)"),
    (0.08, 0.05, True, "losses not compared (the script's own runs 8.0 % apart)"),
])
def test_a_change_whose_losses_drift_is_not_kept_where_the_scripts_own_runs_agree(noise, drift, kept, said):
    base = trial("as written", NONE, [2.0, 1.8, 1.6])
    fused = trial("AdamW(fused=True)", Overrides(optimizer={"fused": True}), [2.0 * (1 + drift), 1.8, 1.6])
    tuning = ScriptTuning(["python", "train.py"], base, base, [base, fused], loss_noise=noise)
    problem = changed_training(fused, tuning)
    assert (problem is None) == kept
    assert said in (problem or fused.note)
    assert fused.same["same"] == Same.NOT_SEEN.name  # no DataLoader: the losses are the check


def test_losses_are_not_compared_where_the_loader_draws_other_random_numbers():
    base_print = {"indices": [0, 1, 2, 3], "sizes": [4], "digests": [["a", "b", "c", "d"]], "epoch": None}
    drawn = {**base_print, "digests": [["e", "f", "g", "h"]]}  # the same indices, other augmentations
    base = trial("as written", NONE, [2.0, 1.8], base_print)
    workers = trial("2 workers", Overrides(loader={"num_workers": 2}), [2.5, 1.8], drawn)
    tuning = ScriptTuning(["python", "train.py"], base, base, [base, workers], loss_noise=0.001)
    assert changed_training(workers, tuning) is None and workers.note == "the same samples, other random draws"
    # a loader of the script's own with in_order=False: given workers, its batches come as they finish (measured:
    # the sampler's indices alike, the digests in another order), which it allows; said so, not "random draws"
    unordered = trial("2 workers", Overrides(loader={"num_workers": 2}), [2.5, 1.8], drawn)
    tuning.loaders = [{"site": "train.py:9", "num_workers": 0, "in_order": False}]
    assert changed_training(unordered, tuning) is None
    assert unordered.note == "the same samples, in the order its workers finish them (the script's in_order=False " \
                             "allows it)"
    assert changed_training(base, tuning) is None and base.same is None  # the script as written is the reference


# A stream each loader worker would replay whole (its __iter__ never asks which worker it is in): the script writes
# the sample ids it trained on to argv[2].
UNSHARDED = """
import sys, time, torch, torch.nn as nn
from torch.utils.data import DataLoader, IterableDataset

class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        for i in range(self.n):
            time.sleep(0.002)
            yield i, torch.full((16,), i / self.n), torch.ones(1)

loader = DataLoader(Stream(8 * int(sys.argv[1])), batch_size=8, num_workers=0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = []
for i, x, y in loader:
    seen.extend(i.tolist())
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
open(sys.argv[2], "w").write(" ".join(map(str, seen)))
"""


@pytest.mark.slow
def test_run_trains_on_exactly_the_samples_a_plain_run_does(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import cli_env, saturate_cmd

    (tmp_path / "stream.py").write_text(UNSHARDED)
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}

    def saturate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(saturate_cmd(*args), env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)

    plain = subprocess.run([sys.executable, "stream.py", "400", "plain.txt"], cwd=tmp_path, env=env, timeout=120)
    assert plain.returncode == 0
    out = saturate("run", "--trial-steps", "3", "--trial-seconds", "1", "--json", "--", sys.executable, "stream.py",
                   "400", "tuned.txt")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    sames = {t["name"]: t["same"] for t in d["tuning"]["trials"] if t["same"]}
    assert sames["2 workers"]["same"] == "REPEATED" and "Stream.__iter__" in sames["2 workers"]["edit"]
    assert d["overrides"].get("loader", {}).get("num_workers", 0) <= 1  # one worker overlaps, and replays nothing
    assert d["full_run"]["same"]["same"] == "ALIKE"
    assert (tmp_path / "tuned.txt").read_text() == (tmp_path / "plain.txt").read_text()  # the same samples, in order


def test_a_full_run_whose_training_differs_is_warned_about():
    from rich.console import Console

    from saturate.script.run_script import ScriptRunReport, render

    written = stream_print(0, shards=False)
    base = trial("as written", NONE, [], written)
    replayed = {**stream_print(2, shards=False), "epoch": [100, 800]}
    full = ScriptRun(["python", "train.py"], 0, None, {"step_times": [0.0, 1.0, 2.0, 3.0, 4.0], "loaders": [
        {"site": "train.py:20", "batches": 100, "fingerprint": replayed}]}, 100, 5.0)
    report = ScriptRunReport(["python", "train.py"], Overrides(loader={"num_workers": 2}), [base], [base], full)
    console = Console(width=300, record=True)
    render(report, console)
    assert report.to_dict()["full_run"]["same"]["same"] == "REPEATED"
    assert ("warning: the full run's training differs from the script as written's: samples repeated (50 % of its "
            "first samples repeat earlier ones; its first batches repeat 2 times); train.py:6: in Stream.__iter__"
            ) in console.export_text()


@pytest.mark.parametrize("loader, said", [
    ({"num_workers": 2, "persistent_workers": False, "epoch_batches": 40, "starts": [0.5, 0.52]},
     "without persistent_workers they start again every epoch of 40 batches: about 0.50 s an epoch, 56 % of it at "
     "the measured step time (a prediction); train.py:9: DataLoader(..., persistent_workers=True) keeps them"),
    ({"num_workers": 2, "persistent_workers": True, "epoch_batches": 40, "starts": [1.5]}, "): paid once a run, "
     "with its 2 workers starting"),
    ({"num_workers": 2, "persistent_workers": False, "epoch_batches": 100_000, "starts": [0.5]}, None),
    ({"num_workers": 0, "epoch_batches": 40, "starts": [0.01]}, None),
])
def test_the_doctor_names_a_loader_whose_workers_restart_each_epoch_or_whose_first_batch_is_slow(loader, said):
    from saturate.doctor.findings import Measurements
    from saturate.script.doctor_script import loader_starts

    m = Measurements(device_type="cpu", device_name="cpu", timing="wall", steps=10, step_s=0.01, phases={},
                     grad_accum=1)
    note = loader_starts({"loaders": [{"site": "train.py:9", **loader}]}, m)
    assert (note is None) if said is None else (said in note and note.startswith(
        f"the training loader's first batch came {loader['starts'][0]:.2f} s after it was asked for (measured"))
