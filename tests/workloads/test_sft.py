"""Chat fine-tuning: records, template and response mask, packing, isolation of packed sequences, exact resume."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import cli_env, saturate_cmd
from saturate.data.chat import IGNORE, ChatFormat, pack, parse_record
from saturate.data.tokenizer import ByteTokenizer
from saturate.engine.metrics import read_jsonl
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError, DataError
from saturate.hardware import probe
from saturate.plan import Plan
from saturate.workloads.gpt import GPT, GPTConfig
from saturate.workloads.sft import SFTLoss, gpt_forward, preset_sft_workload

SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 64, "effective_batch": 4, "warmup_steps": 2}


def write_chats(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            if i % 2:
                f.write(json.dumps({"prompt": f"{a}+{b}?", "response": f"{a + b}"}) + "\n")
            else:
                f.write(json.dumps({"messages": [{"role": "user", "content": f"add {a} and {b}"},
                                                 {"role": "assistant", "content": f"{a + b}."}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def cpu():
    return probe(measure_peaks=False, device="cpu")


def test_records_in_every_accepted_shape():
    assert parse_record('{"prompt": "hi", "response": "hello", "system": "be nice"}', "f:1") == [
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]
    share_gpt = '{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}'
    assert parse_record(share_gpt, "f:1") == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert parse_record('{"prompt": "q", "completion": "a"}', "f:1")[-1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q"', "chats.jsonl:7: invalid JSON"),
    ('["q", "a"]', "chats.jsonl:7: expected a JSON object, got list"),
    ('{"question": "q", "answer": "a"}', "a record needs 'messages' (a list of {role, content}) or 'prompt' and "
                                         "'response'; it has: answer, question"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message with content"),
    ('{"messages": [{"role": "wizard", "content": "q"}]}', "message 1 has role 'wizard'"),
    ('{"messages": [{"role": "user", "text": "q"}]}', "message 1 needs string 'role' and 'content'"),
    ('{"prompt": "q", "response": 42}', "'response' must be a string"),
])
def test_a_bad_record_is_one_line_naming_file_and_line(line, message):
    with pytest.raises(DataError) as e:
        parse_record(line, "chats.jsonl:7")
    assert message in str(e.value) and str(e.value).startswith("chats.jsonl:7") and "\n" not in str(e.value)


def test_builtin_template_marks_only_the_responses():
    tok = ByteTokenizer()
    ids, mask = ChatFormat(tok).encode([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "R"},
                                        {"role": "assistant", "content": "A2"}])
    targets = ids[mask]
    assert tok.decode(targets[targets != tok.eot_id]) == "A1A2"
    assert (targets == tok.eot_id).sum() == 2  # each response ends with end-of-text, and it is learned
    assert tok.decode(ids).startswith("<|system|>\nS\n<|user|>\nQ\n<|assistant|>\nA1")


def test_packing_keeps_conversations_whole_in_full_rows():
    rng = np.random.default_rng(0)
    encoded = []
    for _ in range(40):
        n = int(rng.integers(4, 30))
        encoded.append((np.arange(n) + 1, np.arange(n) >= n // 2))
    encoded.append((np.arange(80), np.ones(80, bool)))  # longer than a row: truncated
    encoded.append((np.arange(5), np.zeros(5, bool)))  # no response: dropped
    packed = pack(encoded, 32, pad_id=0)
    rows = packed.rows
    assert rows.shape[1:] == (3, 32) and packed.truncated == 1 and packed.dropped == 1
    lengths = sorted(len(ids) - 1 for ids, _ in encoded[:40])
    packed_lengths = []
    for r in rows:
        pos = r[2]
        bounds = [*np.flatnonzero(pos == 0), 32]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if (r[1, a:b] != IGNORE).any():
                packed_lengths.append(b - a)
    assert sorted(packed_lengths) == sorted([*lengths, 32])  # every conversation once, whole; plus the truncated one
    assert packed.real_tokens / (len(rows) * 32) > 0.8  # nearly full rows
    again = pack(encoded, 32, pad_id=0)
    assert np.array_equal(again.rows, rows)  # deterministic


def test_a_packed_row_trains_as_its_conversations_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=50)).eval()
    a, b = torch.randint(0, 50, (1, 12)), torch.randint(0, 50, (1, 9))
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(12), torch.arange(9)])[None]
    with torch.no_grad():
        packed = model(row, position_ids=pos)
        alone_a, alone_b = model(a), model(b)
    assert torch.allclose(packed[0, :12], alone_a[0], atol=1e-5)
    assert torch.allclose(packed[0, 12:], alone_b[0], atol=1e-5)  # b does not see a


def test_the_loss_is_the_same_for_any_split_of_the_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16, vocab_size=40))
    labels = torch.randint(0, 40, (8, 16))
    labels[torch.rand(8, 16) < torch.linspace(0.1, 0.9, 8)[:, None]] = IGNORE  # rows with few and many targets
    batch = {"input_ids": torch.randint(0, 40, (8, 16)), "labels": labels,
             "position_ids": torch.arange(16).repeat(8, 1)}
    loss = SFTLoss(gpt_forward)
    whole = loss(model, batch)
    halves = [loss(model, {k: v[s] for k, v in batch.items()}) for s in (slice(0, 4), slice(4, 8))]
    quarters = [loss(model, {k: v[i:i + 2] for k, v in batch.items()}) for i in range(0, 8, 2)]
    assert torch.allclose(whole, sum(halves) / 2) and torch.allclose(whole, sum(quarters) / 4)


def test_sft_resumes_exactly_after_a_crash(tmp_path, cpu):
    chats = write_chats(tmp_path / "chats.jsonl", 30)
    workload = preset_sft_workload("gpt-tiny", data=[str(chats)], **{**SMALL, "seq_len": 128}, steps=8)
    assert len(workload.train_data.dataset) < 8 * 4 / 2  # the 8 steps of 4 rows cross epochs of packed rows
    plan = Plan(micro_batch=2, grad_accum=2)

    def config(run_dir: Path, **kw) -> RunConfig:
        return RunConfig(run_dir=run_dir, steps=8, ckpt_every=3, eval_every=4, log_every=1, progress=False,
                         tensorboard=False, **kw)

    reference = train(workload, plan, config(tmp_path / "reference"), hardware=cpu)

    real_loss, calls = workload.loss_fn, {"n": 0}

    def crashing(model, batch):
        calls["n"] += 1
        if calls["n"] > 5 * plan.grad_accum:  # during step 6, after the checkpoint of step 3
            raise RuntimeError("simulated crash")
        return real_loss(model, batch)

    workload.loss_fn = crashing
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(workload, plan, config(tmp_path / "crashed"), hardware=cpu)
    workload.loss_fn = real_loss
    resumed = train(workload, None, config(tmp_path / "crashed", resume=True), hardware=cpu)
    assert resumed.steps == 8

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r.get("train/loss", r.get("val/loss")) for r in read_jsonl(run / "metrics.jsonl")
                if "train/loss" in r or "val/loss" in r}

    got, want = losses(tmp_path / "crashed"), losses(tmp_path / "reference")
    assert got == want and sorted({r["step"] for r in read_jsonl(tmp_path / "crashed" / "metrics.jsonl")}) == \
        list(range(1, 9))
    assert reference.val_loss == resumed.val_loss
    a = load_file(tmp_path / "crashed" / "model.safetensors")
    b = load_file(tmp_path / "reference" / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
def test_cli_sft_trains_and_refuses_a_bad_record(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", 40)
    args = ["train", "--task", "sft", "--data", str(chats), *[f"--param={k}={v}" for k, v in SMALL.items()],
            "--steps", "3", "--no-progress"]
    ok = subprocess.run(saturate_cmd(*args, "--run-dir", "r"), cwd=tmp_path, env=cli_env(), capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    info = json.loads((tmp_path / "r" / "run.json").read_text())["info"]
    assert info["task"] == "sft" and info["conversations"] == 40 and "filled" in info["rows"]
    with open(chats, "a") as f:
        f.write('{"prompt": "no answer"}\n')
    bad = subprocess.run(saturate_cmd(*args, "--run-dir", "r2"), cwd=tmp_path, env=cli_env(), capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith(f"saturate: error: {chats}:41: a record needs 'messages'")
    assert not (tmp_path / "r2").exists()


def test_sft_refusals():
    with pytest.raises(ConfigError, match="--task sft needs --data"):
        preset_sft_workload("gpt-tiny", data=None)
    with pytest.raises(ConfigError, match="ts-lstm is not one"):
        preset_sft_workload("ts-lstm", data=["x.jsonl"])
    with pytest.raises(DataError, match="reads .jsonl conversations"):
        preset_sft_workload("gpt-tiny", data=[__file__])
