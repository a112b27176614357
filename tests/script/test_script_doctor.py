"""`saturate doctor -- CMD`: a user's script, unchanged, instrumented in its own process; bad commands refused
in one line; Ctrl-C and time limits stop the whole command."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import cli_env, line_of, saturate_cmd
from saturate.doctor.findings import Fix, Prediction
from saturate.script.doctor_script import in_your_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scripts"
FAST = ["--warmup", "1", "--steps", "2"]


def doctor(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(saturate_cmd("doctor", *args), env=cli_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# A nanoGPT-style loop: no DataLoader, batches from a get_batch() inside the accumulation loop.
GET_BATCH_LOOP = """
import torch, torch.nn as nn
torch.manual_seed(0)
data = torch.randint(0, 64, (20000,))
def get_batch():
    i = torch.randint(0, len(data) - 33, (8,))
    return torch.stack([data[j:j + 32] for j in i]), torch.stack([data[j + 1:j + 33] for j in i])
model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(200):
    for micro in range(2):
        x, y = get_batch()
        loss = nn.functional.cross_entropy(model(x).view(-1, 64), y.view(-1)) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    lossf = loss.item()  # the one read that would wait for a GPU; get_batch's index reads would not
open("finished.txt", "w").write("the script ran to its end")
"""


@pytest.mark.slow
def test_doctor_a_guide_script_unchanged(tmp_path):
    script = EXAMPLES / "gpt_pretrain" / "train.py"
    before = script.read_bytes()
    out = doctor(*FAST, "--json", "--", sys.executable, str(script), "--config", "tiny", "--out-dir",
                 str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["verdict"] and d["measurements"]["steps"] == 2 and d["measurements"]["context"] == "loop"
    phases = d["measurements"]["phases"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0  # the model was found
    script_view = d["script"]
    assert script_view["model"]["class"] == "GPT" and script_view["optimizer"]["class"] == "AdamW"
    loader = script_view["loaders"][0]
    assert loader["site"].endswith(line_of(script, "DataLoader(")) and loader["batch_size"] == 4
    assert loader["num_workers"] == 0
    assert loader["batches"] == 2 * 2  # 2 timed steps × accumulation 2
    assert script_view["optimizer"]["site"].endswith(line_of(script, "torch.optim.AdamW("))
    # stopped after its measured steps: the script never saved (into its scratch layer: the folder is never written)
    assert not any(w.startswith("out") for w in d["script"]["written"] or []) and not (tmp_path / "out").exists()
    assert script.read_bytes() == before  # nothing of the user's is changed


@pytest.mark.slow
def test_doctor_the_time_series_guide_script_counts_its_per_batch_host_copy(tmp_path):
    script = EXAMPLES / "timeseries_grid" / "train.py"
    out = doctor(*FAST, "--json", "--", sys.executable, str(script), "--hidden", "8", "--window", "8",
                 "--num-workers", "1", "--length", "2000", "--batch-size", "16", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["measurements"]["syncs_per_step"] == 1  # predictions.append(out.detach().cpu().numpy())
    loader = d["script"]["loaders"][0]
    assert loader["site"].endswith(line_of(script, "DataLoader(")) and loader["num_workers"] == 1
    assert loader["batch_size"] == 16
    assert d["script"]["model"]["class"] == "Forecaster" and d["script"]["optimizer"]["class"] == "Adam"


@pytest.mark.slow
def test_human_report_names_the_script_and_its_knobs(tmp_path):
    script = EXAMPLES / "gpt_pretrain" / "train.py"
    out = doctor(*FAST, "--", sys.executable, str(script), "--config", "tiny", "--out-dir", str(tmp_path / "out"),
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "verdict:" in out.stdout and "in your script" in out.stdout
    assert "training DataLoader at" in out.stdout and line_of(script, "DataLoader(") in out.stdout
    assert "saturate's hooks:" in " ".join(out.stdout.split())  # their own time per step, measured
    assert "config: {" in out.stdout  # the script's own output still reaches the terminal


@pytest.mark.slow
def test_a_loop_without_dataloader_gets_the_host_share_named(tmp_path):
    (tmp_path / "loop.py").write_text(GET_BATCH_LOOP)
    out = doctor(*FAST, "--json", "--", sys.executable, "loop.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["script"]["loaders"] == []
    assert any("no DataLoader" in n and "get_batch" in n for n in d["measurements"]["notes"])
    assert d["measurements"]["phases"]["other"] > 0  # get_batch() lands in "everything else", the host's share
    assert d["measurements"]["syncs_per_step"] == 1
    assert d["measurements"]["syncs_by_site"] == {line_of(tmp_path / "loop.py", "lossf = loss.item()"): 1}
    # stopped after its measured steps: the script never reached its last line (its writes kept from the folder)
    assert not d["script"]["written"] and not (tmp_path / "finished.txt").exists()  # None: not isolated here


DDP_SCRIPT = """
import torch, torch.nn as nn, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(4000, 32), torch.randn(4000, 1)), batch_size=16, shuffle=True)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
open(f"finished-{dist.get_rank()}.txt", "w").write("ran to its end")
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.dist
def test_under_torchrun_every_rank_stops_together_and_rank_0_reports(tmp_path):
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    traces = tmp_path.parent / f"{tmp_path.name}-traces"  # outside the script's folder, which stays as it was
    out = doctor(*FAST, "--json", "--trace-dir", str(traces), "--", sys.executable, "-m", "torch.distributed.run",
                 "--nproc_per_node=2", "ddp.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["script"]["world_size"] == 2 and d["measurements"]["steps"] == 2
    # every rank traced the steps after the timed ones, its phases as ranges; rank 0's file is the one named
    assert d["measurements"]["trace"]["trace"] == str(traces / "rank0_trace.json")
    assert d["measurements"]["trace"]["ranks"] == 2
    for rank in (0, 1):
        events = json.loads((traces / f"rank{rank}_trace.json").read_text())["traceEvents"]
        assert {"saturate: forward", "saturate: backward", "saturate: step 1"} <= {e.get("name") for e in events}
    assert d["script"]["model"]["class"] == "Sequential"
    assert d["script"]["model"]["wrapped_in"] == ["DistributedDataParallel"]
    assert not list(tmp_path.glob("finished-*")) and not running_in(tmp_path)
    # the sibling rank is this job, not a neighbour: a quiet machine is not "contended" (contention.job_root)
    assert d["verdict"] != "contended" and d["measurements"]["contention"]["significant"] is False


@pytest.mark.parametrize(("command", "message"), [
    ([], "no command after `--`"),
    (["no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["ls", "-l"], "ls is not a Python command"),
])
@pytest.mark.slow
def test_commands_that_cannot_be_instrumented_are_refused_in_one_line(tmp_path, command, message):
    out = doctor("--", *command, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("saturate: error: ") and message in lines[0]


@pytest.mark.slow
def test_a_script_failing_before_its_first_step_is_named_with_its_own_error(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\nraise ValueError('no such config: medium')\n")
    out = doctor("--", sys.executable, "bad.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("saturate: error: the script failed before its first optimizer step (exit code 1: "
                    "ValueError: no such config: medium)")
    assert "Traceback" in out.stderr  # the script's own traceback is shown as it ran, above saturate's line


@pytest.mark.slow
def test_a_script_without_optimizer_steps_or_ending_early_says_so(tmp_path):
    (tmp_path / "none.py").write_text("import torch\nprint(torch.ones(2).sum())\n")
    out = doctor("--", sys.executable, "none.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "ended without an optimizer step (exit code 0)" in out.stderr
    (tmp_path / "short.py").write_text(GET_BATCH_LOOP.replace("range(200)", "range(2)"))
    out = doctor("--warmup", "2", "--steps", "5", "--", sys.executable, "short.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "the script ended after 2 optimizer step(s)" in out.stderr


@pytest.mark.slow
def test_a_script_that_ends_inside_the_timed_steps_is_diagnosed_on_what_was_timed(tmp_path):
    (tmp_path / "short.py").write_text(GET_BATCH_LOOP.replace("range(200)", "range(6)"))
    out = doctor("--warmup", "1", "--steps", "50", "--json", "--", sys.executable, "short.py", cwd=tmp_path,
                 timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert 1 <= d["measurements"]["steps"] < 50
    assert any("ended after" in n for n in d["measurements"]["notes"])


def running_in(folder: Path) -> list[psutil.Process]:
    """Processes still running in `folder` (the script and anything it started)."""
    found = []
    for p in psutil.process_iter(["cwd"]):
        with contextlib.suppress(psutil.Error):
            if p.info["cwd"] == str(folder) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@pytest.mark.slow
def test_no_first_step_within_the_limit_stops_the_command(tmp_path):
    (tmp_path / "slow.py").write_text("import time, torch\ntime.sleep(120)\n")
    started = time.monotonic()
    out = doctor("--first-step-timeout", "3", "--", sys.executable, "slow.py", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "no optimizer step within 3 s" in out.stderr
    assert time.monotonic() - started < 60
    assert not [p for p in psutil.process_iter(["cmdline"]) if "slow.py" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
def test_ctrl_c_stops_the_command_and_everything_it_started(tmp_path):
    (tmp_path / "slow.py").write_text("import time, torch\nprint('started', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(saturate_cmd("doctor", "--", sys.executable, "slow.py"), env=cli_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = iter(proc.stdout.readline, "")
    assert any(line.strip() == "started" for line in lines)  # the script is running
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "saturate: interrupted"
    assert not running_in(tmp_path)


def test_other_verbs_take_no_command():
    from saturate.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--", "python", "train.py"])
    assert e.value.code == 2


def test_fixes_are_said_in_the_scripts_own_terms():
    report = {"loaders": [{"site": "train.py:92", "batch_size": 12}],
              "optimizer": {"class": "AdamW", "site": "train.py:95"}, "model": {"class": "GPT"}}
    p = Prediction("step_s", 1.0, 0.5, "test")
    assert in_your_script(Fix("workers", {"num_workers": 2, "prefetch_factor": 4}, p, ""), report, "cuda") == [
        "train.py:92: DataLoader(..., num_workers=2, prefetch_factor=4)"]
    lines = in_your_script(Fix("micro", {"micro_batch": 32, "grad_accum": 4}, p, ""), report, "cuda")
    assert lines[0] == "train.py:92: DataLoader(..., batch_size=32)" and "accumulate 4 micro-batches" in lines[1]
    one = in_your_script(Fix("micro", {"micro_batch": 128, "grad_accum": 1}, p, ""), report, "cuda")
    assert one[1].startswith("no accumulation: one micro-batch per optimizer step")  # never "accumulate 1 …"
    assert in_your_script(Fix("bf16", {"precision": "bf16"}, p, ""), report, "cuda") == [
        "wrap the forward and the loss in `with torch.autocast('cuda', dtype=torch.bfloat16):`"]
    assert in_your_script(Fix("fused", {"fused": True}, p, ""), report, "cuda") == [
        "train.py:95: AdamW(..., fused=True)"]
    assert in_your_script(Fix("compile", {"compile": "default"}, p, ""), report, "cuda") == [
        "model = torch.compile(model) after building your GPT"]
    assert in_your_script(Fix("code", {}, p, ""), report, "cuda") == []


def test_the_shim_chains_an_existing_sitecustomize(tmp_path):
    """A machine's own sitecustomize still runs under saturate's (Debian and conda ship one)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    from saturate.script.boundary import SHIM

    env = cli_env()
    env["PYTHONPATH"] = f"{SHIM}:{theirs}:{env['PYTHONPATH']}"
    env["SATURATE_SCRIPT_DIR"] = str(tmp_path)
    code = "import os, sys; print(os.environ.get('THEIRS_RAN'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False"]  # theirs ran; torch is not imported until the script does


@pytest.mark.parametrize("first", ["", "import importlib.util; importlib.util.find_spec('torch')",
                                   "import importlib.util; importlib.util.find_spec('torch'); "
                                   "importlib.util.find_spec('torch')"])
def test_the_shim_waits_for_torch_and_then_installs_the_hooks(tmp_path, first):
    """Also when torch is looked up before it is imported (`datasets` calls find_spec("torch") at import time,
    and most Hugging Face scripts import datasets first): the lookup's spec is thrown away, the import is hooked."""
    from saturate.script.boundary import SHIM

    env = cli_env()
    env["PYTHONPATH"] = f"{SHIM}:{env['PYTHONPATH']}"
    env["SATURATE_SCRIPT_DIR"] = str(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        {first}
        assert "saturate.script.child.hooks" not in sys.modules and "torch" not in sys.modules
        import torch
        from saturate.script.child import hooks
        print(hooks._script is not None, "install.<locals>.init" in torch.utils.data.DataLoader.__init__.__qualname__,
              not any(type(f).__name__ == "_AfterTorch" for f in sys.meta_path))  # gone once torch has run
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr


HAND_UPDATED = """
import torch
torch.manual_seed(0)
w = torch.randn(64, requires_grad=True)
x = torch.randn(256, 64)
for step in range(10**7):
    loss = (x @ w).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 1e-3 * w.grad
        w.grad = None
open("finished.txt", "w").write(str(step))
print("FINISHED", step)
"""


def test_a_script_without_an_optimizer_is_stopped_in_one_line_not_run_to_its_end(tmp_path):
    (tmp_path / "hand.py").write_text(HAND_UPDATED)
    started = time.monotonic()
    out = doctor("--", sys.executable, "hand.py", cwd=tmp_path)
    assert out.returncode != 0
    assert "backward passes without a torch.optim optimizer step" in out.stderr.strip().splitlines()[-1]
    assert "FINISHED" not in out.stdout and time.monotonic() - started < 120


# pytorch/examples' time_sequence_prediction, in small: LBFGS runs the script's closure (forward, backward, and a
# weight update between) several times inside each optimizer step — not an update by hand
LBFGS = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
for step in range(200):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
"""


def test_an_optimizer_running_the_scripts_closure_inside_its_step_is_not_an_update_by_hand(tmp_path):
    (tmp_path / "lbfgs.py").write_text(LBFGS)
    out = doctor("--json", "--", sys.executable, "lbfgs.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]  # it read "changed its weights between backward passes 2 times"
    assert json.loads(out.stdout)["script"]["optimizer"]["class"] == "LBFGS"


# micro-batch 1 × accumulation 4 through twelve tiny layers: a micro-step's fixed cost is nearly all of it
SMALL_MICRO_BATCHES = """
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(20000, 32), torch.randn(20000, 1))
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)], torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(data, batch_size=1, shuffle=True)
for step, (x, y) in enumerate(loader):
    (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
    if (step + 1) % 4 == 0:
        opt.step()
        opt.zero_grad()
"""


def test_a_script_at_a_small_micro_batch_is_found_overhead_bound_by_its_scaling_probe(tmp_path):
    (tmp_path / "small.py").write_text(SMALL_MICRO_BATCHES)
    out = subprocess.run(saturate_cmd("doctor", "--json", "--", sys.executable, "small.py"),
                         env={**cli_env(), "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    probe = d["measurements"]["scaling"]
    assert probe["micro_batches"] == [1, 2] and len(probe["ratios"]) == 5  # measured in the script's own process
    assert d["verdict"] == "overhead-bound", (d["verdict"], probe)
    assert d["fixes"][0]["title"].startswith("micro-batch 1 → ") and d["fixes"][0]["changes"]["grad_accum"] < 4


# pytorch/examples' word_language_model: an nn.Module updated by hand (`p.data.add_`), slow steps
HAND_UPDATED_MODULE = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
x = torch.randn(256, 64)
for step in range(10**6):
    print("STEP", step, flush=True)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    time.sleep(0.5)  # a step of half a second: 256 backward passes would take two minutes
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-1e-3)
"""


def test_a_hand_updated_model_is_stopped_after_a_few_backward_passes_whatever_a_step_costs(tmp_path):
    (tmp_path / "hand.py").write_text(HAND_UPDATED_MODULE)
    out = doctor("--", sys.executable, "hand.py", cwd=tmp_path)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "changed its weights between backward passes 2 times without a torch.optim optimizer step" in last
    steps = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("STEP")]
    assert max(steps) <= 3, steps  # stopped at the third backward pass, seconds in


LIBRARY = """
def log_every_step(loss):
    return loss.item()  # a framework's logging: the read is here, the call in the user's script
"""

CALLS_A_LIBRARY = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import fakelib
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(400):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    fakelib.log_every_step(loss)
"""


def test_a_read_inside_a_library_is_placed_at_the_librarys_line_and_the_users_call(tmp_path):
    library = tmp_path / "lib" / "site-packages"
    library.mkdir(parents=True)
    (library / "fakelib.py").write_text(LIBRARY)
    (tmp_path / "loop.py").write_text(CALLS_A_LIBRARY)
    out = doctor("--json", "--", sys.executable, "loop.py", str(library), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    sites = json.loads(out.stdout)["measurements"]["syncs_by_site"]
    where = f"fakelib.py:{line_of(library / 'fakelib.py', 'loss.item()').split(':')[1]}"
    assert sites == {f"{where} (from {line_of(tmp_path / 'loop.py', 'fakelib.log_every_step(')})": 1}


def test_a_fix_no_model_predicts_says_what_measures_it_for_a_command():
    from saturate.script.doctor_script import trial_for

    tune = "(`saturate tune -- CMD` measures it)"
    assert trial_for({"precision": "bf16"}, framework=False, device_type="mps") == tune
    assert trial_for({"precision": "bf16"}, framework=False) == "(--apply measures it)"  # bf16 autocast from outside
    assert trial_for({"compile": "default"}, framework=True) == "(`saturate tune -- CMD` measures it)"
    assert trial_for({"compile": "default"}, framework=False) == "(--apply measures it)"  # compiled in place
    assert "needs your training code" in trial_for({"activation_checkpointing": True}, framework=False)


def test_a_fix_is_applied_from_outside_only_where_every_change_it_makes_can_be():
    from saturate.script.overrides import Overrides, from_changes

    assert from_changes({"num_workers": 4, "prefetch_factor": 2, "persistent_workers": True}, False, "cpu") == \
        Overrides(loader={"num_workers": 4, "prefetch_factor": 2, "persistent_workers": True})
    pinned = Overrides(loader={"pin_memory": True})
    assert from_changes({"pin_memory": True, "non_blocking": True}, True, "cuda") == pinned
    assert from_changes({"threads": 1}, True, "cpu") == Overrides(threads=1)
    assert from_changes({"precision": "bf16"}, False, "cuda") == Overrides(bf16_autocast="cuda")
    assert from_changes({"compile": "default"}, False, "cpu") == Overrides(compile="default")
    for changes, framework in (({"precision": "bf16"}, True), ({"compile": "default"}, True), ({}, False),
                               ({"micro_batch": 8, "grad_accum": 1}, False),
                               ({"num_workers": 2, "micro_batch": 8}, False)):
        assert from_changes(changes, framework, "cpu") is None, changes  # an edit, a Trainer's own knob, or nothing


# Each sample waits 2 ms (a slow decode): the script is input-bound at num_workers=0
SLOW_SAMPLES = """
import time, torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self): return 100000
    def __getitem__(self, i):
        time.sleep(0.002)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Slow(), batch_size=8, shuffle=True):
    nn.functional.mse_loss(model(x), y).backward(); opt.step(); opt.zero_grad()
"""


@pytest.mark.slow
def test_apply_measures_the_top_fix_it_can_set_against_the_script_as_written(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_SAMPLES)
    out = doctor("--apply", "--warmup", "1", "--steps", "4", "--no-trace", "--json", "--", sys.executable, "slow.py",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["verdict"] == "input-bound"
    a = d["applied"]
    assert a["fix"] == d["fixes"][0]["title"] and a["overrides"]["loader"]["num_workers"] >= 2
    assert a["paired"] and a["verdict"] == "faster" and a["kept"]
    assert a["measured_gain"] > 1.2 and a["predicted_gain"] > 1.2
    assert a["trial"]["same"]["same"] is not None  # checked against the script as written's samples
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.py"]


@pytest.mark.slow
def test_apply_says_a_faster_fix_that_changes_the_training_is_not_one_to_make(tmp_path):
    # the same slow samples as a stream no worker shards: 2 workers each replay it, so every sample trains twice
    (tmp_path / "stream.py").write_text(SLOW_SAMPLES.replace("DataLoader, Dataset", "DataLoader, IterableDataset")
                                        .replace("class Slow(Dataset):", "class Slow(IterableDataset):")
                                        .replace("    def __len__(self): return 100000\n", "")
                                        .replace("    def __getitem__(self, i):\n        time.sleep(0.002)\n",
                                                 "    def __iter__(self):\n      for i in range(100000):\n"
                                                 "        time.sleep(0.002)\n")
                                        .replace("        return torch.randn", "        yield torch.randn")
                                        .replace("DataLoader(Slow(), batch_size=8, shuffle=True)",
                                                 "DataLoader(Slow(), batch_size=8)"))
    out = doctor("--apply", "--warmup", "1", "--steps", "4", "--no-trace", "--", sys.executable, "stream.py",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "applied from outside: DataLoader num_workers 0 → 2" in text
    assert "not kept: it changes the training: samples repeated" in text and "get_worker_info()" in text


# torch looked up before it is imported (as `datasets` does), and loader workers that pass tensors: each worker then
# opens multiprocessing's `pymp-*` folder in the temporary folder, which nothing removes once the run is stopped
FIND_SPEC_WORKERS = """
import importlib.util
importlib.util.find_spec("torch")
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(50):
    for x, y in DataLoader(data, batch_size=8, num_workers=2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.slow
def test_doctor_hooks_a_script_that_looks_torch_up_first_and_leaves_nothing_in_the_temporary_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(FIND_SPEC_WORKERS)
    # a temporary folder of its own outside the script's (covered) one, with a short path, as /tmp has: a worker's
    # listener socket under pytest's long tmp_path would pass the 107-byte limit of a socket's path
    tmp = Path(tempfile.mkdtemp(prefix="sat-"))
    try:
        env = {**cli_env(), "TMPDIR": str(tmp)}
        out = subprocess.run(saturate_cmd("doctor", *FAST, "--json", "--", sys.executable, "train.py"), env=env,
                             cwd=work, capture_output=True, text=True, timeout=240)
        left = sorted(p.name for p in tmp.iterdir())
        traced = [p.name for p in tmp.glob("saturate-doctor-*/*")]  # the trace, by default in a folder of its own
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["script"]["optimizer"]["class"] == "SGD"
    assert not [name for name in left if name.startswith("pymp-")], left  # the workers' listener folders went too
    assert sorted(p.name for p in work.iterdir()) == ["train.py"]
    assert traced == ["trace.json"] and d["measurements"]["trace"]["trace"].startswith(str(tmp))
    assert not [name for name in left if not name.startswith(("saturate-doctor-", "torchinductor_"))], left


@pytest.mark.slow
def test_a_read_every_few_steps_is_counted_per_step_at_its_line(tmp_path):
    # minGPT logs loss.item() every tenth iteration: the counted steps fell between and it read 0 per step
    loop = GET_BATCH_LOOP.replace("    lossf = loss.item()  # the one read that would wait for a GPU; get_batch's "
                                  "index reads would not\n",
                                  "    if step % 4 == 0:\n        print(f'step {step}: loss {loss.item():.4f}')\n")
    assert loop != GET_BATCH_LOOP
    (tmp_path / "loop.py").write_text(loop)
    out = doctor("--warmup", "1", "--steps", "8", "--json", "--", sys.executable, "loop.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)["measurements"]
    site = line_of(tmp_path / "loop.py", "print(f'step")
    assert m["syncs_by_site"] == {site: 0.25} and m["syncs_seen"] == {site: [2, 8]}, m["syncs_by_site"]
    assert m["syncs_per_step"] == pytest.approx(0.25) and m["syncs_by_phase"].get("other") == pytest.approx(0.25)
