"""`saturate tune -- CMD` and `saturate run -- CMD`: loader settings found by measurement and applied from
outside, the script itself unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cli_env, line_of, saturate_cmd
from saturate.script.command import run_instrumented
from saturate.script.overrides import NONE, Overrides
from saturate.script.tune_script import ScriptTrial, tune_command, window_rule
from saturate.script.tuning import ScriptTuning, edits

# A loader-bound loop: each sample takes 4 ms to produce (a sleep, so workers help even on a busy 2-core machine).
SLOW_DATA = """
import sys, time, torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 100000
    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.randn(16), torch.randn(1)
steps = int(sys.argv[1])
loader = DataLoader(Slow(), batch_size=8, num_workers=0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step + 1 == steps:
        break
print(f"trained {steps} steps")
"""


# A plain loop (no DataLoader, no Trainer) over a tiny model; OPTIMIZER is filled in.
PLAIN = """
import sys, torch, torch.nn as nn
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = OPTIMIZER
x, y = torch.randn(64, 32), torch.randn(64, 1)
for step in range(int(sys.argv[1])):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
print("done", int(sys.argv[1]))
"""


def saturate(*args: str, cwd, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(saturate_cmd(*args), env={**cli_env(), "OMP_NUM_THREADS": "1"}, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_applies_the_overrides_without_an_edit_and_compares(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_DATA)
    (tmp_path / "over.json").write_text(json.dumps({"loader": {"num_workers": 2, "persistent_workers": True}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "3", "--trial-seconds", "1", "--json", "--",
                   sys.executable, "slow.py", "30", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["as_written"]) == len(d["tuned"]) == 3 and len(d["ratios"]) == 3  # alternating rounds
    assert d["speedup"]["rounds"] == 3 and d["speedup"]["min"] <= d["speedup"]["median"] <= d["speedup"]["max"]
    assert "measuring side by side: round 3/3" in out.stderr
    assert d["tuning"] is None  # the settings were given, not tuned
    assert d["full_run"]["returncode"] == 0 and d["full_run"]["optimizer_steps"] == 30
    assert d["full_run"]["steps_per_s"] > 0
    assert "trained 30 steps" in out.stderr  # the script's own output, moved off stdout by --json


@pytest.mark.slow
def test_run_refuses_an_unreadable_overrides_file(tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2")
    out = saturate("run", "--overrides", "bad.json", "--", sys.executable, "x.py", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "not a readable overrides.json" in out.stderr


def test_the_edit_is_said_at_the_loader_call():
    t = ScriptTrial("2 workers", Overrides(loader={"num_workers": 2, "persistent_workers": True}), 0.5, None, 0.1, 3)
    base = ScriptTrial("as written", NONE, 1.0, None, 0.6, 3)
    tuning = ScriptTuning(["python", "train.py"], base, t, [base, t], loaders=[{"site": "train.py:40"}])
    assert edits(tuning) == ["train.py:40: DataLoader(..., num_workers=2, persistent_workers=True)"]
    from saturate.engine.host_alloc import child_env

    alloc = ScriptTrial("host allocator", Overrides(host_alloc=True), 0.9, None, 0.6, 3)
    said = edits(ScriptTuning(["python", "train.py"], base, alloc, [base, alloc], loaders=[{"site": "train.py:40"}]))
    assert said == ([f"in the environment: {' '.join(f'{k}={v}' for k, v in child_env({}).items())}"]
                    if child_env({}) else [])
    merged = Overrides(loader={"num_workers": 2}).merged(Overrides(loader={"prefetch_factor": 4}, tf32=True))
    assert merged.to_dict() == {"loader": {"num_workers": 2, "prefetch_factor": 4}, "tf32": True}


def tune_recorded(script: str, reports: list, **kw) -> ScriptTuning:
    """`tune_command` on `script` (its argument: a million steps) in short trials, each trial's report kept in
    `reports`."""
    def runner(*args, **k):
        run = run_instrumented(*args, **k)
        reports.append(run.report)
        return run

    return tune_command([sys.executable, script, "1000000"], steps=2, runner=runner, quiet_stdout=True,
                        rule=window_rule(max_seconds=1.0), window_s=0.2, **kw)


@pytest.mark.slow
def test_a_plain_adamw_script_gets_fused_tried_at_its_line(tmp_path, monkeypatch):
    script = tmp_path / "adam.py"
    script.write_text(PLAIN.replace("OPTIMIZER", "torch.optim.AdamW(model.parameters(), lr=1e-3)"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reports: list = []
    tuning = tune_recorded("adam.py", reports, supports={"bf16": False})
    assert [t.name for t in tuning.trials] == ["as written", "AdamW(fused=True)"]
    assert "precision: fp32 (bf16 is not native on cpu)" in tuning.decisions
    assert tuning.optimizer["site"] == line_of(script, "AdamW(") and not tuning.optimizer["fused"]
    assert reports[1]["optimizer"]["fused"] is True  # applied at the constructor, from outside
    assert len(reports[0]["windows"]["rates"]) >= 3 and tuning.baseline.windows >= 3  # timed in windows
    assert any(d.startswith("fused optimizer: AdamW(fused=True) ") for d in tuning.decisions)
    tuning.best = tuning.trials[1]  # kept or not (timing decides), its edit is said at the script's line
    assert edits(tuning) == [f"{line_of(script, 'AdamW(')}: AdamW(..., fused=True)"]


def test_a_plain_loop_gets_bf16_autocast_tried_from_outside_and_checked_against_its_own_losses(tmp_path,
                                                                                                monkeypatch):
    (tmp_path / "sgd.py").write_text(PLAIN.replace("OPTIMIZER", "torch.optim.SGD(model.parameters(), lr=0.1)"))
    monkeypatch.chdir(tmp_path)
    reports: list = []
    tuning = tune_recorded("sgd.py", reports, supports={"bf16": True}, confirm=False)
    assert [t.name for t in tuning.trials] == ["as written", "bf16 autocast"]
    assert reports[0]["loop"]["bf16_autocast"] is None and reports[1]["loop"]["bf16_autocast"] == "cpu"
    base, bf16 = tuning.trials
    assert len(base.losses) >= 3 and len(bf16.losses) >= 3  # each step's loss, from the backward passes
    # the same seed and batches: the losses differ by bf16's rounding alone, so they differ, a little
    assert bf16.losses[:3] != base.losses[:3] and bf16.losses[:3] == pytest.approx(base.losses[:3], rel=0.02)
    assert "losses within" in bf16.note
    assert any(d.startswith("precision: bf16 autocast ") for d in tuning.decisions)
    tuning.best = bf16  # kept or not (timing decides), its edit is said
    assert "around each forward and its loss: with torch.autocast('cpu', dtype=torch.bfloat16):" in edits(tuning)


@pytest.mark.slow
def test_a_loop_that_autocasts_itself_is_not_given_another_precision(tmp_path, monkeypatch):
    own = PLAIN.replace("OPTIMIZER", "torch.optim.SGD(model.parameters(), lr=0.1)").replace(
        "    loss = nn.functional.mse_loss(model(x), y)",
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n        loss = nn.functional.mse_loss(model(x), y)")
    (tmp_path / "own.py").write_text(own)
    monkeypatch.chdir(tmp_path)
    tuning = tune_command([sys.executable, "own.py", "1000000"], steps=2, quiet_stdout=True,
                          rule=window_rule(max_seconds=1.0), window_s=0.2, supports={"bf16": True}, confirm=False)
    assert [t.name for t in tuning.trials] == ["as written"]
    assert "precision: the script already trains in bf16 (its own torch.autocast)" in tuning.decisions


@pytest.mark.slow  # a tuning trial, then the whole script
def test_run_with_nothing_found_skips_the_side_by_side_and_runs_the_script_as_written(tmp_path):
    (tmp_path / "sgd.py").write_text(PLAIN.replace("OPTIMIZER", "torch.optim.SGD(model.parameters(), lr=0.01)"))
    # long enough that its first trial (up to 8 windows alone while its speed settles, then its own) cannot reach
    # the script's end on a slow machine (CI's 3000 steps did: "a short job")
    out = saturate("run", "--trial-steps", "2", "--trial-seconds", "1", "--json", "--", sys.executable, "sgd.py",
                   "12000", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["overrides"] == {} and d["side_by_side"] is None and not d["as_written"] and not d["ratios"]
    assert d["reason"].startswith("tuning found no setting faster than the script as written beyond the noise")
    assert "measuring side by side" not in out.stderr and "done 12000" in out.stderr  # the whole script ran
    assert d["full_run"]["returncode"] == 0 and d["full_run"]["optimizer_steps"] == 12000


class _Planned:
    def __init__(self, steps):
        self.planned_steps = steps


def test_a_job_is_too_short_to_tune_when_it_ends_in_its_first_trial_or_its_trainer_plans_too_few_steps():
    from saturate.script.short_job import too_short

    base = ScriptTrial("as written", NONE, 0.1, None, 0.0, 10)
    assert too_short(base, 10.0, None) is None  # a plain loop plans nothing saturate can read
    base.ran_to_end = True
    assert too_short(base, 10.0, None).startswith("the script ran to its end inside its first trial")
    base.ran_to_end = False
    # 100 steps × 0.1 s = 10 s against a tuning of about 8 trials × 10 s: could not pay for itself
    assert "could not pay for itself" in too_short(base, 10.0, _Planned(100))
    assert too_short(base, 10.0, _Planned(100_000)) is None  # 10 000 s: worth tuning
    # a plain loop whose settings say its length: 100 steps (cfg.max_steps) are as short as a Trainer's
    loop = {"measurements": {"grad_accum": 1}, "loaders": [{"split": {"length": {"steps": {"cfg.max_steps": 100},
                                                                                 "epochs": {}}}}]}
    assert "100 planned steps take about 10 s" in too_short(base, 10.0, None, loop)


@pytest.mark.parametrize(("device", "share", "expected", "faults"), [
    ("cpu", 0.6, {"num_workers": 2, "persistent_workers": True}, None),  # it waited for data: workers, chosen
    ("cpu", 0.05, {}, 20_000.0),  # on a CPU workers would take cores from the step: none
    ("cuda", 0.0, {"num_workers": 4, "persistent_workers": True, "pin_memory": True}, 20_000.0),  # from the cores
])
def test_a_short_job_gets_only_the_settings_that_change_nothing_in_the_training(device, share, expected, faults):
    from saturate.engine.host_alloc import left_alone
    from saturate.script.short_job import prior_overrides

    base = ScriptTrial("as written", NONE, 0.1, None, share, 10, faults_per_s=faults)
    tuning = ScriptTuning(["python", "train.py"], base, base, [base], device_type=device,
                          loaders=[{"site": "train.py:9", "num_workers": 0, "pin_memory": False}])
    over, said = prior_overrides(tuning, cores=2 if device == "cpu" else 16)
    assert over.loader == expected
    # glibc's thresholds: on a CPU whose first trial faulted pages in fast, chosen
    assert over.host_alloc == (device == "cpu" and faults is not None and left_alone() is None)
    assert said[-1].startswith("not applied without measuring: precision, micro-batch")
    assert all("not measured" in line for line in said[:-1] if "→" in line)


def test_a_short_job_over_a_stream_that_does_not_shard_gets_no_workers():
    from saturate.script.short_job import prior_overrides

    stream = {"sizes": [8], "digests": [[]], "dataset": {"class": "Lines", "stream": True, "shards": False,
                                                         "defined_at": "train.py:4"}}
    base = ScriptTrial("as written", NONE, 0.1, None, 0.6, 10, fingerprint=stream)
    tuning = ScriptTuning(["python", "train.py"], base, base, [base],
                          loaders=[{"site": "train.py:9", "num_workers": 0}])
    over, said = prior_overrides(tuning, cores=2)
    assert over.loader == {}
    assert said[0].startswith("loader workers: 0 as written (its stream does not shard itself by worker") and \
        "train.py:4: in Lines.__iter__, yield only every info.num_workers-th sample" in said[0]


def test_a_short_job_without_a_dataloader_still_gets_the_allocator(monkeypatch):
    from saturate.engine import host_alloc
    from saturate.script.short_job import prior_overrides

    monkeypatch.setattr(host_alloc, "left_alone", lambda environ=None: None)
    base = ScriptTrial("as written", NONE, 0.1, None, 0.0, 10, faults_per_s=20_000.0)
    tuning = ScriptTuning(["python", "train.py"], base, base, [base], device_type="cpu", loaders=[])
    over, said = prior_overrides(tuning, cores=2)
    assert over == Overrides(host_alloc=True)
    assert said[0].startswith("loader settings: no DataLoader") and "allocator" in said[1]
    base.faults_per_s = 500.0  # buffers reused already: nothing at all
    assert prior_overrides(tuning, cores=2)[0] == NONE


def test_run_on_a_short_job_does_not_tune_and_applies_the_risk_free_settings(tmp_path):
    # the loader made inline in the loop, so nothing but its iterator holds it
    (tmp_path / "short.py").write_text(SLOW_DATA.replace("loader = DataLoader(Slow(), batch_size=8, num_workers=0)\n",
                                                         "").replace("enumerate(loader)",
                                                                     "enumerate(DataLoader(Slow(), batch_size=8))"))
    out = saturate("run", "--trial-steps", "4", "--trial-seconds", "2", "--json", "--", sys.executable, "short.py",
                   "40", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    short = d["short_job"]
    assert short["why"].startswith("the script ran to its end inside its first trial")
    assert short["applied"] == {"loader": {"num_workers": 2, "persistent_workers": True}}
    assert d["side_by_side"] is None and d["applied"] is True and d["full_run"]["optimizer_steps"] == 40


@pytest.mark.parametrize(("device", "faults", "tried"), [
    ("cpu", 24_000.0, True),  # the peers' job's rate under glibc's defaults: worth a trial
    ("cpu", 800.0, False),  # a step that reuses its buffers already: nothing to gain
    ("cpu", None, False),  # not read (no complete window)
    ("cuda", 24_000.0, False),  # the step's buffers are the device's
])
def test_the_host_allocator_is_tried_only_on_a_cpu_that_faults_pages_in_fast(device, faults, tried, monkeypatch):
    from types import SimpleNamespace

    from saturate.engine import host_alloc
    from saturate.script.host_stages import alloc_stage

    monkeypatch.setattr(host_alloc, "left_alone", lambda environ=None: None)
    base = ScriptTrial("as written", NONE, 0.5, None, 0.0, 10, faults_per_s=faults)
    considered = []
    search = SimpleNamespace(result=ScriptTuning(["python", "train.py"], base, base, [base], device_type=device),
                             with_overrides=lambda over: over,
                             consider=lambda name, over: considered.append((name, over)))
    alloc_stage(search, device)
    assert considered == ([("host allocator", Overrides(host_alloc=True))] if tried else [])
    assert bool(search.result.decisions) != tried
    if not tried and device == "cpu":
        assert "minor page faults while timed" in search.result.decisions[0]


MANY_WORKERS = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1)), batch_size=8)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step(); opt.zero_grad()
    if step == int(sys.argv[1]):
        break
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["trial", "apply"])
def test_torchs_warning_of_more_workers_than_cores_is_left_out_of_trials_only(tmp_path, monkeypatch, capfd, mode):
    import os

    from saturate.script.boundary import ChildSettings

    (tmp_path / "many.py").write_text(MANY_WORKERS)
    monkeypatch.chdir(tmp_path)
    workers = Overrides(loader={"num_workers": (os.cpu_count() or 1) + 1})
    settings = (ChildSettings(mode="trial", warmup=1, count_steps=0, steps=2, stop=True, overrides=workers)
                if mode == "trial" else ChildSettings(mode="apply", profile=False, stop=False, overrides=workers))
    run = run_instrumented([sys.executable, "many.py", "6"], settings, quiet_stdout=True)
    assert run.returncode == 0
    # every trial of a worker count saturate is measuring would say it twice; the user's own run still does
    assert ("This DataLoader will create" in capfd.readouterr().err) is (mode == "apply")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["trial", "doctor"])
def test_a_trials_own_output_goes_to_its_log_and_its_failure_names_it(tmp_path, monkeypatch, capfd, mode):
    from saturate.errors import SaturateError
    from saturate.script.boundary import ChildSettings

    (tmp_path / "fails.py").write_text("import sys, torch\nprint('config: width 64')\n"
                                       "sys.exit('ValueError: no such dataset')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SATURATE_TRIAL_LOGS", str(tmp_path / "logs"))
    with pytest.raises(SaturateError) as e:
        run_instrumented([sys.executable, "fails.py"], ChildSettings(mode=mode, stop=True), quiet_stdout=True)
    said = str(e.value)
    assert said.startswith("the script failed before its first optimizer step (exit code 1: ValueError: no such")
    printed = capfd.readouterr().err
    if mode == "trial":  # its log holds both of its streams, in order; the terminal neither
        log = next((tmp_path / "logs").glob("*.log"))
        assert said.endswith(f" (its output: {log})")
        assert log.read_text() == "config: width 64\nValueError: no such dataset\n"
        assert "config: width 64" not in printed and "no such dataset" not in printed
    else:
        assert "its output" not in said and "config: width 64" in printed and "no such dataset" in printed
