"""Guide 2's chat fine-tuning script, unchanged, launched with `accelerate launch` in two CPU processes:
`saturate doctor|tune|run -- accelerate launch …` instrument every rank, rank 0 reports, and the script's
own DataLoader call is named even though Accelerate's `prepare` made the loader that is iterated."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, line_of, run_saturate
from saturate.script.run_script import full_run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "chat_sft" / "train_low_mem.py"
# two CPU processes: --multi_gpu starts them (torch's launcher), ACCELERATE_USE_CPU puts them on gloo
LAUNCH = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]
TOY = ["train", "--size", "toy", "--batch-size", "4", "--grad-accum", "2", "--max-length", "64",
       "--num-workers", "0", "--output-dir", "user-out"]


saturate = functools.partial(run_saturate, timeout=400, ACCELERATE_USE_CPU="1")


@pytest.mark.slow
def test_doctor_under_accelerate_launch_reports_rank_0_and_the_scripts_own_loader(tmp_path):
    out = saturate("doctor", "--warmup", "1", "--steps", "2", "--json", "--", *LAUNCH, str(SCRIPT), *TOY,
                   "--max-steps", "200", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    script = d["script"]
    assert script["world_size"] == 2 and d["measurements"]["steps"] == 2
    assert script["model"]["class"] == "LlamaForCausalLM"
    assert script["model"]["wrapped_in"] == ["DistributedDataParallel"]
    assert script["optimizer"]["class"] == "AdamW" and script["optimizer"]["site"].endswith(line_of(SCRIPT, "AdamW("))
    loader = script["loaders"][0]
    # the loader iterated is the one Accelerate's prepare() made inside its DataLoaderShard, over the same
    # dataset; the knob is set at the script's own call
    assert loader["site"].endswith(line_of(SCRIPT, "DataLoader("))
    assert loader["batch_size"] == 4 and loader["batches"] == 2 * 2  # 2 timed steps × accumulation 2
    assert d["measurements"]["samples_per_step"] == 8  # rank 0's: 4 × 2
    assert not (tmp_path / "user-out").exists()  # stopped before any save


@pytest.mark.slow
def test_tune_under_accelerate_launch(tmp_path):
    out = saturate("tune", "--trial-steps", "2", "--json", "--out", str(tmp_path / "t"), "--", *LAUNCH, str(SCRIPT),
                   *TOY, "--max-steps", "200", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    first = d["trials"][0]
    # two processes: every rank times the same fixed windows (3 of --trial-steps steps), so all stop together
    assert first["name"] == "as written" and first["windows"] == 3 and first["steps"] == 6
    assert d["loaders"][0]["site"].endswith(line_of(SCRIPT, "DataLoader("))
    assert any(x.startswith("loader") for x in d["decisions"])  # tried, or why not: said either way
    assert "compile: not tried (a command of 2 processes: a DDP-wrapped model is compiled with its own graph breaks, " \
           "untried here)" in d["decisions"]
    # its accumulation went into Accelerator(...) before the DataLoader was made: a split set in args cannot reach it
    assert any(x.startswith("micro-batch") for x in d["decisions"])
    assert json.loads((tmp_path / "t" / "overrides.json").read_text()) == d["overrides"]
    assert not (tmp_path / "user-out").exists()


@pytest.mark.slow
def test_run_under_accelerate_launch_applies_the_overrides_in_every_rank(tmp_path):
    (tmp_path / "over.json").write_text(json.dumps({"loader": {"num_workers": 1, "persistent_workers": True}}))
    out = saturate("run", "--overrides", "over.json", "--trial-steps", "2", "--json", "--", *LAUNCH, str(SCRIPT),
                   *TOY, "--max-steps", "14", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert len(d["as_written"]) == len(d["tuned"]) == 3 and len(d["ratios"]) == 3  # alternating rounds
    full = d["full_run"]
    assert full["returncode"] == 0 and full["optimizer_steps"] == 14
    assert full["loaders"][0]["num_workers"] == 1 and full["loaders"][0]["persistent_workers"] is True
    assert (tmp_path / "user-out" / "final").is_dir()  # the full run is the real one: it saves where it says
    assert (tmp_path / "user-out" / "states" / "step_14").is_dir()


# `saturate run`'s full run (script.run_script.full_run: the script with the overrides applied from outside), as the
# CLI makes it after its side-by-side rounds; a Ctrl-C reaches saturate, which stops the command's process group.
FULL_RUN = """
import json, sys
from saturate.script.run_script import full_run
full_run(json.loads(sys.argv[1]), json.loads(sys.argv[2]), quiet_stdout=True)
"""


def _complete_states(folder: Path) -> list[int]:
    """The steps of the script's saved states that both ranks finished writing."""
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*")
                  if all((p / f"random_states_{rank}.pkl").exists() for rank in (0, 1)))


@pytest.mark.slow
def test_an_interrupted_full_run_resumes_from_the_scripts_own_state_with_the_overrides(tmp_path, monkeypatch):
    over = {"loader": {"num_workers": 1, "persistent_workers": True}}
    last = 30  # room for a late Ctrl-C: under load the script ran from its first state (3) to 10 before it took
    command = [*LAUNCH, str(SCRIPT), *TOY, "--max-steps", str(last), "--save-every", "3"]
    env = {**cli_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    states = tmp_path / "user-out" / "states"
    first = subprocess.Popen([sys.executable, "-c", FULL_RUN, json.dumps(command), json.dumps(over)], cwd=tmp_path,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not _complete_states(states) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)  # Ctrl-C, once the script saved its first state
        first.wait(timeout=60)
    finally:
        first.kill()
    saved = _complete_states(states)
    assert saved and saved[-1] < last, f"the interruption came too late: states {saved}"
    assert not (tmp_path / "user-out" / "final").exists()  # interrupted before its end

    # the same command again, continuing: the script's own resume, saturate's overrides applied again
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    resumed = full_run([*command, "--is_keep_training=True"], over)
    assert resumed.returncode == 0, resumed.tail
    summary = resumed.summary
    assert summary["optimizer_steps"] == last - saved[-1]  # from its latest state to --max-steps, not from 0
    assert summary["loaders"][0]["num_workers"] == 1 and summary["loaders"][0]["persistent_workers"] is True
    assert (states / f"step_{last}").is_dir() and (tmp_path / "user-out" / "final").is_dir()
