"""The command line end to end, as a user runs it: `saturate.cli.main`, what `python -m saturate` runs, in this
process with its own working folder, cache and streams (a torch import less per command), and `python -m saturate`
itself in a subprocess for the shared training run and the --debug traceback.

Bad input must end in one line on stderr that names the problem, a non-zero exit, no traceback
and no half-written file; the success paths must leave the files a run promises.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env
from saturate.data.shards import open_shard, write_shard
from saturate.engine.checkpoint import load_checkpoint
from saturate.errors import DataError
from saturate.plan import Plan
from saturate.workloads import PRESETS
from saturate.workloads.gpt import GPT, GPTConfig

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60


def _env(cache: Path) -> dict[str, str]:
    env = {**cli_env(), "SATURATE_CACHE": str(cache)}
    env.pop("XDG_CACHE_HOME", None)
    return env


def _saturate(*args: str, cwd: Path, cache: Path, timeout: float = 120,
              subprocess_: bool = False) -> subprocess.CompletedProcess:
    """`saturate ARGS` in `cwd` with its own token cache: main() here, or `python -m saturate` with `subprocess_`."""
    if subprocess_:
        return subprocess.run([sys.executable, "-m", "saturate", *args], cwd=cwd, env=_env(cache),
                              capture_output=True, text=True, timeout=timeout)
    from saturate.cli import main

    out, err, here, saved = io.StringIO(), io.StringIO(), Path.cwd(), dict(os.environ)
    os.environ["SATURATE_CACHE"] = str(cache)
    os.environ.pop("XDG_CACHE_HOME", None)
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["saturate", *args], code, out.getvalue(), err.getvalue())


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """A private working folder with a small corpus; its own token cache."""
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text(TEXT)
    return tmp_path


def _fails(work: Path, *args: str, keywords: tuple[str, ...]) -> str:
    """Run saturate expecting a clean failure; returns its one stderr line."""
    before = _files(work)
    proc = _saturate(*args, cwd=work, cache=work / "cache")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("saturate: error: "), lines[0]
    for word in keywords:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    new = _files(work) - before
    # Nothing half-written: no temporaries anywhere, no checkpoint or run output. (Complete token
    # shards in the cache are fine: the data may be prepared before the error is found.)
    assert not [f for f in new if ".tmp" in f], new
    outputs = (".pt", ".toml", ".safetensors", ".jsonl", ".json")
    assert not [f for f in new if not f.startswith("cache/") and f.endswith(outputs)], new
    assert not (work / "runs").exists()
    return lines[0]


def _shards(work: Path) -> list[Path]:
    return sorted((work / "cache").rglob("*.bin")) if (work / "cache").exists() else []


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One real two-step run, shared: its cache, checkpoint and outputs are read by several tests."""
    root = tmp_path_factory.mktemp("trained")
    (root / "small.txt").write_text(TEXT)
    proc = _saturate("train", "--steps", "2", "--data", "small.txt", "--run-dir", "r", "--no-progress",
                     "--log-every", "1", cwd=root, cache=root / "cache", subprocess_=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return root


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_preset(work):
    _fails(work, "train", "--preset", "gpt-enormous", "--data", "small.txt",
           keywords=("gpt-enormous", "preset"))


def test_unknown_preset_with_debug_shows_the_traceback(work):
    proc = _saturate("--debug", "train", "--preset", "gpt-enormous", "--data", "small.txt",
                     cwd=work, cache=work / "cache", subprocess_=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "ConfigError" in proc.stderr and "gpt-enormous" in proc.stderr


def test_data_path_that_does_not_exist(work):
    _fails(work, "train", "--data", "no/such/corpus.txt", keywords=("no/such/corpus.txt", "does not exist"))


def test_empty_corpus(work):
    (work / "data").mkdir()
    (work / "data" / "empty.txt").write_text("")
    _fails(work, "train", "--data", "data", "--steps", "1", keywords=("empty",))
    assert _shards(work) == []


def test_corpus_shorter_than_one_sequence(work):
    (work / "tiny.txt").write_text("hello")
    _fails(work, "train", "--data", "tiny.txt", "--steps", "1", keywords=("5 tokens", "seq_len"))
    assert _shards(work) == []


@pytest.mark.parametrize(
    ("text", "keywords"),
    [
        ("micro_batch = 4\nmicro_bach = 8\n", ("micro_bach", "plan.toml")),
        ('micro_batch = "8"\n', ("plan.micro_batch", "str")),
        ("grad_accum = 0\n", ("plan.grad_accum", ">= 1")),
        ("micro_batch = 4\ngrad_accum = 2\nmicro_batch = 8\n",
         ("plan.toml is not valid TOML: key 'micro_batch' is given twice (again on line 3)",)),
    ],
    ids=["unknown-key", "wrong-type", "out-of-range", "duplicate-key"],
)
def test_bad_plan_file(work, text, keywords):
    (work / "plan.toml").write_text(text)
    _fails(work, "train", "--plan", "plan.toml", "--data", "small.txt", "--steps", "1", keywords=keywords)
    assert (work / "plan.toml").read_text() == text  # the user's file is untouched


def test_plan_tuned_for_another_workload(work):
    text = 'name = "tuned"\nmicro_batch = 8\n\n[provenance]\nworkload = "ts-lstm"\nhardware = "0123456789abcdef"\n'
    (work / "plan.toml").write_text(text)
    _fails(work, "train", "--plan", "plan.toml", "--data", "small.txt", "--steps", "1",
           keywords=("tuned for ts-lstm, not gpt-tiny", "[provenance]"))
    assert (work / "plan.toml").read_text() == text


def test_plan_that_is_neither_file_nor_name(work):
    _fails(work, "train", "--plan", "nonsense", "--data", "small.txt",
           keywords=("'nonsense'", "reference plan"))



def test_unwritable_run_folder(work):
    (work / "blocker").write_text("a regular file, not a folder")
    line = _fails(work, "train", "--data", "small.txt", "--steps", "1", "--run-dir", "blocker/run",
                  keywords=("blocker/run", "not writable"))
    assert "Not a directory" in line
    assert (work / "blocker").read_text() == "a regular file, not a folder"


@pytest.mark.parametrize("verb, flag, what", [
    (("train",), "--run-dir", "run folder"),
    (("train", "--resume"), "--run-dir", "run folder"),  # not "--resume: run folder afile does not exist"
    (("run",), "--run-dir", "run folder"),
    (("tune",), "--out", "output folder"),  # before the search, not after it
])
def test_run_folder_that_is_a_file(work, verb, flag, what):
    (work / "afile").write_text("a regular file, not a folder")
    _fails(work, *verb, flag, "afile", "--data", "small.txt", "--steps", "1",
           keywords=(f"{what} afile is a file, not a folder; choose another {flag}",))
    assert (work / "afile").read_text() == "a regular file, not a folder"


def test_resume_with_no_checkpoint(work):
    (work / "r").mkdir()
    _fails(work, "train", "--data", "small.txt", "--steps", "1", "--run-dir", "r", "--resume",
           keywords=("--resume", "no loadable checkpoint"))
    assert _files(work / "r") == set()


def test_resume_with_no_run_folder(work):
    _fails(work, "train", "--data", "small.txt", "--steps", "1", "--run-dir", "gone", "--resume",
           keywords=("gone", "does not exist"))
    assert not (work / "gone").exists()


def test_resume_without_any_run(work):
    _fails(work, "train", "--data", "small.txt", "--steps", "1", "--resume",
           keywords=("--resume", "gpt-tiny"))


@pytest.mark.slow
def test_run_folder_with_checkpoints_needs_resume(work, trained):
    ckpt = trained / "r" / "checkpoints" / "ckpt-00000002.pt"
    (work / "old" / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt, work / "old" / "checkpoints")
    _fails(work, "train", "--data", "small.txt", "--steps", "3", "--run-dir", "old",
           keywords=("old", "already holds checkpoints", "--resume"))
    # The existing run is left exactly as it was.
    assert _files(work / "old") == {"checkpoints/ckpt-00000002.pt"}
    assert (work / "old" / "checkpoints" / "ckpt-00000002.pt").read_bytes() == ckpt.read_bytes()


def test_zero_steps(work):
    _fails(work, "train", "--steps", "0", "--data", "small.txt", keywords=("steps", "got 0"))


def test_bpe_vocabulary_too_small(work):
    _fails(work, "train", "--tokenizer", "bpe:5", "--data", "small.txt", "--steps", "1", keywords=("bpe:5",))
    assert _shards(work) == [] and not list(work.rglob("tokenizer.json"))


# --- the token cache -------------------------------------------------------------------------------


def test_truncated_cached_shard_is_rebuilt_and_training_succeeds(work, trained):
    # The shared run prepared the cache for the same small.txt; damage a private copy of it.
    shutil.copytree(trained / "cache", work / "cache")
    (train_bin,) = (work / "cache" / "tokens").glob("*/train.bin")
    whole = open_shard(train_bin)
    n_tokens, build_id, size = len(whole), whole.meta["build_id"], train_bin.stat().st_size
    del whole
    with open(train_bin, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(DataError, match="truncated"):
        open_shard(train_bin)

    # The naive plan (8 samples a step) keeps the training part short; the data path is the same.
    proc = _saturate("train", "--steps", "1", "--plan", "naive", "--data", "small.txt", "--run-dir", "r2",
                     "--no-progress", cwd=work, cache=work / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rebuilt = open_shard(train_bin)  # whole again, from a new build of the same text
    assert len(rebuilt) == n_tokens and train_bin.stat().st_size == size
    assert rebuilt.meta["build_id"] != build_id
    assert (work / "r2" / "checkpoints" / "ckpt-00000001.pt").is_file()
    assert not [p for p in (work / "cache").rglob("*") if p.name.endswith(".tmp")]


def test_foreign_token_shard_given_as_data(work):
    shards = work / "shards"
    shards.mkdir()
    (shards / "train.bin").write_bytes(bytes(range(256)) * 40)  # raw tokens with no header
    (shards / "val.bin").write_bytes(bytes(range(256)) * 4)
    _fails(work, "train", "--data", "shards", "--steps", "1", keywords=("train.bin", "not a saturate token shard"))


def test_other_file_errors_are_one_line(work):
    (work / "r" / "metrics.jsonl").mkdir(parents=True)  # a folder where the metrics file goes
    _fails(work, "train", "--data", "small.txt", "--steps", "1", "--run-dir", "r",
           keywords=("Is a directory", "metrics.jsonl"))


def test_open_shard_rejects_a_foreign_file(work):
    foreign = work / "foreign.bin"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(DataError, match="not a saturate token shard") as err:
        open_shard(foreign)
    assert "foreign.bin" in str(err.value)
    (work / "short.bin").write_bytes(b"SAT")
    with pytest.raises(DataError, match="not a saturate token shard"):
        open_shard(work / "short.bin")


def test_open_shard_rejects_trailing_bytes(work):
    path = work / "shard.bin"
    write_shard(path, torch.arange(10).numpy(), {"vocab_size": 257, "tokenizer": "byte", "source_hash": "x"})
    assert open_shard(path).tokens.tolist() == list(range(10))
    with open(path, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match="corrupt"):
        open_shard(path)


# --- success paths ---------------------------------------------------------------------------------


def test_probe_json(work):
    proc = _saturate("probe", "--json", "--no-peaks", cwd=work, cache=work / "cache")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    accelerated = torch.cuda.is_available() or torch.backends.mps.is_available()
    if accelerated:
        assert info["device_type"] in ("cuda", "rocm", "mps")
    else:
        assert info["device_type"] == "cpu"
    assert _files(work) == {"small.txt"}  # probing writes nothing


def test_train_writes_every_promised_file(trained):
    run = trained / "r"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == [1, 2]  # --log-every 1
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in train_records)
    assert all("throughput/tokens_per_s" in r and r["throughput/tokens_per_s"] > 0 for r in train_records)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == summary["total_steps"] == 2
    assert summary["stopped_early"] is False
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])

    plan = Plan.load(run / "plan.toml")
    assert plan.samples_per_step() == 32  # the default plan keeps gpt-tiny's effective batch
    assert plan == Plan.from_dict(summary["plan"])

    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000002.pt", "ckpt-00000002.pt.sha256"]
    state = load_checkpoint(run / "checkpoints" / "ckpt-00000002.pt")
    assert state["step"] == 2

    # The exported weights load strictly into a fresh gpt-tiny (the tied head included) and are
    # the checkpoint's final weights, which moved away from the initialisation.
    from safetensors.torch import load_model

    p = PRESETS["gpt-tiny"]
    model = GPT(GPTConfig(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, seq_len=p.seq_len))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    load_model(model, str(run / "model.safetensors"))
    assert model.lm_head.weight is model.wte.weight
    exported = model.state_dict()
    assert exported.keys() == state["model"].keys()
    for name, tensor in state["model"].items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(exported["wte.weight"], initial["wte.weight"])
    assert not [p for p in trained.rglob("*") if ".tmp" in p.name]
    assert not (trained / "runs").exists()  # --run-dir was honoured
