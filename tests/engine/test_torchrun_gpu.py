"""The NCCL path: FSDP with CPU offload on one GPU, DDP on two (skipped where the GPUs are missing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import cli_env, make_small_corpus, saturate_cmd
from saturate.engine.metrics import read_jsonl
from saturate.plan import Plan

pytestmark = [pytest.mark.gpu, pytest.mark.dist]


def _train(cmd: list[str], shared: Path) -> subprocess.CompletedProcess:
    env = {**cli_env(), "SATURATE_CACHE": str(shared / "cache")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _args(corpus: Path, plan: Path, run_dir: Path) -> list[str]:
    return ["train", "--device", "cuda", "--data", str(corpus), "--plan", str(plan), "--steps", "6",
            "--log-every", "1", "--eval-every", "6", "--run-dir", str(run_dir)]


def _losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_fsdp_with_cpu_offload_on_one_gpu_matches_single(tmp_path):
    corpus = make_small_corpus(tmp_path)
    single, fsdp = tmp_path / "single.toml", tmp_path / "fsdp.toml"
    Plan(micro_batch=8, grad_accum=2, precision="bf16").save(single)
    Plan(micro_batch=8, grad_accum=2, precision="bf16", strategy="fsdp", cpu_offload=True).save(fsdp)
    _train(saturate_cmd(*_args(corpus, single, tmp_path / "a")), tmp_path)
    _train(saturate_cmd(*_args(corpus, fsdp, tmp_path / "b")), tmp_path)
    # bf16 compute either way; FSDP also gathers bf16 parameters: a looser tolerance than on the CPU.
    assert _losses(tmp_path / "b") == pytest.approx(_losses(tmp_path / "a"), rel=2e-2)
    assert (tmp_path / "b" / "checkpoints" / "ckpt-00000006" / ".metadata").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_on_two_gpus_matches_one(tmp_path):
    corpus = make_small_corpus(tmp_path)
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    Plan(micro_batch=8, grad_accum=2, precision="bf16").save(one)
    Plan(micro_batch=8, grad_accum=1, precision="bf16", strategy="ddp").save(two)
    _train(saturate_cmd(*_args(corpus, one, tmp_path / "a")), tmp_path)
    _train([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "saturate",
            *_args(corpus, two, tmp_path / "b")], tmp_path)
    assert _losses(tmp_path / "b") == pytest.approx(_losses(tmp_path / "a"), rel=2e-2)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
