"""Guide 2's chat fine-tuning script, unchanged, launched with `accelerate launch` in two CPU processes:
`saturate doctor|tune|run -- accelerate launch …` instrument every rank, rank 0 reports, and the script's
own DataLoader call is named even though Accelerate's `prepare` made the loader that is iterated."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from conftest import line_of, run_saturate

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
    assert any("need the script's training code" in x for x in d["decisions"])  # no Trainer: not tried from outside
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
